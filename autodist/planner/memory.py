"""A layout's memory per rank, by kind (the kinds ``autodist.memory`` counts, plus activations), and its peak,
from the :class:`~autodist.planner.profile.Profile`.

Parameters, gradients and the optimizer's state follow from the layout: ``mp=K`` keeps what the model-parallel
plan leaves on a rank, ``shard=`` divides the optimizer state (``"optimizer"``), the gradients too
(``"gradients"``) and the parameters too (``"parameters"``, plus the blocks gathered for use) over the
data-parallel ranks. autodist's buffers (shared memory included) are the gradient buckets (as large as the
gradients) without sharding, two ring buffers of :func:`~autodist.sharded.scatter.ring_bytes` with it, and
the model-parallel all-reduce's slots. Activations are measured: the peak of one forward/backward at two
batch sizes, with and without the blocks checkpointed, extended to this layout's rows; ``mp=K`` divides what
autograd keeps in the region it splits (:class:`~autodist.planner.profile.Profile`); with checkpointing the
blocks' inputs, which it keeps, stay whole, and the rest (a block recomputed) is divided in that proportion.
With ``pp`` stages each stage's share is predicted (:mod:`~autodist.planner.stages`: every micro-batch's
activations in flight under GPipe, at most ``pp - s`` under 1F1B) and the fullest stage's is the layout's. Under
``ep`` a rank holds ``1/ep`` of the experts, out of the buckets and never sharded, and its activations are measured
with its experts computed as placed (:mod:`~autodist.planner.experts`). The peak is the larger of the
forward/backward's (the state at rest, less whole gradients, which ``zero_grad()`` frees, plus the activations'
peak) and the optimizer step's (the state at rest plus the step's temporaries).

Example:
    >>> kinds, peak = predict(Layout(dp=2, mp=1, shard="optimizer"), profile, rows=32, states=2)
"""
from __future__ import annotations

from torch import nn

from autodist.dp.buckets import MB
from autodist.layers.shared_reduce import SMALLEST_BYTES, held_bytes
from autodist.planner.context import flat
from autodist.planner.plan import Layout
from autodist.planner.profile import Profile, nbytes, summed_nbytes
from autodist.planner.stages import Stage, in_flight, pieces, stages_of
from autodist.runtime.mesh import ParallelDims, built_groups
from autodist.sharded.scatter import RING, ring_bytes


def activations(layout: Layout, profile: Profile, rows: float, kept: bool = False) -> float:
    """Bytes a forward/backward of ``rows`` rows makes at its peak on one rank of ``layout``; ``kept``: with the
    gradients it makes kept to its end (whole gradients), else dropped as they come (sharded ones)."""
    one, one_kept, recomputing, recomputing_kept = profile.peaks(layout.ep)  # ep: a rank's experts as placed
    whole = one(rows)
    peak = recomputing(rows) if layout.checkpoint else whole
    grads = 0.0
    if kept:
        grads = (recomputing_kept(rows) if layout.checkpoint else one_kept(rows)) - peak
    if layout.mp > 1:  # what mp splits (not the blocks' inputs checkpointing keeps); its share of the gradients
        kept_whole = min(peak, profile.block_inputs(rows)) if layout.checkpoint else 0.0
        if whole > 0:
            peak = kept_whole + (peak - kept_whole) * (1 - profile.split_kept[layout.mp](rows) * (1 - 1 / layout.mp)
                                                       / whole)
        grads *= profile.splits[layout.mp].param_bytes / profile.param_bytes if profile.param_bytes else 1.0
    if layout.ep > 1:  # the tokens' exchange, its buffers forward and backward
        if layout.ep not in profile.placed:  # experts held as modules: measured as one process, all of them
            grads *= profile.per_rank(layout)[1] / profile.trainable_bytes if profile.trainable_bytes else 1.0
        peak += sum(profile.experts.sent.get(layout.ep, (0.0, 0.0))) * rows
    return max(peak + grads, 0.0)


