"""What the planner measures on this rank before it predicts anything: the model's bytes (and what ``mp=K``
keeps of them, from the model-parallel plan), the bytes a forward/backward makes and their peak at two batch
sizes (activations, with what each block and each split layer keeps), its time, an optimizer step's time
and transient bytes, and the time of the process group's all-reduce. Plain data: rank 0's is shared.

The measuring leaves the model as it was: its gradients, buffers (BatchNorm's running statistics) and the
random streams are put back, and gradients made during it are dropped as they arrive.

Example:
    >>> profile = measure(model, example, rows=(8, 16), world_size=2)
    >>> profile.activations(32)          # bytes a forward/backward of 32 rows makes at its peak
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from autodist.mp import observe, rewrite
from autodist.planner.live import LiveBytes
from autodist.sharded import blocks as sharded_blocks


@dataclass
class Line:
    """``a + b x rows``: a measure at two batch sizes, extended to any."""

    a: float = 0.0
    b: float = 0.0

    def __call__(self, rows: float) -> float:
        return max(0.0, self.a + self.b * rows)

    @classmethod
    def through(cls, r1: int, y1: float, r2: int, y2: float) -> "Line":
        if r2 == r1:
            return cls(0.0, y1 / r1)
        b = max(0.0, (y2 - y1) / (r2 - r1))
        return cls(max(0.0, y1 - b * r1), b)


@dataclass
class Split:
    """What ``mp=K`` makes of the model: parameter bytes per rank, the fraction of the forward's work in split
    layers, the bytes its all-reduces send per row, and why it cannot be made ("" where it can)."""

    param_bytes: float = 0.0
    split_fraction: float = 0.0
    sent_per_row: float = 0.0
    collectives: int = 0
    impossible: str = ""


@dataclass
class Profile:
    """The measures (bytes, seconds) the memory and time models read."""

    param_bytes: float
    trainable_bytes: float
    buffer_bytes: float
    blocks: list[str]
    largest_block_bytes: float
    splits: dict[int, Split]
    peak: Line  # bytes made at the peak of a forward/backward (gradients dropped as they come)
    in_blocks: Line  # of those kept for backward, the ones inside the blocks
    block_inputs: Line  # the blocks' inputs (what checkpointing keeps instead)
    largest_block: Line  # the most one block keeps (recomputed in backward, one block at a time)
    split_kept: dict[int, Line]  # bytes kept in layers mp=K splits, by K
    forward: Line  # seconds
    backward: Line
    block_forward_fraction: float  # of the forward's time, the blocks' part
    step_per_byte: float  # the optimizer's step: seconds per byte of trainable parameters
    step_transient: float  # its transient bytes per byte of parameters
    latency: float  # seconds of an all-reduce of a few bytes over the world
    bandwidth: float  # bytes per second of the ring all-reduce (2(P-1)/P x bytes sent)
    notes: list[str] = field(default_factory=list)


def _nbytes(tensors: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


def _split(plan: Any, mp: int, rows_in: dict[str, float], total: float, element: int) -> Split:
    """The model-parallel plan of ``mp`` (or why there is none) read as bytes and work; ``rows_in``: Linear rows
    per batch row."""
    if isinstance(plan, str):
        return Split(total, impossible=f"mp={mp} cannot split the model: {plan}")
    split = [r for r in plan.layers if r.split in ("column", "row", "full", "heads")]
    if not split:
        return Split(total, impossible=f"mp={mp} splits none of the model's layers")
    saved = sum(r.dense_params - r.params_per_rank for r in split) * element
    dense = sum(r.dense_params for r in split) * element
    sent = sum(n * rows_in.get(r.name, 1.0) for r in plan.layers for _, _, n in r.collectives) * element
    return Split(total - saved, dense / total if total else 0.0, sent, plan.collectives_per_step)


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """The model's gradients, buffers and the random streams as they were, after whatever runs inside;
    gradients made inside are dropped as they arrive."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng = rng_state()
    for p in grads:
        p.grad = None
    hooks = [p.register_post_accumulate_grad_hook(_drop) for p in grads if p.requires_grad]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for p, g in grads.items():
            p.grad = g
        set_rng_state(rng)


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's random streams: the CPU's and every GPU's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []


def set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def _drop(p: torch.Tensor) -> None:
    p.grad = None


def loss_of(output: Any) -> torch.Tensor:
    """A scalar from any output, for a backward through every floating output (a Hugging Face output's
    ``loss`` where it has one)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    leaves = [t for t in tree_leaves(output if not hasattr(output, "to_tuple") else output.to_tuple())
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ValueError("the model's output holds no floating-point tensor that requires grad, so the planner "
                         "cannot run a backward through it")
    return sum(t.float().mean() for t in leaves)  # type: ignore[return-value]


class _Watch:
    """Which module runs, and the bytes autograd keeps while each does (one storage counted once)."""

    def __init__(self, model: nn.Module, blocks: list[str]) -> None:
        self.kept: dict[str, float] = {}
        self.inputs = 0.0
        self.stack: list[str] = [""]
        self.rows_in: dict[str, float] = {}
        self.seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.blocks = set(blocks)
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            self.stack.append(name)
            if name in self.blocks:
                self.inputs += _nbytes(t for t in tree_leaves(args) if isinstance(t, torch.Tensor))
            if isinstance(module, nn.Linear) and args and isinstance(args[0], torch.Tensor):
                self.rows_in[name] = args[0].numel() / max(1, args[0].shape[-1])
        return hook

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.stack.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.seen:
            self.seen.add(ptr)
            where = self.stack[-1]
            self.kept[where] = self.kept.get(where, 0.0) + t.untyped_storage().nbytes()
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def within(self, prefix: str) -> float:
        return sum(v for k, v in self.kept.items() if k == prefix or k.startswith(prefix + "."))


def _rows(example: Any, n: int, dim: int) -> Any:
    """The first ``n`` rows of every tensor of the example (along ``dim``)."""
    return tree_map(lambda t: t.narrow(dim, 0, min(n, t.shape[dim])) if isinstance(t, torch.Tensor)
                    and t.dim() > dim else t, example)


def _pass(model: nn.Module, example: Any) -> tuple[float, float]:
    """One forward and backward: their seconds."""
    start = time.perf_counter()
    loss = loss_of(observe.call(model, example))
    middle = time.perf_counter()
    loss.backward()
    return middle - start, time.perf_counter() - middle


def _measure_rows(model: nn.Module, example: Any, blocks: list[str], plans: dict[int, list[tuple[str, str]]]
                  ) -> dict[str, Any]:
    watch = _Watch(model, blocks)
    try:
        with LiveBytes() as live, torch.autograd.graph.saved_tensors_hooks(watch.pack, lambda t: t):
            loss_of(observe.call(model, example)).backward()
    finally:
        watch.close()
    inside = {b: watch.within(b) for b in blocks}
    times = [_pass(model, example) for _ in range(2)]
    block_time = _block_time(model, example, blocks) if blocks else 0.0
    return {"peak": float(live.peak), "in_blocks": sum(inside.values()), "block_inputs": watch.inputs,
            "largest_block": max(inside.values(), default=0.0),
            "split": {k: sum(watch.within(n) for n, how in rows if how in ("row", "local", "heads"))
                      for k, rows in plans.items()},
            "forward": min(t[0] for t in times), "backward": min(t[1] for t in times),
            "block_time": block_time, "rows_in": watch.rows_in}


def _block_time(model: nn.Module, example: Any, blocks: list[str]) -> float:
    """Seconds the blocks' forwards take, of one forward without grad."""
    spent = [0.0]
    starts: list[float] = []
    names = set(blocks)
    handles = []
    for name, module in model.named_modules():
        if name in names:
            handles.append(module.register_forward_pre_hook(lambda m, a: starts.append(time.perf_counter())))
            handles.append(module.register_forward_hook(
                lambda m, a, o: spent.__setitem__(0, spent[0] + time.perf_counter() - starts.pop())))
    try:
        with torch.no_grad():
            start = time.perf_counter()
            observe.call(model, example)
            whole = time.perf_counter() - start
    finally:
        for h in handles:
            h.remove()
    return spent[0] / whole if whole > 0 else 0.0


