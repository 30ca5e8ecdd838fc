"""Low-communication modes keep the promises their docstrings make (real gloo ranks)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import autodist
import workloads as w
from alike import assert_same_training


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
    strategy = autodist.LocalSGD(every=100, warmup=2)
    model, data = _parallel(strategy, n=16)
    opt = w.optimizer("sgd", model)
    _loop(model, data, opt, 1)
    exact, sent = w.state(model), strategy.bytes_sent
    _loop(model, data, opt, 1)  # now local
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return (w.state(ref), exact), w.state(model), sent, strategy.bytes_sent, gradient_bytes


def test_local_sgd_warmup_steps_are_exact_then_local(ranks):
    results = ranks(2, _warmup_is_exact)
    assert_same_training([r[0] for r in results])
    assert not torch.equal(results[0][1]["0.weight"], results[1][1]["0.weight"])
    _, _, sent, later, gradient_bytes = results[0]
    # two exact steps: each all-reduced every gradient (ring volume, 2 ranks: one gradient's bytes) plus
    # a few slots of counts and flags; the local steps after them sent nothing (no average yet)
    assert 2 * gradient_bytes <= sent <= 2 * gradient_bytes + 400 and later == sent


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


def _restarted(mode):
    if mode == "LocalSGD":
        return autodist.LocalSGD(every=3)
    if mode == "DiLoCo":
        return autodist.DiLoCo(every=3)  # Nesterov: the outer momentum must come back
    return autodist.Hierarchical(across=autodist.DiLoCo(every=2), ranks_per_host=1)


def _restart(path, mode):
    """Save after an average, go on; then load into a fresh parallelized model and go on the same way."""
    x, y = w.digits_like(22)

    def build(seed):
        strategy = _restarted(mode)
        model, data = autodist.parallelize(w.seeded(w.mlp, seed), w.loader(x, y, 8, shuffle=False), sync=strategy)
        return strategy, model, data, _plain_sgd(model)  # stateless inner optimizer: equal on every replica

    strategy, model, data, opt = build(0)
    _loop(model, data, opt, 2)  # 6 steps: the strategies below all meet at step 6
    autodist.save(path, model, opt)
    _loop(model, data, opt, 2)
    straight = w.state(model)
    fresh, model2, data2, opt2 = build(5)  # other weights, and a strategy that has seen no step
    autodist.load(path, model2, opt2)
    _loop(model2, data2, opt2, 2)
    return straight, w.state(model2), fresh.state_dict()


@pytest.mark.parametrize("mode", ["LocalSGD", "DiLoCo", "Hierarchical"])
def test_restart_from_a_checkpoint_is_the_uninterrupted_run(ranks, tmp_path, mode):
    for straight, resumed, state in ranks(2, _restart, str(tmp_path / "ckpt.pt"), mode):
        assert_close(resumed, straight, rtol=1e-6, atol=1e-7)
        assert (state.get("across", state))["steps"] == 12


def _restart_without_outer_state(path):
    x, y = w.digits_like(22)
    data = w.loader(x, y, 8, shuffle=False)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0), data, sync=autodist.DiLoCo(every=3))
    opt = _plain_sgd(model)
    _loop(model, data, opt, 2)
    autodist.save(path, model, opt)
    _loop(model, data, opt, 1)
    straight = w.state(model)
    exact, data2 = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 8, shuffle=False))
    autodist.load(path, exact, None)  # an exact-sync run ignores the DiLoCo state
    diloco = autodist.DiLoCo(every=3)
    model3, data3 = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 8, shuffle=False), sync=diloco)
    model3.load_state_dict(torch.load(path, weights_only=True)["model"])  # by hand: no outer state
    opt3 = _plain_sgd(model3)
    _loop(model3, data3, opt3, 1)
    return straight, w.state(model3), "sync" in torch.load(path, weights_only=True)


def test_a_model_loaded_by_hand_starts_a_fresh_round_from_its_weights(ranks, tmp_path):
    for straight, fresh, saved in ranks(2, _restart_without_outer_state, str(tmp_path / "ckpt.pt")):
        assert saved
        # the outer parameters are taken at the first step (the loaded weights), not at parallelize: the
        # first outer step moves from there, only without the saved momentum
        assert not torch.allclose(fresh["0.weight"], straight["0.weight"], rtol=1e-4, atol=1e-5)
        assert (fresh["0.weight"] - straight["0.weight"]).abs().max() < 0.5


def _gossip_restart(path):
    gossip = autodist.Gossip()
    model, data = _parallel(gossip)
    opt = _plain_sgd(model)
    _loop(model, data, opt, 1)
    autodist.save(path, model, opt)
    fresh = autodist.Gossip()
    model2, _ = _parallel(fresh)
    opt2 = _plain_sgd(model2)
    autodist.load(path, model2, opt2)
    return gossip.rounds, fresh.rounds, fresh.steps, w.state(model), w.state(model2)


def test_gossip_restart_continues_the_rounds_from_rank_zeros_model(ranks, tmp_path):
    results = ranks(2, _gossip_restart, str(tmp_path / "ckpt.pt"))
    for rounds, restored, steps, _, loaded in results:
        assert rounds == restored == steps == 3
        assert_close(loaded, results[0][3], rtol=0, atol=0)


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
    with pytest.raises(ValueError, match="outer_lr must be a positive number"):
        autodist.DiLoCo(outer_lr=0)
    with pytest.raises(ValueError, match="momentum must be a number in"):
        autodist.DiLoCo(momentum=1.0)
    with pytest.raises(ValueError, match="momentum"):
        autodist.DiLoCo(momentum="high")


def test_outer_step_for_classifies_the_inner_optimizer():
    from autodist.sync.diloco import outer_step_for

    params = list(torch.nn.Linear(2, 2).parameters())
    assert outer_step_for(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == (0.5, 0.5, "sgd")
    assert outer_step_for(torch.optim.ASGD(params)) == (0.5, 0.5, "sgd")
    for adaptive in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad):
        assert outer_step_for(adaptive(params)) == (0.5, 0.5, "adaptive")
    assert outer_step_for(_Plain(params)) == (0.5, 0.5, "unknown")
    assert outer_step_for(torch.optim.LBFGS(params)) == (0.5, 0.5, "unknown")


def test_world_of_one_runs_unchanged():
    assert "RANK" not in os.environ
    x, y = w.digits_like(16)
    model, data = autodist.parallelize(w.seeded(w.mlp, 0), w.loader(x, y, 8), sync=autodist.DiLoCo(every=1))
    ref = w.train(w.seeded(w.mlp, 0), w.loader(x, y, 8), "sgd", 1)
    assert_close(w.state(w.train(model, data, "sgd", 1)), w.state(ref), rtol=0, atol=0)


def _hierarchical(across_mode):
    across = autodist.LocalSGD(every=3) if across_mode == "local" else autodist.DiLoCo(every=3)
    sync = autodist.Hierarchical(across=across, ranks_per_host=2)  # 4 ranks: hosts {0, 1} and {2, 3}
    model, data = _parallel(sync, n=48, batch=8)  # 6 steps
    states = []
    _loop(model, data, w.optimizer("adam", model), 1, lambda: states.append(w.state(model)))
    numel = sum(t.numel() for t in model.parameters())
    return states, sync.syncs, sync.bytes_across_hosts, sync.bytes_sent, numel


@pytest.mark.parametrize("across_mode", ["local", "diloco"])
def test_hierarchical_hosts_identical_every_step_and_meet_every_h(ranks, across_mode):
    results = ranks(4, _hierarchical, across_mode)
    for step in range(6):
        same_host = [results[r][0][step] for r in range(4)]
        assert_close(same_host[1], same_host[0], rtol=0, atol=0)  # exact sync within host 0
        assert_close(same_host[3], same_host[2], rtol=0, atol=0)  # and within host 1
        if (step + 1) % 3 == 0:
            assert_close(same_host[2], same_host[0], rtol=0, atol=0)  # the hosts met
        else:
            assert not torch.equal(same_host[2]["0.weight"], same_host[0]["0.weight"])
    for states, syncs, across, sent, numel in results:
        # each rank carries half the model (plus the weight slot) across hosts, ring over 2 hosts: 2 (2-1)/2
        assert syncs == 2 and across == syncs * ((numel + 1) // 2 + 1) * 4
        assert sent > across


def _hierarchical_every_step_is_exact():
    x, y = w.digits_like(22)
    ref = w.seeded(w.mlp, 0)
    _loop(ref, w.loader(x, y, 8), _plain_sgd(ref), 3)
    sync = autodist.Hierarchical(across=autodist.LocalSGD(every=1), ranks_per_host=2)
    model, data = _parallel(sync)
    _loop(model, data, _plain_sgd(model), 3)
    return w.state(ref), w.state(model)


def test_hierarchical_with_local_sgd_every_step_and_plain_sgd_is_the_exact_run(ranks):
    # 22 samples in global batches of 8: shares 2/2/2/2 then 2/2/1/1: hosts weighted by their samples
    assert_same_training(ranks(4, _hierarchical_every_step_is_exact), rtol=1e-5, atol=1e-6)


def _streamed(fragments, overlap, outer):
    diloco = autodist.DiLoCo(every=4, fragments=fragments, overlap=overlap, mix=0.0, **outer)
    model, data = _parallel(diloco, n=64, batch=8)  # 8 steps
    opt = w.optimizer("adam", model)
    before = []  # each step's parameters before the strategy's hook (the optimizer's own hook runs first)
    opt.register_step_post_hook(lambda *_: before.append(w.state(model)))
    after = []
    _loop(model, data, opt, 1, lambda: after.append(w.state(model)))
    names = [[n for n, p in model.named_parameters() if any(p is q for q in ps)] for ps, _ in diloco.parts]
    return before, after, names, diloco.offsets, diloco.bytes_sent, diloco.syncs


def test_streamed_diloco_with_one_fragment_is_plain_diloco(ranks):
    one = ranks(2, _streamed, 1, 0, {})
    plain = ranks(2, _diloco_plain)
    for (_, after, *_), state in zip(one, plain):
        assert_close(after[-1], state, rtol=0, atol=0)


def _diloco_plain():
    model, data = _parallel(autodist.DiLoCo(every=4), n=64, batch=8)
    _loop(model, data, w.optimizer("adam", model), 1)
    return w.state(model)


@pytest.mark.parametrize("overlap", [0, 1])
def test_streamed_diloco_syncs_each_fragment_every_h_steps_at_its_offset(ranks, overlap):
    results = ranks(2, _streamed, 2, overlap, {"outer_lr": 1.0, "momentum": 0.0})
    (before0, after0, names, offsets, sent, syncs), (before1, after1, *_) = results
    assert offsets == [2, 4] and syncs == 4 and all(names)
    for step in range(8):
        for f, fragment in enumerate(names):
            landed = (step + 1) % 4 == offsets[f] % 4
            for name in fragment:
                if landed:  # outer lr 1, no momentum: the mean of the replicas when the all-reduce started
                    at = before0 if overlap == 0 else after0
                    of = before1 if overlap == 0 else after1
                    mean = (at[step - overlap][name] + of[step - overlap][name]) / 2
                    assert_close(after0[step][name], after1[step][name], rtol=0, atol=0)
                    assert_close(after0[step][name], mean, rtol=1e-6, atol=1e-7)
                else:
                    assert not torch.equal(after0[step][name], after1[step][name])
    assert sent == results[1][4] > 0


def _drift_reported():
    sync = autodist.LocalSGD(every=3)
    model, data = _parallel(sync, n=32, batch=8)  # 4 steps: the last average at step 3
    _loop(model, data, w.optimizer("adam", model), 1)
    metrics = autodist.engine.Metrics()
    metrics.update(1.0, 1, 2)
    between = metrics.reduce(model)
    autodist.synchronize_model(model, what="parameters")
    exact, _ = autodist.parallelize(w.seeded(w.mlp, 0))
    return between, autodist.engine.drift(model), metrics.reduce(exact), autodist.engine.epoch_summary(
        0, between, None, 1.0)


def test_drift_is_reported_through_engine_metrics(ranks):
    between, after, exact, line = ranks(2, _drift_reported)[0]
    assert 0 < between["spread"] < 1 and between["syncs"] == 1 and between["bytes_sent"] > 0
    assert after["spread"] < 1e-7
    assert "spread" not in exact and exact["count"] == 4
    assert f"spread {between['spread']:.2e}" in line


class _Plain(torch.optim.Optimizer):
    """An optimizer class autodist does not know: plain gradient steps."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def _inner(name, model):
    return _Plain(model.parameters()) if name == "plain" else w.optimizer(name, model)


