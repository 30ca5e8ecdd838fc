"""``parallelize(model, loader, cp=K)`` against one process, in float64 at its floor: nanoGPT (its own
``F.scaled_dot_product_attention(is_causal=True)`` and ``torch.arange`` positions, untouched) and Hugging Face's
Llama and Qwen2 (rotary embeddings from ``position_ids``, grouped-query attention, ``attn_implementation="sdpa"``)
trained 20 AdamW steps on a loader of (batch, seq) tokens, every weight after them within 1e-10 of one
process's on the same global batches; at cp 2, 3 and 4, dp 2 x cp 2, prime lengths, masked labels (a token-mean
over the valid ones, with a rank holding no valid token) and a length under 2 x cp (a rank holding no token).
And what cp refuses, each with its reason: a shift of the labels inside the model, a padding mask not from the
batch, a layer it cannot split, and the options it is not built with (masks: tests/cp/test_masks.py)."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from outside.nanogpt import GPT, GPTConfig

ATOL = 1e-10
STEPS = 20


def _gpt(length: int, layers: int = 2) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(block_size=max(length, 8), vocab_size=32, n_layer=layers, n_head=2, n_embd=16, dropout=0.0,
                       bias=True)
    return GPT(config).double()


def _data(length: int, rows: int, labels: str) -> TensorDataset:
    """Tokens and their labels: "all" valid; "prompt": a prompt of random length per row first, at -1 (some
    rows all prompt); "head": the first two positions only, so that a rank holding none of them has no valid
    token (its loss is NaN; it still holds keys the others attend to)."""
    g = torch.Generator().manual_seed(length)
    x = torch.randint(0, 32, (rows * STEPS, length), generator=g)
    y = torch.randint(0, 32, (rows * STEPS, length), generator=g)
    if labels == "prompt":
        prompt = torch.randint(0, length + 2, (rows * STEPS, 1), generator=g)
        y = torch.where(torch.arange(length)[None] < prompt, torch.full_like(y, -1), y)
    if labels == "head":
        y[:, 2:] = -1
    return TensorDataset(x, y)


def _train(model: GPT, loader: DataLoader) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in loader:
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _against_one_process(model: nn.Module, data: torch.utils.data.Dataset, rows: int, train, **options) -> float:
    """``train`` run on a copy of ``model`` in this process and on ``model`` parallelized with ``options``, on
    loaders of ``rows`` a batch: the largest difference of their weights after."""
    import autodist

    reference = copy.deepcopy(model)
    train(reference, DataLoader(data, batch_size=rows))
    model, loader = autodist.parallelize(model, DataLoader(data, batch_size=rows), **options)
    train(model, loader)
    state = autodist.gather_state_dict(model, all_ranks=True)  # dense: mp's split layers and sharded ones whole
    return max((state[n] - p).abs().max().item() for n, p in reference.named_parameters())


def _largest_difference(cp: int, length: int, rows: int, labels: str) -> float:
    return _against_one_process(_gpt(length), _data(length, rows, labels), rows, _train, cp=cp)


@pytest.mark.parametrize("cp, world, length, rows, labels", [
    (2, 2, 13, 3, "all"),
    (2, 2, 13, 3, "prompt"),
    (2, 2, 5, 4, "head"),     # rank 1 holds positions 2 and 3: no valid label
    pytest.param(3, 3, 17, 2, "prompt", marks=pytest.mark.slow),
    pytest.param(4, 4, 31, 3, "all", marks=pytest.mark.slow),
    (2, 4, 11, 4, "prompt"),  # dp 2 x cp 2: each data-parallel rank's 2 rows, split in tokens
    (2, 2, 3, 3, "all"),      # chunks of 1, 1, 1, 0 tokens: rank 0 holds 1, rank 1 holds 2
])
def test_nanogpt_trains_as_one_process(ranks, cp, world, length, rows, labels):
    differences = ranks(world, _largest_difference, cp, length, rows, labels)
    assert max(differences) <= ATOL, differences


def _hugging_face(family: str, attention: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    options = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attention,
                   use_cache=False)  # as training runs it (with a cache, Hugging Face skips its packed-sequence check)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**options)).double()
    if family == "gpt2":  # learned positions; input_ids.view(-1, this rank's tokens) in its forward
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=32, n_embd=16, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, attn_implementation=attention, use_cache=False)).double()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**options)).double()


def _train_outside(model: nn.Module, loader: DataLoader) -> None:
    """The loss written in the loop, as Hugging Face's Trainer users write theirs: labels shifted in the data."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in loader:
        opt.zero_grad()
        logits = model(input_ids=x).logits
        F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1).backward()
        opt.step()


def _largest_difference_hf(family: str, cp: int, length: int, rows: int) -> float:
    return _against_one_process(_hugging_face(family), _data(length, rows, "prompt"), rows, _train_outside, cp=cp)


