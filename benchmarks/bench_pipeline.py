"""Pipeline parallelism: autodist's pp=2 against torch.distributed.pipelining (GPipe, 1F1B), and over a slow link
against data parallelism.

What it measures
    A nanoGPT-style decoder (``benchmarks/gpt_block.py``: ``--layers`` blocks of ``--width``, ``--heads`` heads,
    a vocabulary of ``--vocab``, float32, SGD lr 0.1) trained on a global batch of ``--batch`` rows of ``--seq``
    random tokens (``--distinct`` different batches, taken in turn), cut into 2 pipeline stages at its blocks,
    ``--microbatches`` micro-batches per step, on 2 CPU ranks (torchrun, gloo), by four contenders:

    * ``torch GPipe``, ``torch 1F1B``: ``torch.distributed.pipelining``'s ``PipelineStage`` built by hand (as
      its docs do: the first stage holds the embeddings and its blocks, the last its blocks, the final norm and
      the head, and computes the loss) run by ``ScheduleGPipe`` or ``Schedule1F1B``;
    * ``autodist GPipe``: ``autodist.parallelize(model, loader, pp=2, microbatches=M)`` and the plain loop
      ``loss_fn(model(x), y).backward()``: every stage gets the model's output (broadcast from the last) and
      computes the loss; the root (embeddings, final norm, head) is held by both stages and its gradients
      all-reduced once per step;
    * ``autodist 1F1B``: the same with ``loss_fn=`` given to ``parallelize``; ``model(x, target=y)`` runs the
      step's forwards and backwards, 1F1B, and returns the loss (one number broadcast, not the output).

    The blocks go to the stages where autodist's cut puts them (measured on rank 0), and torch's stages take the
    same cut. All four start from one model's weights and take the same steps on the same batches: their
    losses after the last step are printed and checked to agree.

    Time, bytes and idling: the four in one set of processes, interleaved blocks of ``--steps`` steps for
    ``--rounds`` rounds after ``--warmup`` untimed steps each (``timing.py``); a step is zero_grad, the
    pipeline's forward and backward, the optimizer step. Per rank: the median step on that rank's clock, and
    autodist's over torch's with the same schedule, as a ratio of medians and paired (the median over rounds of
    the ratio of the two blocks' medians in that round, which cancels slow drift of the machine's load).

    Bytes per step: every ``send``/``isend``, ``recv``/``irecv``, ``broadcast`` and ``all_reduce`` the process
    makes is counted (``comm_meter.py`` wraps them, for autodist and torch alike); "on the link" adds up what
    the rank puts on the wire; "calls" counts them.

    Idle (the bubble, measured): the share of the step the rank spent blocked in communication (a blocking
    receive or collective, or ``Work.wait``); next to it the bubble GPipe and 1F1B have in theory,
    (K - 1) / (M + K - 1) of the step for K stages and M micro-batches (compute alone, no communication). The
    measured share also holds the waits for the root's all-reduce and the output's broadcast, and a slower
    stage's lag.

    Memory: each contender alone on fresh ranks, after the warm-up: the peak resident memory during ``--steps``
    steps (VmHWM, reset first, as ``bench_sharded.py`` reads it; it holds the interpreter and torch, the same
    for all four), and the tensor peak: every tensor byte alive between steps (``live_bytes.py``) plus the
    most one step makes above that (``autodist.planner.live.LiveBytes``), as ``bench_checkpoint.py`` counts it.

    ``--slow-link``: two hosts on this machine (network namespaces joined by a veth pair, ``tests/cluster.py``,
    started as ``bench_slow_link.py`` starts them), one rank each, the link rate-limited to ``--rate`` both
    ways; the same model and global batch trained by ``autodist.parallelize(model, loader)`` (data parallel,
    dp=2: half the batch on each host, all gradients all-reduced every step) and by ``pp=2`` (GPipe and 1F1B)
    as above, interleaved. Per rank: the median step and its ratio to dp=2's, the bytes counted per step, and
    what the host's end of the link really sent per step (``tx_bytes``, TCP/IP headers included). The three
    train the same model: their losses after the last step are checked to agree, and the largest difference of
    their parameters from dp=2's is printed. Needs root and iproute2; where the namespaces cannot be made it
    says why and exits with status 2 (``--quick`` says so and skips, status 0, as ``bench_slow_link.py --quick``
    does).

How to run
    python benchmarks/bench_pipeline.py                      # about 3 minutes on 2 cores
    python benchmarks/bench_pipeline.py --microbatches 8 --batch 32
    python benchmarks/bench_pipeline.py --layers 8 --width 512 --seq 256 --vocab 4096
    python benchmarks/bench_pipeline.py --slow-link          # root: 2 hosts, 100 Mbit/s, pp=2 vs dp=2, about 3 min
    python benchmarks/bench_pipeline.py --slow-link --rate 1gbit
    python benchmarks/bench_pipeline.py --quick              # smoke run, under a minute: every part, timing nothing

How to read it
    step: the median of the rank's own step times, in milliseconds; "autodist / torch": autodist's median over
    torch's with the same schedule, on the same rank (lower is better for autodist). idle: measured, against
    the theoretical bubble beside it. KB per step by kind, then "on the link": point-to-point sends, what the
    rank broadcast, its ring share of all-reduces; calls: the messages and collectives per step (each one a
    link's latency). Memory in MB per rank. The step lines at the end give min / quartiles / median per
    contender on each rank: a wide spread means a noisy run (other work on the cores).

Example output (the defaults; 2 cores, 1 thread per rank, other jobs sharing the cores: a noisy run)::

    2 ranks (gloo, 1 thread(s) each), GPT of 4 blocks x width 256, vocabulary 256 (3.32 M parameters, float32, SGD), global batch 16 x 128 tokens, 4 micro-batches; stage 0 blocks 0-1, stage 1 blocks 2-3 (autodist's cut); 43 steps each

    | contender | rank | step (ms) | autodist / torch, same schedule | idle, measured (% of step) | bubble in theory (%) | p2p sent (KB / step) | p2p received | broadcast out / in | all-reduced | on the link | calls / step | peak RSS (MB) | tensor peak (MB) |
    |---|---|---|---|---|---|---|---|---|---|---|---|---|---|
    | torch GPipe | 0 | 469.5 | - | 20.5 | 20 | 2097 | 2097 | 0 / 0 | 0 | 2097 | 8 | 437 | 81.6 |
    | torch GPipe | 1 | 476.3 | - | 20.1 | 20 | 2097 | 2097 | 0 / 0 | 0 | 2097 | 8 | 441 | 86.9 |
    | torch 1F1B | 0 | 474.4 | - | 20.4 | 20 | 2097 | 2097 | 0 / 0 | 0 | 2097 | 8 | 410 | 54.1 |
    | torch 1F1B | 1 | 482.2 | - | 16.6 | 20 | 2097 | 2097 | 0 / 0 | 0 | 2097 | 8 | 402 | 40.2 |
    | autodist GPipe | 0 | 526.3 | 1.121 | 26.4 | 20 | 2098 | 2097 | 0 / 2097 | 657 | 2755 | 20 | 454 | 82.9 |
    | autodist GPipe | 1 | 528.2 | 1.109 | 25.8 | 20 | 2097 | 2098 | 2097 / 0 | 657 | 4852 | 20 | 467 | 89.2 |
    | autodist 1F1B | 0 | 400.5 | 0.844 | 24.2 | 20 | 2098 | 2097 | 0 / 0 | 657 | 2755 | 20 | 422 | 53.3 |
    | autodist 1F1B | 1 | 401.3 | 0.832 | 22.6 | 20 | 2097 | 2098 | 0 / 0 | 657 | 2755 | 20 | 397 | 36.4 |

    ratio of medians autodist GPipe / torch GPipe: rank 0 1.121 (paired 1.168), rank 1 1.109 (paired 1.154)
    ratio of medians autodist 1F1B / torch 1F1B: rank 0 0.844 (paired 0.870), rank 1 0.832 (paired 0.890)
    loss after the last step (the last stage's): torch GPipe 5.539303, torch 1F1B 5.539303, autodist GPipe 5.539303, autodist 1F1B 5.539303 (agree, rtol 1e-4)

    step times, rank 0 / rank 1:
      torch GPipe      min  304.92  q1  394.65  median  469.46  q3  635.56 ms   (40 steps) /   min  286.26  q1  390.95  median  476.27  q3  600.30 ms   (40 steps)
      torch 1F1B       min  311.74  q1  358.25  median  474.37  q3  585.33 ms   (40 steps) /   min  269.60  q1  359.30  median  482.17  q3  563.85 ms   (40 steps)
      autodist GPipe   min  285.90  q1  381.06  median  526.32  q3  659.78 ms   (40 steps) /   min  287.80  q1  384.29  median  528.22  q3  662.44 ms   (40 steps)
      autodist 1F1B    min  312.59  q1  342.48  median  400.53  q3  570.05 ms   (40 steps) /   min  310.66  q1  343.51  median  401.32  q3  566.84 ms   (40 steps)

Example output of ``--slow-link`` (the defaults: 100 Mbit/s)::

    2 hosts x 1 rank (gloo), link 100mbit, GPT of 4 blocks x width 256, vocabulary 256 (3.32 M parameters, float32, SGD), global batch 16 x 128 tokens, 4 micro-batches; stage 0 blocks 0-1, stage 1 blocks 2-3 (autodist's cut); 43 steps each

    | layout | rank | step (ms) | this / dp=2 | idle, measured (% of step) | p2p sent (KB / step) | p2p received | broadcast out / in | all-reduced | on the link, counted | calls / step | on the link, tx_bytes |
    |---|---|---|---|---|---|---|---|---|---|---|---|
    | autodist dp=2 | 0 | 1561.8 | 1.000 | 76.8 | 0 | 0 | 0 / 0 | 13277 | 13277 | 2 | 14171 |
    | autodist dp=2 | 1 | 1562.2 | 1.000 | 76.6 | 0 | 0 | 0 / 0 | 13277 | 13277 | 2 | 14176 |
    | autodist GPipe | 0 | 923.7 | 0.591 | 64.3 | 2098 | 2097 | 0 / 2097 | 657 | 2755 | 20 | 2992 |
    | autodist GPipe | 1 | 919.2 | 0.588 | 62.2 | 2097 | 2098 | 2097 / 0 | 657 | 4852 | 20 | 5138 |
    | autodist 1F1B | 0 | 925.5 | 0.593 | 55.0 | 2098 | 2097 | 0 / 0 | 657 | 2755 | 20 | 2946 |
    | autodist 1F1B | 1 | 928.4 | 0.594 | 54.0 | 2097 | 2098 | 0 / 0 | 657 | 2755 | 20 | 2945 |

    ratio of medians autodist GPipe / autodist dp=2: rank 0 0.591 (paired 0.602), rank 1 0.588 (paired 0.601)
    ratio of medians autodist 1F1B / autodist dp=2: rank 0 0.593 (paired 0.558), rank 1 0.594 (paired 0.563)
    loss after the last step (the global batch's): autodist dp=2 5.539303, autodist GPipe 5.539303, autodist 1F1B 5.539303 (agree, rtol 1e-4); largest parameter difference from dp=2 2.4e-07

    step times, rank 0 / rank 1:
      autodist dp=2    min 1431.51  q1 1482.31  median 1561.79  q3 1748.94 ms   (40 steps) /   min 1427.74  q1 1482.24  median 1562.21  q3 1757.06 ms   (40 steps)
      autodist GPipe   min  841.32  q1  892.20  median  923.74  q3 1081.64 ms   (40 steps) /   min  838.63  q1  891.95  median  919.23  q3 1086.90 ms   (40 steps)
      autodist 1F1B    min  732.23  q1  821.21  median  925.46  q3 1030.04 ms   (40 steps) /   min  727.58  q1  818.75  median  928.35  q3 1034.25 ms   (40 steps)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import astuple, dataclass, field
from typing import Callable

import bench_slow_link as slow_link  # benchmarks/bench_slow_link.py: the two hosts' launch, the link's counter
import harness  # benchmarks/harness.py
import timing  # benchmarks/timing.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from comm_meter import Meter, Tally  # benchmarks/comm_meter.py
from gpt_block import GPT  # benchmarks/gpt_block.py
from live_bytes import live_tensor_bytes, reset_peak, resident  # benchmarks/live_bytes.py
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset

import autodist
from autodist.planner.live import LiveBytes
from autodist.pp.pipeline import pipeline_of

STAGES = 2  # the world is one pipeline of 2 stages (pp=2, dp=1)
LR = 0.1
SCHEDULES = {"torch GPipe": ScheduleGPipe, "torch 1F1B": Schedule1F1B}
AUTODIST = {"autodist GPipe": "torch GPipe", "autodist 1F1B": "torch 1F1B"}  # each against torch's same schedule
CONTENDERS = (*SCHEDULES, *AUTODIST)
DATA_PARALLEL = "autodist dp=2"
LAYOUTS = (DATA_PARALLEL, *AUTODIST)  # over the slow link
ENV = {"OMP_NUM_THREADS": "1", "AUTODIST_LOG_LEVEL": "WARNING"}  # for the ranks: one thread, no summary lines
MB, KB = 1e6, 1e3


@dataclass
class Contender:
    """A model trained one way: ``step(x, y)`` runs one training step and returns the loss where this rank has it
    (None on torch's first stage); ``batches`` are this rank's batches (its slice of each global batch), taken in
    turn.

    Example:
        >>> seconds = contender.train_step()   # the next batch; contender.loss is its loss
    """

    step: Callable[[torch.Tensor, torch.Tensor], float | None]
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    optimizer: torch.optim.Optimizer
    model: nn.Module
    taken: int = 0
    loss: float | None = None

    def train_step(self) -> float:
        """One step on the next batch; its wall time in seconds."""
        x, y = self.batches[self.taken % len(self.batches)]
        start = time.perf_counter()
        self.loss = self.step(x, y)
        seconds = time.perf_counter() - start
        self.taken += 1
        return seconds


# -- the model, the data, the loss --
def build(args: argparse.Namespace) -> GPT:
    """The dense model every contender starts from: (B, T) tokens -> (B, T, vocab) logits."""
    torch.manual_seed(0)
    return GPT(vocab=args.vocab, width=args.width, heads=args.heads, layers=args.layers, seq=args.seq, flat=False)


def token_data(args: argparse.Namespace) -> TensorDataset:
    """``--distinct`` global batches of random tokens: inputs (N, T) and next-token targets (N, T)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.distinct * args.batch, args.seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of (B, T, vocab) logits and (B, T) targets."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- the contenders --
class StagePart(nn.Module):
    """Blocks ``lo`` to ``hi`` of a GPT, cut by hand as torch's pipelining docs cut a model: the first stage also
    embeds the tokens, the last also applies the final norm and the head.

    Example:
        >>> StagePart(GPT(layers=4), 0, 2)(tokens).shape    # the first stage: the hidden states after block 1
        torch.Size([16, 128, 256])
    """

    def __init__(self, gpt: GPT, lo: int, hi: int) -> None:
        super().__init__()
        self.first, self.last = lo == 0, hi == len(gpt.blocks)
        self.tok, self.pos = (gpt.tok, gpt.pos) if self.first else (None, None)
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        self.ln_f, self.head = (gpt.ln_f, gpt.head) if self.last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def torch_pipeline(name: str, gpt: GPT, bounds: list[int], rank: int, batches: list, args: argparse.Namespace
                   ) -> Contender:
    """This rank's stage of ``gpt`` (taken apart: pass a copy) under torch's schedule ``name``."""
    part = StagePart(gpt, bounds[rank], bounds[rank + 1])
    stage = PipelineStage(part, rank, STAGES, torch.device("cpu"))
    schedule = SCHEDULES[name](stage, n_microbatches=args.microbatches, loss_fn=lm_loss)  # scale_grads: a mean
    optimizer = torch.optim.SGD(part.parameters(), lr=LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if part.first else ()), **({"target": y, "losses": losses} if part.last else {}))
        optimizer.step()
        return float(torch.stack(losses).detach().mean()) if losses else None  # equal micro-batches: the mean

    return Contender(step, batches, optimizer, part)


