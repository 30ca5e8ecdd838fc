"""A layout's time per step, modelled from the :class:`~autodist.planner.profile.Profile`: the forward and
backward measured at two batch sizes and extended to the layout's rows (``mp=K`` divides the split layers'
share of the work; checkpointing adds what it was measured to add), the optimizer step on the bytes this
rank updates, and the collectives at the measured latency and ring bandwidth of the world's all-reduce:
the gradient all-reduce (``shard="gradients"``: a reduce-scatter, its time measured against the all-reduce's,
and the gather of the updated parameters), the gather of updated parameters under ``shard="optimizer"``, the
reduce-scatter and the blocks gathered for forward and backward under ``shard="parameters"``, the model-parallel
all-reduces of activations, and under ``ep`` the experts' sum over their replicas (out of the buckets) and each
layer's exchange of the tokens (7 all-to-alls a step, the bytes the busiest rank sends). With ``pp`` stages the
slowest stage's share of the work, stretched by the pipeline's bubble (smaller with more micro-batches), and a
send between stages per step of the schedule (more with more). Communication is added to compute, not
overlapped: on a machine whose cores both compute and move the data that is the closer guess, and the finalists
are measured anyway.

Example:
    >>> seconds(Layout(dp=2, mp=1, shard=None), profile, rows=16, states=2)
"""
from __future__ import annotations

from autodist.planner.context import flat
from autodist.planner.experts import EXCHANGES
from autodist.planner.plan import Layout
from autodist.planner.profile import Profile
from autodist.planner.stages import pieces, stages_of, stretch


def _ring(nbytes: float, ranks: int, profile: Profile, calls: int = 1) -> float:
    """An all-reduce of ``nbytes`` over ``ranks`` ranks in ``calls`` calls."""
    if ranks < 2:
        return 0.0
    return calls * profile.latency + 2 * (ranks - 1) / ranks * nbytes / profile.bandwidth


def seconds(layout: Layout, profile: Profile, rows: float, bucket_mb: float = 25.0,
            microbatches: int | None = None) -> float:
    """Modelled seconds of one training step of ``layout``, ``rows`` rows a rank; ``microbatches``: with
    ``pp``, the micro-batches a step (None: ``parallelize``'s default). With ``cp``, the data-parallel layout over
    ``dp x cp`` ranks at ``rows / cp`` rows, plus attention's exchange: an all-gather forward and an all-reduce
    backward per call, their bytes read from the model's calls (:mod:`~autodist.planner.context`; under ``mp``
    each rank exchanges its heads)."""
    if layout.cp > 1:
        context = profile.contexts[layout.cp]
        exchange = 2 * context.calls * profile.latency + context.sent_per_row * rows / layout.mp / profile.bandwidth
        if layout.pp > 1:  # each stage its own calls, each micro-batch's apart: the slowest stage's, stretched
            m = pieces(layout.pp, rows / layout.cp, microbatches)
            exchange = profile.attention_share(layout.pp) * (exchange + 2 * context.calls * profile.latency * (m - 1))
            exchange *= stretch(layout.pp, rows / layout.cp, microbatches)
        return seconds(flat(layout), profile, rows / layout.cp, bucket_mb, microbatches) + exchange
    dp, mp = layout.dp, layout.mp
    split = profile.splits[mp] if mp > 1 else None
    work = 1.0 if split is None else (1 - split.split_fraction) + split.split_fraction / mp
    compute = (profile.forward(rows) + profile.backward(rows)) * work
    if layout.checkpoint:
        compute += profile.recompute(rows) * work
    params, trainable, own = profile.per_rank(layout)
    comm_p2p = 0.0
    if layout.pp > 1 and profile.block_measures is not None:
        stages = stages_of(profile.block_measures, layout.pp)
        measures = profile.block_measures
        total = sum(measures.seconds) + measures.head
        slowest = max(stages, key=lambda s: s.seconds_per_row)
        compute *= (slowest.seconds_per_row / total if total else 1.0 / layout.pp) * \
            stretch(layout.pp, rows, microbatches)
        fullest = max(profile.stage_fraction(s) for s in stages)
        params, trainable, own = params * fullest, trainable * fullest, own * fullest
        # a hop between stages per step of the schedule (m + pp - 1 of them), forward and back: a micro-batch's
        # activations, or their gradients
        m = pieces(layout.pp, rows, microbatches)
        received = max(s.received_per_row for s in stages)
        comm_p2p = 2 * (m + layout.pp - 1) * (profile.send_latency + received * rows / m / profile.bandwidth)
    step = profile.step_per_byte * own
    placed, placed_trainable = profile.experts_here(layout)  # a rank's experts under ep: summed over their replicas
    params, trainable = params - placed, trainable - placed_trainable
    buckets = max(1, int(trainable // (bucket_mb * 2 ** 20)) + 1)
    summed = trainable * profile.widened  # gradients travel in the dtype they are summed in (float32 for bf16)
    comm = _ring(summed, dp, profile, buckets)  # the all-reduce
    scatter = profile.scatter_share  # a reduce-scatter's share of the all-reduce's time (a ring's half; gloo's all)
    if layout.shard == "gradients" and dp > 1:
        comm = scatter * _ring(summed, dp, profile, buckets) + _ring(trainable, dp, profile, buckets) / 2
    if layout.shard == "optimizer" and dp > 1:
        comm += _ring(trainable, dp, profile, buckets) / 2  # the updated parameters gathered
    if layout.shard == "parameters" and dp > 1:  # a reduce-scatter, and every block gathered for forward and backward
        gathers = 2 * max(1, len(profile.blocks))
        comm = scatter * _ring(summed, dp, profile, buckets) + _ring(params, dp, profile, gathers)
    if split is not None:
        comm += _ring(split.sent_per_row * rows, mp, profile, split.collectives)
    if layout.ep > 1:  # the experts' replicas summed, and each layer's exchange of the tokens (all-to-alls)
        comm += _ring(placed_trainable * profile.widened, dp // layout.ep, profile)
        forward, backward = profile.experts.sent.get(layout.ep, (0.0, 0.0))
        comm += profile.experts.layers * EXCHANGES * profile.latency + (forward + backward) * rows / profile.bandwidth
    return compute + step + comm + comm_p2p
