"""fxfuse: a torch.fx pass that fuses a GEMM and its epilogue (bias, activations, norms, row reductions)
into one op, ``torch.ops.fxfuse.gemm_epilogue``, backed by hand-written CUDA kernels.

Entry points: ``optimize(model, example_inputs=None)``, ``explain(model, example_inputs=None)``,
``torch.compile(model, backend="fxfuse")`` (or ``backend=make_backend(inner=...)``; see docs/BACKEND.md) and
``idiom`` (declare a spelled-out op of your own).
"""
from . import library  # noqa: F401  (registers the torch.library ops)
from .api import explain, optimize
from .idioms import idiom
from .report import Report
from . import testing  # noqa: F401
from .backend import make_backend, register as _register_backend

_register_backend()  # torch.compile(model, backend="fxfuse")

__all__ = ["optimize", "explain", "idiom", "Report", "make_backend"]
