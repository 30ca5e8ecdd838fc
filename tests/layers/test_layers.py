"""autodist.layers against one process: the communication, each split Linear, whole networks trained."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from collectives import counted
from torch.testing import assert_close

from autodist.layers import (ColumnParallelLinear, MPBaseLinear, MPBaseReshape, MPInitialLinear,
                             MPInitialReshape, MPTanh, RowParallelLinear)
from autodist.layers.comm import (copy_to_group, gather_last_dim, group_rank_size, reduce_from_group,
                                  shard_range, shard_sizes, split_last_dim)

SPLIT_LINEARS = [ColumnParallelLinear, RowParallelLinear, MPBaseLinear, MPInitialLinear]


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _shard(dense: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``layer``'s part of a dense weight (or bias) tensor of the same shape as nn.Linear's."""
    lo, hi = layer.bounds
    if layer.split == "row":
        return dense[:, lo:hi] if dense.ndim == 2 else dense
    return dense[lo:hi]


def _assert_pairs(results: list) -> None:
    """Each rank returns (what, got, expected, exact) rows; exact rows had no reduction in them."""
    for rank, rows in enumerate(results):
        for what, got, expected, exact in rows:
            tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
            assert_close(got, expected, **tol, msg=lambda m, r=rank, w=what: f"rank {r}, {w}: {m}")


# -- one process: a group of one ---------------------------------------------------------------------

def test_shard_sizes_uneven_first_ranks_wider():
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert shard_sizes(6, 3) == [2, 2, 2]
    assert shard_range([4, 3, 3], 2) == (7, 10)
    with pytest.raises(ValueError, match="parts >= 1"):
        shard_sizes(4, 0)


@pytest.mark.parametrize("cls", SPLIT_LINEARS)
def test_one_process_layer_is_nn_linear(cls):
    torch.manual_seed(0)
    layer = cls(5, 4)
    after_layer = torch.rand(1)
    torch.manual_seed(0)
    dense = nn.Linear(5, 4)
    assert_close(torch.rand(1), after_layer, rtol=0, atol=0)  # drew exactly what nn.Linear draws
    assert group_rank_size(None) == (0, 1) and layer.sizes == [5 if cls.split == "row" else 4]
    assert list(layer.state_dict()) == list(dense.state_dict()) == ["weight", "bias"]
    x = _randn(1, 3, 5)
    assert_close(layer(x), dense(x), rtol=0, atol=0)
    assert_close(layer.dense_state(), dict(dense.state_dict()), rtol=0, atol=0)
    assert f"split={cls.split}" in repr(layer)


def test_from_dense_draws_no_random_numbers_and_keeps_dtype():
    dense = nn.Linear(4, 3, dtype=torch.float64)
    torch.manual_seed(0)
    layer = MPBaseLinear.from_dense(dense)
    after_layer = torch.rand(1)
    torch.manual_seed(0)
    assert_close(after_layer, torch.rand(1), rtol=0, atol=0)  # a swap must not shift later dropout masks
    assert layer.weight.dtype == torch.float64 and isinstance(layer.weight, nn.Parameter)
    with pytest.raises(TypeError, match=r"Expect nn.Linear \(or a layer with a 2-D weight\) for linear, Conv1d found"):
        MPBaseLinear.from_dense(nn.Conv1d(1, 1, 1))


def test_reshape_and_tanh_need_no_group():
    x = _randn(0, 4, 8, 8).requires_grad_()
    flat = MPInitialReshape(64)(x)
    assert flat.shape == (4, 64)
    assert MPBaseReshape(2, -1)(flat).shape == (4, 2, 32) == MPBaseReshape((2, 32))(flat).shape
    MPTanh()(MPBaseReshape(-1)(x)).sum().backward()
    ref = x.detach().clone().requires_grad_()
    torch.tanh(ref).sum().backward()
    assert_close(x.grad, ref.grad, rtol=0, atol=0)  # the gradient flows back through the reshape unchanged
    assert repr(MPInitialReshape(32, 32)) == "MPInitialReshape(32, 32)"
    for bad in [(), (0,), (-1, -1), ("8",)]:
        with pytest.raises(ValueError, match="MPBaseReshape"):
            MPBaseReshape(*bad)


