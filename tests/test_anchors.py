"""The GEMM anchor in each of its spellings, inputs of 2 to 4 dims, and epilogue operands from outside the region.

Anchors: nn.Linear with and without bias, F.linear, ``x @ W.t() + b``, ``x @ W``, torch.mm, torch.addmm,
torch.matmul and the tensor methods, with a 2-D weight that is a parameter or a buffer. Outside operands:
graph inputs (``layer_norm(linear(h) + x)``, ``(linear(x) + y) * y``) and values computed before the region.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from epilogue_models import (BATCH, IN, OUT, GemmThen, assert_reason, assert_whole_chain_fused, fused_programs,
                             leftover_compute)
from fxfuse.testing import (assert_close_report, assert_fuses, assert_gradients_match, assert_not_fused,
                            fused_op_count)


class OwnWeights(nn.Module):
    """A GEMM written against the model's own weight tensors: `w` is (OUT, IN), `w_in_out` is (IN, OUT)."""

    def __init__(self, gemm, weights_as_buffers=False):
        super().__init__()
        register = self.register_buffer if weights_as_buffers else (
            lambda name, t: self.register_parameter(name, nn.Parameter(t)))
        register("w", torch.randn(OUT, IN) / IN ** 0.5)
        register("w_in_out", torch.randn(IN, OUT) / IN ** 0.5)
        register("b", torch.randn(OUT))
        self.gemm = gemm

    def forward(self, x):
        return torch.relu(self.gemm(self, x))


ANCHORS = {
    "F.linear": lambda m, x: F.linear(x, m.w, m.b),
    "F.linear-no-bias": lambda m, x: F.linear(x, m.w),
    "F.linear-kw": lambda m, x: F.linear(input=x, weight=m.w, bias=m.b),
    "x@W.t()+b": lambda m, x: x @ m.w.t() + m.b,
    "x@W.T+b": lambda m, x: x @ m.w.T + m.b,
    "x@W.transpose(0,1)": lambda m, x: x @ m.w.transpose(0, 1),
    "x@torch.t(W)": lambda m, x: x @ torch.t(m.w),
    "x@W.transpose(dim0=1,dim1=0)": lambda m, x: x @ m.w.transpose(dim0=1, dim1=0),
    "x@W.permute((1,0))": lambda m, x: x @ m.w.permute((1, 0)),
    "x@torch.permute(W,(1,0))+b": lambda m, x: x @ torch.permute(m.w, (1, 0)) + m.b,
    "x@W.swapaxes(0,1)": lambda m, x: x @ m.w.swapaxes(0, 1),
    "x@torch.swapdims(W,-1,0)": lambda m, x: x @ torch.swapdims(m.w, -1, 0),
    "x@W": lambda m, x: x @ m.w_in_out,
    "x@W+b": lambda m, x: x @ m.w_in_out + m.b,
    "torch.mm": lambda m, x: torch.mm(x, m.w_in_out),
    "torch.mm-W.t()": lambda m, x: torch.mm(x, m.w.t()),
    "Tensor.mm": lambda m, x: x.mm(m.w_in_out),
    "torch.matmul": lambda m, x: torch.matmul(x, m.w_in_out),
    "torch.matmul-W.t()+b": lambda m, x: torch.matmul(x, m.w.t()) + m.b,
    "Tensor.matmul": lambda m, x: x.matmul(m.w_in_out),
    "torch.addmm-W.t()": lambda m, x: torch.addmm(m.b, x, m.w.t()),
    "torch.addmm-W": lambda m, x: torch.addmm(m.b, x, m.w_in_out),
    "torch.addmm-kw": lambda m, x: torch.addmm(input=m.b, mat1=x, mat2=m.w.t()),
    "Tensor.addmm": lambda m, x: m.b.addmm(x, m.w.t()),
    "torch.linalg.matmul": lambda m, x: torch.linalg.matmul(x, m.w_in_out),
    "torch.linalg.matmul-W.t()+b": lambda m, x: torch.linalg.matmul(x, m.w.t()) + m.b,
}
TWO_D_ONLY = {"torch.mm", "torch.mm-W.t()", "Tensor.mm", "torch.addmm-W.t()", "torch.addmm-W", "torch.addmm-kw",
              "Tensor.addmm"}


