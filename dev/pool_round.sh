#!/usr/bin/env bash
# One device call for the pool example's two leads: builds kernels/ and variant 100 in parallel (and the pool
# probe's hand-written mean), then times rows of several widths (dev/row_width_bench.py) with both builds, and the
# weight's averaging (dev/pool_mean_probe.py) in bf16 and fp32.
# Usage (on the device, from the repository root): OUT=DIR dev/pool_round.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
VARIANT=dev/variants/100_fast_rows_32_values_above_4096.patch
python3 -m pip install --no-deps --no-build-isolation -q -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
start=$(date +%s)
python3 -c "import fxfuse.kernels as k; k.load()" > "$OUT/build-current.log" 2>&1 &
python3 -c "import sys; sys.path.insert(0, 'dev'); from variant_sources import load_kernels; load_kernels(sys.argv[1])" \
  "$VARIANT" > "$OUT/build-variant.log" 2>&1 &
python3 -c "import sys; sys.path.insert(0, 'dev'); import pool_mean_probe; pool_mean_probe.hand_written()" \
  > "$OUT/build-probe.log" 2>&1 &
wait
echo "builds: $(( $(date +%s) - start )) s"; tail -n 3 "$OUT"/build-*.log
for precision in bf16 fp32; do python3 dev/pool_mean_probe.py $precision 4; done 2>&1 | grep -v Warning
for v in current "$VARIANT"; do python3 dev/row_width_bench.py "$v"; done 2>&1 | grep -v Warning
echo "done: $(( $(date +%s) - start )) s"
