"""A batch cut into micro-batches and their outputs put back together (autodist/pp/micro.py), and the order of
a stage's forwards and backwards (autodist/pp/schedule.py): what pp does to a forward's arguments and
outputs, without ranks."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from autodist.pp import micro, schedule


def test_tensors_with_the_batch_rows_are_cut_and_others_go_whole():
    x, mask, y = torch.arange(10.0).reshape(5, 2), torch.ones(3, 3), torch.arange(5)
    parts = micro.cut((x,), {"mask": mask, "labels": [y], "note": "hi"}, pieces=3, dim=0)
    assert parts.rows == [2, 2, 1]
    assert [a[0].tolist() for a, _ in parts.calls] == [x[:2].tolist(), x[2:4].tolist(), x[4:].tolist()]
    assert all(k["mask"] is mask and k["note"] == "hi" for _, k in parts.calls)
    assert [k["labels"][0].tolist() for _, k in parts.calls] == [[0, 1], [2, 3], [4]]
    assert micro.cut((x[:2],), {}, pieces=4, dim=0).rows == [1, 1]  # never an empty micro-batch


def test_seq_first_inputs_are_cut_along_batch_dim_and_a_target_along_its_own():
    x, y = torch.zeros(7, 4, 3), torch.arange(4)  # (seq, batch, features), (batch,)
    parts = micro.cut((x,), {}, pieces=2, dim=1, target=y)
    assert [tuple(a[0].shape) for a, _ in parts.calls] == [(7, 2, 3), (7, 2, 3)]
    assert [t.tolist() for t in parts.targets] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="none or several of its dimensions have the batch's 4 rows"):
        micro.cut((x,), {}, pieces=2, dim=1, target=torch.zeros(3))
    with pytest.raises(ValueError, match="none or several of its dimensions"):  # (4, 1, 4): which is the batch?
        micro.cut((x,), {}, pieces=2, dim=1, target=torch.zeros(4, 1, 4))


@dataclasses.dataclass
class Batch:
    x: torch.Tensor


def test_batch_rows_inside_an_unknown_container_are_an_error_not_copied_to_every_micro_batch():
    with pytest.raises(TypeError, match=r"a Batch in the forward's arguments holds batch rows \(\.x\)"):
        micro.cut((torch.zeros(4, 2), Batch(torch.zeros(4, 2))), {}, pieces=2, dim=0)


def test_outputs_merge_rows_by_concatenation_and_means_by_weight():
    rows, counts = [2, 1], [2.0, 1.0]
    outs = [{"logits": torch.full((2, 3), 1.0), "loss": torch.tensor(3.0), "n": 7},
            {"logits": torch.full((1, 3), 2.0), "loss": torch.tensor(6.0), "n": 7}]
    dropped = []
    merged = micro.merge(outs, rows, counts, 0, lambda where, value: dropped.append(where))
    assert merged.value["logits"].shape == (3, 3) and merged.value["n"] == 7 and not dropped
    assert_close(merged.value["loss"], torch.tensor(4.0))  # (2 * 3 + 1 * 6) / 3: the batch's mean
    leaves = ["logits", "loss", "n"]
    grads = merged.cut_grad(leaves.index("loss"), torch.tensor(1.0), rows)
    assert_close(torch.stack(grads), torch.tensor([2 / 3, 1 / 3]))
    assert [g.shape for g in merged.cut_grad(0, torch.ones(3, 3), rows)] == [(2, 3), (1, 3)]


def test_an_output_no_rule_fits_is_an_error_and_a_cache_is_dropped_by_name():
    with pytest.raises(ValueError, match=r"output\[0\] of the model's forward is a tensor of shape \(4,\)"):
        micro.merge([(torch.zeros(4),), (torch.zeros(4),)], [2, 2], [2.0, 2.0], 0, lambda *a: None)
    dropped = []
    merged = micro.merge([(torch.zeros(2, 1), object()), (torch.zeros(2, 1), object())], [2, 2], [2.0, 2.0], 0,
                         lambda where, value: dropped.append(where))
    assert merged.value[1] is None and dropped == ["output[1]"]


def test_the_schedules():
    assert schedule.gpipe_forwards(3) == [("F", 0), ("F", 1), ("F", 2)]
    assert schedule.gpipe_backwards(3) == [("B", 2), ("B", 1), ("B", 0)]
    assert schedule.one_f_one_b(3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2),
                                             ("B", 3)]
    assert schedule.one_f_one_b(3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    for stages in (2, 3, 4):
        for stage in range(stages):
            steps = schedule.one_f_one_b(stages, stage, 5)
            held = max(sum(1 if k == "F" else -1 for k, _ in steps[:i + 1]) for i in range(len(steps)))
            assert held == min(stages - stage, 5)
    assert schedule.bubble(2, 4) == pytest.approx(0.2)


def test_a_hollow_output_answers_its_shape_and_refuses_its_values():
    from autodist.pp.hollow import hollow

    h, note = hollow((torch.zeros(2, 3, dtype=torch.float64), "kept"), "layers.0", 0)
    assert (h.shape, h.dtype, h.device, h.size(1), h.dim(), note) == ((2, 3), torch.float64, torch.device("cpu"), 3,
                                                                       2, "kept")
    for use in (lambda: h + 1, lambda: h.sum(), lambda: torch.cat([h]), lambda: h.detach()):
        with pytest.raises(RuntimeError, match="on the output of layers.0, a block pipeline stage 0 runs"):
            use()


def test_a_structure_goes_as_json_in_one_header_message_or_two_and_numbers_inside_it():
    from autodist.pp import wire

    loss = torch.tensor(0.1, dtype=torch.float32)
    value = {"loss": loss, "logits": torch.zeros(2, 3), "note": None}
    tensors, description = wire.describe(value, "the output")
    assert len(tensors) == 1  # the loss rides in the header, exactly
    headers = wire._headers(description, torch.device("cpu"))
    assert [h.numel() for h in headers] == [wire.HEADER]
    back = wire.rebuild(wire._decode(headers[0], None), tensors)
    assert back["loss"].dtype == torch.float32 and back["loss"].item() == loss.item() and back["note"] is None
    long = {f"key {i}": torch.zeros(1) for i in range(40)}  # a description longer than one header
    _, description = wire.describe(long, "a dict")
    first, rest = wire._headers(description, torch.device("cpu"))
    assert first.numel() == wire.HEADER and wire._rest(first, torch.device("cpu")).numel() == rest.numel()
    assert wire._decode(first, rest) == description
    with pytest.raises(TypeError, match="holds a object, which cannot go from one pipeline stage to the next"):
        wire.describe((torch.zeros(1), object()), "the output of h.0")
