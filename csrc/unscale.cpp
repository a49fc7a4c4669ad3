// Validation and dispatch of the unscale family; shared by CPU and CUDA.
#include "unscale.h"

#include <string>

namespace aamp {

namespace {

std::int64_t chunks_of(std::int64_t numel) { return (numel + kUnscaleChunk - 1) / kUnscaleChunk; }

bool is_unscale_dtype(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16;
}

}  // namespace

std::size_t unscale_workspace_bytes(const std::vector<TensorRef>& tensors, bool stats) {
  if (!stats) return 0;
  std::int64_t chunks = 0;
  for (const TensorRef& t : tensors) chunks += chunks_of(t.numel);
  return static_cast<std::size_t>(chunks) * kUnscalePartialsPerChunk * sizeof(UnscalePartial);
}

void validate_unscale(const UnscaleArgs& a) {
  if (a.found_inf == nullptr) throw_argument("found_inf", "is a null pointer; pass a 1-element float32 tensor");
  if (a.inv_scale == nullptr) throw_argument("inv_scale", "is a null pointer; pass a 1-element float32 tensor");
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const TensorRef& t = a.tensors[i];
    if (!is_unscale_dtype(t.dtype)) {
      throw_dtype(item_name("tensors", i), std::string("has dtype ") + dtype_name(t.dtype) +
                                               "; unscale_and_check_ accepts float32, float16 and bfloat16");
    }
    if (t.numel < 0) throw_argument(item_name("tensors", i), "has a negative element count");
    if (t.numel > 0 && t.data == nullptr) throw_argument(item_name("tensors", i), "is a null pointer");
    if (reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) != 0) {
      throw_argument(item_name("tensors", i), "is not aligned to its element size");
    }
  }
  const bool stats = a.sumsq != nullptr || a.amax != nullptr;
  if (stats) {
    if (a.sumsq == nullptr) throw_argument("sumsq", "is missing while amax is given; pass both or neither");
    if (a.amax == nullptr) throw_argument("amax", "is missing while sumsq is given; pass both or neither");
    std::size_t need = unscale_workspace_bytes(a.tensors, true);
    if (need > 0 && (a.workspace == nullptr || a.workspace_bytes < need)) {
      throw_argument("workspace", "holds " + std::to_string(a.workspace_bytes) + " bytes; " +
                                      std::to_string(need) + " are needed (unscale_workspace_bytes)");
    }
  }
  // found_inf is written by every block, also when only checking: it may not
  // live inside a tensor being read.
  check_outside(a.tensors, "tensors", a.found_inf, "found_inf");
  if (!a.check_only) {
    check_no_overlap(a.tensors, "tensors");
    // inv_scale is read by every block while the tensors are written.
    check_outside(a.tensors, "tensors", a.inv_scale, "inv_scale");
  }
  if (a.place.is_cuda() && !cuda_built()) {
    throw CudaError(
        "tensors: CUDA tensors were given, but adaptive_amp was built without CUDA kernels "
        "(nvcc was not found when it was installed). Reinstall with nvcc on PATH or CUDA_HOME set.");
  }
}

void unscale_and_check(const UnscaleArgs& a) {
  validate_unscale(a);
#ifdef AAMP_WITH_CUDA
  if (a.place.is_cuda()) return unscale_and_check_cuda(a);
#endif
  unscale_and_check_cpu(a);
}

}  // namespace aamp
