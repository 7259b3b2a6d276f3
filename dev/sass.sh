#!/usr/bin/env bash
# Disassembles one kernels/*.cu for sm_90a with source lines, to find where spills and long code come from.
# Usage: dev/sass.sh kernels/row_program_16bit.cu OUT_DIR   (writes OUT_DIR/<name>.sass; needs nvcc and nvdisasm)
set -euo pipefail
source_file="$1"
out_dir="$2"
name="$(basename "$source_file" .cu)"
read -r -a flags < <(python3 -c '
import sysconfig, torch, torch.utils.cpp_extension as ext
print(" ".join(["-I" + p for p in ext.include_paths()] + ["-I" + sysconfig.get_paths()["include"],
      "-DTORCH_EXTENSION_NAME=fxfuse_kernels", "-DTORCH_API_INCLUDE_EXTENSION_H",
      f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]))')
nvcc -cubin -o "$out_dir/$name.cubin" "$source_file" "${flags[@]}" -std=c++17 -O3 --expt-relaxed-constexpr \
  -diag-suppress 3306 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xptxas -v 2>&1 | grep -E "stack|registers"
nvdisasm --print-line-info "$out_dir/$name.cubin" > "$out_dir/$name.sass"
rm "$out_dir/$name.cubin"
