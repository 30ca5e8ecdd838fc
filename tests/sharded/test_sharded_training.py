"""shard="optimizer" / "gradients" / "parameters": each data-parallel rank keeps 1/N of the optimizer state (and
of the averaged gradients, and of the parameters between uses), and the training is still the single-process
one (float64, several Adam / AdamW steps, param groups, a scheduler, 2 and 3 ranks, the project's models and
outside code); the state travels dense."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import autodist
import workloads as w
from alike import assert_same_training
from autodist.sharded.grads import ShardedGrad
from autodist.sharded.layout import Layout
from autodist.sharded.optimizer import sharding_of
from outside.nanogpt import GPT, GPTConfig
from test_sync_modes import _accumulate


def test_the_layout_gives_every_rank_one_nth_of_the_elements():
    params = [torch.zeros(7, 3), torch.zeros(5), torch.zeros(2, 2, dtype=torch.float64), torch.zeros(1)]
    layout = Layout.of(params, ranks=3)
    for kind in layout.kinds:
        owned = [sum(p.stop - p.start for p in pieces) for pieces in kind.pieces]
        assert sum(owned) == kind.total and max(owned) == -(-kind.total // 3)  # ceil(T / N) at most
        covered = sorted((p.index, p.start, p.stop) for pieces in kind.pieces for p in pieces)
        for (i, _, stop), (j, start, _) in zip(covered, covered[1:]):
            assert start == (stop if i == j else 0)  # every element once, in order
    assert [(p.index, p.start, p.stop) for p in layout.kinds[0].pieces[1]] == [(0, 9, 18)]


def _groups(model: torch.nn.Module, optimizer: str) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=1e-2, betas=(0.9, 0.95))


def _train(model, batches, optimizer: str, clip: bool = False):
    opt = _groups(model, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        schedule.step()
    return opt


def _mlp_run(optimizer: str, clip: bool, shared_memory: str = "1", shard: str = "optimizer"):
    torch.set_default_dtype(torch.float64)
    os.environ["AUTODIST_SHARED_MEMORY"] = shared_memory  # "0": the chunks meet through gloo's all-gather
    try:
        x, y = w.digits_like(60, features=7, classes=5)
        def build():
            return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))

        ref = w.seeded(build, 0)
        ref_opt = _train(ref, w.loader(x, y, 12, shuffle=False), optimizer, clip)
        model, data = autodist.parallelize(w.seeded(build, 100 * w.rank()), w.loader(x, y, 12, shuffle=False),
                                           shard=shard)
        opt = _train(model, data, optimizer, clip)
        sharding = sharding_of(model)
        held = sharding.held_bytes()
        if shard != "optimizer":  # after the last step's backward: every .grad a slice, 1/N of them in all
            grads = [p.grad for p in model.parameters()]
            assert all(isinstance(g, ShardedGrad) for g in grads), [type(g) for g in grads]
            total = sum(p.numel() for p in model.parameters())
            assert sum(g.local.numel() for g in grads) <= total / torch.distributed.get_world_size() + 2  # a bucket
        full = sum(v.numel() * v.element_size() for s in ref_opt.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)
        dense, ref_dense = opt.state_dict(), ref_opt.state_dict()
        return w.state(ref), w.state(model), held, full, dense, ref_dense
    finally:
        torch.set_default_dtype(torch.float32)
        del os.environ["AUTODIST_SHARED_MEMORY"]


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("optimizer, clip, shared_memory", [("adam", False, "1"), ("adamw", True, "1"),
                                                             ("adamw", True, "0")])
def test_sharded_optimizer_state_trains_as_one_process(ranks, size, optimizer, clip, shared_memory, shard):
    results = ranks(size, _mlp_run, optimizer, clip, shared_memory, shard)
    for ref, par, held, full, dense, ref_dense in results:
        assert_close(par, ref, rtol=1e-12, atol=1e-14)
        assert held <= full / size * 1.01 + 64, (held, full)  # 1/N of the per-element state (+ an element)
        assert dense["param_groups"] == ref_dense["param_groups"]
        assert_close(dense["state"], ref_dense["state"], rtol=1e-12, atol=1e-14)
    for _, par, *_ in results[1:]:
        assert_close(par, results[0][1], rtol=0, atol=0)


def _accumulate_sharded(shard: str):
    return _accumulate(2, 17, shard=shard)


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_no_sync_accumulation_with_uneven_micro_batches(ranks, shard):
    # 17 samples in micro-batches of 5: the last step's ranks hold 1, 1 and 0 samples (tests/dp/test_sync_modes.py)
    assert_same_training(ranks(3, _accumulate_sharded, shard))


def _nanogpt_run(shard: str):
    torch.manual_seed(0)
    config = GPTConfig(block_size=8, vocab_size=19, n_layer=2, n_head=2, n_embd=8, dropout=0.0, bias=True)
    build = lambda: GPT(dataclasses.replace(config)).double()  # noqa: E731
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 19, (12, 9), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ref = w.seeded(build, 0)
    model, (xs, ys) = autodist.parallelize(w.seeded(build, 100 * w.rank()), (x, y), shard=shard)
    for m, (inputs, targets) in ((ref, (x, y)), (model, (xs, ys))):
        opt = m.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95), device_type="cpu")
        for _ in range(3):
            opt.zero_grad()
            _, loss = m(inputs, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
    return w.state(ref), w.state(model)


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_nanogpt_with_its_own_optimizer_groups_trains_as_one_process(ranks, shard):
    for ref, par in ranks(3, _nanogpt_run, shard):
        assert_close(par, ref, rtol=1e-12, atol=1e-14)


def _refused():
    model, _ = autodist.parallelize(w.seeded(w.mlp, 0), shard="optimizer")
    opt = torch.optim.LBFGS(model.parameters())
    model(torch.ones(2, 6)).sum().backward()
    try:
        opt.step(lambda: model(torch.ones(2, 6)).sum())
    except TypeError as e:
        return str(e)
    return "no error"


def test_an_optimizer_that_looks_across_elements_is_refused(ranks):
    for message in ranks(2, _refused):
        assert "torch.optim.lbfgs.LBFGS is not known to" in message and "shard=None" in message


def test_shard_with_a_low_communication_mode_is_one_clear_error():
    with pytest.raises(ValueError, match="Use one or the other"):
        autodist.parallelize(w.mlp(), sync=autodist.LocalSGD(), shard="optimizer")
    with pytest.raises(ValueError, match="shard must be None"):
        autodist.parallelize(w.mlp(), shard="zero1")


# -- outside models: Hugging Face GPT-2 and Llama from tiny configs, torch's TransformerEncoder ----------------

def _outside(kind: str):
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, n_positions=16,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config).double()
    if kind == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          hidden_size=32, intermediate_size=64, vocab_size=50,
                                          max_position_embeddings=16)
        return transformers.LlamaForCausalLM(config).double()
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, dtype=torch.float64)
    return torch.nn.Sequential(torch.nn.Embedding(50, 32, dtype=torch.float64),
                               torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                               torch.nn.Linear(32, 50, dtype=torch.float64))


def _outside_run(kind: str, mp: int = 1, shard: str | None = "optimizer"):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 50, (6, 9), generator=g)

    def loss_of(m, batch):  # in float64 (Hugging Face's own loss computes in float32)
        logits = m(batch) if kind == "encoder" else m(input_ids=batch).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())

    ref = w.seeded(lambda: _outside(kind), 0)
    model, (mine,) = autodist.parallelize(w.seeded(lambda: _outside(kind), 100 * w.rank()), (ids,), mp=mp,
                                          shard=shard)
    dp = torch.distributed.get_world_size() // mp
    # The reference takes the global batch as the ranks' micro-batches (rows r, r + dp, ...) and weights each
    # one's gradient after its backward, as the ranks do: Llama computes its RMSNorm in float32 even in a
    # float64 model, where a gradient scaled before the backward rounds otherwise.
    for m, parts in ((ref, [ids[r::dp] for r in range(dp)]), (model, [mine])):
        params = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            opt.zero_grad()
            if m is model:
                loss_of(m, mine).backward()
            else:
                grads = [torch.autograd.grad(loss_of(m, part), params) for part in parts]
                for i, p in enumerate(params):
                    p.grad = sum(g[i] * (len(part) / len(ids)) for g, part in zip(grads, parts))
            opt.step()
    return w.state(ref), autodist.gather_state_dict(model, all_ranks=True)


def _assert_near(par: dict, ref: dict, tol: float) -> None:
    """Every tensor within ``tol`` of the reference, relative to the tensor's largest element (Adam turns the
    rounding noise of a gradient that is zero in exact arithmetic, e.g. an attention key's bias, into steps)."""
    for name, value in ref.items():
        scale = value.abs().max().item() if value.numel() else 0.0
        assert (par[name] - value).abs().max().item() <= tol * max(scale, 1e-30), name


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "encoder"])
def test_outside_models_train_as_one_process(ranks, kind, shard):
    for ref, par in ranks(3, _outside_run, kind, 1, shard):
        _assert_near(par, ref, 1e-10)


