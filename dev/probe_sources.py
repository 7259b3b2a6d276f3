"""CUDA source shared by the standalone probes (dev/copy_probe.py, dev/lean_probe.py, dev/min_bias_probe.py):
pasted into their load_inline sources."""

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

# One chunk of a group norm over groups of 16 contiguous values (16 / VALUES lanes a group, as the row kernel holds
# them), in place, with the affine where weight is given; `vector` is the chunk's 16-byte index among the params.
GROUP_NORM_16 = r"""
template <bool HALF>
__device__ __forceinline__ void group_norm_16(float (&v)[HALF ? 8 : 4], const uint4* weight, const uint4* bias,
                                              int vector) {
  constexpr int VALUES = HALF ? 8 : 4, LANES = 16 / VALUES;
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < VALUES; ++j) sum += v[j];
#pragma unroll
  for (int offset = 1; offset < LANES; offset <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float mean = sum * (1.0f / 16);
  float squares = 0.0f;
#pragma unroll
  for (int j = 0; j < VALUES; ++j) squares += (v[j] - mean) * (v[j] - mean);
#pragma unroll
  for (int offset = 1; offset < LANES; offset <<= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
  const float rstd = rsqrtf(squares * (1.0f / 16) + 1e-5f);
  if (weight != nullptr) {
    float w[VALUES], b[VALUES];
    unpack_storage<HALF>(weight[vector], w);
    unpack_storage<HALF>(bias[vector], b);
#pragma unroll
    for (int j = 0; j < VALUES; ++j) v[j] = (v[j] - mean) * rstd * w[j] + b[j];
  } else {
#pragma unroll
    for (int j = 0; j < VALUES; ++j) v[j] = (v[j] - mean) * rstd;
  }
}
"""
