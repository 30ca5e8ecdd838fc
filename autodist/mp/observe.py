"""One forward on a sample batch, recorded: which ops ran, in which module, on which tensors.

The model-parallel planner reads this instead of the model's source code
when torch.fx cannot trace the model. A ``TorchDispatchMode`` sees every
aten op the forward runs (after autograd, so ``F.linear`` appears as
``t`` + ``addmm``), and global module hooks keep the stack of modules each op
runs in. From that the planner knows, for what the forward actually does:
how often each layer is called, whether its input needs a gradient, whether
any op outside the layer reads its parameters (a tied head, code reading
``self.fc.weight``), and which ops lie between two layers (all elementwise?).

What it cannot see: Python reading a tensor's shape (``h.size(-1)``) runs
no op, and code paths that this batch, in this mode, does not take. The run
has no side effects: the RNG state is forked and every buffer (BatchNorm's
statistics) is restored afterwards; the parameters are not changed.
"""
from __future__ import annotations

import collections
import collections.abc
import contextlib
import itertools
import linecache
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autodist.runtime.tree import map_tensors


@dataclass
class Op:
    """One aten op of the recorded forward."""

    name: str  # e.g. "aten.gelu.default"
    pointwise: bool  # torch tags it pointwise (elementwise, same shape out as in, up to broadcasting)
    inputs: list[int]  # ids of the tensors it read
    outputs: list[int]
    scope: tuple[int, ...]  # ids of the modules it ran inside, outermost first
    where: str = ""  # the line of the model's code that ran it ("file.py:12: return self.fc(x)")


@dataclass
class Call:
    """One call of a module."""

    input: int | None  # id of the first tensor argument
    output: int | None  # id of the output, if it is one tensor
    input_needs_grad: bool
    grad_inputs: int = 0  # distinct positional tensor arguments that need a gradient


@dataclass
class Observation:
    """What one forward did; tensors are named by ``id`` (all were kept alive while it ran)."""

    ops: list[Op] = field(default_factory=list)
    calls: dict[int, list[Call]] = field(default_factory=lambda: collections.defaultdict(list))
    producer: dict[int, int] = field(default_factory=dict)  # tensor id -> index of the op that made it
    consumers: dict[int, list[int]] = field(default_factory=lambda: collections.defaultdict(list))
    scalar: set[int] = field(default_factory=set)  # ids of 0-dim tensors
    outputs: set[int] = field(default_factory=set)  # the ids of the model's output tensors

    def reads_outside(self, module: nn.Module) -> str | None:
        """Where an op outside ``module``'s own calls reads one of its parameters; None if none does."""
        params = {id(p) for p in module.parameters()}
        for op in self.ops:
            if id(module) not in op.scope and params.intersection(op.inputs):
                return f"{op.name} at {op.where}" if op.where else op.name
        return None


