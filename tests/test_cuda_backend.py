"""The torch.compile backend, dynamic batches and export on the GPU (``pytest -m cuda``), where the fused op runs
the CUDA kernels: the CPU tests of test_backend.py, test_dynamic_shapes.py and test_export.py, in float32 and
bfloat16. Skipped without a GPU (tests/conftest.py).

Results are judged as tests/test_cuda_kernels.py judges the kernels: by the relative norm error against a
float64 run of the same model, at most 1e-5 in float32; in bfloat16 at most 1e-2, or 1.5 times eager
bfloat16's own error where eager itself misses that.
"""
import copy

import pytest
import torch

import fxfuse
from fxfuse.modelfile import example_files, load_model_file
from fxfuse.testing import exported_ops_reading_inputs, fused_op_count, gradients

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]

EXAMPLES = {path.stem: path for path in example_files()}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _relative_error(got, ref):
    finite = torch.isfinite(ref)
    norm = torch.linalg.vector_norm(ref[finite]).item()
    return torch.linalg.vector_norm((got.double() - ref)[finite]).item() / max(norm, 1e-30)


class Judge:
    """Float64 and eager references of one model, for inputs of any batch."""

    def __init__(self, model, dtype):
        self.model, self.dtype = model, dtype
        self.reference = copy.deepcopy(model).double()

    def check(self, out, inputs, what=""):
        with torch.no_grad():
            ref = self.reference(*[t.double() for t in inputs])
            eager = self.model(*inputs)
        assert out.shape == eager.shape and out.dtype == eager.dtype
        error = _relative_error(out, ref)
        bound = 1e-5 if self.dtype == torch.float32 else max(1e-2, 1.5 * _relative_error(eager, ref))
        assert error <= bound, f"{what}: relative error {error:.3g} > {bound:.3g}"


def _example_on(name, dtype, device):
    model, inputs = load_model_file(EXAMPLES[name], small=True).build()
    return model.to(device, dtype), [t.to(device, dtype) for t in inputs]


def _resized(inputs, batch):
    return [torch.rand(batch, *t.shape[1:], device=t.device, dtype=t.dtype) for t in inputs]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_backend_with_inductor(name, precision, grad, device="cuda"):
    """Under no_grad the inference op; under grad the training op (its CUDA forward, which keeps the GEMM output)."""
    model, inputs = _example_on(name, DTYPES[precision], device)
    backend = fxfuse.make_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.set_grad_enabled(grad):
        out = compiled(*inputs)
    Judge(model, DTYPES[precision]).check(out.detach(), inputs, f"{name} {precision}")
    assert [[row.op for row in r.fused] for r in backend.reports] == \
        [["gemm_epilogue_train" if grad else "gemm_epilogue"]]


