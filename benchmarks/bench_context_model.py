"""One long sequence through a Hugging Face model: cp=2 against one process, mp=2 and pp=2 (step time, peak memory).

What it measures
    Qwen2 built from a config (4 layers, hidden 128, 8 heads, ``attn_implementation="sdpa"``, float32), one
    sequence of each length a step (global batch 1), SGD, the loss written in the loop on labels shifted in the
    data; a step is the forward, the loss, backward and the optimizer step. Each layout runs in processes of
    its own, one after another (fresh ones for each length): one process (no launcher), then 2 ranks (gloo, 1
    thread each) with ``parallelize(..., cp=2)``, ``mp=2`` and ``pp=2``. Per layout: the median of the timed
    steps (its slowest
    rank's), and the peak resident memory of its largest process from just before ``parallelize`` to the last
    step (``VmHWM``: everything the process holds, autodist's buffers and the planning of mp and pp included),
    also as what it grew above the process before the model was built (torch and transformers imported: about
    400 MB that every process pays whatever it trains).
    The cp=2 run's loss is checked against one process's (the sum of the ranks' token-weighted losses).

How to run
    python benchmarks/bench_context_model.py                     # 2048 and 4096 tokens, a few minutes
    python benchmarks/bench_context_model.py --lengths 8192 --layouts one,cp2
    python benchmarks/bench_context_model.py --quick             # smoke run of seconds, timing nothing
    python benchmarks/bench_context_model.py --budget 512 --layouts one,cp2   # the longest sequence in 512 MB
    python benchmarks/bench_context_model.py --layouts one,cp2 --padded 0.1  # a tenth of each sequence padding
    python benchmarks/bench_context_model.py --layouts one,cp2,one-compiled,cp2-compiled --warmup 2  # compiled

How to read it
    One row per length and layout: milliseconds a step, its ratio to one process's (lower is better), peak MB
    and its ratio to one process's. cp holds each rank's tokens' activations (half of one process's at 2 ranks)
    plus the whole sequence's keys and values of one layer at a time; mp=2 and pp=2 plan from runs of the whole
    model on one rank.

    With ``--budget MB``: for each layout, the longest sequence (to 256 tokens) whose training step grows its
    largest process by at most MB above the idle process (found by doubling, then halving the gap: one step, in
    fresh processes each try), and its ratio to one process's (``--quick``: one try of 64 tokens each).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import harness  # benchmarks/harness.py, next to this file
import torch
import torch.distributed as dist
import torch.nn.functional as F
from live_bytes import reset_peak, resident
from torch.utils.data import DataLoader, TensorDataset

LAYOUTS = ["one", "cp2", "mp2", "pp2"]
COMPILED = ["one-compiled", "cp2-compiled"]  # torch.compile(model) after parallelize (asked for by name)
VOCAB = 1024


def model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=16384,
                                      attn_implementation="sdpa", use_cache=False)
    return transformers.Qwen2ForCausalLM(config)


def data(length: int, steps: int, padded: float = 0.0) -> TensorDataset:
    """Token ids and their next tokens; with ``padded`` that fraction of each sequence right padding: an
    ``attention_mask`` (0 there) and labels -100 there."""
    ids = torch.randint(0, VOCAB, (steps, length + 1), generator=torch.Generator().manual_seed(length))
    if not padded:
        return TensorDataset(ids[:, :-1], ids[:, 1:].clone())
    mask = (torch.arange(length) < round(length * (1 - padded))).long().expand(steps, -1).contiguous()
    return TensorDataset(ids[:, :-1], ids[:, 1:].masked_fill(mask == 0, -100), mask)


def run_layout(layout: str, length: int, steps: int, warmup: int, padded: float = 0.0) -> dict:
    """This process's part of one layout: step seconds, peak bytes, losses."""
    import autodist

    options = {"one": {}, "cp2": {"cp": 2}, "mp2": {"mp": 2}, "pp2": {"pp": 2}}[layout.removesuffix("-compiled")]
    import transformers  # noqa: F401 - imported before the idle process is measured

    idle = resident()  # torch and transformers imported (the process group joined), nothing of the model yet
    built = model()
    reset_peak()
    loader = DataLoader(data(length, steps + warmup, padded), batch_size=1)
    net, loader = autodist.parallelize(built, loader, **options)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    if layout.endswith("-compiled"):  # compiled in the warmup steps (give it two: --warmup 2)
        net = torch.compile(net)
    seconds, losses = [], []
    for step, (x, y, *mask) in enumerate(loader):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = net(input_ids=x, attention_mask=mask[0] if mask else None).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
        losses.append((loss.item(), int((y != -100).sum())))
    return {"seconds": statistics.median(seconds), "peak": resident("VmHWM"), "idle": idle, "losses": losses}


def run_part(args) -> None:
    """One layout (the worker on the ranks, or one process with --solo); its row written to ``--out``."""
    autodist_world = dist.is_initialized() or "RANK" in os.environ
    if autodist_world:
        import autodist

        autodist.init(backend="gloo")
    rows = []
    for length in args.lengths:
        mine = run_layout(args.layout, length, args.steps, args.warmup, args.padded)
        if dist.is_initialized():
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        rows.append({"length": length, "seconds": max(g["seconds"] for g in gathered),
                     "peak": max(g["peak"] for g in gathered), "grown": max(g["peak"] - g["idle"] for g in gathered),
                     "loss": _whole_loss([g["losses"] for g in gathered], args.layout)})
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps({"layout": args.layout, "rows": rows}) + "\n")