def model_line() -> str:
    """The innermost frame outside torch and autodist: the model's line that ran the current op,
    as ``"file.py:12: return self.fc(x)"`` ("" when there is none)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in path and "/autodist/" not in path:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return f"{os.path.basename(path)}:{frame.f_lineno}: {line}"
        frame = frame.f_back
    return ""


class _Recorder(TorchDispatchMode):
    def __init__(self, seen: Observation, stack: list[int], keep: list[Any]) -> None:
        super().__init__()
        self.seen, self.stack, self.keep = seen, stack, keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        self.keep.append((ins, outs))  # ids stay unique only while the tensors live
        index = len(self.seen.ops)
        self.seen.ops.append(Op(str(func), torch.Tag.pointwise in func.tags, [id(t) for t in ins],
                                [id(t) for t in outs], tuple(self.stack), model_line()))
        for t in ins:
            self.seen.consumers[id(t)].append(index)
            if t.dim() == 0:
                self.seen.scalar.add(id(t))
        for t in outs:
            self.seen.producer.setdefault(id(t), index)
            if t.dim() == 0:
                self.seen.scalar.add(id(t))
        return out


def observe(model: nn.Module, run: Callable[[], Any]) -> Observation:
    """Record ``run()`` (a forward of ``model``) with no lasting effect on the model or the RNG.

    Example:
        >>> seen = observe(model, lambda: model(x))
        >>> [op.name for op in seen.ops][:3]
    """
    seen, stack, keep = Observation(), [], []

    def enter(module: nn.Module, args: tuple) -> None:
        stack.append(id(module))

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if stack and stack[-1] == id(module):
            stack.pop()
        tensors = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
        first = tensors[0] if tensors else None
        keep.append((args, output))
        seen.calls[id(module)].append(Call(None if first is None else id(first),
                                           id(output) if isinstance(output, torch.Tensor) else None,
                                           first is not None and first.requires_grad,
                                           len({id(t) for t in tensors if t.requires_grad})))

    handles = [nn.modules.module.register_module_forward_pre_hook(enter),
               nn.modules.module.register_module_forward_hook(leave)]
    try:
        with isolated(model), _Recorder(seen, stack, keep):
            result = run()
        seen.outputs = {id(t) for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)}
        keep.append(result)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@contextlib.contextmanager
def isolated(model: nn.Module) -> Iterator[None]:
    """Run a sample forward of ``model`` with no lasting effect: the RNG is forked, the buffers restored.

    Example:
        >>> with isolated(model):
        ...     model(x)           # BatchNorm's running statistics are as before afterwards
    """
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"][:1]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


Example = Any  # a positional-argument tuple, a keyword-argument dict, or one tensor


def check_example(example: Example | None) -> None:
    """An example is None, a tuple of positional arguments, a mapping of keyword ones, or one tensor."""
    if example is not None and not isinstance(example, (tuple, collections.abc.Mapping, torch.Tensor)):
        raise TypeError(f"example must be the arguments of one forward: a tuple of positional ones, a dict of "
                        f"keyword ones, or one tensor; got {type(example).__name__}")


def model_example(model: nn.Module) -> Example | None:
    """The sample inputs a model carries itself, as keyword arguments: a Hugging Face model's
    ``dummy_inputs`` for its ``main_input_name`` (token ids), or, for one that takes images
    (``pixel_values``), random images of its config's size; None for any other model.

    Example:
        >>> model_example(transformers.BertModel(config))
        {'input_ids': tensor([[7, 6, 0, 0, 1], ...])}
    """
    name = getattr(model, "main_input_name", None)
    config = getattr(model, "config", None)
    if not isinstance(name, str) or config is None:
        return None
    if name == "pixel_values":
        size = getattr(config, "image_size", None)
        channels = getattr(config, "num_channels", 3)
        if not isinstance(size, int):
            return None
        generator = torch.Generator().manual_seed(0)
        return {name: torch.randn(2, channels, size, size, generator=generator, device=_device(model))}
    try:
        dummy = model.dummy_inputs
    except Exception:  # noqa: BLE001 - a model whose dummy inputs cannot be built has none
        return None
    if not isinstance(dummy, collections.abc.Mapping) or name not in dummy:
        return None
    return complete(model, {k: v.to(_device(model)) if isinstance(v, torch.Tensor) else v for k, v in dummy.items()})


def complete(model: nn.Module, example: Example | None) -> Example | None:
    """An example for an encoder-decoder (a Hugging Face T5, BART) that lacks decoder inputs gets them: the
    decoder's start token for every row, as generation begins. Any other example is returned as it is."""
    config = getattr(model, "config", None)
    if example is None or not getattr(config, "is_encoder_decoder", False):
        return example
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None) or 0
    if isinstance(example, torch.Tensor):
        example = (example,)
    if isinstance(example, tuple) and len(example) == 1 and isinstance(example[0], torch.Tensor):
        example = {getattr(model, "main_input_name", "input_ids"): example[0]}
    if isinstance(example, collections.abc.Mapping) and not any(k.startswith("decoder_") or k == "labels"
                                                                for k in example):
        first = next((v for v in example.values() if isinstance(v, torch.Tensor)), None)
        if first is not None:
            example = {**example, "decoder_input_ids": torch.full((first.shape[0], 1), int(start),
                                                                  dtype=torch.long, device=first.device)}
    return example


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def for_model(model: nn.Module, example: Any) -> Any:
    """``example`` as the training loop hands it to ``model``: its tensors on the device of the model's parameters
    (a loader's batches are on the CPU, a model under NCCL on its GPU by now), and its floating tensors in the
    dtype of the model's floating parameters where they all have one (a float64 or bfloat16 model fed float32
    batches that the loop casts): what a forward that measures or traces the model is called with.

    Example:
        >>> for_model(model.double().cuda(), (torch.zeros(2, 8),))[0].dtype
        torch.float64
    """
    device = _device(model)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else None

    def moved(_: str, t: torch.Tensor) -> torch.Tensor:
        wanted = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return t if t.device == device and t.dtype == wanted else t.to(device=device, dtype=wanted)

    return map_tensors(example, moved)


def example_of(data: Any, rows: int = 2) -> Example | None:
    """A small batch from the data given to ``parallelize``, as the forward is usually called with it:
    a dict batch as keyword arguments, the first element of a tuple batch ``(x, y)``, a tensor as is."""
    if data is None:
        return None
    try:
        batch = _first_rows(data, rows)
    except (TypeError, IndexError, KeyError, NotImplementedError):  # no len() or indexing: example= is needed
        return None
    if isinstance(batch, collections.abc.Mapping):
        return dict(batch)
    if isinstance(batch, (tuple, list)):
        return (batch[0],)
    return batch


def for_device(model: nn.Module, obj: Any) -> Any:
    """``obj``'s tensors on the device of the model's parameters, their dtypes kept (a target as the loop hands
    it over)."""
    device = _device(model)
    return map_tensors(obj, lambda _, t: t if t.device == device else t.to(device))


def target_of(data: Any, rows: int = 2) -> Any:
    """The target of a small batch of the data, as a loop with ``loss_fn=`` hands it over (``model(x,
    target=y)``): the last element of a tuple batch ``(x, y)``; None for a batch of one tensor, a one-element
    tuple or a dict (the model or ``loss_fn`` finds its labels there)."""
    try:
        batch = _first_rows(data, rows) if data is not None else None
    except (TypeError, IndexError, KeyError, NotImplementedError):
        return None
    return batch[-1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None


def _first_rows(data: Any, rows: int) -> Any:
    from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

    if isinstance(data, DataLoader) and isinstance(data.dataset, IterableDataset):
        # a stream's first samples, read from a fresh iterator of it (the loop's own iteration starts afresh);
        # one whose iterator is always the same object would lose them: nothing is read (example= is asked)
        first = iter(data.dataset)
        if first is iter(data.dataset):
            return None
        batch = data.collate_fn(list(itertools.islice(first, rows)))  # type: ignore[arg-type]
    elif isinstance(data, DataLoader):
        batch = data.collate_fn([data.dataset[i] for i in range(min(rows, len(data.dataset)))])  # type: ignore
    elif isinstance(data, Dataset):
        batch = default_collate([data[i] for i in range(min(rows, len(data)))])  # type: ignore[arg-type]
    elif isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        batch = tuple(t[:rows] for t in data)
    elif isinstance(data, torch.Tensor):
        batch = data[:rows]
    else:
        return None
    return batch
