"""checkpoint=True: each block's activations recomputed in backward (torch.utils.checkpoint per block). The
training is one process's at every shard= level and with mp=2 (float64, Adam); with dropout the masks are
replayed, so it equals the same run without checkpointing; the blocks run their forward twice a step and
autograd keeps fewer bytes; copies and pickles of the model are plain; bad input is named."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w
from autodist.sharded.recompute import recomputed
from outside.nanogpt import GPT, GPTConfig


class Block(nn.Module):
    calls = 0  # forwards run, over every instance

    def __init__(self, width: int = 12, p: float = 0.0) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + self.drop(self.down(torch.tanh(self.up(x))))


class Net(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(6, 12), nn.Linear(12, 3)
        self.blocks = nn.Sequential(*[Block(12, p) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _train(model: nn.Module, batches, steps: int = 3) -> dict:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _, (x, y) in zip(range(steps), batches):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return w.state(model)


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)[0].sum().backward()
    return total


@w.float64
def _exact(options: dict):
    x, y = w.digits_like(32)
    reference = _train(w.seeded(Net, 0), w.loader(x, y, 8))
    model, loader = autodist.parallelize(w.seeded(Net, 0), w.loader(x, y, 8), checkpoint=True, **options)
    Block.calls = 0
    trained = _train(model, loader)
    if options.get("mp"):  # the split layers' dense weights
        trained = {k: v.clone() for k, v in autodist.gather_state_dict(model, all_ranks=True).items()}
    copied = copy.deepcopy(model)  # the plain model: no block recomputed
    return reference, trained, Block.calls, recomputed(model), recomputed(copied)


@pytest.mark.parametrize("options", [{}, {"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"},
                                     {"mp": 2}], ids=["none", "optimizer", "gradients", "parameters", "mp2"])
def test_checkpointed_blocks_train_as_one_process(ranks, options):
    for reference, trained, calls, names, in_copy in ranks(2, _exact, options):
        assert_close(trained, reference, rtol=1e-10, atol=1e-12)
        assert calls == 3 * 3 * 2  # 3 steps x 3 blocks x (forward + its recomputation in backward)
        assert names == ["blocks.0", "blocks.1", "blocks.2"] and in_copy == []


@w.float64
def _hugging_face_cache(family: str, checkpoint: bool) -> dict:
    """Qwen2 or GPT-2 (its config's use_cache on, as every Hugging Face config has it: the model makes a
    key/value cache in each forward, training too; GPT-2's blocks take it by position) trained 2 steps, its
    blocks recomputed or not."""
    pytest.importorskip("transformers")
    loader = torch.utils.data.DataLoader(w.padded_rows(), batch_size=8)
    model, loader = autodist.parallelize(w.seeded(getattr(w, family), 0), loader, checkpoint=checkpoint)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for batch in loader:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    return w.state(model)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_a_hugging_face_models_cache_is_not_filled_twice(ranks, family):
    """Before: recomputed in backward, each decoder layer appended its keys to the model's cache again and
    attended over both copies (a shape error with an attention mask; GPT-2's too, which passes the cache by
    position). Now the recomputed run is the plain one."""
    for plain, recomputed_run in zip(ranks(2, _hugging_face_cache, family, False),
                                     ranks(2, _hugging_face_cache, family, True)):
        assert max(float((plain[k] - recomputed_run[k]).abs().max()) for k in plain) <= 1e-12


def _dropout_replayed():
    x, y = w.digits_like(32)
    runs = []
    for checkpoint in (False, True):
        torch.manual_seed(5)  # the same random streams for both runs on this rank
        model, loader = autodist.parallelize(w.seeded(lambda: Net(p=0.3), 0), w.loader(x, y, 8),
                                             checkpoint=checkpoint)
        runs.append(_train(model, loader))
    return runs


def test_dropout_masks_are_replayed_in_the_recomputation(ranks):
    for plain, checkpointed in ranks(2, _dropout_replayed):
        assert_close(checkpointed, plain, rtol=0, atol=0)


def test_autograd_keeps_less_in_one_process_and_copies_recompute_alike():
    """Without a launcher too (the option is the user's): nanoGPT keeps fewer bytes for backward, the numbers
    are the same, and a copy or a pickle (of a model parallelize returned as it is) recomputes its own blocks."""
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32, dropout=0.0)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    plain = w.seeded(lambda: GPT(config), 0)
    model, _ = autodist.parallelize(w.seeded(lambda: GPT(config), 0), checkpoint=True)
    assert recomputed(model) == [f"transformer.h.{i}" for i in range(4)]
    kept, kept_plain = _saved_bytes(model, x), _saved_bytes(plain, x)
    print(f"nanoGPT, 4 blocks: autograd keeps {kept} bytes with checkpoint=True, {kept_plain} without")
    assert kept < 0.5 * kept_plain
    assert_close(model(x)[0], plain(x)[0])
    for name, p in model.named_parameters():
        assert_close(p.grad, dict(plain.named_parameters())[name].grad, msg=name)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert recomputed(other) == recomputed(model)
        assert other.transformer.h[0].forward.block is other.transformer.h[0]
        assert_close(other(x)[0], plain(x)[0])


@pytest.mark.parametrize("call, error, words", [
    (lambda: autodist.parallelize(Net(), checkpoint="yes"), TypeError, "checkpoint must be True"),
    (lambda: autodist.parallelize(nn.Linear(3, 3), checkpoint=True), ValueError,
     "autodist found no blocks in Linear"),
    (lambda: autodist.parallelize(Net(), blocks=["blocks.0"]), ValueError, "pass shard='parameters' or checkpoint"),
])
def test_bad_checkpoint_options_are_named(call, error, words):
    with pytest.raises(error, match=words):
        call()
