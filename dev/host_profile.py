"""cProfile of the fused training op's step on CUDA (dev/host_breakdown.py's shapes): where its host time goes.

Usage: python dev/host_profile.py [bf16|fp32] [variant]   (300 steps)
"""
import cProfile
import pstats
import sys

import torch

sys.argv += ["bf16"] * (len(sys.argv) < 2)
from host_breakdown import program, train, wb, wparams, ww, wx  # noqa: E402

steps = 300


def step():
    train(wx, ww, wb, wparams, program)[0].float().sum().backward()


for _ in range(20):
    step()
torch.cuda.synchronize()
profiler = cProfile.Profile()
profiler.enable()
for _ in range(steps):
    step()
profiler.disable()
torch.cuda.synchronize()
pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
