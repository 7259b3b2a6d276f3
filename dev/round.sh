#!/usr/bin/env bash
# One device call for kernel variants: installs fxfuse, builds kernels/ and every variant given in parallel, times
# each with dev/variant_bench.py (kernels/ as "current" first), then the optional profiles.
# Usage (on the device, from the repository root): OUT=DIR [SASS=1] [PIPES=V] [STALLS=V] [PROFILE=V
#   [PROFILE_DTYPES="fp32 bf16"]] dev/round.sh [dev/variants/NN_name.patch ...]
# SASS: static opcode counts of every build's bf16 fast kernels; PIPES / STALLS: ncu pipe utilization / stall
# reasons of variant V's fast kernels (dev/ncu_metrics.py); PROFILE: ncu source counters of V's fast kernels, then
# dev/instruction_mix.py and dev/stall_lines.py. V is "current" or a patch.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
# The device tool returns at most 8 files from $OUT: the logs are merged or removed so that a profile comes back.
python3 -m pip install --no-deps --no-build-isolation -q -e . > /tmp/round-pip.log 2>&1 || cat /tmp/round-pip.log
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
V="$*"
start=$(date +%s); rm -f /tmp/round-build-*.log
python3 -c "import fxfuse.kernels as k; k.load()" > /tmp/round-build-current.log 2>&1 &
for v in $V; do
  python3 -c "import sys; sys.path.insert(0, 'dev'); from variant_sources import load_kernels; load_kernels(sys.argv[1])" \
    "$v" > "/tmp/round-build-$(basename "$v" .patch).log" 2>&1 &
done
wait
echo "builds: $(( $(date +%s) - start )) s"; tail -n 3 /tmp/round-build-*.log > "$OUT/builds.log"; grep -i error "$OUT/builds.log"
for v in current $V; do python3 dev/variant_bench.py "$v" 2>&1 | grep -v Warning; done | tee "$OUT/bench.txt"
echo "bench done: $(( $(date +%s) - start )) s"
if [ -n "${SASS:-}" ]; then  # static opcode counts of the bf16 fast kernels of every build
  for o in $(find /tmp/fxfuse-variant-*/build "$HOME/.cache/fxfuse" -name 'row_fast_bf16*.o' 2>/dev/null); do
    echo "$o: $(cuobjdump -sass "$o" | grep -oE '^ +/\*[0-9a-f]+\*/ +(@!?U?P[0-9T] +)?[A-Z0-9]+' |
      awk '{print $NF}' | sort | uniq -c | sort -rn | head -12 | tr -s ' \n' ' ')"
  done
fi
for kind in PIPES STALLS; do  # ncu raw metrics of the fast kernels: pipe utilization, or stall reasons
  variant="${!kind:-}"
  [ -n "$variant" ] || continue
  sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis)
  [ "$kind" = STALLS ] && sections=(--section SpeedOfLight --section WarpStateStats)
  for dtype in bf16 fp32; do
    ncu --kernel-name "regex:(fast|chain)_row" "${sections[@]}" --csv --page raw \
      python3 dev/profile_epilogue.py $dtype "$variant" > "$OUT/$kind-$dtype.csv" 2>"$OUT/$kind-$dtype.err"
    python3 dev/ncu_metrics.py "$(echo $kind | tr A-Z a-z)" "$OUT/$kind-$dtype.csv" $dtype
  done
done
if [ -n "${PROFILE:-}" ]; then
  for dtype in ${PROFILE_DTYPES:-bf16}; do
    dev/profile.sh $dtype "$OUT" "(fast|chain)_row" "$PROFILE"
    python3 dev/instruction_mix.py "$OUT/source-$dtype.csv.gz" 14; python3 dev/stall_lines.py "$OUT/source-$dtype.csv.gz" 14
    rm -f "$OUT/source-$dtype.err" "$OUT/ncu-$dtype.log"
  done
  echo "profile done: $(( $(date +%s) - start )) s"
fi
