"""Checks of the C++ autograd formulas (kernels/autograd.cpp) on the CPU, run by tests/test_cpp_autograd.py.

Usage: python tests/cpp_autograd_checks.py BUILD_DIR CHECK
Builds kernels/autograd.cpp alone for AutogradCPU into BUILD_DIR (cached there), loads it over the Python formulas
of this process (the fused ops' CPU references then run below it), and runs CHECK; exits non-zero on a mismatch.
"""
import itertools
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

import fxfuse
from fxfuse.library import run_reference_train
from fxfuse.testing import assert_close_report

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from test_autocast import TAILS, _check_under_autocast, _model  # noqa: E402
from test_opcheck import make_args, programs  # noqa: E402
from test_training import (check_an_inference_tensor_that_eager_does_not_save_trains,  # noqa: E402
                           check_second_order_gradients)

OPS = {"gemm_epilogue": torch.ops.fxfuse.gemm_epilogue, "gemm_epilogue_train": torch.ops.fxfuse.gemm_epilogue_train}


def load(build_dir: str) -> None:
    cpp_extension.load(name="fxfuse_cpp_autograd_cpu", sources=[str(TESTS.parent / "kernels" / "autograd.cpp")],
                       extra_cflags=["-O1", "-DFXFUSE_AUTOGRAD_KEY=AutogradCPU"], build_directory=build_dir,
                       is_python_module=False)


def check_node() -> None:
    x, weight, bias, params, program = make_args("workload-1", requires_grad=True)
    for kind, expected in (("gemm_epilogue", "GemmEpilogue"), ("gemm_epilogue_train", "GemmEpilogueTrain")):
        out = OPS[kind](x, weight, bias, params, program)
        node = (out[0] if isinstance(out, tuple) else out).grad_fn.name()
        assert node.startswith("torch::autograd::CppNode<") and node.endswith(f"::{expected}>"), node


def _leaves(name, wanted, with_bias):
    torch.manual_seed(0)  # the same values for the fused op and the reference
    x, weight, bias, params, program = make_args(name, dtype=torch.float64)
    tensors = [x, weight, bias if with_bias else None, *params]
    leaves = [None if t is None else t.detach().requires_grad_(flag) for t, flag in zip(tensors, wanted)]
    return leaves, program


def check_gradients() -> None:
    """Every program, bias or none, each subset of (x, weight, bias, params) requiring grad, a loss on the result,
    on the GEMM output (training op) or on both: the gradients of autograd through the reference's own ops."""
    checked = 0
    for name, kind in itertools.product(programs(), OPS):
        has_bias = programs()[name][2]
        for with_bias, subset in itertools.product([has_bias, False], itertools.product([True, False], repeat=4)):
            if not any(subset):
                continue
            x_grad, weight_grad, bias_grad, params_grad = subset
            if name == "batch_norm":
                params_grad = False  # running statistics
            n_params = len(programs()[name][3])
            wanted = [x_grad, weight_grad, bias_grad and with_bias, *[params_grad] * n_params]
            if not any(wanted):
                continue
            losses = ["out"] if kind == "gemm_epilogue" else ["out", "gemm_out", "both"]
            for loss in losses:
                results = []
                for fused in (True, False):
                    leaves, program = _leaves(name, wanted, with_bias)
                    x, weight, bias, *params = leaves
                    if fused:
                        result = OPS[kind](x, weight, bias, params, program)
                    else:
                        result = run_reference_train(x, weight, bias, params, program)
                    out, gemm_out = result if isinstance(result, tuple) else (result, None)
                    terms = {"out": [out], "gemm_out": [gemm_out], "both": [out, gemm_out]}[loss]
                    total = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view(t.shape)).sum()
                                for t in terms)
                    inputs = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
                    # a loss on the GEMM output alone depends on no param
                    results.append(torch.autograd.grad(total, inputs, allow_unused=True) if total.requires_grad
                                   else [None] * len(inputs))
                for i, (actual, expected) in enumerate(zip(*results)):
                    what = f"{kind} {name} bias={with_bias} wanted={wanted} loss={loss}: gradient {i}"
                    if expected is None:
                        assert actual is None or actual.abs().max() == 0, what
                        continue
                    assert_close_report(actual, expected, rtol=1e-9, atol=1e-9, what=what)
                checked += 1
    print(f"{checked} gradient cases")


