"""Times the fused op against the GEMM alone for 16-bit rows of several widths (one kernel variant per process).

Usage: python dev/row_width_bench.py current|dev/variants/NN_name.patch
The fast row kernels hold 32 values a thread in 16-bit storage for rows of more than 512 features
(`fast_row_values`, program_format.cuh), a choice measured on rows of 8192 only (variant 98). The pool example's
rows are 2048 wide after the fold, and its bf16 row kernel read 24 µs against fp32's 8 in a kernel trace (which
counts the early launch's wait). This prints, per width and program, the whole op's time over F.linear's and the
time it adds (the median of interleaved calls, as fxfuse.bench times them), for bf16 at 1024 rows, K = 8192.
hardtanh and mish are chains of FXFUSE_ROW_CHAINS, pool_gelu_max and norm_gelu of FXFUSE_LIBM_ROW_CHAINS (compiled
whole); norm_silu is interpreted, by the build without libdevice ops.
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fxfuse.bench import time_interleaved_ms

sys.path.insert(0, str(Path(__file__).parent))
from variant_sources import load_kernels  # noqa: E402

# Program text, and the shapes of its params, for `features` wide rows.
PROGRAMS = {
    "pool_gelu_max": (lambda n: "gelu(%0,'none');mul(%1,2.0);max_dim(%2,1,False)", lambda n: []),
    "norm_silu": (lambda n: "group_norm(%0,$0,$1,16,1e-05);silu(%1)", lambda n: [(n,), (n,)]),
    "norm_gelu": (lambda n: "group_norm(%0,$0,$1,16,1e-05);gelu(%1,'none')", lambda n: [(n,), (n,)]),
    "hardtanh": (lambda n: "group_norm(%0,$0,$1,16,1e-05);hardtanh(%1,-2.0,2.0)", lambda n: [(n,), (n,)]),
    "mish": (lambda n: "add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,256,1e-05)",
             lambda n: [(n,)] * 3),
}


def main():
    variant = load_kernels(sys.argv[1] if len(sys.argv) > 1 else "current")
    dtype = torch.bfloat16
    for features in (1024, 2048, 4096, 8192):
        inputs = [[torch.rand(1024, 8192, device="cuda", dtype=dtype)] for _ in range(4)]
        w = torch.randn(features, 8192, device="cuda", dtype=dtype) * 8192 ** -0.5
        b = torch.randn(features, device="cuda", dtype=dtype)
        calls = {"gemm": lambda x: F.linear(x, w, b)}
        for name, (text, shapes) in PROGRAMS.items():
            params = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes(features)]
            calls[name] = lambda x, p=params, t=text(features): torch.ops.fxfuse.gemm_epilogue(x, w, b, p, t)
        times = time_interleaved_ms(calls, inputs, runs=100)
        for name in PROGRAMS:
            print(f"{variant:<28} bf16 {features:5d} features {name:<14} op/GEMM {times[name] / times['gemm']:.3f}  "
                  f"+{(times[name] - times['gemm']) * 1e3:5.1f} µs over the GEMM's {times['gemm'] * 1e3:6.1f}")


if __name__ == "__main__":
    main()
