"""Summarizes an ncu raw-page CSV of the four example programs' fast row kernels (dev/round.sh writes them).

Usage: python dev/ncu_metrics.py stalls|pipes RAW.csv LABEL
stalls: each kernel's time, DRAM throughput and its top stall reasons in cycles per issued instruction
(--section WarpStateStats); pipes: each pipe's share of its peak while the SM is active
(--section ComputeWorkloadAnalysis). Kernels are in profile_epilogue.py's program order.
"""
import csv
import sys

from profile_epilogue import PROGRAMS


def summaries(mode, path):
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    header, data = rows[start], rows[start + 2:]  # the row after the header holds the units
    names = list(PROGRAMS)
    for k, row in enumerate(data):
        metrics = dict(zip(header, row))
        if mode == "stalls":
            keep = {h.split("issue_stalled_")[1].split("_per")[0]: metrics[h] for h in header
                    if "average_warps_issue_stalled_" in h and h.endswith("_per_issue_active.ratio")}
            prefix = (f"ns {metrics.get('gpu__time_duration.sum')} dram% "
                      f"{metrics.get('gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed')} ")
            unit = ""
        else:
            keep = {h.replace("sm__inst_executed_pipe_", "").replace("sm__pipe_", "").split(".")[0]: metrics[h]
                    for h in header
                    if ("inst_executed_pipe_" in h or "sm__pipe_" in h) and "pct_of_peak_sustained_active" in h}
            prefix, unit = "", "%"
        values = sorted(((name, float(v.replace(",", ""))) for name, v in keep.items() if v),
                        key=lambda kv: -kv[1])[:8]
        yield names[k % len(names)], prefix + " ".join(f"{name}={v:.2f}{unit}" for name, v in values)


if __name__ == "__main__":
    for name, line in summaries(sys.argv[1], sys.argv[2]):
        print(sys.argv[3], name, line)
