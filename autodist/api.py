"""``parallelize``: validate -> init -> lay out ranks -> shard data -> replicate -> split -> share RNG -> hooks."""
from __future__ import annotations

import inspect
import numbers
import weakref
from functools import partial
from typing import Any, Callable, Literal

import torch.distributed as dist
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import DataLoader

from autodist import sync as sync_mod
from autodist.cp import explain as cp_explain
from autodist.cp import forward as cp_forward
from autodist.cp import options as cp_options
from autodist.cp.batches import SequenceCut
from autodist.ep import explain as ep_explain
from autodist.ep import options as ep_options
from autodist.ep import place as ep_place
from autodist.dp import batch_layout, elastic_data, joining, loader_position, precision, wrappers
from autodist.dp import batch_norm as bn_layers
from autodist.dp import data as data_mod
from autodist.dp.buckets import MB
from autodist.dp.check import Check, Checker, LossOf
from autodist.dp.grad_sync import Registration, attach, is_parallelized
from autodist.dp.replicate import broadcast_state, check_same_model, model_tensors
from autodist.dp.shares import SampleCounter, SampleFn
from autodist.dp.stream import Batches
from autodist.faults import elastic, watchdog
from autodist.mp import observe, rewrite
from autodist.mp.guards import retire
from autodist.planner import search as planner
from autodist.planner.budget import default_budget
from autodist.planner.memory import replicated_need
from autodist.planner.plan import Auto, Layout, ParallelPlan, size_text
from autodist.planner.target import Target
from autodist.pp import cut as pp_cut
from autodist.pp import pipeline as pp_pipeline
from autodist.ps.strategy import ParameterServer
from autodist.runtime import environment
from autodist.runtime.compiled import unwrapped
from autodist.runtime.environment import busy_timeout, hang_timeout
from autodist.runtime.mesh import (Groups, ParallelDims, build_groups, context_group, expert_groups, replica_group,
                                   second_dp_group)
from autodist.runtime.rng import share_rng_state
from autodist.runtime.units import scale_outputs
from autodist.runtime.world import World, init, log
from autodist.sharded import blocks as sharded_blocks
from autodist.sharded import optimizer as sharded_optimizer
from autodist.sharded import parameters as sharded_parameters
from autodist.sharded import recompute
from autodist.sharded.parameters import BlockScatter, ParameterSharding
from autodist.sharded.scatter import Scatter
from autodist.train import copies, habits


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"the model ({type(model).__name__}) has no trainable parameters (none with "
                         f"requires_grad=True), so there is nothing to train in parallel")
    if is_parallelized(model):
        raise RuntimeError("this model is already parallelized; call autodist.parallelize once per model")
    wrappers.refuse_wrapped(model)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    lazy = [name for name, t in tensors if is_lazy(t)]
    if lazy:
        raise ValueError(f"{type(model).__name__} has lazy parameters not created yet ({', '.join(lazy[:4])}"
                         f"{', ...' if len(lazy) > 4 else ''}: nn.LazyLinear and friends make them at their first "
                         f"forward): run one forward first, e.g. `with torch.no_grad(): model(example_batch)`, "
                         f"then call parallelize, which starts every rank from rank 0's weights")
    meta = next((name for name, t in tensors if t.is_meta), None)
    if meta is not None:
        raise ValueError(f"{type(model).__name__}.{meta} is on the meta device (shapes, no values): create the "
                         f"weights first, e.g. model.to_empty(device='cpu') and initialize them, or load a "
                         f"checkpoint, then call parallelize")


def _check_counting(batch_dim: int | None, samples: SampleFn | None) -> None:
    if batch_dim is not None and (not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0):
        raise ValueError(f"batch_dim must be a non-negative int (the dimension of the forward's input tensors that "
                         f"indexes samples), got {batch_dim!r}")
    if samples is not None and not callable(samples):
        raise TypeError(f"samples must be a callable taking the forward's arguments and returning this rank's "
                        f"sample count, got {type(samples).__name__}")


def _check_options(mp: int, bucket_mb: float, first_bucket_mb: float, sync_buffers: bool,
                   backend: str | None) -> None:
    if not isinstance(mp, int) or isinstance(mp, bool) or mp < 1:
        raise ValueError(f"mp must be a positive int, got {mp!r}")
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be a positive number of megabytes, got {value!r}")
    if not isinstance(sync_buffers, bool):
        raise TypeError(f"sync_buffers must be True or False, got {sync_buffers!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None (chosen for you: NCCL when every rank has a "
                         f"GPU of its own, gloo otherwise), got {backend!r}")


SHARD_LEVELS = ("optimizer", "gradients", "parameters")


def _check_shard(shard: str | None, strategy: sync_mod.Strategy) -> None:
    if shard is None:
        return
    if shard not in SHARD_LEVELS:
        raise ValueError(f"shard must be None (every rank holds everything), 'optimizer' (each data-parallel rank "
                         f"keeps 1/N of the optimizer state), 'gradients' or 'parameters'; got {shard!r}")
    if not isinstance(strategy, sync_mod.Exact):
        raise ValueError(f"shard={shard!r} keeps the exact training of sync='backward' or 'manual' and splits its "
                         f"optimizer state; {strategy!r} keeps replicas apart, each with its own state. Use one or "
                         f"the other")


def _check_blocks(blocks: sharded_blocks.Choice, shard: str | None, checkpoint: bool) -> None:
    if not isinstance(checkpoint, bool):
        raise TypeError(f"checkpoint must be True (recompute each block's activations in backward) or False, "
                        f"got {checkpoint!r}")
    if blocks is not None and shard != "parameters" and not checkpoint:
        raise ValueError(f"blocks= names the modules shard='parameters' gathers one at a time and checkpoint=True "
                         f"recomputes; with shard={shard!r} and no checkpoint nothing uses them: drop blocks=, or "
                         f"pass shard='parameters' or checkpoint=True")


def _check_the_check(check: Check | LossOf | None, mp: int, pp: int, shard: str | None,
                     strategy: sync_mod.Strategy) -> Check | None:
    if check is None:
        return None
    check = check if isinstance(check, Check) else Check(check)
    if mp != 1 or pp != 1 or shard in ("gradients", "parameters") or not isinstance(strategy, sync_mod.Exact):
        raise ValueError(f"check= compares rank 0's whole gradients with one process's: it runs with data "
                         f"parallelism and exact sync, shard=None or 'optimizer' (here mp={mp}, pp={pp}, "
                         f"shard={shard!r}, sync={strategy!r}); check the loss at that layout, then change it")
    return check


def _check_positive(name: str, value: object, meaning: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int ({meaning}), got {value!r}")


def _check_pipeline(pp: int, stages: pp_cut.Stages, microbatches: int | None, strategy: sync_mod.Strategy,
                    shard: str | None, loss_fn: Callable[..., Any] | None) -> None:
    _check_positive("pp", pp, "the number of pipeline stages")
    if microbatches is not None:
        _check_positive("microbatches", microbatches, "the pieces pp cuts each batch into")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output) -> loss or (output, target) -> loss, got "
                        f"{type(loss_fn).__name__}")
    if pp == 1:  # loss_fn= without pp: model(x, target=y) is loss_fn(model(x), y), as in one process
        if stages is not None or microbatches is not None:
            raise ValueError("stages= and microbatches= cut the model into pipeline stages: they need pp > 1")
        return
    if not isinstance(strategy, sync_mod.Exact):
        raise ValueError(f"pp={pp} trains as one process does, with sync='backward' or 'manual'; {strategy!r} "
                         f"is not built with pipeline stages: use one or the other")
    if shard == "parameters":
        raise ValueError(f"pp={pp} with shard='parameters' is not built: each stage holds its blocks whole; use "
                         f"shard='optimizer' or 'gradients' with pp")