# -- real ranks: the communication --------------------------------------------------------------------

def _comm_case(n: int) -> list:
    rank, size = group_rank_size(None)
    sizes = shard_sizes(n, size)
    lo, hi = shard_range(sizes, rank)
    full = _randn(0, 2, 3, n)  # the same on every rank
    upstream = [_randn(10 + r, 2, 3, n) for r in range(size)]  # rank r's gradient, known to all
    rows = []

    x = full.clone().requires_grad_()
    y = copy_to_group(x, None)
    y.backward(upstream[rank])
    rows += [("copy forward", y.detach(), full, True), ("copy backward", x.grad, sum(upstream), False)]

    x = full.clone().requires_grad_()
    h = x * 1.0
    (copy_to_group(h, None) + h).backward(upstream[rank])  # both branches get the same gradient tensor
    rows.append(("copy backward leaves a shared gradient alone", x.grad, sum(upstream) + upstream[rank], False))

    partials = [_randn(20 + r, 2, 3, n) for r in range(size)]
    x = partials[rank].clone().requires_grad_()
    y = reduce_from_group(x, None)
    y.backward(full)
    rows += [("reduce forward", y.detach(), sum(partials), False),
             ("reduce leaves its input alone", x.detach(), partials[rank], True),
             ("reduce backward", x.grad, full, True)]

    grad = _randn(30, 2, 3, n)
    shard = full[..., lo:hi].clone().requires_grad_()
    y = gather_last_dim(shard, None, sizes)
    y.backward(grad)
    rows += [("gather forward", y.detach(), full, True), ("gather backward", shard.grad, grad[..., lo:hi], True)]

    x = full.clone().requires_grad_()
    y = split_last_dim(x, None, sizes)
    y.backward(grad[..., lo:hi])  # each rank its own slice of one known gradient
    rows += [("split forward", y.detach(), full[..., lo:hi], True), ("split backward", x.grad, grad, True)]
    return rows


@pytest.mark.parametrize("size, n", [(2, 6), (2, 7), (3, 6), (3, 7)])
def test_comm_forward_and_backward(ranks, size, n):
    _assert_pairs(ranks(size, _comm_case, n))


# -- real ranks: each layer against nn.Linear -----------------------------------------------------------

def _linear_case(in_features: int, out_features: int, bias: bool) -> list:
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features, bias=bias)
    x, grad = _randn(1, 2, 3, in_features), _randn(2, 2, 3, out_features)
    ref_x = x.clone().requires_grad_()
    ref_out = dense(ref_x)
    ref_out.backward(grad)
    rows = []
    for cls in (ColumnParallelLinear, RowParallelLinear, MPBaseLinear, MPInitialLinear):
        layer = cls.from_dense(dense)
        name, (lo, hi) = cls.__name__, layer.bounds
        column, sharded_in = layer.split == "column", cls is RowParallelLinear
        input_grad = cls is not MPInitialLinear
        inp = (x[..., lo:hi] if sharded_in else x).clone().requires_grad_(input_grad)
        out = layer(inp)
        out.backward(grad[..., lo:hi] if column else grad)
        rows.append((f"{name} output", out.detach(), ref_out.detach()[..., lo:hi] if column else ref_out.detach(),
                     False))
        if input_grad:
            rows.append((f"{name} input grad", inp.grad, ref_x.grad[..., lo:hi] if sharded_in else ref_x.grad, False))
        rows.append((f"{name} weight grad", layer.weight.grad, _shard(dense.weight.grad, layer), False))
        if bias:
            rows.append((f"{name} bias grad", layer.bias.grad, _shard(dense.bias.grad, layer), False))
    return rows


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("in_features, out_features, bias", [(10, 7, True), (9, 10, False)])
def test_each_layer_matches_nn_linear(ranks, size, in_features, out_features, bias):
    _assert_pairs(ranks(size, _linear_case, in_features, out_features, bias))


