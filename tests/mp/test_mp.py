"""Model parallelism through parallelize(mp=K): the same training as one process, hybrid dp x mp."""
from __future__ import annotations

import logging

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w
from collectives import counted
from autodist.layers.comm import all_gather_cat, shard_sizes
from autodist.mp.rewrite import mp_modules


class TorchADNet(nn.Module):
    """TorchAD-NN's README network: reshape to 1024, Linear 1024->2048, Tanh, Linear 2048->10."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1024, 2048)
        self.fc2 = nn.Linear(2048, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x.view(-1, 1024))))


def deep_stack() -> nn.Module:
    # widths 20 and 16 do not divide by 3: uneven shards
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 20), nn.Tanh(),
                         nn.Linear(20, 3))


class ReshapeInside(nn.Module):
    """Flatten at the top, and a view on an activation between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(torch.flatten(x, 1)))
        h = h.view(-1, 2, 32).flatten(1)  # acts on the would-be sharded dimension: must stay whole
        return self.c(torch.relu(self.b(h)))


class FunctionalMLP(nn.Module):
    """Linear layers written as F.linear calls on the module's own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(16, 12) * 0.3), nn.Parameter(torch.randn(16) * 0.1)
        self.w2, self.b2 = nn.Parameter(torch.randn(3, 16) * 0.3), nn.Parameter(torch.randn(3) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(F.linear(x, self.w1, self.b1)), self.w2, bias=self.b2)


class FullInside(nn.Module):
    """A reshape after a Megatron pair leaves the next Linear unpaired: a full-in/full-out MPBaseLinear. (c's
    output, transposed as an 8 x 8 grid and flattened, mixes every rank's slice: no pair with d either way.)"""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c(self.b(torch.tanh(self.a(x))).view(-1, 8, 8).flatten(1))
        return self.d(h.view(-1, 8, 8).transpose(1, 2).flatten(1))


class Untraceable(nn.Module):
    """torch.fx stops at the data-dependent branch; forward also reads fc2's weight itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            x = -x
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.fc3(h) + 0.1 * self.fc2.weight.pow(2).sum()  # a shard's sum would differ on every rank


def _data(shape: tuple[int, ...], n: int = 24, classes: int = 3, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def dense_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under the single-process model's names, split layers' shards gathered."""
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    for name, layer in mp_modules(model):
        prefix = f"{name}." if name else ""
        original = getattr(layer, "dense_names", {})  # a layer that replaced F.linear: the names it had
        for key, p in layer.named_parameters(recurse=False):
            whole = key == "bias" and layer.split == "row"  # a row split keeps the whole bias on every rank
            dim = 0 if layer.split == "column" else 1
            grads.pop(prefix + key)
            grads[original.get(key, prefix + key)] = p.grad.detach().clone() if whole else \
                all_gather_cat(p.grad, layer.group, layer.sizes, dim=dim)
    return grads


def _compare_training(build, shape, classes: int, opt_name: str, steps: int, mp: int):
    """Outputs, one-step gradients and multi-step parameters against the model trained alone."""
    x, y = _data(shape, classes=classes)
    ref = w.seeded(build, 0)
    model, _ = autodist.parallelize(w.seeded(build, 0 if w.rank() == 0 else 9), mp=mp, example=x[:2])
    out = {"output": (model(x).detach(), ref(x).detach())}
    pairs = [(model, w.optimizer(opt_name, model)), (ref, w.optimizer(opt_name, ref))]
    for step in range(steps):
        for m, o in pairs:
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
        if step == 0:
            out["gradients"] = (dense_grads(model), dense_grads(ref))
        for _, o in pairs:
            o.step()
    out["state"] = (autodist.gather_state_dict(model, all_ranks=True), w.state(ref))
    return out


def _assert_compared(results):
    for out in results:
        for got, expected in out.values():
            assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_torchad_network_mp2(ranks):
    _assert_compared(ranks(2, _compare_training, TorchADNet, (32, 32), 10, "sgd", 3, 2))


@pytest.mark.parametrize("size", [2, 3])
def test_deep_stack_even_and_uneven(ranks, size):
    _assert_compared(ranks(size, _compare_training, deep_stack, (12,), 3, "adam", 4, size))


def test_reshape_inside_forward(ranks):
    _assert_compared(ranks(2, _compare_training, ReshapeInside, (8, 8), 3, "adam", 4, 2))


def test_untraceable_model_falls_back_soundly(ranks):
    # fc2's weight is read by forward itself: it must stay whole, or every rank would add its shard's sum
    _assert_compared(ranks(2, _compare_training, Untraceable, (12,), 3, "adam", 4, 2))


def test_untraceable_pair_seen_in_the_recorded_forward_is_exact(ranks):
    # layers.0 -> tanh -> layers.1 pair up, module by module; stem, side and head are full-in/full-out
    _assert_compared(ranks(2, _compare_training, UntraceableBlocks, (12,), 3, "adam", 3, 2))


def _fallback_warnings() -> list[str]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("autodist")
    logger.addHandler(handler)
    try:
        autodist.parallelize(w.seeded(Untraceable, 0), mp=2, example=torch.ones(2, 12))
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_fallback_warns_where_tracing_stopped(ranks):
    on_rank0, on_rank1 = ranks(2, _fallback_warnings)
    assert len(on_rank0) == 1 and on_rank1 == []
    assert "test_mp.py" in on_rank0[0] and "if x.sum() > 0:" in on_rank0[0] and "fc1, fc3" in on_rank0[0]


def test_hybrid_dp2_mp2(ranks):
    # data parallel over 2 groups of 2 model-parallel ranks: first-batch gradients, then parameters
    _assert_compared(ranks(4, _hybrid_gathered))


def test_functional_linear_calls_are_rewritten(ranks):
    _assert_compared(ranks(2, _compare_training, FunctionalMLP, (12,), 3, "adam", 4, 2))


def _hybrid_gathered():
    x, y = w.digits_like(30, features=12)
    ref, ref_data = w.seeded(deep_stack, 0), w.loader(x, y, 8)
    model, data = autodist.parallelize(w.seeded(deep_stack, 0 if w.rank() == 0 else 5), w.loader(x, y, 8), mp=2)
    for m, batches in ((ref, ref_data), (model, data)):  # one global batch; the sharded one holds this rank's part
        xb, yb = next(iter(batches))
        F.cross_entropy(m(xb), yb).backward()
    out = {"gradients": (dense_grads(model), dense_grads(ref))}
    w.train(ref, ref_data, "adam", 3)
    w.train(model, data, "adam", 3)
    out["state"] = (autodist.gather_state_dict(model, all_ranks=True), w.state(ref))
    return out


class _Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x)


