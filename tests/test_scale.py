"""The pass scales: optimize() on a traced model of over 10,000 nodes (500 stacked Linear blocks).

Issue 2 asks for under 5 s on one CPU core; the test asserts a generous 20 s so that a loaded CI machine
doesn't make it flaky, and prints the time.
"""
import time

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse.testing import assert_close_report, fused_op_count

BLOCKS = 500
WIDTH = 8
BOUND_SECONDS = 20.0


class Block(nn.Module):
    """Linear -> bias -> GELU -> LayerNorm -> scale -> clamp -> x*sigmoid(x) -> - row max -> + residual.

    All of it after the Linear is one fused region, which reads the block's input as an outside operand.
    """

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.bias = nn.Parameter(torch.randn(WIDTH) * 0.1)
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.fc(x) + self.bias
        h = F.gelu(h)
        h = self.norm(h)
        h = self.drop(h) * self.scale
        h = torch.clamp(h, -3.0, 3.0)
        h = h * torch.sigmoid(h)
        h = F.leaky_relu(h, 0.1)
        h = h - h.amax(-1, keepdim=True)
        h = torch.tanh(h) * 0.5 + 0.5
        h = h.abs() + h.relu() * 2.0
        return h + x


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_optimize_of_10000_nodes_is_fast(one_thread):
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)]).eval()
    traced = fx.symbolic_trace(model)
    nodes = len(traced.graph.nodes)
    assert nodes >= 10_000, f"the model has only {nodes} nodes"
    start = time.perf_counter()
    optimized = fxfuse.optimize(traced)
    seconds = time.perf_counter() - start
    print(f"\noptimize() of {nodes} nodes ({BLOCKS} blocks): {seconds:.2f} s")
    assert fused_op_count(optimized) == BLOCKS
    assert seconds < BOUND_SECONDS, f"optimize() took {seconds:.1f} s on {nodes} nodes"
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        assert_close_report(optimized(x), model(x), rtol=1e-4, atol=1e-5)


def test_matching_time_grows_about_linearly(one_thread):
    """Twice the blocks should take about twice the time, far from the 4x of a quadratic pass."""
    def time_of(blocks):
        traced = fx.symbolic_trace(nn.Sequential(*[Block() for _ in range(blocks)]).eval())
        start = time.perf_counter()
        fxfuse.optimize(traced)
        return time.perf_counter() - start

    time_of(10)  # warm caches (idiom patterns, program parsing)
    small, large = min(time_of(50) for _ in range(2)), min(time_of(200) for _ in range(2))
    print(f"\n50 blocks: {small:.2f} s, 200 blocks: {large:.2f} s ({large / small:.1f}x)")
    assert large / small < 10, f"4x the blocks took {large / small:.1f}x the time"


class NormedBlock(nn.Module):
    """Linear -> BatchNorm1d -> ReLU: every BatchNorm call may change its statistics, which matching weighs against
    every earlier region."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)

    def forward(self, x):
        return F.relu(self.bn(self.fc(x))) + x


def test_blocks_with_batch_norms_match_in_about_linear_time(one_thread):
    """Each region's reads were walked back through every earlier fused op, and each later norm's statistics
    weighed against them with storages found anew: 80 such blocks took 47 s (found by review), 320 now about 4."""
    def time_of(blocks):
        model = nn.Sequential(*[NormedBlock() for _ in range(blocks)]).eval()
        start = time.perf_counter()
        optimized = fxfuse.optimize(model, (torch.randn(4, WIDTH),))
        assert fused_op_count(optimized) == blocks
        return time.perf_counter() - start

    time_of(5)
    small, large = time_of(40), time_of(160)
    print(f"\n40 blocks: {small:.2f} s, 160 blocks: {large:.2f} s ({large / small:.1f}x)")
    assert large / small < 12, f"4x the blocks took {large / small:.1f}x the time"


class LongOperandChain(nn.Module):
    """The GEMM output times a tensor made by 3000 adds: a chain that looks like a number's arithmetic to a walk
    looking for sizes (`h * (n + 1)`), until its first node."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, y):
        for _ in range(3000):
            y = y + 1.0
        return self.fc(x) * y


def test_a_long_chain_of_adds_as_an_operand_is_matched_in_time():
    model = LongOperandChain().eval()
    inputs = (torch.randn(4, WIDTH), torch.randn(4, WIDTH))
    start = time.perf_counter()
    optimized = fxfuse.optimize(model)
    elapsed = time.perf_counter() - start
    print(f"optimize() with a 3000-node operand chain: {elapsed:.2f} s")
    errors = [row.reason for row in optimized.fxfuse_report.skipped if "fxfuse error" in row.reason]
    assert not errors, errors
    assert elapsed < BOUND_SECONDS
    with torch.no_grad():
        assert_close_report(optimized(*inputs), model(*inputs))
