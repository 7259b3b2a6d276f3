"""The C++ autograd formulas of the fused ops (kernels/autograd.cpp, what CUDA tensors get) on the CPU-only CI.

That file is built alone for AutogradCPU and loaded in a process of its own (tests/cpp_autograd_checks.py): in
this one it would take over every CPU call of the fused ops. There the ops' CPU references run below it, so each
check compares the C++ formula with autograd through the reference: gradients for every program, bias or none,
any subset of inputs requiring grad, a loss on either output; second-order gradients; compiled autograd with
fullgraph; CPU autocast in train mode. Skipped where no C++ compiler is found.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS_SCRIPT = Path(__file__).resolve().parent / "cpp_autograd_checks.py"

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build kernels/autograd.cpp for the CPU")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cpp_autograd_cpu")


@pytest.mark.parametrize("check", ["node", "gradients", "second-order", "compiled-autograd", "autocast",
                                   "inference-tensors", "empty-features"])
def test_cpp_autograd_formula_on_the_cpu(build_dir, check):
    run = subprocess.run([sys.executable, str(CHECKS_SCRIPT), str(build_dir), check], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{check} failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert f"{check}: ok" in run.stdout
