"""Pipeline parallelism (``pp=K``) trains as one process does on the same global batch.

Every case trains a float64 model for two epochs of a dataset whose last global batch is short (21 samples in
batches of 8), with AdamW and ``clip_grad_norm_`` that bites, on real gloo ranks, beside the same loop in one
process on the whole batches; the losses every rank logs, the norms it clips by and the dense weights at the
end must equal the single process's. Models: nanoGPT (tied embedding and head, held by every stage), Hugging
Face's GPT-2 (a dict batch, its own loss in float32, a ModelOutput), and torch's TransformerEncoder on (seq, batch) inputs.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

import autodist
from outside.nanogpt import GPT, GPTConfig

GPT_CONFIG = GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32, dropout=0.0, bias=True)
SAMPLES, BATCH = 21, 8


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(config)


class SeqFirst(nn.Module):
    """torch's own encoder layers on (seq, batch) inputs: a classifier over the mean of the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(0))


class ResidualMLP(nn.Module):
    """Code between the blocks that pp runs on the stage that receives: a residual around each block, on the
    input the root computes on every stage, and an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(1)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _stem_blocks_head() -> nn.Module:
    """The plain shape: Sequential(stem, *blocks, norm, head), the blocks a run of one type between others."""
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]
    return nn.Sequential(nn.Embedding(64, 8), nn.Flatten(), nn.Linear(16 * 8, 32), *blocks, nn.LayerNorm(32),
                         nn.Linear(32, 5))


def _untied_gpt() -> nn.Module:
    """nanoGPT with its head's own weight (Llama's, Mixtral's): a root parameter only the last stage's forward
    uses, whose gradient the other stages get from the sum over the stages."""
    model = GPT(GPT_CONFIG)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = {"gpt": lambda: GPT(GPT_CONFIG), "hf": _hf_gpt2, "seq": SeqFirst, "res": ResidualMLP,
             "stem": _stem_blocks_head, "gpt-untied": _untied_gpt}[name]()
    return model.double()


def _loader(name: str) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (SAMPLES, 16), generator=g)
    if name == "hf":
        return DataLoader([{"input_ids": row, "labels": row} for row in x], batch_size=BATCH)
    if name in ("seq", "res", "stem"):  # (seq, batch) for "seq": the DataLoader's batches are transposed in the step
        return DataLoader(TensorDataset(x, torch.randint(0, 5, (SAMPLES,), generator=g)), batch_size=BATCH)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=BATCH)


LOSS_FNS = {"gpt": lambda out: out[1], "hf": lambda out: out.loss, "seq": F.cross_entropy, "res": F.cross_entropy,
            "stem": F.cross_entropy}


def _loss(name: str, model: nn.Module, batch: object, in_forward: bool = False) -> torch.Tensor:
    """The step's loss; ``in_forward``: the model was parallelized with ``loss_fn`` (1F1B) and returns it."""
    if name == "hf":
        out = model(**batch)
        return out if in_forward else out.loss
    x, y = batch
    if name in ("seq", "res", "stem"):
        x = x.t() if name == "seq" else x
        return model(x, target=y) if in_forward else F.cross_entropy(model(x), y)
    out = model(x, y)
    return out if in_forward else out[1]


def _train(name: str, model: nn.Module, loader: object, in_forward: bool = False) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for _ in range(2):
        for batch in loader:
            opt.zero_grad()
            loss = _loss(name, model, batch, in_forward)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            losses.append(float(loss))
    return losses, norms


