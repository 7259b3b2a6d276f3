"""CUDA source shared by the standalone probes (dev/copy_probe.py, dev/lean_probe.py): pasted into their
load_inline sources."""

# 16 bytes of storage to fp32 values: 8 bf16 (HALF) or 4 fp32, as kernels/interpreter.cuh's storage types do.
UNPACK_STORAGE = r"""
template <bool HALF>
__device__ __forceinline__ void unpack_storage(uint4 raw, float (&v)[HALF ? 8 : 4]) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (HALF) {
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    } else {
      v[k] = __uint_as_float(w[k]);
    }
  }
}
"""