@pytest.mark.parametrize("weights_as_buffers", [False, True], ids=["parameters", "buffers"])
@pytest.mark.parametrize("anchor", list(ANCHORS))
def test_gemm_anchor_fuses_with_its_epilogue(anchor, weights_as_buffers):
    model = OwnWeights(ANCHORS[anchor], weights_as_buffers)
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))
    (program,) = fused_programs(optimized)
    assert program.split(";")[-1].startswith("relu(")


@pytest.mark.parametrize("anchor", [a for a in ANCHORS if a not in TWO_D_ONLY])
@pytest.mark.parametrize("shape", [(2, 5, IN), (2, 1, 3, IN)], ids=["3-D", "4-D"])
def test_gemm_anchor_on_inputs_with_leading_dims(anchor, shape):
    model = OwnWeights(ANCHORS[anchor])
    assert_whole_chain_fused(model, (torch.randn(*shape),))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [(1, IN), (BATCH, IN), (2, 5, IN), (4, 1, 2, IN)], ids=str)
def test_nn_linear_fuses_on_any_leading_dims(bias, shape):
    model = GemmThen(lambda m, x, y: F.gelu(m.fc(x)), bias=bias)
    assert_whole_chain_fused(model, (torch.randn(*shape),))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("gemm", [lambda m, x: F.linear(x, m.w * 2, m.b), lambda m, x: x @ m.w.tanh().t() + m.b.exp()],
                         ids=["F.linear(x,w*2,b)", "x@w.tanh().t()+b.exp()"])
def test_weight_made_of_module_tensors_is_an_anchor_without_example_inputs(gemm, training):
    """A weight that the vocabulary's ops make of module tensors alone is a known 2-D tensor without example inputs
    too (match.values_of_module_tensors): the GEMM is an anchor, its gradients reach the module tensors."""
    model, x = OwnWeights(gemm).train(training), torch.randn(BATCH, IN)
    optimized = assert_fuses(model, (x,), example_inputs=False)
    assert fused_programs(optimized)[0].split(";")[-1].startswith("relu(")
    assert_gradients_match(model, optimized, (x,))


def test_two_gemms_in_a_row_become_two_regions():
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, 16), nn.Tanh())
    assert_whole_chain_fused(model, (torch.randn(BATCH, IN),), regions=2)


