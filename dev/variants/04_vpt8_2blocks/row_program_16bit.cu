// The row kernels for bf16 / fp16 programs without slots (one translation unit per launcher: ninja builds them in parallel).
#include "interpreter.cuh"

namespace fxfuse {

void launch_row_program_16bit(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream) {
  launch_row_program<2, 0>(prog, launch, stream);
}

}  // namespace fxfuse
