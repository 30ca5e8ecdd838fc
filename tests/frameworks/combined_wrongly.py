"""Run under ``autodist run -n 2``: each way of combining autodist with another data-parallel wrapper or
framework wrongly, one after another; prints one ``RESULT {json}`` line per case and rank (the error raised,
or none). tests/frameworks/test_combined_wrongly.py reads them."""
from __future__ import annotations

import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import autodist


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def train(model: nn.Module, loader: object) -> None:
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()


def ddp_before() -> None:
    autodist.parallelize(nn.parallel.DistributedDataParallel(mlp()))


def ddp_after() -> None:
    model, loader = autodist.parallelize(mlp(), DataLoader(data(), batch_size=8))
    train(nn.parallel.DistributedDataParallel(model), loader)


def fsdp_before() -> None:
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    fully_shard(model)
    autodist.parallelize(model)


def fsdp_after() -> None:
    from torch.distributed.fsdp import fully_shard
    model, loader = autodist.parallelize(mlp(), DataLoader(data(), batch_size=8))
    fully_shard(model)
    train(model, loader)


def sampler_over_dataset() -> None:
    _, shard = autodist.parallelize(mlp(), data())
    DistributedSampler(shard)


def accelerate_loader() -> None:
    from accelerate import Accelerator
    model, loader = autodist.parallelize(mlp(), DataLoader(data(), batch_size=8, shuffle=True))
    train(model, Accelerator(cpu=True).prepare(loader))


def accelerate_model() -> None:
    from accelerate import Accelerator
    model, loader = autodist.parallelize(mlp(), DataLoader(data(), batch_size=8, shuffle=True))
    train(Accelerator(cpu=True).prepare(model), loader)


class _Tokens(Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))


def _hf_train(model: nn.Module, dataset: Dataset, out: str) -> None:
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(out, per_device_train_batch_size=4, num_train_epochs=1, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=dataset).train()


def hf_trainer_data(out: str) -> None:
    model, shard = autodist.parallelize(_gpt2(), _Tokens())
    _hf_train(model, shard, out)


def hf_trainer_model(out: str) -> None:
    model, _ = autodist.parallelize(_gpt2())
    _hf_train(model, _Tokens(), out)


def _lightning(where: str, devices: int, strategy: str) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()
            if where == "init":
                self.net, _ = autodist.parallelize(self.net)

        def setup(self, stage: str) -> None:
            if where == "setup":
                self.net, _ = autodist.parallelize(self.net)

        def training_step(self, batch: list, index: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(Module(), DataLoader(data(), batch_size=8))


def lightning_one_device_setup() -> None:
    _lightning("setup", 1, "auto")


def lightning_ddp_setup() -> None:
    _lightning("setup", 2, "ddp")


def lightning_ddp_init() -> None:
    _lightning("init", 2, "ddp")


def rank_skips_a_batch(**options: str) -> None:
    model, loader = autodist.parallelize(mlp(), DataLoader(data(), batch_size=8, shuffle=True), **options)
    batches = iter(loader)
    if autodist.rank() == 1:
        next(batches)
    train(model, [next(batches)])


def rank_skips_a_batch_with_sharded_gradients() -> None:
    """The mark rides in the reduce-scattered buckets too (their count and flags are staged apart)."""
    rank_skips_a_batch(shard="gradients")


def sampler_seeded_per_rank() -> None:
    order = torch.Generator().manual_seed(autodist.rank())
    model, loader = autodist.parallelize(mlp(), DataLoader(data(), batch_size=8, shuffle=True, generator=order))
    train(model, loader)


def uneven_and_empty_slices() -> None:
    """The control: 17 samples in global batches of 8, the last one's single sample on rank 0 alone."""
    model, loader = autodist.parallelize(mlp(), DataLoader(data(17), batch_size=8, shuffle=True))
    for _ in range(2):
        train(model, loader)


CASES = [ddp_before, ddp_after, fsdp_before, fsdp_after, sampler_over_dataset, accelerate_loader, accelerate_model,
         hf_trainer_data, hf_trainer_model, lightning_one_device_setup, lightning_ddp_setup, lightning_ddp_init,
         rank_skips_a_batch, rank_skips_a_batch_with_sharded_gradients, sampler_seeded_per_rank,
         uneven_and_empty_slices]


def main(out: str) -> None:
    autodist.init()
    for case in CASES:
        try:
            case(out) if case.__name__.startswith("hf_") else case()
            error = None
        except Exception as e:  # noqa: BLE001 - the error is the result
            error = [type(e).__name__, str(e)]
        print("RESULT " + json.dumps({"case": case.__name__, "rank": autodist.rank(), "error": error}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