class UntraceableBlocks(_Stem):
    """Untraceable; layers fed the input through a helper method, super().forward and a loop over a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.side, self.head = nn.Linear(12, 12), nn.Linear(12, 3)
        self.layers = nn.ModuleList([nn.Linear(12, 12), nn.Linear(12, 12)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = -x
        h = torch.tanh(self.project(x) + super().forward(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x + h)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.side(x)


class _Penalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def penalty(self) -> torch.Tensor:
        return self.fc.weight.pow(2).sum()


class ReadInSubmoduleMethod(nn.Module):
    """A weight read in a submodule's method that the parent calls."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = _Penalized(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = -x
        return self.head(torch.tanh(self.block(x))) + 0.1 * self.block.penalty()


class ReadInCheckpointedMethod(nn.Module):
    """A weight read in a method handed to activation checkpointing as a callable."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * self.fc.weight.norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = -x
        return self.head(torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    @staticmethod
    def _norm(layer: nn.Linear) -> torch.Tensor:
        return layer.weight.abs().sum()

    @classmethod
    def scaled(cls, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return layer(x) / cls._norm(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(self.fc, x)


class ReadInStaticHelper(nn.Module):
    """A weight read in a static method, reached through a class method, handed the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = _Scaled(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = -x
        return self.head(torch.tanh(self.block(x)))


class ReadInProperty(nn.Module):
    """A weight read in a property."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    @property
    def scale(self) -> torch.Tensor:
        return self.fc.weight.abs().mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = -x
        return self.head(torch.tanh(self.fc(x))) * self.scale


# each model reads one layer's weight outside forward: that layer stays whole, the head is swapped
WEIGHT_READERS = {"submodule method": (ReadInSubmoduleMethod, "block.fc"),
                  "checkpointed method": (ReadInCheckpointedMethod, "fc"),
                  "static helper": (ReadInStaticHelper, "block.fc"), "property": (ReadInProperty, "fc")}


@pytest.mark.parametrize("reader", sorted(WEIGHT_READERS))
def test_weight_read_outside_forward_keeps_the_layer_whole(ranks, reader):
    _assert_compared(ranks(2, _compare_training, WEIGHT_READERS[reader][0], (8,), 3, "adam", 3, 2))


# name -> (builder, sample shape, how each Linear must be split: a layer left whole would be caught here)
_COUNTED = {
    "megatron pairs": (deep_stack, (12,), {"0": "column", "2": "row", "4": "column", "6": "row"}),
    "full in, full out": (FullInside, (16,), {"a": "column", "b": "row", "c": "full", "d": "replicated"}),
    "F.linear": (FunctionalMLP, (12,), {"w1": "column", "w2": "row"}),
    "untraceable": (Untraceable, (12,), {"fc1": "full", "fc2": "replicated", "fc3": "full"}),
    "untraceable blocks": (UntraceableBlocks, (12,), {"stem": "full", "side": "full", "head": "full",
                                                      "layers.0": "column", "layers.1": "row"}),
    # head's input comes from a checkpointed method: it needs a gradient, so head sends in backward
    "checkpointed": (ReadInCheckpointedMethod, (8,), {"fc": "replicated", "head": "full"}),
}


_F_LINEAR_BIASES = {"b1": "w1", "b2": "w2"}  # FunctionalMLP's F.linear sites are named by their weights


def _params_on_rank(dense: nn.Module, splits: dict[str, str], rank: int, size: int) -> int:
    """What rank ``rank`` must hold: column layers keep rows of weight and bias, row/full layers keep columns of
    the weight and the whole bias, everything else is whole."""
    total = 0
    for name, p in dense.named_parameters():
        layer = name.rpartition(".")[0] or _F_LINEAR_BIASES.get(name, name)
        split = splits.get(layer, "replicated")
        if split == "column":
            total += p.numel() // p.shape[0] * shard_sizes(p.shape[0], size)[rank]
        elif split in ("row", "full") and p.ndim == 2:
            total += p.shape[0] * shard_sizes(p.shape[1], size)[rank]
        else:
            total += p.numel()
    return total


def _count_collectives(model_name: str):
    build, shape, splits = _COUNTED[model_name]
    size, rank = dist.get_world_size(), dist.get_rank()
    x, y = _data(shape)
    model, _ = autodist.parallelize(w.seeded(build, 0), mp=size, example=x[:2])
    plan = autodist.explain(w.seeded(build, 0), mp=size, example=x[:2])
    x, y = _data(shape)
    sent = [c for c in counted(lambda: F.cross_entropy(model(x), y).backward())
            if c in ("all_reduce", "all_gather", "all_gather_into_tensor")]
    dense = w.seeded(build, 0)
    return {"sent": len(sent), "planned": plan.collectives_per_step,
            "splits": {r.name: r.split for r in plan.layers if r.op in ("Linear", "F.linear")},
            "params": sum(p.numel() for p in model.parameters()),
            "expected params": _params_on_rank(dense, splits, rank, size),
            "planned params": sum(r.params_per_rank for r in plan.layers),  # rank 0's: it holds the wider shards
            "rank 0 params": _params_on_rank(dense, splits, 0, size)}


@pytest.mark.parametrize("model_name", sorted(_COUNTED))
@pytest.mark.parametrize("size", [2, 3])
def test_collectives_and_parameter_count_match_the_plan(ranks, size, model_name):
    for got in ranks(size, _count_collectives, model_name):
        assert got["sent"] == got["planned"] > 0
        assert got["splits"] == _COUNTED[model_name][2]
        assert got["params"] == got["expected params"]
        assert got["planned params"] == got["rank 0 params"]


def _input_gradient(build, shape):
    """A saliency-style gradient with respect to the input, parallelized and alone."""
    x, y = _data(shape)
    ref = w.seeded(build, 0)
    model, _ = autodist.parallelize(w.seeded(build, 0), (x, y), mp=2)  # the data: a sample for the plan
    grads = []
    for m in (model, ref):
        inp = x.clone().requires_grad_()
        F.cross_entropy(m(inp), y).backward()
        grads.append(inp.grad)
    return grads


@pytest.mark.parametrize("build, shape", [(deep_stack, (12,)), (ReshapeInside, (8, 8))],
                         ids=["first-layer-column", "first-layer-full"])
def test_input_that_requires_grad_gets_the_single_process_gradient(ranks, build, shape):
    for got, expected in ranks(2, _input_gradient, build, shape):
        assert_close(got, expected, rtol=1e-5, atol=1e-6)


def dropout_stack() -> nn.Module:
    # dropout in the replicated region, between two Megatron pairs: every rank of a group must draw one mask
    return nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 64),
                         nn.Tanh(), nn.Linear(64, 3))


def _train_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    opt = w.optimizer("sgd", model)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _dropout_training():
    """Each rank seeds its RNG differently; parallelize must give the ranks of a group one random stream."""
    x, y = _data((12,))
    ref = w.seeded(dropout_stack, 0)
    model, (xs, ys) = autodist.parallelize(w.seeded(dropout_stack, 0 if w.rank() == 0 else 9 + w.rank()), (x, y),
                                           mp=2)
    start = torch.get_rng_state()
    _train_steps(model, xs, ys, 3)
    replicated = {k: v for k, v in w.state(model).items() if k in ("2.bias", "6.bias")}  # the row layers' biases
    gathered = autodist.gather_state_dict(model, all_ranks=True)
    torch.set_rng_state(start)  # one process drawing the same masks: the same training (meaningful for dp=1)
    _train_steps(ref, x, y, 3)
    return replicated, gathered, w.state(ref)


@pytest.mark.parametrize("size", [2, 4])
def test_dropout_draws_one_mask_per_model_parallel_group(ranks, size):
    results = ranks(size, _dropout_training)
    for replicated, gathered, ref in results:
        # identical in every rank (exact): the same mask within a group, the same averaged gradient across groups
        assert_close(replicated, results[0][0], rtol=0, atol=0)
        if size == 2:
            assert_close(gathered, ref, rtol=1e-5, atol=1e-6)


def _dropout_over_epochs():
    x, y = _data((12,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
    model, data = autodist.parallelize(w.seeded(dropout_stack, 0 if w.rank() == 0 else 9), loader, mp=2)
    w.train(model, data, "sgd", 2)  # a new order from the global RNG every epoch
    return {k: v for k, v in w.state(model).items() if k in ("2.bias", "6.bias")}


def test_dropout_masks_stay_shared_across_epochs_of_a_shuffling_loader(ranks):
    first, second = ranks(2, _dropout_over_epochs)
    assert_close(first, second, rtol=0, atol=0)


def _optimizer_too_early():
    model = w.seeded(deep_stack, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = autodist.parallelize(model, mp=2)
    F.cross_entropy(model(_data((12,))[0]), _data((12,))[1]).backward()
    with pytest.raises(RuntimeError, match="Build the optimizer after parallelize"):
        opt.step()


def test_optimizer_built_before_parallelize_refuses_to_step(ranks):
    ranks(2, _optimizer_too_early)


def _gathered_loads_into_plain_model():
    model, _ = autodist.parallelize(w.seeded(TorchADNet, 0), mp=2)
    state = autodist.gather_state_dict(model)
    if w.rank() != 0:
        return state is None
    plain = TorchADNet()
    plain.load_state_dict(state)
    assert_close(w.state(plain), w.state(w.seeded(TorchADNet, 0)), rtol=0, atol=0)
    return True


def test_gather_state_dict_loads_into_the_plain_model(ranks):
    assert ranks(2, _gathered_loads_into_plain_model) == [True, True]


def _hand_placed(groups_of: int):
    """TorchAD-NN's network built by hand from autodist.layers, trained through parallelize."""
    from autodist.layers import MPBaseLinear, MPInitialLinear, MPInitialReshape, MPTanh

    size, rank = dist.get_world_size(), dist.get_rank()
    group = None
    if groups_of < size:
        for start in range(0, size, groups_of):  # every rank creates every group
            g = dist.new_group(list(range(start, start + groups_of)))
            if start <= rank < start + groups_of:
                group = g

    def dense():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))

    ref = w.seeded(dense, 0)
    d = w.seeded(dense, 0)
    model = nn.Sequential(MPInitialReshape(64), MPInitialLinear.from_dense(d[1], group=group), MPTanh(),
                          MPBaseLinear.from_dense(d[3], group=group))
    x, y = _data((8, 8), n=24, classes=10)
    ref = w.train(ref, w.loader(x, y, 8), "sgd", 2)
    model, data = autodist.parallelize(model, w.loader(x, y, 8))
    w.train(model, data, "sgd", 2)
    return autodist.gather_state_dict(model, all_ranks=True), w.state(ref)