class ResidualBlock(nn.Module):
    """A pre-norm transformer block's two residual adds: the second adds the first's fused output."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(OUT, OUT), nn.LayerNorm(OUT)
        self.fc1, self.fc2 = nn.Linear(OUT, 2 * OUT), nn.Linear(2 * OUT, OUT)

    def forward(self, x):
        h = x + self.proj(x)
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


@pytest.mark.parametrize("example_inputs", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_an_earlier_regions_fused_output_is_a_later_regions_operand(example_inputs):
    """The residual stream `h`, fused as proj's region, is the operand of fc2's add: a tensor made of x. (The norm
    before fc1 is no epilogue: it stays.)"""
    model, x = ResidualBlock(), torch.randn(2, 5, OUT)
    optimized = assert_fuses(model, (x,), regions=3, example_inputs=None if example_inputs else False)
    assert fused_programs(optimized) == ["add($0,%0)", "gelu(%0,'none')", "add($0,%0)"]
    assert leftover_compute(optimized) == ["norm (call_module norm)"]
    assert_gradients_match(model, optimized, (x.requires_grad_(),))


def test_batched_matmul_is_no_gemm_anchor():
    """`x @ y` with a 3-D `y` multiplies a batch of matrices: no 2-D weight, so not fused, and still runs."""
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x) @ y))
    assert_not_fused(model, (torch.randn(2, 5, IN), torch.randn(2, OUT, 7)), reason="is not a known 2-D tensor")


# ---------------------------------------------------------------- operands from outside the region

# Operands that are graph inputs: the whole model becomes one fused op.
INPUT_OPERANDS = {
    "layer_norm(linear(h)+x)": (lambda m, x, y: m.norm(m.fc(x) + y), dict(norm=nn.LayerNorm(OUT))),
    "(linear(x)+y)*y": (lambda m, x, y: (m.fc(x) + y) * y, {}),
    "y+relu(linear(x))": (lambda m, x, y: y + F.relu(m.fc(x)), {}),
    "group_norm(linear(x)-y)": (lambda m, x, y: m.norm(m.fc(x) - y), dict(norm=nn.GroupNorm(4, OUT))),
}
# Operands computed by ops outside any region (before or after the GEMM in graph order): those ops stay.
COMPUTED_OPERANDS = {
    "sigmoid(y)-computed-before": lambda m, x, y: (lambda z: F.relu(m.fc(x)) * z)(torch.sigmoid(y)),
    "x.sum()-computed-after-the-gemm": lambda m, x, y: F.relu(m.fc(x)) + x.sum(-1, keepdim=True),
    "slice-of-y": lambda m, x, y: m.fc(x) * y[:, :1],
}


@pytest.mark.parametrize("name", list(INPUT_OPERANDS))
def test_graph_input_operand(name):
    epilogue, extras = INPUT_OPERANDS[name]
    model = GemmThen(epilogue, **extras)
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN), torch.randn(BATCH, OUT)))
    assert "$" in fused_programs(optimized)[0]


@pytest.mark.parametrize("name", list(COMPUTED_OPERANDS))
def test_operand_computed_outside_the_region(name):
    model = GemmThen(COMPUTED_OPERANDS[name])
    optimized = assert_fuses(model, (torch.randn(BATCH, IN), torch.randn(BATCH, OUT)), regions=1)
    assert len(leftover_compute(optimized)) == 1, optimized.code
    assert "$" in fused_programs(optimized)[0]


def test_outside_operand_without_example_inputs_is_a_graph_input():
    model = GemmThen(lambda m, x, y: (m.fc(x) + y) * y)
    assert_whole_chain_fused(model, (torch.randn(BATCH, IN), torch.randn(BATCH, OUT)), example_inputs=False)


# Operands that the vocabulary's ops make of module tensors and numbers alone (CLIP's `logit_scale.exp()`): a tensor
# at every call, whose shape and dtype follow from the module's tensors, so they fuse without example inputs too;
# their ops stay, before the fused op (the number of them).
MODULE_TENSOR_OPERANDS = {
    "logit_scale.exp()": (lambda m, x, y: m.fc(x) * m.logit_scale.exp(), 1),
    "sigmoid(gate)": (lambda m, x, y: m.fc(x) * torch.sigmoid(m.gate), 1),
    "softplus(offset)": (lambda m, x, y: m.fc(x) + F.softplus(m.offset), 1),
    "scale.clamp(min=0.1)": (lambda m, x, y: m.fc(x) * m.scale.clamp(min=0.1), 1),
    "temperature.abs()": (lambda m, x, y: m.fc(x) / m.temperature.abs(), 1),
    "gate.softmax(0)*2+offset": (lambda m, x, y: F.gelu(m.fc(x)) * (m.gate.softmax(0) * 2 + m.offset), 3),
    "layer_norm(h*row.exp())": (lambda m, x, y: F.layer_norm(m.fc(x) * m.row.exp(), (OUT,)), 1),
}


def module_tensors_model(epilogue, **extras):
    """GemmThen with CLIP-like module tensors: parameters logit_scale (0-d), gate (OUT,) and temperature (1,); buffers
    offset (OUT,), scale (OUT,) and row (1, OUT)."""
    return GemmThen(epilogue, logit_scale=nn.Parameter(torch.tensor(0.5)), gate=nn.Parameter(torch.randn(OUT)),
                    temperature=nn.Parameter(torch.tensor([0.07])), offset=torch.randn(OUT), scale=torch.rand(OUT),
                    row=torch.randn(1, OUT) / 4, **extras)


@pytest.mark.parametrize("example_inputs", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("name", list(MODULE_TENSOR_OPERANDS))
def test_operand_made_of_module_tensors_fuses_without_example_inputs(name, example_inputs):
    epilogue, ops_left = MODULE_TENSOR_OPERANDS[name]
    model = module_tensors_model(epilogue).eval()
    optimized = assert_fuses(model, (torch.randn(BATCH, IN),), example_inputs=None if example_inputs else False)
    assert len(leftover_compute(optimized)) == ops_left, optimized.code
    assert "$" in fused_programs(optimized)[0]


@pytest.mark.parametrize("name", list(MODULE_TENSOR_OPERANDS))
def test_operand_made_of_module_tensors_trains_without_example_inputs(name):
    """In train mode the operand's ops stay outside the fused op, so the module tensors' gradients flow through them
    from the fused op's param gradient."""
    model = module_tensors_model(MODULE_TENSOR_OPERANDS[name][0]).train()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    assert len(leftover_compute(optimized)) == MODULE_TENSOR_OPERANDS[name][1], optimized.code
    assert_gradients_match(model, optimized, (torch.randn(BATCH, IN),))