def existing_mp_buffers(world_size: int, mp: int, pp: int = 1) -> float:
    """Bytes this rank already holds for the shared-memory all-reduce of the model-parallel group a layout with
    ``mp`` (and ``pp``) would use (made by an earlier model or layer on that group; the slots never shrink); 0
    for none."""
    groups = built_groups(ParallelDims.for_world(world_size, mp, pp))
    if groups is None and mp != world_size:
        return 0.0  # its groups are made by the first parallelize of that layout, with fresh slots
    return held_bytes(None if groups is None else groups.mp)  # None: the whole world's


def predict(layout: Layout, profile: Profile, rows: float, states: int, bucket_mb: float = 25.0,
            mp_buffers: float = 0.0, microbatches: int | None = None,
            one_f_one_b: bool = False) -> tuple[dict[str, float], float]:
    """Bytes per rank by kind, and the step's peak, for ``layout`` with ``rows`` rows a rank per step;
    ``mp_buffers``: what its model-parallel group's all-reduce already holds (:func:`existing_mp_buffers`).
    With ``pp`` stages, the fullest stage's (``microbatches`` a step: None, ``parallelize``'s default;
    ``one_f_one_b``: its schedule, else GPipe's). With ``cp``,
    a rank holds ``1/cp`` of each row's tokens and keeps the whole sequence's keys and values its attention
    gathered: the data-parallel layout over ``dp x cp`` ranks at ``rows / cp`` rows, plus the gathered part of them,
    and at the peak what one attention call holds for a moment in backward (:mod:`~autodist.planner.context`); with
    ``pp`` too, the fullest stage's share of the attention calls (its blocks'), GPipe's micro-batches all kept."""
    if layout.cp > 1:
        kinds, peak = predict(flat(layout), profile, rows / layout.cp, states, bucket_mb, mp_buffers, microbatches)
        context = profile.contexts[layout.cp]
        # with pp, the fullest stage's share of the attention calls, and a call holds one micro-batch's for a moment
        share, one = profile.attention_share(layout.pp), pieces(layout.pp, rows / layout.cp, microbatches)
        gathered = context.kept_per_row * rows * (1 - 1 / layout.cp) / layout.mp * share
        moment = context.transient_per_row * rows / layout.mp / (one if layout.pp > 1 else 1)
        return {**kinds, "activations": kinds["activations"] + gathered}, peak + gathered + moment
    if layout.pp == 1 or profile.block_measures is None:
        return _predict(layout, profile, rows, states, bucket_mb, mp_buffers, None)
    each = [_predict(layout, profile, rows, states, bucket_mb, mp_buffers, stage, microbatches, one_f_one_b)
            for stage in stages_of(profile.block_measures, layout.pp)]
    return max(each, key=lambda kinds_peak: kinds_peak[1])


