"""torch.fx: find the Linear layers, choose how to split them, swap in the MP layers.

Planning (Megatron-LM's pattern). A selected Linear whose only use is a chain
of elementwise ops (tanh, relu, ...) ending in another selected Linear forms a
*pair*: the first is split by output features (column), the elementwise ops
run on the local slice, the second is split by input features (row). The
activation between them never leaves its rank, and the pair costs one
all-reduce forward (after the row layer) and one backward (before the column
layer) - none at all when the column layer is the network's first, whose
input needs no gradient (autograd then records no communication; an input
that does need one, for a saliency map, still gets its exact gradient). A
selected Linear outside any pair becomes a full-in/full-out ``MPBaseLinear``,
unless it is small (fewer than 64 input or output features, like an output
layer over 10 classes): then two collectives a step would buy almost no
memory, so it stays replicated unless named in ``mp_layers``. Anything
else between two Linears - a reshape, dropout (its random mask would differ
from one process's), a second use of the activation - keeps the tensor whole:
the pair is not formed, never a silent shape error. A Linear the plan cannot
split stays replicated and the plan says why.

The swap is in place: planned ``nn.Linear`` modules are replaced at their own
qualified names, so parameter names (and ``gather_state_dict``) stay those of
the original model.
"""
from __future__ import annotations

import collections
import traceback
import types
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autodist import observe, regions, torch_layers

MPLayers = Union[str, Sequence[str], Callable[[str, nn.Module], bool]]

_ELEMENTWISE_MODULES = (nn.Tanh, nn.ReLU, nn.GELU, nn.Sigmoid, nn.SiLU, nn.Identity)
_ELEMENTWISE_FUNCTIONS = {torch.tanh, F.tanh, torch.relu, F.relu, F.gelu, torch.sigmoid, F.sigmoid, F.silu}
_ELEMENTWISE_METHODS = {"tanh", "relu", "sigmoid"}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten}
_LINEAR_FUNCTIONS = {F.linear, torch._C._nn.linear}
# An unpaired Linear costs two collectives per step (all-reduce out, all-gather in); below this many
# features on either side (an output layer over 10 classes, say) it saves too little memory to pay.
SMALL_UNPAIRED = 64
_RESHAPE_METHODS = {"view", "reshape", "flatten"}


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
class Plan:
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
        lines.append(f"mp={self.mp}: {self.collectives_per_step} model-parallel collectives per training step; "
                     f"{total:,} parameters per rank in these layers"
                     + ("" if self.traced else f"; model not traceable by torch.fx (stopped at {self.untraced}): "
                                               f"module-by-module swap, collectives counted for one call of each "
                                               f"layer"))
        # a Linear takes every leading dimension as rows: a (B, T, C) activation is B x T rows
        rows_sent = f"{self.batch_size} rows" if self.batch_size else "one row (pass batch_size)"
        lines.append(f"bytes: for {rows_sent} through each Linear; a row is a sample of (batch, features) inputs, "
                     f"so for (batch, seq, features) inputs pass batch_size = batch x seq")
        return "\n".join(lines)


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


