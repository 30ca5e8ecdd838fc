"""parallelize in a world of one, and errors for bad input (no process group needed)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import autodist
import workloads as w


def test_world_of_one_returns_model_and_data_unchanged():
    model, data = w.mlp(), (torch.zeros(4, 6), torch.zeros(4))
    before = w.state(model)
    out_model, out_data = autodist.parallelize(model, data)
    assert out_model is model and out_data is data
    torch.testing.assert_close(w.state(model), before, rtol=0, atol=0)
    assert not model._forward_pre_hooks  # nothing installed: no overhead
    with autodist.no_sync(model):
        pass
    autodist.synchronize_model(model)  # a no-op, no process group needed
    assert autodist.init().size == 1 and autodist.init() is autodist.init()
    other = w.mlp()
    assert autodist.parallelize(other, mp=2)[0] is other and not other._forward_pre_hooks


@pytest.mark.parametrize("model, kwargs, error, words", [
    ("not a model", {}, TypeError, "Expect nn.Module for model, str found"),
    (nn.ReLU(), {}, ValueError, "no trainable parameters"),
    (nn.Linear(2, 2).requires_grad_(False), {}, ValueError, "no trainable parameters"),
    (nn.Linear(2, 2), {"sync": "later"}, ValueError, "sync must be 'backward'"),
    (nn.Linear(2, 2), {"mp": 0}, ValueError, "mp must be a positive int"),
    (nn.Linear(2, 2), {"bucket_mb": 0}, ValueError, "bucket_mb must be a positive number"),
])
def test_bad_arguments_get_clear_errors(model, kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        autodist.parallelize(model, **kwargs)


def test_bad_data_fails_in_a_world_of_one_too():
    with pytest.raises(ValueError, match="different lengths"):
        autodist.parallelize(nn.Linear(2, 2), (torch.zeros(3, 2), torch.zeros(4)))


def test_synchronize_model_checks_its_arguments():
    with pytest.raises(ValueError, match="'gradients' or 'parameters'"):
        autodist.synchronize_model(nn.Linear(2, 2), what="buffers")
    with pytest.raises(TypeError, match="Expect nn.Module"):
        autodist.synchronize_model("model")


def test_the_public_names_import_as_they_always_did():
    """The package moved into subsystem folders; what users import did not move."""
    import subprocess
    import sys

    code = (
        "import autodist, autodist.engine, autodist.comm, autodist.checkpoint\n"
        "from autodist import *\n"
        "from autodist.engine import Metrics, prefetch, evaluate, progress, rank_logger, log_epoch, drift\n"
        "from autodist.comm import all_reduce, broadcast, all_gather, reduce_scatter, send, recv, host, ring_bytes\n"
        "from autodist.checkpoint import CheckpointError, save, load, resume\n"
        "from autodist.layers import (MPInitialReshape, MPInitialLinear, MPBaseReshape, MPBaseLinear, MPTanh,\n"
        "                             ColumnParallelLinear, RowParallelLinear, MPMultiheadAttention)\n"
        "from autodist.cli import main\n"
        "assert autodist.engine.Metrics is Metrics and autodist.checkpoint.save is autodist.save\n"
        "assert all(hasattr(autodist, name) for name in autodist.__all__)\n"
    )
    # a fresh interpreter: `import autodist.engine` must work before anything imported the module by its new path
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_model_parallel_split_plan_and_the_layout_plan_have_names_apart():
    """explain(model, mp=K) returns a SplitPlan (how each layer is split); plan() a ParallelPlan (the layout). The
    split's old name, autodist.Plan, still works, with a DeprecationWarning naming the new one."""
    split = autodist.explain(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), mp=2)
    assert isinstance(split, autodist.SplitPlan) and "SplitPlan" in autodist.__all__ and "Plan" not in autodist.__all__
    with pytest.warns(DeprecationWarning, match="autodist.Plan is now autodist.SplitPlan"):
        assert autodist.Plan is autodist.SplitPlan
    with pytest.raises(AttributeError, match="no attribute 'Plann'"):
        autodist.Plann  # noqa: B018