def _predict(layout: Layout, profile: Profile, rows: float, states: int, bucket_mb: float, mp_buffers: float,
             stage: Stage | None, microbatches: int | None = None,
             one_f_one_b: bool = False) -> tuple[dict[str, float], float]:
    dp, mp = layout.dp, layout.mp
    params, trainable, own = profile.per_rank(layout)
    if stage is not None:
        fraction = profile.stage_fraction(stage)
        params, trainable, own = params * fraction, trainable * fraction, own * fraction

    def acts(kept: bool = False) -> float:
        if stage is None:
            return activations(layout, profile, rows, kept)
        # each micro-batch's forward casts the stage's float32 parameters anew, and keeps its casts for its backward
        # (checkpointed blocks keep none: they cast again as they recompute)
        m = pieces(layout.pp, rows, microbatches)
        held = in_flight(stage, layout.pp, m, one_f_one_b)
        cast = params * profile.outside_fraction(stage) if layout.checkpoint else params
        casts = (held - 1) * cast / 2 if layout.precision is not None else 0.0
        made = profile.stage_share(activations(layout, profile, rows), stage, rows, layout.checkpoint, m, held)
        if kept:  # the first micro-batch's backward makes the stage's gradients whole, the others' activations kept
            made = made + trainable if layout.checkpoint else max(made, made * (held - 1) / held + trainable)
        return made + casts
    gathered = 0.0
    if layout.shard == "parameters" and dp > 1:
        params = params - trainable + own  # frozen parameters stay whole
        block = profile.largest_block_bytes - (profile.experts.param_bytes / max(1, profile.experts.layers)
                                               if layout.ep > 1 else 0.0)  # a block's experts stay placed (ep)
        gathered = 2 * max(0.0, block) / mp  # a block in use and the next one gathered
        if layout.precision is not None:  # gathered in the compute dtype, from float32 chunks
            gathered /= 2
    grads = own if layout.shard in ("gradients", "parameters") and dp > 1 else trainable
    buffers = 0.0
    bucketed = trainable - profile.experts_here(layout)[1]  # a rank's experts (ep) stay out of the buckets
    if dp > 1:
        summed = bucketed * profile.widened  # the buckets, in the dtype gradients are summed in
        # each buffer of the ring as large as its largest bucket, at most the cap: no more than the buckets
        ring = min(RING * ring_bytes(int(bucketed), dp, int(bucket_mb * MB)), summed)
        buffers += {None: summed, "optimizer": summed + ring}.get(layout.shard, ring)
    if mp > 1:
        sent = profile.splits[mp].sent_per_row * rows / max(1, profile.splits[mp].collectives)
        buffers += max(SMALLEST_BYTES, 2 * sent, mp_buffers)
    whole = not (layout.shard in ("gradients", "parameters") and dp > 1)
    # under ep with sharded gradients a rank's experts' gradients are whole ones: zero_grad() frees them, backward
    # makes them (their part of the gradients' bytes at the peak, measured kept)
    placed_grads = profile.experts_here(layout)[1] if not whole else 0.0
    kinds = {"parameters": params, "model buffers": profile.buffer_bytes, "gradients": grads,
             "optimizer state": states * own, "autodist buffers": buffers,
             "activations": acts()}
    at_rest = sum(v for k, v in kinds.items() if k != "activations")
    # zero_grad() frees whole gradients (torch's default, set_to_none=True): backward makes them anew as it
    # frees the activations, which the peak measured with them kept holds; sharded ones stay at rest
    between = at_rest - grads if whole else at_rest - placed_grads
    made_again = (activations(layout, profile, rows, kept=True) - kinds["activations"]) * placed_grads / trainable \
        if placed_grads and trainable else 0.0
    # the step's temporaries: per byte stepped (foreach), or the largest tensor's, which mp and sharding cut alike
    transient = profile.step_transient * own + profile.step_transient_bytes * (
        own / profile.trainable_bytes if profile.trainable_bytes else 0.0)
    # a stage's gradients build up whole over its micro-batches' backwards, sharded or not, summed after the last
    peak = max(between + acts(kept=whole or layout.pp > 1) + gathered + made_again, at_rest + transient)
    return kinds, peak


def replicated_need(model: nn.Module, dp: int, states: int = 2) -> float:
    """Bytes a rank holds at rest when every rank holds everything (no ``mp``, no ``shard``): the parameters
    and buffers, a gradient and ``states`` optimizer tensors per trainable parameter, and (``dp > 1``) the
    gradient buckets. Activations come on top: this is the least the layout needs.

    Example:
        >>> replicated_need(nn.Linear(1000, 1000), dp=2) / 1e6     # 4 MB of weights x (1 + 1 + 2 + 1)
        20.02
    """
    params = nbytes(model.parameters())
    trainable = nbytes(p for p in model.parameters() if p.requires_grad)
    summed = summed_nbytes(p for p in model.parameters() if p.requires_grad)
    buffers = nbytes(model.buffers())
    return params + buffers + (1 + states) * trainable + (dp > 1) * summed
