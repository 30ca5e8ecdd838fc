"""The CUDA paths, each compared with one process on the same GPU; skipped where there is no GPU (CI).

One GPU is enough for most: two ranks share it, which is the "several processes per GPU" set-up
(``autodist.init`` picks gloo, since NCCL wants a GPU per rank; the tensors stay on the GPU). The NCCL
test needs two GPUs. Everything runs in float64, so that any difference is a real one, not TF32 or a
changed summation order.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import autodist
import workloads as w
from alike import train_alike
from autodist import engine
from outside.nanogpt import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in state.items()}


def _train(model, batches, optimizer, device):
    for x, y in engine.prefetch(batches, device=device):
        optimizer.zero_grad()
        F.cross_entropy(model(x.double()), y).backward()
        optimizer.step()


def _data_parallel(opt_name: str = "adam", **options):
    world = autodist.init()
    device = world.device
    x, y = w.digits_like(22)
    ref = w.seeded(w.mlp, 0).double().to(device)
    _train(ref, w.loader(x, y, 8), w.optimizer(opt_name, ref), device)
    model = w.seeded(w.mlp, w.rank() * 7).double().to(device)  # ranks differ: rank 0's weights must win
    model, data = autodist.parallelize(model, w.loader(x, y, 8), **options)
    optimizer = w.optimizer(opt_name, model)
    _train(model, data, optimizer, device)
    on_gpu = all(p.is_cuda and p.grad.is_cuda for p in model.parameters())
    state_on_gpu = all(v.is_cuda for s in optimizer.state_dict()["state"].values() for v in s.values() if v.dim())
    return _cpu(ref.state_dict()), _cpu(model.state_dict()), on_gpu and state_on_gpu, world.backend, str(device)


def _sharded(shard: str):
    return _data_parallel("adamw", shard=shard)


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_sharded_state_on_one_shared_gpu_trains_as_one_process(ranks, shard):
    for ref, par, on_gpu, backend, _ in ranks(2, _sharded, shard):
        assert on_gpu and backend == "gloo"
        assert_close(par, ref, rtol=1e-9, atol=1e-12)


def test_two_ranks_sharing_one_gpu_train_as_one_process(ranks):
    # 22 samples, batch 8: the last global batch of 6 splits 3/3; Adam in float64
    for ref, par, on_gpu, backend, device in ranks(2, _data_parallel):
        assert (on_gpu, backend, device) == (True, "gloo", "cuda:0")
        assert_close(par, ref, rtol=1e-9, atol=1e-12)


def _local_sgd_every_step():
    device = autodist.init().device
    x, y = w.digits_like(22)
    ref = w.seeded(w.mlp, 0).double().to(device)
    plain = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    _train(ref, w.loader(x, y, 8), plain(ref), device)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0).double().to(device), w.loader(x, y, 8),
                                       sync=autodist.LocalSGD(every=1))
    _train(model, data, plain(model), device)
    return _cpu(ref.state_dict()), _cpu(model.state_dict())


def test_local_sgd_every_step_on_gpu_is_the_exact_run(ranks):
    for ref, par in ranks(2, _local_sgd_every_step):
        assert_close(par, ref, rtol=1e-9, atol=1e-12)


CONFIG = GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=64, dropout=0.0, bias=True)


def _nanogpt_mp2(dropout: float):
    device = autodist.init().device
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=g).to(device)
    y = torch.roll(x, -1, 1)

    def gpt(seed):
        torch.manual_seed(seed)
        return GPT(dataclasses.replace(CONFIG, dropout=dropout)).double().to(device)

    ref = gpt(0)
    model, _ = autodist.parallelize(gpt(0 if w.rank() == 0 else 5), (x, y), mp=2)
    train_alike((ref, model), lambda m: m(x, y)[1])
    gathered = autodist.gather_state_dict(model, all_ranks=True)
    return _cpu(gathered), _cpu(ref.state_dict())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_nanogpt_mp2_on_one_gpu_trains_as_one_process(ranks, dropout):
    for gathered, expected in ranks(2, _nanogpt_mp2, dropout):
        assert gathered.keys() == expected.keys()
        for name in expected:
            assert_close(gathered[name], expected[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def _checkpoint_round_trip(path: str):
    device = autodist.init().device
    x, y = w.digits_like(22)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0).double().to(device), w.loader(x, y, 8))
    optimizer = w.optimizer("adam", model)
    _train(model, data, optimizer, device)
    autodist.save(path, model, optimizer, step=3)
    fresh, _ = autodist.parallelize(w.seeded(w.mlp, 9).double().to(device), None)
    fresh_optimizer = w.optimizer("adam", fresh)
    extra = autodist.load(path, fresh, fresh_optimizer)
    moments = [s["exp_avg"] for s in fresh_optimizer.state.values()]
    return (extra["step"], _cpu(model.state_dict()), _cpu(fresh.state_dict()),
            all(p.is_cuda for p in fresh.parameters()) and all(m.is_cuda for m in moments))


def test_checkpoint_of_a_gpu_model_loads_onto_the_gpu(ranks, tmp_path):
    for step, saved, loaded, on_gpu in ranks(2, _checkpoint_round_trip, str(tmp_path / "ckpt.pt")):
        assert step == 3 and on_gpu
        assert_close(loaded, saved, rtol=0, atol=0)


@pytest.mark.e2e
def test_example_trains_on_the_gpu_through_autodist_run(tmp_path):
    # two processes on the machine's GPU(s): the model and every batch on the GPU, one epoch of digits
    out = subprocess.run(
        [sys.executable, "-m", "autodist", "run", "-n", "2", "examples/cifar/train.py", "--epochs", "1",
         "--data-dir", str(tmp_path), "--no-progress", "--out", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "model on cuda:0" in out.stdout + out.stderr, out.stdout + out.stderr
    assert "final test accuracy" in out.stdout + out.stderr


NCCL_SCRIPT = """
import torch, torch.nn.functional as F, autodist, workloads as w
world = autodist.init()
x, y = w.digits_like(22)
ref = w.seeded(w.mlp, 0).double().cuda()
opt = w.optimizer("adam", ref)
for xb, yb in w.loader(x, y, 8):
    opt.zero_grad(); F.cross_entropy(ref(xb.double().cuda()), yb.cuda()).backward(); opt.step()
