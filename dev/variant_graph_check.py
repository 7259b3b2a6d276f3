"""Checks one kernel variant where timing does not look: the min + bias program (row kernel, then broadcast tail)
on a side stream and replayed from a CUDA graph with fresh inputs, against eager calls and the float64 reference.

Usage: python dev/variant_graph_check.py dev/variants/NN_name.patch   (or "current")
Prints, per dtype, whether the side stream's result equals the default stream's, whether the graph's replay equals
an eager call on the same inputs, and the replay's ||out - ref|| / ||ref||.
"""
import sys
from pathlib import Path

import torch

from fxfuse.program import run_reference

sys.path.insert(0, str(Path(__file__).parent))
from variant_sources import load_kernels  # noqa: E402

load_kernels(sys.argv[1])
PROGRAM = "group_norm(%0,$0,$1,512,1e-05);min_dim(%1,1,True);add(%2,$2)"
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(1024, 1024, device="cuda", dtype=dtype)
    w = torch.randn(8192, 1024, device="cuda", dtype=dtype) * 1024 ** -0.5
    b = torch.randn(8192, device="cuda", dtype=dtype)
    params = [torch.randn(8192, device="cuda", dtype=dtype), torch.randn(8192, device="cuda", dtype=dtype),
              torch.randn(1, 8192, 1, 1, device="cuda", dtype=dtype)]
    call = lambda: torch.ops.fxfuse.gemm_epilogue(x, w, b, params, PROGRAM)
    eager = call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side = call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    x.copy_(torch.randn_like(x))
    graph.replay()
    fresh = call()
    torch.cuda.synchronize()
    ref = run_reference(x.double(), w.double(), b.double(), [p.double() for p in params], PROGRAM)
    error = ((captured.double() - ref).norm() / ref.norm()).item()
    print(f"{str(dtype)[6:]:9s} side stream equal: {torch.equal(side, eager)}  graph replay equal: "
          f"{torch.equal(captured, fresh)}  replay error {error:.1e}")