def _across(dims: ParallelDims, groups: Groups, rank: int) -> tuple[Any] | None:
    """The group a norm over the model's gradients is summed over across the data-parallel ranks: the replica's
    (mp and pp), the pipeline's, the model-parallel one's; None without mp or pp."""
    if dims.pp > 1 and dims.mp > 1:
        return (replica_group(dims, rank),)
    if dims.pp > 1 or dims.mp > 1:
        return (groups.pp if dims.pp > 1 else groups.mp,)
    return None


def _staged(cut: pp_cut.Cut | None, pieces: int, loss_fn: Callable[..., Any] | None) -> str:
    """What the summary line says of the pipeline."""
    how = "1F1B" if loss_fn is not None else "GPipe"
    return "" if cut is None else f"{cut.stages} pipeline stages ({how}, {pieces} micro-batches a batch) x "


def _sharded(shard: str | None, dp: int, at_rest: ParameterSharding | None, cp: int = 1) -> str:
    """What the summary line says of ``shard``."""
    if shard is None or dp == 1:
        return ""
    what = {"optimizer": "optimizer state", "gradients": "optimizer state and gradients",
            "parameters": "optimizer state, gradients and parameters"}[shard]
    blocks = "" if at_rest is None else \
        f" (gathered in {len(at_rest.blocks)} blocks: {', '.join(b.name for b in at_rest.blocks[:3])}" \
        f"{', ...' if len(at_rest.blocks) > 3 else ''})"
    return f", {what} sharded over the {dp} {'' if cp > 1 else 'data-parallel '}ranks{blocks}"


def _through(sync_state: object | None) -> str:
    """" through shared memory" where rank 0's group sums its buckets that way (:mod:`~autodist.dp.exchange`)."""
    exchange = getattr(sync_state, "exchange", None)
    return f" through {exchange.name}" if getattr(exchange, "name", "") == "shared memory" else ""


def _example(model: nn.Module, data: Any, example: observe.Example | None) -> observe.Example | None:
    """The forward's arguments the plans are read from (``example=``, else the data's first rows), as the loop
    hands them to the model (:func:`~autodist.mp.observe.for_model`: on its device, in its floating dtype)."""
    return observe.for_model(model, observe.example_of(data) if example is None else example)


def _device_of(model: nn.Module, world: World) -> str:
    """Where the model's parameters are, for the summary line; a GPU left unused is said."""
    device = next((p.device for p in model.parameters()), None)
    if device is None:
        return "no parameters"
    if device.type == "cpu" and world.device.type == "cuda":
        return (f"cpu (this rank's GPU {world.device} is unused: move the model there first, "
                f"model.to(autodist.init().device), to train on it)")
    return str(device)


def _hand_placed_mp(model: nn.Module, mp: int, world: World) -> int:
    """mp as the model's own MP layers imply it (they default to the whole world as their group)."""
    for name, layer in rewrite.mp_modules(model):
        try:
            layer._check_group()
        except RuntimeError as err:  # built before autodist.init(): a group of one, the whole layer
            raise ValueError(f"MP layer {name!r}: {err}") from None
    sizes = {len(m.sizes) for _, m in rewrite.mp_modules(model)}
    if not sizes:
        return mp
    if len(sizes) > 1 or (mp > 1 and sizes != {mp}):
        raise ValueError(f"the model's MP layers are split over groups of {sorted(sizes)} ranks but mp={mp}; "
                         f"build every MP layer over the same group and pass that size as mp")
    return sizes.pop()


def _check_hand_placed_groups(model: nn.Module, dims: ParallelDims, world: World) -> None:
    """Hand-placed MP layers must be split over this rank's model-parallel group: consecutive ranks."""
    expected = dims.mp_ranks(world.rank)
    for name, layer in rewrite.mp_modules(model):
        ranks = dist.get_process_group_ranks(layer.group) if layer.group is not None else list(range(world.size))
        if ranks != expected:
            raise ValueError(f"MP layer {name!r} is split over ranks {ranks}, but with mp={dims.mp} rank "
                             f"{world.rank}'s model-parallel group is ranks {expected}: build every MP layer with "
                             f"group=torch.distributed.new_group(ranks) for groups of {dims.mp} consecutive ranks")


def _start_elastic(world: World, dims: ParallelDims, shard: str | None, strategy: sync_mod.Strategy,
                   data: data_mod.DataLike) -> bool:
    """Under ``autodist run --elastic``: join the elastic state (:mod:`autodist.faults.elastic`), which replaces
    the watchdog, and True; or, for a job that cannot go on without a lost rank, say so and False: it falls back
    to a restart of every rank from its last checkpoint."""
    if isinstance(strategy, ParameterServer):
        if world.rank == 0:
            log.info("elastic: parameter-server training goes on without a lost worker by itself, as under "
                     "--keep-going (docs/parameter-server.md)")
        return False
    why = _not_elastic(world, dims, shard, strategy, data)
    if why is not None:
        elastic.fall_back(environment.launch(), world.rank, why)
        return False
    elastic.start(world, environment.launch(), hang_timeout(), busy_timeout())
    return True


def _not_elastic(world: World, dims: ParallelDims, shard: str | None, strategy: sync_mod.Strategy,
                 data: data_mod.DataLike) -> str | None:
    """Why this job cannot go on without a lost rank, or None."""
    layout = [what for what, used in (("mp", dims.mp > 1), ("pp", dims.pp > 1), (f"shard={shard!r}", shard),
                                      (type(strategy).__name__, not isinstance(strategy, sync_mod.Exact))) if used]
    if layout:
        return f"its layout has {', '.join(layout)}, whose state a lost rank takes with it"
    if world.backend != "gloo":
        return f"it runs on {world.backend!r}, where a lost peer's collective neither fails nor can be left"
    if not isinstance(data, DataLoader) or isinstance(data.dataset, Batches):
        return (f"its data is {_kind(data)}, which cannot be read again and split over the ranks left: pass a "
                f"DataLoader to parallelize (over a map-style Dataset, or a stream that gives the same batches each "
                f"time it is iterated)")
    return None


def _elastic_loader(model: nn.Module, loader: Any, sync_state: Any) -> None:
    """The loader of an elastic job knows its model (to send its state to a rank that joins); a rank that
    joined loads the state the first member sent (:mod:`autodist.dp.joining`)."""
    loader.elastic_model = weakref.ref(model)
    joining.listen()
    state = elastic.current()
    if state is not None and state.joined_with is not None:
        state.joined_epoch = joining.receive(state.joined_with, model, [loader])
        state.joined_with = None
        sync_state.forget_buffers()  # the model's buffers were replaced: every one counts as changed


def _kind(data: data_mod.DataLike) -> str:
    if isinstance(data, DataLoader):
        return "a DataLoader over an iterator read once"
    return "no data" if data is None else f"a {type(data).__name__}"


