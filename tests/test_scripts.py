"""scripts/gpu_check.sh, on a machine without CUDA: it checks that the CUDA tests are collected and says so in
one line, status 0, and fails where they no longer import (where there is a GPU it runs them and the GPU
benchmarks)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it runs the whole GPU check")
def test_gpu_check_without_cuda_is_one_line_and_status_0_after_collecting_the_cuda_tests():
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], capture_output=True, text=True,
                         env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip()
    assert "\n" not in line and line.startswith("gpu_check: no CUDA device here, nothing run; the "), line
    count = int(line.split("the ", 1)[1].split()[0])
    assert count >= 10 and line.endswith("CUDA tests of tests/gpu are collected and run where there is one"), line


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it runs the whole GPU check")
def test_gpu_check_fails_where_a_cuda_test_no_longer_imports(tmp_path):
    """A copy of the checkout whose CUDA test module is broken: the check fails, naming it, so it cannot rot."""
    copy = tmp_path / "checkout"
    (copy / "scripts").mkdir(parents=True)
    (copy / "tests" / "gpu").mkdir(parents=True)
    (copy / "scripts" / "gpu_check.sh").write_text(open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read())
    (copy / "tests" / "gpu" / "test_cuda.py").write_text("import no_such_module_for_the_gpu_check\n")
    out = subprocess.run(["bash", str(copy / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no_such_module_for_the_gpu_check" in out.stdout and "do not collect" in out.stderr, out.stdout + out.stderr
