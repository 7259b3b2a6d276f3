"""Is any cuBLASLt configuration faster than the heuristic's pick? (1024 x 8192 -> 8192, with bias)

Usage: python dev/cublaslt_search.py [precision ...]   (fp32, tf32, bf16; default tf32 bf16)

dev/cublaslt_probe.py times the algorithms cuBLASLt's heuristic offers (8 for tf32). This one walks the whole
configuration space instead: every algorithm id (cublasLtMatmulAlgoGetIds) with every tile, stage count, CTA
swizzle, cluster shape and split-k of 1 or 2 its capabilities allow, kept where cublasLtMatmulAlgoCheck accepts it
within a 32 MB workspace. Each kept configuration is screened by a short CUDA-event timing; the fastest 12 are then
checked against F.linear and timed beside it with fxfuse.bench's timing (queued behind a GPU spin, input sets
rotated). Each line: [algo id, tile, stages, swizzle, cluster, split-k], its time and its ratio to F.linear's.
"""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).parent))
from cublaslt_probe import PRECISIONS, SOURCE, problem_tensors  # noqa: E402

from fxfuse.bench import time_interleaved_ms  # noqa: E402

SEARCH = r"""
static cublasComputeType_t compute_of(const torch::Tensor& x, bool tf32) {
  return x.scalar_type() == at::kFloat && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}
static cudaDataType_t type_of(const torch::Tensor& x) {
  return x.scalar_type() == at::kFloat ? CUDA_R_32F : x.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
}

// config: algo id, tile, stages, swizzle, cluster, split-k
static bool make_algo(const torch::Tensor& x, bool tf32, const std::vector<int64_t>& config, cublasLtMatmulAlgo_t* algo) {
  const cudaDataType_t t = type_of(x);
  if (cublasLtMatmulAlgoInit(handle(), compute_of(x, tf32), CUDA_R_32F, t, t, t, t, config[0], algo) !=
      CUBLAS_STATUS_SUCCESS) return false;
  const uint32_t tile = config[1], stages = config[2], swizzle = config[3], split = config[5];
  const uint16_t cluster = config[4];
  const uint32_t reduction = split > 1 ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE : CUBLASLT_REDUCTION_SCHEME_NONE;
  return cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile)) == 0 &&
         cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages)) == 0 &&
         cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle)) == 0 &&
         cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster)) == 0 &&
         cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split)) == 0 &&
         (split == 1 || cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                                             sizeof(reduction)) == 0);
}

static std::vector<uint32_t> cap_ids(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attribute) {
  size_t written = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, nullptr, 0, &written);
  std::vector<uint32_t> ids(written / sizeof(uint32_t));
  if (!ids.empty()) cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, ids.data(), written, &written);
  if (ids.empty()) ids.push_back(0);
  return ids;
}

std::vector<std::vector<int64_t>> search(torch::Tensor x, torch::Tensor w, torch::Tensor bias, bool tf32,
                                         double seconds) {
  Problem& p = problem(x, w, bias, tf32, 1);
  const cudaDataType_t t = type_of(x);
  int ids[512];
  int found = 0;
  CHECK_LT(cublasLtMatmulAlgoGetIds(handle(), compute_of(x, tf32), CUDA_R_32F, t, t, t, t, 512, ids, &found));
  std::vector<std::vector<int64_t>> kept;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < found; ++i) {
    cublasLtMatmulAlgo_t algo;
    if (cublasLtMatmulAlgoInit(handle(), compute_of(x, tf32), CUDA_R_32F, t, t, t, t, ids[i], &algo) != 0) continue;
    const std::vector<uint32_t> tiles = cap_ids(algo, CUBLASLT_ALGO_CAP_TILE_IDS);
    const std::vector<uint32_t> stages = cap_ids(algo, CUBLASLT_ALGO_CAP_STAGES_IDS);
    int32_t splitk = 0;
    uint32_t swizzle = 0;
    size_t written = 0;
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &splitk, sizeof(splitk), &written);
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &swizzle, sizeof(swizzle), &written);
    for (uint32_t tile : tiles)
      for (uint32_t stage : stages)
        for (uint32_t s = 0; s <= swizzle; ++s)
          for (int cluster = 0; cluster < CUBLASLT_CLUSTER_SHAPE_END; ++cluster)
            for (int split = 1; split <= (splitk ? 2 : 1); ++split) {
              if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds)
                return kept;
              std::vector<int64_t> config{ids[i], tile, stage, s, cluster, split};
              cublasLtMatmulAlgo_t candidate;
              if (!make_algo(x, tf32, config, &candidate)) continue;
              cublasLtMatmulHeuristicResult_t result{};
              if (cublasLtMatmulAlgoCheck(handle(), p.op, p.a, p.b, p.c, p.c, &candidate, &result) != 0 ||
                  result.state != CUBLAS_STATUS_SUCCESS || result.workspaceSize > kWorkspace) continue;
              kept.push_back(config);
            }
  }
  return kept;
}

void run_config(torch::Tensor x, torch::Tensor w, torch::Tensor bias, torch::Tensor out, torch::Tensor workspace,
                bool tf32, std::vector<int64_t> config) {
  Problem& p = problem(x, w, bias, tf32, 1);
  cublasLtMatmulAlgo_t algo;
  TORCH_CHECK(make_algo(x, tf32, config, &algo), "config rejected");
  const float alpha = 1.0f, beta = 0.0f;
  CHECK_LT(cublasLtMatmul(handle(), p.op, &alpha, w.data_ptr(), p.a, x.data_ptr(), p.b, &beta, out.data_ptr(), p.c,
                          out.data_ptr(), p.c, &algo, workspace.data_ptr(), kWorkspace,
                          at::cuda::getCurrentCUDAStream()));
}

std::vector<int64_t> heuristic_config(torch::Tensor x, torch::Tensor w, torch::Tensor bias, bool tf32) {
  const cublasLtMatmulAlgo_t& algo = problem(x, w, bias, tf32, 1).algorithms.at(0).algo;
  std::vector<int64_t> config;
  size_t written = 0;
  int32_t id = 0;
  uint32_t tile = 0, stages = 0, swizzle = 0, split = 0;
  uint16_t cluster = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split), &written);
  return {id, tile, stages, swizzle, cluster, split};
}
"""


