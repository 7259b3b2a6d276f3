"""An average pool over a GEMM's output features folds into the GEMM: its weight's rows (and its bias) are averaged
in the pool's windows before the fused op, whose GEMM is then that many times smaller.

Each spelling of avg_pool1d over the features (the module, F.avg_pool1d, torch.avg_pool1d, on the 2-D output or
between `unsqueeze(1)` and `squeeze(1)` as KernelBench writes it) fuses with the ops after it, matches eager in each
dtype and trains with eager's gradients; pools that are no mean of whole windows of the features do not fold.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from epilogue_models import BATCH, IN, OUT, GemmThen, assert_reason, assert_whole_chain_fused, fused_programs
from fxfuse.testing import assert_close_report, assert_gradients_match, fused_op_count


def pool_module(m, x, y):
    return m.pool(m.fc(x).unsqueeze(1)).squeeze(1).relu()


def pool_module_on_rows(m, x, y):  # avg_pool1d reads a 2-D value as (channels, length): it pools the features
    return torch.tanh(m.pool(m.fc(x)))


def pool_functional(m, x, y):
    return F.gelu(F.avg_pool1d(m.fc(x).unsqueeze(-2), 3).squeeze(-2))


def pool_keywords(m, x, y):
    return torch.avg_pool1d(m.fc(x), kernel_size=(4,), stride=4, padding=0, ceil_mode=False) * 2.0


def pool_positional(m, x, y):
    return F.avg_pool1d(m.fc(x), 2, 2, 0, False, False).sigmoid()


def pool_then_max(m, x, y):  # KernelBench's Matmul_AvgPool_GELU_Scale_Max
    h = m.pool(m.fc(x).unsqueeze(1)).squeeze(1)
    return torch.max(F.gelu(h) * 2.0, dim=1).values


def pool_alone(m, x, y):
    return m.pool(m.fc(x).unsqueeze(1)).squeeze(1)


def pool_of_matmul_plus_bias(m, x, y):  # the bias, added first, is averaged as the weight
    return F.avg_pool1d(x @ m.fc.weight.t() + m.fc.bias, 4).relu()


def pool_of_addmm(m, x, y):
    return torch.tanh(F.avg_pool1d(torch.addmm(m.fc.bias, x, m.fc.weight.t()), 4))


def pool_of_two_biases(m, x, y):
    return m.pool(m.fc(x) + m.shift).relu()


# spelling -> its kernel (the model's nn.AvgPool1d has 4)
SPELLINGS = {pool_module: 4, pool_module_on_rows: 4, pool_functional: 3, pool_keywords: 4, pool_positional: 2,
             pool_then_max: 4, pool_alone: 4, pool_of_matmul_plus_bias: 4, pool_of_addmm: 4, pool_of_two_biases: 4}


def pooled(epilogue, kernel=4, out_features=OUT, bias=True):
    return GemmThen(epilogue, out_features=out_features, bias=bias, pool=nn.AvgPool1d(kernel),
                    shift=nn.Parameter(torch.randn(out_features))).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("epilogue", SPELLINGS, ids=lambda f: f.__name__)
def test_each_spelling_folds_into_the_gemm(epilogue, dtype):
    model = pooled(epilogue).to(dtype)
    x = torch.randn(BATCH, IN, dtype=dtype)
    optimized = assert_whole_chain_fused(model, [x])
    (row,) = optimized.fxfuse_report.fused
    assert row.pool == SPELLINGS[epilogue]
    assert f"weight rows averaged by {row.pool}" in str(optimized.fxfuse_report)


@pytest.mark.parametrize("out_features", [OUT, 41, 7, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_a_partial_last_window_is_dropped_as_eager_drops_it(out_features, bias):
    model = pooled(pool_module, kernel=3, out_features=out_features, bias=bias)
    optimized = assert_whole_chain_fused(model, [torch.randn(5, IN)], example_inputs=False)
    assert optimized(torch.randn(1, IN)).shape == (1, out_features // 3)


def test_three_dims_pool_the_features_and_a_call_of_other_ranks_runs_the_model():
    model = pooled(pool_module_on_rows)
    x3 = torch.randn(2, BATCH, IN)
    assert_whole_chain_fused(model, [x3])  # with a 3-D example: the program holds for 3-D inputs
    optimized = fxfuse.optimize(model)  # without: for 2-D ones, checked first
    with torch.no_grad():
        for x in (torch.randn(BATCH, IN), x3):
            assert_close_report(optimized(x), model(x))
        with pytest.raises(RuntimeError) as eager:
            model(torch.randn(2, 2, BATCH, IN))
        with pytest.raises(type(eager.value)) as fused:
            optimized(torch.randn(2, 2, BATCH, IN))
        assert str(fused.value) == str(eager.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("epilogue", [pool_then_max, pool_module, pool_alone], ids=lambda f: f.__name__)
def test_gradients_reach_the_weight_through_the_pool(epilogue, dtype):
    model = pooled(epilogue).to(dtype).train()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1
    assert_gradients_match(model, optimized, [torch.randn(BATCH, IN, dtype=dtype)])


def test_a_pool_alone_of_three_dims_changed_in_place_gives_eagers_gradients():
    """A pool alone after the GEMM (an empty program) returned linear's output, which for an x of 3 dims is a view of
    its 2-D GEMM: an in-place op on it made the backward raise autograd's "a view and is being modified inplace"
    (optimize_hunt seed 222094). The fused op's result is a tensor of its own."""
    def pool_then_scale_in_place(m, x, y):
        h = F.avg_pool1d(m.fc(x), 4)
        h.mul_(y)  # (a number among the example inputs: outside the fused op)
        return h.relu()

    model = pooled(pool_then_scale_in_place)
    x = torch.randn(2, BATCH, IN)
    optimized = fxfuse.optimize(model, [x, 2.0])
    assert fused_programs(optimized) == [""]
    assert_gradients_match(model, optimized, [x, 2.0])


