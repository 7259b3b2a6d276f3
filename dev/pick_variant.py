"""Picks the variant with the lowest total epilogue time in variant_bench.py's output and copies its
program_format.cuh (where the layout choices live) into kernels/.

Usage: python dev/pick_variant.py variants.log
"""
import shutil
import sys
from collections import defaultdict
from pathlib import Path

from variant_sources import materialize

totals = defaultdict(float)
for line in Path(sys.argv[1]).read_text().splitlines():
    fields = line.split()
    if len(fields) > 4 and fields[4] == "us":
        totals[fields[0]] += float(fields[3])
for name, total in sorted(totals.items(), key=lambda item: item[1]):
    print(f"{name:<20} {total:8.1f} us over the examples")
winner = min(totals, key=totals.get)
winner_sources = materialize(Path(__file__).parent / "variants" / f"{winner}.patch")
shutil.copy(winner_sources / "program_format.cuh", Path("kernels/program_format.cuh"))
print(f"kernels/program_format.cuh <- {winner}")
