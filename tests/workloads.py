"""Tiny models and training loops shared by the multi-rank tests (run inside the ranks)."""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def digits_like(n: int = 22, features: int = 6, classes: int = 3, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def mlp(features: int = 6, classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, classes))


class TinyCNN(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).flatten(1))


class TiedLM(nn.Module):
    """Embedding and output layer share one weight."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class SometimesUsed(nn.Module):
    """`extra` only runs for batches holding a sample with x[0] > 1, `never` never runs."""

    def __init__(self, features: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.base = nn.Linear(features, classes)
        self.extra = nn.Linear(features, classes)
        self.never = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        mask = x[:, 0] > 1.0
        if mask.any():
            out = out + self.extra(x) * mask[:, None]
        return out


def seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if name == "adamw":  # decays every parameter that has a grad, even a zero one
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.5)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: nn.Module, loader, opt_name: str, epochs: int, loss_fn=F.cross_entropy) -> nn.Module:
    opt = optimizer(opt_name, model)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    return model


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def update_error(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                 initial: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, how far ``state``'s update (its change from ``initial``) is from ``reference``'s, relative to
    the reference's (L2 norms, in float64): 0 is the same update, 1 no update at all (an untrained tensor, or
    one whose gradient was dropped); a tensor the reference leaves alone counts 0 if ``state`` does too."""
    out = {}
    for name, start in initial.items():
        moved = (reference[name].double() - start.double()).norm().item()
        off = (state[name].double() - reference[name].double()).norm().item()
        out[name] = off / moved if moved else (0.0 if off == 0 else float("inf"))
    return out


def norm_parameters(model: nn.Module) -> set[str]:
    """The names of the parameters held by normalization layers (LayerNorm, RMSNorm, BatchNorm1d, ...)."""
    return {f"{m}.{p}" if m else p for m, module in model.named_modules() if "Norm" in type(module).__name__
            for p, _ in module.named_parameters(recurse=False)}


def loader(x: torch.Tensor, y: torch.Tensor, batch: int, shuffle: bool = True, seed: int = 3, **kw) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(seed), **kw)


def reference_and_parallel(build: Callable[[], nn.Module], make_data: Callable[[], tuple], opt_name: str,
                           epochs: int, **options) -> tuple[dict, dict]:
    """Train once in this process alone and once through parallelize; both final states.

    Rank 0 builds its model from the reference's seed, the others from other
    seeds: parallelize must hand rank 0's weights to everyone.
    """
    ref = train(seeded(build, 0), make_data(), opt_name, epochs)
    model = seeded(build, 0 if rank() == 0 else 100 + rank())
    model, data = autodist.parallelize(model, make_data(), **options)
    return state(ref), state(train(model, data, opt_name, epochs))


def float64(fn: Callable) -> Callable:
    """Run ``fn`` (a rank's test function) with float64 as the default dtype: where Adam would turn rounding
    noise into a difference, the comparison with one process is exact to ~1e-12."""
    @functools.wraps(fn)  # the ranks find it by its name
    def run(*args):
        torch.set_default_dtype(torch.float64)
        try:
            return fn(*args)
        finally:
            torch.set_default_dtype(torch.float32)
    return run


def padded_rows(samples: int = 16, length: int = 12, vocab: int = 50, seed: int = 4) -> list[dict]:
    """Token rows of random lengths padded to ``length``, with an attention mask and labels at -100 on the
    padding, as a Hugging Face SFT collator gives them (a list of dicts: a Dataset, or a stream's items)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for valid in torch.randint(length // 2, length, (samples,), generator=g).tolist():
        ids = torch.randint(0, vocab, (length,), generator=g)
        mask = (torch.arange(length) < valid).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def gpt2(vocab: int = 50, positions: int = 16) -> nn.Module:
    """A tiny Hugging Face GPT-2 (tied embeddings; its blocks take the key/value cache by position;
    ``config.use_cache`` on); the caller skips where transformers is missing."""
    import transformers

    config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=positions)
    return transformers.GPT2LMHeadModel(config)


def qwen2(vocab: int = 50, positions: int = 16, tied: bool = False) -> nn.Module:
    """A tiny Hugging Face Qwen2 (grouped-query attention: 2 key/value heads; ``config.use_cache`` on, as its
    default is); the caller skips where transformers is missing (``pytest.importorskip``)."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                                      tie_word_embeddings=tied)
    return transformers.Qwen2ForCausalLM(config)
