"""Drives variant 100 (dev/variants/100_host_section_timers.patch: host timers by section in the fused ops' C++):
200 calls each of the training op below autograd, epilogue_backward alone and the bench's fxfuse training step,
bf16, at full size, queued behind GPU spins so that no call waits for the GPU. The patched kernels print one
`TIMER` line per 100 calls of each timed function (µs per call by section); of each pair, the second is warm.

Usage (on the device, from the repository root):
  mkdir -p /tmp/tp && cp dev/variants/100_host_timer.h /tmp/tp/timer.h
  (cd kernels && patch -p1 < ../dev/variants/100_host_section_timers.patch)
  python dev/host_sections.py [examples/NAME.py] 2>&1 | grep -E "TIMER|=="
Sections: gemm 0 describe, 1 handle and y's at::empty, 2 algorithm lookup, 3 workspace, 4 cublasLtMatmul; forward
op 0 checks, 1 program lookup, 2 bind, 3 layout, 4 gemm, 5 row setup, 6 tail, 7 launch; epilogue_backward 0 checks,
1 program lookup, 2 bind, 3 layout and the tail's sums, 4 the row program, 5 the grid and the gradient buffers, 6
grad_gemm_out's at::empty_like, 7 the launch, 8 the summed grads' finish, 9 the returned list.
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fxfuse
from fxfuse.bench import first_linear, training_step
from fxfuse.modelfile import load_model_file

path = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/linear_groupnorm_hardtanh.py")
model, inputs = load_model_file(path).build()
model = model.to(device="cuda", dtype=torch.bfloat16).train()
inputs = [t.to(device="cuda", dtype=torch.bfloat16) for t in inputs]
optimized = fxfuse.optimize(model, inputs)
linear = first_linear(model)
x = inputs[0]
call = next(n for n in optimized.graph.nodes if n.op == "call_function" and "fxfuse" in str(n.target))
program = call.args[4]
params = [optimized.get_parameter(str(p.target)) for p in call.args[3]]
gemm_out = F.linear(x, linear.weight, linear.bias).detach()
grad = torch.randn_like(gemm_out)
below_autograd = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
spin_cycles = int(100e-3 * torch.cuda.clock_rate() * 1e6)


def train_below_autograd():
    with torch._C._ExcludeDispatchKeyGuard(below_autograd):
        torch.ops.fxfuse.gemm_epilogue_train.default(x, linear.weight, linear.bias, params, program)


def backward_alone():
    torch.ops.fxfuse.epilogue_backward(grad, gemm_out, params, program, [True] * (1 + len(params)))


step = training_step(optimized, list(model.parameters()))
for name, fn in (("train op below autograd", train_below_autograd), ("epilogue_backward alone", backward_alone),
                 ("fxfuse step", lambda: step(*inputs))):
    print(f"== {name}", file=sys.stderr, flush=True)
    with torch.enable_grad():
        for _ in range(10):
            torch.cuda.synchronize()
            torch.cuda._sleep(spin_cycles)
            for _ in range(20):
                fn()
    torch.cuda.synchronize()
