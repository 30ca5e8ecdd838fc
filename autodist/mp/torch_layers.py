"""Planning for torch's own layers that read their weights inside their forward: ``nn.MultiheadAttention``
and the Transformer layers built on it.

``nn.MultiheadAttention`` applies its packed ``in_proj_weight`` and its
``out_proj`` inside ``F.multi_head_attention_forward``: no Linear of it runs as
a module, so it is split as a whole, by heads
(:class:`autodist.layers.attention.MPMultiheadAttention`). The Linears of a
``TransformerEncoderLayer`` (``linear1 -> activation -> dropout -> linear2``)
are ordinary candidates once the layer's fused fast path, which reads every
weight itself in inference, is off - which the split attention does; while
the attention stays whole they stay whole too. ``TransformerDecoderLayer``
has no fast path. An ``nn.TransformerEncoder`` holding split layers stops
converting padded batches to nested tensors (a fast path of its own, with
the same result).
"""
from __future__ import annotations

import collections
from typing import Callable

from torch import nn

from autodist.layers.attention import why_not_split
from autodist.mp.observe import Observation


def attention_modules(model: nn.Module) -> dict[str, nn.MultiheadAttention]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention) and name}


def plan_attention(model: nn.Module, mp: int, selected: Callable[[str, nn.Module], bool],
                   seen: Observation) -> tuple[dict[str, nn.MultiheadAttention], dict[str, str]]:
    """The attention modules to split by heads, and why each other one stays whole."""
    owners = collections.Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    split, kept = {}, {}
    for name, module in attention_modules(model).items():
        calls = len(seen.calls.get(id(module), []))
        outside = seen.reads_outside(module)
        why = why_not_split(module, mp)
        if not selected(name, module):
            kept[name] = "not selected by mp_layers"
        elif any(owners[id(p)] > 1 for p in module.parameters(recurse=False)):
            kept[name] = "weights shared with another layer"
        elif any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in module.modules()):
            kept[name] = "it has hooks, which swapping the module would drop"
        elif why is not None:
            kept[name] = why
        elif not calls:
            kept[name] = "not run by the forward on the sample batch"
        elif outside is not None:
            kept[name] = f"the model reads its parameters outside the module ({outside}), which would see a shard"
        else:
            split[name] = module
    return split, kept


def linear_kept(model: nn.Module, name: str, heads: dict[str, nn.MultiheadAttention]) -> str | None:
    """Why a Linear-like layer inside one of torch's own layers must stay whole (None: it may be split)."""
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name)
    if isinstance(parent, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) or \
            not type(parent).__module__.startswith("torch.nn"):
        return None
    if isinstance(parent, nn.TransformerDecoderLayer):
        return None
    if isinstance(parent, nn.TransformerEncoderLayer):
        attention = f"{parent_name}.self_attn"
        if attention in heads:
            return None
        return (f"{type(parent).__name__}'s fused inference path reads its weights itself, and its attention "
                f"stays whole")
    return f"inside {type(parent).__name__}, whose forward reads its weights itself"


def attention_collectives(module: nn.MultiheadAttention, seen: Observation) -> list[tuple[str, str, int]]:
    """One call's collectives: the out_proj all-reduce forward, and one backward all-reduce per distinct input
    needing a gradient (one for self-attention, two for cross-attention on (x, memory))."""
    call = seen.calls[id(module)][0]
    e = module.embed_dim
    return [("forward", "all-reduce", e)] + [("backward", "all-reduce", e)] * call.grad_inputs


def swap_attention(model: nn.Module, name: str, group: object | None) -> None:
    """Replace the attention module ``name`` by its split-by-heads version; encoders holding it stop making
    nested tensors (whose fast path reads the dense weights)."""
    from autodist.layers.attention import MPMultiheadAttention

    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, MPMultiheadAttention.from_dense(model.get_submodule(name), group=group))
    for module_name, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoder) and name.startswith(module_name + "."):
            module.use_nested_tensor = False
