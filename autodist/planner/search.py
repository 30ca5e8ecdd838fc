"""The search: measure the model, predict every candidate's memory and time, measure the best few, choose,
explain. Rank 0 decides (from its own measures and every rank's budget) and the plan travels to every rank
as plain data, so all of them take the same layout.

Example:
    >>> plan = search(model, loader, Auto(), world, pinned={}, setup=quiet_parallelize)
    >>> plan.layout
    Layout(dp=1, mp=2, shard=None, checkpoint=False)
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, replace
from functools import partial
from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from autodist.dp import precision
from autodist.mp import observe
from autodist.planner import context, experts, memory, timing, trial
from autodist.planner.budget import default_budget
from autodist.planner.candidates import candidates
from autodist.planner.context import Context
from autodist.planner.plan import Auto, ParallelPlan, Row, rows_from, size_text
from autodist.planner.profile import Profile, first_rows, measure, nbytes, probe_peak, rows_within
from autodist.planner.stages import counts
from autodist.planner.target import Target, carried
from autodist.runtime import plain
from autodist.runtime.world import World, log


_TRIAL_MARGIN = 0.9  # a trial runs where its predicted peak is within 90% of the memory free beside the model


def batch_size_of(data: Any, auto: Auto) -> int:
    """Rows of one global batch: the setting, else the DataLoader's."""
    if auto.batch_size is not None:
        return auto.batch_size
    size = getattr(data, "batch_size", None) if isinstance(data, DataLoader) else None
    if not isinstance(size, int):
        raise ValueError("plan='auto' needs the global batch size to measure and predict a step: pass the data as "
                         "a DataLoader with a batch_size, or plan=autodist.Auto(batch_size=rows of one global batch)")
    return size


def _predict(rows: list[Row], profile: Profile, batch: int, states: int, budget: float, bucket_mb: float,
             world_size: int, here: bool = True, one_f_one_b: bool = False) -> None:
    """Each row's memory, peak and time; ``here``: the world this process is in (its model-parallel buffers
    already made count), else a :class:`Target`; ``one_f_one_b``: pipelines run 1F1B (``loss_fn=``)."""
    unlinked = replace(profile, latency=0.0, bandwidth=float("inf"), send_latency=0.0)  # the step without the link
    for row in rows:
        if row.impossible:
            row.status = f"not possible: {row.impossible}"
            continue
        per_rank = math.ceil(batch / row.layout.dp)
        existing = memory.existing_mp_buffers(world_size, row.layout.mp, row.layout.pp) \
            if row.layout.mp > 1 and here else 0.0
        row.memory, row.peak = memory.predict(row.layout, profile, per_rank, states, bucket_mb, existing,
                                              row.microbatches, one_f_one_b)
        if row.layout.pp > 1:
            row.stages = counts(profile.cuts[row.layout.pp])
        row.seconds = timing.seconds(row.layout, profile, per_rank, bucket_mb, row.microbatches)
        row.linked = row.seconds - timing.seconds(row.layout, unlinked, per_rank, bucket_mb, row.microbatches)
        if row.peak > budget:
            row.status = f"does not fit: needs {size_text(row.peak)} > budget {size_text(budget)}"


def _cut(options: dict[str, Any], row: Row) -> dict[str, Any]:
    """A trial's options: with ``pp``, the cut its memory was predicted for and checked to run (``stages=``) and
    its micro-batches (``microbatches=``), each unless the user gave it."""
    staged = {"stages": row.stages, "microbatches": row.microbatches}
    return {**options, **{k: v for k, v in staged.items() if v and options.get(k) is None}}


def _nothing_fits(rows: list[Row], budget: float, ranks: int, batch: int, name: str) -> ValueError:
    possible = [r for r in rows if not r.impossible]
    if not possible:  # the pins leave no layout that can be made
        why = "; ".join(sorted({r.impossible for r in rows})) or "the pins given match no factorization"
        return ValueError(f"no layout of {name} can be made on {ranks} ranks with the mp, shard and checkpoint "
                          f"given beside plan=: {why}")
    smallest = min(possible, key=lambda r: r.peak)
    helps = ["more ranks (sharding and mp divide the model's state by the ranks)",
             f"a smaller global batch than {batch} (activations grow with it)"]
    if not smallest.layout.checkpoint and any(r.layout.checkpoint for r in possible):
        helps.append("checkpoint=True")
    return ValueError(f"no layout of {name} fits the memory budget on {ranks} ranks: the smallest, "
                      f"{smallest.layout}, needs {size_text(smallest.peak)} per rank > budget {size_text(budget)}. "
                      f"What would help: {'; '.join(helps)}; or a larger budget (plan=autodist.Auto(budget_gb=...)) "
                      f"if more memory is free than autodist sees")