def _replicate(model: nn.Module, dims: ParallelDims, groups: Groups, world: World) -> None:
    """Rank 0's weights everywhere; shards of hand-placed MP layers within their data-parallel group."""
    sharded = {id(t) for _, m in rewrite.mp_modules(model) for t in [*m.parameters(), *m.buffers()]}
    common = model_tensors(model, exclude=sharded)
    check_same_model(common)
    broadcast_state(common, src=0)
    if sharded and dims.dp > 1:
        shards = [e for e in model_tensors(model) if id(e[2]) in sharded]
        check_same_model(shards, groups.dp)
        broadcast_state(shards, src=dims.mp_rank(world.rank), group=groups.dp)


def _split_layers(model: nn.Module, dims: ParallelDims, groups: Groups, mp_layers: rewrite.MPLayers,
                  rank: int, example: observe.Example | None) -> None:
    """Plan and swap in the MP layers; remember the parameters they replaced."""
    planned = rewrite.plan(model, dims.mp, mp_layers, example=example)
    _check_split_pays(model, planned.plan, rank)
    retire(rewrite.apply(model, planned, groups.mp))
    log.debug("model-parallel plan:\n%s", planned.plan)
    if not planned.plan.traced and rank == 0:
        swapped = ", ".join(planned.roles)
        log.warning("torch.fx cannot trace %s (tracing stopped at %s), so model parallelism was planned from one "
                    "forward on a sample batch and swaps modules one by one (%s); see "
                    "autodist.explain(model, mp=%d, example=...) for the plan",
                    type(model).__name__, planned.plan.untraced, swapped or "none", dims.mp)


def _check_split_pays(model: nn.Module, plan: rewrite.SplitPlan, rank: int) -> None:
    """mp > 1 that splits nothing raises; one that splits little of the model warns, naming what stays whole."""
    total = sum(p.numel() for p in model.parameters())
    split = [r for r in plan.layers if r.split in ("column", "row", "full")]
    saved = sum(r.dense_params - r.params_per_rank for r in split)
    whole = [(r.name, r.dense_params, r.note) for r in plan.layers if r.split == "replicated"]
    whole = sorted(whole + plan.outside, key=lambda w: -w[1])
    why = "; ".join(f"{name} ({params:,} parameters): {note}" for name, params, note in whole[:3]) or \
        "it has no Linear-like layer (x @ W + b)"
    if not split:
        raise ValueError(f"mp={plan.mp} splits none of {type(model).__name__}'s layers, so every rank of a "
                         f"model-parallel group would do the same work: {why}. Use mp=1 (data parallelism), or see "
                         f"autodist.explain(model, mp={plan.mp}) for the plan")
    if total and saved < 0.2 * total * (1 - 1 / plan.mp) and rank == 0:
        log.warning("mp=%d splits only %.0f%% of %s's parameters; the largest layers kept whole: %s",
                    plan.mp, 100 * sum(r.dense_params for r in split) / total, type(model).__name__, why)


_warned_fit = False


def _warn_if_too_big(model: nn.Module, dp: int, world: World) -> None:
    """Rank 0 warns once where the replicated layout is predicted not to fit its memory (parameters, gradients,
    an Adam-like optimizer's two states, the buckets: the least it needs, activations not counted)."""
    global _warned_fit
    if _warned_fit or world.rank != 0:
        return
    need, budget = replicated_need(model, dp), default_budget(model, world)
    if need > budget:
        _warned_fit = True
        log.warning("%s needs at least %s per rank in this layout (every rank holds the parameters, their "
                    "gradients, an Adam-like optimizer's two states and the gradient buckets: %s of parameters), "
                    "more than the %s this rank has (AUTODIST_BUDGET_GB sets it): parallelize(model, data, "
                    "plan='auto') chooses a layout that fits (sharding, mp, checkpointing)", type(model).__name__,
                    size_text(need), size_text(sum(p.numel() * p.element_size() for p in model.parameters())),
                    size_text(budget))


def _pins(given: dict) -> dict:
    """The layout options given other than their defaults, by the names of :class:`Layout`'s fields: the
    dimensions a search keeps (and the precision every candidate computes in)."""
    layout = Layout.of(None, given)
    return {k: getattr(layout, k) for k in ("mp", "pp", "cp", "shard", "checkpoint", "precision", "ep")
            if getattr(layout, k) != getattr(Layout(), k)}


def _planned(model: nn.Module, data: data_mod.DataLike, plan: str | ParallelPlan | Auto, given: dict,
             options: dict) -> ParallelPlan:
    """The plan ``plan=`` stands for: searched ("auto", an Auto), or read (a ParallelPlan, a JSON file)."""
    if isinstance(plan, str) and plan != "auto":
        plan = ParallelPlan.load(plan)
    if not isinstance(plan, (str, ParallelPlan, Auto)):
        raise TypeError(f"plan must be 'auto', autodist.Auto(...), an autodist.ParallelPlan or the path of one saved "
                        f"as JSON, got {type(plan).__name__}")
    world = init(options["backend"])
    if isinstance(plan, ParallelPlan):
        if plan.world_size != world.size:
            raise ValueError(f"this plan was made for {plan.world_size} ranks, and the world has {world.size}: plan "
                             f"again with plan='auto' (or autodist.plan) under this launch")
        pins = _pins(given)
        if any(getattr(plan.layout, k) != v for k, v in pins.items()):
            raise ValueError(f"the plan's layout ({plan.layout}) differs from {pins} given beside it: give one or "
                             f"the other")
        if plan.layout.pp > 1 and (plan.schedule == "1F1B") != (options.get("loss_fn") is not None):
            made, now = ("with", "without") if plan.schedule == "1F1B" else ("without", "with")
            raise ValueError(f"this plan's pipeline ({plan.layout}) was planned {made} loss_fn= (its schedule "
                             f"{plan.schedule or 'GPipe'}, its memory as that schedule holds it), and it is given "
                             f"{now}: plan again with the loop this script runs, or give loss_fn= as planned")
        if world.rank == 0:
            log.info("plan: %s (the plan given, used without searching)", plan.layout)
        return plan
    trials = {**options, "check": None}  # the trials' copies are not checked (the chosen layout is)
    return search_plan(model, data, Auto() if plan == "auto" else plan, given, trials)


def search_plan(model: nn.Module, data: data_mod.DataLike, auto: Auto, given: dict, options: dict,
                target: Target | None = None) -> ParallelPlan:
    """Run the search with ``parallelize``'s options (the trials parallelize copies of the model with them);
    for ``target``, the prediction for that world."""
    _check_model(model)
    if not isinstance(options["sync"], str) or options["sync"] not in ("backward", "manual"):
        raise ValueError(f"plan= chooses among the layouts that train as one process (sync='backward' or 'manual'); "
                         f"with sync={options['sync']!r} choose mp= and shard= yourself")
    _check_options(given["mp"], options["bucket_mb"], options["first_bucket_mb"], options["sync_buffers"],
                   options["backend"])
    _check_shard(given["shard"], sync_mod.choose(options["sync"]))
    _check_blocks(options["blocks"], "parameters", given["checkpoint"])  # blocks= may serve the chosen layout
    _check_counting(options["batch_dim"], options["samples"])
    precision.check(model, precision.compute_dtype(given.get("mixed_precision")))
    pipeline = [k for k in ("stages", "microbatches") if options.get(k) is not None]
    if pipeline and given.get("pp", 1) == 1:
        raise ValueError(f"{'= and '.join(pipeline)}= shape pipeline stages, and plan= may choose none: give pp= "
                         f"beside them (the search keeps it), or leave them to the plan")
    world = init(options["backend"])
    dim = 0 if options["batch_dim"] is None else options["batch_dim"]
    setup = partial(_build_chosen, announce=False)
    here = None
    if target is not None:  # this world's plan first: its measured layouts calibrate the time model
        try:
            here = planner.search(model, data, auto, world, _pins(given), setup, dim, options,
                                  options["bucket_mb"]).rows
        except ValueError as err:  # nothing fits here (the target may have more memory): the model alone
            log.warning("plan: no layout could be measured here (%s): the target's times are the time model's, "
                        "uncalibrated", str(err).splitlines()[0][:200])
    return planner.search(model, data, auto, world, _pins(given), setup, dim, options, options["bucket_mb"], target,
                          here)


