"""What the planner measures on this rank before it predicts anything: the model's bytes (and what ``mp=K``
keeps of them, from the model-parallel plan), the bytes a forward/backward makes and their peak at two batch
sizes, with and without the blocks checkpointed, gradients dropped or counted as kept (and of what autograd
keeps, the part ``mp=K`` splits and the blocks' inputs), its time, an optimizer step's time and temporaries,
and the time of the process group's all-reduce.

The measuring leaves the model as it was (:func:`~autodist.planner.step.untouched`): its gradients, buffers
(BatchNorm's running statistics) and the random streams are put back, and gradients made during it are
dropped as they arrive.

Example:
    >>> profile = measure(model, example, rows=(8, 16), world_size=2, states=2)
    >>> profile.peak(32)          # bytes a forward/backward of 32 rows makes at its peak
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from autodist.dp import precision
from autodist.dp.buckets import sum_dtype
from autodist.mp import rewrite
from autodist.planner.context import Context
from autodist.planner.experts import Experts, as_placed
from autodist.planner.live import LiveBytes, nbytes
from autodist.planner.stages import Blocks, Stage, bounds_of, measure_blocks, refusal
from autodist.planner.step import first_rows, loss_of, make_optimizer, untouched
from autodist.runtime import tree
from autodist.runtime.comm import carrier, reduce_scatter_single
from autodist.sharded import blocks as sharded_blocks
from autodist.sharded import recompute


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
    peak: Line  # bytes made at the peak of a forward/backward, gradients dropped as they come
    kept: Line  # the same, gradients kept (zero_grad() freed them before: backward makes them anew)
    checkpoint_peak: Line  # both with the blocks recomputed in backward
    checkpoint_kept: Line
    block_inputs: Line  # bytes of the blocks' inputs, which checkpointing keeps (whole under mp)
    split_kept: dict[int, Line]  # bytes kept for backward that mp=K splits, by K
    forward: Line  # seconds
    backward: Line
    recompute: Line  # seconds checkpointing adds to a forward/backward
    step_per_byte: float  # the optimizer's step: seconds per byte of trainable parameters
    step_transient: float  # its temporaries per byte of parameters it steps (a foreach step), or
    step_transient_bytes: float  # its temporaries in bytes (a step one tensor at a time: the largest one's)
    latency: float  # seconds of an all-reduce of a few bytes over the world
    bandwidth: float  # bytes per second of the ring all-reduce (2(P-1)/P x bytes sent)
    notes: list[str] = field(default_factory=list)
    widened: float = 1.0  # bytes the ranks sum per byte of trainable parameters (2: bfloat16 summed in float32)
    block_measures: Blocks | None = None  # each block's bytes and time, for pp's stages (None: no pp possible)
    send_latency: float = 0.0  # seconds of a small send from one rank to another
    scatter_share: float = 0.5  # a reduce-scatter's time over an all-reduce's of the same bytes (gloo's: about 1)
    cuts: dict[int, list[int]] = field(default_factory=dict)  # by pp: where each stage begins, and the end
    cut_refusals: dict[int, str] = field(default_factory=dict)  # by pp: why that cut cannot run ("" where it can)
    contexts: dict[int, Context] = field(default_factory=dict)  # by cp: what it sends and keeps (none: no attention)
    experts: Experts = field(default_factory=Experts)  # what ep places and sends (no layers: no experts)
    placed: dict[int, tuple[Line, Line, Line, Line]] = field(default_factory=dict)  # by ep: the 4 peaks, as placed

    def peaks(self, ep: int = 1) -> tuple[Line, Line, Line, Line]:
        """The peaks of a forward/backward (gradients dropped, kept; checkpointed, dropped and kept): one
        process's, or with ``ep`` a rank's, its experts computed as placed
        (:func:`~autodist.planner.experts.as_placed`)."""
        if ep in self.placed:
            return self.placed[ep]
        return self.peak, self.kept, self.checkpoint_peak, self.checkpoint_kept

    def attention_share(self, pp: int) -> float:
        """The share of the model's attention calls the fullest of ``pp`` stages makes: its blocks' share of them (1
        without stages)."""
        if pp == 1 or pp not in self.cuts:
            return 1.0
        bounds = self.cuts[pp]
        return max(hi - lo for lo, hi in zip(bounds, bounds[1:])) / max(1, bounds[-1] - bounds[0])

    def stage_fraction(self, stage: Stage) -> float:
        """The share of the model's parameter bytes a rank of ``stage`` holds: every parameter outside the
        blocks (each stage keeps them) and its blocks'."""
        if self.block_measures is None or not self.param_bytes:
            return 1.0
        outside = max(0.0, self.param_bytes - sum(self.block_measures.params))
        return (outside + stage.block_bytes) / self.param_bytes

    def outside_fraction(self, stage: Stage) -> float:
        """Of the parameter bytes a rank of ``stage`` holds, the share outside the blocks."""
        if self.block_measures is None or not self.param_bytes:
            return 1.0
        outside = max(0.0, self.param_bytes - sum(self.block_measures.params))
        return outside / (outside + stage.block_bytes) if outside + stage.block_bytes else 1.0

    def stage_share(self, whole: float, stage: Stage, rows: float, checkpoint: bool, pieces: int = 1,
                    held: int | None = None) -> float:
        """Of ``whole`` bytes a forward/backward keeps on one rank, what ``stage`` keeps with ``held`` of its
        ``pieces`` micro-batches in flight (None: all of them, GPipe): the blocks' part in proportion to what they
        save, the rest (the head's) on the last stage. Checkpointed, the blocks keep their inputs, in proportion to
        their number, and recompute one block of one micro-batch at a time; the rest of ``whole``, less the one
        pass's recomputing of its largest block, is the head's. A stage before the last keeps its outputs too,
        until the next stage sends their gradients."""
        measures = self.block_measures
        if measures is None:
            return whole
        flight = (pieces if held is None else held) / max(1, pieces)
        outputs = stage.sent_per_row * rows
        if checkpoint:
            inputs = min(whole, self.block_inputs(rows))
            recomputed = min(whole - inputs, max(measures.saved, default=0.0) * rows)
            head = whole - inputs - recomputed
            return (flight * (inputs * stage.blocks / max(1, len(measures.saved)) + outputs
                              + (head if stage.last else 0.0)) + stage.largest_saved_per_row * rows / max(1, pieces))
        in_blocks = min(whole, sum(measures.saved) * rows)
        share = stage.saved_per_row / sum(measures.saved) if sum(measures.saved) else 1.0 / len(measures.saved)
        return flight * (in_blocks * share + outputs + (whole - in_blocks if stage.last else 0.0))

    def per_rank(self, layout: Any) -> tuple[float, float, float]:
        """Parameter bytes a rank of ``layout`` holds whole (after ``mp``), the trainable part of them, and the
        trainable bytes it updates itself (its 1/dp under ``shard=``, over the data- and context-parallel ranks).
        Under ``ep`` a rank holds ``1/ep`` of the experts, its own, never sharded further."""
        params = self.splits[layout.mp].param_bytes if layout.mp > 1 else self.param_bytes
        trainable = params * (self.trainable_bytes / self.param_bytes if self.param_bytes else 1.0)
        placed, placed_trainable = self.experts_here(layout)
        if placed_trainable or placed:
            params -= self.experts.param_bytes - placed
            trainable -= self.experts.trainable_bytes - placed_trainable
        over = layout.dp * layout.cp
        dense = trainable - placed_trainable
        own = (dense / over if layout.shard is not None and over > 1 else dense) + placed_trainable
        return params, trainable, own

    def experts_here(self, layout: Any) -> tuple[float, float]:
        """Bytes of the experts a rank of ``layout`` holds under ``ep`` (the trainable part): ``1/ep`` of them; (0,
        0) without ``ep`` (the experts are parameters like the others)."""
        ep = getattr(layout, "ep", 1)
        if ep == 1:
            return 0.0, 0.0
        return self.experts.param_bytes / ep, self.experts.trainable_bytes / ep


