"""Planning a model torch.fx can trace, with Megatron-LM's pattern.

A selected Linear whose only use is a chain of elementwise ops (tanh, relu,
...) ending in another selected Linear forms a *pair*: the first is split by
output features (column), the elementwise ops run on the local slice, the
second is split by input features (row). The activation between them never
leaves its rank, and the pair costs one all-reduce forward (after the row
layer) and one backward (before the column layer) - none at all when the
column layer is the network's first, whose input needs no gradient (autograd
then records no communication; an input that does need one, for a saliency
map, still gets its exact gradient). A selected Linear outside any pair
becomes a full-in/full-out ``MPBaseLinear``, unless it is small (fewer than
64 input or output features, like an output layer over 10 classes): then two
collectives a step would buy almost no memory, so it stays replicated unless
named in ``mp_layers``. Anything else between two Linears - a reshape,
dropout, a second use of the activation - keeps the tensor whole here, never
a silent shape error (with a sample batch, :mod:`autodist.mp.recorded_plan`
follows such ops through a forward, and its plan is taken when it pairs
more). A Linear the plan cannot split stays replicated and the plan says why.
"""
from __future__ import annotations

import collections
import traceback
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autodist.mp.plans import HOOKED, LayerPlan, count_params, hooked, linear_row

_ELEMENTWISE_MODULES = (nn.Tanh, nn.ReLU, nn.GELU, nn.Sigmoid, nn.SiLU, nn.Identity)
_ELEMENTWISE_FUNCTIONS = {torch.tanh, F.tanh, torch.relu, F.relu, F.gelu, torch.sigmoid, F.sigmoid, F.silu}
_ELEMENTWISE_METHODS = {"tanh", "relu", "sigmoid"}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten}
_LINEAR_FUNCTIONS = {F.linear, torch._C._nn.linear}
# An unpaired Linear costs two collectives per step (all-reduce out, all-gather in); below this many
# features on either side (an output layer over 10 classes, say) it saves too little memory to pay.
SMALL_UNPAIRED = 64
_RESHAPE_METHODS = {"view", "reshape", "flatten"}


