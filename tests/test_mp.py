"""Model parallelism through parallelize(mp=K): the same training as one process, hybrid dp x mp."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w


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


def _data(shape: tuple[int, ...], n: int = 24, classes: int = 3, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def _compare_training(build, shape, classes: int, opt_name: str, steps: int, mp: int):
    """Outputs, one-step gradients and multi-step parameters against the model trained alone."""
    x, y = _data(shape, classes=classes)
    ref = w.seeded(build, 0)
    model, _ = autodist.parallelize(w.seeded(build, 0 if w.rank() == 0 else 9), mp=mp)
    out = {"output": (model(x).detach(), ref(x).detach())}
    ref_opt, opt = w.optimizer(opt_name, ref), w.optimizer(opt_name, model)
    for _ in range(steps):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
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




def test_hybrid_dp2_mp2(ranks):
    # Compare gathered dense parameters; data parallel over 2 groups of 2 model-parallel ranks.
    for ref, par in ranks(4, _hybrid_gathered):
        assert_close(par, ref, rtol=1e-5, atol=1e-6)


def test_functional_linear_calls_are_rewritten(ranks):
    _assert_compared(ranks(2, _compare_training, FunctionalMLP, (12,), 3, "adam", 4, 2))


def _hybrid_gathered():
    x, y = w.digits_like(30, features=12)
    ref = w.train(w.seeded(deep_stack, 0), w.loader(x, y, 8), "adam", 3)
    model, data = autodist.parallelize(w.seeded(deep_stack, 0 if w.rank() == 0 else 5), w.loader(x, y, 8), mp=2)
    w.train(model, data, "adam", 3)
    return w.state(ref), autodist.gather_state_dict(model, all_ranks=True)


def _count_collectives():
    model, _ = autodist.parallelize(w.seeded(deep_stack, 0), mp=dist.get_world_size())
    plan = autodist.explain(w.seeded(deep_stack, 0), mp=dist.get_world_size())
    counts = {"n": 0}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor")}

    def counting(fn):
        def wrapper(*args, **kwargs):
            counts["n"] += 1
            return fn(*args, **kwargs)
        return wrapper
    x, y = _data((12,))
    try:
        for name, fn in originals.items():
            setattr(dist, name, counting(fn))
        F.cross_entropy(model(x), y).backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    dense = sum(p.numel() for p in w.seeded(deep_stack, 0).parameters())
    mine = sum(p.numel() for p in model.parameters())
    return counts["n"], plan.collectives_per_step, mine, dense, sum(r.params_per_rank for r in plan.layers)


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_and_parameter_count_match_the_plan(ranks, size):
    for sent, planned, mine, dense, planned_params in ranks(size, _count_collectives):
        assert sent == planned > 0
        assert mine <= planned_params  # rank 0 holds the larger shard of uneven splits
        assert mine <= dense / size + 20 + 16 + 20 + 3 + 20 * size  # 1/K of the weights, plus biases, plus rounding


def _input_gradient(build, shape):
    """A saliency-style gradient with respect to the input, parallelized and alone."""
    x, y = _data(shape)
    ref = w.seeded(build, 0)
    model, _ = autodist.parallelize(w.seeded(build, 0), mp=2)
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
