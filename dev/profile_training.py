"""Where a bf16 training step's time goes: eager against fxfuse, one example at full size (torch.profiler).

Usage: python dev/profile_training.py [examples/NAME.py]   (default: examples/linear_groupnorm_hardtanh.py)
Prints, per column, the wall time per step, the CUDA kernel time per step and the top kernels and CPU ops.
"""
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fxfuse.bench import COLUMNS, training_step
from fxfuse.modelfile import load_model_file

STEPS = 10
path = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/linear_groupnorm_hardtanh.py")
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
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / STEPS * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step(*inputs)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_ms = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / STEPS / 1e3
    print(f"== {column.name}: {wall_ms:.3f} ms per step (wall), {kernel_ms:.3f} ms of CUDA kernels per step")
    print(events.table(sort_by="device_time_total", row_limit=14, max_name_column_width=60))
    print(events.table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