def test_the_backend_folds_it_too():
    model = pooled(pool_then_max)
    backend = fxfuse.make_backend("eager")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(BATCH, IN)
    with torch.no_grad():
        assert_close_report(compiled(x), model(x))
    assert [row.pool for report in backend.reports for row in report.fused] == [4]


@pytest.mark.usefixtures("fresh_dynamo")  # (the second batch size recompiles: Dynamo must not remember the last test)
@pytest.mark.parametrize("epilogue", [pool_of_two_biases, pool_of_matmul_plus_bias], ids=lambda f: f.__name__)
def test_the_backend_folds_a_pool_after_bias_adds(epilogue):
    """In Dynamo's graph a module's parameters are graph inputs, not module tensors: a bias added before the pool
    was refused as "a value the region computed" under torch.compile, where optimize() folds it. Guards keep the
    shapes of graph inputs, so the bias averages with the weight as a module tensor does."""
    model = pooled(epilogue).train()
    backend = fxfuse.make_backend("eager")
    compiled = torch.compile(model, backend=backend)
    for batch in (BATCH, 5):  # (the second batch size recompiles with a dynamic batch)
        assert_gradients_match(model, compiled, [torch.randn(batch, IN)])
    assert [row.pool for report in backend.reports for row in report.fused] == [4, 4]