def _bias_once_case() -> list:
    dense = nn.Linear(6, 4)
    with torch.no_grad():
        dense.weight.zero_()
        dense.bias.copy_(torch.arange(1.0, 5.0))
    x = torch.ones(2, 6)
    rows = []
    for cls in (RowParallelLinear, MPBaseLinear, MPInitialLinear):
        layer = cls.from_dense(dense)
        lo, hi = layer.bounds
        out = layer(x[..., lo:hi] if cls is RowParallelLinear else x)
        out.sum().backward()
        rows += [(f"{cls.__name__} output is the bias, once", out.detach(), dense.bias.detach().expand(2, 4), True),
                 (f"{cls.__name__} bias grad", layer.bias.grad, torch.full((4,), 2.0), True)]
    return rows


def test_bias_is_added_once_not_on_every_rank(ranks):
    _assert_pairs(ranks(3, _bias_once_case))


def _round_trip_case() -> list:
    rows = []
    for cls in SPLIT_LINEARS:
        for bias in (True, False):
            torch.manual_seed(0)
            dense = nn.Linear(10, 7, bias=bias)
            expected = {k: v.detach() for k, v in dense.state_dict().items()}
            rows.append((f"{cls.__name__} from_dense", cls.from_dense(dense).dense_state(), expected, True))
            torch.manual_seed(0)
            rows.append((f"{cls.__name__} built directly", cls(10, 7, bias=bias).dense_state(), expected, True))
    return rows


@pytest.mark.parametrize("size", [2, 3])
def test_dense_state_round_trip_is_exact(ranks, size):
    _assert_pairs(ranks(size, _round_trip_case))


def _param_counts() -> list:
    return [(cls.__name__, cls(30, 20).weight.numel()) for cls in SPLIT_LINEARS]


def test_each_rank_holds_about_one_kth_of_the_weight(ranks):
    per_rank = ranks(3, _param_counts)
    for i, cls in enumerate(SPLIT_LINEARS):
        counts = [rows[i][1] for rows in per_rank]
        other_dim = 30 if cls.split == "column" else 20
        assert sum(counts) == 600, cls.__name__
        assert max(counts) <= 600 / 3 + other_dim, (cls.__name__, counts)  # 1/K, plus one row of rounding


def _backward_sends() -> dict:
    """Collectives each layer sends in backward, for an input without and with requires_grad."""
    counts = {}
    for cls in (ColumnParallelLinear, MPBaseLinear):
        for needs_grad in (False, True):
            torch.manual_seed(0)
            out = cls(6, 4)(torch.zeros(2, 6, requires_grad=needs_grad))
            counts[cls.__name__, needs_grad] = counted(lambda: out.sum().backward())
    return counts


def test_first_layer_input_sends_nothing_backward_unless_it_needs_a_gradient(ranks):
    for counts in ranks(2, _backward_sends):
        assert counts == {("ColumnParallelLinear", False): [], ("ColumnParallelLinear", True): ["all_reduce"],
                          ("MPBaseLinear", False): [], ("MPBaseLinear", True): ["all_gather"]}


# -- real ranks: errors ---------------------------------------------------------------------------------

def _errors_case() -> bool:
    with pytest.raises(ValueError, match="cannot split out_features=2 over a group of 3 ranks.*out_features=3"):
        ColumnParallelLinear(5, 2)
    with pytest.raises(ValueError, match="cannot split in_features=2 over a group of 3 ranks"):
        MPBaseLinear.from_dense(nn.Linear(2, 5))
    needs_grad = torch.zeros(2, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="use MPBaseLinear below the top of the network"):
        MPInitialLinear(6, 4)(needs_grad)
    with pytest.raises(ValueError, match="MPBaseLinear takes the full input"):
        RowParallelLinear(6, 4)(torch.zeros(2, 6))
    with torch.no_grad():  # no gradient wanted: the first layer takes any input
        MPInitialLinear(6, 4)(needs_grad)
    return True


def test_clear_errors(ranks):
    assert ranks(3, _errors_case) == [True] * 3