def check_second_order() -> None:
    for kind in OPS:
        check_second_order_gradients(kind, "cpu")


def check_compiled_autograd() -> None:
    """Compiled autograd traces the formulas' backward whole (fullgraph), with eager's gradients."""
    from torch._dynamo import compiled_autograd

    for kind in OPS:
        grads = []
        for compiled in (False, True):
            torch._dynamo.reset()
            torch.manual_seed(0)
            x, weight, bias, params, program = make_args("workload-2-broadcast", requires_grad=True)
            result = OPS[kind](x, weight, bias, params, program)
            out = result[0] if isinstance(result, tuple) else result
            inputs = [x, weight, bias, *params]
            if compiled:
                with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
                    out.square().sum().backward()
            else:
                out.square().sum().backward()
            grads.append([t.grad for t in inputs])
        for i, (actual, expected) in enumerate(zip(*grads)):
            assert_close_report(actual, expected, rtol=1e-5, atol=1e-6, what=f"{kind}: gradient {i} compiled")


def check_autocast() -> None:
    """CPU autocast in train mode: the fused op runs in bf16 below autocast; gradients come back as eager's, in
    the params' dtypes."""
    for name, (_, fused_below) in TAILS.items():
        model, x = _model(name, "cpu", "train")
        optimized = fxfuse.optimize(model, (x,))
        actual, expected = _check_under_autocast(model, optimized, x, "cpu", fused_below=fused_below)
        params = list(model.parameters())
        fused_grads = torch.autograd.grad(actual.float().square().sum(), params, allow_unused=True)
        eager_grads = torch.autograd.grad(expected.float().square().sum(), params, allow_unused=True)
        for (what, param), fused, eager in zip(model.named_parameters(), fused_grads, eager_grads):
            assert (fused is None) == (eager is None), f"{name}: {what}"
            if eager is not None:
                assert fused.dtype == param.dtype
                assert_close_report(fused, eager, rtol=2e-2, atol=2e-2, what=f"{name}: {what}'s gradient")


def check_inference_tensors() -> None:
    """A tensor made under inference_mode that eager's ops would not save is kept as its copy."""
    for mode, made in itertools.product(["train", "eval"], ["x", "y"]):
        check_an_inference_tensor_that_eager_does_not_save_trains(mode, made)


def check_empty_features() -> None:
    """A linear of no input or no output features (a dim of 0 last): its gradients are eager's empty or zero ones;
    the formula reshaped them to (-1, 0), which a tensor of no elements cannot resolve."""
    for (k, n), kind in itertools.product([(3, 0), (0, 5)], OPS):
        grads = []
        for fused in (True, False):
            torch.manual_seed(0)
            x, weight, bias = (torch.randn(*shape, dtype=torch.float64, requires_grad=True)
                               for shape in ((2, 4, k), (n, k), (n,)))
            result = (OPS[kind] if fused else run_reference_train)(x, weight, bias, [], "relu(%0)")
            out = result[0] if isinstance(result, tuple) else result
            grads.append(torch.autograd.grad(out.sum(), [x, weight, bias]))
        for i, (actual, expected) in enumerate(zip(*grads)):
            assert_close_report(actual, expected, rtol=0, atol=0, what=f"{kind} k={k} n={n}: gradient {i}")


CHECKS = {"node": check_node, "gradients": check_gradients, "second-order": check_second_order,
          "compiled-autograd": check_compiled_autograd, "autocast": check_autocast,
          "inference-tensors": check_inference_tensors, "empty-features": check_empty_features}

if __name__ == "__main__":
    load(sys.argv[1])
    CHECKS[sys.argv[2]]()
    print(f"{sys.argv[2]}: ok")