def _dense(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _pipelined(name: str, pp: int, options: dict) -> dict:
    in_forward = options.pop("1f1b", False)
    if in_forward:
        options["loss_fn"] = LOSS_FNS[name]
    model, loader = autodist.parallelize(_model(name), _loader(name), pp=pp, microbatches=3,
                                         batch_dim=1 if name == "seq" else None, **options)
    losses, norms = _train(name, model, loader, in_forward=in_forward)
    from autodist.pp.pipeline import pipeline_of
    from autodist.sharded.recompute import is_recomputing

    held = sum(p.numel() for p in model.parameters())
    state = _dense(model) if options.get("mp", 1) == 1 else autodist.gather_state_dict(model, all_ranks=True)
    modules = dict(model.named_modules())
    recomputed = [name for name in pipeline_of(model).held_blocks()
                  if is_recomputing(modules[name].__dict__.get("forward"))]
    return {"losses": losses, "norms": norms, "state": state, "held": held, "rank": autodist.init().rank,
            "recomputed": recomputed}


_REFERENCE: dict[str, tuple] = {}


def _reference(name: str) -> tuple[list[float], list[float], dict[str, torch.Tensor], int]:
    if name not in _REFERENCE:
        model = _model(name)
        losses, norms = _train(name, model, _loader(name))
        _REFERENCE[name] = (losses, norms, _dense(model), sum(p.numel() for p in model.parameters()))
    return _REFERENCE[name]


CASES = [  # id, ranks, pp, model, options
    ("pp2-gpt", 2, 2, "gpt", {}),
    ("pp2-hf", 2, 2, "hf", {}),
    ("pp2-seq-first", 2, 2, "seq", {}),
    ("pp2-residual-between-blocks", 2, 2, "res", {}),
    ("pp2-stem-blocks-head", 2, 2, "stem", {}),
    ("pp2-gpt-recomputed", 2, 2, "gpt", {"checkpoint": True, "stages": [3, 1]}),  # a stage of one block recomputes
    ("pp4-gpt", 4, 4, "gpt", {}),
    ("dp2-pp2-gpt", 4, 2, "gpt", {}),  # 2 data-parallel replicas of 2 stages
    ("dp2-pp2-shard-optimizer", 4, 2, "gpt", {"shard": "optimizer"}),
    ("dp2-pp2-shard-gradients", 4, 2, "gpt", {"shard": "gradients"}),
    ("dp2-pp2-hf-stages-by-hand", 4, 2, "hf", {"stages": [3, 1]}),
    ("pp2-mp2-gpt", 4, 2, "gpt", {"mp": 2}),
    # the head split by mp and used on the last stage only: the first stage's gradient of it, set by the sum over
    # the stages, is its model-parallel part of the norm too (it counted as whole there: 0.18 off one process)
    ("pp2-mp2-gpt-untied-head", 4, 2, "gpt-untied", {"mp": 2}),
    ("pp2-gpt-1f1b", 2, 2, "gpt", {"1f1b": True}),
    ("pp2-seq-first-1f1b", 2, 2, "seq", {"1f1b": True}),  # target=y cut along its own batch dimension (0; inputs' 1)
    ("pp4-gpt-1f1b", 4, 4, "gpt", {"1f1b": True}),
    ("dp2-pp2-hf-1f1b-shard-optimizer", 4, 2, "hf", {"1f1b": True, "shard": "optimizer"}),
]


@pytest.mark.parametrize("size,pp,name,options", [
    pytest.param(*case, id=ident, marks=() if ident == "pp2-gpt" else pytest.mark.slow) for ident, *case in CASES])
def test_trains_as_one_process(ranks, size, pp, name, options):
    losses, norms, state, total = _reference(name)
    # Hugging Face's loss is float32 even in a float64 model (it upcasts the logits to float32 only), and the
    # mean of 3 micro-batches' means rounds differently from the batch's: float32's last digits, carried on
    # Elsewhere float64: rtol 1e-10 of each element, and an absolute floor of 1e-10 for the elements near zero
    # (a bias of about 8e-13 came out 1.08e-12 off on another CPU: rounding at the float floor, which Adam
    # spreads; the parameters themselves are of order 0.1, so 1e-10 is still nine digits of theirs)
    tol = dict(rtol=1e-5, atol=1e-6) if name == "hf" else dict(rtol=1e-10, atol=1e-10)
    results = ranks(size, _pipelined, name, pp, options)
    dp = size // pp // options.get("mp", 1)
    for result in results:
        if dp == 1:  # each rank's loss is its data-parallel shard's: the whole batch's without dp
            assert_close(result["losses"], losses, **tol)
        assert_close(result["norms"], norms, **tol)  # the whole model's norm, on every stage
        assert result["held"] < total  # a stage holds its own blocks (and the root), not the model
        if options.get("checkpoint"):
            assert len(result["recomputed"]) == options["stages"][result["rank"]]
        assert result["state"].keys() == state.keys()
        for key, value in state.items():
            assert_close(result["state"][key], value, **tol, msg=key)


def _steps(name: str, model: nn.Module, opt: torch.optim.Optimizer, loader: object, skip: int, take: int) -> None:
    for i, batch in enumerate(loader):
        if skip <= i < skip + take:
            opt.zero_grad()
            _loss(name, model, batch).backward()
            opt.step()


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2)


