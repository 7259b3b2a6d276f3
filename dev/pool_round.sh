#!/usr/bin/env bash
# One device call for the pool example's weight averaging (torch.ops.fxfuse.mean_of_row_groups): builds kernels/,
# runs its CUDA tests and the pool example's CUDA tests, times the averaging's spellings (dev/pool_mean_probe.py)
# in bf16 and fp32 (and bf16 groups of 128 to 8192 rows), then the pool example's benchmark rows; also the CUDA
# tests of the fast row kernel's choices and chains. VARIANT=patch also builds that variant of the kernels
# beside them and times rows of several widths with both (dev/row_width_bench.py).
# Usage (on the device, from the repository root): OUT=DIR [VARIANT=dev/variants/N_name.patch] dev/pool_round.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
VARIANT=${VARIANT:-}
python3 -m pip install --no-deps --no-build-isolation -q -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
start=$(date +%s)
python3 -c "import fxfuse.kernels as k; k.load()" > "$OUT/build-current.log" 2>&1 &
if [ -n "$VARIANT" ]; then
  python3 -c "import sys; sys.path.insert(0, 'dev'); from variant_sources import load_kernels; load_kernels(sys.argv[1])" \
    "$VARIANT" > "$OUT/build-variant.log" 2>&1 &
fi
wait
echo "builds: $(( $(date +%s) - start )) s"; tail -n 3 "$OUT"/build-*.log
python3 -m pytest -m cuda -q tests/test_cuda_pool.py tests/test_cuda_backend.py tests/test_cuda_kernels.py \
  -k "pool or Pool or chain or fastest" 2>&1 | tail -15
for precision in bf16 fp32; do python3 dev/pool_mean_probe.py $precision 4; done 2>&1 | grep -v Warning
# the kernel against ATen where a thread sums many rows (128: the kernel; 1024, 8192: ATen's, through the fallback)
for size in 128 1024 8192; do python3 dev/pool_mean_probe.py bf16 $size; done 2>&1 | grep "µs"
python3 -m fxfuse.bench --runs 30 --training none --png "$OUT/pool.png" examples/linear_avgpool_gelu_scale_max.py \
  2>&1 | grep -v Warning | tail -12
if [ -n "$VARIANT" ]; then
  for v in current "$VARIANT"; do python3 dev/row_width_bench.py "$v"; done 2>&1 | grep -v Warning
fi
echo "done: $(( $(date +%s) - start )) s"