def _logged(runs):
    """Each (DiLoCo options, inner optimizer) trains a step; per run: the outer values before the first step
    and after it, the class they were chosen for, and the autodist log lines of INFO and above."""
    import logging

    logger = logging.getLogger("autodist")
    level = logger.level
    results = []
    for options, inner in runs:
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            diloco = autodist.DiLoCo(every=2, **options)
            model, data = _parallel(diloco)
            before = (diloco.outer_lr, diloco.momentum)
            _loop(model, data, _inner(inner, model), 1)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        group = diloco.outer.param_groups[0]
        results.append({"before": before, "after": (diloco.outer_lr, diloco.momentum), "for": diloco.chosen_for,
                        "outer_sgd": (group["lr"], group["momentum"], group["nesterov"]), "repr": repr(diloco),
                        "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
                        "infos": [r.getMessage() for r in records if r.levelno == logging.INFO]})
    return results


def test_diloco_chooses_the_outer_step_from_the_inner_optimizer(ranks):
    sgd, adamw, adam = ranks(2, _logged, [({}, "sgd"), ({}, "adamw"), ({}, "adam")])[0]
    assert sgd["before"] == (None, None) and sgd["after"] == (0.5, 0.5) and sgd["for"] == "SGD"
    assert sgd["outer_sgd"] == (0.5, 0.5, True)  # Nesterov, as asked
    assert adamw["after"] == adam["after"] == (0.5, 0.5) and adamw["outer_sgd"] == (0.5, 0.5, True)
    assert adamw["for"] == "AdamW" and adam["for"] == "Adam"
    assert "outer_lr=0.5, momentum=0.5" in sgd["repr"]
    for run, inner in ((sgd, "SGD"), (adamw, "AdamW")):
        assert run["warnings"] == []  # chosen values never warn
        chosen = [m for m in run["infos"] if "set them with autodist.DiLoCo(outer_lr=" in m]
        assert len(chosen) == 1 and f"outer_lr and momentum chosen for the inner {inner} (" in chosen[0]
    assert all("outer_lr / (1 - momentum) = 1" in run["infos"][-1] for run in (sgd, adamw, adam))


