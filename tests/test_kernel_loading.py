"""fxfuse.kernels.load() where the kernels cannot run: without a GPU, without nvcc, or when the build fails, it says
so once and returns False, then returns False at once on later calls (no second warning, no second build), and
writes no completed build into the cache, so that the fused op keeps its reference implementation. Runs anywhere:
a machine's own GPU and nvcc are hidden from fxfuse.kernels, and the loader's state is restored afterwards.
"""
import logging

import pytest
import torch

from fxfuse import kernels


@pytest.fixture
def unloaded(monkeypatch, tmp_path):
    """The loader as in a fresh process, with an empty cache."""
    monkeypatch.setattr(kernels, "_loaded", False)
    monkeypatch.setattr(kernels, "_unavailable", False)
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def gpu_and_nvcc(monkeypatch):
    """A machine that looks as if it had a Hopper GPU and nvcc."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(kernels, "_find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(kernels, "_arch_flags", lambda: ["-gencode=arch=compute_90a,code=sm_90a"])


def load_twice(caplog) -> list[str]:
    """load()'s results must both be False; returns the warnings logged."""
    with caplog.at_level(logging.WARNING, logger="fxfuse"):
        assert kernels.load() is False
        assert kernels.load() is False
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_without_a_gpu_load_says_so_once(unloaded, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    warnings = load_twice(caplog)
    assert len(warnings) == 1 and "no CUDA GPU" in warnings[0], warnings
    assert "runs its reference implementation" in warnings[0]


def test_without_nvcc_load_says_so_once(unloaded, gpu_and_nvcc, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_find_nvcc", lambda: None)
    warnings = load_twice(caplog)
    assert len(warnings) == 1 and "nvcc not found" in warnings[0], warnings


def test_a_failed_build_says_so_once_and_leaves_no_completed_build(unloaded, gpu_and_nvcc, monkeypatch, caplog):
    builds = []

    def failing_build(name, build_dir, arch_flags):
        builds.append(name)
        raise RuntimeError("Error building extension 'fxfuse_kernels'")

    monkeypatch.setattr(kernels, "_build", failing_build)
    warnings = load_twice(caplog)
    assert len(warnings) == 1 and "failed to build or load" in warnings[0], warnings
    assert "Error building extension" in warnings[0]
    assert len(builds) == 1, "a later call built again"
    assert not list(unloaded.glob("*/complete")), "a failed build was marked complete"
