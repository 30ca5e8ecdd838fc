"""Losses that couple a batch's samples train as one process does: token means over masked labels.

A cross-entropy over labels with ignored positions (-100: a prompt, padding) is a mean over the valid tokens,
which differ per rank; autodist reads what the loss divides by from its graph and weights each rank by it
(autodist/dp/loss_reading.py). Compared with one process on the same global batches, float64, every
parameter at the float floor: the user's ``F.cross_entropy(..., ignore_index=-100)``, a hand-written masked
mean, Hugging Face GPT-2's own loss (its shift included), and gradient accumulation over an uneven window.
69 samples in shuffled batches of 8 make an uneven last batch.

Hugging Face computes its loss in float32 whatever the model's dtype (``logits.float()``), so one process
and any split of its batch differ there by float32 rounding (1e-8 a step, 5e-7 after 18 Adam steps). Its
floor is the split done in one process: each rank's rows' loss weighted by its valid tokens over the batch's,
which the parallel run must equal at 1e-10, and one process within 1e-6.
"""
from __future__ import annotations

import logging
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

import autodist
from autodist.dp.handover import slice_bounds
from alike import train_in_windows
from workloads import float64, seeded

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH, SAMPLES = 48, 12, 69


def _sft_data() -> TensorDataset:
    """Token sequences whose first 1..8 positions are a prompt (label -100), as a fine-tuning set has."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=g)
    prompt = torch.randint(1, 9, (SAMPLES,), generator=g)
    labels = torch.where(torch.arange(LENGTH)[None, :] < prompt[:, None], -100, ids)
    return TensorDataset(ids, labels)


def _loader(batch: int = 8) -> DataLoader:
    return DataLoader(_sft_data(), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(2))


def _one_at_a_time() -> DataLoader:
    """One sequence a step (the long-sequence case: a global batch of 1), 10 steps."""
    return DataLoader(torch.utils.data.Subset(_sft_data(), range(10)), batch_size=1)


def _gpt2(layers: int = 1) -> nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=LENGTH,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      hidden_size=16, intermediate_size=32, vocab_size=VOCAB,
                                      max_position_embeddings=LENGTH)
    return transformers.LlamaForCausalLM(config)


def _mixtral(coefficient: float = 0.02) -> nn.Module:
    """4 experts, top-2, its load-balancing loss added to the loss at ``coefficient`` (eager experts: float64)."""
    config = transformers.MixtralConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        hidden_size=16, intermediate_size=32, vocab_size=VOCAB,
                                        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                        router_aux_loss_coef=coefficient, max_position_embeddings=LENGTH,
                                        attn_implementation="eager", experts_implementation="eager")
    return transformers.MixtralForCausalLM(config)


def _t5() -> nn.Module:
    config = transformers.T5Config(num_layers=1, num_decoder_layers=1, num_heads=2, d_model=16, d_kv=8, d_ff=32,
                                   vocab_size=VOCAB, decoder_start_token_id=0, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(config)


def _token_classifier() -> nn.Module:
    config = transformers.BertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=16,
                                     intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=LENGTH,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=VOCAB)
    return transformers.BertForTokenClassification(config)


def _moe(family: str) -> Callable[[], nn.Module]:
    """Qwen2-MoE or OLMoE, 4 experts, top-2, their load-balancing loss at 0.02 (eager experts: float64)."""
    def build() -> nn.Module:
        common = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                      vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                      router_aux_loss_coef=0.02, max_position_embeddings=LENGTH, attn_implementation="eager",
                      experts_implementation="eager")
        if family == "qwen2_moe":
            config = transformers.Qwen2MoeConfig(intermediate_size=32, moe_intermediate_size=16,
                                                 shared_expert_intermediate_size=16, **common)
            return transformers.Qwen2MoeForCausalLM(config)
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(intermediate_size=16, **common))
    return build


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


class LossInside(TinyLM):
    """Its forward computes the loss (a mean over the labels not at -100), as nanoGPT's does."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(ids).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def valid_labels(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``samples=``: what LossInside's mean is over."""
    return (labels != -100).sum()


def _hf_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=labels).loss


def _ignore_index(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100) / 2


def _masked_mean(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    mask = (labels != -100).double()
    each = F.cross_entropy(model(ids).transpose(1, 2), labels.clamp(min=0), reduction="none")
    return (each * mask).sum() / mask.sum()


def _inside(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(ids, labels)


LOSSES = {"inside": (LossInside, _inside), "hf": (_gpt2, _hf_loss), "ignore_index": (TinyLM, _ignore_index), "masked_mean": (TinyLM, _masked_mean),
          "llama": (_llama, _hf_loss), "mixtral": (_mixtral, _hf_loss),
          "mixtral_control": (lambda: _mixtral(0.0), _hf_loss), "hf2": (lambda: _gpt2(2), _hf_loss),
          "t5": (_t5, _hf_loss), "token_classification": (_token_classifier, _hf_loss),
          "qwen2_moe": (_moe("qwen2_moe"), _hf_loss), "olmoe": (_moe("olmoe"), _hf_loss)}
HF = ("hf", "llama", "hf2", "t5", "token_classification")
UNSHIFTED = ("t5", "token_classification")  # a label for every position, not the next token's


def _split(loss_of, world: int, shift: int = 1):
    """``loss_of``'s backward as the ranks compute it, in one process: each rank's rows' gradient (of the very
    loss that rank computes) weighted by its share of the batch's valid labels (``shift`` 1: a causal language
    model predicts the next token), added in float64 as the sync adds them."""
    def backward(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, divide: int) -> None:
        bounds = [slice_bounds(len(ids), r, world) for r in range(world)]
        valid = [int((labels[lo:hi, shift:] != -100).sum()) for lo, hi in bounds]
        params = [p for p in model.parameters() if p.requires_grad]
        for (lo, hi), n in zip(bounds, valid):
            if n:
                grads = torch.autograd.grad(loss_of(model, ids[lo:hi], labels[lo:hi]) / divide, params,
                                            allow_unused=True)
                for p, g in zip(params, grads):
                    if g is not None:
                        p.grad = g * (n / sum(valid)) if p.grad is None else p.grad + g * (n / sum(valid))
    return backward


def _whole(loss_of):
    def backward(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, divide: int) -> None:
        (loss_of(model, ids, labels) / divide).backward()
    return backward


def _train(model: nn.Module, loader, backward, epochs: int = 2, accumulate: int = 1) -> dict[str, torch.Tensor]:
    train_in_windows(model, loader, lambda m, batch, window: backward(m, *batch, window), epochs, accumulate)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@float64
def _largest_differences(name: str, accumulate: int, world: int, data=_loader, options: dict | None = None
                         ) -> tuple[float, float]:
    """(from one process, from one process's split of each batch into the ``world`` ranks' parts: a Hugging Face
    loss's float32 floor; for the others one process itself)."""
    build, loss_of = LOSSES[name]
    reference = _train(seeded(build, 0), data(), _whole(loss_of), accumulate=accumulate)
    split = _train(seeded(build, 0), data(), _split(loss_of, world, 0 if name in UNSHIFTED else 1),
                   accumulate=accumulate) if name in HF else reference
    model, loader = autodist.parallelize(seeded(build, 0), data(), **(options or {}))
    _train(model, loader, _whole(loss_of), accumulate=accumulate)
    trained = autodist.gather_state_dict(model, all_ranks=True)  # whole where mp splits the layers
    return _difference(trained, reference), _difference(trained, split)


def _check(name: str, differences: list[tuple[float, float]]) -> None:
    for one_process, split in differences:
        assert split <= 1e-10, f"{name}: {split:.3g} from the split floor"
        assert one_process <= (1e-6 if name in HF else 1e-10), f"{name}: {one_process:.3g} from one process"


@pytest.mark.parametrize("name", ["hf", "ignore_index", "masked_mean"])
def test_token_means_train_as_one_process(ranks, name):
    _check(name, ranks(2, _largest_differences, name, 1, 2))


@pytest.mark.parametrize("name", ["t5", "token_classification"])
def test_hugging_faces_other_token_losses(ranks, name):
    """Seq2seq (T5: labels for the decoder) and token classification (BERT): means over the labels not at -100."""
    _check(name, ranks(2, _largest_differences, name, 1, 2))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf", "ignore_index", "masked_mean"])
def test_token_means_at_three_ranks(ranks, name):
    _check(name, ranks(3, _largest_differences, name, 1, 3))


@pytest.mark.parametrize("options", [{"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"},
                                     {"sync": "manual"}], ids=str)
def test_token_means_at_every_shard_level(ranks, options):
    _check("hf", ranks(2, _largest_differences, "hf", 1, 2, _loader, options))


@pytest.mark.slow
def test_token_means_with_model_parallelism(ranks):
    """mp=2 on 4 ranks: 2 data-parallel ranks, each of 2 model-parallel ones holding half of every layer."""
    _check("hf", ranks(4, _largest_differences, "hf", 1, 2, _loader, {"mp": 2}))


def test_token_means_through_pipeline_stages(ranks):
    """pp=2 (GPipe): Hugging Face's loss, computed per micro-batch in the model, is merged weighted by each
    micro-batch's tokens (0.19 from one process by samples); its own float32 rounding per micro-batch is the
    floor here."""
    for one_process, _ in ranks(2, _largest_differences, "hf2", 1, 1, _loader, {"pp": 2}):
        assert one_process <= 1e-5, f"{one_process:.3g} from one process"


@pytest.mark.slow
def test_token_means_through_pipeline_stages_and_data_parallel_ranks(ranks):
    """pp=2 x dp=2: the last stage's tokens weight each replica in the sync of every stage (0.15 by samples)."""
    for one_process, _ in ranks(4, _largest_differences, "hf2", 1, 2, _loader, {"pp": 2}):
        assert one_process <= 1e-5, f"{one_process:.3g} from one process"


@pytest.mark.parametrize("name", ["hf", "ignore_index"])
def test_token_means_accumulated_over_an_uneven_window(ranks, name):
    """3 micro-batches a step: 9 steps over 2 epochs of 9 batches, the window holding the short one uneven."""
    _check(name, ranks(2, _largest_differences, name, 3, 2))


@pytest.mark.parametrize("accumulate", [1, 3])
def test_samples_counting_tokens_weights_each_micro_batch(ranks, accumulate):
    """samples=fn counting the valid labels, with and without accumulation: each micro-batch of a window is
    weighted by its own count over the ranks' (before: the counts pooled over the window, 8.8e-3 off)."""
    _check("inside", ranks(2, _largest_differences, "inside", accumulate, 2, _loader, {"samples": valid_labels}))


# -- mixture of experts: the load-balancing loss --------------------------------------------------------------

@float64
def _balanced(options: dict) -> tuple[float, float]:
    """(Mixtral with its load-balancing loss, the same at coefficient 0: the float floor of a routed model),
    each the largest difference from one process."""
    return (_largest_differences("mixtral", 1, 0, _loader, options)[0],
            _largest_differences("mixtral_control", 1, 0, _loader, options)[0])


@pytest.mark.slow
def test_the_load_balancing_loss_at_three_ranks(ranks):
    for balanced, control in ranks(3, _balanced, {}):
        assert balanced <= 10 * max(control, 1e-12), f"{balanced:.3g} from one process (control {control:.3g})"


@float64
def _other_family(name: str) -> tuple[float, float]:
    """(the MoE family with its load-balancing loss, Mixtral at coefficient 0 for the float floor)."""
    return (_largest_differences(name, 1, 0, _loader)[0],
            _largest_differences("mixtral_control", 1, 0, _loader)[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe"])
def test_other_moe_families_balance_over_the_global_batch(ranks, name):
    for balanced, control in ranks(2, _other_family, name):
        assert balanced <= 10 * max(control, 1e-12), f"{name}: {balanced:.3g} from one process ({control:.3g})"


@pytest.mark.parametrize("options", [{}, {"shard": "parameters"}], ids=["dp", "shard=parameters"])
def test_the_load_balancing_loss_takes_the_global_batchs_routing(ranks, options):
    for balanced, control in ranks(2, _balanced, options):
        assert balanced <= 10 * max(control, 1e-12), f"{balanced:.3g} from one process (control {control:.3g})"


# -- a rank with no rows ---------------------------------------------------------------------------------------

def test_one_sequence_over_two_ranks_trains_as_one_process(ranks):
    """A global batch of 1: rank 1 runs a stand-in row (the batch's own), weighted zero, every step."""
    _check("llama", ranks(2, _largest_differences, "llama", 1, 2, _one_at_a_time))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "ignore_index"])
def test_a_last_batch_smaller_than_the_world_trains_as_one_process(ranks, name):
    """6 ranks, the last global batch of each epoch holds 5 rows: rank 5 holds none of it."""
    _check(name, ranks(6, _largest_differences, name, 1, 6))


class _Passing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _watch_lifecycle() -> tuple[list[int], list[str]]:
    """The stack depth after each part of a step, and the warnings of a step under another mode."""
    model, loader = autodist.parallelize(seeded(TinyLM, 0), _loader())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, labels = next(iter(loader))
    depths = []
    logits = model(ids)
    depths.append(torch._C._len_torch_function_stack())  # the watch, waiting for the loss
    F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    optimizer.step()
    depths.append(torch._C._len_torch_function_stack())  # gone before the step
    model(ids)
    with torch.no_grad():
        model(ids)  # the next forward takes it off, inference too
    depths.append(torch._C._len_torch_function_stack())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("autodist").addHandler(handler)
    try:
        with _Passing():
            F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1)).backward()
            depths.append(torch._C._len_torch_function_stack())  # the user's mode alone
    finally:
        logging.getLogger("autodist").removeHandler(handler)
    return depths, [r.getMessage() for r in records]


