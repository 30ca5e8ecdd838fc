"""The model parallelize returns stays an ordinary module: copy.deepcopy gives the plain model with the whole
weights at every level (an EMA made from it trains on as one process's does), pickling works where it needs no
other rank and otherwise says what to use, and under shard="parameters" reading a weight between steps gives
its true value inside autodist.full_parameters or one clear error, never NaN."""
from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.testing import assert_close

import autodist
import workloads as w

LEVELS = [None, "optimizer", "gradients", "parameters"]
HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
         "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class Scaled(nn.Module):
    """An MLP of repeated layers (the blocks at shard="parameters") with a buffer, for use_buffers=True."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 12), nn.Linear(12, 12), nn.Linear(12, 3)])
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x) * self.scale


def _batches(x, y, n, rank):
    """The three global batches of 12 rows, and this rank's rows of each (autodist's even split)."""
    whole = [(x[i:i + 12], y[i:i + 12]) for i in range(0, 36, 12)]
    return whole, [(bx[rank * 12 // n:(rank + 1) * 12 // n], by[rank * 12 // n:(rank + 1) * 12 // n])
                   for bx, by in whole]


def _ema_step(ema: list[torch.Tensor], model: nn.Module, decay: float = 0.9) -> None:
    """The hand-written EMA of a training script: ema = decay * ema + (1 - decay) * p."""
    with torch.no_grad():
        for e, p in zip(ema, model.parameters()):
            e.mul_(decay).add_(p.detach(), alpha=1 - decay)


def _train_with_emas(model: nn.Module, data):
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    averaged = AveragedModel(model)  # deep copies of the model: ordinary modules
    buffers = AveragedModel(model, use_buffers=True)
    with autodist.full_parameters(model):  # the whole weights at shard="parameters"; nothing at the other levels
        ema = [p.detach().clone() for p in model.parameters()]
    for xb, yb in data:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        with autodist.full_parameters(model):
            averaged.update_parameters(model)
            buffers.update_parameters(model)
            _ema_step(ema, model)
    return ({k: v.clone() for k, v in averaged.module.state_dict().items()},
            {k: v.clone() for k, v in buffers.module.state_dict().items()}, ema)


@w.float64
def _emas(level):
    n, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    x, y = w.digits_like(36, features=6, classes=3)
    whole, mine = _batches(x, y, n, rank)
    ref = _train_with_emas(w.seeded(Scaled, 0), whole)
    model, _ = autodist.parallelize(w.seeded(Scaled, 10 * rank), shard=level)
    got = _train_with_emas(model, mine)
    return ref, got


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("level", LEVELS)
def test_averaged_model_and_a_hand_written_ema_train_on_as_one_process(ranks, level, n):
    for ref, got in ranks(n, _emas, level):
        for a, b in zip(ref, got):
            assert_close(b, a, rtol=1e-12, atol=1e-12)


def _hooks(module: nn.Module) -> int:
    return sum(len(getattr(m, attr)) for m in module.modules() for attr in HOOKS)


@w.float64
def _copies(options):
    n, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if options.get("sync") == "local":
        options = {**options, "sync": autodist.LocalSGD(every=2)}
    x, y = w.digits_like(36, features=6, classes=3)
    whole, mine = _batches(x, y, n, rank)
    ref = w.seeded(Scaled, 0)
    # mp splits the batch over no rank: both ranks of the model-parallel group see the whole batch
    model, _ = autodist.parallelize(w.seeded(Scaled, 10 * rank), **options)
    for m, data in ((ref, whole), (model, whole if options.get("mp") else mine)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for xb, yb in data:
            opt.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            opt.step()
    twin = copy.deepcopy(model)
    again = copy.deepcopy(twin)  # a copy of the copy: an ordinary module copies as one
    plain = pickle.loads(pickle.dumps(twin))  # nothing of autodist's left in it: no group, no shared memory
    return {"class": type(twin).__name__, "layers": [type(m).__name__ for m in twin.layers],
            "hooks": _hooks(twin), "state": twin.state_dict(), "again": again.state_dict(),
            "pickled": plain.state_dict(), "ref": ref.state_dict(),
            "out": twin(x).detach(), "ref_out": ref(x).detach()}


@pytest.mark.parametrize("options", [{}, {"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"},
                                     {"mp": 2}, {"sync": "local"}],
                         ids=["none", "optimizer", "gradients", "parameters", "mp2", "localsgd"])
def test_deepcopy_is_the_plain_model_with_the_whole_current_weights(ranks, options):
    for out in ranks(2, _copies, options):
        assert out["class"] == "Scaled" and out["layers"] == ["Linear"] * 3, out["layers"]
        assert out["hooks"] == 0
        local = options.get("sync") == "local"  # LocalSGD: the copy is this rank's replica, not yet averaged
        for key in ("state", "again", "pickled"):
            if not local:
                assert_close(out[key], out["ref"], rtol=1e-12, atol=1e-12)
            else:
                assert set(out[key]) == set(out["ref"])
        assert_close(out["again"], out["state"], rtol=0, atol=0)
        if not local:
            assert_close(out["out"], out["ref_out"], rtol=1e-12, atol=1e-12)


def _pickles(level):
    torch.manual_seed(0)
    model, _ = autodist.parallelize(w.seeded(Scaled, 0), shard=level)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = w.digits_like(8, features=6, classes=3)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    dense = model.state_dict()
    out = {"dense": dense}
    for name, write in (("torch.save", lambda f: torch.save(model, f)), ("pickle", lambda f: pickle.dump(model, f))):
        f = io.BytesIO()
        try:
            write(f)
        except RuntimeError as err:
            out[name] = str(err)
            continue
        f.seek(0)
        loaded = torch.load(f, weights_only=False) if name == "torch.save" else pickle.load(f)
        out[name] = (type(loaded).__name__, _hooks(loaded), loaded.state_dict())
    with autodist.full_parameters(model):  # under shard="parameters" the whole weights are here: pickling works
        inside = pickle.loads(pickle.dumps(model))
    out["inside"] = inside.state_dict()
    return out


@pytest.mark.parametrize("level", LEVELS)
def test_pickling_gives_the_plain_model_or_says_what_to_use(ranks, level):
    for out in ranks(2, _pickles, level):
        assert_close(out["inside"], out["dense"])
        for name in ("torch.save", "pickle"):
            if level == "parameters":
                assert "autodist.save" in out[name] and "full_parameters" in out[name] and \
                    "shard='parameters'" in out[name], out[name]
            else:
                cls, hooks, state = out[name]
                assert cls == "Scaled" and hooks == 0
                assert_close(state, out["dense"])


def _mp_pickle():
    model, _ = autodist.parallelize(w.seeded(Scaled, 0), mp=2)
    with pytest.raises(RuntimeError, match="gather_state_dict") as err:
        pickle.dumps(model)
    return str(err.value)


def test_pickling_a_model_split_by_mp_names_what_saves_it(ranks):
    for message in ranks(2, _mp_pickle):
        assert "mp=K" in message and "autodist.save" in message


def _at_rest():
    torch.manual_seed(0)
    x, y = w.digits_like(12, features=6, classes=3)
    ref = w.seeded(Scaled, 0)
    model, (xs, ys) = autodist.parallelize(w.seeded(Scaled, 0), (x, y), shard="parameters")
    clipped = []
    for m, (bx, by) in ((ref, (x, y)), (model, (xs, ys))):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        F.cross_entropy(m(bx), by).backward()
        clipped.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1))
        opt.step()
        opt.zero_grad()
    reads = {
        "weight norms": lambda: sum(p.norm() for p in model.parameters()),
        "parameters_to_vector": lambda: torch.nn.utils.parameters_to_vector(model.parameters()),
        "detach clone": lambda: model.layers[0].weight.detach().clone(),
        "data": lambda: model.layers[0].weight.data + 0,
        "ema": lambda: torch.zeros(12, 6).mul_(0.999).add_(model.layers[0].weight.detach(), alpha=0.001),
        "copy_ into it": lambda: _no_grad(model.layers[0].weight.copy_, torch.zeros(12, 6)),
        "to(float64)": lambda: model.to(torch.float64),
    }
    errors = {}
    for name, read in reads.items():
        try:
            read()
            errors[name] = None
        except RuntimeError as err:
            errors[name] = str(err)
    meta = (tuple(model.layers[0].weight.shape), model.layers[0].weight.dtype,
            sum(p.numel() for p in model.parameters()), next(model.parameters()).new_zeros(2).tolist())
    model.eval()
    with torch.no_grad():
        evaluated = model(x)
    with autodist.full_parameters(model):
        norms = sum(p.norm() for p in model.parameters()).item()
        vector = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        model.layers[0].bias.data.fill_(0.25)  # written inside: kept after
        with pytest.raises(RuntimeError, match="inside autodist.full_parameters"):
            torch.optim.SGD(model.parameters(), lr=0.1).step()
    kept = model.state_dict()["layers.0.bias"]
    return {"errors": errors, "meta": meta, "norms": norms, "vector": vector, "kept": kept,
            "ref_norms": sum(p.norm() for p in ref.parameters()).item(),
            "ref_vector": torch.nn.utils.parameters_to_vector(ref.parameters()).detach(),
            "evaluated": evaluated, "ref_eval": ref.eval()(x).detach(), "norm": clipped[1], "ref_norm": clipped[0]}


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def test_a_parameter_at_rest_raises_on_every_read_and_full_parameters_gives_its_true_values(ranks):
    for out in ranks(2, _at_rest):
        for name, message in out["errors"].items():
            assert message is not None, f"{name} read a parameter at rest without an error"
            assert "shard='parameters'" in message and "autodist.full_parameters(model)" in message, message
        assert out["meta"] == ((12, 6), torch.float32, 6 * 12 + 12 + 12 * 12 + 12 + 12 * 3 + 3, [0.0, 0.0])
        assert_close(out["norm"], out["ref_norm"])
        assert_close(out["evaluated"], out["ref_eval"])
        assert_close(out["norms"], out["ref_norms"])
        assert_close(out["vector"], out["ref_vector"])
        assert_close(out["kept"], torch.full((12,), 0.25))


def _unfreeze(level):
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    model, _ = autodist.parallelize(model, shard=level)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].requires_grad_(True)
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError) as err:
        model(x).sum().backward()
        opt.step()
    return str(err.value)


@pytest.mark.parametrize("level", ["gradients", "parameters"])
def test_unfreezing_after_parallelize_names_the_level_in_use_and_the_rule(ranks, level):
    for message in ranks(2, _unfreeze, level):
        assert f"shard={level!r}" in message and "Frozen parameters" in message, message
        other = {"gradients": "parameters", "parameters": "gradients"}[level]
        assert f"parallelize(..., shard={other!r})" not in message


ALONE = textwrap.dedent("""
    import copy, sys, torch, autodist
    from torch import nn
    options = {"shard": "parameters"} if sys.argv[1] == "parameters" else {"mp": 2}
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model, _ = autodist.parallelize(model, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        if step == 1 and autodist.rank() == 0:
            twin = copy.deepcopy(model)   # rank 0 alone: a collective the other rank never enters
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
""")


@pytest.mark.slow
@pytest.mark.parametrize("what", ["parameters", "mp"])
def test_a_copy_on_one_rank_alone_is_a_named_error_not_a_hang(tmp_path, what):
    script = tmp_path / "alone.py"
    script.write_text(ALONE)
    env = {**os.environ, "AUTODIST_TIMEOUT": "4"}
    run = subprocess.run([sys.executable, "-m", "autodist", "run", "-n", "2", str(script), what],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0
    assert "copy.deepcopy(model)" in run.stderr and "call it on every rank" in run.stderr, run.stderr[-3000:]


class HasModule(nn.Module):
    """A model with a real submodule called `module`: it stays reachable."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _unwrap(model: nn.Module) -> nn.Module:
    """Hugging Face's unwrap_model: recursive over `.module`."""
    return _unwrap(model.module) if hasattr(model, "module") else model


def _module_habit():
    model, _ = autodist.parallelize(w.seeded(Scaled, 0))
    with pytest.raises(AttributeError) as err:
        model.module
    wrapped, _ = autodist.parallelize(w.seeded(HasModule, 0))
    return {"name": type(model).__name__, "isinstance": isinstance(model, Scaled), "hasattr": hasattr(model, "module"),
            "unwrapped": _unwrap(model) is model, "message": str(err.value),
            "real": type(wrapped.module).__name__, "copied": type(copy.deepcopy(model)) is Scaled,
            "pickled": type(pickle.loads(pickle.dumps(model))) is Scaled}


def test_model_module_from_ddp_code_says_the_model_itself_is_returned(ranks):
    """DDP code reaches the model as model.module: here that raises, saying to use the model; hasattr stays
    False (unwrapping helpers keep the model), a real submodule called module is found, copies are the class."""
    for out in ranks(2, _module_habit):
        assert out["message"].startswith("'Scaled' object has no attribute 'module': autodist.parallelize returns "
                                         "your model itself"), out["message"]
        assert out["name"] == "Scaled" and out["isinstance"] and not out["hasattr"] and out["unwrapped"]
        assert out["real"] == "Linear" and out["copied"] and out["pickled"]