def _both(kind: str, shard: str):
    return _outside_run(kind, 1, None)[1], _outside_run(kind, 1, shard)[1]


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_sharded_is_bit_for_bit_the_unsharded_run(ranks, shard):
    for unsharded, sharded in ranks(3, _both, "gpt2", shard):
        assert_close(sharded, unsharded, rtol=0, atol=0)


@pytest.mark.parametrize("shard", [pytest.param("optimizer", marks=pytest.mark.slow),
                                   pytest.param("gradients", marks=pytest.mark.slow), "parameters"])
def test_with_mp2_on_four_ranks_the_state_is_sharded_over_the_data_parallel_pairs(ranks, shard):
    for ref, par in ranks(4, _outside_run, "gpt2", 2, shard):
        _assert_near(par, ref, 1e-10)


# -- the state travels dense -----------------------------------------------------------------------------

def _checkpoint_run(path: str, save_shard: str | None, load_shard: str | None):
    """Two epochs uninterrupted; then one epoch saved at ``save_shard``, a fresh model and optimizer
    loaded at ``load_shard`` (another world size: the test runs it on 2 and 3 ranks), one more epoch."""
    torch.set_default_dtype(torch.float64)
    try:
        x, y = w.digits_like(48, features=6, classes=3)

        def epoch(model, data, opt):
            for xb, yb in data:
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()

        ref = w.seeded(w.mlp, 0)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        for _ in range(2):
            epoch(ref, w.loader(x, y, 12, shuffle=False), ref_opt)
        if save_shard != "skip":
            model, data = autodist.parallelize(w.seeded(w.mlp, 100 * w.rank()), w.loader(x, y, 12, shuffle=False),
                                               shard=save_shard)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            epoch(model, data, opt)
            autodist.save(path, model, opt)
        return w.state(ref), ref_opt.state_dict()
    finally:
        torch.set_default_dtype(torch.float32)


