#!/usr/bin/env bash
# ncu source-level profile of the four example programs' row kernels (fp32 or bf16) on the device.
# Usage: dev/profile.sh bf16 OUT_DIR [KERNEL_REGEX [VARIANT]]   (default regex: row_program; writes OUT_DIR/details-bf16.csv and OUT_DIR/source-bf16.csv.gz: per SASS
# instruction executions and stall samples, interleaved with the CUDA source lines they come from)
set -uo pipefail
dtype="$1"
out_dir="$2"
report="/tmp/fxfuse-profile-$dtype"
ncu --kernel-name "regex:${3:-row_program}" --launch-count 5 --section SourceCounters --section SpeedOfLight \
  --section WarpStateStats --section Occupancy --import-source yes -o "$report" -f \
  python3 "$(dirname "$0")/profile_epilogue.py" "$dtype" "${4:-current}" > "$out_dir/ncu-$dtype.log" 2>&1
ncu -i "$report.ncu-rep" --page details --csv > "$out_dir/details-$dtype.csv"
ncu -i "$report.ncu-rep" --page source --csv --print-source cuda,sass > "$out_dir/source-$dtype.csv" 2>"$out_dir/source-$dtype.err" ||
  ncu -i "$report.ncu-rep" --page source --csv --print-source sass > "$out_dir/source-$dtype.csv"
gzip -f "$out_dir/source-$dtype.csv"
