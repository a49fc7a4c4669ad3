// Validation and dispatch of the statistics family; shared by CPU and CUDA.
#include "stats.h"

#include <string>

namespace aamp {

const char* const kStatFieldNames[kStatFields] = {
    "numel", "nan_count", "inf_count", "zero_count", "min", "max", "amax", "min_abs_nonzero",
    "mean", "std", "l2_norm", "dynamic_range", "overflow_count", "underflow_count", "subnormal_count",
};

namespace {

std::int64_t chunks_of(std::int64_t numel) { return (numel + kStatsChunk - 1) / kStatsChunk; }

bool is_stats_input(DType t) { return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16; }

}  // namespace

bool is_stats_format(DType t) {
  return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat8E4M3FN || t == DType::kFloat8E5M2;
}

std::size_t stats_workspace_bytes(const std::vector<TensorRef>& tensors) {
  std::int64_t chunks = 0;
  for (const TensorRef& t : tensors) chunks += chunks_of(t.numel);
  return static_cast<std::size_t>(chunks) * kStatsPartialsPerChunk * sizeof(StatsPartial);
}

void validate_stats(const StatsArgs& a) {
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const TensorRef& t = a.tensors[i];
    if (!is_stats_input(t.dtype)) {
      throw_dtype(item_name("tensors", i), std::string("has dtype ") + dtype_name(t.dtype) +
                                               "; tensor_stats accepts float32, float16 and bfloat16");
    }
    if (t.numel < 0) throw_argument(item_name("tensors", i), "has a negative element count");
    if (t.numel > 0 && t.data == nullptr) throw_argument(item_name("tensors", i), "is a null pointer");
    if (reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) != 0) {
      throw_argument(item_name("tensors", i), "is not aligned to its element size");
    }
  }
  if (a.has_format && !is_stats_format(a.format)) {
    throw_dtype("format", std::string("is ") + dtype_name(a.format) +
                              "; expected float16, bfloat16, float8_e4m3fn or float8_e5m2");
  }
  if (a.scale != nullptr && a.has_scale_value) {
    throw_argument("scale", "is given both as a pointer and as a value; pass one");
  }
  if ((a.scale != nullptr || a.has_scale_value) && !a.has_format) {
    throw_argument("scale", "is given without a format; it only scales the format counts");
  }
  if (a.scale_per_tensor && a.scale == nullptr) {
    throw_argument("scale", "is per tensor but no scale array is given");
  }
  if (a.out == nullptr && !a.tensors.empty()) throw_argument("out", "is a null pointer");
  const std::size_t need = stats_workspace_bytes(a.tensors);
  if (need > 0 && (a.workspace == nullptr || a.workspace_bytes < need)) {
    throw_argument("workspace", "holds " + std::to_string(a.workspace_bytes) + " bytes; " + std::to_string(need) +
                                    " are needed (stats_workspace_bytes)");
  }
  if (a.place.is_cuda() && !cuda_built()) {
    throw CudaError(
        "tensors: CUDA tensors were given, but adaptive_amp was built without CUDA kernels "
        "(nvcc was not found when it was installed). Reinstall with nvcc on PATH or CUDA_HOME set.");
  }
}

void tensor_stats(const StatsArgs& a) {
  validate_stats(a);
  if (a.tensors.empty()) return;
#ifdef AAMP_WITH_CUDA
  if (a.place.is_cuda()) return tensor_stats_cuda(a);
#endif
  tensor_stats_cpu(a);
}

}  // namespace aamp
