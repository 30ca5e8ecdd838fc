"""Padded batches and masks a model builds, under ``cp=K``: Hugging Face's ``attention_mask`` (1 at tokens, 0 at
padding), from which the model builds its mask over this rank's tokens only. The routing reads the whole batch's
padding (every rank of a group holds the batch before it is cut), checks the mask the model built against it, and
attends over the whole sequence with it: Llama and Qwen2, right and left padding, rows of every length (a row all
padding on a rank included), trained 20 AdamW steps in float64 within 1e-10 of one process. (Right padding under a
causal mask changes no token's output, so only the left-padded cases fail where the padding is dropped: checked.) A
model building its own causal mask from its tokens, boolean or additive, trains as one process too; a mask that is
neither causal nor none (nor the layer's sliding window), a bias in a float mask, and padding the model's attention
never takes, are refused with the reason. Sliding windows (Mistral's, Qwen2's per layer) train as one process."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from test_context_parallel import ATOL, STEPS, _against_one_process, _data, _hugging_face, _train_outside
from torch import nn
from torch.utils.data import DataLoader


def _padded(length: int, rows: int, side: str) -> list[dict[str, torch.Tensor]]:
    """Rows of token ids with a random number of real tokens (1 to ``length``), padded on ``side``; labels -100
    at padding."""
    g = torch.Generator().manual_seed(length)
    samples = []
    for _ in range(rows * STEPS):
        real = int(torch.randint(1, length + 1, (), generator=g))
        at = torch.arange(length)
        if side == "middle":  # a hole of padding after two tokens: no query without a token to attend to
            mask = (at < 2) | (at >= 2 + length - real)
        else:
            mask = (at < real) if side == "right" else (at >= length - real)
        ids = torch.where(mask, torch.randint(1, 32, (length,), generator=g), torch.zeros(length, dtype=torch.long))
        labels = torch.where(mask, torch.randint(0, 32, (length,), generator=g), torch.full((length,), -100))
        samples.append({"input_ids": ids, "attention_mask": mask.long(), "labels": labels})
    return samples


def _train_hf(model: nn.Module, loader: DataLoader, copied: bool = False) -> None:
    """Every tensor of the batch but the labels given to the model by name, the loss written in the loop;
    ``copied``: each a copy, as ``batch.to("cuda")`` makes one."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in loader:
        batch = {k: v.clone() for k, v in batch.items()} if copied else batch
        opt.zero_grad()
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
        opt.step()


def _largest_difference(family: str, cp: int, length: int, rows: int, side: str, recompute: str = "",
                        copied: bool = False) -> float:
    model = _hugging_face(family)
    if recompute.startswith("the model's own"):  # one process recomputes its layers too
        model.gradient_checkpointing_enable({"use_reentrant": recompute.endswith("reentrant")})
    return _against_one_process(model, _padded(length, rows, side), rows, functools.partial(_train_hf, copied=copied),
                                cp=cp, checkpoint=recompute == "checkpoint=True")


@pytest.mark.parametrize("family, cp, world, length, rows, side", [
    pytest.param("llama", 2, 2, 13, 3, "right", marks=pytest.mark.slow),
    ("llama", 2, 2, 13, 3, "left"),   # a row's first queries see no real key: one process's output there, zeros
    pytest.param("qwen2", 3, 3, 17, 2, "right", marks=pytest.mark.slow),
    pytest.param("qwen2", 2, 4, 11, 2, "left", marks=pytest.mark.slow),  # dp 2 x cp 2
])
def test_padded_batches_train_as_one_process(ranks, family, cp, world, length, rows, side):
    differences = ranks(world, _largest_difference, family, cp, length, rows, side)
    assert max(differences) <= ATOL, differences


@pytest.mark.slow
def test_a_batch_copied_before_the_forward_is_read_whole_too(ranks):
    """The loop hands the model copies of the batch's tensors (``batch.to("cuda")``): their whole batch is found
    by their values (and names)."""
    differences = ranks(2, _largest_difference, "llama", 2, 13, 3, "left", "", True)
    assert max(differences) <= ATOL, differences


@pytest.mark.parametrize("how", [pytest.param("checkpoint=True", marks=pytest.mark.slow), "the model's own",
                                 pytest.param("the model's own, reentrant", marks=pytest.mark.slow)])
