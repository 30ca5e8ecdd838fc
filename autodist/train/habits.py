"""DDP habits on the model ``parallelize`` returns: ``model.module`` says what to write instead, and
``model.require_backward_grad_sync`` works as DDP's.

DDP wraps the model, so DDP code reaches the user's model as ``model.module``. ``parallelize`` returns the
model itself; ``model.module`` would raise torch's bare "object has no attribute 'module'". The model's
class becomes a subclass of its own (as torch's ``fully_shard`` does: same name, ``isinstance`` holds)
whose ``__getattr__`` adds the reason to that error, and only to it: ``hasattr(model, "module")`` stays
False, so code that unwraps ``model.module if hasattr(model, "module") else model`` keeps the model, and a
real submodule called ``module`` is found as before. Copies and pickles get the user's own class.

DDP's ``require_backward_grad_sync`` (what ``no_sync()`` sets, and what frameworks set around
accumulation steps) would otherwise be a plain attribute nobody reads, silently syncing every backward: on
the subclass it is a property over the same switch as ``autodist.no_sync(model)``.

Example:
    >>> model, loader = autodist.parallelize(model, loader)
    >>> model.module
    AttributeError: 'Net' object has no attribute 'module': autodist.parallelize returns your model itself ...
    >>> model.require_backward_grad_sync = False   # as autodist.no_sync(model): backwards accumulate locally
"""
from __future__ import annotations

from typing import Any

from torch import nn

from autodist.dp.grad_sync import state_of

_made: dict[type, type] = {}


def _getattr(self: nn.Module, name: str) -> Any:
    try:
        return super(type(self), self).__getattr__(name)  # type: ignore[misc]
    except AttributeError as err:
        if name != "module":
            raise
        raise AttributeError(
            f"{err}: autodist.parallelize returns your model itself, not a wrapper as DDP does; where DDP code "
            f"says model.module, use model (its state_dict() is already the plain one)") from None


def _syncs(self: nn.Module) -> bool:
    """Whether the next backward synchronizes gradients (False inside ``autodist.no_sync(model)``)."""
    sync = state_of(self)
    return True if sync is None else sync.enabled


def _set_syncs(self: nn.Module, value: bool) -> None:
    sync = state_of(self)
    if sync is not None:
        sync.enabled = bool(value)


def adopt(model: nn.Module) -> None:
    """Give ``model`` the subclass of its class that explains ``model.module`` (made once per class)."""
    cls = type(model)
    if cls in _made.values():
        return
    if cls not in _made:
        _made[cls] = type(cls.__name__, (cls,), {
            "__getattr__": _getattr, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_autodist_own_class": cls, "require_backward_grad_sync": property(_syncs, _set_syncs)})
    model.__class__ = _made[cls]


def own_class(model: nn.Module) -> type:
    """The user's class of ``model`` (the one before :func:`adopt`)."""
    return getattr(type(model), "_autodist_own_class", type(model))