def test_operand_made_of_a_float64_buffer_is_not_fused_without_example_inputs():
    """Eager promotes `h * buf64.exp()` to float64: the operand's dtype is known from the buffer's, and refused as
    with example inputs."""
    model = module_tensors_model(lambda m, x, y: m.fc(x) * m.buf64.exp(),
                                 buf64=torch.randn(OUT, dtype=torch.float64)).eval()
    optimized = assert_fuses(model, (torch.randn(BATCH, IN),), regions=0, example_inputs=False)
    assert_reason(optimized, "operand `exp` is float64 while the GEMM is float32 (eager would promote the result)")


@pytest.mark.parametrize("example_inputs", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_operand_made_of_a_module_tensor_changed_in_place_is_not_fused(example_inputs):
    """`self.scale.exp_()` changes the buffer at every call: no operand of a fused op, with example inputs or without
    (explain() says why)."""
    model = module_tensors_model(lambda m, x, y: m.fc(x) * m.scale.exp_()).eval()
    x = torch.randn(BATCH, IN)
    optimized = fxfuse.optimize(model, (x,) if example_inputs else None)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    if not example_inputs:
        assert_reason(optimized, "operand `exp_` changes `scale` in place: without example inputs, only what the "
                                 "vocabulary's ops make out of place of module tensors and numbers is taken")
    expected = model(x)  # (each call changes the buffer: eager's second call against the optimized model's)
    model.scale.log_()
    assert_close_report(optimized(x), expected)


@pytest.mark.parametrize("epilogue", [lambda m, x, y: m.fc(x) * (m.act(m.gate) * 2),
                                      lambda m, x, y: m.fc(x) * m.scale.unsqueeze_(0).exp(),
                                      lambda m, x, y: (m.scale.unsqueeze_(0), m.fc(x) * m.scale.exp())[1],
                                      lambda m, x, y: m.fc(x) * m.gate.detach()],
                         ids=["of-a-module-call", "of-a-module-tensor-changed-in-place",
                              "of-a-module-tensor-an-op-changes-in-place", "detach-of-a-module-tensor"])
def test_operand_of_module_tensors_that_stays_unknown_says_to_pass_example_inputs(epilogue):
    """What a module's call makes (its hooks may return anything), ops of a module tensor that an op of the forward
    may change in place (its shape too), or detach (the module tensor's own memory) is not evaluated: explain() says
    to pass example inputs."""
    model = module_tensors_model(epilogue, act=nn.Sigmoid()).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "without example inputs (of module tensors and numbers alone, only what the vocabulary's "
                             "ops make out of place is")
    assert_reason(optimized, "pass example inputs")


@pytest.mark.parametrize("name", ["logit_scale.exp()", "gate.softmax(0)*2+offset", "layer_norm(h*row.exp())"])
def test_operand_made_of_module_tensors_follows_a_cast_after_optimize(name):
    """The operand's ops run at each call on the module's tensors as they are then: module tensors cast alone to
    float64 promote the result as eager's ops do (a (1, OUT) or (OUT,) one; a 0-d one does not), and after .double()
    the fused op computes in float64."""
    model = module_tensors_model(MODULE_TENSOR_OPERANDS[name][0]).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    assert len(leftover_compute(optimized)) == MODULE_TENSOR_OPERANDS[name][1], optimized.code
    x = torch.randn(BATCH, IN)
    for tensor in (optimized.offset, optimized.row, optimized.logit_scale):  # (the model's own tensors)
        tensor.data = tensor.data.double()
    with torch.no_grad():
        expected, actual = model(x), optimized(x)
    assert actual.dtype == expected.dtype
    assert_close_report(actual, expected)
    optimized.float().double()
    model.double()  # (its own buffers: the optimized model's are in a dict of its own, cast above)
    with torch.no_grad():
        expected, actual = model(x.double()), optimized(x.double())
    assert actual.dtype == expected.dtype == torch.float64
    assert_close_report(actual, expected)


