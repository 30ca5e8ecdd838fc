"""A world that is not here: :class:`Target`, and the measures of this rank carried over to it (:func:`carried`).

The cost model, stated: a rank of the target computes ``speed`` times as fast as this one (the forward, backward,
recomputation and optimizer step measured here, divided by ``speed``); its collectives are alpha-beta over a ring:
an all-reduce of ``n`` bytes over ``P`` ranks takes ``2 (P - 1) alpha + 2 (P - 1) / P x n / B``, with ``alpha`` the
latency of one hop and ``B`` the link's bandwidth, either given or measured here (an all-reduce of a few bytes
over this world's ``P0`` ranks is ``2 (P0 - 1)`` hops); a reduce-scatter takes the share of an all-reduce's time
measured here beside it (over a given link, a ring's: half); a pipeline's send is one hop. A latency or bandwidth
measured here is this machine's, whose cores run the collectives too: it is divided by ``speed`` alike (4 ranks
sharing the 2 cores 2 ranks use here: ``speed=0.5``, the compute and the collectives twice as slow). Memory is
predicted per rank as for this world (:mod:`autodist.planner.memory`), against the target's memory per rank.
What the model does not know: contention for links (ranks sharing a network), the network's shape (a ring's hops
are taken alike), a GPU's kernels at other sizes (the forward's time is linear in the rows between the two
measured).

Example:
    >>> plan = autodist.plan(model, loader, target=autodist.Target(ranks=64, memory_gb=80, link_gbps=50))
    >>> print(plan)            # every layout of 64 ranks, predicted; the fastest that fits chosen
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autodist.planner.profile import Line, Profile


@dataclass(frozen=True)
class Target:
    """``ranks`` ranks of ``memory_gb`` each, linked at ``link_gbps`` with ``latency_us`` a hop, each computing
    ``speed`` times as fast as a rank here.

    Args:
        ranks: the target world's size.
        memory_gb: memory per rank, GB (10**9 bytes); None: this rank's budget (as ``Auto(budget_gb=...)``).
        link_gbps: the all-reduce's bus bandwidth, GB/s; None: measured here (needs 2 or more ranks here).
        latency_us: one hop's latency, microseconds; None: measured here.
        speed: compute speed of a target rank over a rank here (2.0: twice as fast; 0.5: 4 ranks sharing the
            2 cores 2 ranks use here); a link measured here (``link_gbps``, ``latency_us`` None) runs on the same
            cores and is scaled alike.

    Example:
        >>> autodist.Target(ranks=4, speed=0.5)    # 4 ranks on this machine, from measurements on 2
    """

    ranks: int
    memory_gb: float | None = None
    link_gbps: float | None = None
    latency_us: float | None = None
    speed: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or isinstance(self.ranks, bool) or self.ranks < 1:
            raise ValueError(f"Target's ranks must be a positive int, got {self.ranks!r}")
        for name in ("memory_gb", "link_gbps", "latency_us", "speed"):
            value = getattr(self, name)
            if (value is not None or name == "speed") and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not value > 0):
                raise ValueError(f"Target's {name} must be a positive number{' or None' if name != 'speed' else ''}"
                                 f", got {value!r}")


def _scaled(line: Line, factor: float) -> Line:
    return Line(line.a * factor, line.b * factor)


def carried(profile: Profile, target: Target, here: int) -> Profile:
    """``profile``, measured on ``here`` ranks, as a rank of ``target`` would measure it (see the module
    docstring)."""
    slower = 1.0 / target.speed
    # a link measured here runs on this machine's cores (gloo's copies and sums): where the target's ranks get a
    # smaller share of them (speed < 1: more ranks than here on these cores), its collectives slow alike
    if target.latency_us is not None:
        hop = target.latency_us * 1e-6
    elif here > 1:
        hop = profile.latency / (2 * (here - 1)) * slower
    else:
        hop = None
    bandwidth = target.link_gbps * 1e9 if target.link_gbps is not None else profile.bandwidth / slower
    if target.ranks > 1 and (hop is None or bandwidth == float("inf")):
        raise ValueError(f"a plan for {target.ranks} ranks from a world of one needs the link: "
                         f"Target(link_gbps=..., latency_us=...), or plan under a launch of 2 or more ranks, which "
                         f"measures it")
    blocks = profile.block_measures
    if blocks is not None:
        blocks = replace(blocks, seconds=[s * slower for s in blocks.seconds], head=blocks.head * slower)
    return replace(
        profile, forward=_scaled(profile.forward, slower), backward=_scaled(profile.backward, slower),
        recompute=_scaled(profile.recompute, slower), step_per_byte=profile.step_per_byte * slower,
        latency=2 * (target.ranks - 1) * (hop or 0.0), bandwidth=bandwidth, block_measures=blocks,
        send_latency=hop or 0.0, scatter_share=0.5 if target.link_gbps is not None else profile.scatter_share)