def _optimizer_step(model: nn.Module, states: int) -> tuple[float, float]:
    """Seconds and transient bytes per byte of parameters of the optimizer the plan assumes, stepping zeros of
    the shapes of the model's trainable parameters (the first 16 MB of them: foreach steps make their
    temporaries per list of tensors)."""
    shapes, total = [], 0
    for p in model.parameters():
        if p.requires_grad and total < (4 << 20):
            shapes.append(p)
            total += p.numel()
    params = [nn.Parameter(torch.zeros_like(p)) for p in shapes]
    for p in params:
        p.grad = torch.ones_like(p)
    nbytes = max(1.0, _nbytes(params))
    optimizer = make_optimizer(params, states)
    optimizer.step()  # its state
    times = []
    for _ in range(3):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    with LiveBytes() as live:
        optimizer.step()
    return min(times) / nbytes, live.peak / nbytes


def make_optimizer(params: Any, states: int) -> torch.optim.Optimizer:
    """The torch optimizer with ``states`` tensors per parameter: Adam (2), SGD with momentum (1), SGD (0)."""
    if states >= 2:
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if states == 1 else 0.0)


def _all_reduce_time(device: torch.device) -> tuple[float, float]:
    """Latency and ring bandwidth of the default group's all-reduce (every rank calls this)."""
    size = dist.get_world_size() if dist.is_initialized() else 1
    if size < 2:
        return 0.0, float("inf")
    out = []
    for nbytes in (1 << 10, 4 << 20):
        t = torch.zeros(nbytes // 4, device=device)
        dist.all_reduce(t)
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            best = min(best, time.perf_counter() - start)
        out.append(best)
    moved = 2 * (size - 1) / size * ((4 << 20) - (1 << 10))
    return out[0], moved / max(1e-9, out[1] - out[0])


def measure(model: nn.Module, example: Any, rows: tuple[int, int], world_size: int, states: int,
            blocks: sharded_blocks.Choice = None, batch_dim: int = 0) -> Profile:
    """Measure the model on two batch sizes of ``example`` (its first ``rows`` rows), and the world's
    all-reduce. Every rank calls it (the all-reduce is timed over the default group)."""
    params = list(model.parameters())
    element = params[0].element_size() if params else 4
    total = _nbytes(params)
    trainable = _nbytes(p for p in params if p.requires_grad)
    device = params[0].device if params else torch.device("cpu")
    found = sharded_blocks.find(model, blocks)
    names = [n for n, _ in found]
    largest = max((_nbytes(m.parameters()) for _, m in found), default=0.0)
    mps = [k for k in range(2, world_size + 1) if world_size % k == 0]
    first = _rows(example, rows[0], batch_dim)
    measured = []
    with untouched(model):
        explained: dict[int, Any] = {}
        for k in mps:
            try:
                explained[k] = rewrite.explain(model, k, example=first)
            except (ValueError, RuntimeError, NotImplementedError, TypeError) as err:
                explained[k] = str(err).splitlines()[0]
        plans = {k: [] if isinstance(p, str) else [(r.name, r.split) for r in p.layers] for k, p in explained.items()}
        _pass(model, first)  # warm
        for r in rows:
            measured.append(_measure_rows(model, _rows(example, r, batch_dim), names, plans))
        rows_in = {n: v / rows[0] for n, v in measured[0]["rows_in"].items()}
        splits = {k: _split(explained[k], k, rows_in, total, element) for k in mps}
    step, transient = _optimizer_step(model, states)
    latency, bandwidth = _all_reduce_time(device)
    (r1, m1), (r2, m2) = zip(rows, measured)

    def line(key: str) -> Line:
        return Line.through(r1, m1[key], r2, m2[key])

    return Profile(
        param_bytes=total, trainable_bytes=trainable, buffer_bytes=_nbytes(model.buffers()), blocks=names,
        largest_block_bytes=largest, splits=splits, peak=line("peak"), in_blocks=line("in_blocks"),
        block_inputs=line("block_inputs"), largest_block=line("largest_block"),
        split_kept={k: Line.through(r1, m1["split"][k], r2, m2["split"][k]) for k in mps},
        forward=line("forward"), backward=line("backward"),
        block_forward_fraction=(m1["block_time"] + m2["block_time"]) / 2, step_per_byte=step,
        step_transient=transient, latency=latency, bandwidth=bandwidth)
