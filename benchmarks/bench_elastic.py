"""A lost rank: ``autodist run --elastic`` against torchrun's restart from a checkpoint, on the same job.

What it measures
    3 real ranks (gloo, CPU) train an MLP on a DataLoader; rank 2 SIGKILLs itself right after step ``--kill-at``.
    Each rank logs, after every optimizer step, how many steps the training has applied and when.

    * elastic: ``autodist run --elastic -n 3``: the other two abandon the step in flight, regroup and go on.
    * restart: ``autodist run -n 3 --max-restarts 1``: torchrun stops the others and starts all three again;
      the script resumes from its last ``autodist.save`` (one every ``--every`` steps) and repeats the steps
      since (torchrun's elastic agent, the peer: DeepSpeed and torchrun users restart so).

    "to the step in flight" is the time from the kill to the first rank completing the step the victim never
    finished: the training is past the failure. "repeated" counts the steps done twice. The steady step time
    (median over the steps before the kill) of the elastic job is put beside the same job launched without
    ``--elastic``, which sums through shared memory on one machine, and beside it through gloo
    (``AUTODIST_SHARED_MEMORY=0``), as elastic mode always does: the difference to the second is what the
    agreement in the store costs each step. Medians over ``--repeats`` runs.

    ``--traffic`` instead counts what the ranks ask of the launcher's store without a failure: each rank's
    requests (its Elastic state's client wrapped by a counter: the agreement, the polls while its all-reduce
    runs) per step at 3 and 8 ranks, plus what the heartbeat threads and the launcher add a second by their
    schedule (one add a rank; a check and an add per member). What node 0's store thread would carry at 1,000
    ranks is extrapolated from those counts and the per-request cost bench_watchdog.py measures.

How to run
    python benchmarks/bench_elastic.py                 # about 2 minutes on 2 cores
    python benchmarks/bench_elastic.py --quick         # smoke run: a tiny model, one repeat
    python benchmarks/bench_elastic.py --traffic       # the store's requests, at 3 and 8 ranks

How to read it
    The restart's time holds torchrun noticing the death, stopping the others, starting three fresh Python
    processes that import torch, the rendezvous, ``parallelize``, loading the checkpoint and the repeated steps;
    the elastic one holds gloo's connection reset, the agreement, a new process group and the abandoned step's
    batch again.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def worker(folder: str, mode: str, steps: int, kill_at: int, every: int, width: int) -> None:
    """One rank of the job (run by the launcher): trains ``steps`` steps, logging each applied one."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import autodist

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(3 * 32 * 30, 64), torch.randint(0, 10, (3 * 32 * 30,)))
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10))
    model, loader = autodist.parallelize(model, DataLoader(data, batch_size=96, shuffle=True))
    counted, counting_since = _count_requests() if mode == "traffic" else (None, 0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)  # counts the steps applied
    rank, attempt = autodist.rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    checkpoint = os.path.join(folder, "ckpt.pt")
    applied = autodist.resume(checkpoint, model, optimizer, applied=0)["applied"] if mode == "restart" else 0
    schedule.last_epoch = applied
    log = open(os.path.join(folder, f"steps.{rank}.{attempt}"), "a", buffering=1)
    while schedule.last_epoch < steps:
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            schedule.step()  # held back on an abandoned step (elastic)
            log.write(f"{schedule.last_epoch} {time.time()}\n")
            if mode == "restart" and schedule.last_epoch % every == 0:
                autodist.save(checkpoint, model, optimizer, applied=schedule.last_epoch)
            if rank == 2 and attempt == "0" and schedule.last_epoch == kill_at:
                with open(os.path.join(folder, "killed"), "w") as f:
                    f.write(f"{time.time()}")
                os.kill(os.getpid(), signal.SIGKILL)
            if schedule.last_epoch >= steps:
                break
    if counted is not None:
        with open(os.path.join(folder, f"requests.{rank}"), "w") as f:
            f.write(f"{counted.count} {counting_since} {time.time()}")


def _count_requests() -> tuple[Any, float]:
    """This rank's Elastic client wrapped by bench_watchdog's request counter, and when counting began."""
    from bench_watchdog import Counted

    from autodist.faults import elastic

    state = elastic.current()
    assert state is not None, "--traffic runs under autodist run --elastic"
    state.store = Counted(state.store)
    return state.store, time.time()


