// The fast row kernel for bf16 programs with libdevice ops, on whole rows (as many features as the
// threads hold) longer than 512 features; row_fast_bf16.cu launches it. One translation unit per kernel: ninja
// builds them in parallel.
#include "fast_row.cuh"

namespace fxfuse {

template RowKernel libm_row_kernel<Bf16Storage, kLongRowValues, true>();

}  // namespace fxfuse
