"""A float64 training run that loses ranks, run by tests/elastic/test_elastic.py under ``autodist run --elastic``.

Usage: python elastic_train.py OUT KILLS [EPOCHS]. KILLS is "" or comma-separated RANK:STEP:WHERE, each rank
SIGKILLing itself at its loop's STEP-th iteration (counted from 0 over the whole run): WHERE is "backward"
(in the middle of backward), "between" (after the optimizer step), "step" (inside optimizer.step) or
"freeze" (SIGSTOP after the optimizer step: alive, silent, as a host cut off) or "busy" (BUSY_S seconds in
its own code after the optimizer step, evaluating alone: waited for, not lost); "reduce" and "busyreduce" do the
same at the end of the epoch of that step, between its last sync and ``engine.Metrics.reduce``; "endfreeze"
SIGSTOPs the rank after it wrote its OUT file (the step is not read); "agree" SIGKILLs it after that step's
all-reduce completed, where it would count itself in the sync's agreement. BUCKET_MB sets parallelize's
bucket_mb and first_bucket_mb (small: the gradients travel in several buckets, the last layer's first). Each
rank that finishes writes OUT.<rank>: its parameters, the optimizer's state, the learning rate, the batches its loop took
and each epoch's metrics. Run in one process (no launcher) it is the reference. BATCHNORM=1 puts a BatchNorm in
the model; BATCHNORM=nosync also parallelizes it with sync_buffers=False. ADMIT_DIE=WRITE: rank 0 dies just
before that write of the first admission of a rank that joins (see _dies_before). JOIN_AT=N: the ranks that
started together wait at their N-th iteration until a rank started again to join has begun (OUT.joining), so
that it asks while they still have steps to take, however slowly it starts.
"""
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import autodist

torch.set_default_dtype(torch.float64)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    if os.environ.get("BATCHNORM"):  # its running statistics: changed by a forward that no rank applies
        return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 3))
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(90, 5, generator=g), torch.randint(0, 3, (90,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=12, shuffle=True)  # the global RNG draws the order


def _states_in_store() -> list[int]:
    """The generations whose joining state is still in the launcher's store (each should go once read)."""
    from autodist.faults import elastic

    state = elastic.current()
    if state is None:
        return []
    return [g for g in range(1, state.generation + 1) if state.store.check([f"{g}/state"])]


def _dies_before(write: str) -> None:
    """Rank 0 SIGKILLs itself just before the admission's write ``write`` (ADMIT_DIE): "state", "members" (the
    joiners' state, the next generation's members), "joined" (the word to each joiner) or "takeoff" (the join list,
    cleared last)."""
    from autodist.faults import elastic

    name = {"state": "_send_state", "members": "_fix_members", "joined": "_tell_joiners", "takeoff": "_take_off"}[write]
    setattr(elastic, name, lambda *args: os.kill(os.getpid(), signal.SIGKILL))


def _wait_for_a_joiner(out: str) -> None:
    """JOIN_AT: the job does not end before the rank started again has begun (a slow start is not a failure)."""
    waited = time.monotonic()
    while not os.path.exists(f"{out}.joining"):
        assert time.monotonic() - waited < 120, "no rank was started again to join"
        time.sleep(0.05)


def main(out: str, kills: str, epochs: int) -> None:
    if os.environ.get("AUTODIST_ELASTIC_JOIN"):
        open(f"{out}.joining", "w").close()
    torch.manual_seed(5)
    net, data = autodist.parallelize(model(), loader(), sync_buffers=os.environ.get("BATCHNORM") != "nosync",
                                     bucket_mb=float(os.environ.get("BUCKET_MB", "25")),
                                     first_bucket_mb=float(os.environ.get("BUCKET_MB", "1")))
    rank = int(os.environ.get("RANK", "0"))  # the launch's slot (autodist.rank() is the place among those alive)
    if rank == 0 and os.environ.get("ADMIT_DIE"):
        _dies_before(os.environ["ADMIT_DIE"])
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    mine = [(int(s), where) for r, s, where in (k.split(":") for k in kills.split(",") if k) if int(r) == rank]
    if os.environ.get("AUTODIST_ELASTIC_JOIN"):
        mine = []  # started again to join the others: it lives
    taken, metrics, epochs_seen = 0, autodist.engine.Metrics(), []
    # written for restarts: a rank that joins a running elastic job gets the others' epoch (no file is read)
    joining = bool(os.environ.get("AUTODIST_ELASTIC_JOIN"))
    for _ in range(autodist.resume(f"{out}.never-saved", net, opt, epoch=0)["epoch"], epochs):
        if not joining:  # EPOCH_S: the ranks that started together come late to each epoch (a joiner draws first)
            time.sleep(float(os.environ.get("EPOCH_S", "0")))
        for x, y in data:
            die = next((where for s, where in mine if s == taken), None)
            if not joining and taken == int(os.environ.get("JOIN_AT", "-1")):
                _wait_for_a_joiner(out)
            taken += 1
            opt.zero_grad()
            out_ = net(x)
            loss = F.cross_entropy(out_, y)
            metrics.update(loss.detach() * len(y), (out_.argmax(1) == y).sum(), len(y))
            if die == "backward":  # after the last layer's gradients, before the first's
                net[0].bias.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
            if die == "agree":  # its all-reduce done, before it counts itself in the agreement
                from autodist.faults.elastic import Elastic

                Elastic.agree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            if die == "step":
                opt.register_step_pre_hook(lambda *a: os.kill(os.getpid(), signal.SIGKILL))
            opt.step()
            sched.step()
            time.sleep(float(os.environ.get("STEP_S", "0")))  # for a rank restarted to join while the others train
            if die == "busy":
                time.sleep(float(os.environ["BUSY_S"]))
            if die in ("between", "freeze"):
                os.kill(os.getpid(), signal.SIGKILL if die == "between" else signal.SIGSTOP)
        at_end = [where for s, where in mine if s < taken and where.endswith("reduce")]
        if at_end:
            mine = [(s, where) for s, where in mine if not (s < taken and where.endswith("reduce"))]
            if at_end[0] == "busyreduce":
                time.sleep(float(os.environ["BUSY_S"]))
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        if not os.environ.get("NO_METRICS"):  # (a sum between epochs finds a rank lost at the boundary first)
            epochs_seen.append(metrics.reduce(net))
            metrics.reset()
    state = {"params": {n: p.detach().clone() for n, p in net.state_dict().items()},
             "momentum": [opt.state[p]["momentum_buffer"].clone() for p in net.parameters()],
             "lr": opt.param_groups[0]["lr"], "scheduler": sched.last_epoch, "taken": taken,
             "metrics": epochs_seen, "states_in_store": _states_in_store(),
             "place": (autodist.rank(), autodist.world_size())}  # among the ranks alive at the end
    torch.save(state, f"{out}.{rank}")
    if any(where == "endfreeze" for _, where in mine):  # stopped after its last line: at the end meeting, silent
        os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "", int(sys.argv[3]) if len(sys.argv) > 3 else 2)