def where_tracing_stopped(err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/torch/" not in f.filename.replace("\\", "/")]
    if not frames:
        return str(err)
    f = frames[-1]
    return f"{type(err).__name__}: {err} (at {f.filename}:{f.lineno}: {f.line})"

class Planner:
    """Walks the traced graph and decides a role for each Linear module."""

    def __init__(self, model: nn.Module, graph: fx.Graph, mp: int, selected: Callable[[str, nn.Module], bool],
                 explicit: bool = False, functions: str = ""):
        self.model, self.graph, self.mp, self.selected = model, graph, mp, selected
        self.explicit = explicit  # the user named the layers: split them even where it does not pay
        self.functions_blocked = functions  # why F.linear sites must stay as they are ("" if they need not)
        self.modules = dict(model.named_modules())
        calls = [n.target for n in graph.nodes if n.op == "call_module"]
        self.calls = collections.Counter(calls)
        self.direct_uses = {str(n.target).rsplit(".", 1)[0] for n in graph.nodes if n.op == "get_attr"}
        # a parameter registered in two modules is tied: splitting one owner would silently untie it
        self.owners = collections.Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
        self.role: dict[str, str] = {}  # module name -> "column" | "row" | "full"
        self.first: set[str] = set()  # column/full layers whose input needs no gradient
        self.local: list[fx.Node] = []  # elementwise nodes that run on a slice
        self.kept_whole: dict[str, str] = {}  # module name -> why it stayed replicated
        self.nodes: dict[str, fx.Node] = {}  # planned name -> its node
        self.swaps: dict[str, str] = {}  # module name -> MP layer it becomes ("MPTanh", "MPInitialReshape", ...)

    def _module(self, node: fx.Node) -> nn.Module | None:
        return self.modules.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]

    def site(self, node: fx.Node) -> tuple[str, nn.Linear] | None:
        """(name, Linear) for an nn.Linear call or an F.linear call on parameters; None otherwise.

        An F.linear site is named after its weight and described by a Linear on
        the meta device (shapes only).
        """
        module = self._module(node)
        if isinstance(module, nn.Linear):
            return str(node.target), module
        if node.op != "call_function" or node.target not in _LINEAR_FUNCTIONS:
            return None
        weight, bias = linear_args(node)
        if not (_is_param_attr(self.model, weight) and (bias is None or _is_param_attr(self.model, bias))):
            return None
        out_features, in_features = self.model.get_parameter(weight.target).shape  # type: ignore[union-attr]
        return str(weight.target), nn.Linear(in_features, out_features, bias is not None, device="meta")  # type: ignore

    def candidate(self, node: fx.Node) -> bool:
        """A selected Linear, called once, whose weight nothing else touches."""
        found = self.site(node)
        if found is None:
            return False
        name, module = found
        if node.op == "call_function":
            attrs = [a for a in linear_args(node) if a is not None]
            owners = {str(a.target).rpartition(".")[0] for a in attrs}
            shared = any(len(a.users) > 1 for a in attrs) or bool(owners & set(self.calls)) \
                or any(self.owners[id(self.model.get_parameter(str(a.target)))] > 1 for a in attrs)
        else:
            shared = name in self.direct_uses or any(self.owners[id(p)] > 1 for p in module.parameters())
        if node.op == "call_function" and self.functions_blocked:
            self.kept_whole[name] = self.functions_blocked
        elif not self.selected(name, module):
            self.kept_whole[name] = "not selected by mp_layers"
        elif node.op == "call_module" and self.calls[name] > 1:
            self.kept_whole[name] = "called more than once in forward"
        elif hooked(module):
            self.kept_whole[name] = HOOKED
        elif shared:
            self.kept_whole[name] = "its weight is shared or used outside the layer"
        elif min(module.in_features, module.out_features) < self.mp:
            self.kept_whole[name] = f"a dimension smaller than mp={self.mp}"
        else:
            return True
        return False

    def needs_grad(self, node: fx.Node, seen: dict | None = None) -> bool:
        """Whether a value depends on parameters (so its gradient is wanted); inputs count as not."""
        seen = {} if seen is None else seen
        if node in seen:
            return seen[node]
        if node.op == "placeholder":
            result = False
        elif node.op == "get_attr":
            result = _is_param_attr(self.model, node)
        elif node.op == "call_module" and any(True for _ in self._module(node).parameters()):  # type: ignore
            result = True
        else:
            result = any(self.needs_grad(a, seen) for a in node.all_input_nodes)
        seen[node] = result
        return result

    def _elementwise(self, node: fx.Node, source: fx.Node) -> bool:
        if node.all_input_nodes != [source]:
            return False
        if node.op == "call_module":
            return isinstance(self._module(node), _ELEMENTWISE_MODULES)
        if node.op == "call_function":
            return node.target in _ELEMENTWISE_FUNCTIONS
        return node.op == "call_method" and node.target in _ELEMENTWISE_METHODS

    def _pair_end(self, start: fx.Node) -> tuple[fx.Node | None, list[fx.Node], str]:
        """Follow start's single-use chain of elementwise ops to the next candidate Linear."""
        chain, current = [], start
        while True:
            users = list(current.users)
            if len(users) != 1:
                return None, [], "its output is used in more than one place"
            user = users[0]
            if self._elementwise(user, current):
                chain.append(user)
                current = user
                continue
            found = self.site(user)
            if found is not None and linear_input(user) is current and self.candidate(user) \
                    and found[0] not in self.role:
                return user, chain, ""
            return None, [], f"followed by {_describe(user, self.modules)}"

    def plan(self) -> None:
        for node in self.graph.nodes:
            found = self.site(node)
            if found is None or found[0] in self.role or not self.candidate(node):
                continue
            name, linear = found
            end, chain, why = self._pair_end(node)
            why = f"unpaired ({why})" if why else "unpaired"
            if end is None and not self.explicit and min(linear.in_features, linear.out_features) < SMALL_UNPAIRED:
                saved = count_params(linear) - linear_row(name, linear, "full", False, self.mp, "").params_per_rank
                self.kept_whole[name] = (f"{why} and small: splitting it would add 2 collectives per step to save "
                                         f"{saved:,} parameters per rank; name it in mp_layers to split it anyway")
                continue
            self.nodes[name] = node
            if not self.needs_grad(linear_input(node)):
                self.first.add(name)
            if end is None:
                self.role[name] = "full"
                self.kept_whole[name] = why
                continue
            end_name = self.site(end)[0]  # type: ignore[index]
            self.nodes[end_name] = end
            self.role[name], self.role[end_name] = "column", "row"
            self.local += chain
        self._plan_swaps()

    def _plan_swaps(self) -> None:
        """nn.Tanh on a slice becomes MPTanh; nn.Flatten() feeding a split Linear becomes an MP reshape."""
        for node in self.local:
            if isinstance(self._module(node), nn.Tanh):
                self.swaps[str(node.target)] = "MPTanh"
        for name, linear_node in self.nodes.items():
            source = linear_input(linear_node)
            module = self._module(source)
            if isinstance(module, nn.Flatten) and (module.start_dim, module.end_dim) == (1, -1) \
                    and self.calls[str(source.target)] == 1:
                first = not self.needs_grad(source.all_input_nodes[0])
                self.swaps[str(source.target)] = "MPInitialReshape" if first else "MPBaseReshape"

