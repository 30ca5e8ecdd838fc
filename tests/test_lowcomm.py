"""Low-communication modes keep the promises their docstrings make (real gloo ranks)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import autodist
import workloads as w
from test_equivalence import assert_same_training


def _plain_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _loop(model, data, opt, epochs, after_step=None):
    for _ in range(epochs):
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if after_step is not None:
                after_step()
    return model


def _parallel(strategy, n=22, batch=8, build=w.mlp):
    x, y = w.digits_like(n)
    return autodist.parallelize(w.seeded(build, 0 if w.rank() == 0 else 100 + w.rank()), w.loader(x, y, batch),
                                sync=strategy)


def _every_one_is_exact():
    x, y = w.digits_like(22)
    ref = w.seeded(w.mlp, 0)
    _loop(ref, w.loader(x, y, 8), _plain_sgd(ref), 3)
    model, data = _parallel(autodist.LocalSGD(every=1))
    _loop(model, data, _plain_sgd(model), 3)
    return w.state(ref), w.state(model)


def test_local_sgd_every_step_with_plain_sgd_is_the_exact_run(ranks):
    # 22 samples, batch 8, 3 ranks: shares 3/3/2 then 2/2/2: the average must weight replicas by samples
    assert_same_training(ranks(3, _every_one_is_exact), rtol=1e-5, atol=1e-6)


def _replicas_meet_every_h():
    strategy = autodist.LocalSGD(every=3)
    model, data = _parallel(strategy)
    states = []
    _loop(model, data, w.optimizer("adam", model), 2, lambda: states.append(w.state(model)))
    return states, strategy.syncs, strategy.spread()


def test_local_sgd_replicas_identical_after_each_average_and_apart_between(ranks):
    results = ranks(2, _replicas_meet_every_h)
    for step in range(6):
        a, b = results[0][0][step], results[1][0][step]
        if (step + 1) % 3 == 0:
            assert_close(a, b, rtol=0, atol=0)
        else:
            assert not torch.equal(a["0.weight"], b["0.weight"])
    assert results[0][1] == 2 and results[0][2] == 0.0  # two averages; the last step was one


def _warmup_is_exact():
    x, y = w.digits_like(16)
    ref = w.train(w.seeded(w.mlp, 0), w.loader(x, y, 8), "sgd", 1)  # 2 steps, SGD with momentum
    model, data = _parallel(autodist.LocalSGD(every=100, warmup=2), n=16)
    opt = w.optimizer("sgd", model)
    _loop(model, data, opt, 1)
    exact = w.state(model)
    _loop(model, data, opt, 1)  # now local
    return (w.state(ref), exact), w.state(model)


def test_local_sgd_warmup_steps_are_exact_then_local(ranks):
    results = ranks(2, _warmup_is_exact)
    assert_same_training([r[0] for r in results])
    assert not torch.equal(results[0][1]["0.weight"], results[1][1]["0.weight"])


def _diloco_vs_local(outer):
    diloco = autodist.DiLoCo(every=3, **outer)
    local = autodist.LocalSGD(every=3)
    a, data_a = _parallel(diloco)
    b, data_b = _parallel(local)
    _loop(a, data_a, w.optimizer("adam", a), 2)
    _loop(b, data_b, w.optimizer("adam", b), 2)
    return w.state(a), w.state(b), diloco.bytes_sent, local.bytes_sent


def test_diloco_with_outer_lr_one_and_no_momentum_is_local_sgd(ranks):
    for a, b, sent_a, sent_b in ranks(2, _diloco_vs_local, {"outer_lr": 1.0, "momentum": 0.0}):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert sent_a == sent_b > 0


def test_diloco_with_nesterov_differs_from_local_sgd_but_replicas_agree(ranks):
    results = ranks(2, _diloco_vs_local, {})
    assert not torch.equal(results[0][0]["0.weight"], results[0][1]["0.weight"])
    assert_close(results[0][0], results[1][0], rtol=0, atol=0)  # the outer step leaves one model


def _diloco_restart(path):
    x, y = w.digits_like(22)

    def run(restore):
        diloco = autodist.DiLoCo(every=2)
        model, data = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 8, shuffle=False), sync=diloco)
        opt = _plain_sgd(model)  # stateless inner optimizer: the outer state is all a restart needs
        if restore:
            saved = autodist.load(path, model, opt)["diloco"]
            if restore == "outer":
                diloco.load_state_dict(saved)
        return diloco, model, data, opt

    diloco, model, data, opt = run(None)
    _loop(model, data, opt, 2)  # 6 steps: 3 outer steps, the replicas identical
    autodist.save(path, model, opt, diloco=diloco.state_dict())
    _loop(model, data, opt, 1)
    straight = w.state(model)
    restored, model2, data2, opt2 = run("outer")
    _loop(model2, data2, opt2, 1)
    _, model3, data3, opt3 = run("model only")
    _loop(model3, data3, opt3, 1)
    return straight, w.state(model2), w.state(model3), restored.steps


def test_diloco_outer_state_survives_a_restart(ranks, tmp_path):
    for straight, resumed, without_outer, steps in ranks(2, _diloco_restart, str(tmp_path / "ckpt.pt")):
        assert steps == 9
        assert_close(resumed, straight, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(without_outer["0.weight"], straight["0.weight"], rtol=1e-4, atol=1e-5)


def _gossip_without_learning(rounds, peers):
    gossip = autodist.Gossip(peers=peers)
    model, _ = autodist.parallelize(w.seeded(w.mlp, 0), sync=gossip)
    torch.manual_seed(w.rank())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    start = w.state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 6)
    for _ in range(rounds):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    gossip.flush()
    return start, w.state(model), gossip.bytes_sent, gossip.rounds


def _mean(states):
    return {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}


def test_gossip_reaches_the_initial_mean_in_log2_p_rounds(ranks):
    results = ranks(4, _gossip_without_learning, 2, 1)
    mean = _mean([r[0] for r in results])
    params = sum(t.numel() * 4 for t in results[0][0].values())
    for start, end, sent, rounds in results:
        assert_close(end, mean, rtol=1e-5, atol=1e-6)
        assert rounds == 2 and sent == 2 * params  # one model to one peer per round


def test_gossip_keeps_the_mean_and_contracts_for_any_size(ranks):
    results = ranks(3, _gossip_without_learning, 4, 1)
    start_mean, end_mean = _mean([r[0] for r in results]), _mean([r[1] for r in results])
    assert_close(end_mean, start_mean, rtol=1e-5, atol=1e-6)
    before = max((r[0]["0.weight"] - start_mean["0.weight"]).norm() for r in results)
    after = max((r[1]["0.weight"] - start_mean["0.weight"]).norm() for r in results)
    assert after < 0.2 * before


def _gossip_trains():
    gossip = autodist.Gossip(peers=2)
    model, data = _parallel(gossip)
    _loop(model, data, w.optimizer("sgd", model), 3)
    gossip.flush()
    spread = gossip.spread()
    autodist.synchronize_model(model, what="parameters")
    return spread, gossip.spread(), w.state(model)


def test_gossip_with_learning_keeps_replicas_close_and_ends_as_one(ranks):
    results = ranks(3, _gossip_trains)
    for spread, after, state in results:
        assert 0 < spread < 0.5 and after < 1e-6
        assert_close(state, results[0][2], rtol=0, atol=0)


def _traffic(every):
    strategy = autodist.LocalSGD(every=every)
    model, data = _parallel(strategy, n=64, batch=4)  # 16 steps an epoch
    _loop(model, data, _plain_sgd(model), 2)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    exact = 32 * 2 * (2 - 1) / 2 * gradient_bytes  # exact sync all-reduces every gradient at every step
    return strategy.bytes_sent, exact


def test_local_sgd_every_16_sends_over_ten_times_less_than_exact_sync(ranks):
    sent_16, exact = ranks(2, _traffic, 16)[0]
    sent_1, _ = ranks(2, _traffic, 1)[0]
    assert exact / sent_16 >= 10, (sent_16, exact)
    assert sent_1 == pytest.approx(exact, rel=0.01)  # the counter agrees with exact sync's volume at every=1


def _misuse():
    errors = []
    strategy = autodist.LocalSGD()
    autodist.parallelize(w.seeded(w.mlp, 0), sync=strategy)
    for call in (lambda: autodist.parallelize(w.seeded(w.mlp, 0), sync=strategy),
                 lambda: autodist.parallelize(w.seeded(w.mlp, 0), sync="sometimes")):
        try:
            call()
            errors.append(None)
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    return errors


def test_misuse_is_named(ranks):
    reused, unknown = ranks(2, _misuse)[0]
    assert "already used by another model" in reused
    assert "autodist.LocalSGD(every=16)" in unknown and "'sometimes'" in unknown


@pytest.mark.parametrize("bad", [dict(every=0), dict(warmup=-1), dict(every=2.5)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError, match="must be an int"):
        autodist.LocalSGD(**bad)


def test_bad_outer_arguments():
    with pytest.raises(ValueError, match="outer_lr"):
        autodist.DiLoCo(outer_lr=0)
    with pytest.raises(ValueError, match="momentum"):
        autodist.DiLoCo(momentum=1.0)


def test_world_of_one_runs_unchanged():
    assert "RANK" not in os.environ
    x, y = w.digits_like(16)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 8), sync=autodist.DiLoCo(every=1))
    ref = w.train(w.seeded(w.mlp, 0), w.loader(x, y, 8), "sgd", 1)
    assert_close(w.state(w.train(model, data, "sgd", 1)), w.state(ref), rtol=0, atol=0)
