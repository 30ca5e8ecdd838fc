"""The model-parallel plan, computed without any process group."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import autodist
from test_mp import (WEIGHT_READERS, FunctionalMLP, ReadInCheckpointedMethod, ReshapeInside, TorchADNet,
                     UntraceableBlocks, deep_stack)


def _rows(plan):
    return {row.name: row for row in plan.layers}


def _plan(model: nn.Module, features: int = 8, **options):
    """The plan of a model torch.fx cannot trace: read from one forward on two samples."""
    return autodist.explain(model, mp=2, example=torch.randn(2, features), **options)


def test_torchad_network_is_one_megatron_pair():
    plan = autodist.explain(TorchADNet(), mp=2, batch_size=128)
    rows = _rows(plan)
    assert (rows["fc1"].split, rows["fc2"].split, rows["tanh"].split) == ("column", "row", "local")
    assert rows["fc1"].collectives == []  # the first layer: no input-gradient communication
    assert rows["fc2"].collectives == [("forward", "all-reduce", 10)]
    assert rows["fc1"].params_per_rank == 1024 * 1024 + 1024
    assert plan.collectives_per_step == 1
    table = str(plan)
    assert "column" in table and "5,120" in table  # 128 rows x 10 floats x 4 bytes
    assert "for (batch, seq, features) inputs pass batch_size = batch x seq" in table  # what the bytes assume


def test_deep_stack_pairs_then_a_lone_layer():
    rows = _rows(autodist.explain(deep_stack(), mp=3))
    assert [rows[n].split for n in ("0", "2", "4", "6")] == ["column", "row", "column", "row"]
    assert rows["4"].collectives == [("backward", "all-reduce", 16)]  # not first: input gradient is all-reduced
    assert rows["0"].params_per_rank == 7 * 12 + 7  # 20 outputs over 3 ranks: 7, 7, 6


def test_reshape_on_the_sharded_dimension_keeps_the_tensor_whole():
    with pytest.raises(ValueError, match="depends on one forward on a sample batch"):  # it has a "full" layer
        autodist.explain(ReshapeInside(), mp=2)
    rows = _rows(autodist.explain(ReshapeInside(), mp=2, example=torch.randn(2, 8, 8)))
    assert rows["a"].split == "full" and "view" in rows["a"].note
    assert (rows["b"].split, rows["c"].split) == ("column", "row")


def test_selection_by_name_and_callable():
    rows = _rows(autodist.explain(deep_stack(), mp=2, mp_layers=["0", "2"]))
    assert rows["4"].split == "replicated" and rows["4"].note == "not selected by mp_layers"
    rows = _rows(autodist.explain(deep_stack(), mp=2, mp_layers=lambda name, m: m.out_features >= 16))
    assert rows["6"].split == "replicated"
    with pytest.raises(ValueError, match=r"not nn.Linear .*layers of the model.*\['0', '2', '4', '6'\]"):
        autodist.explain(deep_stack(), mp=2, mp_layers=["fc9"])


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow stops torch.fx
            x = -x
        return self.fc2(torch.tanh(self.fc1(x)))


class UntraceableNoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return x * self.w


def test_untraceable_model_falls_back_to_module_swaps():
    plan = _plan(Untraceable())
    # fc1 -> tanh -> fc2, seen in the recorded forward: a Megatron pair, module by module
    assert not plan.traced and [r.split for r in plan.layers] == ["column", "row"]
    assert "module-by-module" in str(plan) and "if x.sum() > 0" in str(plan)  # says where tracing stopped
    rows = _rows(plan)
    assert rows["fc1"].collectives == []  # fed the input: nothing sent backward
    assert rows["fc2"].collectives == [("forward", "all-reduce", 2)]
    assert plan.collectives_per_step == 1


class ReadsItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return self.out(self.fc(x)).sum(1) + self.fc.weight.pow(2).sum()


class OnlyLayerIsRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return self.fc(x).sum(1) + self.fc.weight.pow(2).sum()


def test_fallback_keeps_a_linear_whose_weight_forward_reads_whole():
    rows = _rows(_plan(ReadsItsWeight()))
    assert rows["fc"].split == "replicated" and rows["out"].split == "full"
    assert re.search(r"reads its parameters.*test_explain.py:\d+: return self.out\(self.fc\(x\)\)", rows["fc"].note)
    assert rows["out"].collectives == [("forward", "all-reduce", 2), ("backward", "all-gather", 8)]
    with pytest.raises(NotImplementedError, match=r"if x.sum\(\) > 0.*fc stays: .*self.fc.weight.pow\(2\)"):
        _plan(OnlyLayerIsRead())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.flatten(1)))) * self.b.weight.device.type.count("c")  # harmless read


class Reads(nn.Module):
    """Reads in a helper method and through a loop variable; a Sequential and a block fed the input."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Flatten(), nn.Linear(8, 8))
        self.block = Block()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.loop = nn.ModuleList([nn.Linear(8, 8)])
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        h = self.block(x) + self.seq(x)
        for layer in self.layers:
            h = layer(h)
        for layer in self.loop:
            h = layer(h) + layer.bias
        return self.head(h) + self.penalty()

    def penalty(self):
        return self.layers[1].weight.sum()


