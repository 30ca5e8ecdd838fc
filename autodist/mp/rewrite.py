"""Plan how to split a model over a model-parallel group, and swap in the MP layers.

:func:`plan` traces the model with torch.fx and pairs Linears the Megatron-LM
way (:mod:`autodist.mp.fx_plan`); a model fx cannot trace, or whose attention a
trace cannot see, is planned from one recorded forward on a sample batch
(:mod:`autodist.mp.recorded_plan`). :func:`apply` makes the swap, in place:
planned layers are replaced at their own qualified names, so parameter names
(and ``gather_state_dict``) stay those of the original model.
"""
from __future__ import annotations

import types
from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch import nn

from autodist.mp import observe, regions, torch_layers
from autodist.mp.fx_plan import Planner, depends_on_training, linear_args, linear_input, plan_rows
from autodist.mp.plans import LayerPlan, MPLayers, Rewrite, SplitPlan, outside_of
from autodist.mp.recorded_plan import plan_recorded

__all__ = ["LayerPlan", "MPLayers", "SplitPlan", "Rewrite", "plan", "apply", "explain", "mp_modules", "check_selection"]

def _selector(mp_layers: MPLayers) -> Callable[[str, nn.Module], bool]:
    if isinstance(mp_layers, str) and mp_layers == "all":
        return lambda name, module: True
    if callable(mp_layers):
        return mp_layers
    if not isinstance(mp_layers, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in mp_layers):
        raise ValueError(f"mp_layers must be 'all', a list of layer names or a callable (name, module) -> bool, "
                         f"got {mp_layers!r}")
    wanted = set(mp_layers)
    return lambda name, module: name in wanted

def check_selection(model: nn.Module, mp_layers: MPLayers) -> None:
    """mp_layers is 'all', a callable, or names of the model's Linear (or attention) layers."""
    _selector(mp_layers)
    if isinstance(mp_layers, (list, tuple, set)):
        linears = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.MultiheadAttention))}
        unknown = sorted(set(mp_layers) - linears)
        if unknown:
            raise ValueError(f"mp_layers names {unknown} that are not nn.Linear (or nn.MultiheadAttention) layers "
                             f"of the model; its Linear layers are {sorted(linears)}")

def plan(model: nn.Module, mp: int, mp_layers: MPLayers = "all", batch_size: int | None = None,
         example: observe.Example | None = None) -> Rewrite:
    """Trace ``model`` (or, failing that, record a forward on ``example``) and decide each Linear's split;
    nothing is changed yet. The plan also names the modules whose own parameters no row covers (kept whole)."""
    result = _plan(model, mp, mp_layers, batch_size, example)
    result.plan.outside = outside_of(model, result.plan.layers)
    return result