@pytest.mark.parametrize("dynamic", [True, "mark_dynamic"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_dynamic_batch_compiles_once(name, dynamic, device="cuda"):
    model, inputs = _example_on(name, torch.float32, device)
    judge = Judge(model, torch.float32)
    backend = fxfuse.make_backend()
    compiled = torch.compile(model, backend=backend, dynamic=True if dynamic is True else None)
    graphs_after_first = None
    with torch.no_grad():
        for batch in (48, 96, 130):
            batch_inputs = _resized(inputs, batch)
            if dynamic == "mark_dynamic":
                for t in batch_inputs:
                    torch._dynamo.mark_dynamic(t, 0)
            judge.check(compiled(*batch_inputs), batch_inputs, f"{name} batch {batch}")
            graphs_after_first = graphs_after_first or len(backend.reports)
    assert len(backend.reports) == graphs_after_first, "a new batch size recompiled"
    assert all(len(r.fused) == 1 for r in backend.reports)


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_exported_optimized_model(name, precision, device="cuda"):
    model, inputs = _example_on(name, DTYPES[precision], device)
    optimized = fxfuse.optimize(model, inputs)
    assert fused_op_count(optimized) == 1
    batch = torch.export.Dim("batch", min=2, max=4096)
    program = torch.export.export(optimized, tuple(inputs), dynamic_shapes=tuple({0: batch} for _ in inputs))
    assert exported_ops_reading_inputs(program) == [torch.ops.fxfuse.gemm_epilogue.default]
    pooled = optimized.fxfuse_report.fused[0].pool is not None
    averaged = [torch.ops.fxfuse.mean_of_row_groups.default] * 2 if pooled else []  # (a pool's weight and bias)
    assert [n.target for n in program.graph.nodes if n.op == "call_function" and
            getattr(n.target, "namespace", None) == "fxfuse"] == [*averaged, torch.ops.fxfuse.gemm_epilogue.default]
    judge = Judge(model, DTYPES[precision])
    with torch.no_grad():
        for size in (inputs[0].shape[0], 100):
            batch_inputs = _resized(inputs, size)
            judge.check(program.module()(*batch_inputs), batch_inputs, f"{name} {precision} batch {size}")


# KernelBench's level-2 chains of reductions of reduced values, residuals without a gradient and subtracted means;
# then the spread and the 2-norm of a row.
def _max_minus_mean_gelu(m, x):  # Gemm_Max_Subtract_GELU
    r = torch.max(m.fc(x), dim=1, keepdim=True).values
    return torch.nn.functional.gelu(r - r.mean(dim=1, keepdim=True))


def _sum_max_mean_logsumexp_twice(m, x):  # Matmul_Sum_Max_AvgPool_LogSumExp_LogSumExp
    r = m.fc(x).sum(1, keepdim=True).max(1, keepdim=True)[0].mean(1, keepdim=True)
    return torch.logsumexp(torch.logsumexp(r, 1, keepdim=True), 1, keepdim=True)


def _scaled_plus_detached(m, x):  # Matmul_Scaling_ResidualAdd
    h = m.fc(x)
    return h * 0.5 + h.clone().detach()


def _standardized_by_std(m, x):  # a row's z-score, and its spread beside it
    h = m.fc(x)
    return (h - h.mean(-1, keepdim=True)) / h.std(-1, keepdim=True) + h.var(-1, keepdim=True, correction=0)


def _normalized_embedding(m, x):  # a contrastive head: unit rows, scaled
    return torch.nn.functional.normalize(torch.nn.functional.gelu(m.fc(x)), dim=-1) * 2.5


def _row_norms(m, x):
    return torch.linalg.vector_norm(torch.relu(m.fc(x)), dim=1, keepdim=True)


def _pooled_gelu_scaled(m, x):
    h = torch.nn.functional.avg_pool1d(m.fc(x).unsqueeze(1), kernel_size=4).squeeze(1)
    return torch.nn.functional.gelu(h) * 2.0


def _avg_pool_gelu_scale_max(m, x):  # Matmul_AvgPool_GELU_Scale_Max: the pool folds into the GEMM's weight
    return torch.max(_pooled_gelu_scaled(m, x), dim=1).values


# Chains whose gradient flows to the column of each row's maximum, of the values this computes (a maximum that
# rounding may move to another column, in eager as in the fused op: the gradients are compared on the others' rows)
VALUES_OF_A_ROW_MAXIMUM = {_avg_pool_gelu_scale_max: _pooled_gelu_scaled}


def _rows_of_a_clear_maximum(chain, model, x):
    """x's rows whose maximum, in a float64 run, leads the next value by more than 8 of x's dtype's eps (relative),
    so that no rounding moves it; all of x for a chain of no row maximum."""
    values_of = VALUES_OF_A_ROW_MAXIMUM.get(chain)
    if values_of is None:
        return x
    with torch.no_grad():
        top_two = values_of(copy.deepcopy(model).double(), x.double()).topk(2, dim=1).values
    lead = (top_two[:, 0] - top_two[:, 1]) / top_two[:, 0].abs().clamp_min(1e-30)
    clear = x[lead > 8 * torch.finfo(x.dtype).eps]
    assert len(clear) >= 30, f"{chain.__name__}: only {len(clear)} rows of a clear maximum"
    return clear


class _Chain(torch.nn.Module):
    def __init__(self, chain):
        super().__init__()
        self.fc, self.chain = torch.nn.Linear(512, 1024), chain

    def forward(self, x):
        return self.chain(self, x)


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("chain", [_max_minus_mean_gelu, _sum_max_mean_logsumexp_twice, _scaled_plus_detached,
                                   _standardized_by_std, _normalized_embedding, _row_norms,
                                   _avg_pool_gelu_scale_max])
def test_kernelbench_chains_fuse_whole_and_train(chain, precision):
    dtype = DTYPES[precision]
    model = _Chain(chain).to("cuda", dtype)
    x = torch.randn(300, 512, device="cuda", dtype=dtype)
    optimized = fxfuse.optimize(model, [x])
    assert fused_op_count(optimized) == 1 and not optimized.fxfuse_report.near_misses
    Judge(model, dtype).check(optimized(x), [x], chain.__name__)
    params = list(model.parameters())
    x = _rows_of_a_clear_maximum(chain, model, x)
    expected, actual = gradients(model, [x], params), gradients(optimized, [x], params)
    bound = 1e-4 if dtype == torch.float32 else 2e-2
    for name, want, got in zip(["x", "weight", "bias"], expected, actual):
        error = (got - want).abs().max().item()  # within the bound of the largest, or exactly eager's 0
        assert error <= bound * want.abs().max().item(), f"{chain.__name__}: d/d{name} off by {error:.3g}"


class _ScaledOutsideTensors(torch.nn.Module):
    """alpha scaling a param and addcmul of two params: steps on outside tensors alone, which run before the fused op
    (rewrite's hoist_param_steps), so that the kernels bind the rest."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(512, 1024)
        self.shift, self.gate = torch.nn.Parameter(torch.randn(1024)), torch.nn.Parameter(torch.randn(1024))

    def forward(self, x):
        h = torch.sub(self.fc(x), self.shift, alpha=0.5)
        return torch.nn.functional.gelu(h.addcmul(self.shift, self.gate, value=2.0))


@pytest.mark.parametrize("precision", sorted(DTYPES))
def test_steps_on_outside_tensors_alone_leave_the_epilogue_to_the_kernels(precision, caplog):
    dtype = DTYPES[precision]
    model = _ScaledOutsideTensors().to("cuda", dtype)
    x = torch.randn(300, 512, device="cuda", dtype=dtype)
    optimized = fxfuse.optimize(model, [x])
    assert fused_op_count(optimized) == 1
    with caplog.at_level("DEBUG", logger="fxfuse"):
        out = optimized(x)
        out.sum().backward()
    fallbacks = [r.getMessage() for r in caplog.records if "runs the reference" in r.getMessage()]
    assert not fallbacks, fallbacks
    Judge(model, dtype).check(out, [x], "scaled outside tensors")