def _finalists(rows: list[Row], count: int) -> list[int]:
    """The rows to measure: the fastest modelled fitting row of each family (dp, cp, mp, pp, shard level); first
    the best family of each mp, pp and cp degree, then the other families fastest by the model, ``count`` in all.
    The model ranks structurally different layouts roughly (communication most of all): measuring the best of each
    degree and family lets the measurement decide among them."""
    best: dict[tuple, int] = {}
    for i, r in enumerate(rows):
        family = (r.layout.dp, r.layout.cp, r.layout.mp, r.layout.pp, r.layout.shard, r.layout.ep)
        if r.fits and r.seconds is not None and (family not in best or r.seconds < rows[best[family]].seconds):
            best[family] = i
    ranked = sorted(best.values(), key=lambda i: rows[i].seconds)  # type: ignore[arg-type, return-value]
    first = {}
    for i in ranked:
        first.setdefault((rows[i].layout.mp, rows[i].layout.pp, rows[i].layout.cp, rows[i].layout.ep), i)
    picked = sorted(first.values(), key=ranked.index)[:count]
    return picked + [i for i in ranked if i not in picked][:max(0, count - len(picked))]


def _choose(rows: list[Row], budget: float) -> tuple[Row, str]:
    """The fastest fitting layout: measured where any finalist was, else modelled; every other row's status."""
    fitting = [r for r in rows if r.fits and r.seconds is not None]
    measured = [r for r in fitting if r.measured_seconds is not None]
    best = min(measured, key=lambda r: r.measured_seconds) if measured else min(fitting, key=lambda r: r.seconds)
    for r in rows:
        if r is best:
            r.status = "chosen"
        elif r in fitting and not r.status:
            r.status = _slower(r, best)
    replicated = next((r for r in rows if r.layout.mp == r.layout.pp == r.layout.cp == r.layout.ep == 1
                       and r.layout.shard is None and not r.layout.checkpoint), None)
    how = f"the fastest of {len(measured)} measured" if measured else "the fastest modelled"
    possible = sum(1 for r in rows if not r.impossible)
    why = f"{how}; {len(fitting)} of the {possible} possible layouts fit {size_text(budget)} per rank"
    if replicated is not None and replicated is not best:
        if not replicated.fits:
            why += f"; replicated ({replicated.layout}) does not fit: needs {size_text(replicated.peak)}"
        else:
            why += f"; replicated is {replicated.status}"
    return best, why


def _slower(row: Row, best: Row) -> str:
    """How much slower ``row`` is than ``best``: measured against measured, else modelled against modelled."""
    if row.measured_seconds is not None and best.measured_seconds is not None:
        return f"+{100 * (row.measured_seconds / best.measured_seconds - 1):.0f}% slower"
    ratio = row.seconds / best.seconds  # type: ignore[operator]
    if ratio < 1:  # the model put it first, the measured finalists beat it: the model misjudges its kind
        return f"{100 * (ratio - 1):.0f}% modelled, not measured"
    return f"+{100 * (ratio - 1):.0f}% slower (modelled)"


def _family(layout: Any, checkpoint: bool = True) -> tuple:
    """What the time model misjudges alike: the shard level, whether layers, the model or the sequence are split,
    and (``checkpoint``) recomputation."""
    return (layout.shard, layout.mp > 1, layout.pp > 1, layout.cp > 1, layout.ep > 1,
            layout.checkpoint if checkpoint else None)


