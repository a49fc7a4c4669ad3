// Validation and dispatch of the stochastic-rounding family; shared by CPU and CUDA.
#include "sround.h"

#include <string>

namespace aamp {

namespace {

void check_ref(const TensorRef& t, const char* name) {
  if (t.numel < 0) throw_argument(name, "has a negative element count");
  if (t.numel > 0 && t.data == nullptr) throw_argument(name, "is a null pointer");
  if (reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) != 0) {
    throw_argument(name, "is not aligned to its element size");
  }
}

bool overlap(const TensorRef& a, const TensorRef& b) {
  if (a.numel == 0 || b.numel == 0) return false;
  const auto a0 = reinterpret_cast<std::uintptr_t>(a.data), b0 = reinterpret_cast<std::uintptr_t>(b.data);
  const auto a1 = a0 + static_cast<std::uintptr_t>(a.numel) * dtype_size(a.dtype);
  const auto b1 = b0 + static_cast<std::uintptr_t>(b.numel) * dtype_size(b.dtype);
  return a0 < b1 && b0 < a1;
}

}  // namespace

bool is_sround_source(DType t) { return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16; }

bool is_sround_target(DType t) {
  return t == DType::kBFloat16 || t == DType::kFloat16 || t == DType::kFloat8E4M3FN || t == DType::kFloat8E5M2;
}

void validate_sround(const SroundArgs& a) {
  if (!is_sround_source(a.x.dtype)) {
    throw_dtype("x", std::string("has dtype ") + dtype_name(a.x.dtype) +
                         "; stochastic_round accepts float32, float16 and bfloat16");
  }
  check_ref(a.x, "x");
  if (!is_sround_target(a.out.dtype)) {
    throw_dtype("out", std::string("has dtype ") + dtype_name(a.out.dtype) +
                           "; stochastic_round rounds to bfloat16, float16, float8_e4m3fn or float8_e5m2");
  }
  check_ref(a.out, "out");
  if (a.out.numel != a.x.numel) {
    throw_argument("out", "has " + std::to_string(a.out.numel) + " elements; x has " + std::to_string(a.x.numel));
  }
  if (overlap(a.out, a.x)) throw_argument("out", "shares memory with x; pass a separate output");
  if (a.has_random_bits) {
    if (a.random_bits.dtype != DType::kInt32) {
      throw_dtype("random_bits", std::string("has dtype ") + dtype_name(a.random_bits.dtype) + "; expected int32");
    }
    check_ref(a.random_bits, "random_bits");
    if (a.random_bits.numel != a.x.numel) {
      throw_argument("random_bits", "has " + std::to_string(a.random_bits.numel) + " elements; x has " +
                                        std::to_string(a.x.numel) + " (one 32-bit word per element)");
    }
    if (overlap(a.out, a.random_bits)) throw_argument("out", "shares memory with random_bits");
  }
  if (a.scale != nullptr && a.has_scale_value) {
    throw_argument("scale", "is given both as a number and in memory; pass one");
  }
  if (a.scale != nullptr && reinterpret_cast<std::uintptr_t>(a.scale) % alignof(float) != 0) {
    throw_argument("scale", "is not aligned to its element size");
  }
  if (a.amax != nullptr && reinterpret_cast<std::uintptr_t>(a.amax) % alignof(float) != 0) {
    throw_argument("amax", "is not aligned to its element size");
  }
  if (a.seed_offset != nullptr && reinterpret_cast<std::uintptr_t>(a.seed_offset) % alignof(std::uint64_t) != 0) {
    throw_argument("generator", "seed and offset are not aligned to 8 bytes");
  }
  if (a.place.is_cuda() && !cuda_built()) {
    throw CudaError(
        "x: a CUDA tensor was given, but adaptive_amp was built without CUDA kernels "
        "(nvcc was not found when it was installed). Reinstall with nvcc on PATH or CUDA_HOME set.");
  }
}

void stochastic_round(const SroundArgs& a) {
  validate_sround(a);
#ifdef AAMP_WITH_CUDA
  if (a.place.is_cuda()) return stochastic_round_cuda(a);
#endif
  stochastic_round_cpu(a);
}

}  // namespace aamp