def _plan(model: nn.Module, mp: int, mp_layers: MPLayers, batch_size: int | None,
          example: observe.Example | None) -> Rewrite:
    check_selection(model, mp_layers)
    selected = _selector(mp_layers)
    explicit = isinstance(mp_layers, (list, tuple, set))
    # no example given or taken from the data: the model's own sample inputs, if it carries any (Hugging Face)
    example = observe.model_example(model) if example is None else observe.complete(model, example)
    try:
        graph = fx.Tracer().trace(model)
    except Exception as err:  # noqa: BLE001 - any tracing failure means: fall back or explain
        result = plan_recorded(model, mp, selected, err, example)
        result.plan.batch_size = batch_size
        return result
    planner = Planner(model, graph, mp, selected, explicit)
    planner.plan()
    if any(n.op == "call_function" for n in planner.nodes.values()) and depends_on_training(model, graph):
        why = "F.linear in a forward that depends on model.training: rewriting it would freeze the mode"
        planner = Planner(model, graph, mp, selected, explicit, functions=why)
        planner.plan()
    traced = Rewrite(SplitPlan(mp, plan_rows(planner, graph), batch_size=batch_size), planner.role, planner.first,
                     graph, planner.nodes, planner.swaps)
    attention = bool(torch_layers.attention_modules(model))
    if ("full" in planner.role.values() or attention) and not planner.swaps \
            and not any(n.op == "call_function" for n in planner.nodes.values()):
        if example is None:  # a sample could change the plan: never print or apply one it would not be
            raise ValueError(
                f"the model-parallel plan of {type(model).__name__} depends on one forward on a sample batch "
                f"(the trace sees {'attention layers' if attention else 'Linear layers'} as a whole; following a "
                f"forward can split {'them by heads' if attention else 'them in pairs'}): pass "
                f"example=(args...) or example={{kwargs}} with the arguments your training loop gives the model "
                f"(to explain as to parallelize), or give parallelize its data")
        # The graph pairs only Linears joined by elementwise ops, and sees torch's own layers as leaves;
        # following the split through a forward also pairs attention (heads) and splits nn.MultiheadAttention
        # - take that plan when it splits more layers in pairs.
        try:
            recorded = plan_recorded(model, mp, selected, None, example)
        except (ValueError, NotImplementedError):
            return traced
        paired = sum(role in ("column", "row", "heads") for role in recorded.roles.values())
        traced_paired = sum(role in ("column", "row") for role in planner.role.values())
        if paired > traced_paired or (attention and paired == traced_paired):  # its rows say why attention stays
            recorded.plan.batch_size, recorded.plan.traced = batch_size, True
            return recorded
    return traced

def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)

def _mp_layer(linear: nn.Module, role: str, group: object | None, blocks: tuple[int, ...] | None = None,
              transposed: bool = False) -> nn.Module:
    """The split layer for a role. A first layer needs no special class: its input, needing no gradient, makes
    autograd record no backward communication, and an input that does need one (saliency) still gets it exact."""
    from autodist.layers import ColumnParallelLinear, MPBaseLinear, RowParallelLinear

    if role == "column":
        return ColumnParallelLinear.from_dense(linear, group=group, blocks=blocks, transposed=transposed)
    if role == "row":
        return RowParallelLinear.from_dense(linear, group=group, blocks=blocks, transposed=transposed)
    return MPBaseLinear.from_dense(linear, group=group, transposed=transposed)

def _join_regions(model: nn.Module, found: list[regions.Region], group: object | None) -> None:
    """Columns of a region share one entry into the group; regions whose ops need it follow the split."""
    from autodist.layers.comm import group_rank_size
    from autodist.layers.linear import SharedInput

    rank, parts = group_rank_size(group)
    for region in found:
        entry = SharedInput(len(region.columns))
        for name in region.columns:
            model.get_submodule(name).entry = entry
        if region.flow:
            regions.attach(model, region, parts, rank, group)

def _elementwise_layer(name: str) -> nn.Module:
    from autodist import layers

    return layers.MPTanh() if name == "MPTanh" else getattr(layers, name)(-1)

def _replace_function_site(model: nn.Module, graph: fx.Graph, node: fx.Node, layer: nn.Module) -> None:
    """F.linear(x, self.w, self.b) -> self.mp_w(x); the dense parameters leave their owner."""
    weight, bias = linear_args(node)
    name = "mp_" + str(weight.target).replace(".", "_")
    layer.dense_names = {"weight": str(weight.target)} | ({"bias": str(bias.target)} if bias is not None else {})
    model.add_module(name, layer)
    with graph.inserting_before(node):
        call = graph.call_module(name, (linear_input(node),))
    node.replace_all_uses_with(call)
    graph.erase_node(node)
    for attr in (weight, bias):
        if attr is not None:
            graph.erase_node(attr)
            owner_name, _, param = str(attr.target).rpartition(".")
            delattr(model.get_submodule(owner_name), param)