def _save_and_resume(pp: int, mp: int, folder: str) -> dict:
    """2 steps under pp, a checkpoint, a copy; then a one-process checkpoint resumed under pp, 1 step more."""
    model, loader = autodist.parallelize(_model("gpt"), _loader("gpt"), pp=pp, mp=mp, microbatches=2)
    opt = _adamw(model)
    _steps("gpt", model, opt, loader, 0, 2)
    autodist.save(os.path.join(folder, f"pp{pp}-mp{mp}.pt"), model, opt, step=2)
    dense = copy.deepcopy(model)  # the whole model, an ordinary module
    try:
        pickle.dumps(model)
        pickled = "pickled"
    except RuntimeError as err:
        pickled = str(err)
    autodist.load(os.path.join(folder, "one.pt"), model, opt)  # written by one process after 2 steps
    _steps("gpt", model, opt, loader, 2, 1)
    return {"copy": {k: v.clone() for k, v in dense.state_dict().items()}, "copy_type": type(dense).__name__,
            "pickled": pickled, "resumed": autodist.gather_state_dict(model, all_ranks=True)}


@pytest.mark.slow
def test_checkpoints_are_dense_at_any_layout(ranks, tmp_path):
    reference = _model("gpt")
    opt = _adamw(reference)
    _steps("gpt", reference, opt, _loader("gpt"), 0, 2)
    autodist.save(str(tmp_path / "one.pt"), reference, opt, step=2)
    after_two = _dense(reference)
    _steps("gpt", reference, opt, _loader("gpt"), 2, 1)
    after_three = _dense(reference)
    for size, pp, mp in ((2, 2, 1), (4, 2, 1), (4, 4, 1), (4, 2, 2)):
        results = ranks(size, _save_and_resume, pp, mp, str(tmp_path))
        for result in results:
            assert result["copy_type"] == "GPT"
            for key, value in after_two.items():
                assert_close(result["copy"][key], value, rtol=1e-10, atol=1e-12, msg=key)
                assert_close(result["resumed"][key], after_three[key], rtol=1e-10, atol=1e-12, msg=key)
            assert "pickling a model" in result["pickled"]
        # the checkpoint written under pp, loaded by one process, goes on as the one process does
        plain = _model("gpt")
        plain_opt = _adamw(plain)
        assert autodist.load(str(tmp_path / f"pp{pp}-mp{mp}.pt"), plain, plain_opt) == {"step": 2}
        _steps("gpt", plain, plain_opt, _loader("gpt"), 2, 1)
        for key, value in after_three.items():
            assert_close(plain.state_dict()[key], value, rtol=1e-10, atol=1e-12, msg=key)