model, data = autodist.parallelize(w.seeded(w.mlp, world.rank).double(), w.loader(x, y, 8))
opt = w.optimizer("adam", model)
for xb, yb in data:
    opt.zero_grad(); F.cross_entropy(model(xb.double().cuda()), yb.cuda()).backward(); opt.step()
assert world.backend == "nccl" and next(model.parameters()).is_cuda
torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=1e-9, atol=1e-12)
print("nccl run matches one process", flush=True)
"""


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_nccl_data_parallel_matches_one_process(tmp_path):
    script = tmp_path / "nccl_train.py"
    script.write_text(NCCL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    out = subprocess.run([sys.executable, "-m", "autodist", "run", "-n", "2", str(script)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (out.stdout + out.stderr).count("nccl run matches one process") == 2


# -- every layout on the GPU: pp, checkpoint=True, plan="auto" ------------------------------------------------

def _layout_on_gpu(options: dict):
    """One process's training and the parallel one's with ``options`` on this rank's GPU (two ranks share it:
    gloo on CUDA tensors), float64, Adam; both dense states on the CPU."""
    world = autodist.init()
    device = world.device
    x, y = w.digits_like(24)
    ref = w.seeded(w.mlp, 0).double().to(device)
    _train(ref, w.loader(x, y, 8), w.optimizer("adam", ref), device)
    model = w.seeded(w.mlp, w.rank() * 7).double().to(device)  # ranks differ: rank 0's weights must win
    model, data = autodist.parallelize(model, w.loader(x, y, 8), **options)
    _train(model, data, w.optimizer("adam", model), device)
    held = [p for p in model.parameters() if p.numel() > 1]
    on_gpu = all(p.is_cuda for p in held)
    whole = autodist.gather_state_dict(model, all_ranks=True)  # the plan may choose mp: its layers' slices gathered
    return _cpu(ref.state_dict()), _cpu(whole), on_gpu, str(device)


@pytest.mark.parametrize("options", [{"pp": 2}, {"checkpoint": True}, {"checkpoint": True, "shard": "parameters"},
                                     {"plan": "auto"}], ids=["pp2", "checkpoint", "checkpoint-parameters", "auto"])
def test_each_layout_on_one_shared_gpu_trains_as_one_process(ranks, options):
    """pp=2 (activations and gradients between the stages on the GPU), the blocks recomputed in backward
    (also fully sharded), and the layout plan="auto" chooses: one process's training, on the GPU."""
    for ref, par, on_gpu, device in ranks(2, _layout_on_gpu, options):
        assert on_gpu and device == "cuda:0"
        assert_close(par, ref, rtol=1e-9, atol=1e-12)