def test_diloco_values_set_win_and_only_unset_ones_are_chosen(ranks):
    both, lr_only, momentum_only = ranks(2, _logged, [({"outer_lr": 1.0, "momentum": 0.0}, "adam"),
                                                      ({"outer_lr": 0.3}, "adam"), ({"momentum": 0.2}, "sgd")])[0]
    assert both["before"] == both["after"] == (1.0, 0.0) and both["for"] is None
    assert not any("chosen for" in m for m in both["infos"])
    assert both["outer_sgd"] == (1.0, 0.0, False)  # no momentum: no Nesterov
    assert lr_only["before"] == (0.3, None) and lr_only["after"] == (0.3, 0.5)
    assert "outer_lr=0.3, momentum=0.5" in lr_only["infos"][-1] and "): momentum chosen for the inner Adam (" \
        in lr_only["infos"][-1]
    assert momentum_only["after"] == (0.5, 0.2) and momentum_only["warnings"] == []


def test_diloco_over_an_unknown_optimizer_takes_the_same_values_and_says_so(ranks):
    on_rank0, on_rank1 = ranks(2, _logged, [({}, "plain")])
    assert on_rank0[0]["after"] == (0.5, 0.5) and on_rank0[0]["for"] == "_Plain"
    assert len(on_rank0[0]["warnings"]) == 1 and on_rank1[0]["warnings"] == []
    message = on_rank0[0]["warnings"][0]
    assert "outer_lr and momentum chosen as 0.5 and 0.5, measured over torch's SGD and adaptive optimizers (" \
        in message and "AdamW" in message and "not over _Plain" in message
    assert "autodist.DiLoCo(outer_lr=..., momentum=...)" in message


