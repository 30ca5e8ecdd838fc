"""``parallelize(..., mixed_precision="bf16")``: float32 master weights, forward and backward in a lower precision.

The meaning is FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` (every op of a module in
the compute dtype, norms included: not autocast's per-op choice, which is Lightning's ``"bf16-mixed"``), defined
module by module so that the same option in one process is the reference:

* the parameters stay as they are (float32: the master the optimizer steps, ``.grad`` float32, a checkpoint
  holds them);
* when a module runs, each floating-point parameter it holds directly is replaced, for that call, by its cast
  to the compute dtype (an autograd op: its gradient flows back to the float32 parameter, cast up exactly);
* the model's floating-point inputs are cast to the compute dtype (integer ones, token ids, are left alone);
  its output is what the last module computes, in the compute dtype;
* the ranks' float32 gradients are summed in float32 (:mod:`autodist.dp.buckets`), so a run equals one
  process with the same option at the split floor;
* under ``shard="parameters"`` the blocks are gathered in the compute dtype
  (:meth:`autodist.sharded.parameters.ParameterSharding.compute_in`): the parameters hold it while gathered,
  so the casts here have nothing to do, and the float32 chunks stay the master.

Buffers keep their dtype. A parameter used outside its own module's forward (``F.linear(x, other.weight)``)
is not cast, and torch then refuses the mixed dtypes by name. The hooks are plain objects of this module,
so ``copy.deepcopy`` and pickling carry them.

Example:
    >>> model, loader = autodist.parallelize(model, loader, mixed_precision="bf16")
    >>> model(x).dtype, next(model.parameters()).dtype
    (torch.bfloat16, torch.float32)
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils._pytree import tree_map

Precision = Union[str, torch.dtype, None]
_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def compute_dtype(value: Precision) -> torch.dtype | None:
    """The compute dtype ``mixed_precision=`` names: "bf16" / "fp16" (or "bfloat16", "float16", the dtypes)."""
    if value is None:
        return None
    dtype = _NAMES.get(value) if isinstance(value, str) else value
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"mixed_precision must be 'bf16', 'fp16', torch.bfloat16 or torch.float16 (the dtype the "
                         f"forward and backward compute in; the parameters stay float32), got {value!r}")
    return dtype


class _Cast:
    """A module's forward pre-hook: its floating-point parameters replaced by their casts for this call."""

    __slots__ = ("dtype", "saved")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.saved = dtype, []

    def __call__(self, module: nn.Module, args: tuple) -> None:
        params = module._parameters
        saved = {name: p for name, p in params.items() if p is not None and p.is_floating_point()}
        self.saved.append(saved)
        for name, p in saved.items():
            params[name] = p.to(self.dtype)  # type: ignore[assignment]  # for this call only: see _Restore


class _Restore:
    """The module's forward hook (also called when the forward raises): its own parameters back."""

    __slots__ = ("cast",)

    def __init__(self, cast: _Cast) -> None:
        self.cast = cast

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.cast.saved:
            module._parameters.update(self.cast.saved.pop())


class _CastInputs:
    """The model's forward pre-hook: its floating-point tensor arguments in the compute dtype."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def cast(x: Any) -> Any:
            return x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        return tree_map(cast, args), tree_map(cast, kwargs)


def check(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Raises where a trainable parameter is not float32: a model already in a low precision trains as it is,
    without the option."""
    if dtype is None:
        return
    low = next(((n, p) for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32), None)
    if low is not None:
        raise ValueError(f"mixed_precision keeps float32 master weights and computes in {dtype}, but parameter "
                         f"{low[0]!r} is {low[1].dtype}: drop mixed_precision to train the model in its own dtypes "
                         f"(a bfloat16 model trains as bfloat16, its gradients summed in float32), or convert it "
                         f"with model.float() first")


def setup(model: nn.Module, dtype: torch.dtype) -> list[RemovableHandle]:
    """Compute ``model`` in ``dtype`` from its float32 parameters (the module docstring; :func:`check` first);
    the hooks' handles (:func:`computing_in` removes them)."""
    handles = []
    for module in model.modules():
        if any(p is not None and p.is_floating_point() for p in module._parameters.values()):
            cast = _Cast(dtype)
            handles.append(module.register_forward_pre_hook(cast))
            handles.append(module.register_forward_hook(_Restore(cast), always_call=True))
    handles.append(model.register_forward_pre_hook(_CastInputs(dtype), with_kwargs=True))
    return handles


@contextlib.contextmanager
def computing_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """``model`` computed in ``dtype`` while inside, as :func:`setup` makes it (the planner measures a layout's
    precision so); as it was after. None: as it is."""
    handles = setup(model, dtype) if dtype is not None else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