class Shared(nn.Module):
    """ALBERT's habit: one layer called twice in a forward, which no cut into stages can hold."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in (0, 1, 2, 3, 3):
            x = self.layers[i](x)
        return x


def _refusals() -> dict[str, str]:
    said = {}
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 4))
    cases = {
        "odd pp": lambda: autodist.parallelize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), pp=3),
        "no blocks": lambda: autodist.parallelize(SeqFirst().head, pp=2),
        "pp above the blocks": lambda: autodist.parallelize(Shared(), pp=2, blocks=["layers.0"]),
        "stages do not add up": lambda: autodist.parallelize(Shared(), pp=2, stages=[2, 1]),
        "stages out of order": lambda: autodist.parallelize(Shared(), pp=2, stages=[["layers.2"], ["layers.0"]]),
        "stages without pp": lambda: autodist.parallelize(Shared(), stages=[2, 2]),
        "shard parameters": lambda: autodist.parallelize(Shared(), data, pp=2, shard="parameters"),
        "local sgd": lambda: autodist.parallelize(Shared(), data, pp=2, sync=autodist.LocalSGD(every=2)),
        "no microbatches": lambda: autodist.parallelize(Shared(), data, pp=2, microbatches=0),
    }
    for name, case in cases.items():
        try:
            case()
            said[name] = "no error"
        except (ValueError, TypeError) as err:
            said[name] = f"{type(err).__name__}: {err}"
    return said


def test_bad_cuts_are_clear_errors(ranks):
    expected = {
        "odd pp": "pp=3 does not divide the 2 ranks",
        "no blocks": "autodist found no blocks in Linear",
        "pp above the blocks": "pp=2 stages need at least 2 blocks, and Shared has 1",
        "stages do not add up": "stages=[2, 1] deals out 3 blocks, and Shared has 4",
        "stages out of order": "in the order the forward calls them",
        "stages without pp": "they need pp > 1",
        "shard parameters": "with shard='parameters' is not built",
        "local sgd": "is not built with pipeline stages",
        "no microbatches": "microbatches must be a positive int",
    }
    for said in ranks(2, _refusals):
        for name, phrase in expected.items():
            assert said[name].startswith("ValueError") and phrase in said[name], (name, said[name])


def _evaluated_between_steps() -> dict:
    """Validation with and without no_grad between training steps: the same outputs, and training unchanged."""
    model, loader = autodist.parallelize(_model("gpt"), _loader("gpt"), pp=2, microbatches=2)
    opt = _adamw(model)
    x, y = next(iter(_loader("gpt")))
    seen = {}
    for i, batch in enumerate(loader):
        if i == 1:
            model.eval()
            with torch.no_grad():
                seen["no_grad"] = model(x, y)[1].clone()
            seen["with_grad"] = model(x, y)[1].detach().clone()  # a validation loop that forgot no_grad
            model.train()
        opt.zero_grad()
        _loss("gpt", model, batch).backward()
        opt.step()
    state = _dense(model)
    model.float()  # a dtype change after parallelize: each stage's entries come as they are there
    return {"seen": seen, "state": state, "dtypes": {v.dtype for v in model.state_dict().values()}}


def test_validation_between_steps(ranks):
    reference = _model("gpt")
    opt = _adamw(reference)
    seen = {}
    x, y = next(iter(_loader("gpt")))
    for i, batch in enumerate(_loader("gpt")):
        if i == 1:
            reference.eval()
            with torch.no_grad():
                seen = reference(x, y)[1]
            reference.train()
        opt.zero_grad()
        _loss("gpt", reference, batch).backward()
        opt.step()
    for result in ranks(2, _evaluated_between_steps):
        assert_close(result["seen"]["no_grad"], seen, rtol=1e-10, atol=1e-12)
        assert_close(result["seen"]["with_grad"], seen, rtol=1e-10, atol=1e-12)
        for key, value in reference.state_dict().items():
            assert_close(result["state"][key], value, rtol=1e-10, atol=1e-12, msg=key)
        assert result["dtypes"] == {torch.float32}


def test_explain_shows_the_stages():
    model = _model("gpt")
    idx = torch.randint(0, 64, (2, 16))
    cut = autodist.explain(model, pp=2, example=(idx,))
    text = str(cut)
    assert text.startswith("pp=2: 4 blocks in 2 stages, balanced by the time and bytes measured per block")
    # where the measured cut falls depends on this machine's timings (a loaded machine moves it); what each stage
    # sends does not: 16 positions x 32 float64 features
    assert "sends 4,096 bytes a sample to stage 1" in text
    assert cut.stage_names(0) + cut.stage_names(1) == [f"transformer.h.{i}" for i in range(4)]
    assert all(cut.stage_names(s) for s in (0, 1)), text
    by_bytes = autodist.explain(model, pp=2)  # no sample: the parameters' bytes alone decide, the same anywhere
    assert str(by_bytes).splitlines()[1].startswith("stage 0: 2 blocks (transformer.h.0 .. transformer.h.1)")
    assert by_bytes.stage_names(1) == ["transformer.h.2", "transformer.h.3"]
    assert str(autodist.explain(model, pp=2, stages=[3, 1])).splitlines()[1].startswith(
        "stage 0: 3 blocks (transformer.h.0 .. transformer.h.2)")
    both = str(autodist.explain(model, pp=2, mp=2, example=(idx,)))  # the measured cut again: anywhere in 1..3
    assert "mp=2:" in both and "stage 1: " in both and "transformer.h.3)" in both
    with pytest.raises(ValueError, match="need at least 5 blocks"):
        autodist.explain(model, pp=5)


def test_the_balance_takes_the_fullest_stage():
    from autodist.pp.cut import balance

    assert balance([1.0] * 4, [1] * 4, 2) == [0, 2, 4]
    assert balance([3.0, 1.0, 1.0, 1.0], [0] * 4, 2) == [0, 1, 4]  # by time alone
    assert balance([3.0, 1.0, 1.0, 1.0], [1] * 4, 2) == [0, 2, 4]  # 67% of the time beats 75% of the bytes
    assert balance([1.0] * 4, [0] * 4, 2, tail=2.0) == [0, 3, 4]  # the head's time goes to the last stage
    assert balance([1.0, 1.0, 1.0, 1.0], [5, 1, 1, 1], 2) == [0, 1, 4]  # memory counts as much as time


@contextlib.contextmanager
def _logged():
    """The lines autodist logs in the block."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("autodist")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def _held_and_refused() -> dict:
    """How many micro-batches each schedule holds at once, and 1F1B's refusals of a loss it cannot honour."""
    from autodist.pp.pipeline import pipeline_of

    said = {}
    x, y = next(iter(_loader("gpt")))
    for schedule, options in (("gpipe", {}), ("1f1b", {"loss_fn": LOSS_FNS["gpt"]})):
        model, _ = autodist.parallelize(_model("gpt"), pp=2, microbatches=4, **options)
        loss = _loss("gpt", model, (x, y), in_forward=schedule == "1f1b")
        said[schedule] = pipeline_of(model).peak
        if schedule == "1f1b":  # a second forward before the first's backward: the first's gradients are left
            with _logged() as lines:
                _loss("gpt", model, (x, y), in_forward=True)
            said["unfinished"] = lines
        try:
            (loss * 0.5).backward()
            said[f"{schedule} scaled"] = "no error"
        except ValueError as err:
            said[f"{schedule} scaled"] = str(err)
    return said