def plain_loop(model: nn.Module, batches: list, staged: bool = False) -> Contender:
    """The user's loop around a model ``parallelize`` returned: ``loss_fn(model(x), y).backward()``, or with
    ``staged`` (``parallelize(..., loss_fn=)``) ``model(x, target=y).backward()``, the step inside the call."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad()
        loss = model(x, target=y) if staged else lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return Contender(step, batches, optimizer, model)


def autodist_pipeline(name: str, gpt: GPT, data: TensorDataset, args: argparse.Namespace
                      ) -> tuple[Contender, list[int]]:
    """``gpt`` (changed in place: pass a copy) cut into 2 stages by autodist, run by the schedule ``name`` names
    (1F1B: ``loss_fn=``); and where its stages begin."""
    loss_fn = lm_loss if name.endswith("1F1B") else None
    model, loader = autodist.parallelize(gpt, DataLoader(data, batch_size=args.batch), pp=STAGES,
                                         microbatches=args.microbatches, loss_fn=loss_fn)
    return plain_loop(model, list(loader), staged=loss_fn is not None), list(pipeline_of(model).cut.bounds)


def autodist_data_parallel(gpt: GPT, data: TensorDataset, args: argparse.Namespace) -> Contender:
    """``gpt`` (changed in place) data parallel: each rank half of every global batch."""
    model, loader = autodist.parallelize(gpt, DataLoader(data, batch_size=args.batch))
    return plain_loop(model, list(loader))


# -- timing, bytes, idling --
@dataclass
class Record:
    """One contender's timed steps on this rank: their times, their bytes and waiting, the link's bytes."""

    times: list[float] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    link: int = 0


def race(contenders: dict[str, Contender], meter: Meter, args: argparse.Namespace,
         link: Callable[[], int] | None = None) -> dict[str, Record]:
    """Warm-up, then interleaved blocks of every contender (``timing.interleave``, a barrier before each block);
    each timed step's bytes and waiting from ``meter``, and the bytes ``link()`` reads (where given)."""
    records = {name: Record() for name in contenders}
    read_link = link or (lambda: 0)

    def timed(name: str) -> timing.Step:
        def step() -> float:
            before, wire = meter.tally(), read_link()
            seconds = contenders[name].train_step()
            records[name].tally += meter.tally() - before
            records[name].link += read_link() - wire
            return seconds
        return step

    steps = {name: timed(name) for name in contenders}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    for record in records.values():  # the warm-up (torch's exchange of shapes) is not counted
        record.tally, record.link = Tally(), 0
    times, _ = timing.interleave(steps, args.steps, args.rounds, 0, before_block=dist.barrier)
    for name, record in records.items():
        record.times = times[name]
    return records