def traffic(ranks: int, steps: int, width: int) -> dict[str, float]:
    """One elastic job of ``ranks`` ranks, no failure: requests a rank sends per step and per second."""
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as folder:
        env = os.environ | {"AUTODIST_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "autodist", "run", "--elastic", "-n", str(ranks), "--show-ranks", "0",
                        os.path.abspath(__file__), "--worker", folder, "traffic", str(steps), "-1", "0", str(width)],
                       check=True, env=env, capture_output=True, text=True, timeout=900)
        counts = []
        for r in range(ranks):
            with open(os.path.join(folder, f"requests.{r}")) as f:
                count, since, until = map(float, f.read().split())
            counts.append((count, until - since))
        per_step = statistics.mean(c for c, _ in counts) / steps
        per_second = statistics.mean(c / s for c, s in counts)
        return {"per_step": per_step, "per_second": per_second, "step_s": statistics.mean(s for _, s in counts) / steps}


def simulate(sizes: list[int], rounds: int, polls: int) -> list[dict[str, float]]:
    """``size`` simulated ranks, each a TCPStore client of its own, replay the store requests of one sync's
    agreement (:meth:`autodist.faults.elastic.Elastic.agree`: each rank adds its count; the last checks the join
    list, writes ``commit`` and deletes the previous sync's keys; each rank waits for the outcome and reads it)
    plus ``polls`` checks a rank while its all-reduce runs, ``rounds`` times, against a real store in a process
    of its own (bench_watchdog.py's): the store's CPU seconds a round, from /proc."""
    import datetime

    import torch.distributed as dist
    from bench_watchdog import _cpu_seconds, store_host

    out = []
    for size in sizes:
        host, port = store_host()
        clients = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
                   for _ in range(size)]
        before, began = _cpu_seconds(host.pid), time.monotonic()
        for sync in range(1, rounds + 1):
            key = f"0/sync/{sync}"
            for store in clients:  # the all-reduce under way: each rank looks for an abort every 50 ms
                for _ in range(polls):
                    store.check([f"{key}/outcome"])
            for rank, store in enumerate(clients):
                if store.add(f"{key}/done", 1) == size:
                    store.check(["autodist/elastic/join"])
                    store.compare_set(f"{key}/outcome", "", "commit")
                    if sync > 1:
                        store.delete_key(f"0/sync/{sync - 1}/done")
                        store.delete_key(f"0/sync/{sync - 1}/outcome")
            for store in clients:
                store.wait([f"{key}/outcome"], datetime.timedelta(seconds=60))
                store.get(f"{key}/outcome")
        cpu, wall = _cpu_seconds(host.pid) - before, time.monotonic() - began
        host.terminate()
        out.append({"size": size, "cpu_per_round": cpu / rounds, "requests_per_round": size * (3 + polls) + 4,
                    "round_s": wall / rounds})
    return out


WATCHDOG_US = 21.5  # the store thread's CPU a request, bench_watchdog.py at 1,000 ranks (4.3% of a core, 2,002/s)


def report_traffic(steps: int, width: int) -> None:
    print(f"elastic, no failure, MLP width {width}, {steps} steps; a rank's requests through its Elastic client")
    print(f"{'ranks':>6}{'per step':>10}{'per second':>12}{'step time':>11}{'+ heartbeat and launcher, /s':>30}")
    last = {}
    for ranks in (3, 8):
        m = traffic(ranks, steps, width)
        extra = ranks * 1.0 + 2 * ranks + 1  # a heartbeat add a rank; the launcher's check + add a member, its check
        print(f"{ranks:>6}{m['per_step']:>10.1f}{m['per_second']:>12.0f}{m['step_s'] * 1000:>8.1f} ms"
              f"{extra:>30.0f}")
        last = m
    total = 1000 * last["per_second"] + 3 * 1000 + 1
    print(f"1,000 ranks at the same step time (extrapolated): {total:,.0f} requests a second at node 0's store, "
          f"about {total * WATCHDOG_US / 1e6 * 100:.0f}% of a core at {WATCHDOG_US} us a request")
    polls = max(0, round(last["per_step"] - 3))
    print(f"simulated ranks (bench_watchdog.py's method), each sync's agreement and {polls} poll(s) a rank:")
    header = f"store cores at a step of {last['step_s'] * 1000:.1f} ms"
    print(f"{'ranks':>6}{'requests / sync':>17}{'store CPU / sync':>18}{header:>36}")
    for m in simulate([100, 300, 1000], 10 if steps > 8 else 2, polls):
        print(f"{m['size']:>6}{m['requests_per_round']:>17,}{m['cpu_per_round'] * 1000:>15.1f} ms"
              f"{m['cpu_per_round'] / last['step_s']:>36.2f}")


