"""Megatron regions found by following split outputs through one forward: column layers -> ops -> row layers.

Used by the planner when torch.fx cannot trace the model. Every candidate
layer's output is marked split along its last dimension, and
:class:`autodist.mp.shard_flow.Flow` follows the marks through the forward on a
sample batch. Layers whose marks reach other candidates' inputs (split along
the last dimension) through ops that a slice can run - ``gelu(fc(x))``,
``silu(gate(x)) * up(x)``, and attention: ``c_attn(x).split(C)``, the head
``view``/``transpose``, ``scaled_dot_product_attention`` or explicit
``softmax(q @ k.T) @ v``, ``view(B, T, C)`` - form a region: the first are
split by output features (a fused QKV projection in blocks, so each rank
holds whole heads of q, k and v), the second by input features, and the ops
between run on each rank's heads. A region costs one all-reduce forward per
row layer and one backward for its input. A mark that reaches the model's
output, an unsplit tensor of the same width, or a reduction or softmax over
the split dimension keeps the layers behind it whole and names the op and
line. Dropout on a slice (also attention's ``dropout_p``) drops what one
process drops: each rank takes its slice of the mask drawn for the whole
tensor.

Candidates are leaf modules whose forward computes ``x @ W.T + b``
(``nn.Linear``) or ``x @ W + b`` (Hugging Face's ``Conv1D``), checked on the
sample batch itself, not by class name.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from autodist.mp.shard_flow import Flow, Split


@dataclass
class Region:
    """Layers split together, and where the ops between them run."""

    module: str  # the innermost module that runs every layer of the region ("" for the model)
    columns: dict[str, tuple[int, ...]]  # layer -> blocks of its output features
    rows: dict[str, tuple[int, ...]]  # layer -> blocks of its input features
    flow: bool  # the ops between need their size arguments rewritten (attention), not only elementwise ones
    elementwise: frozenset[str] = field(default_factory=frozenset)  # functions found elementwise on a slice
    cuts: int = 0  # per-head tensors held whole (T5's position bias) that each rank cuts: one all-gather backward


@dataclass
class Found:
    regions: list[Region]
    unpaired: dict[str, str]  # candidate -> why it is in no region
    orientation: dict[str, str]  # candidate -> "linear" (x @ W.T + b) or "transposed" (x @ W + b)
    not_affine: dict[str, str]  # candidate -> why it is not an affine layer


def _affine(module: nn.Module, x: torch.Tensor, out: Any) -> str | None:
    """How ``module`` computed ``out`` from ``x``: "linear", "transposed", or None (something else)."""
    if type(module) is nn.Linear:
        return "linear"
    weight, bias = module.weight, getattr(module, "bias", None)
    if not isinstance(out, torch.Tensor) or not isinstance(x, torch.Tensor) or not x.is_floating_point() \
            or x.dtype != weight.dtype:
        return None
    with torch.no_grad(), torch._C.DisableTorchFunction():
        for kind, w in (("linear", weight), ("transposed", weight.t())):
            if w.shape[1] == x.shape[-1] and out.shape[-1] == w.shape[0]:
                expected = F.linear(x, w, bias)
                if expected.shape == out.shape and torch.allclose(expected, out, rtol=1e-4, atol=1e-5):
                    return kind
    return None


def find_regions(model: nn.Module, run: Callable[[], Any], candidates: dict[str, nn.Module],
                 parts: int) -> Found:
    """Run ``run()`` (one forward of ``model``) following each candidate's output split over ``parts`` ranks.

    Example:
        >>> found = find_regions(gpt, lambda: gpt(idx), {"h.0.attn.c_attn": ..., "h.0.attn.c_proj": ...}, 2)
        >>> found.regions[0].columns
        {'h.0.attn.c_attn': (64, 64, 64)}
    """
    flow = Flow(parts, local=False)
    by_id = {id(m): name for name, m in candidates.items()}
    rows: dict[str, tuple[frozenset[str], tuple[int, ...] | None]] = {}
    orientation: dict[str, str] = {}
    not_affine: dict[str, str] = {}
    order: list[str] = []
    inputs: dict[str, torch.Tensor] = {}

    def enter(module: nn.Module, args: tuple) -> None:
        name = by_id.get(id(module))
        if name is None:
            return
        x = next((a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)), None)
        split = flow.split_of(x)
        if split is not None:
            if split.dim != x.dim() - 1:  # type: ignore[union-attr]
                flow.fail([x], f"enters {name} split along dimension {split.dim}, not its features")
            else:
                rows[name] = (flow._sources_of([x]), split.blocks)  # type: ignore[list-item]
        if x is not None:
            inputs[name] = x
        order.append(name)
        flow.opaque += 1

    def leave(module: nn.Module, args: tuple, out: Any) -> None:
        name = by_id.get(id(module))
        if name is None:
            return
        flow.opaque -= 1
        kind = _affine(module, inputs.pop(name, None), out)  # type: ignore[arg-type]
        if kind is None:
            not_affine[name] = ("not a Linear-like layer (on the sample batch its output is not x @ weight.T + bias, "
                                "nor x @ weight + bias): kept whole on every rank")
            return
        orientation[name] = kind
        flow.tag(out, Split(out.dim() - 1, None), frozenset({name}))

    handles = [nn.modules.module.register_module_forward_pre_hook(enter),
               nn.modules.module.register_module_forward_hook(leave, always_call=True)]
    try:
        with flow:
            result = run()
    finally:
        for handle in handles:
            handle.remove()
    escaped = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor) and t in flow.splits]
    flow.fail(escaped, "is part of the model's output")
    return _assemble(flow, candidates, rows, order, orientation, not_affine)


def _assemble(flow: Flow, candidates: dict[str, nn.Module], rows: dict, order: list[str],
              orientation: dict[str, str], not_affine: dict[str, str]) -> Found:
    accepted, unpaired = _accept(flow, rows, order, not_affine)
    regions: list[Region] = []
    for columns, row_names in _components(accepted):
        layers = columns | row_names
        col_blocks = {c: flow.decided.get(c) or (_width(candidates[c], orientation[c], out=True),) for c in columns}
        row_blocks = {r: rows[r][1] or (_width(candidates[r], orientation[r], out=False),) for r in row_names}
        module = _common_prefix(sorted(layers, key=order.index))
        regions.append(Region(module, _ordered(col_blocks, order), _ordered(row_blocks, order),
                              bool(columns & flow.structural), frozenset(flow.elementwise),
                              sum(bool(columns & sources) for sources in flow.cuts)))
    taken = {name for r in regions for name in (*r.columns, *r.rows)}
    for name in candidates:
        if name not in taken and name not in unpaired:
            unpaired[name] = flow.failed.get(name, "its output reaches no other layer through ops a slice can run")
    regions.sort(key=lambda r: order.index(next(iter(r.columns))))
    return Found(regions, unpaired, orientation, not_affine)


def _accept(flow: Flow, rows: dict[str, tuple[frozenset[str], Any]], order: list[str],
            not_affine: dict[str, str]) -> tuple[dict[str, frozenset[str]], dict[str, str]]:
    """The row layers that can be split, each with the column layers feeding it, and why the others cannot.

    In forward order, a row is taken unless a layer feeding it is already a row (its output is whole) or it
    already feeds one. A column whose output also reaches a row that is not taken, or meets an op a slice
    cannot run, would hand a slice to code expecting the whole tensor: every row it feeds is dropped, and
    so on until nothing changes.
    """
    accepted: dict[str, frozenset[str]] = {}
    unpaired: dict[str, str] = {}
    roles: dict[str, str] = {}
    for row in sorted(rows, key=order.index):
        sources = rows[row][0]
        if roles.get(row) == "column" or row in sources or any(roles.get(s) == "row" for s in sources):
            unpaired[row] = "the layers feeding it are split otherwise"
            continue
        accepted[row] = sources
        roles[row] = "row"
        roles.update({s: "column" for s in sources})
    while True:
        columns = {s for sources in accepted.values() for s in sources}
        bad = {c: flow.failed[c] for c in columns if c in flow.failed}
        bad |= {c: not_affine[c] for c in columns if c in not_affine}
        bad |= {s: f"its output also reaches {r}, which stays whole" for r, (sources, _) in rows.items()
                if r not in accepted for s in sources if s in columns}
        dropped = {r: next(f"{s} {bad[s]}" for s in sorted(sources) if s in bad)
                   for r, sources in accepted.items() if sources & bad.keys() or r in not_affine}
        if not dropped:
            return accepted, unpaired
        for row, why in dropped.items():
            for name in accepted.pop(row) | {row}:
                unpaired.setdefault(name, f"the split would not hold: {why}" if why else not_affine.get(name, ""))


def _components(accepted: dict[str, frozenset[str]]) -> list[tuple[set[str], set[str]]]:
    """Row layers joined when they share a column layer: each component splits together."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for row, sources in accepted.items():
        for source in sources:
            parent[find(source)] = find(row)
    groups: dict[str, tuple[set[str], set[str]]] = collections.defaultdict(lambda: (set(), set()))
    for row, sources in accepted.items():
        groups[find(row)][1].add(row)
        groups[find(row)][0].update(sources)
    return list(groups.values())


