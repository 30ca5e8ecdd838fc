"""The loss a backward starts from, seen when ``backward()`` is called: where its terms are read.

A rank's weight in the gradient sync is what its loss is a mean over (:mod:`autodist.dp.loss_reading`), and
that is only known from the loss: ``F.cross_entropy(model(x), y, ignore_index=-100)`` in the user's loop is
computed after the model's forward, where no hook of the model sees it. So a parallelized model's forward
ends by putting a torch function mode on this thread's stack, and the mode watches for one call:
``loss.backward()`` (or ``torch.autograd.backward``). There, before autograd runs (and frees what the
reductions kept), it reads the loss's terms; the gradient sync takes them when the backward reaches the
model. The mode leaves the stack at the next forward of a parallelized model or the next optimizer step, so
it sees the loss's few operations and nothing of the model's.

It is put on the stack only when the stack is empty: another mode (``with torch.device(...)``, a profiler's)
could be left above or below it by a ``with`` block that began before it. Then, and for a backward run on
another thread, nothing is read and the ranks are weighted by their samples.

Example:
    >>> out = model(x)                          # arm(): the watch is on this thread's stack
    >>> F.cross_entropy(out, y).backward()      # read before autograd runs: pending() during the backward
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from autodist.dp import step_hooks
from autodist.dp.loss_reading import Reading, read

_local = threading.local()
_pending: Reading | None = None  # the reading of the backward running now (autograd's threads read it too)
_other: str | None = None  # the mode that kept the watch off the stack at the last forward


OnRead = Callable[[Reading], list]  # what the model's sync does with a reading: the hooks to remove after


class _Watch(TorchFunctionMode):
    """Reads the loss of each ``backward()`` called while it is on the stack; every other call passes."""

    def __init__(self) -> None:
        super().__init__()
        self.on_read: weakref.WeakMethod | None = None  # the sync of the model whose forward put it there

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward and args and kwargs.get("gradient", args[1] if len(args) > 1 else None) \
                is None:
            with self._reading([args[0]]):
                return func(*args, **kwargs)
        if func is torch.autograd.backward and args and kwargs.get("grad_tensors", args[1] if len(args) > 1
                                                                   else None) is None:
            roots = [args[0]] if isinstance(args[0], torch.Tensor) else list(args[0])
            with self._reading(roots):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    @contextmanager
    def _reading(self, roots: list[Any]) -> Iterator[None]:
        global _pending
        previous, _pending = _pending, read(roots)
        on_read = self.on_read() if self.on_read is not None else None
        handles = on_read(_pending) if on_read is not None else []
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            _pending = previous


def _watch() -> _Watch:
    watch = getattr(_local, "watch", None)
    if watch is None:
        watch = _local.watch = _Watch()
    return watch


class _AtStep:
    """Takes the watch off the stack before an optimizer step (so the step's operations pass by none)."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        disarm()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass


_at_step = _AtStep()


def arm(on_read: OnRead) -> None:
    """Watch this thread's next ``backward()``: called at the end of a parallelized model's forward, whose sync
    gets the reading (``on_read``, a bound method, held weakly) before autograd runs."""
    global _other
    depth = torch._C._len_torch_function_stack()
    if depth == 0 and torch._C._current_graph_task_id() == -1:
        step_hooks.listen(_at_step)
        watch = _watch()
        watch.on_read = weakref.WeakMethod(on_read)  # type: ignore[arg-type]
        torch._C._push_on_torch_function_stack(watch)
        _other = None
    elif depth and torch._C._get_function_stack_at(depth - 1) is not getattr(_local, "watch", None):
        _other = type(torch._C._get_function_stack_at(depth - 1)).__name__


def unwatched() -> str | None:
    """The torch function mode that kept the watch off the stack at the last forward, if one did."""
    return _other


def disarm() -> None:
    """Take the watch off this thread's stack if it is on top (the next forward, an optimizer step)."""
    depth = torch._C._len_torch_function_stack()
    if depth and torch._C._get_function_stack_at(depth - 1) is getattr(_local, "watch", None):
        torch._C._pop_torch_function_stack()


def pending() -> Reading | None:
    """The terms of the loss whose backward is running, if its ``backward()`` was watched."""
    return _pending
