"""The host cost of a training step, eager against optimize(), on the CPU at the examples' small sizes.

Usage: python dev/training_host_cost.py   (PYTHONPATH=<another checkout> to time another commit's fxfuse)

Each line: µs per step (forward, then backward of the output's sum), the mean of 200 steps after 20 warm-up
steps. On the CPU the fused op runs its reference, so this times fxfuse's Python around it (the graph, the
training op's autograd formula, the linear's gradients) plus the reference's own ops.
"""
import time

import torch

import fxfuse
from fxfuse.modelfile import example_files, load_model_file

torch.manual_seed(0)
for path in example_files():
    model, inputs = load_model_file(path, small=True).build(0)
    model.train()
    optimized = fxfuse.optimize(model, inputs)
    for name, module in (("eager", model), ("fxfuse", optimized)):
        def step():
            module(*inputs).float().sum().backward()

        for _ in range(20):
            step()
        start = time.perf_counter()
        for _ in range(200):
            step()
        print(f"{path.stem:34s} {name:7s} {(time.perf_counter() - start) / 200 * 1e6:8.1f} us/step")
