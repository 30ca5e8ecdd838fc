"""What a model-parallel plan says: one row per layer (:class:`LayerPlan`), the table (:class:`Plan`), and what
applying it needs (:class:`Rewrite`). Made by :mod:`autodist.mp.fx_plan` (a traced model) or
:mod:`autodist.mp.recorded_plan` (a recorded forward); applied by :mod:`autodist.mp.rewrite`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import torch.fx as fx
from torch import nn

from autodist.mp.regions import Region

MPLayers = Union[str, Sequence[str], Callable[[str, nn.Module], bool]]


@dataclass
class LayerPlan:
    """One row of the plan: a layer, how it is split, what it holds and sends."""

    name: str
    op: str
    split: str  # "column", "row", "full", "heads", "replicated" or "local" (elementwise on a slice)
    dense_params: int = 0
    params_per_rank: int = 0
    # (phase, collective, elements per row of the batch) for each collective in one training step
    collectives: list[tuple[str, str, int]] = field(default_factory=list)
    note: str = ""

@dataclass
class SplitPlan:
    """What ``parallelize(model, mp=K)`` will do to each layer; ``str()`` is a table.

    Example:
        >>> print(autodist.explain(model, mp=2, batch_size=128))
    """

    mp: int
    layers: list[LayerPlan]
    traced: bool = True
    untraced: str = ""  # where torch.fx stopped, when it did
    batch_size: int | None = None
    bytes_per_element: int = 4
    # (module, parameters, why) for each module whose own parameters no row covers: kept whole on every rank
    outside: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def collectives_per_step(self) -> int:
        return sum(len(layer.collectives) for layer in self.layers)

    def __str__(self) -> str:
        rows = [("layer", "op", "split", "params/rank", "collectives per step", "bytes", "note")]
        unit = self.batch_size or 1
        for layer in self.layers:
            comm = ", ".join(f"{kind} ({phase})" for phase, kind, _ in layer.collectives) or "-"
            nbytes = sum(n for _, _, n in layer.collectives) * unit * self.bytes_per_element
            params = f"{layer.params_per_rank:,} of {layer.dense_params:,}" if layer.dense_params else "-"
            rows.append((layer.name, layer.op, layer.split, params, comm, f"{nbytes:,}" if nbytes else "-",
                         layer.note))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        total = sum(layer.params_per_rank for layer in self.layers)
        count = self.collectives_per_step
        lines.append(f"mp={self.mp}: {count} model-parallel collective{'' if count == 1 else 's'} per training step; "
                     f"{total:,} parameters per rank in these layers"
                     + ("" if self.traced else f"; model not traceable by torch.fx (stopped at {self.untraced}): "
                                               f"module-by-module swap, collectives counted for one call of each "
                                               f"layer"))
        large = [(name, n) for name, n, _ in sorted(self.outside, key=lambda o: -o[1]) if n >= 0.01 * (total + sum(
            o[1] for o in self.outside))]
        if large:
            shown = ", ".join(f"{name} ({n:,})" for name, n in large[:6]) + (" ..." if len(large) > 6 else "")
            lines.append(f"kept whole on every rank, not layers mp splits (their own parameters, not x @ W + b: a "
                         f"mixture-of-experts layer's fused experts, a norm): {shown}")
        # a Linear takes every leading dimension as rows: a (B, T, C) activation is B x T rows
        rows_sent = f"{self.batch_size} rows" if self.batch_size else "one row (pass batch_size)"
        lines.append(f"bytes: for {rows_sent} through each Linear; a row is a sample of (batch, features) inputs, "
                     f"so for (batch, seq, features) inputs pass batch_size = batch x seq")
        return "\n".join(lines)

@dataclass
class Rewrite:
    """A plan and what applying it needs: each planned layer's role and, when traced, its graph node."""

    plan: SplitPlan
    roles: dict[str, str]  # layer name -> "column" | "row" | "full" | "heads" (nn.MultiheadAttention)
    first: set[str]  # layers whose input needs no gradient
    graph: fx.Graph | None = None
    nodes: dict[str, fx.Node] = field(default_factory=dict)
    swaps: dict[str, str] = field(default_factory=dict)  # module name -> MP layer class name
    regions: list[Region] = field(default_factory=list)  # recorded-forward plans: layers split together
    orientation: dict[str, str] = field(default_factory=dict)  # layer -> "linear" or "transposed" (HF Conv1D)

def split_sizes(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]

def count_params(linear: nn.Linear) -> int:
    return sum(p.numel() for p in linear.parameters())

def linear_row(name: str, linear: nn.Linear, role: str, first: bool, mp: int, note: str) -> LayerPlan:
    dense = count_params(linear)
    bias = linear.bias is not None
    out_local = split_sizes(linear.out_features, mp)[0]
    in_local = split_sizes(linear.in_features, mp)[0]
    n_in, n_out = linear.in_features, linear.out_features
    if role == "column":
        per_rank = out_local * n_in + (out_local if bias else 0)
        comm = [] if first else [("backward", "all-reduce", n_in)]
        return LayerPlan(name, "Linear", "column", dense, per_rank, comm,
                         "first layer: no input-gradient communication" if first else "")
    per_rank = n_out * in_local + (n_out if bias else 0)
    if role == "row":
        return LayerPlan(name, "Linear", "row", dense, per_rank, [("forward", "all-reduce", n_out)], "")
    comm = [("forward", "all-reduce", n_out)] + ([] if first else [("backward", "all-gather", n_in)])
    first_note = "first layer: no input-gradient communication; " if first else ""
    return LayerPlan(name, "Linear", "full", dense, per_rank, comm,
                     f"MPBaseLinear (row split inside); {first_note}{note}")

HOOKED = "it has hooks (weight_norm's, say), which swapping the module would drop"

def hooked(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks)


def outside_of(model: Any, layers: list[LayerPlan]) -> list[tuple[str, int, str]]:
    """(module, parameters, why) for each module of ``model`` holding parameters of its own that no row of
    ``layers`` covers: a mixture-of-experts layer's fused experts (3-D weights, not a Linear), a norm, a bare
    parameter; each kept whole on every rank."""
    covered = {r.name for r in layers}
    found = []
    for name, module in model.named_modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        if own and name not in covered:
            found.append((name or type(model).__name__, own, f"{type(module).__name__}'s own parameters are not a "
                          f"layer mp splits (x @ W + b): kept whole on every rank"))
    return found
