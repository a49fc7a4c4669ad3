// Philox4x32-10, the counter-based generator of Salmon et al., "Parallel
// random numbers: as easy as 1, 2, 3" (SC'11), as in Random123 and cuRAND.
//
// One header for the host and the device: compiled by nvcc the functions are
// __host__ __device__, so the CPU and CUDA kernels draw the very same bits.
// A counter-based generator has no state to carry between threads: any
// element's bits are a pure function of (key, counter), which is what makes
// the results independent of the launch configuration.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace aamp {

struct PhiloxBits {
  std::uint32_t w[4];
};

AAMP_HD void philox_mulhilo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  lo = static_cast<std::uint32_t>(p);
  hi = static_cast<std::uint32_t>(p >> 32);
#endif
}

// The 128-bit counter (c0 least significant) under the 64-bit key (k0 least
// significant) -> four 32-bit words. Known answers (Random123 kat_vectors):
//   counter 0, key 0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8.
AAMP_HD PhiloxBits philox4x32_10(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2, std::uint32_t c3,
                                 std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, hi0, lo0);
    philox_mulhilo(kM1, c2, hi1, lo1);
    const std::uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;  // bumping after the last round too is harmless: the key is not used again
    k1 += kW1;
  }
  return PhiloxBits{{c0, c1, c2, c3}};
}

// The words stochastic rounding uses for element group `group` (elements
// 4*group .. 4*group+3, one word each, in order): key = seed, counter =
// (offset in the low 64 bits, group in the high 64 bits).
AAMP_HD PhiloxBits philox_group(std::uint64_t seed, std::uint64_t offset, std::uint64_t group) {
  return philox4x32_10(static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(offset >> 32),
                       static_cast<std::uint32_t>(group), static_cast<std::uint32_t>(group >> 32),
                       static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

}  // namespace aamp
