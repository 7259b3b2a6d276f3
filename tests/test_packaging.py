"""Packaging: `patterns/` and `kernels/` install as `fxfuse.patterns` and `fxfuse.kernels`, in the editable
install the tests run from and in a regular wheel, which must work on its own (outside this checkout).
"""
import importlib
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ["fxfuse", "patterns", "kernels", "pyproject.toml", "README.md"]


@pytest.mark.parametrize("name", ["fxfuse.patterns", "fxfuse.kernels"])
def test_subpackage_imports_from_its_own_directory(name):
    module = importlib.import_module(name)
    directory = name.split(".")[1]
    assert pathlib.Path(module.__file__).resolve().parent == REPO / directory


def test_patterns_register_the_built_in_idioms():
    import fxfuse.patterns  # noqa: F401
    from fxfuse.idioms import IDIOMS
    assert {"silu", "mish"} <= {i.op for i in IDIOMS}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built from a copy of the sources, so that the build leaves nothing in the checkout."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.so", "*.o")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        elif path.exists():
            shutil.copy(path, source / name)
    dist = work / "dist"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(dist), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = dist.glob("fxfuse-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_the_subpackages_and_the_kernel_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "fxfuse/__init__.py" in names
    assert "fxfuse/patterns/__init__.py" in names
    assert "fxfuse/kernels/__init__.py" in names
    from fxfuse.kernels import SOURCE_DIR, translation_units

    sources = [*translation_units(SOURCE_DIR), *SOURCE_DIR.glob("*.cuh")]
    kernel_sources = {f"fxfuse/kernels/{path.name}" for path in sources}
    assert any(name.endswith(".cpp") for name in kernel_sources), "the host-only translation units are .cpp files"
    missing = kernel_sources - set(names)
    assert not missing, f"kernel sources missing from the wheel: {sorted(missing)}"
    assert not [n for n in names if n.startswith(("patterns/", "kernels/", "tests/"))], names


@pytest.mark.slow
def test_wheel_install_works_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                             str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    script = (
        "import pathlib, torch, fxfuse, fxfuse.patterns, fxfuse.kernels\n"
        f"site = pathlib.Path({str(site)!r}).resolve()\n"
        "for module in (fxfuse, fxfuse.patterns, fxfuse.kernels):\n"
        "    assert site in pathlib.Path(module.__file__).resolve().parents, module.__file__\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.LayerNorm(16))\n"
        "x = torch.randn(3, 8)\n"
        "fxfuse.testing.assert_fuses(model, (x,), regions=1)\n"
        "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**_environment(), "PYTHONPATH": str(site)})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def _environment():
    import os
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