def summed_nbytes(params: Any) -> float:
    """The bytes of ``params``' gradients in the dtype the ranks sum them in (float32 for float16 and bfloat16:
    :func:`autodist.dp.buckets.sum_dtype`), as the gradient buckets hold them."""
    return float(sum(p.numel() * sum_dtype(p.dtype).itemsize for p in params))


def _split(plan: Any, mp: int, rows_in: dict[str, float], total: float, element: int, moved: int) -> Split:
    """The model-parallel plan of ``mp`` (or why there is none) read as bytes and work; ``rows_in``: Linear rows
    per batch row; ``element``: bytes of a parameter, ``moved``: of an activation."""
    if isinstance(plan, str):
        return Split(total, impossible=f"mp={mp} cannot split the model: {plan}")
    split = [r for r in plan.layers if r.split in ("column", "row", "full", "heads")]
    if not split:
        return Split(total, impossible=f"mp={mp} splits none of the model's layers")
    saved = sum(r.dense_params - r.params_per_rank for r in split) * element
    dense = sum(r.dense_params for r in split) * element
    sent = sum(n * rows_in.get(r.name, 1.0) for r in plan.layers for _, _, n in r.collectives) * moved
    return Split(total - saved, dense / total if total else 0.0, sent, plan.collectives_per_step)


