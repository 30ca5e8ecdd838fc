"""A context-parallel forward under torch.compile: the routing split into what a trace can decide and what it cannot.

Dynamo traces a torch function mode on the stack as part of the graph, so where the routing's mode
(:mod:`autodist.cp.forward`) finds itself traced it decides by what a trace knows: the op, and its tensors'
dtypes and shapes (:func:`traced`). What needs more (the tensors' values, or which tensor is which: an input of
the batch, the positions an ``arange`` made) is a break in the graph where the model called it, and runs
eagerly through the mode, exactly as an uncompiled forward runs it (:meth:`autodist.cp.forward.Context.route`):

* attention (``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``), ``torch.arange``,
  ``torch.diff``, and the losses (``F.cross_entropy``, ``F.nll_loss``: the gradient sync reads what a
  token-mean divides by from their autograd nodes);
* any op whose first tensor is not floating point (token ids, positions, masks, labels and what is made from
  them: where the inputs of the batch are), so that a shift of the labels or a mask read along the sequence is
  found and refused (or read whole) as uncompiled; ``F.pad``, which dynamo traces past the modes, is made a
  break too (:func:`see_pads`);
* what would be refused (a reduction or another op mixing an activation's tokens: a convolution over time, a
  running sum, a roll; attention scores written by hand, refused under compile as they are followed by
  identity, which a graph does not keep).

The per-token float work of the blocks (linear layers, norms, activations, rotary products) stays in the graphs.
A floating-point input of this rank's tokens (``inputs_embeds``) is refused: what reads it along the sequence
could not be told from the trace (:func:`refuse_float_inputs`).

Example:
    >>> model, loader = autodist.parallelize(model, loader, cp=2)
    >>> model = torch.compile(model)        # or each block: model.blocks[i].compile()
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.torch_version import Version

from autodist.cp import refusals, scores

log = logging.getLogger("autodist")

# routed eagerly whatever their tensors: what reaches across the sequence or numbers its positions
# and the losses, whose autograd nodes the gradient sync reads (what a token-mean divides by)
EAGER = frozenset({F.scaled_dot_product_attention, F.multi_head_attention_forward, torch.arange, torch.diff,
                   torch.Tensor.diff, F.cross_entropy, F.nll_loss})
# what only reads a tensor's metadata: kept in the graph whatever the dtype (no value made from the batch)
METADATA = frozenset({torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
                      torch.Tensor.stride, torch.Tensor.__len__, torch.Tensor.element_size,
                      torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.device.__get__,
                      torch.Tensor.dtype.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_cuda.__get__})


def traced(context: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` in a forward dynamo traces (the routing mode's dispatch there): in the graph, or
    routed eagerly (see the module docstring). A call routed eagerly is a break in the graph where the model
    called ``func``, which then runs it through the mode eagerly (:func:`in_compiled_region` tells it so)."""
    if context.not_compiled_with or func in EAGER or (func not in METADATA and _integral_first(args)):
        return eagerly(context, func, args, kwargs)
    if (func in scores.PRODUCTS and context.local_scores(args)) or \
            (func in refusals.REDUCTIONS and args and context.pools(args, kwargs)) or \
            (func in refusals.MIXING_TRACED and args and context.mixes(func, args, kwargs)):
        return eagerly(context, func, args, kwargs)  # refused there
    made = func(*args, **kwargs)
    if func in refusals.PRODUCTS and context.square_over_tokens(args, made):
        return eagerly(context, func, args, kwargs)  # refused there
    return made


def in_compiled_region() -> bool:
    """Whether this eager call runs inside a call torch.compile compiles (between its graphs): asked for every op
    of a context-parallel forward, so the callback's getter is imported once, with this module."""
    return get_eval_frame_callback() not in (None, False)


@torch.compiler.disable
def eagerly(context: Any, func: Any, args: tuple, kwargs: dict, compiled: bool = False) -> Any:
    """``func`` routed as an uncompiled forward routes it (a break in the graph); ``compiled``: in a compiled
    forward (attention scores written by hand refused). Its own calls run past this mode, whether dynamo resumes
    here or at the model's line that called ``func``."""
    with torch.overrides._pop_mode_temporarily() if _on_top(context) else contextlib.nullcontext():
        return context.route(func, args, kwargs, compiled)


def see_pads() -> None:
    """Make dynamo hand ``F.pad`` to the routing's mode: it traces ``F.pad`` past the torch function modes on the
    stack (its ``torch._C._nn.pad`` straight into the graph), where a shift of the labels inside a compiled
    forward (Hugging Face's causal-LM loss pads ``labels=``) would go unseen. Marked not to be put in a graph,
    each call is a break in it that the mode sees (for every compiled model in this process, once a model is
    context-parallel: a pad costs a graph break there)."""
    import warnings

    import torch._dynamo

    torch._dynamo.disallow_in_graph(torch._C._nn.pad)
    # dynamo then says, once per process, that it "does not know how to trace" it: by design here
    warnings.filterwarnings("ignore", message=r"Dynamo does not know how to trace the builtin `torch\._C\._nn\.pad")