def test_fallback_reads_helpers_loops_and_submodules():
    rows = _rows(_plan(Reads()))
    # block.a -> tanh -> block.b pair; layers.0 is fed block.b's output (split already) plus seq's: full
    assert {n: r.split for n, r in rows.items()} == {
        "seq.1": "full", "block.a": "column", "block.b": "row", "layers.0": "full", "layers.1": "replicated",
        "loop.0": "replicated", "head": "full"}
    assert "return self.layers[1].weight.sum()" in rows["layers.1"].note  # read in a helper method
    assert "layer.bias" in rows["loop.0"].note
    # fed the model's input, through a Sequential and a block's forward: nothing sent backward
    assert rows["seq.1"].collectives == [("forward", "all-reduce", 8)] and rows["block.a"].collectives == []


def test_fallback_follows_helpers_super_and_module_lists_to_the_layers_fed_the_input():
    rows = _rows(_plan(UntraceableBlocks(), 12))
    assert {n: r.split for n, r in rows.items()} == {"stem": "full", "side": "full", "layers.0": "column",
                                                     "layers.1": "row", "head": "full"}
    assert {n for n, r in rows.items() if r.split == "full" and len(r.collectives) == 1} == {"side", "stem"}
    assert rows["layers.0"].collectives == [] and len(rows["head"].collectives) == 2


def test_fallback_keeps_a_layer_called_in_a_loop_whole():
    class Looped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            for _ in range(3):
                if x.sum() > 0:
                    x = -x
                x = self.fc(x)
            return x

    with pytest.raises(NotImplementedError, match="fc stays: called 3 times"):
        _plan(Looped())


@pytest.mark.parametrize("reader", sorted(WEIGHT_READERS))
def test_fallback_finds_weight_reads_outside_forward(reader):
    build, read = WEIGHT_READERS[reader]
    rows = _rows(_plan(build()))
    assert rows[read].split == "replicated" and "reads its parameters" in rows[read].note
    assert rows["head"].split == "full"


def _weight_norm(layer):
    return layer.weight.norm()


class _NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) / _weight_norm(self.fc)  # a helper of this file: read, and handed only block.fc


def test_fallback_reads_the_functions_of_the_model_file_and_skips_what_init_ran():
    class UsesHelper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.head = _NormedBlock(), nn.Linear(8, 3)
            nn.init.zeros_(self.head.bias)  # ran before parallelize: not a read

        def forward(self, x):
            if x.sum() > 0:
                x = -x
            return self.head(self.block(x))

    rows = _rows(_plan(UsesHelper()))
    assert rows["block.fc"].split == "replicated" and "return layer.weight.norm()" in rows["block.fc"].note
    assert rows["head"].split == "full"


@dataclasses.dataclass(eq=False)
class DataclassNet(nn.Module):
    width: int = 8

    def __post_init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(self.width, self.width)

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return self.fc(x)


def test_fallback_swaps_in_a_dataclass_module_whose_generated_methods_have_no_source():
    assert _plan(DataclassNet()).layers[0].split == "full"