def test_1f1b_holds_fewer_micro_batches_and_refuses_a_scaled_loss(ranks):
    for rank, said in enumerate(ranks(2, _held_and_refused)):
        assert any("its loss.backward() never came" in line for line in said["unfinished"]), said["unfinished"]
        assert said["gpipe"] == 4  # every micro-batch's activations until backward
        assert said["1f1b"] == 2 - rank  # stage s of K holds K - s
        assert said["gpipe scaled"] == "no error"
        assert "with a gradient of 0.5" in said["1f1b scaled"] and "scale the loss inside loss_fn" in said["1f1b scaled"]


def test_in_one_process_the_loss_fn_script_runs_unchanged():
    model, _ = autodist.parallelize(_model("seq"), pp=2, loss_fn=F.cross_entropy, batch_dim=1)
    x, y = next(iter(_loader("seq")))
    assert_close(model(x.t(), target=y), F.cross_entropy(_model("seq")(x.t()), y))


def _accumulate(model: nn.Module, batches: list, in_window: object) -> None:
    """SGD over windows of 2 batches, the first backward of each inside ``in_window`` (no_sync)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(0, len(batches) - 1, 2):
        opt.zero_grad()
        with in_window(model):
            _loss("gpt", model, batches[i]).backward()
        _loss("gpt", model, batches[i + 1]).backward()
        opt.step()


def _accumulated(pp: int) -> dict[str, torch.Tensor]:
    loader = DataLoader(_loader("gpt").dataset, batch_size=4)  # 6 batches, the last of 1
    model, shard = autodist.parallelize(_model("gpt"), loader, pp=pp, microbatches=2)
    _accumulate(model, list(shard), autodist.no_sync)
    return _dense(model)


def test_gradient_accumulation_with_no_sync(ranks):
    """The root's gradients are summed over the stages once a backward, only what that backward added."""
    reference = _model("gpt")
    _accumulate(reference, list(DataLoader(_loader("gpt").dataset, batch_size=4)), lambda _: contextlib.nullcontext())
    for size in (2, 4):
        for state in ranks(size, _accumulated, 2):
            for key, value in reference.state_dict().items():
                assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=key)


