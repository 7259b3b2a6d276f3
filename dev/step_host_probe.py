"""Host time of a bf16 training step at full size and of its parts, each queued behind a GPU spin (so no call waits
for the GPU unless it syncs), eager against fxfuse; and whether the caching allocator goes to cudaMalloc inside.

Usage: python dev/step_host_probe.py [examples/NAME.py]   (default: the hardtanh example)
Each line: host µs per call, the median over 3 rounds of the mean of 20 calls queued behind a 300 ms spin. A line
near 15000 µs (the spin over the calls) means the call waited for the GPU. The last two lines split the bench's
step (eager's, fxfuse's) into its parts, each timed inside the step: zero_grad, forward, sum, backward, optimizer.
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fxfuse
from fxfuse.bench import first_linear, training_step
from fxfuse.modelfile import load_model_file

CALLS = 20
path = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/linear_groupnorm_hardtanh.py")
model, inputs = load_model_file(path).build()
model = model.to(device="cuda", dtype=torch.bfloat16).train()
inputs = [t.to(device="cuda", dtype=torch.bfloat16) for t in inputs]
optimized = fxfuse.optimize(model, inputs)
linear = first_linear(model)
spin_cycles = int(300e-3 * torch.cuda.clock_rate() * 1e6)


def behind_spin_us(fn) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    hosts = []
    for _ in range(3):
        torch.cuda._sleep(spin_cycles)
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        hosts.append((time.perf_counter() - start) / CALLS * 1e6)
        torch.cuda.synchronize()
    new_segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) - segments
    return statistics.median(hosts), new_segments


def with_inputs(step):
    return lambda: step(*inputs)


def forward_backward(module):
    def run():
        module(*inputs).sum().backward()
    return run


x = inputs[0]
call = next(n for n in optimized.graph.nodes if n.op == "call_function" and "fxfuse" in str(n.target))
program = call.args[4]
params = [optimized.get_parameter(str(p.target)) for p in call.args[3]]
weight, bias = linear.weight, linear.bias
gemm_out = F.linear(x, weight, bias).detach()
grad = torch.randn_like(gemm_out)
train = torch.ops.fxfuse.gemm_epilogue_train.default
below_autograd = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)


def train_below_autograd():
    with torch._C._ExcludeDispatchKeyGuard(below_autograd):
        train(x, weight, bias, params, program)


partials = [torch.randn(132, gemm_out.shape[1], device="cuda") for _ in params]
rows = [
    ("train op below autograd", train_below_autograd),
    ("train op, recording", lambda: train(x, weight, bias, params, program)),
    ("epilogue_backward alone", lambda: torch.ops.fxfuse.epilogue_backward(grad, gemm_out, params, program,
                                                                             [True] * (1 + len(params)))),
    ("param grads' finishing ops", lambda: [p.sum(0).to(torch.bfloat16) for p in partials]),
    ("linear's gradients (aten)", lambda: (grad @ weight, grad.t() @ x, grad.sum(0))),
    ("optimizer step alone", torch.no_grad()(lambda: torch._foreach_add_(list(model.parameters()),
                                                                          list(model.parameters()), alpha=1e-7))),
    ("F.linear, no grad", torch.no_grad()(lambda: F.linear(x, linear.weight, linear.bias))),
    ("F.linear, recording", lambda: F.linear(x, linear.weight, linear.bias)),
    ("eager forward", lambda: model(*inputs)),
    ("fxfuse forward", lambda: optimized(*inputs)),
    ("F.linear forward + backward", lambda: F.linear(x, linear.weight, linear.bias).sum().backward()),
    ("eager forward + backward", forward_backward(model)),
    ("fxfuse forward + backward", forward_backward(optimized)),
    ("GEMM step (bench)", with_inputs(training_step(lambda x, *_: F.linear(x, linear.weight, linear.bias),
                                                    [linear.weight, linear.bias]))),
    ("eager step (bench)", with_inputs(training_step(model, list(model.parameters())))),
    ("fxfuse step (bench)", with_inputs(training_step(optimized, list(model.parameters())))),
]
print(f"{path.stem}: {torch.cuda.get_device_name()}, torch {torch.__version__}; host µs per call behind a spin")
with torch.enable_grad():
    for name, fn in rows:
        host, segments = behind_spin_us(fn)
        print(f"  {name:30s} {host:9.1f}   new cudaMalloc segments: {segments}")
print(f"program: {program}")


def step_parts_us(forward, params) -> dict:
    """Host µs of each part of a bench training step, summed over CALLS steps queued behind a spin."""
    optimizer = torch.optim.SGD(params, lr=1e-7)
    parts = {"zero_grad": 0.0, "forward": 0.0, "sum": 0.0, "backward": 0.0, "optimizer step": 0.0}

    def timed(name, fn):
        start = time.perf_counter()
        result = fn()
        parts[name] += time.perf_counter() - start
        return result

    for rounds in range(4):
        if rounds == 1:
            parts = dict.fromkeys(parts, 0.0)
        torch.cuda.synchronize()
        torch.cuda._sleep(spin_cycles)
        for _ in range(CALLS):
            timed("zero_grad", lambda: optimizer.zero_grad(set_to_none=True))
            out = timed("forward", lambda: forward(*inputs))
            loss = timed("sum", out.sum)
            timed("backward", loss.backward)
            timed("optimizer step", optimizer.step)
    torch.cuda.synchronize()
    return {name: total / (3 * CALLS) * 1e6 for name, total in parts.items()}


with torch.enable_grad():
    for name, forward in (("eager", model), ("fxfuse", optimized)):
        parts = step_parts_us(forward, list(model.parameters()))
        print(f"  {name} step parts: " + ", ".join(f"{part} {us:.1f}" for part, us in parts.items()))