def test_the_watch_is_on_the_stack_only_between_forward_and_loss(ranks):
    for depths, warnings in ranks(2, _watch_lifecycle):
        assert depths == [1, 0, 0, 1]
        assert any("did not see this backward's loss" in w and "_Passing" in w for w in warnings), warnings


# -- in-batch negatives ----------------------------------------------------------------------------------------

class TwoTowers(nn.Module):
    """CLIP's shape: an image tower and a text tower, each to a normalized embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(6, 8), nn.Embedding(VOCAB, 8)

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.image(pixels), dim=-1), F.normalize(self.text(ids).mean(1), dim=-1)


def _pairs() -> DataLoader:
    g = torch.Generator().manual_seed(6)
    data = TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randint(0, VOCAB, (SAMPLES, 5), generator=g))
    return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))


def _clip_loss(image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    logits = image @ text.T / 0.1
    labels = torch.arange(len(image))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _own_rows_loss(image: torch.Tensor, text: torch.Tensor, all_image: torch.Tensor, all_text: torch.Tensor,
                   first: int) -> torch.Tensor:
    """open_clip's local loss: this rank's rows against every column."""
    labels = torch.arange(first, first + len(image))
    return (F.cross_entropy(image @ all_text.T / 0.1, labels) + F.cross_entropy(text @ all_image.T / 0.1, labels)) / 2


def _train_towers(model: nn.Module, loader, how: str) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        for pixels, ids in loader:
            optimizer.zero_grad()
            image, text = model(pixels, ids)
            if how == "whole":
                loss = _clip_loss(autodist.whole_batch(image), autodist.whole_batch(text))
            elif how == "own_rows":
                all_image, all_text = autodist.whole_batch(image), autodist.whole_batch(text)
                first = sum(int(n) for n in _rows_before(len(image)))
                loss = _own_rows_loss(image, text, all_image, all_text, first)
            else:
                loss = _clip_loss(image, text)
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rows_before(mine: int) -> list[int]:
    """The rows the ranks before this one hold (all_gather of the counts)."""
    import torch.distributed as dist
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor([mine]))
    return every[:dist.get_rank()]


@float64
def _negatives(how: str) -> float:
    import gc

    reference = _train_towers(seeded(TwoTowers, 0), _pairs(), "one")
    collecting = gc.isenabled()
    gc.disable()  # what the collector would find later, it does not find early here
    try:
        if how == "whole-beside-a-dropped-model":  # a model dropped but alive in a reference cycle, uncollected:
            dropped, _ = autodist.parallelize(seeded(TwoTowers, 0), _pairs())  # not one whole_batch may mean
            dropped.__dict__["itself"] = dropped
            del dropped
            how = "whole"
        model, loader = autodist.parallelize(seeded(TwoTowers, 0), _pairs())
        return _difference(_train_towers(model, loader, how), reference)
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("how", ["whole", "own_rows", "without", "whole-beside-a-dropped-model"])
def test_in_batch_negatives_over_the_whole_batch(ranks, how):
    for difference in ranks(2, _negatives, how):
        if how == "without":  # each rank's negatives its own rows: the test can tell
            assert difference > 1e-3, f"{difference:.3g}"
        else:
            assert difference <= 1e-10, f"{how}: {difference:.3g} from one process"


def _zero_share() -> list[str]:
    """Rank 0's own rows' loss counts nothing (every label -100) while rank 1's scores its rows as negatives."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("autodist").addHandler(handler)
    try:
        model, loader = autodist.parallelize(seeded(TwoTowers, 0), _pairs())
        pixels, ids = next(iter(loader))
        image, text = model(pixels, ids)
        all_text = autodist.whole_batch(text)
        first = sum(int(n) for n in _rows_before(len(image)))
        labels = torch.arange(first, first + len(image)) if first else torch.full((len(image),), -100)
        F.cross_entropy(image @ all_text.T / 0.1, labels).backward()
    finally:
        logging.getLogger("autodist").removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_a_rank_whose_loss_counts_nothing_says_its_rows_negatives_are_lost(ranks):
    """The sync weights a rank by its share of the loss: at 0, the gradient its rows take as the other ranks'
    negatives cannot be carried, and is named rather than dropped silently."""
    zero, counted = ranks(2, _zero_share)
    assert any("whole_batch" in m and "left out" in m for m in zero), zero
    assert not any("whole_batch" in m for m in counted), counted


