// The per-element rule of stochastic rounding (stated in sround.h), written
// once for the host and the device so that the CPU and CUDA kernels agree
// bit for bit by construction. Integer arithmetic on the fp32 bit pattern
// only: no floating-point rounding mode, flush-to-zero or fast-math setting
// can change the result.
#pragma once

#include <cstdint>

#include "philox.h"  // AAMP_HD

namespace aamp {

// Target formats: mantissa bits, exponent bias, and the magnitude bit
// patterns of the largest finite value, infinity (0: none) and the NaN we
// write. The magnitude patterns are monotone in value, so "the next value up"
// is the pattern plus one.
struct SrBF16 {
  using T = std::uint16_t;
  static constexpr int kMant = 7, kBias = 127, kBits = 16;
  static constexpr std::uint32_t kMax = 0x7F7Fu, kInf = 0x7F80u, kNaN = 0x7FC0u;
};
struct SrF16 {
  using T = std::uint16_t;
  static constexpr int kMant = 10, kBias = 15, kBits = 16;
  static constexpr std::uint32_t kMax = 0x7BFFu, kInf = 0x7C00u, kNaN = 0x7E00u;
};
struct SrE4M3 {  // float8_e4m3fn: no infinity, 0x7F is NaN, 448 is the largest
  using T = std::uint8_t;
  static constexpr int kMant = 3, kBias = 7, kBits = 8;
  static constexpr std::uint32_t kMax = 0x7Eu, kInf = 0u, kNaN = 0x7Fu;
};
struct SrE5M2 {
  using T = std::uint8_t;
  static constexpr int kMant = 2, kBias = 15, kBits = 8;
  static constexpr std::uint32_t kMax = 0x7Bu, kInf = 0x7Cu, kNaN = 0x7Eu;
};

// y: the fp32 bits of the (scaled) value; sign: bit 31 is the result's sign,
// sign(x) XOR sign(scale), which is sign(y) for every non-NaN y and, unlike
// the sign of a NaN product, the same on every CPU and GPU; r: the element's
// 32 random bits. Returns the target's bit pattern.
//
// |y| = T*ulp + f*ulp with T the magnitude pattern of RZ(|y|) and f in [0, 1)
// the fractional position. F = floor(2^32 * f) is taken exactly from the bits
// below the target's last mantissa bit; the result is T + 1 (the neighbour
// away from zero) when F + r >= 2^32, else T. Carrying into the exponent is
// the correct next value, and past the largest finite value it reaches the
// infinity pattern (the gap to inf counted as one more ulp), then clamped.
AAMP_HD std::uint32_t max_u32(std::uint32_t a, std::uint32_t b) { return a > b ? a : b; }

template <class Fmt>
AAMP_HD std::uint32_t sround_element(std::uint32_t y, std::uint32_t sign, std::uint32_t r, bool saturate) {
  constexpr int kDrop = 23 - Fmt::kMant;  // fp32 mantissa bits below the target's ulp in the normal range
  const std::uint32_t a = y & 0x7fffffffu;
  std::uint32_t t, f;
  if (Fmt::kBias == 127) {
    // bf16 has fp32's exponent range (subnormals included): a plain cut.
    t = a >> kDrop;
    f = a << (32 - kDrop);
  } else {
    // e: the exponent field of |y| (fp32 subnormals count as field 1, with
    // no implicit bit); significand: the 24-bit significand (hidden bit set).
    const std::uint32_t e = max_u32(a >> 23, 1u);
    const std::uint32_t significand = a + 0x800000u - (e << 23);
    // et1 = (target exponent field) - 1: >= 0 for a normal target value, whose
    // exponent goes into t; < 0 for a subnormal one, whose significand lands
    // -et1 bits further right. One 64-bit shift yields the kept bits (high
    // word) and the 32 fraction bits below the cut (low word), truncated
    // beyond 32 bits.
    const int et1 = static_cast<int>(e) - (128 - Fmt::kBias);
    const int shift = kDrop + (et1 < 0 ? (-et1 < 63 - kDrop ? -et1 : 63 - kDrop) : 0);
    const std::uint64_t wide = (static_cast<std::uint64_t>(significand) << 32) >> shift;
    t = (static_cast<std::uint32_t>(et1 > 0 ? et1 : 0) << Fmt::kMant) + static_cast<std::uint32_t>(wide >> 32);
    f = static_cast<std::uint32_t>(wide);
  }
  t += static_cast<std::uint32_t>((static_cast<std::uint64_t>(f) + r) >> 32);  // F + r carries out of 32 bits
  const std::uint32_t limit = (Fmt::kInf != 0 && !saturate) ? Fmt::kInf : Fmt::kMax;
  t = t < limit ? t : limit;
  const bool is_nan = a > 0x7f800000u;
  const bool is_inf = a == 0x7f800000u;
  // +-inf stays +-inf where the format has inf. e4m3fn has none and
  // saturates: +-inf (also a finite x whose scaled product overflowed fp32)
  // gives +-448, as torch 2.13's CPU cast does with inf.
  const std::uint32_t inf = Fmt::kInf != 0 ? Fmt::kInf : Fmt::kMax;
  t = is_nan ? Fmt::kNaN : (is_inf ? inf : t);
  return ((sign >> 31) << (Fmt::kBits - 1)) | t;
}

// ---------------------------------------------------------------------------
// A cheaper form of the same rule for the CUDA kernel's vector loop, exact on
// the values where it is valid (the kernel sends every other value through
// sround_element). It returns the magnitude pattern only (the caller adds
// sign(y)) and works in 32-bit integers with no 64-bit shift:
//
// m is the number of fp32 mantissa bits below the target's ulp at |y| (kDrop
// in the target's normal range, more below it). With X the significand of
// |y| aligned so that its low m bits are the fraction (the exponent moved to
// the target's bias in the normal range), F + r carries out of 32 bits
// exactly when (X mod 2^m) + (r >> (32 - m)) carries out of m bits, so
// t = (X + (r >> (32 - m))) >> m is RZ plus the carry, for any m <= 31.
// Valid for finite |y| >= sround_fast_lo<Fmt>() (m <= 31) and for +-0 (the
// clamped shift yields 0); the caller clamps t to its limit (overflow is
// exact that way: RZ plus carry beyond the limit is the limit) and sends NaN,
// inf and the nonzero values below sround_fast_lo (m >= 32, where F needs
// more than 32 bits of alignment) to sround_element.
template <class Fmt>
struct SroundFast {
  static constexpr int kDrop = 23 - Fmt::kMant;
  static constexpr int kMTop = kDrop + 128 - Fmt::kBias;  // m = max(kMTop - e, kDrop), e the fp32 exponent field
  // X = a + ((m - kDrop) << 23) - rebias = a + (m << 23) - kXOff (mod 2^32).
  static constexpr std::uint32_t kXOff = (static_cast<std::uint32_t>(kDrop) << 23) +
                                         (static_cast<std::uint32_t>(127 - Fmt::kBias) << 23);
  static constexpr std::uint32_t kLo = static_cast<std::uint32_t>(kMTop - 31) << 23;  // smallest a with m <= 31
  static constexpr int kMiOff = kMTop - 255;  // kMTop - e = (na >> 23) + kMiOff, na = 0x7fffffff - a
};

// r >> (32 - m) for m in [1, 31] (any value otherwise): the high word of
// (0:r) << m, one funnel shift on the device.
AAMP_HD std::uint32_t sround_high_bits(std::uint32_t r, std::uint32_t m) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(r, 0u, m);
#else
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(r) << (m & 31u)) >> 32);
#endif
}

// z >> m, 0 for m >= 32 (a clamped funnel shift on the device).
AAMP_HD std::uint32_t sround_shr_clamp(std::uint32_t z, std::uint32_t m) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_rc(z, 0u, m);
#else
  return m >= 32u ? 0u : z >> m;
#endif
}

// na = 0x7fffffff - |y| bits (|y| finite), the complement of the magnitude
// (one LOP3 from y, and no negation later), and mi = (na >> 23) + kMiOff,
// which is kMTop - e (a parameter so that the CUDA kernel can compute it on
// another pipe, see FastInt there): the magnitude of SR(y, r) before the
// limit clamp.
template <class Fmt>
AAMP_HD std::uint32_t sround_magnitude_fast_na(std::uint32_t na, int mi, std::uint32_t r) {
  using K = SroundFast<Fmt>;
  const std::uint32_t m = static_cast<std::uint32_t>(mi > K::kDrop ? mi : K::kDrop);
  const std::uint32_t z = (m << 23) + (sround_high_bits(r, m) - na + (0x7fffffffu - K::kXOff));
  return sround_shr_clamp(z, m);
}

}  // namespace aamp
