"""Context parallelism with model parallelism: ``parallelize(model, loader, cp=2, mp=2)`` on 4 ranks, each
sequence's tokens split over the 2 ranks of a context-parallel group, each of them holding its model-parallel
rank's heads (the model-parallel ranks consecutive, the context-parallel ones next, then the data-parallel
replicas). Against one process in float64 after 20 AdamW steps, every weight within 1e-10: nanoGPT, Hugging
Face's Llama with left-padded batches (one kv head a rank, repeated by the model itself) and Qwen2's attention
written by hand, packed documents with ``shard="parameters"`` and ``checkpoint=True``, and dp 2 x cp 2 x mp 2 on
8 ranks; ``explain(cp=2, mp=2)`` counts the bytes a rank puts into the context-parallel exchange (its heads);
a checkpoint saved mid-epoch at cp 2 x mp 2 (and at cp 2 x pp 2) resumes in one process."""
from __future__ import annotations

import pytest
import torch
from test_context_parallel import (ATOL, _against_one_process, _data, _gpt, _hugging_face, _resumed, _save_mid_epoch,
                                   _train, _train_outside, _uninterrupted)
from test_explain_context import counting
from test_masks import _packed, _padded, _train_hf
from torch.utils.data import DataLoader

from autodist.runtime.mesh import ParallelDims, context_ranks


def test_the_ranks_of_a_context_parallel_group_hold_the_same_model_parallel_slice():
    dims = ParallelDims.for_world(8, mp=2)  # dp 2 x cp 2 x mp 2
    assert [context_ranks(dims, 2, r) for r in range(8)] == [[0, 2], [1, 3], [0, 2], [1, 3],
                                                             [4, 6], [5, 7], [4, 6], [5, 7]]
    assert context_ranks(ParallelDims.for_world(4), 2, 3) == [2, 3]  # without mp: consecutive ranks


def _largest_difference(case: str) -> float:
    if case == "nanogpt":
        return _against_one_process(_gpt(13), _data(13, 2, "prompt"), 2, _train, cp=2, mp=2)
    if case == "llama, padded":
        return _against_one_process(_hugging_face("llama"), _padded(13, 2, "left"), 2, _train_hf, cp=2, mp=2)
    if case == "qwen2 by hand, padded":
        return _against_one_process(_hugging_face("qwen2", "eager"), _padded(13, 2, "middle"), 2, _train_hf,
                                    cp=2, mp=2)
    if case == "llama, packed, sharded, recomputed":
        return _against_one_process(_hugging_face("llama"), _packed(13, 2), 2, _train_hf, cp=2, mp=2,
                                    shard="parameters", checkpoint=True)
    assert case == "qwen2, dp 2"
    return _against_one_process(_hugging_face("qwen2"), _data(11, 4, "prompt"), 4, _train_outside, cp=2, mp=2)


@pytest.mark.parametrize("case, world", [
    ("nanogpt", 4),
    pytest.param("llama, padded", 4, marks=pytest.mark.slow),
    pytest.param("qwen2 by hand, padded", 4, marks=pytest.mark.slow),
    pytest.param("llama, packed, sharded, recomputed", 4, marks=pytest.mark.slow),
    pytest.param("qwen2, dp 2", 8, marks=pytest.mark.slow),
])
def test_cp_with_mp_trains_as_one_process(ranks, case, world):
    differences = ranks(world, _largest_difference, case)
    assert max(differences) <= ATOL, differences


def _counted_step() -> tuple[list[int], list[int], list[int], list[int], str]:
    """One cp=2 x mp=2 training step of Llama: the bytes this rank put into the attention's all-gathers and
    all-reduces over its context-parallel group, beside what explain counts."""
    import autodist

    data = _data(11, 2, "all")
    x = data.tensors[0][:2]
    plan = autodist.explain(_hugging_face("llama"), cp=2, mp=2, example={"input_ids": x})
    model, loader = autodist.parallelize(_hugging_face("llama"), DataLoader(data, batch_size=2), cp=2, mp=2)
    with counting() as (gathered, reduced):
        x, y = next(iter(loader))
        _train_outside_step(model, x, y)
    split = plan.split
    expected_gathers = [c.contribution(split) for c in plan.calls] + \
        [c.contribution(split) for c in reversed(plan.calls) if c.again]
    return gathered, expected_gathers, reduced, [c.whole(split) for c in reversed(plan.calls)], str(plan)


def _train_outside_step(model, x, y) -> None:
    logits = model(input_ids=x).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()


@pytest.mark.slow
def test_explain_counts_each_ranks_heads(ranks):
    for gathered, expected_gathers, reduced, expected_reduced, shown in ranks(4, _counted_step):
        assert sorted(gathered) == sorted(expected_gathers) and len(gathered) == len(expected_gathers), \
            (gathered, expected_gathers)
        assert reduced == expected_reduced, (reduced, expected_reduced)
        assert "each with mp=2 ranks of its own holding its heads" in shown and "| 1 head x" in shown, shown


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(mp=2), dict(pp=2)])
def test_a_checkpoint_saved_at_cp2_with_mp_or_pp_resumes_in_one_process(ranks, tmp_path, layout):
    """Saved after 7 of 20 steps at cp 2 x mp 2 (or cp 2 x pp 2) on 4 ranks, dense; resumed in one process, it
    ends the epoch where the uninterrupted one-process run does."""
    path = str(tmp_path / "cp2.pt")
    ranks(4, _save_mid_epoch, path, layout.get("mp", 1), layout.get("pp", 1))
    state, expected = _resumed(path, 1), _uninterrupted()
    assert max((p - expected[n]).abs().max().item() for n, p in state.items()) <= ATOL
