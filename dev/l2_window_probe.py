"""Does an L2 persisting window over the GEMM output let the next kernel read it from L2? (torch ops only)

Usage: python dev/l2_window_probe.py [fp32|tf32|bf16 ...]

Reports the device's persisting set-aside limits and whether the current stream takes an access policy window, then
times, at 1024 x 8192 -> 8192: the GEMM (torch.addmm into y) alone, and the GEMM followed by a row min of y
(`amin(dim=1)`), each with no window, and with y's window persisting for the GEMM and normal for the row min.
"""
import sys

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

std::vector<int64_t> limits() {
  int device = 0, most = 0, window = 0;
  size_t before = 0, after = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&most, cudaDevAttrMaxPersistingL2CacheSize, device);
  cudaDeviceGetAttribute(&window, cudaDevAttrMaxAccessPolicyWindowSize, device);
  cudaDeviceGetLimit(&before, cudaLimitPersistingL2CacheSize);
  const int set = cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, most);
  cudaDeviceGetLimit(&after, cudaLimitPersistingL2CacheSize);
  return {most, window, (int64_t)before, set, (int64_t)after};
}

// hit: 0 none (window removed), 1 normal, 2 persisting. Returns the cudaError_t of the set.
int64_t set_window(torch::Tensor y, int64_t hit) {
  cudaStreamAttrValue value{};
  value.accessPolicyWindow.base_ptr = hit ? y.data_ptr() : nullptr;
  value.accessPolicyWindow.num_bytes = hit ? y.nbytes() : 0;
  value.accessPolicyWindow.hitRatio = hit ? 1.0f : 0.0f;
  value.accessPolicyWindow.hitProp = hit == 2 ? cudaAccessPropertyPersisting : cudaAccessPropertyNormal;
  value.accessPolicyWindow.missProp = cudaAccessPropertyNormal;
  const int64_t status = cudaStreamSetAttribute(c10::cuda::getCurrentCUDAStream(), cudaStreamAttributeAccessPolicyWindow, &value);
  cudaGetLastError();
  return status;
}
"""

PRECISIONS = {"fp32": (torch.float32, False), "tf32": (torch.float32, True), "bf16": (torch.bfloat16, False)}


def median_ms(fn, runs: int = 30) -> float:
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(names: list[str]) -> None:
    probe = load_inline("l2_window_probe", cpp_sources=SOURCE, functions=["limits", "set_window"], with_cuda=True)
    most, window, before, status, after = probe.limits()
    print(f"{torch.cuda.get_device_name()}: max persisting {most >> 20} MB, max window {window >> 20} MB, limit "
          f"{before} -> {after} (set: error {status})")
    for name in names:
        dtype, tf32 = PRECISIONS[name]
        torch.backends.cuda.matmul.allow_tf32 = tf32
        xs = [torch.randn(1024, 8192, device="cuda", dtype=dtype) for _ in range(4)]
        w = torch.randn(8192, 8192, device="cuda", dtype=dtype) * 8192 ** -0.5
        b = torch.randn(8192, device="cuda", dtype=dtype)
        y = torch.empty(1024, 8192, device="cuda", dtype=dtype)
        turn = [0]

        def gemm(window: bool, then_min: bool):
            x = xs[turn[0] % 4]
            turn[0] += 1
            if window:
                probe.set_window(y, 2)
            torch.addmm(b, x, w.t(), out=y)
            if window:
                probe.set_window(y, 1)
            if then_min:
                y.amin(dim=1)
            if window:
                probe.set_window(y, 0)

        print(f"{name}: set_window on the current stream returns {probe.set_window(y, 2)}, {probe.set_window(y, 0)}")
        for label, window, then_min in (("GEMM", False, False), ("GEMM, window", True, False),
                                        ("GEMM + amin", False, True), ("GEMM + amin, window", True, True)):
            print(f"  {label:22s} {median_ms(lambda: gemm(window, then_min)) * 1000:8.1f} us")


if __name__ == "__main__":
    main(sys.argv[1:] or ["tf32", "bf16"])
