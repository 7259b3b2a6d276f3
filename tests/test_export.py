"""torch.export of an optimized model: the fxfuse op stays in the exported program (its fake implementation
gives export the shapes), the program runs and matches eager, with a dynamic batch, after
run_decompositions(), and through torch.export.save / load.
"""
import io
import operator

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse.modelfile import example_files, load_model_file
from fxfuse.testing import assert_close_report, exported_ops_reading_inputs, fused_op_count

gemm_epilogue = torch.ops.fxfuse.gemm_epilogue.default
EXAMPLES = {path.stem: path for path in example_files()}


def _ops(program) -> list:
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


def _export(model, inputs, strict=False):
    batch = torch.export.Dim("batch", min=2, max=4096)
    dynamic_shapes = tuple({0: batch} for _ in inputs)
    return torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic_shapes, strict=strict)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_exported_optimized_example_keeps_the_op_and_runs(name, strict):
    model, inputs = load_model_file(EXAMPLES[name], small=True).build()
    optimized = fxfuse.optimize(model, inputs)
    assert fused_op_count(optimized) == 1
    program = _export(optimized, inputs, strict)
    assert exported_ops_reading_inputs(program) == [gemm_epilogue] and _ops(program).count(gemm_epilogue) == 1, \
        f"exported ops: {_ops(program)}"
    with torch.no_grad():
        for batch in (inputs[0].shape[0], 5):
            x = [torch.rand(batch, *t.shape[1:]) for t in inputs]
            assert_close_report(program.module()(*x), model(*x))


def test_run_decompositions_keeps_the_op():
    model, inputs = load_model_file(EXAMPLES["linear_hardtanh_mish_groupnorm"], small=True).build()
    program = _export(fxfuse.optimize(model, inputs), inputs).run_decompositions()
    assert gemm_epilogue in _ops(program)
    with torch.no_grad():
        assert_close_report(program.module()(*inputs), model(*inputs))


def test_save_and_load_round_trip():
    model, inputs = load_model_file(EXAMPLES["linear_groupnorm_min_bias"], small=True).build()
    program = _export(fxfuse.optimize(model, inputs), inputs)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    assert _ops(loaded) == [gemm_epilogue]
    with torch.no_grad():
        assert_close_report(loaded.module()(*inputs), model(*inputs))


def test_exported_eval_model_with_folded_batch_norm_and_second_input():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 32)
            self.bn = nn.BatchNorm1d(32)
            self.drop = nn.Dropout(0.2)

        def forward(self, x, y):
            return torch.relu(self.drop(self.bn(self.fc(x)))) * y

    model = Residual().eval()
    model.bn.running_mean.normal_()
    model.bn.running_var.uniform_(0.5, 2.0)
    inputs = (torch.randn(6, 16), torch.randn(6, 32))
    optimized = fxfuse.optimize(model, inputs)
    assert fused_op_count(optimized) == 1
    program = _export(optimized, inputs)
    assert _ops(program) == [gemm_epilogue]
    with torch.no_grad():
        assert_close_report(program.module()(*inputs), model(*inputs))


def test_exported_train_mode_model_keeps_the_training_op_and_trains():
    """A train-mode model's training op stays in the exported program (export takes each of its outputs out)."""
    model, inputs = load_model_file(EXAMPLES["linear_groupnorm_min_bias"], small=True).build()
    optimized = fxfuse.optimize(model.train(), inputs)
    program = _export(optimized, inputs)
    ops = _ops(program)
    assert ops[0] is torch.ops.fxfuse.gemm_epilogue_train.default and set(ops[1:]) == {operator.getitem}, ops
    with torch.no_grad():
        assert_close_report(program.module()(*inputs), model(*inputs))
    exported = program.module()
    x = inputs[0].clone().requires_grad_()
    (grad,) = torch.autograd.grad(exported(x).square().sum(), [x])
    (expected,) = torch.autograd.grad(model(x).square().sum(), [x])
    assert_close_report(grad, expected, rtol=1e-4, atol=1e-5, what="gradient of x")


def test_exported_program_trains():
    """The op's autograd comes along: gradients of an exported program's module match eager's."""
    model, inputs = load_model_file(EXAMPLES["linear_groupnorm_hardtanh"], small=True).build()
    exported = _export(fxfuse.optimize(model, inputs), inputs).module()
    params = dict(exported.named_parameters())
    # The exported module holds its own copies of the parameters: compare gradients by name.
    eager_grads = torch.autograd.grad((model(*inputs) * 0.5).square().sum(), list(model.parameters()))
    fused_grads = torch.autograd.grad((exported(*inputs) * 0.5).square().sum(),
                                      [params[name] for name, _ in model.named_parameters()])
    for (name, _), e, a in zip(model.named_parameters(), eager_grads, fused_grads):
        assert_close_report(a, e, rtol=1e-4, atol=1e-5, what=f"gradient of {name}")


def test_an_exported_programs_module_given_to_optimize_still_runs():
    """ep.module() holds aten ops, which fxfuse does not fuse; the unfused copy optimize() returned had lost its plain
    attributes (GraphModule's copy keeps none), so export's input check hook raised AttributeError at each call."""
    model, inputs = load_model_file(EXAMPLES["linear_groupnorm_hardtanh"], small=True).build()
    program = _export(model, inputs)
    optimized = fxfuse.optimize(program.module(), inputs)
    with torch.no_grad():
        assert_close_report(optimized(*inputs), model(*inputs))
