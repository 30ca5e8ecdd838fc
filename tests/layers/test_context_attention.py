"""Context-parallel attention (autodist.layers.context) on 2, 3 and 4 real ranks against one process's
``F.scaled_dot_product_attention`` over the whole sequence, in float64 at its floor: this rank's output rows and
the gradients of this rank's q, k and v, for causal, bidirectional, padded, packed-document and sliding-window
masks, at prime lengths and at lengths under 2 x ranks (a rank holding one token, or none). The reference masks
are written here from their definitions, not with the module's own mask."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autodist.layers.context import SequenceSplit, context_attention

ATOL = 1e-10
B, H, D = 2, 3, 4


def _inputs(length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(length)
    q, k, v, grad = (torch.randn(B, H, length, D, generator=g, dtype=torch.float64) for _ in range(4))
    valid = torch.tensor([length, max(1, length - 3)])  # the second sequence right-padded: 3 pad tokens
    padding = torch.arange(length)[None, :] < valid[:, None]
    documents = torch.stack([torch.arange(length) // 5, torch.arange(length) // 3])  # packed documents of 5 and 3
    return q, k, v, grad, padding, documents


def _reference_mask(length: int, mask: str, padding: torch.Tensor, documents: torch.Tensor) -> torch.Tensor | None:
    """One process's mask, (B, 1, S, S) or (S, S), True where a query attends to a key."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    causal = j <= i
    if mask == "causal":
        return causal
    if mask == "none":
        return None
    if mask == "padding":
        return causal[None, None] & padding[:, None, None, :]
    if mask == "documents":
        return causal[None, None] & (documents[:, :, None] == documents[:, None, :])[:, None]
    if mask == "window":
        return causal & (j > i - 4)
    raise AssertionError(mask)


def _options(mask: str, padding: torch.Tensor, documents: torch.Tensor) -> dict:
    return {"causal": mask != "none", "key_padding": padding if mask == "padding" else None,
            "documents": documents if mask == "documents" else None, "window": 4 if mask == "window" else None}


def _compare(length: int, mask: str, groups: int = 1) -> dict[str, float]:
    """On each rank: this rank's rows and gradients against one process's, as the largest differences; with
    ``groups`` query heads to each key head (grouped-query attention)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, grad, padding, documents = _inputs(length)
    if groups > 1:  # the query heads (and the output's) groups times the keys'
        g = torch.Generator().manual_seed(groups)
        q, grad = (torch.randn(B, H * groups, length, D, generator=g, dtype=torch.float64) for _ in range(2))
    split = SequenceSplit(length, size)

    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, attn_mask=_reference_mask(length, mask, padding, documents),
                                              enable_gqa=groups > 1)
    (expected * grad).sum().backward()

    mine = [split.split(t, rank, dim=-2).requires_grad_() for t in (q, k, v)]
    out = context_attention(*mine, split=split, enable_gqa=groups > 1, **_options(mask, padding, documents))
    (out * split.split(grad, rank, dim=-2)).sum().backward()

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().amax()) if a.numel() else 0.0  # NaN where one is (a row with no key)

    errors = {"out": gap(out, split.split(expected, rank, dim=-2))}
    for name, local, ref in zip("qkv", mine, whole):
        errors[f"d{name}"] = gap(local.grad, split.split(ref.grad, rank, dim=-2))
    errors["tokens"] = out.shape[-2]
    return errors


@pytest.mark.parametrize("size, length, mask", [
    (2, 13, "causal"), (2, 13, "none"), (2, 13, "padding"), (2, 13, "documents"), (2, 13, "window"),
    (3, 31, "causal"), (3, 31, "documents"), (4, 31, "padding"), (4, 31, "window"),
    (2, 3, "causal"),  # chunks of 1, 1, 1, 0
    (4, 5, "causal"),  # chunks of 1, 1, 1, 1, 1, 0, 0, 0: every rank holds one or two tokens
    (2, 1, "causal"),  # rank 1 holds no token
])
def test_each_rank_computes_one_process_attention_for_its_tokens(ranks, size, length, mask):
    _each_rank_as_one_process(ranks(size, _compare, length, mask), size, length)


@pytest.mark.parametrize("size, length, mask", [
    (2, 13, "causal"), pytest.param(3, 17, "padding", marks=pytest.mark.slow),
    pytest.param(2, 5, "documents", marks=pytest.mark.slow)])
def test_grouped_query_attention_exchanges_the_key_heads_and_computes_one_process_attention(ranks, size, length,
                                                                                            mask):
    """Two query heads to each key head (enable_gqa=True), on the mask-free causal path and the masked one."""
    _each_rank_as_one_process(ranks(size, _compare, length, mask, 2), size, length)


def _each_rank_as_one_process(results: list[dict], size: int, length: int) -> None:
    split = SequenceSplit(length, size)
    assert [r["tokens"] for r in results] == split.sizes
    for rank, errors in enumerate(results):
        for what in ("out", "dq", "dk", "dv"):
            assert errors[what] <= ATOL, (rank, what, errors)


def test_zigzag_balances_causal_work():
    """Each rank holds an early and a late chunk: the causal query-key pairs it computes are within 5% of the
    mean at lengths that are not multiples of 2 x ranks (one contiguous block per rank: 1.75x at 4 ranks)."""
    for parts in (2, 3, 4, 8):
        for length in (2047, 4096, 8191, 32771):
            split = SequenceSplit(length, parts)
            work = [split.work(r) for r in range(parts)]
            assert max(work) / (sum(work) / parts) <= 1.05, (parts, length, work)
            assert sorted(torch.cat([split.positions(r) for r in range(parts)]).tolist()) == list(range(length))
    blocks = [(r + 1) * 2 - 1 for r in range(4)]  # contiguous quarters' causal work, in quarter-blocks squared / 2
    assert max(blocks) / (sum(blocks) / 4) == 1.75


def test_a_split_that_does_not_match_the_tokens_is_named():
    split = SequenceSplit(10, 1)
    with pytest.raises(ValueError, match="rank 0 holds 10 tokens of the 10-token sequence, but q has 4"):
        context_attention(*(torch.randn(1, 1, 4, 2) for _ in range(3)), split=split)
    with pytest.raises(ValueError, match="the sequence is split over 2 ranks but the group has 1"):
        context_attention(*(torch.randn(1, 1, 5, 2) for _ in range(3)), split=SequenceSplit(10, 2))
    with pytest.raises(ValueError, match="expected the whole sequence"):
        split.split(torch.randn(1, 4, 2), 0, dim=1)
