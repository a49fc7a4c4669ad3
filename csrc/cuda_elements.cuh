// The element types the CUDA kernels read and write: fp32, fp16 and bf16 as
// raw storage, converted to fp32 for arithmetic and back with round to
// nearest even, and a test for NaN/inf on the raw bits (no conversion).
// Kernels take one of them as a template parameter; Vec16 views 16 bytes of
// them, the width of one vector load.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace aamp {
namespace elements {

struct F32 {
  using T = float;
  __device__ static bool nonfinite(T v) { return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u; }
  __device__ static float load(T v) { return v; }
  __device__ static T store(float y) { return y; }
};

struct F16 {
  using T = unsigned short;
  __device__ static bool nonfinite(T v) { return (v & 0x7c00u) == 0x7c00u; }
  __device__ static float load(T v) { return __half2float(__ushort_as_half(v)); }
  __device__ static T store(float y) { return __half_as_ushort(__float2half_rn(y)); }
};

struct BF16 {
  using T = unsigned short;
  __device__ static bool nonfinite(T v) { return (v & 0x7f80u) == 0x7f80u; }
  __device__ static float load(T v) { return __uint_as_float(static_cast<unsigned>(v) << 16); }
  __device__ static T store(float y) { return __bfloat16_as_ushort(__float2bfloat16_rn(y)); }
};

template <class E>
union Vec16 {
  uint4 raw;
  typename E::T e[16 / sizeof(typename E::T)];
};

}  // namespace elements
}  // namespace aamp