def screen_ms(fn, x, repeats: int = 3) -> float:
    fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main(names: list[str]) -> None:
    lt = load_inline("cublaslt_search", cpp_sources=SOURCE.replace("#include <map>", "#include <chrono>\n#include <map>") + SEARCH,
                     functions=["search", "run_config", "heuristic_config"], with_cuda=True,
                     extra_ldflags=["-lcublasLt"], verbose=False)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, dtype, tf32 in PRECISIONS:
        if name not in names:
            continue
        torch.backends.cuda.matmul.allow_tf32 = tf32
        weight, bias, inputs, out, workspace = problem_tensors(dtype)
        x0 = inputs[0][0]
        began = time.perf_counter()
        configs = lt.search(x0, weight, bias, tf32, 60.0)
        print(f"{name}: heuristic's pick {lt.heuristic_config(x0, weight, bias, tf32)}; {len(configs)} configurations "
              f"accepted in {time.perf_counter() - began:.1f} s")
        screened = []
        began = time.perf_counter()
        for config in configs:
            if time.perf_counter() - began > 90:
                print(f"  screening stopped after {len(screened)}")
                break
            try:
                screened.append((screen_ms(lambda x: lt.run_config(x, weight, bias, out, workspace, tf32, config), x0),
                                 config))
            except RuntimeError as error:
                print(f"  {config}: {error}")
        screened.sort()
        linear_ms = screen_ms(lambda x: F.linear(x, weight, bias), x0)
        print(f"  screen: F.linear {linear_ms:.4f} ms; fastest " +
              ", ".join(f"{c} {t:.4f}" for t, c in screened[:12]))
        fns = {"F.linear": lambda x: F.linear(x, weight, bias)}
        expected = F.linear(x0, weight, bias).float()
        for _, config in screened[:12]:
            lt.run_config(x0, weight, bias, out, workspace, tf32, config)
            error = ((out.float() - expected).norm() / expected.norm()).item()
            if error > (1e-5 if name == "fp32" else 5e-3):
                print(f"  {config}: relative error {error:.2g}, left out")
                continue
            fns[str(config)] = (lambda c: lambda x: lt.run_config(x, weight, bias, out, workspace, tf32, c))(config)
        times = time_interleaved_ms(fns, inputs, runs=30)
        base = times["F.linear"]
        for label, t in sorted(times.items(), key=lambda item: item[1]):
            print(f"  {label:40s} {t:.4f} ms  {t / base:.3f}x")
    torch.backends.cuda.matmul.allow_tf32 = False


if __name__ == "__main__":
    main(sys.argv[1:] or ["tf32", "bf16"])
