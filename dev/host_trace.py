"""torch.profiler's CPU view of the fused training op's step on CUDA (dev/host_breakdown.py's shapes): which ops
and autograd nodes take its host time, on the main thread and the autograd engine's device thread.

Usage: python dev/host_trace.py [bf16|fp32] [variant]   (50 profiled steps after 50 warm-up steps)
Prints the ops by self CPU time, then the step's events on each thread in order (one step, µs from its start).
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.argv += ["bf16"] * (len(sys.argv) < 2)
from host_breakdown import program, train, wb, wparams, ww, wx  # noqa: E402

steps = 50


def step():
    with torch.profiler.record_function("step"):
        train(wx, ww, wb, wparams, program)[0].float().sum().backward()


for _ in range(50):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))

events = sorted(prof.events(), key=lambda e: e.time_range.start)
steps_seen = [e for e in events if e.name == "step"]
last = steps_seen[-1]
start, end = last.time_range.start, last.time_range.end
print(f"one step: {end - start:.0f} us")
for e in events:
    if start <= e.time_range.start <= end + 2000 and e.name != "step":
        depth = 0
        parent = e.cpu_parent
        while parent is not None:
            depth += 1
            parent = parent.cpu_parent
        if depth <= 2:
            print(f"  thread {e.thread:>6} +{e.time_range.start - start:7.1f} {e.time_range.elapsed_us():7.1f} us "
                  f"{'  ' * depth}{e.name[:90]}")