def summary(record: Record, loss: float | None, block: int) -> dict:
    """What one rank reports of one contender, JSON-able; ``blocks``: the median of each block of ``block`` steps
    (one per round, for the paired ratios)."""
    steps = len(record.times)
    return {"median": statistics.median(record.times), "idle": record.tally.waited / sum(record.times),
            "tally": astuple(record.tally.per(steps)), "link": record.link / steps, "loss": loss,
            "line": timing.describe("", record.times, 0),
            "blocks": [statistics.median(record.times[i:i + block]) for i in range(0, steps, block)]}


def ratios(ranks: list[dict], contender: str, reference: str) -> str:
    """Per rank: the ratio of medians ``contender`` / ``reference``, and the paired one (the median over rounds of
    the ratio of their blocks' medians in that round, which cancels the machine's slow drift)."""
    def paired(mine: dict) -> float:
        return statistics.median(c / r for c, r in zip(mine[contender]["blocks"], mine[reference]["blocks"]))

    return ", ".join(f"rank {r} {mine[contender]['median'] / mine[reference]['median']:.3f} (paired {paired(mine):.3f})"
                     for r, mine in enumerate(ranks))


def gathered(value: object) -> list:
    """``value`` of every rank, in rank order."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


# -- the workers --
def together(args: argparse.Namespace) -> None:
    """The three contenders in these processes: time, bytes and idling per rank, and their losses; rank 0 writes
    them to ``--result``."""
    rank = autodist.init().rank
    dense, data = build(args), token_data(args)
    ours = {name: autodist_pipeline(name, copy.deepcopy(dense), data, args) for name in AUTODIST}
    bounds = next(iter(ours.values()))[1]
    batches = list(DataLoader(data, batch_size=args.batch))
    contenders = {name: torch_pipeline(name, copy.deepcopy(dense), bounds, rank, batches, args) for name in SCHEDULES}
    contenders |= {name: contender for name, (contender, _) in ours.items()}
    with Meter() as meter:
        records = race(contenders, meter, args)
    ranks = gathered({name: summary(records[name], c.loss, args.steps) for name, c in contenders.items()})
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"ranks": ranks, "bounds": bounds, "parameters": sum(p.numel() for p in dense.parameters()),
                       "steps": contenders[CONTENDERS[0]].taken}, f)


def alone(args: argparse.Namespace) -> None:
    """``--alone``'s contender alone on fresh ranks: its peak resident memory during the steps and its tensor peak
    per rank; rank 0 writes them to ``--result``."""
    rank = autodist.init().rank
    data = token_data(args)
    if args.alone in AUTODIST:
        contender, _ = autodist_pipeline(args.alone, build(args), data, args)
    else:
        batches = list(DataLoader(data, batch_size=args.batch))
        contender = torch_pipeline(args.alone, build(args), args.bounds, rank, batches, args)
    for _ in range(args.warmup):
        contender.train_step()
    reset_peak()
    for _ in range(args.steps):
        contender.train_step()
    rss = resident("VmHWM")
    contender.optimizer.zero_grad()
    held = live_tensor_bytes()
    with LiveBytes() as live:
        contender.train_step()
    ranks = gathered({"rss": rss, "held": held, "tensors": held + live.peak})
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(ranks, f)


def dense_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter of the model, whole, flat (for a model cut into stages: a collective over them)."""
    return torch.cat([t.reshape(-1) for _, t in sorted(model.state_dict().items())])