@pytest.mark.parametrize("epilogue, reason", [
    (lambda m, x, y: F.avg_pool1d(m.fc(x), 2, stride=1), "only windows that tile the features"),
    (lambda m, x, y: F.avg_pool1d(m.fc(x), 2, padding=1), "padding or ceil_mode"),
    (lambda m, x, y: F.avg_pool1d(m.fc(x), 3, ceil_mode=True), "padding or ceil_mode"),
    (lambda m, x, y: F.avg_pool1d(m.fc(x).relu(), 2), "only the GEMM's own output"),
    (lambda m, x, y: F.avg_pool1d(m.fc(x) + m.fc.bias[None], 2), "only the GEMM's own output"),  # (1, N)
    (lambda m, x, y: F.avg_pool1d(m.fc(x) + y, 2), "only the GEMM's own output"),  # a forward argument's
    # (KernelBench's spelling: the reason, not "`unsqueeze` is not an epilogue op")
    (lambda m, x, y: F.avg_pool1d(m.fc(x).unsqueeze(1), 4, 2).squeeze(1), "only windows that tile the features"),
    (lambda m, x, y: F.avg_pool1d(m.fc(x).unsqueeze(1), 3, ceil_mode=True).squeeze(1), "padding or ceil_mode"),
], ids=["overlapping", "padding", "ceil_mode", "after_an_op", "bias_of_two_dims", "argument_bias",
        "unsqueezed_overlapping", "unsqueezed_ceil_mode"])
def test_pools_that_are_no_mean_of_whole_windows_do_not_fold(epilogue, reason):
    model = GemmThen(epilogue).eval()
    x, y = torch.randn(BATCH, IN), torch.randn(OUT)
    optimized = fxfuse.optimize(model, [x, y])
    assert_reason(optimized, reason)
    assert all("avg_pool1d" not in name for row in optimized.fxfuse_report.fused for name in row.replaced)
    with torch.no_grad():
        assert_close_report(optimized(x, y), model(x, y))


def test_a_bias_read_again_after_the_pool_is_not_the_averaged_one():
    """`pool(h + b) + b`: the first b is averaged with the weight, the second keeps its features, which eager
    broadcasts with the pooled ones (here: N // 4 = 1 feature) or raises for."""
    model = pooled(lambda m, x, y: F.avg_pool1d(m.fc(x) + m.shift, 4) + m.shift, out_features=4)
    x = torch.randn(BATCH, IN)
    optimized = fxfuse.optimize(model, [x])
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    wider = pooled(lambda m, x, y: F.avg_pool1d(m.fc(x) + m.shift, 4) + m.shift)
    with pytest.raises(RuntimeError) as eager, torch.no_grad():
        wider(x)
    with pytest.raises(type(eager.value)), torch.no_grad():
        fxfuse.optimize(wider, [x])(x)


def pool_and_sum(m, x, y):
    h = m.fc(x)
    return F.avg_pool1d(h, 4).sum(-1, keepdim=True) + h.sum(-1, keepdim=True)


def two_pools(m, x, y):
    h = m.fc(x)
    return F.avg_pool1d(h, 4).sum(-1) + F.avg_pool1d(h, 2).sum(-1)


@pytest.mark.parametrize("epilogue, reason", [
    (pool_and_sum, "of which the fused op computes no value"),
    (two_pools, "`avg_pool1d_1` pools `fc`, of which the fused op computes no value"),
], ids=["sum_beside_the_pool", "a_second_pool"])
def test_the_gemm_output_read_beside_its_pool_does_not_fold(epilogue, reason):
    """The pooled GEMM computes no unpooled output: `h.sum()` beside `pool(h)` read the pooled value as the GEMM's
    (a silent wrong result); in `pool(h, 4) + pool(h, 2)` the first folds into the weight, so the fused op computes
    no h for the second."""
    model = GemmThen(epilogue).eval()
    x = torch.randn(BATCH, IN)
    optimized = fxfuse.optimize(model, [x])
    assert_reason(optimized, reason)
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


def test_float16_does_not_fold():
    """A GEMM column may overflow float16 where its window's mean does not: the folded GEMM would differ."""
    model = pooled(pool_module).half()
    optimized = fxfuse.optimize(model)
    assert fused_programs(optimized) == []
    assert_reason(optimized, "in float16")


def test_an_unsqueezed_pool_of_three_dims_raises_as_eager():
    model = pooled(pool_module)
    x = torch.randn(2, BATCH, IN)
    with pytest.raises(RuntimeError) as eager, torch.no_grad():
        model(x)
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1
    with pytest.raises(type(eager.value)) as fused, torch.no_grad():
        optimized(x)
    assert str(fused.value) == str(eager.value)