def plan(model: nn.Module, data: data_mod.DataLike = None, auto: Auto | None = None, *, mp: int = 1, pp: int = 1,
         shard: Literal["optimizer", "gradients", "parameters"] | None = None, checkpoint: bool = False,
         target: Target | None = None, **options: object) -> ParallelPlan:
    """Choose the layout ``parallelize(model, data, plan="auto")`` would, without parallelizing the model; or,
    with ``target``, predict it for a world that is not here.

    A collective: every rank calls it. The model, its gradients and the random streams are left as they were.

    Args:
        model / data: as for :func:`parallelize`.
        auto: the search's settings (:class:`autodist.Auto`: memory budget, optimizer states, batch size).
        mp / pp / shard / checkpoint (and cp, among the options): a value other than the default is kept; the
            search chooses the rest.
        target: an :class:`autodist.Target` (ranks, their memory, the link, their speed against a rank here):
            every layout of that world predicted from this one's measures (the stated cost model of
            docs/plan.md), the fastest that fits chosen; nothing is tried, and the plan is for that world.
        options: any other keyword argument of :func:`parallelize` (``batch_dim``, ``example``, ``blocks``...).

    Returns:
        The :class:`autodist.ParallelPlan`: ``print`` it for the table, ``.save(path)`` for JSON that
        ``parallelize(..., plan=path)`` reuses.

    Example:
        >>> plan = autodist.plan(model, loader, autodist.Auto(budget_gb=4))
        >>> print(plan)
        >>> model, loader = autodist.parallelize(model, loader, plan=plan)
    """
    defaults = {name: p.default for name, p in inspect.signature(parallelize).parameters.items()
                if p.kind is p.KEYWORD_ONLY and name not in ("mp", "pp", "shard", "checkpoint", "plan", "layout")}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"autodist.plan got unknown options {unknown}; it takes parallelize's keyword arguments")
    if auto is not None and not isinstance(auto, Auto):
        raise TypeError(f"auto must be an autodist.Auto (the search's settings) or None, got {type(auto).__name__}")
    options = {**defaults, **options}
    if target is not None and not isinstance(target, Target):
        raise TypeError(f"target must be an autodist.Target (a world that is not here) or None, got "
                        f"{type(target).__name__}")
    return search_plan(model, data, auto or Auto(), dict(mp=mp, pp=pp, cp=options["cp"], shard=shard,
                                                         checkpoint=checkpoint, ep=options["ep"],
                                                         mixed_precision=options["mixed_precision"]), options,
                       target)