def _subgroup_case() -> list:
    group = dist.new_group([0, 2])  # collective: every rank creates it
    torch.manual_seed(0)
    dense = nn.Linear(5, 4)
    if dist.get_rank() == 1:
        with pytest.raises(ValueError, match="not a member of the process group"):
            MPBaseLinear.from_dense(dense, group=group)
        return []
    layer = MPBaseLinear.from_dense(dense, group=group)
    twin = copy.deepcopy(layer)  # a process group cannot be copied: the copy shares it
    x = _randn(0, 3, 5)
    return [("output over ranks 0 and 2", layer(x).detach(), dense(x).detach(), False),
            ("output of a deep copy", twin(x).detach(), dense(x).detach(), False),
            ("sizes", torch.tensor(layer.sizes), torch.tensor([3, 2]), True)]


def test_layer_over_a_subgroup(ranks):
    _assert_pairs(ranks(3, _subgroup_case))


# -- real ranks: whole networks, trained --------------------------------------------------------------

def _readme(mp: bool) -> nn.Module:
    if mp:  # TorchAD-NN's README network, by hand
        return nn.Sequential(MPInitialReshape(64), MPInitialLinear(64, 32), MPTanh(), MPBaseLinear(32, 10))
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def _deep(mp: bool) -> nn.Module:
    # 13, 10, 8 split unevenly over 2 or 3 ranks; the input needs a gradient, through three layers
    if mp:
        return nn.Sequential(MPBaseLinear(13, 10), MPTanh(), MPBaseLinear(10, 8), MPTanh(),
                             MPBaseReshape(2, 4), MPBaseReshape(-1), MPBaseLinear(8, 3))
    return nn.Sequential(nn.Linear(13, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(),
                         nn.Unflatten(1, (2, 4)), nn.Flatten(), nn.Linear(8, 3))


def _megatron_pairs(mp: bool) -> nn.Module:
    if mp:
        return nn.Sequential(ColumnParallelLinear(13, 10), MPTanh(), RowParallelLinear(10, 8), MPTanh(),
                             ColumnParallelLinear(8, 7), MPTanh(), RowParallelLinear(7, 3))
    return nn.Sequential(nn.Linear(13, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 7), nn.Tanh(),
                         nn.Linear(7, 3))


# name -> (builder, sample shape, classes, whether the input needs a gradient)
_NETS = {"readme": (_readme, (8, 8), 10, False), "deep": (_deep, (13,), 3, True),
         "megatron": (_megatron_pairs, (13,), 3, True)}


def _train_case(net: str) -> list:
    build, shape, classes, input_grad = _NETS[net]
    torch.manual_seed(0)
    model = build(True)  # built directly: draws the same dense weights as the reference
    torch.manual_seed(0)
    ref = build(False)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, *shape, generator=g), torch.randint(0, classes, (6,), generator=g)
    pairs = list(zip([m for m in model if hasattr(m, "dense_state")], [m for m in ref if isinstance(m, nn.Linear)]))
    rows = [(f"layer {i} initial {k}", v, getattr(lin, k).detach().clone(), True)
            for i, (layer, lin) in enumerate(pairs) for k, v in layer.dense_state().items()]

    inputs = [x.clone().requires_grad_(input_grad) for _ in range(2)]
    outs = [m(inp) for m, inp in zip((model, ref), inputs)]
    rows.append(("output", outs[0].detach(), outs[1].detach(), False))
    for out in outs:
        F.cross_entropy(out, y).backward()
    if input_grad:
        rows.append(("input grad", inputs[0].grad, inputs[1].grad, False))
    for i, (layer, lin) in enumerate(pairs):
        rows.append((f"layer {i} weight grad", layer.weight.grad, _shard(lin.weight.grad, layer), False))
        rows.append((f"layer {i} bias grad", layer.bias.grad, _shard(lin.bias.grad, layer), False))

    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for _ in range(5):
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    rows += [(f"layer {i} {k} after 5 steps", v, getattr(lin, k).detach(), False)
             for i, (layer, lin) in enumerate(pairs) for k, v in layer.dense_state().items()]
    return rows


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("net", sorted(_NETS))
def test_network_trains_like_one_process(ranks, size, net):
    _assert_pairs(ranks(size, _train_case, net))
