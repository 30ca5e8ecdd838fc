"""Planning a model torch.fx cannot trace (or one whose attention a trace cannot see): from one recorded
forward on a sample batch. See :func:`plan_recorded`.
"""
from __future__ import annotations

import collections
from typing import Callable

from torch import nn

from autodist.mp import observe, regions, torch_layers
from autodist.mp.fx_plan import where_tracing_stopped
from autodist.mp.plans import HOOKED, LayerPlan, Rewrite, SplitPlan, count_params, hooked, linear_row
from autodist.runtime import tree


def plan_recorded(model: nn.Module, mp: int, selected: Callable[[str, nn.Module], bool], err: BaseException | None,
              example: observe.Example | None) -> Rewrite:
    """torch.fx could not trace: plan from one recorded forward on ``example`` and swap modules one by one.

    The recorded forward (:mod:`autodist.mp.observe`) says how often each
    candidate (a leaf module with a 2-D weight) ran, whether its input needed
    a gradient, and whether any op outside it read its parameters (a rank's
    shard would then be read instead). A second forward follows each
    candidate's output split along its features (:mod:`autodist.mp.regions`):
    it checks that the candidate computes ``x @ W.T + b`` or ``x @ W + b``
    and finds the Megatron regions, attention included. Every other affine
    candidate becomes a full-in/full-out ``MPBaseLinear``, exact whatever the
    forward does with its output. What stays whole: weights shared with
    another layer, layers with hooks, layers inside torch's own layers
    (MultiheadAttention reads its out_proj weight itself), and layers the
    recorded forward did not run or ran twice.
    """
    where = where_tracing_stopped(err) if err is not None else ""
    if example is None:
        raise ValueError(f"torch.fx cannot trace {type(model).__name__} (tracing stopped at {where}), and autodist "
                         f"then plans model parallelism from one forward on a sample batch: pass data to "
                         f"parallelize (a DataLoader, Dataset or tensors) or example=(args...) / example={{kwargs}}")
    try:
        seen = observe.observe(model, lambda: tree.call(model, example))
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
        elif hooked(module):
            kept[name] = HOOKED
        elif min(module.weight.shape) < mp:
            kept[name] = f"a dimension smaller than mp={mp}"
        elif calls != 1:
            kept[name] = "not run by the forward on the sample batch" if not calls else f"called {calls} times"
        elif outside is not None:
            kept[name] = f"the model reads its parameters outside the layer ({outside}), which would see a shard"
    candidates = {name: module for name, module in linears.items() if name not in kept}
    with observe.isolated(model):
        found = regions.find_regions(model, lambda: tree.call(model, example), candidates, mp)
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
                        LayerPlan(name, type(module).__name__, "replicated", count_params(module), count_params(module), [],
                                  kept[name]))
            continue
        if name not in linears:
            continue
        if name in found.orientation and name not in kept and name not in roles:
            roles[name] = "full"
        if name in roles:
            note = "" if roles[name] != "full" else f"unpaired ({found.unpaired.get(name, 'nothing after it pairs')})"
            row = linear_row(name, _shape_of(module, found.orientation[name]), roles[name],
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
            rows.append(LayerPlan(name, type(module).__name__, "replicated", count_params(module), count_params(module), [],
                                  kept[name]))
    if not roles:
        by_reason: dict[str, list[str]] = collections.defaultdict(list)
        for name, note in kept.items():
            by_reason[note].append(name)
        why = "".join(f"; {', '.join(names)} stay{'s' if len(names) == 1 else ''}: {note}"
                      for note, names in by_reason.items())
        raise NotImplementedError(f"torch.fx cannot trace {type(model).__name__} and no nn.Linear module can be "
                                  f"swapped in its place; tracing stopped at {where}{why}")
    return Rewrite(SplitPlan(mp, rows, traced=False, untraced=where), roles, first, regions=found.regions,
                   orientation=found.orientation)

def _attention_row(name: str, module: nn.MultiheadAttention, mp: int, seen: observe.Observation) -> LayerPlan:
    e, heads = module.embed_dim, module.num_heads
    bias = module.in_proj_bias is not None
    per_rank = (3 * e * e + 3 * e * bias) // mp + e * e // mp + (e if module.out_proj.bias is not None else 0)
    note = (f"split by heads: {heads // mp} of {heads} per rank (its rows of q, k and v; out_proj by input "
            f"features); pass need_weights=False where the weights are unused (as torch's Transformer layers do): "
            f"returning them costs one more all-reduce")
    return LayerPlan(name, "MultiheadAttention", "heads", count_params(module), per_rank,
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
