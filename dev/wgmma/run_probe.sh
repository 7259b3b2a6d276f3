#!/usr/bin/env bash
# On the GPU machine: build dev/wgmma/gemm_probe.cu and time it beside F.linear's tf32 GEMM (the same timing: the
# median over 7 loops of the mean of 20 back-to-back launches), at the examples' size or M N K.
# Usage: [CLUSTERS="1 2"] [ROUNDS="0 1"] dev/wgmma/run_probe.sh [M N K]
#   (CLUSTERS: the cluster sizes to build; ROUNDS: 0 the tensor cores truncate the inputs, 1 rounded in shared memory)
set -euo pipefail
cd "$(dirname "$0")/../.."
for cluster in ${CLUSTERS:-1 2}; do
  for round in ${ROUNDS:-0 1}; do
    nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DCLUSTER_SIZE=$cluster -DROUND_INPUTS=$round \
      -o /tmp/wgmma_gemm_probe dev/wgmma/gemm_probe.cu
    timeout 60 /tmp/wgmma_gemm_probe "$@"
  done
done
python3 - "$@" <<'PY'
import sys
import torch
import torch.nn.functional as F
M, N, K = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (1024, 8192, 8192)
torch.backends.cuda.matmul.allow_tf32 = True
x = torch.rand(M, K, device="cuda")
w = (torch.rand(N, K, device="cuda") * 2 - 1) / K ** 0.5
b = (torch.rand(N, device="cuda") * 2 - 1) / K ** 0.5
exact = F.linear(x.double(), w.double(), b.double())
error = ((F.linear(x, w, b).double() - exact).norm() / exact.norm()).item()
print(f"F.linear tf32 relative error against fp64 on these inputs: {error:.2e}")
for _ in range(10):
    F.linear(x, w, b)
means = []
for _ in range(7):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        F.linear(x, w, b)
    stop.record()
    stop.synchronize()
    means.append(start.elapsed_time(stop) * 1e3 / 20)
means.sort()
print(f"F.linear tf32 {M}x{N}x{K}: {means[3]:.1f} us (loops {means[0]:.1f}-{means[-1]:.1f}), "
      f"{2 * M * N * K / means[3] * 1e-6:.1f} TFLOPS")
PY