def parallelize(
    model: nn.Module,
    data: data_mod.DataLike = None,
    *,
    mp: int = 1,
    mp_layers: rewrite.MPLayers = "all",
    sync: Literal["backward", "manual"] | sync_mod.Strategy = "backward",
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    sync_buffers: bool = True,
    batch_dim: int | None = None,
    samples: SampleFn | None = None,
    example: observe.Example | None = None,
    backend: str | None = None,
    shard: Literal["optimizer", "gradients", "parameters"] | None = None,
    blocks: sharded_blocks.Choice = None,
    checkpoint: bool = False,
    plan: str | ParallelPlan | Auto | None = None,
    pp: int = 1,
    stages: pp_cut.Stages = None,
    microbatches: int | None = None,
    loss_fn: Callable[..., Any] | None = None,
    mixed_precision: precision.Precision = None,
    batch_norm: Literal["global", "local"] = "global",
    check: Check | LossOf | None = None,
    cp: int = 1,
    layout: Layout | None = None,
    ep: int = 1,
) -> tuple[nn.Module, data_mod.DataLike]:
    """Make a single-process model and its data parallel: data parallel, model parallel (mp) or both.

    Every rank checks it holds the same model as rank 0 and takes rank 0's
    parameters and buffers. With ``mp=K`` the Linear layers are split over
    groups of K consecutive ranks (see ``autodist.explain``), the world being
    ``dp x K``. Backward hooks then all-reduce gradients over the data-parallel
    ranks in buckets, overlapped with the rest of backward, so that after
    ``loss.backward()`` every rank holds the gradient of the *global* batch,
    as one process would.

    Args:
        model: the model, changed in place and returned.
        data: a tensor or numpy array, a tuple/list of them (same first
            dimension), a map-style Dataset, a DataLoader (over a map-style
            Dataset or a stream, an IterableDataset: every rank reads it and
            keeps its rows of each batch) or a generator of batches; None for
            no data.
        mp: model-parallel degree (must divide the number of ranks). A model
            holding hand-placed ``autodist.layers`` implies it.
        mp_layers: which Linear layers to split: "all", a list of qualified
            names, or a callable ``(name, module) -> bool``.
        sync: "backward" installs the hooks; "manual" installs none and you
            call ``autodist.synchronize_model(model)`` yourself; or a
            low-communication strategy, ``autodist.LocalSGD(every=16)``,
            ``autodist.DiLoCo(every=64)`` or ``autodist.Gossip()``, which
            trade exactness for less traffic (each says what it promises).
        bucket_mb / first_bucket_mb: bucket sizes for the gradient all-reduce.
        sync_buffers: average floating-point buffers (BatchNorm running stats)
            over data-parallel ranks, weighted by samples, at every gradient sync.
        batch_norm: "global": BatchNorm layers in training mode normalize by the
            statistics of the global batch (one all-gather in forward and one
            all-reduce in backward per layer), as one process does, where the
            ranks keep the one-process training (exact sync, no pipeline stages,
            not elastic); "local": by each rank's rows, as DDP does.
        check: ``loss(model, batch) -> loss`` (or ``autodist.Check(loss, every=K)``): on the first step
            (and every K), rank 0 computes one process's gradient of the step's global batch and compares
            it with the synchronized one; a difference beyond the float floor raises on every rank, naming
            the parameter and the likely cause (a loss coupling the batch that autodist cannot read). Costs
            one forward and backward of the global batch on rank 0 on those steps; data parallel, exact sync,
            ``shard=None`` or ``"optimizer"``.
        batch_dim: the dimension that indexes samples: tensors passed as
            ``data`` are split along it (1 for word_language_model's
            (time, batch) data: each rank keeps its columns of every time
            step), and forwards on data autodist did not shard are counted
            along it (1 for (seq, batch) inputs). None (the default): 0,
            checked at the first forward against the model's recurrent and
            attention layers with ``batch_first=False``, which batch along
            dimension 1 (a mismatch raises, naming the fix); give 0 to skip
            the check.
        samples: ``fn(*args, **kwargs) -> int``, called with each forward's
            arguments, returning this rank's count; it overrides every other
            way of counting (count tokens for a loss that is a mean over tokens).
        example: with ``mp > 1`` for a model torch.fx cannot trace, the
            arguments of one forward (a tuple of positional ones, a dict of
            keyword ones, or one tensor) to plan the split from what the
            forward runs; default: two samples of ``data``, a dict batch as
            keyword arguments, a tuple batch's first element as the input.
        backend: force "gloo" or "nccl" (default: chosen by ``autodist.init``).
        shard: "optimizer": each data-parallel rank keeps and updates only its
            1/N of the optimizer state and the ranks all-gather the updated
            parameters (ZeRO stage 1; the same training). None: every rank
            holds everything. "gradients": also keeps only its 1/N of the
            averaged gradients (each bucket reduce-scattered; ZeRO stage 2;
            ``.grad`` holds this rank's slice, and ``clip_grad_norm_`` still
            gives the global norm). "parameters": also keeps only its 1/N
            of the parameters between uses, gathering each block for its
            forward and again for its backward (fully sharded; ZeRO stage 3).
            See docs/sharded.md.
        blocks: with ``shard="parameters"``, the modules gathered one at a
            time (and with ``checkpoint=True`` the ones recomputed): a list
            of module names or a callable ``(name, module) -> bool``;
            default: each run of two or more consecutive members of one type
            in the model's ModuleLists and Sequentials (its transformer or
            ResNet blocks; a stem or head around them is not one).
        checkpoint: recompute each block's activations in backward
            (activation checkpointing, ``torch.utils.checkpoint`` per block):
            less memory, one more forward per block and step, the same
            numbers. Also in a world of one.
        plan: "auto" (or ``autodist.Auto(...)`` with its settings): choose
            ``mp``, ``pp``, ``shard`` and ``checkpoint`` for this world and the
            memory budget (each one given here other than its default is
            kept; ``mixed_precision=`` is the precision every candidate
            computes in), from predicted memory and times measured on a copy
            of the model (docs/plan.md); a :class:`~autodist.ParallelPlan` or
            the path of one saved as JSON: its layout, without searching.
        pp: pipeline stages: the model cut at its blocks (as ``blocks=`` finds or names them) into ``pp`` runs
            of consecutive blocks, each rank holding one stage's (docs/pipeline.md); the world is
            ``dp x pp x mp``. ``model(x)`` runs the batch's micro-batches through the stages (GPipe) and
            returns the output on every rank; ``loss.backward()`` runs their backwards.
        stages: with ``pp``, the cut by hand: ``pp`` counts (blocks per stage) or ``pp`` lists of module names;
            default: balanced by the time and bytes rank 0 measures per block on two samples of ``data``.
        microbatches: with ``pp``, the pieces each batch is cut into (default ``2 * pp``; fewer for a batch
            with fewer rows).
        loss_fn: ``(output) -> loss`` or ``(output, target) -> loss``: ``model(x, target=y)`` then returns
            ``loss_fn(model(x), y)`` (``model(x)``: ``loss_fn(model(x))``). With ``pp``, of one micro-batch: the
            stages run 1F1B (a stage holds at most ``pp - s`` micro-batches' activations), the whole step inside
            ``loss = model(x, target=y)``, which returns the batch's loss on every rank. ``plan=`` with it plans
            that loop (its pipelines 1F1B).
        mixed_precision: "bf16" or "fp16": keep the float32 parameters as the master the optimizer steps and
            compute forward and backward in that dtype (each module's parameters cast for its call, floating
            inputs cast; FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``; under
            ``shard="parameters"`` the blocks gathered in that dtype), the gradients summed in float32. Also in a world of one, which is the reference (docs/precision.md). Without it a
            model keeps its own dtypes: bfloat16 parameters train as bfloat16.
        cp: context parallelism: each sequence split over ``cp`` ranks along its tokens (docs/context-parallel.md),
            the world being data-parallel x ``cp`` (x ``mp``: each rank of a cp group then holds its heads of its
            tokens, the model-parallel ranks consecutive); ``data`` a DataLoader of ``(batch, seq)`` tensors (``(seq,
            batch)`` with ``batch_dim=1``), each batch cut to this rank's tokens as the loader hands it over. The
            model's ``F.scaled_dot_product_attention`` calls attend over the whole sequence and its
            ``torch.arange`` of the tokens gives their global positions, exactly one process's training.
            With every ``shard=`` level, ``checkpoint=True``, ``mp``, ``pp`` (its default schedule: not
            ``loss_fn=``'s 1F1B) and ``check=`` (where check= runs: without mp, pp or a sharded gradient); not
            yet with torch.compile or ``autodist run --elastic``.
        layout: an :class:`autodist.Layout` (``dp``, ``mp``, ``pp``, ``cp``, ``shard``, ``checkpoint``,
            ``precision``), the object a plan chooses (``plan.layout``), written by hand: the keywords above of
            those names are its shorthands (one given beside it must agree with it), and a ``dp`` it names must
            make the world with the others.
        ep: expert parallelism (docs/experts.md): the experts of each mixture-of-experts layer (Hugging Face's
            experts interface) placed over ``ep`` data-parallel ranks, each token sent to the ranks holding its
            top-k experts and their outputs back by all-to-all, dropless, exactly one process's training; the
            expert groups of ``ep`` consecutive ranks replicas of each other (``ep`` divides the data-parallel
            ranks). With ``mp``, ``pp`` (GPipe or 1F1B, each stage's experts placed over its data-parallel ranks;
            experts held as modules not with ``pp`` and ``mp`` together), ``checkpoint=True``, every ``shard=`` level,
            ``mixed_precision=`` and torch.compile; not yet with ``cp``, ``sync="manual"`` or ``plan=``.

    Returns:
        ``(model, shard)``: the model, and this rank's shard of ``data`` of the
        same kind (a DataLoader comes back as a DataLoader yielding this rank's
        slice of each global batch, and keeping its position for checkpoints).
        Ranks of one model-parallel group get the same shard. In a world of
        one: the model as it is, and the data too, except that a DataLoader
        comes back position-keeping (its own batches, in its order).

    Example:
        >>> model, loader = autodist.parallelize(model, loader)
        >>> for x, y in loader:
        ...     optimizer.zero_grad()
        ...     loss_fn(model(x), y).backward()   # gradients synchronized here
        ...     optimizer.step()

    Note:
        The gradient of the global batch weights each rank by its share n_r / N
        of the batch behind each backward, so uneven shards stay exact for a
        loss that is a mean over the batch. A DataLoader passed here knows each
        batch's share; other data is counted along ``batch_dim`` of the
        forward's tensors, and a backward through a forward it cannot count
        raises, naming the arguments; a loss that is a mean over valid tokens
        (labels at -100) weights each rank by its tokens, read from the loss.
        BatchNorm normalizes by the global batch's statistics (``batch_norm``).
        With ``mp > 1`` every rank of a model-parallel group takes the torch RNG state (CPU and CUDA) of the group's first
        rank, so dropout and other random ops draw the same numbers on all of
        them - and so does random data augmentation on torch's RNG, which must
        agree because the ranks of a group must see the same input (Python's
        ``random`` and NumPy are not touched: seed them alike on every rank).
        Data-parallel replicas keep their own random streams. Build the
        optimizer after parallelize: with mp the Linear parameters are
        replaced (an optimizer holding the old ones refuses to step), and
        with pp a rank holds only its stage's blocks.
    """
    if layout is not None:  # the keywords are its shorthands (each checked below as given by them)
        chosen = Layout.of(layout, dict(mp=mp, pp=pp, cp=cp, shard=shard, checkpoint=checkpoint,
                                        mixed_precision=mixed_precision, ep=ep))
        if plan is not None:
            raise ValueError("plan= and layout= were both given: a plan chooses the layout (plan.layout is one); "
                             "give one or the other")
        if chosen.dp is not None:
            chosen.for_world(init(backend).size)
        mp, pp, cp, shard, checkpoint = chosen.mp, chosen.pp, chosen.cp, chosen.shard, chosen.checkpoint
        mixed_precision, ep = chosen.precision, chosen.ep
    options = dict(mp_layers=mp_layers, sync=sync, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb,
                   sync_buffers=sync_buffers, batch_dim=batch_dim, samples=samples, example=example, backend=backend,
                   blocks=blocks, pp=pp, stages=stages, microbatches=microbatches, loss_fn=loss_fn,
                   mixed_precision=mixed_precision, batch_norm=batch_norm, check=check, cp=cp, ep=ep)
    # compiled before parallelize: the model inside torch.compile's wrapper is set up (its hooks, the
    # registries every function taking a model looks in), and the wrapper returned, compiling it as before
    given, model = model, unwrapped(model)
    if plan is None:
        built, data = _build(model, data, mp=mp, shard=shard, checkpoint=checkpoint, **options)
    else:
        picked = _planned(model, data, plan, dict(mp=mp, pp=pp, cp=cp, shard=shard, checkpoint=checkpoint,
                                                  mixed_precision=mixed_precision, ep=ep), options)
        chosen = picked.options()
        for kept in ("stages", "microbatches"):  # the user's cut and micro-batches, kept
            if options[kept] is not None:
                chosen.pop(kept, None)
        built, data = _build_chosen(model, data, **{**options, **chosen})
    return (given if built is model else built), data