def test_diloco_over_sgd_warns_about_a_reach_the_user_set(ranks):
    on_rank0, on_rank1 = ranks(2, _logged, [({"outer_lr": 0.7, "momentum": 0.9}, "sgd"),
                                            ({"outer_lr": 0.7, "momentum": 0.9}, "adam"),
                                            ({"outer_lr": 0.7, "momentum": 0.5}, "sgd")])
    risky, adaptive, bounded = on_rank0
    assert len(risky["warnings"]) == 1 and all(r["warnings"] == [] for r in on_rank1)  # once, on rank 0
    assert "7.0x" in risky["warnings"][0] and "leave outer_lr and momentum unset" in risky["warnings"][0]
    assert adaptive["warnings"] == [] and bounded["warnings"] == []  # over Adam; a reach of 1.4 over SGD


def _choice_survives_a_checkpoint(path, inner, saved_options, loaded_options):
    """Train 3 steps with ``inner`` and save; load into a fresh DiLoCo (before any step of its own) and train
    one step with plain SGD: the outer values at each point. Also a checkpoint saved before any step."""
    first = autodist.DiLoCo(every=3, **saved_options)
    model, data = _parallel(first)
    opt = _inner(inner, model)
    _loop(model, data, opt, 1)
    autodist.save(path, model, opt)
    fresh = autodist.DiLoCo(every=3, **loaded_options)
    model2, data2 = _parallel(fresh)
    opt2 = _plain_sgd(model2)
    autodist.load(path, model2, opt2 if inner == "sgd" else None)
    loaded = (fresh.outer_lr, fresh.momentum, fresh.chosen_for, fresh.outer.param_groups[0]["lr"],
              fresh.outer.param_groups[0]["momentum"])
    _loop(model2, data2, opt2, 1)  # an SGD now: the loaded values stay
    unstepped = autodist.DiLoCo(every=3)
    model3, _ = _parallel(unstepped)
    autodist.save(path + ".early", model3, None)  # nothing chosen yet
    late = autodist.DiLoCo(every=3)
    model4, data4 = _parallel(late)
    autodist.load(path + ".early", model4, None)
    early = (late.outer_lr, late.momentum)
    _loop(model4, data4, w.optimizer("adam", model4), 1)
    return (first.outer_lr, first.momentum), loaded, (fresh.outer_lr, fresh.momentum, fresh.chosen_for), early, \
        (late.outer_lr, late.momentum), fresh.state_dict()["chosen"]