def test_padded_blocks_recomputed_in_backward_keep_the_padding(ranks, how):
    """Each decoder layer runs again in backward, after the model's forward has returned (autodist's
    checkpoint=True, or Hugging Face's gradient_checkpointing_enable(), torch's checkpoint with or without
    reentrance): its attention is routed and masked with the same batch's padding then."""
    differences = ranks(2, _largest_difference, "llama", 2, 13, 3, "left", how)
    assert max(differences) <= ATOL, differences


def _packed(length: int, rows: int) -> list[dict[str, torch.Tensor]]:
    """Rows of documents packed end to end, as Hugging Face's DataCollatorWithFlattening gives them: position ids
    starting again at each document (no attention_mask), the first label of each document -100; some rows one
    document."""
    g = torch.Generator().manual_seed(length + 1)
    samples = []
    for i in range(rows * STEPS):
        cuts = [] if i % 4 == 0 else sorted(torch.randperm(length - 1, generator=g)[:3].add(1).tolist())
        bounds = [0, *cuts, length]
        positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
        labels = torch.randint(0, 32, (length,), generator=g).masked_fill(positions == 0, -100)
        samples.append({"input_ids": torch.randint(0, 32, (length,), generator=g), "position_ids": positions,
                        "labels": labels})
    return samples


def _largest_difference_packed(family: str, cp: int, length: int, rows: int) -> float:
    return _against_one_process(_hugging_face(family), _packed(length, rows), rows, _train_hf, cp=cp)


@pytest.mark.parametrize("family, cp, world, length, rows", [
    ("llama", 2, 2, 13, 2),
    pytest.param("llama", 2, 2, 17, 1, marks=pytest.mark.slow),  # one row a batch
    pytest.param("qwen2", 3, 3, 19, 2, marks=pytest.mark.slow),
])
def test_packed_documents_train_as_one_process(ranks, family, cp, world, length, rows):
    differences = ranks(world, _largest_difference_packed, family, cp, length, rows)
    assert max(differences) <= ATOL, differences


def _buffers_kept() -> tuple[float, int]:
    """What autodist.memory counts as autodist's buffers growing by with a padded batch in hand at cp=2, and the
    bytes of that batch (whole) and of its padding mask."""
    import autodist

    data = _padded(13, 3, "left")
    model, loader = autodist.parallelize(_hugging_face("llama"), DataLoader(data, batch_size=3), cp=2)
    before = autodist.memory(model)["autodist buffers"]
    batch = next(iter(loader))
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    whole = sum(t.numel() * t.element_size() for t in DataLoader(data, batch_size=3).collate_fn(data[:3]).values())
    return autodist.memory(model)["autodist buffers"] - before, whole + 3 * 13  # the mask: a byte a token


def test_memory_counts_the_whole_batch_the_ranks_keep(ranks):
    for grown, expected in ranks(2, _buffers_kept):
        assert grown == expected, (grown, expected)


