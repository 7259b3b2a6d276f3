"""Executed SASS instructions per element of each profiled row kernel, by opcode, from dev/profile.sh's source page.

Usage: python dev/instruction_mix.py OUT_DIR/source-bf16.csv.gz [TOP]
The four kernels are the example programs in profile_epilogue.py's order. Counts are warp instructions times 32
over the 1024 x 8192 elements; each SASS address counts once (the source page repeats inlined code under every
source line it comes from).
"""
import collections
import csv
import gzip
import sys

from profile_epilogue import PROGRAMS

ELEMENTS = 1024 * 8192


def listing_rows(path):
    """Each row of the source page, with whether it opens the next kernel's listing: a kernel lists its source
    files in path order, so a file path that does not sort after the previous one starts the next kernel (the
    first file differs between kernels: <cmath> only where libm is called)."""
    previous = None
    for row in csv.reader(gzip.open(path, "rt")):
        if not row:
            continue
        opens_kernel = row[0] == "File Path" and (previous is None or row[1] <= previous)
        if row[0] == "File Path":
            previous = row[1]
        yield row, opens_kernel


def executed_by_address(path):
    """[{address: (warp instructions executed, SASS text)}] per kernel, in profile order."""
    kernels, header_length = [], 0
    for row, opens_kernel in listing_rows(path):
        if opens_kernel:
            kernels.append({})
        elif row[0] == "Line No":
            header_length = len(row)
        elif row[0] == "" and header_length:
            # ncu leaves commas inside source text unquoted: the metrics are the row's last columns
            address, sass, _, _, _, executed = row[len(row) - (header_length - 2):][:6]
            executed = executed.replace(",", "")
            if executed.isdigit():
                kernels[-1][address] = (int(executed), sass.strip())
    return kernels


def main():
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    for name, kernel in zip(PROGRAMS, executed_by_address(sys.argv[1])):
        by_opcode = collections.Counter()
        for executed, sass in kernel.values():
            words = sass.split()
            opcode = words[1] if words[0].startswith("@") else words[0]
            by_opcode[opcode.split(".")[0]] += executed
        total = sum(by_opcode.values()) * 32 / ELEMENTS
        mix = ", ".join(f"{op} {n * 32 / ELEMENTS:.2f}" for op, n in by_opcode.most_common(top))
        print(f"{name}: {total:.1f} instructions per element: {mix}")


if __name__ == "__main__":
    main()