def _width(module: nn.Module, orientation: str, out: bool) -> int:
    rows_, cols_ = module.weight.shape
    if orientation == "transposed":
        rows_, cols_ = cols_, rows_
    return rows_ if out else cols_


def _ordered(blocks: dict[str, tuple[int, ...]], order: list[str]) -> dict[str, tuple[int, ...]]:
    return dict(sorted(blocks.items(), key=lambda kv: order.index(kv[0])))


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    # a layer is not its own region: the region runs the layers, so it is a module above them
    if len(common) == max(len(p) for p in parts):
        common = common[:-1]
    return ".".join(common)


def attach(model: nn.Module, region: Region, parts: int, rank: int, group: Any = None) -> None:
    """Make the split model run ``region``'s ops on each rank's slice: a :class:`Flow` (running) is active
    during the region module's forward, the column layers' outputs are marked split, and the row layers check
    that their input is the slice they hold.

    Example:
        >>> attach(model, Region("h.0.attn", {"h.0.attn.c_attn": (64, 64, 64)}, {"h.0.attn.c_proj": (64,)},
        ...                      flow=True), parts=2, rank=0)
    """
    flow = Flow(parts, local=True, rank=rank, group=group)
    flow.elementwise = set(region.elementwise)
    owner = model.get_submodule(region.module)
    def enter(module: nn.Module, args: tuple) -> None:
        flow.__enter__()

    def leave(module: nn.Module, args: tuple, out: Any) -> None:
        flow.__exit__(None, None, None)

    owner.register_forward_pre_hook(enter)
    owner.register_forward_hook(leave, always_call=True)
    for name, blocks in region.columns.items():
        def mark(module: nn.Module, args: tuple, out: torch.Tensor, blocks: tuple[int, ...] = blocks) -> None:
            flow.tag(out, Split(out.dim() - 1, blocks))
        model.get_submodule(name).register_forward_hook(mark)
    for name, blocks in region.rows.items():
        def check(module: nn.Module, args: tuple, name: str = name, blocks: tuple[int, ...] = blocks) -> None:
            flow.opaque += 1
            split = flow.split_of(args[0]) if args else None
            if split != Split(args[0].dim() - 1, blocks):
                raise RuntimeError(f"model parallelism: the input of {name} is not the slice the plan expects "
                                   f"(last dimension split in blocks {list(blocks)}), but {split}; the forward "
                                   f"took another path than on the sample batch the plan was made from")

        def done(module: nn.Module, args: tuple, out: Any) -> None:
            flow.opaque -= 1
        layer = model.get_submodule(name)
        layer.register_forward_pre_hook(check)
        layer.register_forward_hook(done, always_call=True)
