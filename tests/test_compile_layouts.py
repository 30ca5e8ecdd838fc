"""torch.compile at the layouts that gather and send between blocks: ``shard="parameters"`` (with checkpoint=True,
with mp, with mixed_precision) and ``pp`` (GPipe and 1F1B). Each block's forward compiles whole, in one graph;
dynamo counts no graph break; the training is one process's (float64), in whichever order compile comes."""
from __future__ import annotations

import gc
import shutil
import time

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

import autodist
from outside.nanogpt import GPT, GPTConfig

pytestmark = pytest.mark.slow  # torch.compile takes seconds a model: the full tier

CONFIG = GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32, dropout=0.0, bias=True)
BLOCK_OPS = {"scaled_dot_product_attention", "gelu", "layer_norm"}  # nanoGPT's Block: attention and MLP


class Residual(nn.Module):
    """A block of the user's own code that torch.fx traces (model parallelism splits its two Linears)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(Residual(8) for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return out, nn.functional.cross_entropy(out, y)


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(CONFIG) if name.startswith("gpt") else Stack()
    return model.float() if name == "gpt-float" else model.double()


def _loader(name: str) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    if name == "stack":
        return DataLoader(TensorDataset(torch.randn(24, 6, generator=g, dtype=torch.float64),
                                        torch.randint(0, 3, (24,), generator=g)), batch_size=12)
    x = torch.randint(0, 64, (21, 16), generator=g)  # the last global batch holds 5: uneven over the ranks
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=8)


LAYOUTS = {"shard-parameters": ("gpt", {"shard": "parameters"}),
           "shard-parameters-checkpoint": ("gpt", {"shard": "parameters", "checkpoint": True}),
           "shard-parameters-mp2": ("stack", {"shard": "parameters", "mp": 2}),
           "shard-parameters-bf16": ("gpt-float", {"shard": "parameters", "mixed_precision": "bf16"}),
           "pp2": ("gpt", {"pp": 2}),
           "pp2-1f1b": ("gpt", {"pp": 2, "loss_fn": lambda out, y: out[1]})}


def _train(model: nn.Module, loader: DataLoader, run: nn.Module | None = None, one_f_one_b: bool = False) -> None:
    run = model if run is None else run
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            loss = run(x, y, target=y) if one_f_one_b else run(x, y)[1]
            loss.backward()
            optimizer.step()


def _compiled(layout: str, order: str) -> tuple[dict, list[list[str]], dict, dict]:
    """(dynamo's graph breaks, each compiled graph's ops, the compiled run's weights, the reference's)."""
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters

    graphs: list[list[str]] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:  # aot_eager: the ops as they are, exact
        graphs.append([str(getattr(n.target, "__name__", n.target)) for m in gm.modules()  # checkpoint's too
                       if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes if n.op == "call_function"])
        return aot_eager(gm, inputs)

    torch._dynamo.reset()
    counters.clear()
    name, options = LAYOUTS[layout]
    model = _build(name)
    if order == "before":
        model = torch.compile(model, backend=backend)
    model, loader = autodist.parallelize(model, _loader(name), **options)
    run = torch.compile(model, backend=backend) if order == "after" else model
    if order == "method":
        model.compile(backend=backend)
    _train(model, loader, run, "loss_fn" in options)
    got = {k.removeprefix("_orig_mod."): v for k, v in autodist.gather_state_dict(model, all_ranks=True).items()}
    if "mixed_precision" in options:  # the reference: the same layout uncompiled (bfloat16 rounds the same ops)
        ref, ref_loader = autodist.parallelize(_build(name), _loader(name), **options)
        _train(ref, ref_loader)
        want = autodist.gather_state_dict(ref, all_ranks=True)
    else:  # one process
        ref = _build(name)
        _train(ref, _loader(name))
        want = ref.state_dict()
    return dict(counters["graph_break"]), graphs, got, want


@pytest.mark.parametrize("layout, order, size", [
    ("shard-parameters", "after", 2), ("shard-parameters", "before", 2), ("shard-parameters", "method", 2),
    ("shard-parameters-checkpoint", "after", 2), ("shard-parameters-mp2", "after", 4),
    ("shard-parameters-bf16", "after", 2), ("pp2", "after", 2), ("pp2-1f1b", "after", 2)])
def test_each_block_compiles_whole_and_trains_as_one_process(ranks, layout, order, size):
    for breaks, graphs, got, want in ranks(size, _compiled, layout, order):
        if layout.startswith("pp"):  # only where the stages exchange activations: a stage's input, its output
            exchanges = ("Stub.forward", "Pipeline._stage_ends")
            assert all(any(f"function {name} " in reason for name in exchanges) for reason in breaks), list(breaks)
        else:
            assert breaks == {}, [reason.splitlines()[0] for reason in breaks]
        block_ops = {"tanh", "add"} if layout == "shard-parameters-mp2" else BLOCK_OPS
        whole = [ops for ops in graphs if block_ops <= set(ops)]  # one graph holds a whole block
        assert whole, graphs
        _one_block_a_graph(graphs, layout)
        _same(got, want, layout)


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "wait_tensor", "broadcast", "all_to_all")


def _one_block_a_graph(graphs: list[list[str]], layout: str) -> None:
    """No graph holds more than one block (a model compiled whole, its gathers traced inside, would hold every
    block in one), and no graph holds a gather, a reduce-scatter or the stages' exchanges: they run between
    graphs. (Model parallelism's all-reduce of a split product is the block's own computation: traced inside,
    as torch's tensor parallelism traces its functional collectives.)"""
    mp = layout == "shard-parameters-mp2"
    marker = "tanh" if mp else "scaled_dot_product_attention"  # once a block
    assert max(ops.count(marker) for ops in graphs) == 1, [ops.count(marker) for ops in graphs]
    kept_out = [c for c in COLLECTIVES if not (mp and c in ("all_reduce", "wait_tensor"))]
    traced = sorted({op for ops in graphs for op in ops if any(c in op for c in kept_out)})
    assert not traced, traced


def test_a_model_compiled_before_pp_trains_as_one_process(ranks):
    """Compiled, then cut into stages: exact (dynamo counts graph breaks where it meets the stages' exchanges:
    the docs say to compile after parallelize)."""
    for _, _, got, want in ranks(2, _compiled, "pp2", "before"):
        _same(got, want, "pp2")


def _same(got: dict, want: dict, layout: str) -> None:
    """float64 at its floor (1e-10); bfloat16 compute against the same layout uncompiled, at assert_close's
    float32 defaults (the compiled graph may order bfloat16's roundings otherwise)."""
    if LAYOUTS[layout][0] == "gpt-float":
        assert_close(got, want)
        return
    assert got.keys() == want.keys()
    worst = max(float((got[k].double() - want[k].double()).abs().max()) for k in want)
    assert worst <= 1e-10, worst


# -- what a rank holds under compile ------------------------------------------------------------------------

def _held_after(name: str, backend: str | None) -> tuple[list[int], list[int], int, dict, dict]:
    """Model ``name`` at shard="parameters", compiled with ``backend`` (None: eager): after each forward (before its
    backward) and after each step, the bytes of the blocks gathered during it that something still holds (a
    weak reference to each gathered storage: a compiled graph that kept a gathered weight for backward would
    keep it alive); the model's bytes; the weights, and one process's."""
    import torch._dynamo
    from torch.multiprocessing.reductions import StorageWeakRef

    from autodist.sharded.parameters import sharding_of

    torch._dynamo.reset()
    model, loader = autodist.parallelize(_build(name), _loader(name), shard="parameters")
    sharding = sharding_of(model)
    gathered: list[tuple[StorageWeakRef, int]] = []
    original = sharding._gather

    def gather(block, wait: bool = True) -> None:
        original(block, wait)
        for part in block.parts:
            if part.full is not None and block is not sharding.root:
                storage = part.full.untyped_storage()
                gathered.append((StorageWeakRef(storage), storage.nbytes()))

    sharding._gather = gather
    run = model if backend is None else torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    after_forward, after_step = [], []
    for _ in range(2):
        for x, y in loader:
            gathered.clear()
            loss = run(x, y)[1]
            after_forward.append(_still_held(gathered))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            after_step.append(_still_held(gathered))
    whole = sum(p.numel() * p.element_size() for p in _build(name).parameters())
    ref = _build(name)
    _train(ref, _loader(name))
    return after_forward, after_step, whole, autodist.gather_state_dict(model, all_ranks=True), ref.state_dict()


def _still_held(gathered: list) -> int:
    """The bytes of the gathered storages still alive, after a collection (a cold inductor compile, a recompile
    at step 3, left a block in cyclic garbage until the next one). The watchdog holds the frame of a collective
    it saw the main thread in, and with it its callers' locals, until it looks again (every HELD_FRAME_LOOK_S;
    later on a loaded machine): while something is alive, look again up to 5 s, as tests/test_memory.py does.
    A block a graph keeps for backward stays alive however long."""
    from autodist.faults.watchdog import HELD_FRAME_LOOK_S

    deadline = time.monotonic() + max(20 * HELD_FRAME_LOOK_S, 5.0)
    while True:
        gc.collect()
        held = sum(n for ref, n in gathered if not ref.expired())
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(HELD_FRAME_LOOK_S)


@pytest.mark.parametrize("name, backend", [("gpt", "aot_eager"), ("stack", "inductor")])
def test_a_compiled_forward_frees_each_block_as_eager_does(ranks, name, backend):
    """docs/sharded.md: under compile the gathered blocks are freed after each block as uncompiled, and what a
    block saves for backward is gathered again there. Measured, beside eager; exact to one process in float64,
    with inductor's generated kernels too (a smaller model: inductor takes about a minute to compile here)."""
    if backend == "inductor" and not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("inductor generates C++ on CPU: no C++ compiler on this machine")
    for (eager_forward, eager_step, whole, _, _), (forward, step, _, got, want) in zip(
            ranks(2, _held_after, name, None), ranks(2, _held_after, name, backend, timeout=600)):
        assert forward == eager_forward and step == eager_step, (forward, eager_forward, step, eager_step)
        assert max(forward) == 0 and max(step) == 0, (forward, step)  # no block outlives its use
        _same({k.removeprefix("_orig_mod."): v for k, v in got.items()}, want, "shard-parameters")
