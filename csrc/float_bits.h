// Host-side conversions between fp32 and the 16-bit formats, bit-exact with
// the hardware conversions the CUDA kernels use (round to nearest even,
// subnormals kept, NaN stays NaN with its payload truncated and quieted, as
// x86 F16C and CUDA's cvt do). Branch-free so the compiler can vectorize the
// loops that call them.
#pragma once

#include <cstdint>
#include <cstring>

namespace aamp {

inline std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float f32_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bool f32_bits_nonfinite(std::uint32_t u) { return (u & 0x7f800000u) == 0x7f800000u; }

inline float bf16_to_f32(std::uint16_t h) { return f32_from_bits(static_cast<std::uint32_t>(h) << 16); }

inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u = f32_bits(f);
  std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  std::uint32_t nan = (u >> 16) | 0x0040u;  // quiet, sign and top payload kept
  bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(is_nan ? nan : rounded);
}

inline float f16_to_f32(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  // Normal: rebias the exponent. Inf/NaN: all-ones exponent.
  std::uint32_t normal = sign | ((exp + 112u) << 23) | (mant << 13);
  std::uint32_t special = sign | 0x7f800000u | (mant << 13);
  // Subnormal: mant * 2^-24 is exact in fp32.
  float sub = static_cast<float>(mant) * 5.9604644775390625e-08f;
  std::uint32_t subnormal = sign | f32_bits(sub);
  std::uint32_t u = exp == 0 ? subnormal : (exp == 31 ? special : normal);
  return f32_from_bits(u);
}

inline std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  // All candidates are computed and one is selected, so loops vectorize.
  // Normal result: rebias the exponent (-112 << 23) and round to nearest even.
  const std::uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  // Subnormal or zero result: adding 0.5 aligns the mantissa so that the
  // FPU's own round-to-nearest-even does the rounding.
  const std::uint32_t subnormal = f32_bits(f32_from_bits(a) + 0.5f) - 0x3f000000u;
  const std::uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
  const std::uint32_t r = a > 0x7f800000u   ? nan
                          : a >= 0x477ff000u ? 0x7c00u  // rounds to inf
                          : a < 0x38800000u  ? subnormal
                                             : normal;
  return static_cast<std::uint16_t>(sign | r);
}

}  // namespace aamp