def test_broadcast_to_a_larger_output_as_in_eager():
    """Linear -> GroupNorm -> min(dim=1, keepdim=True) -> + bias (1, N, 1, 1) gives (1, N, B, 1)."""
    model = GemmThen(lambda m, x, y: torch.min(m.norm(m.fc(x)), dim=1, keepdim=True)[0] + m.shift,
                     norm=nn.GroupNorm(8, OUT), shift=nn.Parameter(torch.randn(1, OUT, 1, 1)))
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))
    assert optimized(torch.randn(BATCH, IN)).shape == (1, OUT, BATCH, 1)


def test_full_shape_operand_broadcast_by_a_reduced_value():
    """A row reduction without keepdim, plus a (B, 1) operand: eager broadcasts (B,) + (B, 1) to (B, B)."""
    model = GemmThen(lambda m, x, y: m.fc(x).sum(-1) + m.col, col=torch.randn(BATCH, 1))
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))
    assert optimized(torch.randn(BATCH, IN)).shape == (BATCH, BATCH)


def test_torch_nn_subclass_of_linear_is_an_anchor():
    """MultiheadAttention's out_proj is a NonDynamicallyQuantizableLinear: a Linear in all but name."""
    linear = nn.modules.linear.NonDynamicallyQuantizableLinear(IN, OUT)
    model = nn.Sequential(linear, nn.GELU())
    assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))


def test_lazy_linear_is_an_anchor_once_materialized():
    model = nn.Sequential(nn.LazyLinear(OUT), nn.Tanh())
    model(torch.randn(BATCH, IN))
    assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))


# A norm or reduction over the features of a value an earlier keepdim reduction left at one feature: pointwise steps
# (epilogue.py's over_one_feature), so KernelBench's chains of reductions fuse whole.
OVER_ONE_FEATURE = {
    "max-then-minus-its-mean-gelu": (lambda m, x, y: (lambda r: F.gelu(r - r.mean(dim=1, keepdim=True)))(
        torch.max(m.fc(x), dim=1, keepdim=True).values), "max_dim(%0,1,True);add(%1,0.0);sub(%1,%2);gelu"),
    "sigmoid-sum-logsumexp": (lambda m, x, y: torch.logsumexp(torch.sigmoid(m.fc(x)).sum(1, keepdim=True), 1,
                                                              keepdim=True), "sum(%1,1,True);add(%2,0.0);pow(%3,1.0)"),
    "sum-max-mean-logsumexp-twice": (lambda m, x, y: torch.logsumexp(torch.logsumexp(
        m.fc(x).sum(-1, keepdim=True).amax(-1, keepdim=True).mean(-1, keepdim=True), -1, keepdim=True), -1,
        keepdim=True), "sum(%0,-1,True);add(%1,0.0);add(%2,0.0);pow(%3,1.0)"),
    "mean-then-softmax": (lambda m, x, y: F.softmax(m.fc(x).mean(dim=1, keepdim=True), dim=1),
                          "mean(%0,1,True);sub(%1,%1);exp(%2)"),
    "scaled-min-then-log_softmax": (lambda m, x, y: (m.fc(x).amin(-1, keepdim=True) * 2 + m.one).log_softmax(-1),
                                    "amin(%0,-1,True);mul(%1,2);add(%2,$0);sub(%3,%3);exp(%4);log(%5)"),
}


@pytest.mark.parametrize("example_inputs", [True, False], ids=["shapes", "no-shapes"])
@pytest.mark.parametrize("name", list(OVER_ONE_FEATURE))
def test_a_reduction_over_one_feature_left_by_another_fuses_as_pointwise_steps(name, example_inputs):
    epilogue, program = OVER_ONE_FEATURE[name]
    model = GemmThen(epilogue, one=torch.ones(1, 1))
    x = torch.randn(BATCH, IN)
    optimized = assert_whole_chain_fused(model, (x,), example_inputs=None if example_inputs else False)
    (fused,) = fused_programs(optimized)
    assert program in fused.replace(" ", ""), fused
    x[0, 0] = float("inf")  # a row whose reductions are infinite: the steps give eager's NaN or infinity
    torch.testing.assert_close(optimized(x), model(x), equal_nan=True)
    assert_gradients_match(model, optimized, (torch.randn(BATCH, IN),))