def test_fallback_counts_a_layer_after_a_checkpointed_method_as_needing_a_gradient():
    # checkpoint(self._body, x) runs fc: its result needs a gradient, so head's backward sends
    rows = _rows(_plan(ReadInCheckpointedMethod()))
    assert "test_mp.py" in rows["fc"].note and "first layer" not in rows["head"].note
    assert rows["head"].collectives == [("forward", "all-reduce", 3), ("backward", "all-gather", 8)]


def test_fallback_keeps_a_block_called_twice_whole_and_sees_the_next_input_needs_a_gradient():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.head = nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 8)

        def forward(self, x):
            if x.sum() > 0:
                x = -x
            return self.head(self.block(torch.tanh(self.block(x))))  # the second call's input needs a gradient

    rows = _plan(Twice()).layers  # the block runs twice: kept whole; head's input needs a gradient
    assert [(r.split, len(r.collectives)) for r in rows] == [("replicated", 0), ("full", 2)]


def test_untraceable_model_without_linears_names_the_line():
    with pytest.raises(NotImplementedError, match=r"test_explain.py:\d+: if x.sum\(\) > 0"):
        _plan(UntraceableNoLinear(), 3)


def test_explain_checks_arguments():
    with pytest.raises(TypeError, match="Expect nn.Module"):
        autodist.explain("model", mp=2)
    with pytest.raises(ValueError, match="mp must be a positive int"):
        autodist.explain(deep_stack(), mp=0)


def test_functional_linear_calls_are_planned():
    rows = _rows(autodist.explain(FunctionalMLP(), mp=2))
    assert (rows["w1"].op, rows["w1"].split, rows["w2"].split) == ("F.linear", "column", "row")


def test_small_unpaired_layer_stays_replicated_unless_named():
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 10))
    rows = _rows(autodist.explain(net, mp=2))
    assert rows["4"].split == "replicated" and "small" in rows["4"].note and rows["4"].collectives == []
    rows = _rows(autodist.explain(net, mp=2, mp_layers=["0", "2", "4"]))
    assert rows["4"].split == "full" and len(rows["4"].collectives) == 2


class TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class WeightReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x) + torch.nn.functional.linear(x, self.fc.weight, self.fc.bias)


class ModeDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        h = torch.nn.functional.dropout(torch.nn.functional.linear(x, self.w1), 0.5, self.training)
        return torch.nn.functional.linear(h, self.w2)


def test_a_linear_with_hooks_stays_replicated():
    traced, untraced = deep_stack(), Untraceable()
    for layer in (traced[2], untraced.fc1):
        layer.register_forward_hook(lambda module, inputs, output: 2 * output)  # a swap would drop it
    for name, plan in (("2", autodist.explain(traced, mp=2)), ("fc1", _plan(untraced))):
        assert _rows(plan)[name].split == "replicated" and "hooks" in _rows(plan)[name].note


def test_shared_weights_stay_replicated():
    rows = _rows(autodist.explain(TiedPair(), mp=2))
    assert rows["a"].split == rows["b"].split == "replicated" and "shared" in rows["a"].note
    rows = _rows(autodist.explain(WeightReadTwice(), mp=2))
    assert rows["fc"].split == "replicated" and rows["fc.weight"].split == "replicated"


def test_functional_linear_in_a_mode_dependent_forward_is_left_alone():
    rows = _rows(autodist.explain(ModeDependent(), mp=2))
    assert rows["w1"].split == "replicated" and "model.training" in rows["w1"].note


class LoRALinear(nn.Linear):
    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.adapter = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return super().forward(x) + self.adapter


class UntraceableMixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lora, self.plain = LoRALinear(8), nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return self.plain(self.lora(x))


def test_fallback_swaps_only_plain_linears():
    rows = _rows(_plan(UntraceableMixed()))
    assert set(rows) == {"plain", "attn"} and rows["plain"].split == "full"
    # torch's attention is split whole, by heads - but only when the forward runs it
    assert rows["attn"].split == "replicated" and "not run by the forward" in rows["attn"].note


