"""fxfuse.testing is what users unit-test their models and idioms with: its helpers must fail when they should,
with a message that says what went wrong."""
import pytest
import torch
import torch.nn as nn

from fxfuse.testing import assert_close_report, assert_fuses, assert_not_fused, fused_op_count


def linear_relu():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU())


class Noisy(nn.Module):
    """Each call adds fresh noise, so no two runs agree: a stand-in for a fused model that is wrong."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return torch.relu(self.fc(x)) + torch.rand_like(self.fc.bias)


def test_assert_fuses_reports_a_wrong_region_count_with_the_explain_table():
    with pytest.raises(AssertionError, match=r"expected 2 fused region\(s\), found 1\nfxfuse: 1 fused region"):
        assert_fuses(linear_relu(), (torch.randn(2, 8),), regions=2)


def test_assert_fuses_reports_a_numeric_mismatch_with_the_worst_element():
    with pytest.raises(AssertionError, match=r"output 0 differs from eager; worst at index \(\d+, \d+\): fused"):
        assert_fuses(Noisy(), (torch.randn(2, 8),), regions=1)


def test_assert_fuses_compares_every_output():
    class TwoOutputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)

        def forward(self, x):
            return torch.relu(self.fc(x)), torch.rand(3)

    with pytest.raises(AssertionError, match="output 1 differs from eager"):
        assert_fuses(TwoOutputs(), (torch.randn(2, 8),), regions=1)


def test_assert_not_fused_fails_on_a_fused_model():
    with pytest.raises(AssertionError, match=r"expected 0 fused region\(s\), found 1"):
        assert_not_fused(linear_relu(), (torch.randn(2, 8),))


def test_assert_not_fused_checks_the_reason():
    model = nn.Sequential(nn.Linear(8, 16))
    assert_not_fused(model, (torch.randn(2, 8),), reason="no epilogue op follows the GEMM")
    with pytest.raises(AssertionError, match="no near miss says 'float64'"):
        assert_not_fused(model, (torch.randn(2, 8),), reason="float64")


def test_assert_close_report_checks_shape_and_dtype():
    with pytest.raises(AssertionError, match=r"shape \(2, 3\) != eager's \(3, 2\)"):
        assert_close_report(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(AssertionError, match="dtype torch.float64 != eager's torch.float32"):
        assert_close_report(torch.zeros(2, dtype=torch.float64), torch.zeros(2))


def test_assert_close_report_treats_nan_as_equal_only_where_eager_has_nan():
    nan = float("nan")
    assert_close_report(torch.tensor([1.0, nan]), torch.tensor([1.0, nan]))
    with pytest.raises(AssertionError, match=r"worst at index \(1,\): fused nan vs eager 2.0"):
        assert_close_report(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0]))


def test_fused_op_count_counts_fused_ops_in_submodules():
    optimized = assert_fuses(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh()),
                             (torch.randn(2, 8),), regions=2)
    assert fused_op_count(optimized) == 2
    assert fused_op_count(linear_relu()) == 0
