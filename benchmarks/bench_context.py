"""Attention over one long sequence split across ranks (autodist.layers.context_attention) against one process.

What it measures
    One causal self-attention layer's forward and backward on one sequence (batch 1, 8 heads of 64, float32),
    at each length: split over the ranks (2 by default, gloo, 1 thread each; the keys and values all-gathered,
    their gradients all-reduced, each rank's chunks through torch's flash kernel), and on the whole sequence in
    one process (``F.scaled_dot_product_attention(is_causal=True)``), run by rank 0 while the other ranks wait
    at a barrier, so the two never share the cores. Rounds alternate the two, the order flipping every round.
    Also counted: the bytes each keeps for backward (the tensors autograd saves, each storage once), which is
    what grows with the number of layers. Every rank's output rows are checked against one process's once per
    length.

How to run
    python benchmarks/bench_context.py                      # 2 ranks, 4k and 8k tokens, about a minute
    python benchmarks/bench_context.py --lengths 2048,16384 --ranks 3
    python benchmarks/bench_context.py --quick              # smoke run of seconds, timing nothing

How to read it
    Per length, the median milliseconds of each (the split's: its slowest rank's median) and the ratio split /
    one process (lower is better), then the bytes saved for backward and their ratio. The layer only: a
    model's per-token layers (its Linears, norms, the loss) hold 1/K of one process's activations on each rank.
"""
from __future__ import annotations

import statistics
import sys
import time

import harness  # benchmarks/harness.py, next to this file
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autodist
from autodist.layers import SequenceSplit, context_attention

HEADS, HEAD_DIM = 8, 64


class SavedBytes:
    """The bytes autograd saves for backward inside the block, each storage once."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> "SavedBytes":
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def whole(length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(length)
    return tuple(torch.randn(1, HEADS, length, HEAD_DIM, generator=g) for _ in range(4))  # q, k, v, grad


def step_split(split: SequenceSplit, tensors: tuple[torch.Tensor, ...]) -> tuple[float, int, torch.Tensor]:
    rank = dist.get_rank()
    q, k, v, grad = (split.split(t, rank, dim=-2) for t in tensors)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dist.barrier()
    start = time.perf_counter()
    with SavedBytes() as saved:
        out = context_attention(q, k, v, split=split)
    out.backward(grad)
    return time.perf_counter() - start, saved.total, out.detach()


def step_one(tensors: tuple[torch.Tensor, ...]) -> tuple[float, int, torch.Tensor]:
    q, k, v = (t.clone().requires_grad_() for t in tensors[:3])
    start = time.perf_counter()
    with SavedBytes() as saved:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(tensors[3])
    return time.perf_counter() - start, saved.total, out.detach()


def measure(length: int, rounds: int) -> str | None:
    """This length's row (on rank 0; None on the others)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    split, tensors = SequenceSplit(length, size), whole(length)
    times: dict[str, list[float]] = {"split": [], "one": []}
    saved: dict[str, int] = {}
    for r in range(rounds + 1):  # the first round warms up, untimed
        for name in (("split", "one") if r % 2 == 0 else ("one", "split")):
            if name == "split":
                seconds, saved["split"], mine = step_split(split, tensors)
            else:
                dist.barrier()
                if rank == 0:
                    seconds, saved["one"], reference = step_one(tensors)
                dist.barrier()
            if r and (name == "split" or rank == 0):
                times[name].append(seconds)
    outputs = split.gather(mine, None, dim=-2)  # every rank's rows, to compare with one process's
    slowest = torch.tensor([statistics.median(times["split"]), float(saved["split"])])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    gap = float((outputs - reference).abs().max())
    assert gap < 1e-4, f"{length} tokens: the split's output differs from one process's by {gap:.1e}"
    one, split_s, split_b = statistics.median(times["one"]), slowest[0].item(), slowest[1].item()
    return (f"| {length} | {1e3 * one:.0f} | {1e3 * split_s:.0f} | {split_s / one:.2f} | {saved['one'] / 2**20:.0f} "
            f"| {split_b / 2**20:.0f} | {split_b / saved['one']:.2f} |")


def run_worker(args) -> None:
    autodist.init(backend="gloo")
    rows = [measure(length, args.rounds) for length in args.lengths]
    if dist.get_rank() == 0:
        print(f"causal attention, batch 1, {HEADS} heads of {HEAD_DIM}, float32, forward + backward; "
              f"{dist.get_world_size()} ranks, gloo, 1 thread each; median of {args.rounds} rounds\n")
        print("\n".join(["| tokens | one process ms | split ms (slowest rank) | split / one | one process saved MB "
                         "| split saved MB (largest rank) | split / one |", "|---|---|---|---|---|---|---|", *rows]),
              flush=True)


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2, ranks_option=True)
    parser.add_argument("--lengths", type=lambda t: [int(v) for v in t.split(",")], default=[4096, 8192],
                        help="comma-separated sequence lengths in tokens (default 4096,8192)")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds of each")
    args = parser.parse(quick={"lengths": [64], "rounds": 2})
    return harness.run(parser, args, run_worker)


if __name__ == "__main__":
    sys.exit(main())