def _resume_run(path: str, load_shard: str | None):
    torch.set_default_dtype(torch.float64)
    try:
        x, y = w.digits_like(48, features=6, classes=3)
        model, data = autodist.parallelize(w.seeded(w.mlp, 7 + w.rank()), w.loader(x, y, 12, shuffle=False),
                                           shard=load_shard)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        autodist.load(path, model, opt)
        for xb, yb in data:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
        return w.state(model), opt.state_dict()
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("save_shard, load_shard", [("optimizer", None), (None, "optimizer"),
                                                    ("optimizer", "optimizer"), ("gradients", "optimizer"),
                                                    (None, "gradients"), ("parameters", "gradients"),
                                                    ("optimizer", "parameters")])
def test_a_checkpoint_resumes_at_another_level_and_world_size_exactly(ranks, tmp_path, save_shard, load_shard):
    path = str(tmp_path / "ckpt.pt")
    ref, ref_opt = ranks(2, _checkpoint_run, path, save_shard, load_shard)[0]
    saved = torch.load(path, weights_only=True)  # dense: a plain model and a plain optimizer take it
    plain = w.seeded(w.mlp, 3).double()
    plain.load_state_dict(saved["model"])
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(saved["optimizer"])
    assert len(plain_opt.state) == len(list(plain.parameters()))
    for state, opt_state in ranks(3, _resume_run, path, load_shard):
        assert_close(state, ref, rtol=1e-12, atol=1e-14)
        assert_close(opt_state["state"], ref_opt["state"], rtol=1e-12, atol=1e-14)


def _round_trip_run(shard: str):
    """Two steps, the optimizer's state through state_dict() and back into it, a third step."""
    torch.set_default_dtype(torch.float64)
    try:
        x, y = w.digits_like(36, features=6, classes=3)
        batches = [(x[i:i + 12], y[i:i + 12]) for i in range(0, 36, 12)]
        ref = w.seeded(w.mlp, 0)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        model, (xs, ys) = autodist.parallelize(w.seeded(w.mlp, 100 * w.rank()), (x, y), shard=shard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mine = [(xs[i:i + 4], ys[i:i + 4]) for i in range(0, 12, 4)]  # this rank's rows of each global batch
        for step, ((xb, yb), (xr, yr)) in enumerate(zip(mine, batches)):
            if step == 2:
                opt.load_state_dict(opt.state_dict())  # dense out, cut back in
            for m, o, a, b in ((model, opt, xb, yb), (ref, ref_opt, xr, yr)):
                o.zero_grad()
                F.cross_entropy(m(a), b).backward()
                o.step()
        return w.state(ref), w.state(model)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_the_state_goes_out_dense_and_back_in_between_steps(ranks, shard):
    for ref, par in ranks(3, _round_trip_run, shard):
        assert_close(par, ref, rtol=1e-12, atol=1e-14)