def over_the_link(args: argparse.Namespace) -> None:
    """One rank on each host: autodist dp=2 and pp=2 (GPipe, 1F1B) interleaved; rank 0 prints the table."""
    world = autodist.init()
    dense, data = build(args), token_data(args)
    contenders = {DATA_PARALLEL: autodist_data_parallel(copy.deepcopy(dense), data, args)}
    for name in AUTODIST:
        contenders[name], bounds = autodist_pipeline(name, copy.deepcopy(dense), data, args)
    with Meter() as meter:
        records = race(contenders, meter, args, link=slow_link.wire_bytes)
    local = torch.tensor([contenders[DATA_PARALLEL].loss])
    dist.all_reduce(local)  # the global batch's loss: each rank holds the mean over its half of it
    losses = {name: c.loss for name, c in contenders.items()} | {DATA_PARALLEL: float(local) / world.size}
    dense_dp = dense_parameters(contenders[DATA_PARALLEL].model)
    gap = max(float((dense_parameters(contenders[name].model) - dense_dp).abs().max()) for name in AUTODIST)
    ranks = gathered({name: summary(records[name], losses[name], args.steps) for name in contenders})
    if world.rank == 0 and not print_slow_link(args, ranks, bounds, sum(p.numel() for p in dense.parameters()),
                                               contenders[DATA_PARALLEL].taken, gap):
        sys.exit(1)