@pytest.mark.parametrize("epilogue", [
    lambda m, x, y: F.avg_pool1d(m.fc(x) + m.shift + m.shift, 4).relu(),
    lambda m, x, y: F.avg_pool1d(m.fc(x) + m.fc.bias + m.shift + m.fc.bias, 4),
], ids=["shift_twice", "bias_twice_around_shift"])
def test_a_bias_added_twice_before_the_pool_is_averaged_once(epilogue):
    """`pool(h + s + s)`: both adds read one param, which the rewritten graph averaged once per add (a mean of the
    mean: one feature, broadcast over the pooled ones, a silent wrong result)."""
    model = pooled(epilogue)
    x = torch.randn(BATCH, IN)
    optimized = assert_whole_chain_fused(model, [x])
    assert [row.pool for row in optimized.fxfuse_report.fused] == [4]
    assert_gradients_match(model.train(), fxfuse.optimize(model.train()), [x])


@pytest.mark.parametrize("epilogue, example, calls", [
    (lambda m, x, y: F.avg_pool1d(F.linear(x, m.fc.weight, y), 4).relu(), (OUT,), [(1, OUT), (BATCH, OUT), (1,), (5,)]),
    (lambda m, x, y: F.avg_pool1d(torch.addmm(y, x, m.fc.weight.t()), 4).relu(), (OUT,), [(1, OUT), (BATCH, 1), (7,)]),
    (lambda m, x, y: F.avg_pool1d(F.linear(x, y), 4).relu(), (OUT, IN), [(12, IN), (2, IN)]),
], ids=["linear_bias", "addmm_input", "linear_weight"])
def test_a_weight_or_bias_of_forward_arguments_does_not_fold_under_optimize(epilogue, example, calls):
    """A later call's bias of another shape that broadcasts ((1, N), (B, N), (1,)) was averaged over its first dim
    (or to no values), where eager broadcasts it; a weight of fewer rows than the kernel gave no features, where
    eager's pool raises, and a bias of its own width averaged to the pooled width ran where eager raises."""
    model = GemmThen(epilogue).eval()
    x = torch.randn(BATCH, IN)
    optimized = fxfuse.optimize(model, [x, torch.randn(example)])
    assert_reason(optimized, "may differ at a later call")
    with torch.no_grad():
        for shape in calls:
            y = torch.randn(shape)
            try:
                expected = model(x, y)
            except RuntimeError as error:
                with pytest.raises(type(error)):
                    optimized(x, y)
            else:
                assert_close_report(optimized(x, y), expected)


@pytest.mark.parametrize("epilogue, shape", [
    (pool_module_on_rows, (0, IN)), (pool_module_on_rows, (2, 0, IN)), (pool_module_on_rows, (0, 3, IN)),
    (pool_module, (0, IN)),
], ids=["no_rows", "three_dims_no_channels", "three_dims_no_batch", "unsqueezed_no_rows"])
def test_an_empty_input_raises_where_eager_pool_reads_no_channels(epilogue, shape):
    """avg_pool1d reads a 2-D value as (channels, length), a 3-D one as (batch, channels, length): eager's pool
    raises for no channels (a 2-D input of no rows), where the folded GEMM gave an empty result. No batch, or no rows
    between unsqueeze(1) and squeeze(1) (a batch then), run."""
    model = pooled(epilogue)
    x = torch.randn(shape)
    for optimized in (fxfuse.optimize(model), fxfuse.optimize(model, [torch.randn(*shape[:-2], 4, IN)])):
        assert fused_op_count(optimized) == 1
        with torch.no_grad():
            try:
                expected = model(x)
            except RuntimeError as error:
                with pytest.raises(type(error)) as fused:
                    optimized(x)
                assert str(fused.value) == str(error)
            else:
                assert_close_report(optimized(x), expected)