def _logs(folder: str) -> list[tuple[int, float, str]]:
    out = []
    for name in os.listdir(folder):
        if name.startswith("steps."):
            with open(os.path.join(folder, name)) as f:
                out += [(int(a), float(b), name) for a, b in (line.split() for line in f if line.strip())]
    return out


def _repeated(logs: list[tuple[int, float, str]]) -> int:
    """Steps rank 0 applied twice: in each attempt's log an applied step moves the count (an abandoned
    iteration, elastic, logs the count it left), and a restart's attempt applies again what the first did."""
    applied: list[int] = []
    for name in sorted({name for _, _, name in logs if name.startswith("steps.0.")}):
        counts = [s for s, _, n in sorted(logs, key=lambda e: e[1]) if n == name]
        applied += [s for before, s in zip([-1] + counts, counts) if s != before]
    return len(applied) - len(set(applied))


def run(mode: str, steps: int, kill_at: int | None, every: int, width: int) -> dict[str, float]:
    """One job; its recovery time, repeated steps and steady step time."""
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as folder:
        launch = {"elastic": ["--elastic"], "restart": ["--max-restarts", "1"], "plain": [], "gloo": []}[mode]
        env = os.environ | {"AUTODIST_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
        if mode == "gloo":  # the exchange elastic mode uses: the backend's all-reduce, never shared memory
            env["AUTODIST_SHARED_MEMORY"] = "0"
        subprocess.run([sys.executable, "-m", "autodist", "run", *launch, "-n", "3", "--show-ranks", "0",
                        os.path.abspath(__file__), "--worker", folder, mode,
                        str(steps), str(-1 if kill_at is None else kill_at), str(every), str(width)],
                       check=True, env=env, capture_output=True, text=True, timeout=600)
        logs = _logs(folder)
        first = sorted(t for s, t, name in logs if name == "steps.0.0")
        steady = statistics.median(b - a for a, b in zip(first[1:], first[2:(kill_at or steps)]))
        result = {"step_s": steady}
        if kill_at is not None:
            with open(os.path.join(folder, "killed")) as f:
                killed = float(f.read())
            result["recovery_s"] = min(t for s, t, _ in logs if s == kill_at + 1 and t > killed) - killed
            result["repeated"] = _repeated(logs)
        return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        folder, mode, steps, kill_at, every, width = sys.argv[2:8]
        worker(folder, mode, int(steps), int(kill_at), int(every), int(width))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--every", type=int, default=10, help="restart: a checkpoint every this many steps")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--traffic", action="store_true", help="count the store's requests at 3 and 8 ranks")
    args = parser.parse_args()
    if args.traffic:
        report_traffic(40 if not args.quick else 8, 256 if not args.quick else 32)
        return
    if args.quick:
        args.steps, args.kill_at, args.every, args.width, args.repeats = 8, 5, 4, 32, 1
    rows: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats):  # interleaved, so that a busy moment of the machine falls on every mode
        for mode, kill in (("elastic", args.kill_at), ("restart", args.kill_at), ("plain", None), ("gloo", None)):
            rows.setdefault(mode, []).append(run(mode, args.steps, kill, args.every, args.width))
    median = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in rows.items()}
    print(f"3 ranks, MLP width {args.width}, rank 2 killed after step {args.kill_at}, a checkpoint every "
          f"{args.every} steps (restart); medians of {args.repeats}")
    print(f"{'':28}{'to the step in flight':>24}{'steps repeated':>16}{'step time':>12}")
    for mode, label in (("elastic", "autodist run --elastic"), ("restart", "torchrun restart + resume"),
                        ("plain", "no failure, not elastic"), ("gloo", "the same, through gloo")):
        m = median[mode]
        recovery = f"{m['recovery_s']:.2f} s" if "recovery_s" in m else "-"
        repeated = f"{m['repeated']:.0f}" if "repeated" in m else "-"
        print(f"{label:28}{recovery:>24}{repeated:>16}{m['step_s'] * 1000:>9.1f} ms")
    print(f"restart / elastic, time to the step in flight: "
          f"{median['restart']['recovery_s'] / median['elastic']['recovery_s']:.1f}x; "
          f"elastic step time / plain: {median['elastic']['step_s'] / median['plain']['step_s']:.2f}x, "
          f"/ plain through gloo (the agreement alone): {median['elastic']['step_s'] / median['gloo']['step_s']:.2f}x")


if __name__ == "__main__":
    main()