def apply(model: nn.Module, rewrite: Rewrite, group: object | None) -> list[tuple[nn.Parameter, str]]:
    """Swap the planned layers for MP layers in place; returns the (parameter, name) pairs that were replaced.

    nn.Linear modules are replaced at their own names. F.linear calls need the
    forward itself changed: the rewritten graph's code becomes ``model.forward``
    (only planned when the forward does not depend on ``model.training``; forward
    hooks of submodules the trace went through no longer run).
    """
    replaced: list[tuple[nn.Parameter, str]] = []
    functions = False
    for name, role in rewrite.roles.items():
        if role == "heads":
            replaced += [(p, f"{name}.{n}") for n, p in model.get_submodule(name).named_parameters()]
            torch_layers.swap_attention(model, name, group)
            continue
        node = rewrite.nodes.get(name)
        if node is None or node.op == "call_module":
            linear = model.get_submodule(name)
            replaced += [(p, f"{name}.{n}") for n, p in linear.named_parameters()]
            blocks = next((r.columns.get(name) or r.rows.get(name) for r in rewrite.regions
                           if name in r.columns or name in r.rows), None)
            _swap(model, name, _mp_layer(linear, role, group, blocks, rewrite.orientation.get(name) == "transposed"))
            continue
        weight, bias = linear_args(node)
        w = model.get_parameter(str(weight.target))
        b = model.get_parameter(str(bias.target)) if bias is not None else None
        dense = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            dense.weight.copy_(w)
            if b is not None:
                dense.bias.copy_(b)
        replaced += [(w, str(weight.target))] + ([(b, str(bias.target))] if b is not None else [])
        _replace_function_site(model, rewrite.graph, node, _mp_layer(dense, role, group))
        functions = True
    for name, layer in rewrite.swaps.items():
        _swap(model, name, _elementwise_layer(layer))
    _join_regions(model, rewrite.regions, group)
    if functions:
        rewrite.graph.lint()  # type: ignore[union-attr]
        code = fx.GraphModule(model, rewrite.graph)
        model.forward = types.MethodType(type(code).forward, model)  # type: ignore[method-assign]
    return replaced

def explain(model: nn.Module, mp: int, mp_layers: MPLayers = "all", batch_size: int | None = None,
            example: observe.Example | None = None) -> SplitPlan:
    """What ``parallelize(model, mp=mp)`` would do, without running anything or needing a process group.

    Args:
        model: the single-process model.
        mp: the model-parallel degree.
        mp_layers: "all", a list of Linear layer names, or a callable (name, module) -> bool.
        batch_size: rows each Linear sees per step, to turn the bytes per row into bytes per step: the
            batch size for (batch, features) inputs, batch x sequence length for (batch, seq, features).
        example: for a model torch.fx cannot trace, the arguments of one forward (a tuple of positional
            ones, a dict of keyword ones, or one tensor): the plan is then read from that forward.

    Returns:
        A :class:`SplitPlan`; ``print`` it for the table.

    Example:
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(1024, 2048), nn.Tanh(), nn.Linear(2048, 10))
        >>> print(autodist.explain(net, mp=2, batch_size=128))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found")
    if not isinstance(mp, int) or isinstance(mp, bool) or mp < 1:
        raise ValueError(f"mp must be a positive int, got {mp!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int (rows through each Linear per step) or None, "
                         f"got {batch_size!r}")
    observe.check_example(example)
    return plan(model, mp, mp_layers, batch_size, example).plan

def mp_modules(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """The model-parallel layers inside ``model`` (hand-placed or swapped in), with their names; also those of a
    block another pipeline stage holds, in the stand-in's ``skeleton`` (on the meta device: their names and
    shards, whose values ``state_dict()`` brings from that stage)."""
    found = []
    for name, module in model.named_modules():
        if callable(getattr(module, "dense_state", None)):
            found.append((name, module))
        skeleton = module.__dict__.get("skeleton")
        if isinstance(skeleton, nn.Module):
            found += [(f"{name}.{inner}" if inner else name, layer) for inner, layer in skeleton.named_modules()
                      if callable(getattr(layer, "dense_state", None))]
    return found