def test_hand_placed_layers_through_parallelize(ranks):
    for got, expected in ranks(2, _hand_placed, 2):  # the layers' group is every rank: mp=2, dp=1
        assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_hand_placed_layers_hybrid(ranks):
    for got, expected in ranks(4, _hand_placed, 2):  # groups {0,1} and {2,3}: mp=2 x dp=2
        assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _hand_placed_wrong_group():
    from autodist.layers import MPBaseLinear

    model = nn.Sequential(MPBaseLinear(8, 4))  # split over all 4 ranks
    with pytest.raises(ValueError, match=r"split over groups of \[4\] ranks but mp=2"):
        autodist.parallelize(model, mp=2)


def test_hand_placed_layers_must_match_mp(ranks):
    ranks(4, _hand_placed_wrong_group)


def _swapped_modules():
    def build():
        return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    model, _ = autodist.parallelize(w.seeded(build, 0), mp=2)
    x = _data((4, 4))[0]
    assert_close(model(x), w.seeded(build, 0)(x), rtol=1e-5, atol=1e-6)
    return [type(m).__name__ for m in model]


def test_module_forms_become_mp_layers(ranks):
    for names in ranks(2, _swapped_modules):
        assert names == ["MPInitialReshape", "ColumnParallelLinear", "MPTanh", "RowParallelLinear"]


class _TiedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rnn = nn.Embedding(50, 16), nn.LSTM(16, 16)
        self.head = nn.Linear(16, 50)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.rnn(self.embed(x))[0])


def _splits_nothing(kind: str) -> str:
    if kind == "conv":
        model, data = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)), torch.randn(4, 3, 8, 8)
    else:
        model, data = _TiedLSTM(), torch.randint(0, 50, (4, 6))
    with pytest.raises(ValueError) as err:
        autodist.parallelize(model, data, mp=2)
    return str(err.value)


@pytest.mark.parametrize("kind,why", [("conv", r"2 \(292 parameters\): only Linear layers are split"),
                                      ("lstm", "head .*weight is shared")])
def test_mp_that_splits_nothing_raises_and_says_why(ranks, kind, why):
    for message in ranks(2, _splits_nothing, kind):
        assert re.search(f"mp=2 splits none of .*{why}", message), message
