"""What a loss is a mean over, read from its graph (autodist/dp/loss_reading.py): pure logic, one process."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autodist.dp.loss_reading import read

LABELS = torch.tensor([0, 1, -100, 2, -100, 1])


def _logits() -> torch.Tensor:
    return torch.randn(6, 3, requires_grad=True)


def test_a_cross_entropy_is_a_mean_over_its_valid_labels():
    assert read([F.cross_entropy(_logits(), LABELS)]).count == 4.0
    assert read([F.cross_entropy(_logits(), LABELS.clamp(min=0), ignore_index=1)]).count == 4.0  # the two 1s
    assert read([F.cross_entropy(_logits(), LABELS.clamp(min=0))]).count == 6.0


def test_class_weights_make_it_a_mean_over_the_targets_weights():
    weight = torch.tensor([1.0, 2.0, 0.5])
    assert read([F.cross_entropy(_logits(), LABELS, weight=weight)]).count == 1.0 + 2.0 + 0.5 + 2.0


def test_what_only_scales_or_adds_is_looked_through():
    logits, scale = _logits(), torch.tensor(1024.0)
    loss = F.cross_entropy(logits, LABELS)
    assert read([(loss / 4).float() * scale]).count == 4.0  # accumulation, GradScaler
    assert read([2 * loss - 1]).count == 4.0


def test_a_sum_divided_by_a_number_is_a_mean_over_it():
    logits = _logits()
    mask = (LABELS != -100).double()
    each = F.cross_entropy(logits, LABELS.clamp(min=0), reduction="none")
    assert read([(each * mask).sum() / mask.sum()]).terms[0].kind == "divided"
    assert read([(each * mask).sum() / mask.sum()]).count == 4.0
    summed = F.cross_entropy(logits, LABELS, reduction="sum")
    assert read([summed / torch.tensor(11)]).count == 11.0  # Hugging Face's sum / num_items_in_batch


def test_label_smoothing_keeps_one_count():
    reading = read([F.cross_entropy(_logits(), LABELS, label_smoothing=0.1)])
    assert [t.kind for t in reading.terms] == ["tokens", "divided"]
    assert reading.count == 4.0 and reading.disagreement() is None


def test_what_is_not_a_mean_over_a_count_is_not_counted():
    x = torch.randn(6, 3, requires_grad=True)
    assert read([x.mean()]).count is None  # over its elements: the samples decide
    assert read([x.sum()]).count is None
    assert read([F.mse_loss(x, torch.zeros(6, 3))]).count is None
    assert read([x.sum() * x.mean()]).count is None  # a product of terms
    assert read([x]).terms == ()  # not one number: backward(gradient) weights it


def test_terms_that_divide_by_different_counts_are_named():
    logits = _logits()
    loss = F.cross_entropy(logits, LABELS) + F.cross_entropy(logits, torch.tensor([0, 1, 2, 2, 1, 0]))
    reading = read([loss])
    assert reading.count == 4.0
    assert "over 4" in reading.disagreement() and "over 6" in reading.disagreement()


def test_several_roots_are_the_terms_of_one_loss():
    logits = _logits()
    assert read([F.cross_entropy(logits, LABELS), logits.sum()]).count == 4.0


def test_a_load_balancing_loss_is_read_with_its_statistic():
    """Hugging Face's Switch-Transformer loss: sum(f * p.sum(0) / rows) * experts, f without a gradient."""
    logits = torch.randn(10, 4, requires_grad=True)
    probs = logits.softmax(-1)
    f = torch.histc(probs.topk(2, dim=-1).indices.float().reshape(-1), bins=4, min=0, max=4) / 10.0
    aux = (f * (probs.sum(0) / 10.0).unsqueeze(0)).sum() * 4
    reading = read([F.cross_entropy(logits, LABELS.repeat(2)[:10]) + 0.02 * aux])
    assert [t.kind for t in reading.terms] == ["tokens", "balance"]
    assert reading.count == 7.0  # the balance term is not a count of the loss's
    (balance,) = reading.balances
    assert balance.rows == 10.0 and torch.equal(balance.statistic, f)
    assert read([(f * probs.mean(0)).sum()]).balances[0].rows == 10.0  # older transformers: a mean over rows
    masked = (probs * torch.ones(10, 1)).sum()  # a masked sum is not one: nothing divides it by rows
    assert read([masked]).balances == ()


def test_a_graph_backward_freed_reads_as_nothing_and_torch_says_why():
    loss = F.cross_entropy(_logits(), LABELS)
    loss.backward()
    assert read([loss]).count is None  # the second backward raises torch's own error, not autodist's