def _budget():
    from autodist.planner.budget import default_budget

    world = autodist.init()
    model = w.seeded(w.mlp, 0).to(world.device)
    free, _ = torch.cuda.mem_get_info(world.device)
    return default_budget(model, world), free, sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_planners_gpu_budget_is_the_free_memory_shared_by_the_ranks_on_the_gpu(ranks):
    """Two ranks on one GPU may each plan for half its free memory (plus what the model holds), not all of it."""
    for budget, free, held in ranks(2, _budget):
        sharing = 2 if torch.cuda.device_count() == 1 else 1
        assert abs(budget - (free / sharing + held)) <= 0.05 * free, (budget, free, held)


def _coupled() -> tuple[dict, dict, float]:
    """A BatchNorm net trained on a mean over valid labels (every fourth at -100), on the GPU two ranks share:
    the global batch's statistics and the tokens read from the loss, against one process."""
    device = autodist.init().device
    x, y = w.digits_like(22)
    y = y.clone()
    y[::4] = -100

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 3)).double().to(device)

    ref = build()
    _train(ref, w.loader(x, y, 8), w.optimizer("adam", ref), device)
    model, data = autodist.parallelize(build(), w.loader(x, y, 8))
    _train(model, data, w.optimizer("adam", model), device)
    worst = max(float((a.double() - b.double()).abs().max()) for a, b in zip(ref.state_dict().values(),
                                                                            model.state_dict().values()))
    return _cpu(ref.state_dict()), _cpu(model.state_dict()), worst


def test_batch_norm_and_token_means_on_a_shared_gpu(ranks):
    for _, _, worst in ranks(2, _coupled):
        assert worst <= 1e-10, f"{worst:.3g} from one process"


def _experts_on_gpu() -> tuple[float, bool]:
    """Mixtral's experts placed over the two ranks sharing the GPU (ep=2: the all-to-all on CUDA tensors, gloo),
    float64, against one process on the same GPU."""
    transformers = pytest.importorskip("transformers")
    device = autodist.init().device

    def build():
        torch.manual_seed(0)
        config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                            num_experts_per_tok=2, max_position_embeddings=32, use_cache=False,
                                            attn_implementation="eager", experts_implementation="eager")
        return transformers.MixtralForCausalLM(config).double().to(device)

    ids = torch.randint(0, 32, (24, 6), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

    def train(model, batches):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for (x,) in batches:
            opt.zero_grad()
            x = x.to(device)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
        return _cpu(model.state_dict())

    reference = train(build(), loader)
    model, shard = autodist.parallelize(build(), loader, ep=2)
    trained = train(model, shard)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    return max(float((trained[k] - v).abs().max()) for k, v in reference.items()), experts.is_cuda


def test_experts_placed_over_ranks_sharing_a_gpu_train_as_one_process(ranks):
    for worst, on_gpu in ranks(2, _experts_on_gpu):
        assert on_gpu and worst <= 1e-12, worst
