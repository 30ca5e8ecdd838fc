"""Megatron pairs from a recorded forward: column layers -> elementwise ops -> a row layer.

Used by the planner when torch.fx cannot trace the model (it reads an
:class:`autodist.observe.Observation`). A layer B pairs with the layers
feeding it when everything between their outputs and B's input is elementwise:
ops torch tags pointwise, whose other operands are scalars, and whose results
go nowhere else (not to another op, not to the model's output). Then the
feeding layers can be split by output features and B by input features, and
the ops between run on each rank's slice unchanged - ``gelu(fc(x))``, GPT-2's
tanh GELU written out in Python, and gated MLPs ``silu(gate(x)) * up(x)`` alike.
Dropout with p > 0 between them breaks the pair (its mask on a slice would not
be the single-process one's slice); with p = 0 it runs no op.
"""
from __future__ import annotations

from dataclasses import dataclass

from autodist.observe import Observation


@dataclass(frozen=True)
class Pair:
    columns: tuple[str, ...]  # the layers feeding the region, split by output features
    row: str  # the layer after it, split by input features
    ops: tuple[str, ...]  # the elementwise ops between, in order


def find_pairs(seen: Observation, layers: dict[str, int]) -> tuple[list[Pair], dict[str, str]]:
    """Pairs among ``layers`` (name -> id of a module called once), and why the rest did not pair.

    Example:
        >>> pairs, why = find_pairs(seen, {"mlp.c_fc": id(fc), "mlp.c_proj": id(proj)})
        >>> pairs[0].columns, pairs[0].row
        (('mlp.c_fc',), 'mlp.c_proj')
    """
    by_output = {seen.calls[m][0].output: name for name, m in layers.items() if seen.calls[m][0].output is not None}
    order = sorted(layers, key=lambda n: _first_op(seen, layers[n]))
    pairs: list[Pair] = []
    taken: set[str] = set()
    why: dict[str, str] = {}
    for row in order:
        if row in taken:
            continue
        found = _region(seen, layers[row], by_output)
        if isinstance(found, str):
            why[row] = found
            continue
        columns, ops = found
        if row in columns or taken.intersection(columns):
            why[row] = "the layers feeding it are already split in another pair"
            continue
        pairs.append(Pair(tuple(sorted(columns, key=order.index)), row, tuple(seen.ops[i].name for i in ops)))
        taken.update(columns, {row})
    return pairs, why


def _first_op(seen: Observation, module: int) -> int:
    return next((i for i, op in enumerate(seen.ops) if module in op.scope), len(seen.ops))


def _region(seen: Observation, row: int, by_output: dict[int, str]) -> tuple[set[str], list[int]] | str:
    """The layers feeding ``row``'s input through elementwise ops only, and those ops; or why not."""
    start = seen.calls[row][0].input
    if start is None:
        return "its input is not a tensor"
    columns: set[str] = set()
    ops: set[int] = set()
    inner: set[int] = set()  # tensors between the column layers' outputs and the row layer's input
    todo = [start]
    while todo:
        tensor = todo.pop()
        if tensor in inner:
            continue
        inner.add(tensor)
        if tensor in by_output:
            columns.add(by_output[tensor])
            continue
        index = seen.producer.get(tensor)
        if index is None:
            return "its input does not come from another layer"
        op = seen.ops[index]
        if not op.pointwise:
            return f"its input comes from {op.name}, not only elementwise ops on another layer's output"
        ops.add(index)
        todo += [t for t in op.inputs if t not in seen.scalar]  # a scalar operand broadcasts over any slice
    for tensor in inner:
        escape = _escape(seen, tensor, ops, row)
        if escape:
            return f"a value between it and the layers feeding it {escape}"
    return columns, sorted(ops)


def _escape(seen: Observation, tensor: int, region: set[int], row: int) -> str:
    """How ``tensor`` is used outside the region and the row layer ("" if it is not). A detach is followed:
    autograd detaches the tensors it saves for backward, and those are no use."""
    if tensor in seen.outputs:
        return "is part of the model's output"
    for use in seen.consumers.get(tensor, []):
        op = seen.ops[use]
        if use in region or row in op.scope:
            continue
        if op.name == "aten.detach.default":
            found = next((e for e in (_escape(seen, t, region, row) for t in op.outputs) if e), "")
            if found:
                return found
            continue
        return f"is also read by {op.name}" + (f" at {op.where}" if op.where else "")
    return ""