@pytest.mark.parametrize("family, cp, world, length, rows", [
    ("llama", 2, 2, 13, 3),
    pytest.param("qwen2", 3, 3, 17, 2, marks=pytest.mark.slow),
    pytest.param("qwen2", 2, 4, 11, 4, marks=pytest.mark.slow),  # dp 2 x cp 2
    ("llama", 2, 2, 13, 1),  # one sequence a batch: Hugging Face looks for packed documents in its positions
    pytest.param("qwen2", 4, 4, 37, 1, marks=pytest.mark.slow),
    # 5 and 4 tokens of 8 rows: a view of the whole 72 ids to rank 0's 5 a row fails, to rank 1's 4 does not
    ("gpt2", 2, 2, 9, 8),
])
def test_hugging_face_models_train_as_one_process(ranks, family, cp, world, length, rows):
    differences = ranks(world, _largest_difference_hf, family, cp, length, rows)
    assert max(differences) <= ATOL, differences


class _MultiheadLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attn = nn.Embedding(32, 8), nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.attn(x, x, x, need_weights=False)[0]


def _refusal(case: str) -> str:
    """What the first step under cp=2 raises, for each thing cp refuses in the model; nothing of it left alive."""
    import autodist

    data = _data(13, 3, "all")
    if case in ("multihead", "no attention"):
        built = {"multihead": _MultiheadLM,
                 "no attention": lambda: nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))}[case]()
        model, loader = autodist.parallelize(built, DataLoader(data, batch_size=3), cp=2)
        x, _ = next(iter(loader))
        call = lambda: model(x)  # noqa: E731
    else:
        built = _hugging_face("llama")
        model, loader = autodist.parallelize(built, DataLoader(data, batch_size=3), cp=2)
        x, y = next(iter(loader))
        if case == "labels":
            call = lambda: model(input_ids=x, labels=y)  # noqa: E731
        else:  # a padding mask made anew, not the batch's: its whole sequence's is nowhere (tests/cp/test_masks.py)
            call = lambda: model(input_ids=x, attention_mask=(y >= 5).long())  # noqa: E731
    try:
        call()
    except NotImplementedError as error:
        return str(error)
    return "nothing raised"


@pytest.mark.parametrize("case, says", [
    ("labels", "calls pad on its input kwargs['labels']"),
    ("mask", "is not a cut of the batch the loader handed out last"),
    ("multihead", "nn.MultiheadAttention adds keys of its own (bias_k"),  # torch's layer: tests/cp/test_multihead.py
    ("no attention", "ran no attention autodist could route"),
])  # torch.compile: tests/cp/test_compiled.py
def test_what_cannot_be_split_is_refused_with_the_reason(ranks, case, says):
    for message in ranks(2, _refusal, case):
        assert says in message, message


def test_hugging_faces_shift_labels_run():
    """``shift_labels=`` (the labels shifted in the data) is Hugging Face's own way around the shift: it passes."""
    from autodist.cp.refusals import along as _along

    labels = torch.zeros(2, 7)
    assert _along(F.pad, labels, 1, ((0, 1),), {}) and not _along(F.pad, labels, 1, ((0, 0, 1, 0),), {})
    assert _along(torch.Tensor.__getitem__, labels, 1, ((Ellipsis, slice(1, None)),), {})
    assert not _along(torch.Tensor.__getitem__, labels, 1, ((slice(0, 1),),), {})  # rows: along the batch
    assert _along(torch.Tensor.__getitem__, labels, 1, ((slice(None), -1),), {})


@pytest.mark.parametrize("options, says", [
    (dict(cp=0), "cp must be a positive int"),
    (dict(cp=2, data=torch.zeros(4, 8)), "wrap the data in a DataLoader"),
])
def test_options_cp_is_not_built_with_are_refused(options, says):
    import autodist

    data = options.pop("data", DataLoader(_data(13, 3, "all"), batch_size=3))
    model = _gpt(13)
    with pytest.raises((ValueError, NotImplementedError), match=says.replace("(", r"\(").replace(")", r"\)")):
        autodist.parallelize(model, data, **options)


def _train_accumulating(model: nn.Module, loader, no_sync) -> None:
    """Two micro-batches a step (the second backward syncs), the gradient's norm clipped, AdamW: as one script
    combines them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    batches = iter(loader)
    for first, second in zip(batches, batches):
        opt.zero_grad()
        with no_sync(model):
            (model(*first)[1] / 2).backward()
        (model(*second)[1] / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()


def _largest_difference_accumulating(cp: int, length: int, rows: int) -> float:
    import autodist  # no_sync: nothing for the reference, which is not parallelized

    return _against_one_process(_gpt(length), _data(length, rows, "prompt"), rows,
                                lambda model, loader: _train_accumulating(model, loader, autodist.no_sync), cp=cp)


def test_accumulation_and_clipping_train_as_one_process(ranks):
    """Each micro-batch's tokens weigh its own backward (a token-mean per micro-batch, as one process divides
    each by its own valid tokens); the clipped norm is the whole gradient's."""
    differences = ranks(3, _largest_difference_accumulating, 3, 19, 2)
    assert max(differences) <= ATOL, differences


