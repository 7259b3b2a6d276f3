"""A bf16 training step's host cost, eager against fxfuse, at full size on the GPU, and fxfuse's by function.

Usage: python dev/profile_training_host.py [examples/NAME.py]   (default: examples/linear_groupnorm_hardtanh.py)
Per column: the host ms per step (100 steps enqueued, no sync) and the wall ms per step (after the sync); then
cProfile's top 25 functions by own time over 100 fxfuse steps. Where host and wall agree, the step is host-bound.
"""
import cProfile
import pstats
import sys
import time

import torch

from fxfuse.bench import COLUMNS, training_step
from fxfuse.modelfile import load_model_file

PATH = sys.argv[1] if len(sys.argv) > 1 else "examples/linear_groupnorm_hardtanh.py"
model, inputs = load_model_file(PATH).build()
model = model.to(device="cuda", dtype=torch.bfloat16).train()
inputs = [t.to(device="cuda", dtype=torch.bfloat16) for t in inputs]
for column in COLUMNS:
    if column.name not in ("eager", "fxfuse"):
        continue
    step = training_step(column.build(model, inputs), list(model.parameters()))
    for _ in range(20):
        step(*inputs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(100):
        step(*inputs)
    host = (time.perf_counter() - start) / 100 * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 100 * 1e3
    print(f"{column.name}: host {host:.3f} ms/step (enqueue), wall {wall:.3f} ms/step")
    if column.name == "fxfuse":
        cProfile.run("for _ in range(100): step(*inputs)", "/tmp/fxfuse_training_host.prof")
        torch.cuda.synchronize()
        pstats.Stats("/tmp/fxfuse_training_host.prof").sort_stats("tottime").print_stats(25)
