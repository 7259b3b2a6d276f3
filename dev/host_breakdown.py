"""Where a fused op's host time goes, layer by layer (CUDA, small shapes so that the GPU never holds the host back).

Usage: python dev/host_breakdown.py [bf16|fp32] [variant]   (a patch of dev/variants, or current)
Each line: host µs per call, the mean of 2000 calls queued without a sync (the GPU work of each is a few µs), for
the hardtanh example's program (group norm, then hardtanh) at 64 x 256 -> 512:
  F.linear; the op's CUDA kernel alone (called below the Autograd key); the op through the dispatcher with no
  input requiring grad; the same with grad wanted (the autograd formula's forward); gemm_epilogue_train likewise;
  and a whole training step of the op (forward, backward of the sum) against F.linear's.
"""
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fxfuse  # noqa: F401  (defines the ops)

dtype = torch.float32 if (sys.argv[1:] or ["bf16"])[0] == "fp32" else torch.bfloat16
sys.path.insert(0, str(Path(__file__).resolve().parent))
from variant_sources import load_kernels  # noqa: E402

load_kernels(sys.argv[2] if len(sys.argv) > 2 else "current")
program = "group_norm(%0,$0,$1,16,1e-05);hardtanh(%1,-2.0,2.0)"
x = torch.randn(64, 256, device="cuda", dtype=dtype)
w = torch.randn(512, 256, device="cuda", dtype=dtype)
b = torch.randn(512, device="cuda", dtype=dtype)
params = [torch.randn(512, device="cuda", dtype=dtype) for _ in range(2)]


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


op = torch.ops.fxfuse.gemm_epilogue.default
train = torch.ops.fxfuse.gemm_epilogue_train.default
below_autograd = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)


def kernel_alone():
    with torch._C._ExcludeDispatchKeyGuard(below_autograd):
        op(x, w, b, params, program)


wx, ww, wb = (t.detach().requires_grad_() for t in (x, w, b))
wparams = [p.detach().requires_grad_() for p in params]


def main() -> None:
    print(f"{torch.cuda.get_device_name()} {torch.__version__} {dtype}: host us per call")
    rows = [
        ("F.linear", lambda: F.linear(x, w, b)),
        ("op below Autograd (C++ only)", kernel_alone),
        ("op, no grad wanted", lambda: op(x, w, b, params, program)),
        ("op, grad wanted (forward)", lambda: op(wx, ww, wb, wparams, program)),
        ("train op, grad wanted (forward)", lambda: train(wx, ww, wb, wparams, program)),
        ("F.linear + sum, step", lambda: F.linear(wx, ww, wb).float().sum().backward()),
        ("train op + sum, step", lambda: train(wx, ww, wb, wparams, program)[0].float().sum().backward()),
    ]
    for name, fn in rows:
        print(f"  {name:34s} {host_us(fn):7.1f}")

    # The backward's parts: the epilogue's backward op alone, and whether any call of the step fell back.
    gemm_out = F.linear(x, w, b)
    grad = torch.randn(64, 512, device="cuda", dtype=dtype)
    needs = [True, True, True]
    print(f"  {'epilogue_backward alone':34s} "
          f"{host_us(lambda: torch.ops.fxfuse.epilogue_backward(grad, gemm_out, params, program, needs)):7.1f}")
    # A call that waits for the GPU takes the queued spin's 20 ms of host time.
    spin_cycles = int(20e-3 * torch.cuda.clock_rate() * 1e6)
    for name, fn in (("op below Autograd", kernel_alone), ("op, grad wanted", rows[3][1]),
                     ("train op", rows[4][1]), ("train op + sum, step", rows[6][1]),
                     ("epilogue_backward", lambda: torch.ops.fxfuse.epilogue_backward(grad, gemm_out, params, program,
                                                                                       needs))):
        torch.cuda.synchronize()
        torch.cuda._sleep(spin_cycles)
        start = time.perf_counter()
        fn()
        print(f"  {name} behind a 20 ms GPU spin: {(time.perf_counter() - start) * 1e3:.2f} ms of host time")
    reasons = []
    handler = logging.Handler()
    handler.emit = lambda record: reasons.append(record.getMessage())
    logging.getLogger("fxfuse").addHandler(handler)
    logging.getLogger("fxfuse").setLevel(logging.DEBUG)
    train(wx, ww, wb, wparams, program)[0].float().sum().backward()
    torch.cuda.synchronize()
    print(f"  fallbacks in one step: {reasons or 'none'}")


if __name__ == "__main__":
    main()