def linear_args(node: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(weight, bias) argument nodes of an F.linear call."""
    args = list(node.args) + [None] * 3
    bias = node.kwargs.get("bias", args[2])
    return node.kwargs.get("weight", args[1]), bias  # type: ignore[return-value]

def linear_input(node: fx.Node) -> fx.Node:
    return node.args[0] if node.args else node.kwargs["input"]  # type: ignore[return-value]

def _is_param_attr(model: nn.Module, node: object) -> bool:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    try:
        model.get_parameter(str(node.target))
    except AttributeError:
        return False
    return True

def _describe(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    if node.op == "call_module":
        return f"{type(modules[node.target]).__name__} '{node.target}'"  # type: ignore[index]
    if node.op == "output":
        return "the model's output"
    target = getattr(node.target, "__name__", node.target)
    return f"{node.op.replace('call_', '')} '{target}'"

def plan_rows(planner: Planner, graph: fx.Graph) -> list[LayerPlan]:
    rows: list[LayerPlan] = []
    local = set(planner.local)
    for node in graph.nodes:
        module = planner._module(node)
        found = planner.site(node)
        if found is not None:
            name, linear = found
            row = (linear_row(name, linear, planner.role[name], name in planner.first, planner.mp,
                               planner.kept_whole.get(name, "")) if name in planner.role else
                   LayerPlan(name, "Linear", "replicated", count_params(linear), count_params(linear), [],
                             planner.kept_whole.get(name, "")))
            if node.op == "call_function":
                row.op = "F.linear"
            rows.append(row)
        elif module is not None and any(True for _ in module.parameters()):
            n = sum(p.numel() for p in module.parameters())
            holds_attention = any(isinstance(m, nn.MultiheadAttention) for m in module.modules())
            rows.append(LayerPlan(str(node.target), type(module).__name__, "replicated", n, n, [],
                                  "holds nn.MultiheadAttention, which is split by heads from a forward on a sample "
                                  "batch: pass data (or example=) to parallelize" if holds_attention else
                                  "only Linear layers are split"))
        elif node in local:
            rows.append(LayerPlan(_node_name(node), _op_name(node, module, planner.swaps), "local",
                                  note="on the local slice"))
        elif _is_reshape(node, module) or isinstance(module, nn.Tanh) or \
                (node.op != "call_module" and node.target in (torch.tanh, F.tanh)) or node.target == "tanh":
            rows.append(LayerPlan(_node_name(node), _op_name(node, module, planner.swaps), "replicated",
                                  note="full tensor, no communication"))
    return rows

def _node_name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_module" else node.name

def _op_name(node: fx.Node, module: nn.Module | None, swaps: dict[str, str]) -> str:
    if module is not None:
        swap = swaps.get(str(node.target))
        return type(module).__name__ + (f" -> {swap}" if swap else "")
    return getattr(node.target, "__name__", str(node.target))

def _is_reshape(node: fx.Node, module: nn.Module | None) -> bool:
    return isinstance(module, nn.Flatten) or (node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS) \
        or (node.op == "call_method" and node.target in _RESHAPE_METHODS)

def depends_on_training(model: nn.Module, graph: fx.Graph) -> bool:
    """Whether tracing in the other mode gives other code (``F.dropout(x, p, self.training)``, say)."""
    was_training = model.training
    try:
        model.train(not was_training)
        other = fx.Tracer().trace(model)
    finally:
        model.train(was_training)
    return str(other) != str(graph)
