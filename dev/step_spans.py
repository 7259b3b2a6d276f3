"""Host µs of each span of a bf16 training step, eager against fxfuse (torch.profiler's CPU events, one example at
full size): the forward's top-level ops on the main thread, each autograd node's `evaluate_function` on the
backward thread, and the optimizer. Steps are queued behind a GPU spin, so no span waits for the GPU.

Usage: python dev/step_spans.py [examples/NAME.py]   (default: the hardtanh example)
Each line: the span's name, calls per step, host µs per step (the profiler's own cost included).
"""
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fxfuse.bench import COLUMNS, training_step
from fxfuse.modelfile import load_model_file

STEPS = 20
path = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/linear_groupnorm_hardtanh.py")
model, inputs = load_model_file(path).build()
model = model.to(device="cuda", dtype=torch.bfloat16).train()
inputs = [t.to(device="cuda", dtype=torch.bfloat16) for t in inputs]
spin_cycles = int(200e-3 * torch.cuda.clock_rate() * 1e6)


def top_level(events):
    """Events not inside another event of the same thread."""
    by_thread = collections.defaultdict(list)
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CPU:
            by_thread[event.thread].append(event)
    tops = []
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        end = -1
        for event in thread_events:
            if event.time_range.start >= end:
                tops.append(event)
                end = event.time_range.end
    return tops


for column in COLUMNS:
    if column.name not in ("eager", "fxfuse"):
        continue
    step = training_step(column.build(model, inputs), list(model.parameters()))
    for _ in range(10):
        step(*inputs)
    torch.cuda.synchronize()
    torch.cuda._sleep(spin_cycles)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(STEPS):
            step(*inputs)
        host_us = (time.perf_counter() - start) / STEPS * 1e6
    torch.cuda.synchronize()
    events = prof.events()
    spans = collections.defaultdict(lambda: [0, 0.0])
    for event in events:
        if event.name.startswith("autograd::engine::evaluate_function"):
            spans[event.name][0] += 1
            spans[event.name][1] += event.cpu_time_total
    for event in top_level(events):
        spans["top: " + event.name][0] += 1
        spans["top: " + event.name][1] += event.cpu_time_total
    print(f"== {column.name} ({path.stem}): {host_us:.1f} µs of host time per step under the profiler")
    for name, (calls, total) in sorted(spans.items(), key=lambda item: -item[1][1]):
        print(f"  {name[:90]:90s} {calls / STEPS:5.1f} {total / STEPS:9.1f}")
