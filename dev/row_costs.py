"""Epilogue kernel time of small programs at full size (1024 x 8192 -> 8192), to price each piece of a program.

Usage: python dev/row_costs.py [bf16|fp32] [current|dev/variants/NN_name.patch]   (prints CUDA µs per call of the
epilogue kernels; default: kernels/ as it is)
The first line is the yardstick: torch's in-place `mul_` over the output of the same `F.linear` (TF32 allowed).
"""
import sys
from pathlib import Path

import torch

from fxfuse.bench import ROW_KERNELS, epilogue_kernel_us

sys.path.insert(0, str(Path(__file__).parent))
from variant_sources import load_kernels  # noqa: E402

PROGRAMS = [  # (program, param shapes)
    ("relu(%0)", []),
    ("amin(%0,1,True)", []),
    ("sum(%0,-1,True)", []),
    ("group_norm(%0,$0,$1,512,1e-05)", [(8192,), (8192,)]),
    ("group_norm(%0,$0,$1,512,1e-05);min_dim(%1,1,True)", [(8192,), (8192,)]),
    ("group_norm(%0,$0,$1,512,1e-05);leaky_relu(%1,0.01);add(%2,%2)", [(8192,), (8192,)]),
    ("group_norm(%0,$0,$1,16,1e-05)", [(8192,), (8192,)]),
    ("layer_norm(%0,$0,$1,1e-05)", [(8192,), (8192,)]),
]

dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "bf16"]
load_kernels(sys.argv[2] if len(sys.argv) > 2 else "current")
x = torch.randn(1024, 8192, device="cuda", dtype=dtype)
w = torch.randn(8192, 8192, device="cuda", dtype=dtype) * 8192 ** -0.5
b = torch.randn(8192, device="cuda", dtype=dtype)
torch.backends.cuda.matmul.allow_tf32 = True  # the yardstick as measured for BENCHMARKS.md
mul_us = epilogue_kernel_us(lambda: torch.nn.functional.linear(x, w, b).mul_(1.0001), [], 20, ("elementwise",))
print(f"{str(dtype)[6:]:<9} {mul_us:6.1f} us  torch's in-place mul_ after F.linear")
torch.backends.cuda.matmul.allow_tf32 = False
for program, shapes in PROGRAMS:
    params = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
    call = lambda: torch.ops.fxfuse.gemm_epilogue(x, w, b, params, program)
    us = epilogue_kernel_us(call, [], 20, ROW_KERNELS)
    print(f"{str(dtype)[6:]:<9} {us:6.1f} us  {program}")
