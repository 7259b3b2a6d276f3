"""Kernel variants are patches against kernels/ (dev/variants/NN_name.patch); this makes one into sources and
builds it.

Entry points: ``materialize(patch) -> Path`` (a fresh directory holding kernels/ with the patch applied);
``load_kernels(arg) -> str`` (builds and registers the kernels of a patch, or loads kernels/ for "current").
"""
import shutil
import subprocess
import time
from pathlib import Path

from fxfuse.kernels import translation_units

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def materialize(patch: Path) -> Path:
    """The patched sources; files whose text did not change keep their time stamps, so a rebuild is a no-op."""
    sources = Path("/tmp") / f"fxfuse-variant-{patch.stem}" / "src"
    fresh = sources.with_name("fresh")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    for source in [*translation_units(KERNELS), *KERNELS.glob("*.cuh")]:
        shutil.copy(source, fresh)
    subprocess.run(["patch", "-s", "-p1", "-d", str(fresh), "-i", str(Path(patch).resolve())], check=True)
    sources.mkdir(parents=True, exist_ok=True)
    for source in fresh.iterdir():
        kept = sources / source.name
        if not kept.exists() or kept.read_bytes() != source.read_bytes():
            shutil.copy(source, kept)
    return sources


def load_kernels(arg: str) -> str:
    """Builds the variant `arg` (a patch path) into its own build directory, or loads kernels/ as it is through
    fxfuse.kernels for "current", and registers its CUDA implementations of the fxfuse ops (one variant per
    process); returns its name."""
    import fxfuse.kernels  # also defines the ops the library implements
    from torch.utils import cpp_extension

    from fxfuse.kernels import NVCC_FLAGS, _arch_flags, _cublaslt_link_flags

    if arg == "current":  # the package's own cached build
        assert fxfuse.kernels.load()
        return "current"
    name = Path(arg).stem
    sources = materialize(Path(arg))
    build_dir = Path("/tmp") / f"fxfuse-variant-{name}" / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cpp_extension.load(name=f"fxfuse_variant_{name}", sources=[str(p) for p in translation_units(sources)],
                       extra_cuda_cflags=NVCC_FLAGS + _arch_flags(), extra_ldflags=_cublaslt_link_flags(),
                       build_directory=str(build_dir),
                       is_python_module=False)
    print(f"{name}: built in {time.perf_counter() - start:.0f} s")
    fxfuse.kernels._loaded = True  # fxfuse.optimize's own load() must not register kernels/ over the variant
    return name
