"""torch.compile on the models users bring, at 2 ranks: a Hugging Face model compiles once (it makes a
ModuleList in every forward, which must not reach a guard), ``samples=`` holds in a compiled forward, a
compiled run says once that it reads nothing of the loss, and a parameter added after ``parallelize`` is
refused at the end of a compiled backward as it is before an uncompiled forward."""
from __future__ import annotations

import functools
import gc
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autodist
from workloads import float64, qwen2, seeded

pytestmark = pytest.mark.slow  # torch.compile takes seconds a model: the full tier
transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 48, 12


def _qwen2() -> nn.Module:
    """Qwen2Model's forward slices ``self.layers[: num_hidden_layers]``: a new ModuleList at every call."""
    return qwen2(VOCAB, LENGTH, tied=True)


def _tokens(samples: int = 21, prompts: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (samples, LENGTH), generator=g)
    if not prompts:
        return TensorDataset(ids, ids.clone())
    prompt = torch.randint(1, 9, (samples,), generator=g)
    return TensorDataset(ids, torch.where(torch.arange(LENGTH)[None, :] < prompt[:, None], -100, ids))


def _released(fn):
    """``fn``, then dynamo's caches emptied: they hold the compiled models, which a pool's later tests would
    find still parallelized (``autodist.whole_batch`` asks which model then)."""
    @functools.wraps(fn)
    def run(*args):
        import torch._dynamo

        try:
            return fn(*args)
        finally:
            torch._dynamo.reset()
            gc.collect()
    return run


def _train(model: nn.Module, loader, backward, epochs: int = 2) -> None:
    """Adam over ``loader`` as it yields (a compiled forward takes its weight from the batch the sharded loader
    handed out last: a list made first would leave none current)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(epochs):
        for batch in loader:
            optimizer.zero_grad()
            backward(model, batch)
            optimizer.step()


def _difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("_orig_mod."): v.detach().clone() for k, v in model.state_dict().items()}


@_released
@float64
def _hugging_face_compiled() -> tuple[list[int], float]:
    """(dynamo's frames compiled so far after each step, the largest difference from one process): every
    label valid, so that the loss's float32 rounding inside Hugging Face is the floor."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    loader = DataLoader(_tokens(24), batch_size=4)  # 6 steps of one shape (a new shape compiles anew)

    def backward(model: nn.Module, batch: tuple) -> None:
        model(input_ids=batch[0], labels=batch[1]).loss.backward()
        frames.append(counters["frames"]["total"])

    frames: list[int] = []
    reference = seeded(_qwen2, 0)
    _train(reference, loader, backward, epochs=1)
    model, sharded = autodist.parallelize(seeded(_qwen2, 0), loader)
    compiled = torch.compile(model, backend="eager")
    frames.clear()
    _train(compiled, sharded, backward, epochs=1)
    return frames, _difference(_state(compiled), _state(reference))


def test_a_hugging_face_model_compiles_once(ranks):
    """Before: dynamo compiled Qwen2 again at every forward (a guard on autodist's registration counter, which
    Qwen2's slice of its layers bumps) until its limit of 8, then ran it uncompiled."""
    for frames, difference in ranks(2, _hugging_face_compiled):
        assert len(frames) == 6 and frames[1] == frames[-1], frames  # nothing compiled after the second step
        assert difference <= 1e-6, f"{difference:.3g} from one process"


class _LossInside(nn.Module):
    """A language model whose forward computes its loss (a mean over the labels not at -100), as nanoGPT's
    and Hugging Face's do: compiled whole, the loss is inside the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(ids)))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def _valid_labels(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (labels != -100).sum()


@_released
@float64
def _samples_compiled(counted: bool) -> tuple[float, list[str]]:
    """(the largest difference from one process after 2 epochs of Adam, the warnings): the model compiled
    after parallelize, with ``samples=`` counting the valid labels or without."""
    import torch._dynamo

    torch._dynamo.reset()
    def loader() -> DataLoader:  # a generator of its own for each run: the same shuffles
        return DataLoader(_tokens(prompts=True), batch_size=8, shuffle=True,
                          generator=torch.Generator().manual_seed(2))

    def backward(model: nn.Module, batch: tuple) -> None:
        model(*batch).backward()

    reference = seeded(_LossInside, 0)
    _train(reference, loader(), backward)
    model, sharded = autodist.parallelize(seeded(_LossInside, 0), loader(),
                                          **({"samples": _valid_labels} if counted else {}))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("autodist").addHandler(handler)
    try:
        _train(torch.compile(model, backend="aot_eager"), sharded, backward)
    finally:
        logging.getLogger("autodist").removeHandler(handler)
    return _difference(_state(model), _state(reference)), [r.getMessage() for r in records]


def test_samples_holds_in_a_compiled_forward(ranks):
    """Before: a compiled forward ignored samples= and weighted the ranks by their rows (9.5e-3 from one
    process in the issue's run): now the count is taken eagerly at the forward's end."""
    for rank, (difference, warnings) in enumerate(ranks(2, _samples_compiled, True)):
        assert difference <= 1e-10, f"rank {rank}: {difference:.3g} from one process"
        assert not any("runs compiled" in w for w in warnings), warnings


def test_a_compiled_forward_says_it_reads_nothing_of_the_loss(ranks):
    """Without samples=, the ranks are weighted by their rows (not exact for this loss), said once on rank 0."""
    for rank, (difference, warnings) in enumerate(ranks(2, _samples_compiled, False)):
        assert difference > 1e-4, f"rank {rank}: {difference:.3g}: the weighting by rows was exact after all?"
        said = [w for w in warnings if "runs compiled" in w and "samples=fn" in w]
        assert len(said) == (1 if rank == 0 else 0), warnings


@_released
def _parameter_added_under_compile() -> str:
    model, loader = autodist.parallelize(seeded(_LossInside, 0), DataLoader(_tokens(), batch_size=8))
    compiled = torch.compile(model, backend="aot_eager")
    batches = iter(loader)
    compiled(*next(batches)).backward()
    model.register_parameter("scale", nn.Parameter(torch.ones(())))  # after parallelize: nothing would sync it
    try:
        compiled(*next(batches)).backward()
    except autodist.ModelChanged as error:
        return str(error)
    return "no error"


def test_a_parameter_added_after_parallelize_is_refused_under_compile(ranks):
    for message in ranks(2, _parameter_added_under_compile):
        assert "never saw (scale)" in message, message