def worker(args: argparse.Namespace) -> None:
    if args.slow_link:
        over_the_link(args)
    elif args.alone:
        alone(args)
    else:
        together(args)


# -- the tables --
def setting(args: argparse.Namespace, parameters: int, bounds: list[int]) -> str:
    """The run's model, batch and cut, in words."""
    stages = ", ".join(f"stage {s} blocks {bounds[s]}-{bounds[s + 1] - 1}" for s in range(STAGES))
    return (f"GPT of {args.layers} blocks x width {args.width}, vocabulary {args.vocab} ({parameters / 1e6:.2f} M "
            f"parameters, float32, SGD), "
            f"global batch {args.batch} x {args.seq} tokens, {args.microbatches} micro-batches; {stages} "
            f"(autodist's cut)")


def bubble(args: argparse.Namespace) -> float:
    """GPipe's and 1F1B's idle share in theory: (K - 1) / (M + K - 1)."""
    return (STAGES - 1) / (args.microbatches + STAGES - 1)


def traffic(tally: list[float]) -> str:
    """A rank's KB per step by kind, as table cells: p2p sent, received, broadcast out / in, all-reduce, link; and
    its counted calls per step."""
    t = Tally(*tally)
    return (f"{t.sent / KB:.0f} | {t.received / KB:.0f} | {t.broadcast_out / KB:.0f} / {t.broadcast_in / KB:.0f} | "
            f"{t.all_reduce / KB:.0f} | {t.out / KB:.0f} | {t.calls:.0f}")


