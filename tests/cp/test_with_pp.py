"""Context parallelism with pipeline parallelism: ``parallelize(model, loader, cp=2, pp=2)`` on 4 ranks, each
stage's blocks on 2 ranks that share its sequences (the world dp x pp x cp x mp: ranks 0 and 2 stage 0's
two halves of each sequence, 1 and 3 stage 1's), every micro-batch of GPipe's schedule routed with its own
rows' padding and documents (and a block recomputed in backward with its micro-batch's). Against one process in
float64 after 20 AdamW steps, every weight within 1e-10: nanoGPT, Llama left-padded with
``shard="optimizer"``, ``checkpoint=True`` and ``clip_grad_norm_`` in the loop, Qwen2's attention written by hand,
packed documents, the model's own gradient checkpointing of padded micro-batches, and pp 2 x cp 2 x mp 2 on 8
ranks. pp's 1F1B (``loss_fn=``) is refused, named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_context_parallel import ATOL, _against_one_process, _data, _gpt, _hugging_face, _train
from test_explain_context import counting
from test_masks import _packed, _padded, _train_hf
from torch import nn
from torch.utils.data import DataLoader


def _train_clipped(model: nn.Module, loader: DataLoader) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in loader:
        opt.zero_grad()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()


def _largest_difference(case: str) -> float:
    if case == "nanogpt":
        return _against_one_process(_gpt(13), _data(13, 4, "prompt"), 4, _train, cp=2, pp=2)
    if case == "nanogpt, two blocks a stage":  # a stage runs stubs of the other's blocks, one into the next
        return _against_one_process(_gpt(13, layers=4), _data(13, 4, "prompt"), 4, _train, cp=2, pp=2)
    if case == "llama, padded, sharded, recomputed, clipped":
        return _against_one_process(_hugging_face("llama"), _padded(13, 4, "left"), 4, _train_clipped, cp=2, pp=2,
                                    shard="optimizer", checkpoint=True)
    if case == "qwen2 by hand, padded":
        return _against_one_process(_hugging_face("qwen2", "eager"), _padded(13, 4, "middle"), 4, _train_hf, cp=2,
                                    pp=2)
    if case == "llama, packed":
        return _against_one_process(_hugging_face("llama"), _packed(13, 4), 4, _train_hf, cp=2, pp=2)
    assert case == "llama, padded, mp 2"
    return _against_one_process(_hugging_face("llama"), _padded(13, 4, "left"), 4, _train_hf, cp=2, pp=2, mp=2)


@pytest.mark.parametrize("case, world", [
    ("nanogpt", 4),
    ("nanogpt, two blocks a stage", 4),
    pytest.param("llama, padded, sharded, recomputed, clipped", 4, marks=pytest.mark.slow),
    pytest.param("qwen2 by hand, padded", 4, marks=pytest.mark.slow),
    pytest.param("llama, packed", 4, marks=pytest.mark.slow),
    pytest.param("llama, padded, mp 2", 8, marks=pytest.mark.slow),
])
def test_cp_with_pp_trains_as_one_process(ranks, case, world):
    differences = ranks(world, _largest_difference, case)
    assert max(differences) <= ATOL, differences


def test_1f1b_is_refused():
    import autodist

    loader = DataLoader(_data(13, 4, "all"), batch_size=4)
    with pytest.raises(NotImplementedError, match="loss_fn= \\(the loss inside the model.s forward; under pp, 1F1B"):
        autodist.parallelize(_gpt(13), loader, cp=2, pp=2, loss_fn=lambda out: out[1])


def _own_checkpointing(reentrant: bool) -> float:
    model = _hugging_face("llama")  # one process recomputes its layers too
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    return _against_one_process(model, _padded(13, 4, "left"), 4, _train_hf, cp=2, pp=2)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_the_models_own_checkpointing_recomputes_each_micro_batch_with_its_padding(ranks, reentrant):
    """Hugging Face's gradient_checkpointing_enable(): each layer run again in backward, by autograd, for each
    micro-batch, is masked with its micro-batch's padding, found by the layer's input."""
    differences = ranks(4, _own_checkpointing, reentrant)
    assert max(differences) <= ATOL, differences


def _counted_step() -> tuple[int, int, int, int]:
    """One cp=2 x pp=2 training step of Llama (4 micro-batches): the bytes this rank put into the attention's
    all-gathers and all-reduces, summed, beside what explain counts for its stage."""
    import autodist

    data = _data(11, 4, "all")
    model = _hugging_face("llama")
    plan = autodist.explain(model, cp=2, pp=2, example={"input_ids": data.tensors[0][:4]})
    model, loader = autodist.parallelize(model, DataLoader(data, batch_size=4), cp=2, pp=2)
    with counting() as (gathered, reduced):
        x, y = next(iter(loader))
        F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()
    stage = torch.distributed.get_rank() % 2  # ranks 0 and 2: stage 0
    mine = [c for c in plan.calls if plan.stage_of(c) == stage]
    expected = sum(c.contribution(plan.split) * (1 + c.again) for c in mine)
    return sum(gathered), expected, sum(reduced), sum(c.whole(plan.split) for c in mine)


@pytest.mark.slow
def test_explain_counts_each_stages_bytes(ranks):
    """What explain(cp=2, pp=2) says a rank of each stage puts into the context-parallel collectives, over its
    4 micro-batches, is what it puts there."""
    for gathered, expected_gathered, reduced, expected_reduced in ranks(4, _counted_step):
        assert gathered == expected_gathered > 0 and reduced == expected_reduced > 0, \
            (gathered, expected_gathered, reduced, expected_reduced)


def test_explain_shows_each_stages_calls():
    import autodist

    model = _hugging_face("llama")
    example = {"input_ids": _data(11, 2, "all").tensors[0][:2]}
    alone, staged = autodist.explain(model, cp=2, example=example), autodist.explain(model, cp=2, pp=2, example=example)
    assert [staged.stage_of(c) for c in staged.calls] == [0, 1]
    assert staged.sent(0) == staged.sent(1) and staged.sent(0)[0] * 2 == alone.sent()[0]
    assert "stage 1:" in str(staged) and "pp=2: 2 blocks in 2 stages" in str(staged), str(staged)
