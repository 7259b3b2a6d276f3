"""Builds and loads the CUDA implementation of ``torch.ops.fxfuse.gemm_epilogue``.

Entry points: ``load()`` (optimize(), the backend and the fused ops' first CUDA call run it; cheap once loaded),
``loaded()`` and ``supported_ops()``.

The sources (``*.cu``, ``*.cuh``, and the host-only ``*.cpp`` here) are compiled once with
``torch.utils.cpp_extension`` and ninja for the visible GPUs' architectures into a cache directory
(``~/.cache/fxfuse``, or ``$FXFUSE_CACHE_DIR``) keyed by a hash of the sources, the torch and CUDA versions and
the archs; later processes load the cached library with ``torch.ops.load_library``. A file lock keeps concurrent
builders from corrupting the cache. Without a GPU or nvcc, or when the build fails, ``load()`` logs one warning and
returns False (from then on at once, without trying again in this process), and the op keeps running its reference
implementation.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger("fxfuse")

SOURCE_DIR = Path(__file__).resolve().parent
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]

_loaded = False
_unavailable = False  # a load failed in this process: later calls return False at once


def cache_root() -> Path:
    return Path(os.environ.get("FXFUSE_CACHE_DIR") or Path.home() / ".cache" / "fxfuse")


def translation_units(directory: Path) -> list[Path]:
    """The translation units in `directory`: kernels in .cu files, host-only code (the ops' launchers) in .cpp."""
    return sorted(directory.glob("*.cu")) + sorted(directory.glob("*.cpp"))


def _arch_flags() -> list[str]:
    """-gencode flags for every visible GPU's compute capability (sm_90a on Hopper)."""
    flags = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        arch = f"{major}{minor}" + ("a" if major == 9 and minor == 0 else "")
        flag = f"-gencode=arch=compute_{arch},code=sm_{arch}"
        if flag not in flags:
            flags.append(flag)
    return flags


def build_directory(arch_flags: list[str]) -> Path:
    """Where the build for these archs lives: its ninja files and objects, the library and its completion mark."""
    return cache_root() / f"gemm_epilogue-{build_key(arch_flags)}"


def build_key(arch_flags: list[str]) -> str:
    digest = hashlib.sha256()
    for path in translation_units(SOURCE_DIR) + sorted(SOURCE_DIR.glob("*.cuh")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for item in [torch.__version__, str(torch.version.cuda), *arch_flags, *NVCC_FLAGS]:
        digest.update(item.encode())
    return digest.hexdigest()[:16]


def _unavailable_because(message: str) -> bool:
    """Logs why the kernels cannot run (once: later calls of load() return before this) and returns False."""
    global _unavailable
    _unavailable = True
    logger.warning("fxfuse: %s; torch.ops.fxfuse.gemm_epilogue runs its reference implementation", message)
    return False


def _find_nvcc() -> str | None:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    candidate = os.path.join(home, "bin", "nvcc") if home else None
    if candidate and os.path.exists(candidate):
        return candidate
    return shutil.which("nvcc")


def loaded() -> bool:
    """Whether this process has loaded the kernels (load() returned True)."""
    return _loaded


def load() -> bool:
    """Loads the kernels (building them once if needed); False where this machine cannot run them."""
    global _loaded
    if _loaded or _unavailable:
        return _loaded
    from fxfuse import library  # noqa: F401  (defines the fxfuse ops the kernels implement)

    if not torch.cuda.is_available() or torch.version.cuda is None:
        return _unavailable_because("no CUDA GPU")
    if _find_nvcc() is None:
        return _unavailable_because("nvcc not found, so the CUDA kernels cannot be built")

    arch_flags = _arch_flags()
    name = f"fxfuse_kernels_{build_key(arch_flags)}"
    build_dir = build_directory(arch_flags)
    complete = build_dir / "complete"
    try:
        if not complete.exists():
            build_dir.mkdir(parents=True, exist_ok=True)
            # not build_dir / "lock": cpp_extension's own FileBaton takes that name and would wait on ours forever
            with open(build_dir.with_name(build_dir.name + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder finishes first; then we find it complete
                if not complete.exists():
                    _build(name, build_dir, arch_flags)
                    complete.write_text(name + "\n")
                    _loaded = True
                    return True
        torch.ops.load_library(str(build_dir / f"{name}.so"))
    except Exception as error:  # a failed build or load must not break the model: the reference still runs
        return _unavailable_because(f"the CUDA kernels failed to build or load ({error})")
    _loaded = True
    return True


def _cublaslt_link_flags() -> list[str]:
    """cuBLASLt's library where the toolkit has its header: gemm_epilogue.cpp calls it only then (else at::linear)."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    return ["-lcublasLt"] if home and (Path(home) / "include" / "cublasLt.h").exists() else []


def _build(name: str, build_dir: Path, arch_flags: list[str]) -> None:
    from torch.utils import cpp_extension

    archs = ", ".join(flag.rsplit("=", 1)[1] for flag in arch_flags)
    print(f"fxfuse: building the CUDA kernels for {archs} into {build_dir} (once per version) ...", flush=True)
    start = time.perf_counter()
    cpp_extension.load(name=name, sources=[str(p) for p in translation_units(SOURCE_DIR)],
                       extra_cuda_cflags=NVCC_FLAGS + arch_flags, extra_ldflags=_cublaslt_link_flags(),
                       build_directory=str(build_dir),
                       is_python_module=False, verbose=False)
    print(f"fxfuse: built the CUDA kernels in {time.perf_counter() - start:.0f} s", flush=True)


def supported_ops() -> list[str]:
    """The epilogue ops the loaded kernels implement (call after a successful ``load()``)."""
    return torch.ops.fxfuse.cuda_supported_ops().split(",")


def row_chains() -> list[list[str]]:
    """The op sequences whose row programs the loaded kernels compile whole (FXFUSE_ROW_CHAINS, then
    FXFUSE_LIBM_ROW_CHAINS)."""
    return [chain.split(",") for chain in torch.ops.fxfuse.cuda_row_chains().split(";")]


def tail_chains() -> list[list[str]]:
    """The op sequences whose broadcast tails the loaded kernels compile whole (FXFUSE_TAIL_CHAINS)."""
    return [chain.split(",") for chain in torch.ops.fxfuse.cuda_tail_chains().split(";")]