def test_diloco_checkpoint_keeps_the_chosen_outer_step(ranks, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    for saved, loaded, after, early, late, chosen in ranks(2, _choice_survives_a_checkpoint, path, "adam", {}, {}):
        assert saved == (0.5, 0.5) and loaded == (0.5, 0.5, "Adam", 0.5, 0.5)
        assert after == (0.5, 0.5, "Adam")  # kept, not chosen again for the SGD that steps now
        assert early == (None, None) and late == (0.5, 0.5) and chosen  # the early one chose at its first step
    results = ranks(2, _choice_survives_a_checkpoint, path, "sgd", {}, {"momentum": 0.2})
    for saved, loaded, after, *_ in results:  # a value set in the loading run wins over the checkpoint's
        assert saved == (0.5, 0.5) and loaded == (0.5, 0.2, "SGD", 0.5, 0.2) and after == (0.5, 0.2, "SGD")
    results = ranks(2, _choice_survives_a_checkpoint, path, "adam", {"outer_lr": 0.6, "momentum": 0.8}, {})
    for saved, loaded, after, *_ in results:  # values the saving run set are the loading run's, when it sets none
        assert saved == (0.6, 0.8) and loaded == (0.6, 0.8, None, 0.6, 0.8) and after == (0.6, 0.8, None)


def test_bad_streaming_and_hierarchical_arguments():
    with pytest.raises(ValueError, match="must divide every"):
        autodist.DiLoCo(every=10, fragments=3)
    with pytest.raises(ValueError, match="overlap must be below every/fragments = 5"):
        autodist.DiLoCo(every=10, fragments=2, overlap=5)
    with pytest.raises(ValueError, match="mix"):
        autodist.DiLoCo(overlap=1, mix=2)
    with pytest.raises(TypeError, match="LocalSGD"):
        autodist.Hierarchical(across=autodist.Gossip())
    with pytest.raises(ValueError, match="ranks_per_host"):
        autodist.Hierarchical(ranks_per_host=0)
