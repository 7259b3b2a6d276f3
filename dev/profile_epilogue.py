"""Runs each example program once at full size (1024 x 8192 -> 8192) for ncu to profile the epilogue kernels.

Usage: ncu --kernel-name regex:'row_program|broadcast_tail' python dev/profile_epilogue.py [fp32|bf16] [VARIANT]
(VARIANT: "current", the default, or dev/variants/NN_name.patch)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from variant_sources import load_kernels  # noqa: E402

PROGRAMS = {
    "mish": ("add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,256,1e-05)", [(8192,)] * 3),
    "min_bias": ("group_norm(%0,$0,$1,512,1e-05);min_dim(%1,1,True);add(%2,$2)", [(8192,), (8192,), (1, 8192, 1, 1)]),
    "leaky_sum": ("group_norm(%0,$0,$1,512,1e-05);leaky_relu(%1,0.01);add(%2,%2)", [(8192,)] * 2),
    "hardtanh": ("group_norm(%0,$0,$1,16,1e-05);hardtanh(%1,-2.0,2.0)", [(8192,)] * 2),
}


def main():
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "fp32"]
    load_kernels(sys.argv[2] if len(sys.argv) > 2 else "current")
    x = torch.randn(1024, 8192, device="cuda", dtype=dtype)
    w = torch.randn(8192, 8192, device="cuda", dtype=dtype) * 8192 ** -0.5
    b = torch.randn(8192, device="cuda", dtype=dtype)
    for program, shapes in PROGRAMS.values():
        params = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
        torch.ops.fxfuse.gemm_epilogue(x, w, b, params, program)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