class _OwnMaskLM(nn.Module):
    """Attention with a mask it builds from its input's length (as older GPT ports do): ``kind`` "causal" (a
    boolean lower triangle), "additive" (0 and -inf), "window" (the 3 latest tokens: not taken under cp), "bias"
    (an additive mask with a slope: not a mask)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.embed, self.qkv, self.head = nn.Embedding(32, 8), nn.Linear(8, 24), nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)  # each (batch, heads, tokens, 4)
        if self.kind == "ignores padding":  # takes attention_mask, and masks nothing with it
            return self.head(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2) + x)
        n = ids.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        if self.kind == "window":
            mask = mask & ~torch.ones(n, n, dtype=torch.bool).tril(-3)
        if self.kind in ("additive", "bias"):
            mask = torch.zeros(n, n, dtype=x.dtype).masked_fill(~mask, float("-inf"))
        if self.kind == "bias":
            mask = mask - 0.1 * torch.ones(n, n, dtype=x.dtype).tril().cumsum(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(out.transpose(1, 2).flatten(2) + x)


def _train_own_mask(model: nn.Module, loader: DataLoader) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, mask, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x, attention_mask=mask).flatten(0, 1), y.flatten()).backward()
        opt.step()


def _own_mask(kind: str, cp: int) -> float | str:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(3 * STEPS, 13, dtype=torch.long)
    if kind == "ignores padding":
        mask[:, 3:5] = 0  # padding among both ranks' tokens of 13 (rank 0: 0-3 and 10-12; rank 1: 4-9)
    data = torch.utils.data.TensorDataset(torch.randint(0, 32, (3 * STEPS, 13), generator=g), mask,
                                          torch.randint(0, 32, (3 * STEPS, 13), generator=g))
    try:
        return _against_one_process(_OwnMaskLM(kind).double(), data, 3, _train_own_mask, cp=cp)
    except NotImplementedError as error:
        return str(error)


@pytest.mark.parametrize("kind", ["causal", pytest.param("additive", marks=pytest.mark.slow)])
def test_a_causal_mask_the_model_builds_trains_as_one_process(ranks, kind):
    differences = ranks(2, _own_mask, kind, 2)
    assert all(isinstance(d, float) and d <= ATOL for d in differences), differences


@pytest.mark.parametrize("kind, says", [
    ("window", "fit no one mask autodist can take over the whole sequence (causal or not, with the batch's padding"),
    pytest.param("bias", "adds values other than 0 and the lowest to the scores", marks=pytest.mark.slow),
    ("ignores padding", "got no mask over this rank's"),
])
def test_a_mask_that_is_not_causal_or_none_is_refused(ranks, kind, says):
    for message in ranks(2, _own_mask, kind, 2):
        assert isinstance(message, str) and says in message, message


def _train_combined(model: nn.Module, loader: DataLoader) -> None:
    """As a fine-tuning script combines them: two micro-batches a step (the first under no_sync), the gradient's
    norm clipped, AdamW."""
    import autodist  # no_sync: nothing for the reference, which is not parallelized

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    batches = iter(loader)
    for first, second in zip(batches, batches):
        opt.zero_grad()
        for batch, context in ((first, autodist.no_sync(model)), (second, contextlib.nullcontext())):
            with context:
                logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
                (F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()


def _largest_difference_combined() -> float:
    model = _hugging_face("qwen2")
    model.gradient_checkpointing_enable({"use_reentrant": False})
    return _against_one_process(model, _padded(11, 4, "left"), 4, _train_combined, cp=2, shard="parameters")


@pytest.mark.slow
def test_padding_sharding_own_checkpointing_accumulation_and_clipping_together(ranks):
    """dp 2 x cp 2 on 4 ranks, left-padded batches, shard="parameters", the model's own gradient checkpointing,
    accumulation over two micro-batches and clipping, in one loop: one process's training."""
    differences = ranks(4, _largest_difference_combined)
    assert max(differences) <= ATOL, differences


def _windowed_model(family: str, window: int, attention: str = "sdpa") -> nn.Module:
    """Mistral (every layer within ``config.sliding_window``) or Qwen2 (its second layer only: ``layer_types``)."""
    import transformers

    torch.manual_seed(0)
    options = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, sliding_window=window,
                   attn_implementation=attention, use_cache=False)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**options))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**options, use_sliding_window=True,
                                                                       max_window_layers=1))
    return model.double()


def _windowed(family: str, window: int, attention: str = "sdpa", padded: bool = False) -> float:
    model = _windowed_model(family, window, attention)
    data, train = (_padded(13, 3, "left"), _train_hf) if padded else (_data(13, 3, "prompt"), _train_outside)
    return _against_one_process(model, data, 3, train, cp=2)


@pytest.mark.parametrize("family, window, attention, padded", [
    ("mistral", 8, "sdpa", False),  # 8: more than a rank holds (6, 7): Hugging Face leaves it out of their masks
    pytest.param("mistral", 4, "sdpa", False, marks=pytest.mark.slow),
    pytest.param("mistral", 16, "sdpa", False, marks=pytest.mark.slow),  # longer than the sequence: never binds
    pytest.param("qwen2", 4, "sdpa", False, marks=pytest.mark.slow),  # a full layer, then a sliding one
    pytest.param("mistral", 5, "sdpa", True, marks=pytest.mark.slow),  # left padding
    pytest.param("mistral", 5, "eager", False, marks=pytest.mark.slow),  # attention written by hand
])
def test_a_sliding_window_trains_as_one_process(ranks, family, window, attention, padded):
    """Each attention layer's sliding window (the layer's own or its config's: the layer says which) bounds its
    attention over the whole sequence, whatever mask Hugging Face built over a rank's tokens (with the window, or,
    where the rank holds fewer tokens than it, without): one process's training. Before, refused where the
    window was shorter than the sequence (at 8, without the refusal, silently wrong: a rank attended past it)."""
    differences = ranks(2, _windowed, family, window, attention, padded)
    assert max(differences) <= ATOL, differences