def _steps(model: nn.Module, opt: torch.optim.Optimizer, loader, stop: int | None = None) -> None:
    for step, (x, y) in enumerate(loader, 1):
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
        if step == stop:
            return


def _save_mid_epoch(path: str, mp: int = 1, pp: int = 1) -> None:
    """cp=2 (with ``mp``, ``pp``): 7 of the epoch's 20 steps, then saved, the loader's place with it."""
    import autodist

    model, loader = autodist.parallelize(_gpt(13), DataLoader(_data(13, 3, "prompt"), batch_size=3), cp=2, mp=mp,
                                         pp=pp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(model, opt, loader, stop=7)
    autodist.save(path, model, opt)


def _resumed(path: str, cp: int) -> dict[str, torch.Tensor]:
    """The checkpoint loaded into another model at ``cp`` (1: one process), the epoch's 13 other steps run."""
    import autodist

    torch.manual_seed(5)
    model = GPT(_gpt(13).config).double()  # other weights: the checkpoint's replace them
    model, loader = autodist.parallelize(model, DataLoader(_data(13, 3, "prompt"), batch_size=3), cp=cp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    autodist.load(path, model, opt)
    _steps(model, opt, loader)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _uninterrupted() -> dict[str, torch.Tensor]:
    model = _gpt(13)
    _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
           DataLoader(_data(13, 3, "prompt"), batch_size=3))
    return dict(model.named_parameters())


@pytest.mark.parametrize("cp", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_a_checkpoint_saved_mid_epoch_at_cp2_resumes_at_another_cp(ranks, tmp_path, cp):
    """Saved at cp=2 after 7 of 20 steps; resumed in one process, or at cp=3, it ends the epoch where the
    uninterrupted one-process run does."""
    path = str(tmp_path / "cp2.pt")
    ranks(2, _save_mid_epoch, path)
    states = [_resumed(path, 1)] if cp == 1 else ranks(cp, _resumed, path, cp)
    expected = _uninterrupted()
    for state in states:
        assert max((p - expected[n]).abs().max().item() for n, p in state.items()) <= ATOL


def _largest_difference_sharded(shard: str | None, checkpoint: bool = False) -> float:
    return _against_one_process(_gpt(13), _data(13, 3, "prompt"), 3, _train, cp=2, shard=shard,
                                checkpoint=checkpoint)


@pytest.mark.parametrize("shard", ["optimizer", pytest.param("gradients", marks=pytest.mark.slow), "parameters"])
def test_every_shard_level_trains_as_one_process(ranks, shard):
    """The optimizer state, the gradients and the parameters sharded over the ranks that share each sequence."""
    differences = ranks(2, _largest_difference_sharded, shard)
    assert max(differences) <= ATOL, differences


@pytest.mark.parametrize("shard", [None, "parameters"])
def test_blocks_recomputed_in_backward_are_routed_again(ranks, shard):
    """checkpoint=True: each block runs again in backward, after the model's forward ended; its attention is
    routed over the whole sequence then too (unrouted, the recomputation differed from the first run and
    torch.utils.checkpoint raised its CheckpointError)."""
    differences = ranks(2, _largest_difference_sharded, shard, True)
    assert max(differences) <= ATOL, differences


def _gradients_in(dtype: torch.dtype, cp: int | None, mixed: bool = False) -> dict[str, torch.Tensor]:
    """One step's gradients of nanoGPT in ``dtype`` (weights and compute), in float64 for the comparison: in
    this process (``cp`` None) or parallelized with ``cp``; ``mixed``: float32 weights computed in ``dtype``
    (``mixed_precision=``)."""
    import autodist

    model = _gpt(31).to(torch.float32 if mixed else dtype)
    loader = DataLoader(_data(31, 3, "prompt"), batch_size=3)
    if cp is not None:
        model, loader = autodist.parallelize(model, loader, cp=cp, **({"mixed_precision": dtype} if mixed else {}))
    x, y = next(iter(loader))
    logits, loss = model(x, y)
    assert logits.dtype == dtype, logits.dtype  # computed in dtype (under mixed_precision= too)
    loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mixed", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["bfloat16 model", "mixed_precision=bf16"])
def test_bfloat16_differs_from_one_process_by_no_more_than_bfloat16_does(ranks, mixed):
    """The split floor in bfloat16: cp=2's gradients stand about as far from one process's in bfloat16 as the
    rounding of bfloat16 itself puts one process from float64 (the split sums in another order; within 4x of
    that floor, where a wrong split is off by the gradients' own size); a bfloat16 model, or a float32 one
    computed in bfloat16 (``mixed_precision=``, which casts the weights and inputs as the model here is cast)."""
    exact = _gradients_in(torch.float64, None)
    one = _gradients_in(torch.bfloat16, None)
    floor = max((one[n] - exact[n]).abs().max().item() for n in exact)
    split = ranks(2, _gradients_in, torch.bfloat16, 2, mixed)
    gap = max((g[n] - one[n]).abs().max().item() for g in split for n in one)
    assert 0 < gap <= 4 * floor, (gap, floor)  # here: 9.8e-4 against a floor of 7.5e-4


def _largest_difference_short_last_batch() -> float:
    """dp 2 x cp 2 on 21 rows in batches of 4: the last batch holds one row, so one data-parallel pair of ranks
    holds none of it (a stand-in of no rows, its tokens cut all the same)."""
    full = _data(11, 4, "prompt")
    data = TensorDataset(*(t[:21] for t in full.tensors))
    return _against_one_process(_gpt(11), data, 4, _train, cp=2)


def test_a_data_parallel_pair_with_no_row_of_the_last_batch(ranks):
    differences = ranks(4, _largest_difference_short_last_batch)
    assert max(differences) <= ATOL, differences


class _Stream(torch.utils.data.IterableDataset):
    """The samples of a dataset as a stream (no length, no index): every rank reads all of it."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        return iter(self.data)


def _largest_difference_stream() -> float:
    return _against_one_process(_gpt(13), _Stream(_data(13, 3, "prompt")), 3, _train, cp=2)


def test_a_stream_is_cut_like_a_map_style_dataset(ranks):
    """A DataLoader over an IterableDataset: every rank reads the stream and cuts each batch to its tokens."""
    differences = ranks(2, _largest_difference_stream)
    assert max(differences) <= ATOL, differences


def _validation_loss(model: nn.Module, loader) -> float:
    """The mean loss over the valid tokens of ``loader``'s batches, in eval mode and with gradients on (as many
    validation loops are written): under cp each rank's mean, weighted by its valid tokens, summed."""
    import torch.distributed as dist

    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        _, loss = model(x, y)
        valid = (y != -1).sum()
        if valid:
            total, count = total + loss.detach() * valid, count + valid
    if dist.is_initialized():
        both = torch.stack([total, count])
        dist.all_reduce(both)
        total, count = both
    return (total / count).item()


def _validated() -> tuple[float, float]:
    """One process's validation loss after the epoch, and cp=2's on a loader given to shard_data later."""
    import autodist

    held_out = DataLoader(_data(11, 2, "prompt"), batch_size=2)
    reference = _gpt(13)
    _train(reference, DataLoader(_data(13, 3, "prompt"), batch_size=3))
    model, loader = autodist.parallelize(_gpt(13), DataLoader(_data(13, 3, "prompt"), batch_size=3), cp=2)
    _train(model, loader)
    return _validation_loss(reference, held_out), _validation_loss(model, autodist.api.shard_data(model, held_out))


def test_a_validation_loader_given_later_is_cut_too(ranks):
    """autodist.api.shard_data on a held-out loader after parallelize: its batches are cut to each rank's tokens
    like the training loader's (another length, 11 tokens), and the loss over them is one process's."""
    for one, split in ranks(2, _validated):
        assert abs(one - split) <= ATOL, (one, split)


class _TimeFirst(nn.Module):
    """nanoGPT taking (seq, batch) tokens, as word_language_model's data is laid out."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = _gpt(13)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gpt(ids.t().contiguous(), targets.t().contiguous())


def _time_first(rows: list) -> tuple[torch.Tensor, ...]:
    """Collate samples into (seq, batch) tensors."""
    return tuple(torch.stack(column, dim=1) for column in zip(*rows))


def _largest_difference_time_first() -> float:
    import autodist

    data = _data(13, 3, "prompt")
    model = _TimeFirst()
    reference = copy.deepcopy(model)
    _train(reference, DataLoader(data, batch_size=3, collate_fn=_time_first))
    model, loader = autodist.parallelize(model, DataLoader(data, batch_size=3, collate_fn=_time_first), cp=2,
                                         batch_dim=1)
    _train(model, loader)
    expected = dict(reference.named_parameters())
    return max((p - expected[n]).abs().max().item() for n, p in model.named_parameters())


def test_seq_batch_tensors_are_cut_along_their_first_dimension(ranks):
    """batch_dim=1: (seq, batch) batches, the sequence along dimension 0, cut there."""
    differences = ranks(2, _largest_difference_time_first)
    assert max(differences) <= ATOL, differences
