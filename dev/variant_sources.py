"""Kernel variants are patches against kernels/ (dev/variants/NN_name.patch); this makes one into sources.

Entry point: ``materialize(patch) -> Path`` (a fresh directory holding kernels/ with the patch applied).
"""
import shutil
import subprocess
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def materialize(patch: Path) -> Path:
    sources = Path("/tmp") / f"fxfuse-variant-{patch.stem}" / "src"
    shutil.rmtree(sources, ignore_errors=True)
    sources.mkdir(parents=True)
    for source in [*KERNELS.glob("*.cu"), *KERNELS.glob("*.cuh")]:
        shutil.copy(source, sources)
    subprocess.run(["patch", "-s", "-p1", "-d", str(sources), "-i", str(Path(patch).resolve())], check=True)
    return sources
