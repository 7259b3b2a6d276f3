"""Where a bf16 training step's time goes: eager against fxfuse, one example at full size (torch.profiler).

Usage: python dev/profile_training.py [examples/NAME.py] [--host]   (default: examples/linear_groupnorm_hardtanh.py)
Prints, per column, the host time to enqueue a step (no sync), the wall time per step, the CUDA kernel time per
step and the top kernels and CPU ops; where host and wall agree, the step is host-bound. --host: instead of
torch.profiler's tables, cProfile's top 25 Python functions by own time over fxfuse's steps.
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fxfuse.bench import COLUMNS, training_step
from fxfuse.modelfile import load_model_file

STEPS = 10
arguments = [a for a in sys.argv[1:] if a != "--host"]
path = Path(arguments[0] if arguments else "examples/linear_groupnorm_hardtanh.py")
model_file = load_model_file(path)
model, inputs = model_file.build()
model = model.to(device="cuda", dtype=torch.bfloat16).train()
inputs = [t.to(device="cuda", dtype=torch.bfloat16) for t in inputs]
for column in COLUMNS:
    if column.name not in ("eager", "fxfuse"):
        continue
    step = training_step(column.build(model, inputs), list(model.parameters()))
    for _ in range(10):
        step(*inputs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step(*inputs)
    host_ms = (time.perf_counter() - start) / STEPS * 1e3
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / STEPS * 1e3
    if "--host" in sys.argv:
        print(f"== {column.name}: {host_ms:.3f} ms per step (host), {wall_ms:.3f} ms (wall)")
        if column.name == "fxfuse":
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [step(*inputs) for _ in range(STEPS)])
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        continue
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step(*inputs)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_ms = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / STEPS / 1e3
    print(f"== {column.name}: {host_ms:.3f} ms per step (host), {wall_ms:.3f} ms (wall), {kernel_ms:.3f} ms of CUDA "
          "kernels per step")
    print(events.table(sort_by="device_time_total", row_limit=14, max_name_column_width=60))
    print(events.table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
