"""The fused ops themselves: torch.library.opcheck, gradcheck in float64, fake (meta) shapes, and the program IR.

``torch.ops.fxfuse.gemm_epilogue``, ``gemm_epilogue_train``, ``epilogue_backward`` and their fallbacks are
checked on programs that cover every kind of epilogue op: pointwise with parameters, norms, reductions with and
without keepdim, broadcasting to a larger output, residual reads of earlier values, no bias, 3-D inputs.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fxfuse.program import Program, run_program, run_reference
from fxfuse.testing import assert_close_report

N = 12  # output features
K = 8   # input features


def programs():
    """name -> (program, x shape, has bias, param shapes)."""
    return {
        "relu": ("relu(%0)", (3, K), True, []),
        "workload-1": ("add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,4,1e-05)",
                       (3, K), True, [(N,), (N,), (N,)]),
        "workload-2-broadcast": ("group_norm(%0,$0,$1,3,1e-05);min_dim(%1,1,True);add(%2,$2)",
                                 (5, K), True, [(N,), (N,), (1, N, 1, 1)]),
        "workload-3-residual": ("group_norm(%0,$0,$1,6,1e-05);leaky_relu(%1,0.01);add(%2,%2)",
                                (4, K), True, [(N,), (N,)]),
        "layer_norm-gelu-tanh": ("layer_norm(%0,None,None,1e-05);gelu(%1,'tanh')", (3, K), False, []),
        "rms_norm-silu": ("rms_norm(%0,$0,None);silu(%1)", (2, 3, K), True, [(N,)]),
        "softmax-3-D": ("softmax(%0,-1)", (2, 3, K), True, []),
        "log_softmax": ("log_softmax(%0,1)", (3, K), True, []),
        "logsumexp-keepdim-sub": ("logsumexp(%0,-1,True);sub(%0,%1)", (3, K), True, []),
        "sum-no-keepdim-mul": ("sum(%0,-1,False);mul(%1,0.5)", (3, K), True, []),
        "mean-amax": ("mean(%0,-1,True);amax(%0,-1,True);add(%1,%2)", (3, K), True, []),
        "outside-operand": ("add(%0,$0);mul(%1,$0)", (3, K), True, [(3, N)]),
        "elu-softplus-pow": ("elu(%0,1.0,1.0,1.0);softplus(%1,2.0,1.0);pow(%2,2.0)", (3, K), True, []),
        "batch_norm": ("batch_norm(%0,$0,$1,$2,$3,1e-05)", (3, K), True, [(N,), (N,), (N,), (N,)]),
        "scalar-first": ("sub(1.0,%0);div(2.0,%1)", (3, K), True, []),
        "hardswish-hardsigmoid-sigmoid-tanh": ("hardswish(%0);hardsigmoid(%1);sigmoid(%2);tanh(%3)", (3, K), True,
                                               []),
        "neg-abs-exp-log": ("neg(%0);abs(%1);exp(%2);log(%3)", (3, K), True, []),
    }


def make_args(name, dtype=torch.float32, requires_grad=False):
    program, x_shape, has_bias, param_shapes = programs()[name]
    make = lambda *shape: torch.randn(*shape, dtype=dtype, requires_grad=requires_grad)  # noqa: E731
    params = [make(*shape) for shape in param_shapes]
    if "batch_norm" in program:  # running statistics: no gradient, and a positive variance
        params[0] = params[0].detach()
        params[1] = torch.rand(N, dtype=dtype) + 0.5
    return make(*x_shape), make(N, x_shape[-1]), make(N) if has_bias else None, params, program


OPS = {"gemm_epilogue": lambda: torch.ops.fxfuse.gemm_epilogue.default,
       "gemm_epilogue_fallback": lambda: torch.ops.fxfuse.gemm_epilogue_fallback.default,
       "gemm_epilogue_train": lambda: torch.ops.fxfuse.gemm_epilogue_train.default,
       "gemm_epilogue_train_fallback": lambda: torch.ops.fxfuse.gemm_epilogue_train_fallback.default}


def call_args(op_name, args):
    return args + ("a test of the fallback",) if op_name.endswith("_fallback") else args


# Every program through the op with gradients; a few without, and through the fallback (each opcheck is ~1 s).
SOME = ["relu", "workload-1", "workload-2-broadcast", "outside-operand"]
OPCHECK_CASES = [
    pytest.param(op, name, grad, id=f"{op}-{name}-{'grad' if grad else 'no-grad'}")
    for op in ("gemm_epilogue", "gemm_epilogue_train")
    for name, grad in [(name, True) for name in programs()] + [(name, False) for name in SOME]
] + [
    pytest.param(op, name, grad, id=f"{op}-{name}-{'grad' if grad else 'no-grad'}")
    for op in ("gemm_epilogue_fallback", "gemm_epilogue_train_fallback") for name in SOME for grad in (True, False)]


@pytest.mark.parametrize("op_name, name, requires_grad", OPCHECK_CASES)
def test_opcheck(op_name, name, requires_grad):
    args = call_args(op_name, make_args(name, requires_grad=requires_grad))
    torch.library.opcheck(OPS[op_name](), args)


@pytest.mark.parametrize("fallback", [False, True], ids=["op", "fallback"])
@pytest.mark.parametrize("name", SOME + ["softmax-3-D", "logsumexp-keepdim-sub", "batch_norm"])
def test_epilogue_backward_opcheck(name, fallback):
    x, weight, bias, params, program = make_args(name)
    gemm_out = F.linear(x, weight, bias)
    grad_output = torch.randn_like(run_program(gemm_out, params, program))
    needs = [True] + [not (name == "batch_norm" and i < 2) for i in range(len(params))]  # no running stats
    args = (grad_output, gemm_out, params, program, needs)
    if fallback:
        torch.library.opcheck(torch.ops.fxfuse.epilogue_backward_fallback.default, args + ("a test of the fallback",))
    else:
        torch.library.opcheck(torch.ops.fxfuse.epilogue_backward.default, args)


FULL_GRADCHECK = {"relu", "outside-operand"}  # the whole Jacobian, column by column


@pytest.mark.parametrize("op_name", ["gemm_epilogue", "gemm_epilogue_train"])
@pytest.mark.parametrize("name", list(programs()))
def test_gradcheck_in_float64(name, op_name):
    x, weight, bias, params, program = make_args(name, dtype=torch.float64, requires_grad=True)
    if "abs" in program:
        x = (x.detach() + 3.0).requires_grad_()  # keep away from abs's kink at 0
    tensors = [x, weight] + ([bias] if bias is not None else []) + params

    def fused(*ts):
        x_, w_ = ts[0], ts[1]
        b_ = ts[2] if bias is not None else None
        rest = list(ts[3:] if bias is not None else ts[2:])
        return OPS[op_name]()(x_, w_, b_, rest, program)

    # fast_mode checks a random projection of the Jacobian: the same bugs, a fraction of the time.
    assert torch.autograd.gradcheck(fused, tensors, eps=1e-6, atol=1e-5, fast_mode=name not in FULL_GRADCHECK)


@pytest.mark.parametrize("name", list(programs()))
def test_result_equals_the_reference_interpreter(name):
    args = make_args(name)
    expected = run_reference(*args)
    actual = torch.ops.fxfuse.gemm_epilogue(*args)
    assert_close_report(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(programs()) + ["empty-program"])
def test_training_op_returns_the_result_and_the_gemm_output_apart(name):
    args = make_args(name) if name != "empty-program" else make_args("relu")[:4] + ("",)
    out, gemm_out = torch.ops.fxfuse.gemm_epilogue_train(*args)
    assert_close_report(out, run_reference(*args), rtol=0, atol=0)
    assert_close_report(gemm_out, F.linear(*args[:3]), rtol=0, atol=0, what="gemm_out")
    assert not torch._C._is_alias_of(out, gemm_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", list(programs()))
def test_fake_implementation_gives_eager_shape_and_dtype(name, dtype):
    args = make_args(name, dtype=dtype)
    expected = run_reference(*args)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args[:3]]
        fake_params = [mode.from_tensor(p) for p in args[3]]
        out = torch.ops.fxfuse.gemm_epilogue(fake[0], fake[1], fake[2], fake_params, args[4])
        train_out, gemm_out = torch.ops.fxfuse.gemm_epilogue_train(fake[0], fake[1], fake[2], fake_params, args[4])
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert train_out.shape == expected.shape and train_out.dtype == expected.dtype
    assert gemm_out.shape == (*args[0].shape[:-1], N) and gemm_out.dtype == dtype


def test_workload_2_program_broadcasts_to_a_larger_output():
    x, weight, bias, params, program = make_args("workload-2-broadcast")
    assert torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program).shape == (1, N, 5, 1)


# ---------------------------------------------------------------- the program IR


@pytest.mark.parametrize("text", [p for p, *_ in programs().values()] + [
    "clamp(%0,-inf,inf)", "clamp(%0,None,0.5)", "add(%0,nan)", "gelu(%0,'none')", "pow(%0,-1.5)",
    "leaky_relu(%0,1e-30)", "add(%0,3)"])
def test_program_text_round_trips(text):
    program = Program.parse(text)
    assert str(program) == text
    assert Program.parse(str(program)) == program


def test_program_literals_keep_their_values():
    (clamp,) = Program.parse("clamp(%0,-inf,0.1)").instructions
    assert clamp.attr_dict == {"min": -math.inf, "max": 0.1}
    (add,) = Program.parse("add(%0,nan)").instructions
    assert math.isnan(add.operands[1])


@pytest.mark.parametrize("text, message", [
    ("frobnicate(%0)", "bad program instruction"),
    ("relu(%0", "bad program instruction"),
    ("clamp(%0,1.0)", "takes 1 operands and 2 attributes"),
    ("relu(%1)", "reads %1 before it is defined"),
    ("relu(%0);add(%2,%0)", "reads %2 before it is defined"),
    ("sub_(2.0,%0)", "changes no value of the program"),  # the reference read the number's dtype: AttributeError
    ("add_($0,%0)", "changes no value of the program"),
])
def test_malformed_program_is_rejected(text, message):
    with pytest.raises(ValueError, match=message):
        Program.parse(text)