@pytest.mark.slow
def test_in_batch_negatives_at_three_ranks(ranks):
    for difference in ranks(3, _negatives, "whole"):
        assert difference <= 1e-10, f"{difference:.3g} from one process"


# -- float32 ---------------------------------------------------------------------------------------------------

def _in_float32() -> tuple[float, float]:
    """float32, the user's ignore_index loss: (autodist, weighting by samples), each the largest difference from
    one process's split of every batch into the ranks' parts (the float32 split floor)."""
    build, loss_of = LOSSES["ignore_index"]
    split = _train(seeded(build, 0), _loader(), _split(loss_of, 2, 0))
    model, loader = autodist.parallelize(seeded(build, 0), _loader())
    _train(model, loader, _whole(loss_of))
    by_samples, loader = autodist.parallelize(seeded(build, 0), _loader(), samples=lambda ids: len(ids))
    _train(by_samples, loader, _whole(loss_of))
    return _difference(model.state_dict(), split), _difference(by_samples.state_dict(), split)


def test_token_means_in_float32_at_the_split_floor(ranks):
    for exact, by_samples in ranks(2, _in_float32):
        assert exact <= 1e-5 and by_samples > 1e-3, (exact, by_samples)


@pytest.mark.slow
def test_in_batch_negatives_with_a_stand_in_row(ranks):
    """6 ranks, the last batch of 5: rank 5's stand-in row is no negative of anyone's."""
    for difference in ranks(6, _negatives, "whole"):
        assert difference <= 1e-10, f"{difference:.3g} from one process"
