// The row kernels for fp32 programs that keep values in slots (one translation unit per launcher: ninja builds them in parallel).
#include "interpreter.cuh"

namespace fxfuse {

void launch_row_program_fp32_slots(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream) {
  launch_row_program<4, 2>(prog, launch, stream);
}

}  // namespace fxfuse
