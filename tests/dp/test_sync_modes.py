"""Manual sync, parameter averaging, no_sync accumulation, buckets, and the model check."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import autodist
import workloads as w
from alike import assert_same_training


def _manual_run():
    x, y = w.digits_like(20)
    ref = w.train(w.seeded(w.mlp, 0), w.loader(x, y, 8), "sgd", 2)
    model, data = autodist.parallelize(w.seeded(w.mlp, w.rank()), w.loader(x, y, 8), sync="manual")
    opt = w.optimizer("sgd", model)
    for _ in range(2):
        for xb, yb in data:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            autodist.synchronize_model(model)
            opt.step()
    return w.state(ref), w.state(model)


def test_manual_sync_matches_one_process(ranks):
    assert_same_training(ranks(2, _manual_run))


def _manual_without_sync_diverges():
    x, y = w.digits_like(20)
    model, data = autodist.parallelize(w.seeded(w.mlp, w.rank()), w.loader(x, y, 8), sync="manual")
    w.train(model, data, "sgd", 1)  # no synchronize_model: no hooks, so ranks drift apart
    return w.state(model)


def test_manual_mode_installs_no_hooks(ranks):
    a, b = ranks(2, _manual_without_sync_diverges)
    assert not torch.equal(a["0.weight"], b["0.weight"])


def _average_parameters():
    model, _ = autodist.parallelize(w.seeded(w.mlp, 0), sync="manual")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(w.rank() + 1))  # rank r drifts by r + 1
    autodist.synchronize_model(model, what="parameters")
    return w.state(model)


def test_parameter_averaging(ranks):
    results = ranks(3, _average_parameters)
    expected = {k: v + 2.0 for k, v in w.state(w.seeded(w.mlp, 0)).items()}  # mean of 1, 2, 3
    for par in results:
        assert_close(par, expected, rtol=1e-6, atol=1e-6)


def _accumulate(micro: int, n: int, **options):
    """Each optimizer step accumulates `micro` global micro-batches of 5 samples (the last one of n % 5);
    ``options`` go to parallelize."""
    x, y = w.digits_like(n)
    ref_model, model = w.seeded(w.mlp, 0), w.seeded(w.mlp, w.rank())
    ref_opt = w.optimizer("adam", ref_model)
    model, data = autodist.parallelize(model, w.loader(x, y, 5, shuffle=False), **options)
    opt = w.optimizer("adam", model)
    ref_batches, batches = list(w.loader(x, y, 5, shuffle=False)), list(data)
    for start in range(0, len(batches), micro):
        for i in range(start, start + micro):
            xb, yb = ref_batches[i]
            (F.cross_entropy(ref_model(xb), yb) / micro).backward()
            xb, yb = batches[i]
            if i < start + micro - 1:
                with autodist.no_sync(model):
                    (F.cross_entropy(model(xb), yb) / micro).backward()
            else:
                (F.cross_entropy(model(xb), yb) / micro).backward()
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    return w.state(ref_model), w.state(model)


@pytest.mark.parametrize("size", [2, 3])
def test_no_sync_gradient_accumulation(ranks, size):
    assert_same_training(ranks(size, _accumulate, 2, 20))


def test_no_sync_with_micro_batches_split_differently(ranks):
    # 17 samples in micro-batches of 5, 5 | 5, 2 on 3 ranks: 2+2+1, then 2+2+1 and 1+1+0 in the last
    # step, whose two micro-batches give the ranks different shares (and one rank an empty batch).
    assert_same_training(ranks(3, _accumulate, 2, 17))


def _many_buckets():
    x, y = w.digits_like(20)
    return w.reference_and_parallel(w.mlp, lambda: w.loader(x, y, 8), "sgd", 2,
                                    first_bucket_mb=0.0002, bucket_mb=0.001)


def test_many_small_buckets(ranks):
    assert_same_training(ranks(2, _many_buckets))


def _mismatched_model():
    width = 16 if w.rank() == 0 else 17
    model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Linear(width, 3))
    try:
        autodist.parallelize(model)
    except ValueError as err:
        return str(err)
    return "no error"


def test_model_mismatch_raises_on_every_rank(ranks):
    messages = ranks(2, _mismatched_model, timeout=30)
    for msg in messages:
        assert "'0.weight'" in msg and "(16, 6) on rank 0" in msg and "(17, 6) on rank 1" in msg, msg


def _parallelize_twice():
    model, _ = autodist.parallelize(w.mlp())
    with pytest.raises(RuntimeError, match="already parallelized"):
        autodist.parallelize(model)


def test_parallelize_twice_is_an_error(ranks):
    ranks(2, _parallelize_twice)


def _launch_order():
    model, _ = autodist.parallelize(w.seeded(w.mlp, 0), first_bucket_mb=0.0002, bucket_mb=0.001)
    sync = autodist.dp.grad_sync.state_of(model)
    started_when_first_layer_ready, started_midway = [], []
    first = next(model.parameters())  # the last gradient backward produces
    first.register_post_accumulate_grad_hook(lambda p: started_when_first_layer_ready.append(sync.next_bucket))
    model[2].weight.register_post_accumulate_grad_hook(lambda p: started_midway.append(sync.next_bucket))
    x, y = w.digits_like(8)
    F.cross_entropy(model(x), y).backward()
    return len(sync.buckets), started_midway, started_when_first_layer_ready, sync.next_bucket


def test_buckets_start_during_backward(ranks):
    for n_buckets, midway, started, after in ranks(2, _launch_order):
        assert n_buckets >= 3
        # halfway through backward (the middle layer's weight gradient), the last layer's buckets
        # are already on their way and the first layer's are not
        assert len(midway) == 1 and 0 < midway[0] < n_buckets
        # when the last gradient lands, still inside backward, every bucket has been sent
        # (the first layer's by autodist's own hook on that same parameter, registered first);
        # the end-of-backward callback then only waits, and resets for the next step
        assert started == [n_buckets] and after == 0


def _frozen_run():
    def build():
        model = w.mlp()
        model[0].requires_grad_(False)
        return model
    return w.reference_and_parallel(build, lambda: w.loader(*w.digits_like(22), 8), "adam", 3)


def test_frozen_parameters(ranks):
    assert_same_training(ranks(2, _frozen_run))


def _two_backwards():
    """loss.backward(retain_graph=True) twice per step, on ranks holding 5 and 1 samples."""
    x, y = w.digits_like(6)
    ref = w.seeded(w.mlp, 0)
    F.cross_entropy(ref(x), y).backward(retain_graph=True)
    (2 * F.cross_entropy(ref(x), y)).backward()
    model, _ = autodist.parallelize(w.seeded(w.mlp, 0))
    part = slice(0, 5) if w.rank() == 0 else slice(5, 6)
    loss = F.cross_entropy(model(x[part]), y[part])
    loss.backward(retain_graph=True)
    (2 * loss).backward()
    return ({n: p.grad for n, p in ref.named_parameters()}, {n: p.grad for n, p in model.named_parameters()})


def test_second_backward_without_forward_stays_exact(ranks):
    for ref, par in ranks(2, _two_backwards):
        assert_close(par, ref, rtol=1e-5, atol=1e-6)


def _half_precision():
    x, y = w.digits_like(6)
    model, _ = autodist.parallelize(w.seeded(w.mlp, 0).half())
    part = slice(0, 3) if w.rank() == 0 else slice(3, 6)
    F.cross_entropy(model(x[part].half()).float(), y[part]).backward()
    autodist.synchronize_model(model, what="parameters")  # averaged in float32 too, rounded once
    return {n: (p.dtype, p.grad.dtype) for n, p in model.named_parameters()}


def test_float16_parameters_keep_float16_gradients(ranks):  # (the dtypes of tests/dp/test_precision.py)
    for dtypes in ranks(2, _half_precision):
        assert set(dtypes.values()) == {(torch.float16, torch.float16)}


def _manual_then_parallelize():
    model = w.seeded(w.mlp, 0)
    autodist.synchronize_model(model, what="parameters")
    autodist.parallelize(model)  # still allowed afterwards
    return True


def test_synchronize_before_parallelize(ranks):
    assert ranks(2, _manual_then_parallelize) == [True, True]
