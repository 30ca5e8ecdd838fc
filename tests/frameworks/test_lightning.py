"""Lightning's Trainer with autodist.lightning.AutodistStrategy trains as one process does (float64, an uneven
last batch), syncs gradients once a step, keeps accumulation local, knows its ranks, and writes dense checkpoints
that load at any world size."""
from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

lightning = pytest.importorskip("lightning")

SAMPLES, BATCH = 21, 8  # global batches of 8, 8, 5: the last one splits 3 / 2 over two ranks
TIGHT = dict(rtol=1e-9, atol=1e-12)  # float64: only the order of the sums differs from one process


class MLP(lightning.LightningModule):
    """A tiny float64 regression; the step calls the module itself (its forward), the usual Lightning way."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # every sample of the epoch counted once over the ranks: the data is sharded, and reduce sums over them
        self.log("samples", float(len(x)), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        return F.mse_loss(self.outputs(x), y)

    def outputs(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def validation_step(self, batch, batch_idx):
        self.log("val_samples", float(len(batch[0])), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoForward(MLP):
    """Its training step calls the layers itself (no forward): counted all the same; mp has nothing to follow."""

    forward = lightning.LightningModule.forward

    def outputs(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Copying(MLP):
    """Its batches reach the step as copies (new memory, as on a GPU), after Lightning fetched the next one: the
    strategy tells autodist which global batch a copy is part of."""

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return [t.clone() for t in batch]


def _loader(shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64),
                         torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64))
    return DataLoader(data, batch_size=BATCH, shuffle=shuffle, generator=torch.Generator().manual_seed(1))


class _VaryingBatches:
    """Global batches of 8, 5 and 8 samples (the middle one splits 3 / 2), and no len(): Lightning then fetches
    each batch before the step of the one before."""

    def __iter__(self):
        order = list(range(SAMPLES))
        return iter([order[:8], order[8:13], order[13:]])


def _varying_loader() -> DataLoader:
    return DataLoader(_loader().dataset, batch_sampler=_VaryingBatches())


def _reference(optimizer: str = "sgd", epochs: int = 2, accumulate: int = 1, shuffle: bool = True,
               varying: bool = False) -> dict:
    """One process, plain torch, as Lightning trains: the loss divided by accumulate, a step every accumulate
    batches and at the last batch of each epoch."""
    module, loader = MLP(optimizer), _varying_loader() if varying else _loader(shuffle)
    opt = module.configure_optimizers()
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            (F.mse_loss(module(x), y) / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(loader):
                opt.step()
                opt.zero_grad()
    return {k: v.clone() for k, v in module.state_dict().items()}


def _state(module: nn.Module) -> dict:
    """The dense weights of a module trained on the ranks (model-parallel shards gathered)."""
    import autodist

    return {k: v.clone() for k, v in autodist.gather_state_dict(module, all_ranks=True).items()}


def _trainer(strategy, **options) -> "lightning.Trainer":
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banner lines from every rank
    warnings.filterwarnings("ignore", module="lightning")
    defaults = dict(devices=2, accelerator="cpu", max_epochs=2, enable_progress_bar=False, logger=False,
                    enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    return lightning.Trainer(strategy=strategy, **{**defaults, **options})


def _counting_syncs() -> tuple[list[int], list[int], Callable[[], None]]:
    """Count gradient syncs (GradSync.flush) and backwards through the model on this rank; returns a restore."""
    from autodist.dp import grad_sync

    flushes, backwards = [0], [0]
    flush, end = grad_sync.GradSync.flush, grad_sync.GradSync._end_of_backward

    def counted_flush(self):
        flushes[0] += 1
        return flush(self)

    def counted_end(self):
        backwards[0] += 1
        return end(self)

    grad_sync.GradSync.flush, grad_sync.GradSync._end_of_backward = counted_flush, counted_end

    def restore():
        grad_sync.GradSync.flush, grad_sync.GradSync._end_of_backward = flush, end
    return flushes, backwards, restore


def _fit(options: dict, optimizer: str = "sgd", accumulate: int = 1, kind: str = "MLP") -> dict:
    from autodist.lightning import AutodistStrategy

    flushes, backwards, restore = _counting_syncs()
    try:
        module = {"MLP": MLP, "NoForward": NoForward, "Copying": Copying}[kind](optimizer)
        trainer = _trainer(AutodistStrategy(**options), accumulate_grad_batches=accumulate)
        trainer.fit(module, _varying_loader() if kind == "Copying" else _loader())
        steps, samples = trainer.global_step, float(trainer.callback_metrics["samples"])
    finally:
        restore()
    validated = trainer.validate(module, _loader(shuffle=False), verbose=False)  # a second setup: the same layout
    from autodist.runtime import provenance
    return {"reference": _reference(optimizer, accumulate=accumulate, varying=kind == "Copying"),
            "parallel": _state(module),
            "steps": steps, "syncs": flushes[0], "backwards": backwards[0], "samples": samples,
            "val_samples": validated[0]["val_samples"], "wrapped": type(trainer.strategy.model).__name__,
            "layers": [type(layer).__name__ for layer in module.net],
            "current_after": provenance.current()}  # a later loop's forwards must not count by Lightning's batch


def _assert_trained_as_one_process(results: list[dict]) -> None:
    for r in results:
        assert_close(r["parallel"], r["reference"], **TIGHT)
    assert_close(results[1]["parallel"], results[0]["parallel"], rtol=0, atol=0)  # the same model on every rank


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["MLP", "Copying"])
def test_data_parallel_fit_is_one_process_and_syncs_once_a_step(ranks, kind):
    results = ranks(2, _fit, {}, "sgd", 1, kind)
    _assert_trained_as_one_process(results)
    assert [r["steps"] for r in results] == [6, 6]  # 3 global batches an epoch, on every rank
    assert [r["syncs"] for r in results] == [6, 6]  # one gradient sync a step: autodist's, no DDP reducer
    assert [r["wrapped"] for r in results] == [kind, kind]  # nothing wraps the module
    assert [r["samples"] for r in results] == [SAMPLES, SAMPLES]  # each sample once an epoch, over the ranks
    assert [r["val_samples"] for r in results] == [SAMPLES, SAMPLES]  # and once in validation
    assert [r["current_after"] for r in results] == [None, None]  # no batch left current after the Trainer


@pytest.mark.parametrize("kind, accumulate, steps", [("MLP", 2, 4), ("NoForward", 3, 2)])
def test_accumulated_batches_sync_only_at_the_step(ranks, kind, accumulate, steps):
    # 2: batches 2 and 3 of each epoch step. 3: one window of 8, 8 and 5 samples, which the ranks hold 4, 4 and
    # 3 (2) of; a step calling its layers itself (NoForward) is counted too, through the module's __call__.
    results = ranks(2, _fit, {}, "sgd", accumulate, kind)
    _assert_trained_as_one_process(results)
    assert [r["steps"] for r in results] == [steps, steps]
    assert [r["backwards"] for r in results] == [6, 6]
    assert [r["syncs"] for r in results] == [steps, steps]  # the window's other batches send nothing


@pytest.mark.parametrize("options", [{"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"},
                                     {"mp": 2}], ids=["shard-optimizer", "shard-gradients", "shard-parameters", "mp2"])
def test_sharded_and_model_parallel_fit_is_one_process(ranks, options):
    results = ranks(2, _fit, options, "adam")
    _assert_trained_as_one_process(results)
    assert [r["steps"] for r in results] == [6, 6]
    split = ["ColumnParallelLinear", "MPTanh", "RowParallelLinear"]  # fx traced the LightningModule's forward
    assert [r["layers"] for r in results] == [split if options.get("mp") else ["Linear", "Tanh", "Linear"]] * 2
    assert [r["samples"] for r in results] == [SAMPLES, SAMPLES]  # mp=2: summed over the data-parallel ranks


def _refused(run: Callable[[], object]) -> str:
    try:
        run()
    except ValueError as err:
        return str(err)
    return ""


def _ranks(directory: str) -> dict:
    import autodist
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities import rank_zero_only

    from autodist.lightning import AutodistStrategy

    refused = _refused(lambda: _trainer(AutodistStrategy(), devices=1))
    no_forward = _refused(lambda: _trainer(AutodistStrategy(mp=2)).fit(NoForward(), _loader()))
    trainer = _trainer(AutodistStrategy(), max_epochs=1, logger=CSVLogger(directory, name="logs"))
    trainer.fit(MLP(), _loader())
    ran = []
    rank_zero_only(lambda: ran.append(True))()
    return {"rank": autodist.rank(), "global_rank": trainer.global_rank, "world_size": trainer.world_size,
            "local_rank": trainer.local_rank, "node_rank": trainer.node_rank, "zero": trainer.is_global_zero,
            "rank_zero_only_ran": bool(ran), "broadcast": trainer.strategy.broadcast(f"from {autodist.rank()}"),
            "refused": refused, "no_forward": no_forward}


def test_ranks_are_the_launchers_for_logging_and_rank_zero_only(ranks, tmp_path):
    results = ranks(2, _ranks, str(tmp_path))
    logged = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.csv"))
    assert logged == ["logs/version_0/metrics.csv"]  # rank 0 alone logs
    assert f"{float(SAMPLES)}" in (tmp_path / logged[0]).read_text()  # the epoch's samples, summed over the ranks
    for rank, r in enumerate(results):
        assert (r["global_rank"], r["world_size"], r["local_rank"], r["node_rank"]) == (rank, 2, rank, 0)
        assert r["zero"] is r["rank_zero_only_ran"] is (rank == 0)
        assert r["broadcast"] == "from 0"
        assert "devices=2" in r["refused"]  # Trainer(devices=1) under a 2-rank launch says what to pass
        assert "define forward(self, x)" in r["no_forward"]


def _checkpoints(options: dict, directory: str) -> dict:
    import autodist
    from autodist.lightning import AutodistStrategy

    module = MLP("adam")  # 1 epoch here, saved by Lightning on 2 ranks
    trainer = _trainer(AutodistStrategy(**options), max_epochs=1)
    trainer.fit(module, _loader(shuffle=False))
    trainer.save_checkpoint(f"{directory}/two.ckpt")
    resumed = MLP("adam")  # the 1-process checkpoint resumed here, for the second epoch
    _trainer(AutodistStrategy(**options)).fit(resumed, _loader(shuffle=False), ckpt_path=f"{directory}/one.ckpt")
    with torch.no_grad(), autodist.full_parameters(module):  # the module laid out already, loading into its shards
        for p in module.parameters():
            p.zero_()
    _trainer(AutodistStrategy(**options)).fit(module, _loader(shuffle=False), ckpt_path=f"{directory}/one.ckpt")
    return {"resumed": _state(resumed), "reloaded": _state(module)}


@pytest.mark.parametrize("options", [{"shard": "optimizer"}, {"shard": "parameters"}, {"mp": 2}],
                         ids=["shard-optimizer", "shard-parameters", "mp2"])
def test_checkpoints_are_dense_and_resume_at_any_world_size(ranks, tmp_path, options):
    one_epoch, two_epochs = (_reference("adam", epochs, shuffle=False) for epochs in (1, 2))
    plain = dict(devices=1, accelerator="cpu", enable_progress_bar=False, logger=False, enable_model_summary=False,
                 enable_checkpointing=False)
    first = lightning.Trainer(max_epochs=1, **plain)  # one process, no autodist: the checkpoint 2 ranks resume
    first.fit(MLP("adam"), _loader(shuffle=False))
    first.save_checkpoint(tmp_path / "one.ckpt")

    results = ranks(2, _checkpoints, options, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.ckpt", "two.ckpt"]  # rank 0 wrote one file
    saved = torch.load(tmp_path / "two.ckpt", weights_only=False)
    dense = MLP("adam")
    assert {k: v.shape for k, v in saved["state_dict"].items()} == {k: v.shape for k, v in dense.state_dict().items()}
    assert [s["exp_avg"].shape for s in saved["optimizer_states"][0]["state"].values()] == \
        [p.shape for p in dense.parameters()]
    assert_close(MLP.load_from_checkpoint(tmp_path / "two.ckpt").state_dict(), one_epoch, **TIGHT)

    continued = MLP("adam")  # the 2-rank checkpoint resumed in one process, without autodist
    lightning.Trainer(max_epochs=2, **plain).fit(continued, _loader(shuffle=False), ckpt_path=tmp_path / "two.ckpt")
    assert_close(continued.state_dict(), two_epochs, **TIGHT)
    for r in results:
        assert_close(r["resumed"], two_epochs, **TIGHT)
        assert_close(r["reloaded"], two_epochs, **TIGHT)


@pytest.mark.slow
def test_import_autodist_leaves_lightning_out_and_a_missing_lightning_says_what_to_install():
    script = ("import sys, autodist\n"
              "assert 'lightning' not in sys.modules, 'import autodist imported lightning'\n"
              "sys.modules['lightning'] = None  # as if not installed\n"
              "try:\n"
              "    import autodist.lightning\n"
              "except ImportError as err:\n"
              "    print(err)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install autodist[lightning]" in out.stdout


def test_an_unknown_option_is_refused_naming_parallelizes_own():
    from autodist.lightning import AutodistStrategy

    with pytest.raises(TypeError, match="bucket_mb"):
        AutodistStrategy(bucket_size=4)


class MaskedLM(lightning.LightningModule):
    """A token-level loss over labels with ignored positions (-100): a mean over each batch's valid tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(20, 8).double(), nn.Linear(8, 20).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return F.cross_entropy(self(ids).reshape(-1, 20), labels.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _masked_loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 20, (SAMPLES, 6), generator=g)
    labels = torch.where(torch.rand(SAMPLES, 6, generator=g) < 0.4, -100, ids)
    return DataLoader(TensorDataset(ids, labels), batch_size=BATCH, shuffle=True,
                      generator=torch.Generator().manual_seed(1))


def _fit_masked() -> tuple[dict, dict]:
    from autodist.lightning import AutodistStrategy

    reference, loader = MaskedLM(), _masked_loader()
    opt = reference.configure_optimizers()
    for _ in range(2):
        for batch in loader:
            reference.training_step(batch, 0).backward()
            opt.step()
            opt.zero_grad()
    module = MaskedLM()
    _trainer(AutodistStrategy()).fit(module, _masked_loader())
    return {k: v.clone() for k, v in reference.state_dict().items()}, _state(module)


def test_a_mean_over_valid_tokens_trains_as_one_process(ranks):
    """Lightning calls loss.backward() on training_step's loss: autodist reads its valid tokens there."""
    for reference, parallel in ranks(2, _fit_masked):
        assert_close(parallel, reference, **TIGHT)
