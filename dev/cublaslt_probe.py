"""Does another cuBLASLt algorithm run the GEMM faster than ATen's choice? (1024 x 8192 -> 8192, with bias)

Usage: python dev/cublaslt_probe.py [count]   (count: heuristics asked of cuBLASLt, 16 by default)
Each precision's table is followed by the CUDA kernels that F.linear and the fastest algorithm launch.

ATen's F.linear asks cuBLASLt for one algorithm (its heuristic's first) for out = x @ W^T + b with the bias
epilogue. This probe asks for `count`, runs each on the same problem (column-major: C^T = W^T' X^T, the bias
along C's rows), checks each result against F.linear's, and times each beside F.linear with fxfuse.bench's
timing (calls queued behind a GPU spin, rotating input sets that exceed L2), for fp32 IEEE, tf32 and bf16.
Each line: the algorithm's index in the heuristic's order, its time over F.linear's, and its tile and stages ids.
"""
import sys

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

from fxfuse.bench import INPUT_SETS, time_interleaved_ms

M, K, N = 1024, 8192, 8192
PRECISIONS = [("fp32", torch.float32, False), ("tf32", torch.float32, True), ("bf16", torch.bfloat16, False)]

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>

#include <map>
#include <tuple>
#include <vector>

#define CHECK_LT(call) TORCH_CHECK((call) == CUBLAS_STATUS_SUCCESS, #call " failed")

struct Problem {
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, c;
  std::vector<cublasLtMatmulHeuristicResult_t> algorithms;
};

static cublasLtHandle_t handle() {
  static cublasLtHandle_t lt = [] { cublasLtHandle_t h; cublasLtCreate(&h); return h; }();
  return lt;
}

static constexpr size_t kWorkspace = 32u << 20;

static Problem& problem(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, bool tf32,
                        int64_t count) {
  static std::map<std::tuple<int64_t, int64_t, int64_t, int, bool, const void*>, Problem> problems;
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto key = std::make_tuple(m, k, n, static_cast<int>(x.scalar_type()), tf32, bias.data_ptr());
  auto found = problems.find(key);
  if (found != problems.end()) return found->second;
  Problem p;
  const cudaDataType_t type = x.scalar_type() == at::kFloat ? CUDA_R_32F
                              : x.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const cublasComputeType_t compute = x.scalar_type() == at::kFloat && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                             : CUBLAS_COMPUTE_32F;
  CHECK_LT(cublasLtMatmulDescCreate(&p.op, compute, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  CHECK_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
  CHECK_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)));
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  CHECK_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  const void* bias_pointer = bias.data_ptr();
  CHECK_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_pointer,
                                          sizeof(bias_pointer)));
  CHECK_LT(cublasLtMatrixLayoutCreate(&p.a, type, k, n, k));  // W, row-major n x k
  CHECK_LT(cublasLtMatrixLayoutCreate(&p.b, type, k, m, k));  // x, row-major m x k
  CHECK_LT(cublasLtMatrixLayoutCreate(&p.c, type, n, m, n));  // out, row-major m x n
  cublasLtMatmulPreference_t preference;
  CHECK_LT(cublasLtMatmulPreferenceCreate(&preference));
  size_t workspace = kWorkspace;
  CHECK_LT(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                sizeof(workspace)));
  p.algorithms.resize(count);
  int returned = 0;
  CHECK_LT(cublasLtMatmulAlgoGetHeuristic(handle(), p.op, p.a, p.b, p.c, p.c, preference, count,
                                          p.algorithms.data(), &returned));
  p.algorithms.resize(returned);
  cublasLtMatmulPreferenceDestroy(preference);
  return problems.emplace(key, p).first->second;
}

int64_t algorithm_count(torch::Tensor x, torch::Tensor w, torch::Tensor bias, bool tf32, int64_t count) {
  return problem(x, w, bias, tf32, count).algorithms.size();
}

std::vector<int64_t> algorithm_ids(torch::Tensor x, torch::Tensor w, torch::Tensor bias, bool tf32, int64_t count,
                                   int64_t index) {
  const cublasLtMatmulAlgo_t& algo = problem(x, w, bias, tf32, count).algorithms.at(index).algo;
  std::vector<int64_t> ids;
  for (auto attribute : {CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
                         CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING}) {
    uint32_t value = 0;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written);
    ids.push_back(value);
  }
  return ids;
}

void run(torch::Tensor x, torch::Tensor w, torch::Tensor bias, torch::Tensor out, torch::Tensor workspace,
         bool tf32, int64_t count, int64_t index) {
  Problem& p = problem(x, w, bias, tf32, count);
  const float alpha = 1.0f, beta = 0.0f;
  CHECK_LT(cublasLtMatmul(handle(), p.op, &alpha, w.data_ptr(), p.a, x.data_ptr(), p.b, &beta, out.data_ptr(), p.c,
                          out.data_ptr(), p.c, &p.algorithms.at(index).algo, workspace.data_ptr(), kWorkspace,
                          at::cuda::getCurrentCUDAStream()));
}
"""


def problem_tensors(dtype):
    """(weight, bias, input sets, out, workspace) of the probed GEMM in `dtype`."""
    weight = torch.randn(N, K, device="cuda").to(dtype) * K ** -0.5
    bias = torch.randn(N, device="cuda").to(dtype)
    inputs = [[torch.randn(M, K, device="cuda").to(dtype)] for _ in range(INPUT_SETS)]
    out = torch.empty(M, N, device="cuda", dtype=dtype)
    workspace = torch.empty(32 << 20, device="cuda", dtype=torch.uint8)
    return weight, bias, inputs, out, workspace


def kernel_names(fn, x) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn(x)
        torch.cuda.synchronize()
    return [event.name[:90] for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def main(count: int) -> None:
    lt = load_inline("cublaslt_probe", cpp_sources=SOURCE, functions=["algorithm_count", "algorithm_ids", "run"],
                     with_cuda=True, extra_ldflags=["-lcublasLt"], verbose=False)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, dtype, tf32 in PRECISIONS:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        weight, bias, inputs, out, workspace = problem_tensors(dtype)
        found = lt.algorithm_count(inputs[0][0], weight, bias, tf32, count)
        fns = {"F.linear": lambda x: F.linear(x, weight, bias)}
        for i in range(found):
            lt.run(inputs[0][0], weight, bias, out, workspace, tf32, count, i)
            expected = F.linear(inputs[0][0], weight, bias).float()
            error = ((out.float() - expected).norm() / expected.norm()).item()
            ids = lt.algorithm_ids(inputs[0][0], weight, bias, tf32, count, i)
            if error > (1e-5 if name == "fp32" else 5e-3):
                print(f"{name} algorithm {i} {ids}: relative error {error:.2g}, left out")
                continue
            fns[f"{i} {ids}"] = (lambda i: lambda x: lt.run(x, weight, bias, out, workspace, tf32, count, i))(i)
        times = time_interleaved_ms(fns, inputs, runs=30)
        base = times["F.linear"]
        print(f"{name}: F.linear {base:.4f} ms; {found} algorithms (index [config, tile, stages, split-k, swizzle])")
        ranked = sorted(times.items(), key=lambda item: item[1])
        for label, t in ranked:
            print(f"  {label:40s} {t:.4f} ms  {t / base:.3f}x")
        fastest = next(label for label, _ in ranked if label != "F.linear")
        for label in ("F.linear", fastest):
            print(f"  {label} launches: {kernel_names(fns[label], inputs[0][0])}")
    torch.backends.cuda.matmul.allow_tf32 = False


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
