"""A parameter at rest under ``shard="parameters"``: its shape, dtype and device as always, its values refused.

Between uses a block's parameters hold a placeholder of their shape (one number of memory): the values
live as 1/N on each rank. Reading it would give a number no rank holds, so while at rest a parameter's
class is :class:`AtRest` (a subclass of its own class, swapped in and out as the block is released and
gathered: nothing is added to the path of a parameter in use). Its ``__torch_function__`` answers what
the metadata knows (shape, dtype, device, ``requires_grad``, ``.grad``, hooks) and refuses everything
that reads or writes the values with one error naming how to read them: ``autodist.full_parameters``.

Example:
    >>> rest(p, placeholder)          # p.data is the placeholder; p.norm() raises, p.shape answers
    >>> wake(p, whole[0:n].view(p.shape))
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Attribute reads that are metadata (``p.data`` is not: it is the values).
_GETTERS = {"shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "layout", "ndim", "is_cuda",
            "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mps", "is_xpu", "is_nested", "names", "name",
            "_backward_hooks", "_post_accumulate_grad_hooks", "output_nr", "_version", "itemsize", "retains_grad",
            "_cdata", "_grad", "_grad_fn", "is_mkldnn", "is_vulkan", "is_ipu", "is_hpu", "is_maia",
            "nbytes"}
_SETTERS = {"grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks", "_grad", "retains_grad"}
_METHODS = {torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.element_size,
            torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.requires_grad_,
            torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.get_device,
            torch.Tensor.__len__, torch.Tensor.ndimension, torch.Tensor.is_signed, torch.Tensor.retain_grad,
            # where the placeholder lives (memory accounting, tied-weight checks): its one number, not the values
            torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.storage_offset, torch.Tensor.stride,
            torch.Tensor.is_contiguous,
            # new tensors of its dtype and device, as `next(model.parameters()).new_zeros(...)` makes them
            torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
            torch.Tensor.new_tensor, torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
            torch.rand_like, torch.randn_like, torch.randint_like}


def _metadata(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        return attribute in (_GETTERS if name == "__get__" else _SETTERS)
    return func in _METHODS


def refusal(what: str, shape: tuple[int, ...]) -> str:
    """The one error for a value read (or write) of a parameter at rest."""
    return (f"{what} on a parameter (shape {shape}) of a model parallelized with shard='parameters', between its "
            f"uses: each rank holds only 1/N of its values then, so there is nothing whole to read or write. Read "
            f"(or change) the whole values inside `with autodist.full_parameters(model): ...` on every rank (it "
            f"gathers every block and frees them after; changes are kept), or take model.state_dict() / "
            f"autodist.gather_state_dict(model) (collectives: call them on every rank). A dtype or device change "
            f"(model.to(...)) goes before parallelize")


def _answer(func: Any, args: tuple, kwargs: Any) -> Any:
    """What a parameter at rest (or its detached placeholder) answers: metadata, a detached placeholder that
    refuses reads alike (``state_dict`` detaches every parameter before autodist gathers it), or the error."""
    if _metadata(func) or func is torch.Tensor.detach:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out.as_subclass(Resting) if func is torch.Tensor.detach else out
    name = getattr(func, "__name__", str(func))
    if name in ("__get__", "__set__", "__delete__"):
        name = f"{'reading' if name == '__get__' else 'setting'} .{func.__self__.__name__}"
    shape = next((tuple(a.shape) for a in args if isinstance(a, (AtRest, Resting))), ())
    raise RuntimeError(refusal(name, shape))


def _read(name: str) -> Any:
    """The metadata attribute ``name`` read without ``__torch_function__`` (what a training step reads of every
    parameter: ``.grad`` for zero_grad and clipping; shapes, dtypes, devices): ~4x cheaper than through it."""
    descriptor = getattr(torch._C.TensorBase, name)
    get, put = descriptor.__get__, getattr(descriptor, "__set__", None)

    def read(self: torch.Tensor) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return get(self)

    def write(self: torch.Tensor, value: Any) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            put(self, value)

    return property(read, write if name in _SETTERS else None)


def _call(name: str) -> Any:
    method = getattr(torch._C.TensorBase, name)

    def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return method(self, *args, **kwargs)

    call.__name__ = name
    return call


class AtRest(nn.Parameter):
    """The class of a parameter between its uses under ``shard="parameters"`` (see the module docstring)."""

    grad, requires_grad, shape, dtype, device, is_leaf = (
        _read(n) for n in ("grad", "requires_grad", "shape", "dtype", "device", "is_leaf"))
    numel, dim, size = (_call(n) for n in ("numel", "dim", "size"))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return _answer(func, args, kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"Parameter at rest (shape {tuple(self.shape)}, {self.dtype}; shard='parameters' keeps 1/N of it on "
                f"each rank: read it inside autodist.full_parameters(model))")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(refusal("pickling", tuple(self.shape)))


class Resting(torch.Tensor):
    """``p.detach()`` of a parameter at rest: the placeholder, refusing reads as the parameter does."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return _answer(func, args, kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"detached parameter at rest (shape {tuple(self.shape)}; shard='parameters')"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(refusal("pickling", tuple(self.shape)))


_resting: dict[type, type] = {nn.Parameter: AtRest}


def _at_rest_class(cls: type) -> type:
    """AtRest for a plain Parameter; for a subclass of it, a subclass of both (made once)."""
    if cls not in _resting:
        _resting[cls] = type(f"AtRest{cls.__name__}", (AtRest, cls), {"__module__": __name__})
        _awake[_resting[cls]] = cls
    return _resting[cls]


_awake: dict[type, type] = {rest: cls for cls, rest in _resting.items()}


def rest(p: nn.Parameter, placeholder: torch.Tensor) -> None:
    """``p`` holds ``placeholder`` and refuses value reads until :func:`wake`."""
    if isinstance(p, AtRest):
        with torch._C.DisableTorchFunctionSubclass():
            p.data = placeholder
        return
    p.data = placeholder
    p.__class__ = _at_rest_class(type(p))


def wake(p: nn.Parameter, data: torch.Tensor) -> None:
    """``p`` is an ordinary parameter again, holding ``data``."""
    if isinstance(p, AtRest):
        p.__class__ = _awake[type(p)]
    p.data = data
