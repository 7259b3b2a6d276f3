"""Where the row kernels' warps wait: stall samples per SASS instruction, from dev/profile.sh's source page.

Usage: python dev/stall_lines.py OUT_DIR/source-bf16.csv.gz [TOP]
Prints, per profiled kernel (the example programs in profile_epilogue.py's order), the share of all stall samples
by opcode, then the TOP instructions with the most samples and the executed count of each.
"""
import collections
import sys

from instruction_mix import listing_rows
from profile_epilogue import PROGRAMS


def sass_rows(path):
    """[[{column: value} per SASS instruction]] per kernel, each address once."""
    kernels, header, seen = [], None, set()
    for row, opens_kernel in listing_rows(path):
        if opens_kernel:
            kernels.append([])
            seen = set()
        elif row[0] == "Line No":
            header = row[2:]
        elif row[0] == "" and header:
            values = dict(zip(header, row[len(row) - len(header):]))
            address = values.get("Address", "")
            if address and address not in seen:
                seen.add(address)
                kernels[-1].append(values)
    return kernels


def number(text):
    text = text.replace(",", "")
    return float(text) if text.replace(".", "").isdigit() else 0.0


def main():
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    for name, rows in zip(PROGRAMS, sass_rows(sys.argv[1])):
        if not rows:
            continue
        stall_column = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
        executed_column = next(c for c in rows[0] if c.startswith("Instructions Executed"))
        total = sum(number(r[stall_column]) for r in rows) or 1.0
        by_opcode = collections.Counter()
        for r in rows:
            words = r["Source"].split()
            opcode = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or ["?"])[0]
            by_opcode[opcode.split(".")[0]] += number(r[stall_column])
        print(f"{name}: stall samples by opcode: "
              + ", ".join(f"{op} {n / total * 100:.0f}%" for op, n in by_opcode.most_common(10)))
        for r in sorted(rows, key=lambda r: -number(r[stall_column]))[:top]:
            print(f"   {number(r[stall_column]) / total * 100:5.1f}%  {r['Address']:>6}  "
                  f"exec {r[executed_column]:>10}  {r['Source'][:70]}")


if __name__ == "__main__":
    main()