def _build_chosen(model: nn.Module, data: data_mod.DataLike, *, announce: bool = True,
                  **options: Any) -> tuple[nn.Module, data_mod.DataLike]:
    """:func:`_build` for a layout a plan chose (or a trial of one): ``blocks=`` named for the layouts that use
    them (``shard="parameters"``, ``checkpoint=True``) is dropped where the chosen one does not."""
    if options["shard"] != "parameters" and not options["checkpoint"]:
        options["blocks"] = None
    return _build(model, data, announce=announce, **options)


def _build(model: nn.Module, data: data_mod.DataLike, *, mp: int, mp_layers: rewrite.MPLayers,
           sync: Literal["backward", "manual"] | sync_mod.Strategy, bucket_mb: float, first_bucket_mb: float,
           sync_buffers: bool, batch_dim: int | None, samples: SampleFn | None, example: observe.Example | None,
           backend: str | None, shard: str | None, blocks: sharded_blocks.Choice, checkpoint: bool,
           pp: int = 1, stages: pp_cut.Stages = None, microbatches: int | None = None,
           loss_fn: Callable[..., Any] | None = None, mixed_precision: precision.Precision = None,
           batch_norm: str = "global", check: Check | LossOf | None = None, announce: bool = True, cp: int = 1,
           ep: int = 1) -> tuple[nn.Module, data_mod.DataLike]:
    """``parallelize`` once its layout is known; ``announce=False`` for the planner's trials (no log line)."""
    _check_model(model)
    compute = precision.compute_dtype(mixed_precision)
    precision.check(model, compute)
    _check_options(mp, bucket_mb, first_bucket_mb, sync_buffers, backend)
    if batch_norm not in ("global", "local"):
        raise ValueError(f"batch_norm must be 'global' (BatchNorm normalizes by the global batch's statistics, as "
                         f"one process) or 'local' (by each rank's rows, as DDP), got {batch_norm!r}")
    strategy = sync_mod.choose(sync)
    _check_shard(shard, strategy)
    check = _check_the_check(check, mp, pp, shard, strategy)
    _check_pipeline(pp, stages, microbatches, strategy, shard, loss_fn)
    _check_blocks(blocks, shard, checkpoint or pp > 1)
    _check_counting(batch_dim, samples)
    cp_options.check(cp, mp=mp, pp=pp, exact=isinstance(strategy, sync_mod.Exact), elastic=environment.elastic(),
                     one_f_one_b=loss_fn is not None)
    if cp > 1:
        cp_options.loader_check(cp, data)
    ep_options.check(ep, dp=None, mp=mp, pp=pp, cp=cp, shard=shard, exact=isinstance(strategy, sync_mod.Exact),
                     hooks=getattr(strategy, "hooks", True), elastic=environment.elastic())
    observe.check_example(example)
    rewrite.check_selection(model, mp_layers)
    world = init(backend)
    dim = 0 if batch_dim is None else batch_dim
    if world.size == 1:  # no launcher: the script runs unchanged, mp or not
        if checkpoint:
            recompute.setup(model, blocks)
        if compute is not None:
            precision.setup(model, compute)
        if loss_fn is not None:  # model(x, target=y) is the loss, as under pp
            pp_pipeline.with_loss(model, loss_fn)
        data_shard = data_mod.in_one_process(data, dim)
        loader_position.attach(model, data_shard)  # a checkpoint in one process resumes mid-epoch too
        return model, data_shard
    wrappers.refuse_inside_lightning(model)
    mp = _hand_placed_mp(model, mp, world)
    dims = ParallelDims.for_world(world.size, mp, pp)
    elastic_job = environment.elastic() and _start_elastic(world, dims, shard, strategy, data)
    if not elastic_job:
        watchdog.start(world.rank, world.size, hang_timeout(), busy_timeout())  # a hang becomes a named error
    groups = build_groups(dims, world.rank)
    _check_hand_placed_groups(model, dims, world)
    share = elastic_data.ElasticOrder() if elastic_job else partial(data_mod.broadcast_order, device=world.device)
    cp_group = sequence_cut = None
    if cp > 1:  # the rows sharded over the data-parallel ranks only; each rank of a cp group keeps its tokens
        cp_options.world_check(cp, dims.dp, dims.mp * dims.pp)
        cp_group = context_group(dims, cp, world.rank)
        data_shard = data_mod.shard(data, dims.dp_rank(world.rank) // cp, dims.dp // cp, share, dim=dim)
        sequence_cut = data_shard.cut = SequenceCut(dims.dp_rank(world.rank) % cp, cp, 1 - dim)
    else:
        data_shard = None if data is None else data_mod.shard(data, dims.dp_rank(world.rank), dims.dp, share, dim=dim)
    if world.backend == "nccl":
        model.to(world.device)
    _replicate(model, dims, groups, world)
    split = cut = None
    if (checkpoint or shard == "parameters") and blocks is None and dims.mp > 1:
        blocks = [name for name, _ in sharded_blocks.find(model)] or None  # before the split makes them differ
    if dims.pp > 1 or (dims.mp > 1 and not rewrite.mp_modules(model)):
        split = copies.skeleton(model)  # what a copy of the split model is (the dense layers), without memory
    if ep > 1:  # on the whole model, before a cut: a stage may hold none of its experts
        ep_place.require(model, ep, staged=dims.pp > 1, split=dims.mp > 1)
    if dims.pp > 1:  # where the stages begin: measured on the whole model, before mp splits it
        cut = pp_cut.choose(model, dims.pp, stages, blocks, _example(model, data, example), world.rank)
    if dims.mp > 1 and not rewrite.mp_modules(model):
        _split_layers(model, dims, groups, mp_layers, world.rank, _example(model, data, example))
    if dims.mp == 1 and shard is None and announce:
        _warn_if_too_big(model, dims.dp, world)
    if dims.mp > 1:  # last of the steps that draw random numbers on some ranks only
        share_rng_state(groups.mp, src=dims.mp_ranks(world.rank)[0], device=world.device)
    if cut is not None:
        pp_pipeline.setup(model, cut, dims.stage(world.rank), dims.pp_ranks(world.rank), groups.pp, world.device,
                          microbatches or 2 * dims.pp, dim, samples, loss_fn,
                          (replica_group(dims, world.rank),) if dims.mp > 1 else None, dims.mp_rank(world.rank))
        blocks = cut.stage_names(dims.stage(world.rank))  # what this rank recomputes (checkpoint=True)
    recomputed = recompute.setup(model, blocks) if checkpoint else []
    placement = sync_state = None
    if ep > 1:  # each rank keeps its slice of every expert, taken from the weights just made identical
        ep_options.check(ep, dp=dims.dp, mp=dims.mp, pp=dims.pp, cp=cp, shard=shard, exact=True, hooks=True,
                         elastic=False)
        place_group, copies_group = expert_groups(dims, ep, world.rank)
        placement = ep_place.setup(model, place_group, dims.dp_rank(world.rank) % ep, ep, copies_group,
                                   shard in ("gradients", "parameters"), dims.mp_rank(world.rank) == 0,
                                   None if cut is None else
                                   frozenset(pp_pipeline.pipeline_of(model).own_params()),  # type: ignore[union-attr]
                                   _across(dims, groups, world.rank))
        if cut is not None:  # each micro-batch's forward exchanges within the expert group
            pp_pipeline.pipeline_of(model).exchanges_over(place_group)  # type: ignore[union-attr]
    at_rest = None
    if dims.dp > 1:
        dp_rank = dims.dp_rank(world.rank)
        scatter = None
        if shard == "parameters":
            at_rest = sharded_parameters.setup(model, blocks, second_dp_group(dims, world.rank), dp_rank, dims.dp,
                                               second_dp_group(dims, world.rank, "reads"),
                                               frozenset() if placement is None else placement.params)
            scatter = BlockScatter(at_rest, groups.dp, dp_rank, dims.dp)
            if compute is not None:
                at_rest.compute_in(compute)
        elif shard == "gradients":
            scatter = Scatter(groups.dp, dp_rank, dims.dp)
        dp_ranks = tuple(dims.dp_ranks(world.rank))
        sync_state = sync_mod.setup(strategy, model, sync_mod.SyncContext(
            groups.dp, dp_ranks, dp_rank,
            SampleCounter(dim, samples, None if sequence_cut is None else sequence_cut.tokens), bucket_mb,
            first_bucket_mb,
            sync_buffers, scatter=scatter, own=frozenset() if placement is None else placement.params))
        if shard is not None:
            sharded_optimizer.setup(model, groups.dp, dp_rank, dims.dp, None if shard == "optimizer" else sync_state,
                                    at_rest, int(bucket_mb * MB),
                                    frozenset() if placement is None else placement.params)
        if batch_norm == "global" and cut is None and isinstance(strategy, sync_mod.Exact):
            sync_state.couple_batch_norm()  # type: ignore[union-attr]
        elif batch_norm == "global" and world.rank == 0 and announce and bn_layers.layers(model):
            under, whose = ("pipeline stages (pp)", "each micro-batch's") if cut is not None else \
                (f"sync={strategy!r}", "each rank's")
            log.info("BatchNorm layers normalize by %s statistics under %s, not the global batch's "
                     "(docs/coupled-batches.md)", whose, under)
        if placement is not None and placement.replicas is not None:  # summed over their groups where it sends
            sync_state.finishers.append(placement.replicas.finish)  # type: ignore[union-attr]
        if check is not None:
            sync_state.checker = Checker(model, sync_state, check, groups.dp, dp_rank)  # type: ignore[union-attr]
    if sequence_cut is not None:  # after the sync's hooks: the routing is on the stack inside them
        scale = sync_state.global_units()  # type: ignore[union-attr]
        routing = cp_forward.attach(model, sequence_cut, cp_group, scale,
                                    (dims.dp_rank(world.rank) // cp, dims.dp // cp))
        recompute.within(model, routing.again)  # checkpoint=True: the blocks run again in backward, routed too
        routing.not_compiled_with = [name for name, on in ((f"mp={dims.mp}", dims.mp > 1),
                                                           ("checkpoint=True", bool(checkpoint))) if on]
        sync_state.counts_compiled = True  # type: ignore[union-attr]  # cp routes a compiled forward's loss eagerly
    attach(model, Registration(dims.dp, dims.dp_rank(world.rank), groups.dp, sync_state))
    loader_position.attach(model, data_shard)  # its checkpoints carry where the loop stands in the data
    if elastic_job:
        _elastic_loader(model, data_shard, sync_state)
    if sequence_cut is None and (placement is not None or getattr(sync_state, "coupled", 0)):
        # a rank's experts take gradients from every rank's tokens, a BatchNorm's rows from every rank's rows
        # through the batch's statistics: the backward in the global loss's units (cp scales in its forward;
        # 1F1B, whose backward runs inside the forward, weights its micro-batches' losses so)
        scale = sync_state.global_units()  # type: ignore[union-attr]
        if cut is not None and loss_fn is not None:
            pp_pipeline.pipeline_of(model).in_global_units(groups.dp)  # type: ignore[union-attr]
        else:
            scale_outputs(model, scale)
    if dims.dp > 1 and batch_dim is None and samples is None and cp == 1:
        batch_layout.watch(model, SampleCounter(dim))  # the default dimension against the model's own layers
    # a copy of a split model meets every rank first, on the reads group of the layout without mp: the world
    everyone = None if split is None else second_dp_group(ParallelDims.for_world(world.size, 1), world.rank, "reads")
    copies.make_copyable(model, split, everyone)
    if loss_fn is not None and cut is None:  # model(x, target=y) is the loss, as in one process and under pp
        pp_pipeline.with_loss(model, loss_fn)
    if compute is not None:  # last: a module's parameters are cast after whatever parallelize's hooks put there
        precision.setup(model, compute)
    habits.adopt(model)  # model.module (DDP's) says what to write instead
    wrappers.watch(model)  # and a wrapper around it fails at its first forward
    if world.rank == 0 and announce:
        log.info("parallelized %s over %d ranks (%s, backend %s%s): %d data-parallel x %s%d model-parallel, "
                 "sync=%s%s%s%s%s%s, model on %s", type(model).__name__, world.size, world.launcher, world.backend,
                 f": {world.reason}" if world.reason else "", dims.dp // cp,
                 _staged(cut, microbatches or 2 * dims.pp, loss_fn) + (f"{cp} context-parallel x " if cp > 1 else ""),
                 dims.mp, strategy, _through(sync_state),
                 _sharded(shard, dims.dp, at_rest, cp),
                 f", {len(recomputed)} blocks recomputed in backward" if recomputed else "",
                 "" if placement is None else f", {placement}",
                 f", mixed_precision={mixed_precision!r} (float32 master weights)" if compute is not None else "",
                 _device_of(model, world))
        if elastic_job:
            log.info("elastic (autodist run --elastic): a lost rank's step is abandoned and the ranks left go on "
                     "with the same training (docs/elastic.md)")
        if cut is not None:
            log.info("%s", cut)
    return model, data_shard


def explain(model: nn.Module, mp: int = 1, mp_layers: rewrite.MPLayers = "all", batch_size: int | None = None,
            example: observe.Example | None = None, *, pp: int = 1, stages: pp_cut.Stages = None,
            blocks: sharded_blocks.Choice = None, cp: int = 1,
            ep: int = 1) -> rewrite.SplitPlan | pp_cut.Cut | cp_explain.ContextPlan | ep_explain.ExpertPlan:
    """What ``parallelize(model, mp=mp, pp=pp)``, ``parallelize(model, loader, cp=cp)`` or ``parallelize(model,
    loader, ep=ep)`` would do, without needing a process group (``cp``, ``ep``: the example's forward runs once,
    here).

    Args:
        model: the single-process model.
        mp: the model-parallel degree.
        mp_layers: "all", a list of Linear layer names, or a callable (name, module) -> bool.
        batch_size: rows each Linear sees per step, to turn the bytes per row into bytes per step: the
            batch size for (batch, features) inputs, batch x sequence length for (batch, seq, features).
        example: the arguments of one forward (a tuple of positional ones, a dict of keyword ones, or one
            tensor): for a model torch.fx cannot trace, the plan is read from that forward; with ``pp > 1``
            the blocks are timed on it (without it, the stages are balanced by parameters).
        pp / stages / blocks: the pipeline stages, as for ``parallelize``.
        cp: the context-parallel degree: with ``example`` (one global batch's whole sequences), the plan shows
            which positions each rank holds, the attention work per rank, and the bytes each rank sends for each
            attention call of the forward (:mod:`autodist.cp.explain`).
        ep: the expert-parallel degree: with ``example`` (one global batch), which rank holds which experts of each
            layer, the pairs each expert gets and the bytes a rank sends for each layer (:mod:`autodist.ep.explain`).

    Returns:
        The model-parallel :class:`SplitPlan` (``pp=1``), the cut into stages (``pp > 1``; with ``mp > 1`` it holds
        the plan too), or the context-parallel plan (``cp > 1``; with ``mp > 1`` each call's heads as a rank
        exchanges them, the model-parallel plan printed after; with ``pp > 1`` each stage's bytes, the cut
        after), or the expert-parallel plan (``ep > 1``; with ``pp > 1`` or ``mp > 1`` the cut or mp's plan printed
        after); ``print`` it for the table.

    Example:
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(1024, 2048), nn.Tanh(), nn.Linear(2048, 10))
        >>> print(autodist.explain(net, mp=2, batch_size=128))
        >>> print(autodist.explain(gpt, pp=2, example=(idx,)))   # the blocks of each stage, and their share
        >>> print(autodist.explain(gpt, cp=2, example=(idx,)))   # the cut of the sequence, the bytes per call
        >>> print(autodist.explain(mixtral, ep=2, example=(ids,)))   # the experts each rank holds, the bytes
    """
    _check_positive("pp", pp, "the number of pipeline stages")
    _check_positive("cp", cp, "the number of ranks a sequence is split over")
    _check_positive("ep", ep, "the number of ranks the experts of each layer are placed over")
    if ep > 1:
        if example is None or cp > 1:
            raise ValueError(f"explain(model, ep={ep}) runs one forward of example= (one global batch's arguments) to "
                             f"see each token's experts, and takes no cp (ep is not built with it yet)")
        observe.check_example(example)
        _check_model(model)
        plan = ep_explain.explain(model, ep, example)
        split = rewrite.explain(model, mp, mp_layers, batch_size, example) if mp > 1 else None
        if pp > 1:  # the cut printed after, each stage's layers apart (with mp, the cut holds mp's plan)
            plan.cut = pp_cut.decide(model, pp, stages, blocks, example)
            plan.cut.mp_plan = split
        else:
            plan.split = split
        return plan
    if cp > 1:
        if example is None:
            raise ValueError(f"explain(model, cp={cp}) runs one forward to find the model's attention calls: pass "
                             f"example=, one global batch's arguments with whole sequences (e.g. example=(idx,))")
        observe.check_example(example)
        _check_model(model)
        plan = cp_explain.explain(model, cp, example)
        if mp > 1:
            split = rewrite.explain(model, mp, mp_layers, batch_size, example)
            plan = plan.split_heads(mp, split, {r.name for r in split.layers if r.split == "column"})
        if pp > 1:  # the cut printed after, each stage's calls apart (with mp, the cut holds mp's plan)
            plan.cut = pp_cut.decide(model, pp, stages, blocks, example)
            plan.cut.mp_plan = plan.mp_plan
        return plan
    if pp == 1:
        if stages is not None:
            raise ValueError("stages= cuts the model into pipeline stages: it needs pp > 1")
        return rewrite.explain(model, mp, mp_layers, batch_size, example)
    _check_model(model)
    cut = pp_cut.decide(model, pp, stages, blocks, example)
    if mp > 1:
        cut.mp_plan = rewrite.explain(model, mp, mp_layers, batch_size, example)
    return cut


def shard_data(model: nn.Module, data: data_mod.DataLike, *, batch_dim: int | None = None) -> data_mod.DataLike:
    """This rank's shard of ``data`` for a model ``parallelize`` already laid out, as ``parallelize(model, data)``
    would have returned it: for a framework that hands over its data only after the model is set up (Lightning
    builds its DataLoaders after the strategy's setup).

    A collective for a DataLoader whose sampler draws from the global RNG (every rank takes rank 0's order, once
    an epoch, at the first batch), as with ``parallelize``.

    Args:
        model: the model returned by ``parallelize`` (in a world of one, any model).
        data: a tensor or numpy array, a tuple/list of them, a map-style Dataset, a DataLoader (also over a
            stream) or a generator of batches.
        batch_dim: the dimension of tensors and arrays that indexes samples, as for ``parallelize``
            (None: 0).

    Returns:
        This rank's shard, of the same kind as ``data``: a DataLoader yields this rank's slice of each global
        batch; ranks of one model-parallel group get the same shard; under ``cp`` each batch is cut to this
        rank's tokens, as the training loader's are (a validation loader, say).

    Example:
        >>> model, _ = autodist.parallelize(model, mp=2)
        >>> loader = autodist.api.shard_data(model, loader)   # later: the data-parallel rank's slices
    """
    from autodist.dp.grad_sync import registration_of

    dim = 0 if batch_dim is None else batch_dim
    world = init()
    if world.size == 1:  # parallelize returned the model as it was: the data too (a loader keeps its position)
        data_shard = data_mod.in_one_process(data, dim)
        loader_position.attach(model, data_shard)
        return data_shard
    registration = registration_of(model)
    if registration is None:
        raise ValueError(f"{type(model).__name__} was not parallelized, so it has no data-parallel rank to shard "
                         f"for: call autodist.parallelize(model) first (or parallelize(model, data), which shards "
                         f"the data too)")
    share = partial(data_mod.broadcast_order, device=world.device)
    routing = cp_forward.context_of(model)
    if routing is not None:  # context parallel: the rows over the data-parallel ranks, the tokens as training's
        cp_options.loader_check(routing.cut.parts, data)
        data_shard = data_mod.shard(data, *routing.rows_of_data, share, dim=dim)
        data_shard.cut = routing.cut  # one cut for every loader: the forward reads the batch handed out last
    else:
        data_shard = data_mod.shard(data, registration.dp_rank, registration.dp, share, dim=dim)
    loader_position.attach(model, data_shard)
    return data_shard