class _Watch:
    """The bytes autograd keeps (one storage counted once), and of them those ``mp=K`` splits: kept inside a
    layer the plan splits by rows (its input is a slice) or kept between a column-split layer's output and
    the next row-split layer (attention's heads, the MLP's activation), as Megatron's split makes them."""

    def __init__(self, model: nn.Module, roles: dict[int, dict[str, str]], blocks: list[str]) -> None:
        self.roles, self.blocks = roles, set(blocks)
        self.block_inputs = 0.0  # what checkpointing keeps of each block: its inputs
        self.split = {k: 0.0 for k in roles}
        self.between = {k: False for k in roles}
        self.stack: list[str] = [""]
        self.rows_in: dict[str, float] = {}
        self.seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave(name)))

    def _enter(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            self.stack.append(name)
            if name in self.blocks:
                self.block_inputs += nbytes(t for t in tree_leaves(args) if isinstance(t, torch.Tensor))
            if isinstance(module, nn.Linear) and args and isinstance(args[0], torch.Tensor):
                self.rows_in[name] = args[0].numel() / max(1, args[0].shape[-1])
        return hook

    def _leave(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.stack.pop()
            for k, roles in self.roles.items():
                if roles.get(name) == "column":
                    self.between[k] = True
                elif roles.get(name) == "row":
                    self.between[k] = False
        return hook

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.seen:
            self.seen.add(ptr)
            where = self.stack[-1]
            for k, roles in self.roles.items():
                role = roles.get(where)
                if role in ("row", "local", "heads") or (self.between[k] and role != "column"):
                    self.split[k] += t.untyped_storage().nbytes()
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _pass(model: nn.Module, example: Any) -> tuple[float, float]:
    """One forward and backward: their seconds."""
    start = time.perf_counter()
    loss = loss_of(tree.call(model, example))
    middle = time.perf_counter()
    loss.backward()
    return middle - start, time.perf_counter() - middle


@contextlib.contextmanager
def _checkpointed(model: nn.Module, blocks: list[str]) -> Iterator[None]:
    """The blocks recomputed in backward (as ``checkpoint=True`` makes them) while inside."""
    modules = dict(model.named_modules())
    recompute.setup(model, blocks)
    try:
        yield
    finally:
        for name in blocks:
            modules[name].__dict__.pop("forward", None)


def _peaks(model: nn.Module, example: Any, dropped: list[LiveBytes]) -> tuple[float, float]:
    """The most bytes a forward/backward makes and holds at one time: with the gradients dropped as they
    arrive, and counting them as kept."""
    with LiveBytes() as live:
        dropped.append(live)
        try:
            loss_of(tree.call(model, example)).backward()
        finally:
            dropped.remove(live)
    return float(live.peak), float(live.peak_held)


def _measure_rows(model: nn.Module, example: Any, blocks: list[str], roles: dict[int, dict[str, str]],
                  dropped: list[LiveBytes]) -> dict[str, Any]:
    """One batch size's measures: the peaks (with and without checkpointing, gradients dropped or kept), the
    bytes mp splits, the times."""
    watch = _Watch(model, roles, blocks)
    try:
        with torch.autograd.graph.saved_tensors_hooks(watch.pack, lambda t: t):
            peak, kept = _peaks(model, example, dropped)
    finally:
        watch.close()
    forward, backward = min((_pass(model, example) for _ in range(2)), key=sum)
    measured = {"peak": peak, "kept": kept, "split": watch.split, "forward": forward, "backward": backward,
                "rows_in": watch.rows_in, "block_inputs": watch.block_inputs, "checkpoint_peak": peak,
                "checkpoint_kept": kept, "recompute": 0.0}
    if blocks:
        with _checkpointed(model, blocks):
            measured["checkpoint_peak"], measured["checkpoint_kept"] = _peaks(model, example, dropped)
            measured["recompute"] = max(0.0, min(sum(_pass(model, example)) for _ in range(2)) - forward - backward)
    return measured


def _placed_rows(model: nn.Module, example: Any, blocks: list[str], dropped: list[LiveBytes]) -> list[float]:
    """The four peaks of one batch size (gradients dropped, kept; checkpointed, the same), as :func:`_measure_rows`
    measures them."""
    peak, kept = _peaks(model, example, dropped)
    if not blocks:
        return [peak, kept, peak, kept]
    with _checkpointed(model, blocks):
        return [peak, kept, *_peaks(model, example, dropped)]


def _optimizer_step(model: nn.Module, states: int) -> tuple[float, float, float]:
    """The optimizer the plan assumes, stepping zeros of the shapes of the model's trainable parameters (the
    largest first, then the others in order, up to 16 MB): seconds per byte, and its temporaries, either per
    byte (a foreach step makes them for a whole list of tensors: CUDA) or in bytes (a step one tensor at a
    time makes the largest one's: CPU), whichever the two measures show."""
    trainable = sorted((p for p in model.parameters() if p.requires_grad), key=lambda p: -p.numel())
    shapes, total = [], 0
    for p in trainable[:1] + trainable[1:]:
        if total < (4 << 20) or not shapes:
            shapes.append(p)
            total += p.numel()

    def temporaries(sample: list[nn.Parameter]) -> tuple[float, float]:
        params = [nn.Parameter(torch.zeros_like(p)) for p in sample]
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer = make_optimizer(params, states)
        optimizer.step()  # its state
        times = []
        for _ in range(3):
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        with LiveBytes() as live:
            optimizer.step()
        return min(times) / max(1.0, nbytes(params)), float(live.peak)

    if not shapes:
        return 0.0, 0.0, 0.0
    per_byte, whole = temporaries(shapes)
    _, largest = temporaries(shapes[:1])
    if len(shapes) > 1 and whole > 1.5 * largest:
        return per_byte, whole / nbytes(shapes), 0.0
    return per_byte, 0.0, largest


def _timed(call: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """The median seconds of ``call()``, a collective, each call after a barrier (one slow call, a core taken by
    something else, moves a minimum or a mean; a step meets the typical call)."""
    def done() -> None:  # NCCL's collectives return once queued: the time is the device's
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    call()
    done()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        done()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def link_time(device: torch.device, repeats: int = 9) -> tuple[float, float, float]:
    """Latency and ring bandwidth of the default group's all-reduce, and a reduce-scatter's time over an
    all-reduce's of the same bytes (a ring's: 1/2; gloo's, which sends what an all-reduce sends: about 1); the
    slowest rank's (every rank calls this)."""
    size = dist.get_world_size() if dist.is_initialized() else 1
    if size < 2:
        return 0.0, float("inf"), 0.5
    large = 4 << 20
    small = torch.zeros(256, device=device)
    part = torch.zeros(large // 4 // size, device=device)
    whole = torch.zeros(part.numel() * size, device=device)
    times = [_timed(lambda: dist.all_reduce(small), repeats, device),
             _timed(lambda: dist.all_reduce(whole), repeats, device)]
    try:
        reduce_scatter_single(part, whole)
        scatters = True
    except (RuntimeError, NotImplementedError):  # a backend without it for this device (on every rank alike)
        scatters = False
    times.append(_timed(lambda: reduce_scatter_single(part, whole), repeats, device) if scatters else times[1])
    agreed = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    latency, reduced, scattered = agreed.tolist()
    moved = 2 * (size - 1) / size * (whole.numel() - small.numel()) * 4
    return latency, moved / max(1e-9, reduced - latency), min(1.0, max(0.25, scattered / reduced))


def _send_time(device: torch.device) -> float:
    """Seconds of one small send to another rank, as a pipeline's stages send (half a round trip between ranks
    ``2i`` and ``2i + 1``; every rank calls this)."""
    size = dist.get_world_size() if dist.is_initialized() else 1
    if size < 2:
        return 0.0
    rank = dist.get_rank()
    peer = rank ^ 1 if rank ^ 1 < size else None
    t = torch.zeros(256, device=carrier(device))  # where a pipeline's sends carry it (gloo: host memory)
    best = float("inf")
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        if peer is not None:
            first, second = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)
            first(t, peer)
            second(t, peer)
        best = min(best, (time.perf_counter() - start) / 2)
    return best


def probe_peak(model: nn.Module, example: Any, rows: int, batch_dim: int = 0,
               compute: torch.dtype | None = None) -> float:
    """The most bytes a forward/backward of the example's first ``rows`` rows makes at one time, gradients counted
    as kept: infinite where the device runs out of memory, NaN where the model fails on so few rows."""
    dropped: list[LiveBytes] = []
    try:
        with untouched(model, dropped), precision.computing_in(model, compute):
            return _peaks(model, first_rows(example, rows, batch_dim), dropped)[1]
    except torch.OutOfMemoryError:
        return float("inf")
    except Exception:  # noqa: BLE001 - a model that needs more rows (BatchNorm: two) or fails anyway
        return float("nan")


def rows_within(peak_of: Callable[[int], float], rows: tuple[int, int], room: float, name: str) -> tuple[int, int]:
    """The two batch sizes to measure at: ``rows`` (a rank's share and twice it), or fewer where a forward/backward
    of them would make more than ``room`` bytes at its peak. ``peak_of(r)`` measures ``r`` rows' peak (every rank
    alike). One row and two are measured first (two and three where one fails: BatchNorm); where ``rows`` fit the
    line through them, with the slope doubled, they are taken; else the rows double while that line, through the
    last two measured, puts the next within ``room``, and the last two measured are taken, the rest extrapolated
    (:class:`Line`). Planning a model whose activations at a rank's share would not fit a rank costs no more than
    a rank has: two rows' forward/backward at least (three where one row fails).

    Example:
        >>> rows_within(lambda r: 5e8 + 5e7 * r, rows=(16, 32), room=1.5e9, name="GPT")   # 32 rows: 2.1 GB
        (4, 8)
    """
    first = 1
    measured = [(1, peak_of(1))]
    if measured[0][1] != measured[0][1]:  # NaN: one row fails
        first, measured = 2, [(2, peak_of(2))]
    if measured[0][1] != measured[0][1]:  # the model fails on two rows too: measured on the share, as it is
        return rows
    if first >= rows[1]:
        return rows
    measured.append((first + 1, peak_of(first + 1)))
    if measured[1][1] != measured[1][1]:  # NaN: fails on a row more, not on fewer: measured on the share
        return rows
    if float("inf") in (measured[0][1], measured[1][1]):
        raise ValueError(f"plan='auto' measures {name} on a rank before it predicts a layout, and a forward/backward "
                         f"of {measured[1][0]} rows of the batch ran out of the device's memory: no layout the plan "
                         f"measures fits here. What would help: shorter rows, or a layout written by hand that splits "
                         f"a row (cp=K splits its tokens, mp=K its layers), with checkpoint=True")

    def ahead(r: int) -> float:  # the line through the last two measures, its slope doubled: a margin
        (r1, y1), (r2, y2) = measured[-2:]
        return y2 + 2 * max(0.0, (y2 - y1) / (r2 - r1)) * (r - r2)

    if ahead(rows[1]) <= room or measured[-1][0] >= rows[1]:
        return rows
    while measured[-1][0] < rows[1] and measured[-1][1] <= room:
        nxt = min(rows[1], 2 * measured[-1][0])
        if ahead(nxt) > room:
            break
        measured.append((nxt, peak_of(nxt)))
    if measured[-1][1] > room and len(measured) > 2:  # not as the line said: the rows before it
        measured.pop()
    if measured[-1][0] >= rows[1]:
        return rows
    return measured[-2][0], measured[-1][0]


def measure(model: nn.Module, example: Any, rows: tuple[int, int], world_size: int, states: int,
            blocks: sharded_blocks.Choice = None, batch_dim: int = 0, compute: torch.dtype | None = None,
            ep: list[int] | tuple[int, ...] = ()) -> Profile:
    """Measure the model on two batch sizes of ``example`` (its first ``rows`` rows), and the world's
    all-reduce; ``compute``: forward and backward in that dtype (``mixed_precision=``), the parameters float32;
    ``ep``: the degrees whose peaks are measured with the experts computed as a rank of them computes.
    Every rank calls it (the all-reduce is timed over the default group)."""
    params = list(model.parameters())
    element = params[0].element_size() if params else 4
    moved = compute.itemsize if compute is not None else element  # bytes of an activation mp's all-reduces send
    total = nbytes(params)
    trainable = nbytes(p for p in params if p.requires_grad)
    summed = summed_nbytes(p for p in params if p.requires_grad)
    device = params[0].device if params else torch.device("cpu")
    found = sharded_blocks.find(model, blocks)
    names = [n for n, _ in found]
    largest = max((nbytes(m.parameters()) for _, m in found), default=0.0)
    mps = [k for k in range(2, world_size + 1) if world_size % k == 0]
    first = first_rows(example, rows[0], batch_dim)
    measured = []
    dropped: list[LiveBytes] = []
    with untouched(model, dropped):
        explained: dict[int, Any] = {}
        for k in mps:
            try:
                explained[k] = rewrite.explain(model, k, example=first)
            except (ValueError, RuntimeError, NotImplementedError, TypeError) as err:
                explained[k] = str(err).splitlines()[0]
        roles = {k: {} if isinstance(p, str) else {r.name: r.split for r in p.layers} for k, p in explained.items()}
        with precision.computing_in(model, compute):
            _pass(model, first)  # warm
            for r in rows:
                measured.append(_measure_rows(model, first_rows(example, r, batch_dim), names, roles, dropped))
            pipelined = measure_blocks(model, names, first, rows[0]) if len(names) > 1 and world_size > 1 else None
            degrees = [k for k in range(2, min(world_size, len(names)) + 1) if world_size % k == 0]
            cuts = {k: bounds_of(pipelined, k) for k in degrees} if pipelined is not None else {}
            two = first_rows(example, max(2, rows[0]), batch_dim)  # micro-batches to merge, however small the share
            refused = {k: refusal(model, names, bounds, two, batch_dim) for k, bounds in cuts.items()}
            placed = {}
            for k in ep:
                with as_placed(model, k):
                    each = [_placed_rows(model, first_rows(example, r, batch_dim), names, dropped) for r in rows]
                placed[k] = tuple(Line.through(rows[0], a, rows[1], b) for a, b in zip(*each))
        rows_in = {n: v / rows[0] for n, v in measured[0]["rows_in"].items()}
        splits = {k: _split(explained[k], k, rows_in, total, element, moved) for k in mps}
    step, transient, transient_bytes = _optimizer_step(model, states)
    latency, bandwidth, scatter_share = link_time(device)
    send = _send_time(device)
    (r1, m1), (r2, m2) = zip(rows, measured)

    def line(key: str) -> Line:
        return Line.through(r1, m1[key], r2, m2[key])

    return Profile(
        param_bytes=total, trainable_bytes=trainable, buffer_bytes=nbytes(model.buffers()), blocks=names,
        largest_block_bytes=largest, splits=splits, peak=line("peak"), kept=line("kept"),
        checkpoint_peak=line("checkpoint_peak"), checkpoint_kept=line("checkpoint_kept"),
        block_inputs=line("block_inputs"),
        split_kept={k: Line.through(r1, m1["split"][k], r2, m2["split"][k]) for k in mps},
        forward=line("forward"), backward=line("backward"), recompute=line("recompute"), step_per_byte=step,
        step_transient=transient, step_transient_bytes=transient_bytes, latency=latency, bandwidth=bandwidth,
        scatter_share=scatter_share,
        widened=summed / trainable if trainable else 1.0, block_measures=pipelined, send_latency=send, cuts=cuts,
        cut_refusals=refused, placed=placed)  # type: ignore[arg-type]