def calibrate(rows: list[Row], here: list[Row]) -> int:
    """Each row's modelled time, its step's own work (the time less the link's part) times measured over modelled
    of that work in the layouts measured here of its family (the closest one: the same shard level, split or not,
    staged or not, recomputing or not; else all of them; their median), and the link's part as modelled: what the
    model misses is a step's own work (hooks, packing, Python), not the link's, so a slower link is not scaled by
    it. The number of layouts measured here it went by."""
    measured = [r for r in here if r.measured_seconds is not None and r.seconds and r.seconds > (r.linked or 0.0)]

    def ratio(r: Row) -> float:  # the step's own work: measured over modelled (the link taken as modelled)
        linked = r.linked or 0.0
        return max(0.5, (r.measured_seconds - linked) / (r.seconds - linked))

    if not measured:
        return 0
    overall = statistics.median(ratio(r) for r in measured)
    for row in rows:
        if row.seconds is None:
            continue
        factor = overall
        for exact in (True, False):
            same = [ratio(r) for r in measured if _family(r.layout, exact) == _family(row.layout, exact)]
            if same:
                factor = statistics.median(same)
                break
        linked = row.linked or 0.0
        row.seconds = linked + (row.seconds - linked) * factor
    return len(measured)


def _predicted(rows: list[Row], budget: float, auto: Auto, batch: int, ranks: int, world: World,
               seconds: float, here: list[Row], schedule: str = "") -> ParallelPlan:
    """The plan for a target world: the fastest modelled layout that fits (each time calibrated by the layouts
    measured here, :func:`calibrate`), none tried."""
    calibrated = calibrate(rows, here)
    best, why = _choose(rows, budget)
    by = f", the time model calibrated by the {calibrated} layouts measured here" if calibrated else ""
    plan = ParallelPlan(ranks, budget, auto.optimizer_states, batch, best.layout, rows,
                        f"predicted for {ranks} ranks from the measures of {world.size} here{by}, none tried: {why}",
                        seconds, measured_on=world.size, schedule=schedule)
    if world.size > 1:
        plan = ParallelPlan.from_json(plain.broadcast(plan.to_json(), src=0))
    (log.info if world.rank == 0 else log.debug)("%s", plan.line())
    return plan


