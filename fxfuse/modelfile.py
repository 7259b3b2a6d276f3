"""Load KernelBench-style model files: a module that defines ``Model``, ``get_inputs()`` and
``get_init_inputs()``, with optional module globals and a ``SMALL`` dict of smaller sizes for CPU runs.

Entry point: ``load_model_file(path, small=False) -> ModelFile``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch.nn as nn

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


@dataclass
class ModelFile:
    path: Path
    module: ModuleType

    @property
    def name(self) -> str:
        return self.path.stem

    def build(self, seed: int = 0) -> tuple[nn.Module, list]:
        """A fresh model (eval mode) and its inputs, from the file's own get_init_inputs() and get_inputs()."""
        import torch

        torch.manual_seed(seed)
        model = self.module.Model(*self.module.get_init_inputs()).eval()
        return model, list(self.module.get_inputs())


def load_model_file(path, small: bool = False) -> ModelFile:
    """Import a model file; with `small`, apply its SMALL sizes (if any) to the module globals."""
    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(f"fxfuse_model_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"fxfuse: cannot load a model file from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for required in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, required):
            raise ValueError(f"fxfuse: {path} defines no {required}; a model file needs Model, get_inputs() "
                             f"and get_init_inputs()")
    if small:
        for name, value in getattr(module, "SMALL", {}).items():
            setattr(module, name, value)
    return ModelFile(path, module)


def example_files() -> list[Path]:
    """The bundled examples (examples/*.py beside the package, in a source checkout)."""
    return sorted(EXAMPLES_DIR.glob("*.py"))
