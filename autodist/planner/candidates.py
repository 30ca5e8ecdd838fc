"""The layouts a world allows: every ``dp x cp x pp x mp`` factorization of it (``cp`` where asked), x each
``shard`` level, x checkpointing the blocks or not, x with ``pp`` the micro-batches a step (GPipe, exact at any
count: a smaller bubble against more sends); a layout that cannot be made says why (``mp`` that splits nothing,
sharding over a single data-parallel rank, checkpointing without blocks, ``cp`` on a model without attention calls
or data that is not a DataLoader). A model with experts adds each ``ep`` dividing ``dp`` (with ``mp`` or ``pp``: one
row that says they are not modelled). Dimensions the user pins are kept as given, and so is the precision
(``mixed_precision=``), which every candidate computes in.

Example:
    >>> [str(r.layout) for r in candidates(2, profile, {"mp": 1}) if not r.impossible][:2]
    ["dp=2 x mp=1, shard=None", "dp=2 x mp=1, shard=None, checkpoint=True"]
"""
from __future__ import annotations

from typing import Any

from autodist.planner.plan import SHARDS, Layout, Row
from autodist.planner.profile import Profile


def _why_not(layout: Layout, profile: Profile) -> str:
    if layout.ep > 1 and profile.experts.why_not(layout.ep):
        return profile.experts.why_not(layout.ep)
    if layout.ep > 1 and layout.cp > 1:
        return f"ep={layout.ep} is not built with cp={layout.cp}"
    if layout.ep > 1 and (layout.mp > 1 or layout.pp > 1):
        return (f"ep={layout.ep} with {'mp' if layout.mp > 1 else 'pp'} is not modelled by the planner: give "
                f"layout=autodist.Layout(ep={layout.ep}, mp={layout.mp}, pp={layout.pp}, ...) to parallelize without "
                f"plan=")
    if layout.cp > 1 and layout.cp not in profile.contexts:  # pinned, on a model the search did not read for it
        return f"cp={layout.cp} was not read from the model (pass autodist.Auto(cp=True) or cp= to the plan)"
    if layout.cp > 1 and profile.contexts[layout.cp].impossible:
        return profile.contexts[layout.cp].impossible
    if layout.mp > 1 and profile.splits[layout.mp].impossible:
        return profile.splits[layout.mp].impossible
    if layout.pp > 1 and len(profile.blocks) < layout.pp:
        return (f"pp={layout.pp} stages need at least {layout.pp} blocks (the model has {len(profile.blocks)}; "
                f"name finer ones with blocks=)")
    if layout.pp > 1 and profile.cut_refusals.get(layout.pp):
        return f"pp={layout.pp} cannot run the model (cut as the pipeline cuts it): {profile.cut_refusals[layout.pp]}"
    if layout.pp > 1 and layout.shard == "parameters":
        return f"pp={layout.pp} with shard='parameters' is not built (each stage holds its blocks whole)"
    if layout.shard is not None and layout.dp * layout.cp == 1:
        return f"shard={layout.shard!r} needs 2 or more data-parallel ranks (here dp=1)"
    if layout.checkpoint and not profile.blocks:
        return ("checkpointing needs blocks (the model has no run of repeated members in a ModuleList or "
                "Sequential; pass blocks=)")
    return ""


def candidates(world_size: int, profile: Profile, pinned: dict[str, Any],
               microbatches: int | None = None) -> list[Row]:
    """One row per layout of ``world_size`` ranks that agrees with ``pinned`` (keys "mp", "pp", "shard",
    "checkpoint", "cp", "precision": the layout's fields), each with ``impossible`` set where it cannot be made; with
    ``pp``, one per count of micro-batches a step (``2 * pp``: parallelize's default, and ``4 * pp``; or the
    ``microbatches`` the user gave). Not ``pp`` itself: half its step is the bubble, and its peak is what the
    memory model misses most (a micro-batch's transients grow with its rows: 15-19% under the measured peak
    for bench_plan.py's CNN, where ``2 * pp`` and ``4 * pp`` are within -4..+12%)."""
    rows = []
    experts = bool(profile.experts.layers) or pinned.get("ep", 1) > 1
    for pp, cp, mp in _factors(world_size, searched=bool(profile.contexts) or pinned.get("cp", 1) > 1):
        dp = world_size // (mp * pp * cp)
        for ep in [k for k in range(1, dp + 1) if dp % k == 0] if experts else [1]:
            for shard in SHARDS:
                for checkpoint in (False, True):
                    layout = Layout(dp, mp, shard, checkpoint, pp=pp, cp=cp, precision=pinned.get("precision"),
                                    ep=ep)
                    if any(getattr(layout, key) != value for key, value in pinned.items()):
                        continue
                    if (shard, checkpoint) != (None, False) and ep > 1 and cp * mp * pp > 1 and "ep" not in pinned:
                        continue  # not modelled: one row says so
                    why = _why_not(layout, profile)
                    counts = [None] if pp == 1 or why else [microbatches] if microbatches else [2 * pp, 4 * pp]
                    rows.extend(Row(layout, impossible=why, microbatches=m) for m in counts)
    return rows


def _factors(world_size: int, searched: bool) -> list[tuple[int, int, int]]:
    """Every ``(pp, cp, mp)`` whose product divides ``world_size`` (``cp`` 1 unless ``searched``: asked for, with
    ``Auto(cp=True)`` or ``cp`` pinned)."""
    def divisors(n: int) -> list[int]:
        return [k for k in range(1, n + 1) if n % k == 0]
    return [(pp, cp, mp) for pp in divisors(world_size) for cp in (divisors(world_size // pp) if searched else [1])
            for mp in divisors(world_size // (pp * cp))]