def losses_agree(losses: dict[str, float], rtol: float = 1e-4) -> bool:
    first = next(iter(losses.values()))
    return all(abs(v - first) <= rtol * abs(first) for v in losses.values())


def print_default(args: argparse.Namespace, timed: dict, memory: dict[str, list[dict]]) -> bool:
    """The table of the default run; whether the contenders' losses agree."""
    ranks = timed["ranks"]
    print(f"\n{STAGES} ranks (gloo, {args.threads} thread(s) each), "
          f"{setting(args, timed['parameters'], timed['bounds'])}; {timed['steps']} steps each\n")
    print("| contender | rank | step (ms) | autodist / torch, same schedule | idle, measured (% of step) "
          "| bubble in theory (%) "
          "| p2p sent (KB / step) | p2p received | broadcast out / in | all-reduced | on the link | calls / step "
          "| peak RSS (MB) | tensor peak (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in CONTENDERS:
        for rank, mine in enumerate(ranks):
            row, held = mine[name], memory[name][rank]
            ratio = f"{row['median'] / mine[AUTODIST[name]]['median']:.3f}" if name in AUTODIST else "-"
            print(f"| {name} | {rank} | {1e3 * row['median']:.1f} | {ratio} | {100 * row['idle']:.1f} "
                  f"| {100 * bubble(args):.0f} | {traffic(row['tally'])} | {held['rss'] / MB:.0f} "
                  f"| {held['tensors'] / MB:.1f} |")
    for ours, theirs in AUTODIST.items():
        print(f"\nratio of medians {ours} / {theirs}: {ratios(ranks, ours, theirs)}", end="")
    losses = {name: next(mine[name]["loss"] for mine in ranks[::-1] if mine[name]["loss"] is not None)
              for name in CONTENDERS}
    agree = losses_agree(losses)
    print("\nloss after the last step (the last stage's): "
          + ", ".join(f"{name} {loss:.6f}" for name, loss in losses.items())
          + f" ({'agree' if agree else 'DIFFER'}, rtol 1e-4)")
    print("\nstep times, rank 0 / rank 1:")
    for name in CONTENDERS:
        print(f"  {name:<14}" + " /".join(mine[name]["line"] for mine in ranks))
    return agree


def print_slow_link(args: argparse.Namespace, ranks: list[dict], bounds: list[int], parameters: int, steps: int,
                    gap: float) -> bool:
    """The table of the slow link's run; whether dp's and pp's losses agree."""
    print(f"\n2 hosts x 1 rank (gloo), link {args.rate}, {setting(args, parameters, bounds)}; {steps} steps each\n")
    print("| layout | rank | step (ms) | this / dp=2 | idle, measured (% of step) | p2p sent (KB / step) "
          "| p2p received | broadcast out / in | all-reduced | on the link, counted | calls / step "
          "| on the link, tx_bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in LAYOUTS:
        for rank, mine in enumerate(ranks):
            row = mine[name]
            ratio = row["median"] / mine[DATA_PARALLEL]["median"]
            print(f"| {name} | {rank} | {1e3 * row['median']:.1f} | {ratio:.3f} | {100 * row['idle']:.1f} "
                  f"| {traffic(row['tally'])} | {row['link'] / KB:.0f} |")
    for name in AUTODIST:
        print(f"\nratio of medians {name} / {DATA_PARALLEL}: {ratios(ranks, name, DATA_PARALLEL)}", end="")
    losses = {name: ranks[0][name]["loss"] for name in LAYOUTS}
    agree = losses_agree(losses)
    print("\nloss after the last step (the global batch's): " + ", ".join(f"{n} {v:.6f}" for n, v in losses.items())
          + f" ({'agree' if agree else 'DIFFER'}, rtol 1e-4); largest parameter difference from dp=2 {gap:.1e}")
    print("\nstep times, rank 0 / rank 1:")
    for name in LAYOUTS:
        print(f"  {name:<14}" + " /".join(mine[name]["line"] for mine in ranks), flush=True)
    return agree


# -- the launches --
def launch(parser: harness.Parser, args: argparse.Namespace) -> int:
    """The contenders together (time, bytes, idling), then each alone (memory), then the table."""
    if args.slow_link:
        return launch_slow_link(parser, args)
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)

    def run(**options: object) -> dict | list | None:
        argv = parser.forwarded(argparse.Namespace(**vars(args) | {"result": result} | options))
        if harness.torchrun(parser.script, STAGES, argv, ENV) != 0:
            return None
        with open(result) as f:
            return json.load(f)

    try:
        timed = run()
        memory = {name: run(alone=name, bounds=timed["bounds"]) for name in CONTENDERS} if timed else {}
    finally:
        os.remove(result)
    if not timed or not all(memory.values()):
        print("bench_pipeline: a run failed (its ranks' output is above)", file=sys.stderr)
        return 1
    return 0 if print_default(args, timed, memory) else 1


def launch_slow_link(parser: harness.Parser, args: argparse.Namespace) -> int:
    """One rank on each of two hosts joined by a rate-limited link (``tests/cluster.py``); rank 0 prints."""
    cluster = slow_link.two_hosts("bench_pipeline --slow-link", args.quick)
    if cluster is None:
        return 0 if args.quick else 2
    with cluster:
        if args.rate != "none":
            cluster.limit(args.rate)
        codes = slow_link.run_on_hosts(cluster, parser.script, parser.forwarded(args))
    if any(codes):
        print(f"bench_pipeline --slow-link: the job failed (exit status {codes} on hosts A, B)", file=sys.stderr)
        return 1
    return 0


def bounds_list(text: str) -> list[int]:
    return [int(b) for b in text.split(",")]


def main() -> int:
    parser = harness.Parser(__file__, __doc__, ranks=STAGES, threads=True)
    parser.blocks(steps=5, rounds=8, warmup=3)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--width", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row (default 128)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary: the logits' width (default 256)")
    parser.add_argument("--batch", type=int, default=16, help="global batch, rows (default 16)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--distinct", type=int, default=4, help="different global batches, taken in turn (default 4)")
    parser.add_argument("--slow-link", action="store_true",
                        help="two hosts (network namespaces, root) over a rate-limited link: pp=2 against dp=2")
    parser.add_argument("--rate", default="100mbit", help="--slow-link: tc tbf rate of the link, e.g. 1gbit, or none")
    parser.add_argument("--alone", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--bounds", type=bounds_list, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    # --quick: a tiny model and batch, one step per block
    args = parser.parse(quick={"steps": 1, "rounds": 2, "warmup": 1, "layers": 2, "width": 32, "seq": 16,
                               "batch": 4, "microbatches": 2, "distinct": 2})
    if args.batch % args.microbatches or args.batch % STAGES:
        parser.error(f"--batch must divide into --microbatches equal micro-batches and {STAGES} equal halves "
                     f"(equal micro-batches make torch's mean of micro-batch losses the batch's mean)")
    return harness.run(parser, args, worker, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