def search(model: nn.Module, data: Any, auto: Auto, world: World, pinned: dict[str, Any], setup: trial.Setup,
           batch_dim: int = 0, options: dict[str, Any] | None = None, bucket_mb: float = 25.0,
           target: Target | None = None, here_rows: list[Row] | None = None) -> ParallelPlan:
    """Choose the layout of ``model`` for this world, or predict it for ``target`` from this one's measures
    (nothing is tried there; ``here_rows``: this world's plan, whose measured layouts calibrate the time model);
    a collective: every rank calls it alike."""
    start = time.perf_counter()
    batch = batch_size_of(data, auto)
    options = dict(options or {})
    example = observe.example_of(data, rows=batch) if options.get("example") is None else options["example"]
    if example is None:
        raise ValueError("plan='auto' measures a forward on the data's first global batch, but could not take one "
                         "from the data passed: pass a tensor, a tuple of tensors, a Dataset or a DataLoader, or "
                         "example= (the arguments of one forward on a global batch)")
    example = observe.for_model(model, observe.complete(model, example))
    say = log.info if world.rank == 0 else log.debug
    say("plan: measuring %s (a forward/backward at 2 batch sizes, the optimizer step, the all-reduce)",
        type(model).__name__)
    ranks = world.size if target is None else target.ranks
    held = nbytes([*model.parameters(), *model.buffers()])
    here = default_budget(model, world)
    available = min(plain.all_gather(here)) if world.size > 1 else here
    budget = auto.budget_gb * 1e9 if auto.budget_gb is not None else available
    small = max(1, batch // ranks)
    compute = precision.compute_dtype(pinned.get("precision"))
    # measured at a rank's share of the rows, or fewer where those would not fit this rank beside the model

    def peak_of(r: int) -> float:  # every rank measures the same rows (the all-reduce is timed over them all)
        every = plain.all_gather(probe_peak(model, example, r, batch_dim, compute)) if world.size > 1 else \
            [probe_peak(model, example, r, batch_dim, compute)]
        return float("nan") if any(v != v for v in every) else max(every)

    rows = rows_within(peak_of, (small, min(batch, 2 * small)), budget - held, type(model).__name__)
    degrees = [k for k in range(2, ranks + 1) if ranks % k == 0]
    placing = experts.read(model, example, rows[0], degrees, batch_dim)  # the experts ep would place (if any)
    profile = measure(model, example, rows, ranks, auto.optimizer_states, options.get("blocks"), batch_dim, compute,
                      sorted(placing.sent))
    profile.experts = placing
    if auto.cp or pinned.get("cp", 1) > 1:  # asked for: the code around the model must be per token
        profile.contexts = context.contexts(model, first_rows(example, rows[0], batch_dim), rows[0], degrees,
                                            isinstance(data, DataLoader), batch_dim)
    one_f_one_b = options.get("loss_fn") is not None  # the loop's loss = model(x, target=y): pipelines run 1F1B
    if one_f_one_b and profile.contexts:
        profile.contexts = {k: Context(impossible=f"cp={k} is not built with loss_fn= (the loss inside the forward)")
                            for k in profile.contexts}
    if target is not None:
        profile = carried(profile, target, world.size)
        if target.memory_gb is not None:
            budget = target.memory_gb * 1e9
    rows = candidates(ranks, profile, pinned, options.get("microbatches"))
    _predict(rows, profile, batch, auto.optimizer_states, budget, bucket_mb, ranks, target is None, one_f_one_b)
    if world.size > 1:  # rank 0's predictions decide, on every rank
        rows = rows_from(plain.broadcast([asdict(r) for r in rows], src=0))
    if not any(r.fits for r in rows):
        raise _nothing_fits(rows, budget, ranks, batch, type(model).__name__)
    if target is not None:
        return _predicted(rows, budget, auto, batch, ranks, world, time.perf_counter() - start, here_rows or [],
                          "1F1B" if one_f_one_b else "")
    chosen = _finalists(rows, auto.finalists)
    trial_options = dict(options)
    if trial_options.get("example") is None:  # mp plans an untraceable model from a forward on it
        trial_options["example"] = example if isinstance(example, (tuple, dict)) else (example,)
    room = _TRIAL_MARGIN * (available - held)  # a copy is made beside the model, which stays
    measurable = [i for i in chosen if rows[i].peak <= room]
    for i in chosen:
        if i not in measurable:
            rows[i].status = f"not measured: a copy beside the model would need {size_text(rows[i].peak + held)}"
    if measurable:
        say("plan: measuring %d finalists for %d steps each: %s (%.1f s so far)", len(measurable), auto.steps,
            "; ".join(str(rows[i].layout) for i in measurable), time.perf_counter() - start)
    elif chosen:
        say("plan: no finalist measured, as a copy of the model beside it would not fit: the time model decides "
            "(%.1f s so far)", time.perf_counter() - start)
    labels = observe.for_device(model, observe.target_of(data, batch)) if one_f_one_b else None
    make = [partial(trial.Trial, model, example, rows[i].layout, setup, auto.optimizer_states, world.rank,
                    batch_dim, _cut(trial_options, rows[i]), labels) for i in measurable]
    together = sum(rows[i].peak for i in measurable) <= room
    for i, result in zip(measurable, trial.run_all(make, auto.steps, together)):
        row = rows[i]
        if isinstance(result, str):  # a model-parallel plan (or cp's routing) the forward refuses fails at every shard=
            same = [r for r in rows if (row.layout.mp > 1 and r.layout.mp == row.layout.mp)
                    or (row.layout.cp > 1 and r.layout.cp == row.layout.cp)] or [row]
            for r in same:
                r.impossible, r.status = f"could not be made: {result}", f"not possible: could not be made: {result}"
            continue
        row.measured_seconds, row.measured_peak, row.measured_memory = result.seconds, result.peak, result.kinds
        if result.peak > budget:
            row.status = f"does not fit: measured {size_text(result.peak)} > budget {size_text(budget)}"
    if not any(r.fits for r in rows):
        raise _nothing_fits(rows, budget, ranks, batch, type(model).__name__)
    best, why = _choose(rows, budget)
    plan = ParallelPlan(world.size, budget, auto.optimizer_states, batch, best.layout, rows, why,
                        time.perf_counter() - start, schedule="1F1B" if one_f_one_b else "")
    if world.size > 1:
        plan = ParallelPlan.from_json(plain.broadcast(plan.to_json(), src=0))
    say("%s", plan.line())
    return plan
