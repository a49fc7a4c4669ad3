// What code compiled for both the host and the device shares: the function
// qualifier and the fp32 <-> bit-pattern casts (intrinsics on the device,
// memcpy on the host, which compilers turn into a register move).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define AAMP_HD __host__ __device__ __forceinline__
#else
#define AAMP_HD inline
#endif

namespace aamp {

AAMP_HD std::uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

AAMP_HD float f32_from_bits(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

}  // namespace aamp