def skip_frames(function: Any) -> None:
    """Dynamo never compiles ``function``'s own frame where it is called eagerly (it still traces it inline):
    the routing's dispatch, run eagerly between a compiled forward's graphs, would be compiled as a frame of its
    own for each op's dtypes, past dynamo's recompile limit."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(function.__code__)


def compiled_layers(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s submodules compiled by themselves (``torch.compile(layer)`` in their place, or
    ``layer.compile()``)."""
    return [name for name, m in model.named_modules() if name and (
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None)]


def warn_eager(parts: int, name: str, with_: list[str], layers: list[str]) -> None:
    """Say that the compiled ``layers`` run eagerly under a layout cp is not built with compiled."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning("cp=%d with %s is not built with torch.compile yet: %s's compiled layers (%s) run eagerly, each "
                    "op a break in their graphs (compile it with cp and data parallelism, any shard= level and pp)",
                    parts, " and ".join(with_), name, ", ".join(layers[:3]) + (", ..." if len(layers) > 3 else ""))


def _on_top(context: Any) -> bool:
    stack = torch.overrides._get_current_function_mode_stack()
    return bool(stack) and getattr(stack[-1], "context", None) is context


def _integral_first(args: tuple) -> bool:
    """Whether the first argument is a tensor of integers or booleans (where the batch's inputs are)."""
    return bool(args) and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point() and \
        not args[0].is_complex()


def refuse_float_inputs(parts: int, name: str, paths: list[str]) -> None:
    """Raise: a compiled forward's floating-point inputs of this rank's tokens (see the module docstring)."""
    raise NotImplementedError(
        f"cp={parts}: {name} runs compiled (torch.compile) with floating-point input{'s' if len(paths) > 1 else ''} "
        f"{', '.join(paths)} holding this rank's tokens: under compile cp follows the batch through its integer "
        f"inputs (token ids, positions, masks, labels) only, so what reads a float input along the sequence could "
        f"not be found; pass token ids, or run this model without torch.compile")


def refuse_layout(parts: int, name: str, with_: list[str]) -> None:
    """Raise: a forward torch.compile traces, under a layout that cp is not built with compiled."""
    raise NotImplementedError(
        f"cp={parts} with {' and '.join(with_)} is not built with torch.compile yet ({name} runs compiled: whole, or "
        f"its layers): run this layout uncompiled, or compile it with cp and data parallelism, any shard= level "
        f"and pp")


BUILT_ON = (2, 13)  # the torch whose dynamo the routing's traced dispatch was built and tested on


def older_torch(version: str = torch.__version__) -> bool:
    """Whether ``version`` (torch's) is older than the one a compiled context-parallel forward is built on."""
    return Version(version).release[:2] < BUILT_ON  # a 2.13 nightly (2.13.0a0+git...) counts as 2.13


def refuse_older_torch(parts: int, name: str) -> None:
    """Raise: a forward torch.compile traces, on a torch whose dynamo traces the routing's mode differently (on
    torch 2.11 a compiled nanoGPT at cp=2 trained 0.23 away from one process: silently wrong, so refused)."""
    raise NotImplementedError(
        f"cp={parts}: {name} runs compiled (torch.compile of the whole model) on torch {torch.__version__}, and a "
        f"compiled context-parallel forward is built on torch {BUILT_ON[0]}.{BUILT_ON[1]} or later (on 2.11 one "
        f"trained away from one process): upgrade torch, compile each block instead (model.blocks[i].compile()), "
        f"or run uncompiled")


def refuse_own_checkpointing(parts: int, name: str) -> None:
    """Raise: a model compiled whole that checkpoints its own layers (Hugging Face's
    ``gradient_checkpointing_enable()``): dynamo traces ``torch.utils.checkpoint`` as one operator whose body
    the torch function modes do not see, so the attention inside would escape the routing."""
    raise NotImplementedError(
        f"cp={parts}: {name} runs compiled (torch.compile) and checkpoints its own layers "
        f"(gradient_checkpointing_enable()): dynamo traces torch.utils.checkpoint as one operator whose inside the "
        f"routing of attention does not see, so each rank would attend to its own tokens only. Under compile "
        f"turn it off (gradient_checkpointing_disable()), or run this model uncompiled (autodist's "
        f"checkpoint=True is not built with compile under cp yet either)")
