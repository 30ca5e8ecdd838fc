"""Bad arguments to the public functions: each raises at once, naming the argument and what to pass."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from torch import nn

import autodist


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


CASES = [
    # (what, call, error type, words the message must hold)
    ("backend", lambda: autodist.parallelize(_mlp(), backend="mpi2"), ValueError, "'gloo', 'nccl' or None"),
    ("backend type", lambda: autodist.parallelize(_mlp(), backend=5), ValueError, "got 5"),
    ("meta model", lambda: autodist.parallelize(nn.Linear(4, 4, device="meta")), ValueError, "to_empty"),
    ("model class", lambda: autodist.parallelize(nn.Linear), TypeError, "Expect nn.Module"),
    ("lazy model", lambda: autodist.parallelize(nn.Sequential(nn.LazyLinear(4), nn.ReLU())), ValueError,
     "lazy parameters not created yet (0.weight, 0.bias"),
    ("frozen model", lambda: autodist.parallelize(_mlp().requires_grad_(False)), ValueError, "no trainable"),
    ("mp zero", lambda: autodist.parallelize(_mlp(), mp=0), ValueError, "mp must be a positive int"),
    ("mp float", lambda: autodist.parallelize(_mlp(), mp=2.0), ValueError, "mp must be a positive int"),
    ("mp_layers int", lambda: autodist.parallelize(_mlp(), mp_layers=5), ValueError, "mp_layers must be"),
    ("mp_layers unknown", lambda: autodist.parallelize(_mlp(), mp_layers=["fc9"]), ValueError, "['fc9']"),
    ("bucket_mb text", lambda: autodist.parallelize(_mlp(), bucket_mb="25"), ValueError, "bucket_mb must be"),
    ("bucket_mb zero", lambda: autodist.parallelize(_mlp(), first_bucket_mb=0), ValueError, "first_bucket_mb"),
    ("sync_buffers", lambda: autodist.parallelize(_mlp(), sync_buffers="no"), TypeError, "True or False"),
    ("sync", lambda: autodist.parallelize(_mlp(), sync="bogus"), ValueError, "sync must be"),
    ("batch_dim", lambda: autodist.parallelize(_mlp(), batch_dim=-1), ValueError, "batch_dim must be"),
    ("samples", lambda: autodist.parallelize(_mlp(), samples=3), TypeError, "samples must be a callable"),
    ("example", lambda: autodist.parallelize(_mlp(), example=object()), TypeError, "example must be"),
    ("data", lambda: autodist.parallelize(_mlp(), "abc"), TypeError, "cannot shard data of type str"),
    ("explain batch_size", lambda: autodist.explain(_mlp(), mp=2, batch_size="128"), ValueError,
     "batch_size must be"),
    ("explain example", lambda: autodist.explain(_mlp(), mp=2, example=[1, 2]), TypeError, "example must be"),
    ("explain mp", lambda: autodist.explain(_mlp(), mp=-1), ValueError, "mp must be"),
    ("explain model", lambda: autodist.explain("net", mp=2), TypeError, "Expect nn.Module"),
    ("gather model", lambda: autodist.gather_state_dict("x"), TypeError, "Expect nn.Module"),
    ("init backend", lambda: autodist.init(backend="mpi2"), ValueError, "'gloo', 'nccl' or None"),
    ("init timeout", lambda: autodist.init(timeout=5), TypeError, "datetime.timedelta"),
]


@pytest.mark.parametrize("what,call,error,words", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_is_named(what, call, error, words):
    with pytest.raises(error) as caught:
        call()
    assert words in str(caught.value)


_BUILT_BEFORE_INIT = """
import torch, autodist
from autodist.layers import MPBaseLinear
layer = MPBaseLinear(8, 4)            # before autodist.init(): no group yet, so a group of one
try:
    autodist.parallelize(torch.nn.Sequential(layer))
except ValueError as err:
    print("ERROR:", err)
"""


@pytest.mark.slow
def test_mp_layer_built_before_init_is_named(tmp_path):
    # two ranks as mpirun starts them (no torchrun), each building its layer before autodist.init()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_"))}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILT_BEFORE_INIT], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env=env | {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                                         "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                         "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for out in outputs:
        assert "ERROR: MP layer '0'" in out and "build MP layers after autodist.init()" in out, out