def _short_last_batch(one_f_one_b: bool) -> dict[str, torch.Tensor]:
    loader = DataLoader(_loader("gpt").dataset, batch_size=4)  # 6 batches, the last of 1: one replica holds none
    options = {"loss_fn": LOSS_FNS["gpt"]} if one_f_one_b else {}
    model, shard = autodist.parallelize(_model("gpt"), loader, pp=2, **options)
    _train("gpt", model, shard, in_forward=one_f_one_b)
    return _dense(model)


@pytest.mark.slow
@pytest.mark.parametrize("one_f_one_b", [False, True], ids=["gpipe", "1f1b"])
def test_a_replica_left_with_no_row_of_the_last_batch(ranks, one_f_one_b):
    """dp 2 x pp 2, a last batch of 1 row: the other replica's stand-in row adds nothing. Under 1F1B its
    micro-batches' backwards run in the forward with a weight of 0 (they ran with its row's weight, and the loss's
    zero gradient then failed the step)."""
    reference = _model("gpt")
    _train("gpt", reference, DataLoader(_loader("gpt").dataset, batch_size=4))
    for state in ranks(4, _short_last_batch, one_f_one_b):
        for key, value in reference.state_dict().items():
            assert_close(state[key], value, rtol=1e-10, atol=1e-10, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("case, says", [
    ("residual", "RuntimeError: add on the output of blocks.0, a block pipeline stage 0 runs: the model's own "
                 "code uses it outside the chain of blocks"),
    ("decoder", "RuntimeError: layer_norm on the output of encoder.1, a block pipeline stage 0 runs: the model's own "
                "code uses it outside the chain of blocks"),
    ("hidden-states", "ValueError: output_hidden_states=True asks for every block's outputs, and under pp=2 each "
                      "stage runs only its own blocks"),
])
def test_a_model_whose_own_code_uses_what_another_stage_holds_fails_by_name(case, says):
    """Never a wrong number: only the output of the block before a stage's first reaches it."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "refused_forward.py")
    proc = subprocess.run([sys.executable, "-m", "autodist", "run", "-n", "2", script, case], capture_output=True,
                          text=True, timeout=120)
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert proc.returncode == 1 and says in last, proc.stdout + proc.stderr


def _token_warnings() -> dict:
    """Hugging Face's GPT-2 under dp=2 x pp=2 with loss_fn (1F1B), one step on labels as they are (each row has
    15 valid tokens: its labels shifted by one) and on labels where the batch's second half ignores 3 more: each
    replica takes a half, so its micro-batches have as many valid tokens a sample as each other (15 on one
    replica, 12 on the other) and only the replicas together differ."""
    said = {}
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (8, 16), generator=g)
    for case in ("as they are", "replicas differ"):
        rows = []
        for i, row in enumerate(ids):
            labels = row.clone()
            if case == "replicas differ" and i >= 4:
                labels[:4] = -100  # the first label is never a target (shifted out): 3 fewer valid tokens
            rows.append({"input_ids": row, "labels": labels})
        model, loader = autodist.parallelize(_model("hf"), DataLoader(rows, batch_size=8), pp=2, microbatches=2,
                                             loss_fn=LOSS_FNS["hf"])
        with _logged() as lines:
            for batch in loader:
                _loss("hf", model, batch, in_forward=True).backward()
        said[case] = [line for line in lines if "valid tokens" in line]
    return said


@pytest.mark.slow
def test_1f1b_says_when_weighting_by_samples_is_not_the_mean_over_tokens(ranks):
    said = ranks(4, _token_warnings)
    assert not any(s["as they are"] for s in said), said  # as many valid tokens a sample everywhere: exact, silent
    told = [line for s in said for line in s["replicas differ"]]
    assert told and all("from 12 to 15 over this step's micro-batches and replicas" in line for line in told), said