def _whole_loss(per_rank: list[list[tuple[float, int]]], layout: str) -> list[float]:
    """Each step's loss over the whole sequence: under cp the ranks' token-weighted means added up, else any
    rank's (every rank of mp and pp returns the whole batch's)."""
    if not layout.startswith("cp2"):
        return [loss for loss, _ in per_rank[0]]
    return [sum(loss * n for loss, n in step) / sum(n for _, n in step) for step in zip(*per_rank)]


def _trial(parser: harness.Parser, args, layout: str, length: int, steps: int, warmup: int) -> dict:
    """One layout at one length in fresh processes (``steps`` timed after ``warmup``): its row (seconds, peak,
    grown, loss)."""
    out = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    forwarded = [word for word in parser.forwarded(args) if not word.startswith(("--lengths=", "--budget="))]
    argv = [*forwarded, f"--lengths={length}", f"--layout={layout}", f"--out={out}", f"--steps={steps}",
            f"--warmup={warmup}"]
    code = harness.solo(parser.script, argv) if layout == "one" else harness.torchrun(parser.script, 2, argv)
    if code != 0:
        raise SystemExit(f"{layout} at {length} tokens failed (exit status {code})")
    with open(out) as f:
        row = json.loads(f.read().splitlines()[-1])["rows"][0]
    os.unlink(out)
    return row


def longest(parser: harness.Parser, args) -> int:
    """The longest sequence each layout trains within ``--budget`` MB above its idle process."""
    budget, found = args.budget * 2**20, {}
    for layout in args.layouts:
        fits, over, length = 0, None, 64 if args.quick else 1024
        while over is None or over - fits > 256:
            grown = _trial(parser, args, layout, length, 1, 0)["grown"]
            print(f"{layout}: {length} tokens grow the process by {grown / 2**20:.0f} MB", flush=True)
            if grown <= budget:
                fits = length
            else:
                over = length
            if args.quick:  # a smoke run: one try each
                break
            length = 2 * length if over is None else (fits + over) // 512 * 256
        found[layout] = fits
    print(f"\nthe longest sequence within {args.budget} MB above the idle process (Qwen2 as above, one step, to "
          f"256 tokens)\n\n| layout | tokens | vs one process |\n|---|---|---|")
    for layout, tokens in found.items():
        ratio = f"{tokens / found['one']:.2f}" if found.get("one") else "-"
        print(f"| {layout} | {tokens} | {ratio} |")
    return 0


def launch(parser: harness.Parser, args) -> int:
    if args.budget is not None:
        return longest(parser, args)
    results: dict[str, list] = {}
    for length in args.lengths:  # fresh processes for each: a peak holds nothing of another length
        for layout in args.layouts:
            results.setdefault(layout, []).append(_trial(parser, args, layout, length, args.steps, args.warmup))
    print(f"Qwen2 (4 layers, hidden 128, 8 heads, sdpa), one sequence a step, float32, SGD; 2 ranks, gloo, 1 "
          f"thread each; median of {args.steps} steps\n")
    print("| tokens | layout | step ms | vs one process | peak MB (largest process) | vs one process | above the "
          "idle process MB | vs one process |")
    print("|---|---|---|---|---|---|---|---|")
    for i, length in enumerate(args.lengths):
        base = results.get("one", [None] * len(args.lengths))[i]
        for layout in args.layouts:
            row = results[layout][i]
            speed = f"{row['seconds'] / base['seconds']:.2f}" if base else "-"
            memory = f"{row['peak'] / base['peak']:.2f}" if base else "-"
            grown = f"{row['grown'] / base['grown']:.2f}" if base else "-"
            print(f"| {length} | {layout} | {1e3 * row['seconds']:.0f} | {speed} | {row['peak'] / 2**20:.0f} | "
                  f"{memory} | {row['grown'] / 2**20:.0f} | {grown} |")
        for cp in (name for name in ("cp2", "cp2-compiled") if base and name in results):
            gap = max(abs(a - b) for a, b in zip(results[cp][i]["loss"], base["loss"]))
            assert gap < 1e-4, f"{length} tokens: {cp}'s loss differs from one process's by {gap:.1e}"
    return 0


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=2, solo=True)
    parser.add_argument("--lengths", type=lambda t: [int(v) for v in t.split(",")], default=[2048, 4096],
                        help="comma-separated sequence lengths in tokens (default 2048,4096)")
    parser.add_argument("--layouts", type=harness.some_of(LAYOUTS + COMPILED), default=LAYOUTS,
                        help=f"which of {','.join(LAYOUTS + COMPILED)} (default: the first four)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--padded", type=float, default=0.0,
                        help="this fraction of each sequence right padding (attention_mask 0, labels -100 there)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--budget", type=float, default=None,
                        help="MB above the idle process: find each layout's longest sequence within it")
    parser.add_argument("--layout", choices=LAYOUTS + COMPILED, help=argparse_suppress())
    parser.add_argument("--out", help=argparse_suppress())
    args = parser.parse(quick={"lengths": [64], "steps": 2, "warmup": 1})
    if args.worker or args.solo:
        torch.set_num_threads(1)
        run_part(args)
        return 0
    return launch(parser, args)


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
