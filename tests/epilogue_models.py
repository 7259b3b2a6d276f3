"""Small models and checks shared by the CPU tests: a GEMM followed by an epilogue written as a function.

``GemmThen(epilogue, **extras)`` is ``nn.Linear(IN, OUT)`` followed by ``epilogue(self, h, y)`` where ``h`` is
the model input, ``y`` an optional second input, and ``extras`` become submodules, parameters or buffers of
the model (so the epilogue can use ``self.norm`` or ``self.bias``). The epilogue calls ``self.fc`` itself,
so it may spell the GEMM any way it likes.

``assert_whole_chain_fused`` is ``fxfuse.testing.assert_fuses`` plus the check that the optimized graph
computes nothing but fused ops (a transposed weight view aside).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from fxfuse.api import assert_is_none, require_traced_as_tensor
from fxfuse.epilogue import EPILOGUE_OPS
from fxfuse.library import FUSED_OPS, gemm_epilogue_train
from fxfuse.rewrite import GRAPH_HELPERS
from fxfuse.testing import assert_fuses

IN, OUT, BATCH = 24, 40, 3  # 40 output features: not a multiple of 32


class GemmThen(nn.Module):
    def __init__(self, epilogue, in_features=IN, out_features=OUT, bias=True, **extras):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features, bias=bias)
        for name, value in extras.items():
            if isinstance(value, nn.Module):
                self.add_module(name, value)
            elif isinstance(value, nn.Parameter):
                self.register_parameter(name, value)
            else:
                self.register_buffer(name, value)
        self.epilogue = epilogue

    def forward(self, x, y=None):
        return self.epilogue(self, x, y)


class GemmThenTwoArguments(nn.Module):
    """`epilogue(h, a, b)` of the GEMM's output h and two forward arguments."""

    def __init__(self, epilogue):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.epilogue = epilogue

    def forward(self, x, a, b):
        return self.epilogue(self.fc(x), a, b)


# Nodes a fully fused graph may still hold besides the fused ops (and their eval-mode checks): inputs,
# attributes, the output, the transpose of a weight that the GEMM reads as `x @ W`, and the result taken out of
# a training op's (out, gemm_out).
_BOOKKEEPING = {"placeholder", "get_attr", "output"}


_REFERENCES = {spec.reference for spec in EPILOGUE_OPS.values()}


def leftover_compute(module: nn.Module) -> list[str]:
    """The compute nodes of every graph in `module` other than fused ops, weight transposes and the steps a fused op's
    program computes of outside tensors alone (rewrite's hoist_param_steps: an epilogue op's reference of inputs,
    attributes and other such steps)."""
    left = []
    for graph_module in (m for m in module.modules() if isinstance(m, fx.GraphModule)):
        hoisted = set()
        for node in graph_module.graph.nodes:
            if node.op in _BOOKKEEPING:
                continue
            if node.target in _REFERENCES and all(n.op in _BOOKKEEPING or n in hoisted or n.target in GRAPH_HELPERS
                                                  for n in node.all_input_nodes):
                hoisted.add(node)
                continue
            # (the checks of an argument traced as None, or as a tensor that picked the code)
            if node.target in (*FUSED_OPS, *GRAPH_HELPERS, assert_is_none, require_traced_as_tensor):
                continue
            if node.target is operator.getitem and node.args[0].target is gemm_epilogue_train:
                continue
            if node.target is torch.t and node.args[0].op == "get_attr":
                continue
            left.append(f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)})")
    return left


def assert_whole_chain_fused(model: nn.Module, inputs, regions: int = 1, **kwargs) -> nn.Module:
    """The model becomes `regions` fused ops and nothing else, and matches eager."""
    optimized = assert_fuses(model, inputs, regions=regions, **kwargs)
    left = leftover_compute(optimized)
    assert not left, f"not fused: {left}\n{optimized.fxfuse_report}\n{optimized.code}"
    return optimized


def reasons(module_or_report) -> list[str]:
    report = getattr(module_or_report, "fxfuse_report", module_or_report)
    return [row.reason for row in report.near_misses + report.skipped]


def assert_reason(module_or_report, text: str) -> None:
    found = reasons(module_or_report)
    assert any(text in r for r in found), f"no near miss says {text!r}; explain() gave {found}"


def fused_programs(module: nn.Module) -> list[str]:
    return [row.program for row in module.fxfuse_report.fused]


def rows_input(batch=BATCH, features=IN, dtype=torch.float32):
    return torch.randn(batch, features, dtype=dtype)