@pytest.mark.parametrize("epilogue", [pool_module, pool_module_on_rows], ids=lambda f: f.__name__)
def test_a_weight_of_fewer_rows_than_the_kernel_raises_as_eager(epilogue):
    """A module weight replaced after optimize() by one of fewer rows than the pool's kernel: eager's pool raises (no
    window), where the averaged weight had no rows and the fused op gave an empty result."""
    model = pooled(epilogue)
    optimized = fxfuse.optimize(model)
    model.fc.weight, model.fc.bias = nn.Parameter(torch.randn(2, IN)), nn.Parameter(torch.randn(2))
    x = torch.randn(BATCH, IN)
    with torch.no_grad(), pytest.raises(RuntimeError, match="Output size is too small"):
        model(x)
    with torch.no_grad(), pytest.raises(RuntimeError, match="Output size is too small"):
        optimized(x)


def test_the_training_ops_gemm_output_is_recorded_of_the_pooled_width():
    """The rewritten graph's record of gemm_epilogue_train's (out, gemm_out): the folded GEMM computes N / k
    features, not the anchor's N."""
    model = pooled(pool_module).train()
    optimized = fxfuse.optimize(model, [torch.randn(BATCH, IN)])
    (pair,) = [n for n in optimized.graph.nodes if n.target is torch.ops.fxfuse.gemm_epilogue_train.default]
    assert pair.meta["val"][1].shape == (BATCH, OUT // 4)
    assert pair.meta["val"][1].is_contiguous()  # (as the op's: not a narrowed view of the anchor's N features)


@pytest.mark.parametrize("epilogue, pooled_value", [
    (lambda m, x, y: (lambda h: h.relu().sum(-1, keepdim=True) + F.avg_pool1d(h, 4))(m.fc(x)), "fc"),
    (lambda m, x, y: (lambda h: h.sigmoid() * 2 + m.pool(h.unsqueeze(1)).squeeze(1).repeat(1, 4))(m.fc(x) + m.shift),
     "add"),
], ids=["gemm_output", "plus_a_bias"])
def test_a_pool_after_other_ops_says_the_pool_must_come_first(epilogue, pooled_value):
    """`h.relu().sum(-1, keepdim=True) + pool(h)`: the relu read h first, and explain() said the pool 'pools a value the
    region computed: only the GEMM's own output ... folds', of the GEMM's own output."""
    model = pooled(epilogue)
    x = torch.randn(BATCH, IN)
    optimized = fxfuse.optimize(model, [x])
    assert_reason(optimized, f"pools `{pooled_value}` after other ops of the region: only a pool that comes first")
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


def pool_then_layer_norm(m, x, y):
    return F.layer_norm(m.pool(m.fc(x)), (OUT // 4,))


def pool_then_size_scale(m, x, y):
    h = m.pool(m.fc(x))
    return h * h.size(-1) ** -0.5


@pytest.mark.parametrize("epilogue", [pool_then_layer_norm, pool_then_size_scale], ids=lambda f: f.__name__)
def test_a_weight_of_other_rows_of_the_same_pooled_width_runs_as_eager(epilogue):
    """The program's numbers of the features (a normalized_shape, `h.size(-1)`) are of the pooled width, N // k: a
    module weight replaced after optimize() by one of other rows that pool to that width (41 // 4 == 40 // 4) runs as
    eager does (it raised fxfuse's 'had 40 features'); one of another pooled width still raises, as eager may; and
    one of fewer rows than the kernel raises eager's pool error."""
    model = pooled(epilogue)
    optimized = fxfuse.optimize(model)
    x = torch.randn(BATCH, IN)
    model.fc.weight, model.fc.bias = nn.Parameter(torch.randn(OUT + 1, IN)), nn.Parameter(torch.randn(OUT + 1))
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    model.fc.weight, model.fc.bias = nn.Parameter(torch.randn(OUT - 4, IN)), nn.Parameter(torch.randn(OUT - 4))
    with torch.no_grad(), pytest.raises(RuntimeError, match="had 10 features"):
        optimized(x)
    model.fc.weight, model.fc.bias = nn.Parameter(torch.randn(2, IN)), nn.Parameter(torch.randn(2))
    with torch.no_grad(), pytest.raises(RuntimeError, match="Output size is too small"):
        model(x)
    with torch.no_grad(), pytest.raises(RuntimeError, match="Output size is too small"):
        optimized(x)


def pool_of_a_submodules_shift(m, x, y):
    return m.pool(m.fc(x) + m.holder.shift).relu()


@pytest.mark.parametrize("epilogue, replaced", [
    (pool_module, "fc.bias"), (pool_of_a_submodules_shift, "holder.shift"), (pool_of_a_submodules_shift, "fc.bias"),
])
@pytest.mark.parametrize("shape", [(1,), (), (1, OUT), (BATCH, OUT), (OUT + 1,), (OUT - 1,)], ids=str)
def test_a_tensor_added_before_the_pool_replaced_by_one_of_another_shape_computes_as_eager(epilogue, replaced, shape):
    """A bias, or a module tensor added before the pool, replaced after optimize() by one of another shape: one that
    eager broadcasts over the features ((1,), a 0-d one) or across rows ((1, N), (B, N)) gives eager's result (it was
    averaged over its first dim as the weight's rows, and raised 'Output size is too small' where eager runs); one of
    other features (N + 1, of the same pooled width) raises as eager does (it ran)."""
    model = GemmThen(epilogue, pool=nn.AvgPool1d(4), holder=nn.Module()).eval()
    model.holder.shift = nn.Parameter(torch.randn(OUT))
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1
    module, name = replaced.split(".")
    setattr(getattr(model, module), name, nn.Parameter(torch.randn(shape)))
    x = torch.randn(BATCH, IN)
    with torch.no_grad():
        try:
            expected = model(x)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                optimized(x)
        else:
            assert_close_report(optimized(x), expected)


# The averaging op itself (torch.ops.fxfuse.mean_of_row_groups): shapes of the weight, of a bias, of more dims, a
# partial last group, a group of one and a tensor of exactly one group.
ROW_GROUP_SHAPES = [((12, 8), 4), ((41, 7), 4), ((41,), 3), ((10, 3, 5), 2), ((6, 4), 1), ((4, 9), 4)]


@pytest.mark.parametrize("shape, size", ROW_GROUP_SHAPES, ids=str)
@pytest.mark.parametrize("op", ["mean_of_row_groups", "mean_of_row_groups_fallback"])
def test_the_averaging_op_passes_opcheck(shape, size, op):
    tensor = torch.randn(shape, requires_grad=True)
    extra = ("a test of the fallback",) if op.endswith("fallback") else ()
    torch.library.opcheck(getattr(torch.ops.fxfuse, op).default, (tensor, size, *extra))


@pytest.mark.parametrize("shape, size", ROW_GROUP_SHAPES, ids=str)
def test_the_averaging_op_is_avg_pool1d_over_the_rows_with_its_gradients(shape, size):
    tensor = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    out = torch.ops.fxfuse.mean_of_row_groups(tensor, size)
    over_rows = tensor.reshape(shape[0], -1).t().unsqueeze(0)  # (1, columns, rows): avg_pool1d pools the rows
    expected = F.avg_pool1d(over_rows, size).squeeze(0).t().reshape(shape[0] // size, *shape[1:])
    assert_close_report(out, expected)
    torch.autograd.gradcheck(lambda t: torch.ops.fxfuse.mean_of_row_groups(t, size), (tensor,))
    torch.autograd.gradgradcheck(lambda t: torch.ops.fxfuse.mean_of_row_groups(t, size), (tensor,))


def test_the_rewritten_graph_averages_the_weight_with_the_op():
    optimized = fxfuse.optimize(pooled(pool_then_max))
    calls = [n for n in optimized.graph.nodes if n.target is torch.ops.fxfuse.mean_of_row_groups.default]
    # (the bias's goes through mean_of_feature_groups, which calls the op at run time)
    assert [n.args[0].target for n in calls] == ["fc.weight"], optimized.code