def _split_sizes(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def _where_tracing_stopped(err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/torch/" not in f.filename.replace("\\", "/")]
    if not frames:
        return str(err)
    f = frames[-1]
    return f"{type(err).__name__}: {err} (at {f.filename}:{f.lineno}: {f.line})"


class _Planner:
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
        weight, bias = _linear_args(node)
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
            attrs = [a for a in _linear_args(node) if a is not None]
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
        elif _hooked(module):
            self.kept_whole[name] = _HOOKED
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
            if found is not None and _linear_input(user) is current and self.candidate(user) \
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
                saved = _count(linear) - _linear_row(name, linear, "full", False, self.mp, "").params_per_rank
                self.kept_whole[name] = (f"{why} and small: splitting it would add 2 collectives per step to save "
                                         f"{saved:,} parameters per rank; name it in mp_layers to split it anyway")
                continue
            self.nodes[name] = node
            if not self.needs_grad(_linear_input(node)):
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
            source = _linear_input(linear_node)
            module = self._module(source)
            if isinstance(module, nn.Flatten) and (module.start_dim, module.end_dim) == (1, -1) \
                    and self.calls[str(source.target)] == 1:
                first = not self.needs_grad(source.all_input_nodes[0])
                self.swaps[str(source.target)] = "MPInitialReshape" if first else "MPBaseReshape"


def _linear_args(node: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(weight, bias) argument nodes of an F.linear call."""
    args = list(node.args) + [None] * 3
    bias = node.kwargs.get("bias", args[2])
    return node.kwargs.get("weight", args[1]), bias  # type: ignore[return-value]


def _linear_input(node: fx.Node) -> fx.Node:
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


def _linear_row(name: str, linear: nn.Linear, role: str, first: bool, mp: int, note: str) -> LayerPlan:
    dense = _count(linear)
    bias = linear.bias is not None
    out_local = _split_sizes(linear.out_features, mp)[0]
    in_local = _split_sizes(linear.in_features, mp)[0]
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


def _plan_rows(planner: _Planner, graph: fx.Graph) -> list[LayerPlan]:
    rows: list[LayerPlan] = []
    local = set(planner.local)
    for node in graph.nodes:
        module = planner._module(node)
        found = planner.site(node)
        if found is not None:
            name, linear = found
            row = (_linear_row(name, linear, planner.role[name], name in planner.first, planner.mp,
                               planner.kept_whole.get(name, "")) if name in planner.role else
                   LayerPlan(name, "Linear", "replicated", _count(linear), _count(linear), [],
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


def _count(linear: nn.Linear) -> int:
    return sum(p.numel() for p in linear.parameters())


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


@dataclass
class Rewrite:
    """A plan and what applying it needs: each planned layer's role and, when traced, its graph node."""

    plan: Plan
    roles: dict[str, str]  # layer name -> "column" | "row" | "full" | "heads" (nn.MultiheadAttention)
    first: set[str]  # layers whose input needs no gradient
    graph: fx.Graph | None = None
    nodes: dict[str, fx.Node] = field(default_factory=dict)
    swaps: dict[str, str] = field(default_factory=dict)  # module name -> MP layer class name
    regions: list[regions.Region] = field(default_factory=list)  # recorded-forward plans: layers split together
    orientation: dict[str, str] = field(default_factory=dict)  # layer -> "linear" or "transposed" (HF Conv1D)


def _fallback(model: nn.Module, mp: int, selected: Callable[[str, nn.Module], bool], err: BaseException | None,
              example: observe.Example | None) -> Rewrite:
    """torch.fx could not trace: plan from one recorded forward on ``example`` and swap modules one by one.

    The recorded forward (:mod:`autodist.observe`) says how often each
    candidate (a leaf module with a 2-D weight) ran, whether its input needed
    a gradient, and whether any op outside it read its parameters (a rank's
    shard would then be read instead). A second forward follows each
    candidate's output split along its features (:mod:`autodist.regions`):
    it checks that the candidate computes ``x @ W.T + b`` or ``x @ W + b``
    and finds the Megatron regions, attention included. Every other affine
    candidate becomes a full-in/full-out ``MPBaseLinear``, exact whatever the
    forward does with its output. What stays whole: weights shared with
    another layer, layers with hooks, layers inside torch's own layers
    (MultiheadAttention reads its out_proj weight itself), and layers the
    recorded forward did not run or ran twice.
    """
    where = _where_tracing_stopped(err) if err is not None else ""
    if example is None:
        raise ValueError(f"torch.fx cannot trace {type(model).__name__} (tracing stopped at {where}), and autodist "
                         f"then plans model parallelism from one forward on a sample batch: pass data to "
                         f"parallelize (a DataLoader, Dataset or tensors) or example=(args...) / example={{kwargs}}")
    try:
        seen = observe.observe(model, lambda: observe.call(model, example))
    except Exception as run_err:  # noqa: BLE001 - the user must learn how to call the model instead
        raise ValueError(f"torch.fx cannot trace {type(model).__name__}, and its forward on a sample batch failed "
                         f"({type(run_err).__name__}: {run_err}); the sample was called as "
                         f"{_call_form(example)}: pass parallelize(..., example=...) with the arguments your "
                         f"training loop gives the model (a tuple of positional ones, or a dict of keyword ones)"
                         ) from run_err
    owners = collections.Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    attentions = torch_layers.attention_modules(model)
    heads, kept = torch_layers.plan_attention(model, mp, selected, seen)
    linears = {name: module for name, module in model.named_modules() if _affine_shaped(module) and name
               and not any(name.startswith(a + ".") for a in attentions)}  # their attention's row covers them
    for name, module in linears.items():
        calls, outside = len(seen.calls.get(id(module), [])), seen.reads_outside(module)
        inside = torch_layers.linear_kept(model, name, heads)
        if inside is not None:
            kept[name] = inside
        elif not selected(name, module):
            kept[name] = "not selected by mp_layers"
        elif owners[id(module.weight)] > 1:
            kept[name] = "weight shared with another layer"
        elif _hooked(module):
            kept[name] = _HOOKED
        elif min(module.weight.shape) < mp:
            kept[name] = f"a dimension smaller than mp={mp}"
        elif calls != 1:
            kept[name] = "not run by the forward on the sample batch" if not calls else f"called {calls} times"
        elif outside is not None:
            kept[name] = f"the model reads its parameters outside the layer ({outside}), which would see a shard"
    candidates = {name: module for name, module in linears.items() if name not in kept}
    with observe.isolated(model):
        found = regions.find_regions(model, lambda: observe.call(model, example), candidates, mp)
    kept.update(found.not_affine)
    linears = {name: m for name, m in linears.items() if name in found.orientation or name in kept}
    roles = {name: "column" for r in found.regions for name in r.columns} | \
        {name: "row" for r in found.regions for name in r.rows} | {name: "heads" for name in heads}
    first = {name for name in linears if name in found.orientation
             and not seen.calls[id(linears[name])][0].input_needs_grad}
    shared = _shared_inputs(seen, linears, found.regions)
    rows = []
    for name, module in model.named_modules():
        if name in attentions:
            rows.append(_attention_row(name, module, mp, seen) if name in heads else
                        LayerPlan(name, type(module).__name__, "replicated", _count(module), _count(module), [],
                                  kept[name]))
            continue
        if name not in linears:
            continue
        if name in found.orientation and name not in kept and name not in roles:
            roles[name] = "full"
        if name in roles:
            note = "" if roles[name] != "full" else f"unpaired ({found.unpaired.get(name, 'nothing after it pairs')})"
            row = _linear_row(name, _shape_of(module, found.orientation[name]), roles[name],
                              name in first or name in shared, mp, note)
            if name in shared:
                row.note = f"shares the input's backward all-reduce with {shared[name]}"
            row.note = "; ".join(n for n in (row.note, _region_note(name, found.regions)) if n)
            cuts = sum(r.cuts for r in found.regions if name == next(iter(r.rows)))
            if cuts:  # counted on the region's first row layer
                row.collectives += [("backward", "all-gather", 0)] * cuts
                row.note += (f"; each rank takes its heads of {cuts} per-head tensor(s) held whole (an attention "
                             f"bias): one all-gather of their gradient backward each, bytes not counted")
            row.op = type(module).__name__
            rows.append(row)
        else:
            rows.append(LayerPlan(name, type(module).__name__, "replicated", _count(module), _count(module), [],
                                  kept[name]))
    if not roles:
        by_reason: dict[str, list[str]] = collections.defaultdict(list)
        for name, note in kept.items():
            by_reason[note].append(name)
        why = "".join(f"; {', '.join(names)} stay{'s' if len(names) == 1 else ''}: {note}"
                      for note, names in by_reason.items())
        raise NotImplementedError(f"torch.fx cannot trace {type(model).__name__} and no nn.Linear module can be "
                                  f"swapped in its place; tracing stopped at {where}{why}")
    return Rewrite(Plan(mp, rows, traced=False, untraced=where), roles, first, regions=found.regions,
                   orientation=found.orientation)


def _attention_row(name: str, module: nn.MultiheadAttention, mp: int, seen: observe.Observation) -> LayerPlan:
    e, heads = module.embed_dim, module.num_heads
    bias = module.in_proj_bias is not None
    per_rank = (3 * e * e + 3 * e * bias) // mp + e * e // mp + (e if module.out_proj.bias is not None else 0)
    note = (f"split by heads: {heads // mp} of {heads} per rank (its rows of q, k and v; out_proj by input "
            f"features); pass need_weights=False where the weights are unused (as torch's Transformer layers do): "
            f"returning them costs one more all-reduce")
    return LayerPlan(name, "MultiheadAttention", "heads", _count(module), per_rank,
                     torch_layers.attention_collectives(module, seen), note)


def _affine_shaped(module: nn.Module) -> bool:
    """A leaf module holding a 2-D ``weight`` and maybe a 1-D ``bias``, nothing else: maybe an affine layer."""
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.pop("weight", None), params.pop("bias", None)
    return not params and not any(True for _ in module.children()) and weight is not None and weight.dim() == 2 \
        and (bias is None or bias.dim() == 1) and not any(True for _ in module.buffers(recurse=False))


def _shape_of(module: nn.Module, orientation: str) -> nn.Linear:
    """An nn.Linear on the meta device with ``module``'s sizes (shapes only, for the plan's numbers)."""
    out_features, in_features = module.weight.shape if orientation == "linear" else module.weight.shape[::-1]
    return nn.Linear(in_features, out_features, getattr(module, "bias", None) is not None, device="meta")


def _shared_inputs(seen: observe.Observation, layers: dict[str, nn.Module],
                   found: list[regions.Region]) -> dict[str, str]:
    """Column layers of a region that read the same tensor as an earlier one (q, k, v): name -> that one."""
    shared = {}
    for region in found:
        first_reader: dict[int | None, str] = {}
        for name in region.columns:
            tensor = seen.calls[id(layers[name])][0].input
            if tensor in first_reader:
                shared[name] = first_reader[tensor]
            else:
                first_reader[tensor] = name
    return shared


def _region_note(name: str, found: list[regions.Region]) -> str:
    for region in found:
        if name in region.columns or name in region.rows:
            blocks = region.columns.get(name) or region.rows.get(name)
            where = f"in {region.module or 'the model'}" + (": the ops between run on each rank's slice"
                                                            if region.flow else "")
            return where + (f"; blocks {list(blocks)}" if len(blocks) > 1 else "")  # type: ignore[arg-type]
    return ""


def _call_form(example: object) -> str:
    if isinstance(example, tuple):
        return f"model(*{len(example)} positional arguments)"
    if isinstance(example, dict):
        return f"model(**{{{', '.join(map(str, example))}}})"
    return "model(x)"


_HOOKED = "it has hooks (weight_norm's, say), which swapping the module would drop"


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks)


def plan(model: nn.Module, mp: int, mp_layers: MPLayers = "all", batch_size: int | None = None,
         example: observe.Example | None = None) -> Rewrite:
    """Trace ``model`` (or, failing that, record a forward on ``example``) and decide each Linear's split;
    nothing is changed yet."""
    check_selection(model, mp_layers)
    selected = _selector(mp_layers)
    explicit = isinstance(mp_layers, (list, tuple, set))
    try:
        graph = fx.Tracer().trace(model)
    except Exception as err:  # noqa: BLE001 - any tracing failure means: fall back or explain
        result = _fallback(model, mp, selected, err, example)
        result.plan.batch_size = batch_size
        return result
    planner = _Planner(model, graph, mp, selected, explicit)
    planner.plan()
    if any(n.op == "call_function" for n in planner.nodes.values()) and _depends_on_training(model, graph):
        why = "F.linear in a forward that depends on model.training: rewriting it would freeze the mode"
        planner = _Planner(model, graph, mp, selected, explicit, functions=why)
        planner.plan()
    traced = Rewrite(Plan(mp, _plan_rows(planner, graph), batch_size=batch_size), planner.role, planner.first,
                     graph, planner.nodes, planner.swaps)
    attention = bool(torch_layers.attention_modules(model))
    if example is not None and ("full" in planner.role.values() or attention) and not planner.swaps \
            and not any(n.op == "call_function" for n in planner.nodes.values()):
        # The graph pairs only Linears joined by elementwise ops, and sees torch's own layers as leaves;
        # following the split through a forward also pairs attention (heads) and splits nn.MultiheadAttention
        # - take that plan when it splits more layers in pairs.
        try:
            recorded = _fallback(model, mp, selected, None, example)
        except (ValueError, NotImplementedError):
            return traced
        paired = sum(role in ("column", "row", "heads") for role in recorded.roles.values())
        traced_paired = sum(role in ("column", "row") for role in planner.role.values())
        if paired > traced_paired or (attention and paired == traced_paired):  # its rows say why attention stays
            recorded.plan.batch_size, recorded.plan.traced = batch_size, True
            return recorded
    return traced


def _depends_on_training(model: nn.Module, graph: fx.Graph) -> bool:
    """Whether tracing in the other mode gives other code (``F.dropout(x, p, self.training)``, say)."""
    was_training = model.training
    try:
        model.train(not was_training)
        other = fx.Tracer().trace(model)
    finally:
        model.train(was_training)
    return str(other) != str(graph)


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
    weight, bias = _linear_args(node)
    name = "mp_" + str(weight.target).replace(".", "_")
    layer.dense_names = {"weight": str(weight.target)} | ({"bias": str(bias.target)} if bias is not None else {})
    model.add_module(name, layer)
    with graph.inserting_before(node):
        call = graph.call_module(name, (_linear_input(node),))
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
        weight, bias = _linear_args(node)
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
            example: observe.Example | None = None) -> Plan:
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
        A :class:`Plan`; ``print`` it for the table.

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
    """The model-parallel layers inside ``model`` (hand-placed or swapped in), with their names."""
    return [(n, m) for n, m in model.named_modules() if callable(getattr(m, "dense_state", None))]
