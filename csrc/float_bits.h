// Conversions between fp32 and the 16-bit formats for the host, bit-exact with
// the hardware conversions the CUDA kernels use (round to nearest even,
// subnormals kept, NaN stays NaN with its payload truncated and quieted, as
// x86 F16C and CUDA's cvt do). Branch-free so the compiler can vectorize the
// loops that call them.
#pragma once

#include <cstdint>

#include "host_device.h"  // f32_bits, f32_from_bits

namespace aamp {

// cond ? a : b on words, written so that compilers keep both sides computed
// and blend (a branch would stop loops from vectorizing: with trapping math on,
// gcc will not evaluate a floating-point operation the source made conditional).
inline std::uint32_t select_u32(bool cond, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

inline bool f32_bits_nonfinite(std::uint32_t u) { return (u & 0x7f800000u) == 0x7f800000u; }

// bf16 both ways also serve device code (the optimizers' round-to-nearest path).
AAMP_HD float bf16_to_f32(std::uint16_t h) { return f32_from_bits(static_cast<std::uint32_t>(h) << 16); }

AAMP_HD std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u = f32_bits(f);
  std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  std::uint32_t nan = (u >> 16) | 0x0040u;  // quiet, sign and top payload kept
  bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(is_nan ? nan : rounded);
}

inline float f16_to_f32(std::uint16_t h) {
  // Arithmetic only (no int->float conversion of a variable, no branches) so
  // that loops over it vectorize. The magnitude bits shifted to the top of a
  // word line up with fp32's fields after a shift right by 4; adding 224 to
  // the exponent field and scaling by 2^-112 rebiases normals and maps the
  // all-ones exponent to inf/NaN (payload kept). Subnormals are rebuilt by
  // placing the mantissa under the exponent of 0.5 and subtracting 0.5.
  const std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
  const std::uint32_t sign = w & 0x80000000u;
  const std::uint32_t two_w = w + w;  // drops the sign
  const float normal = f32_from_bits((two_w >> 4) + (224u << 23)) * 0x1.0p-112f;
  const float subnormal = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const std::uint32_t magnitude = select_u32(two_w < (1u << 27), f32_bits(subnormal), f32_bits(normal));
  return f32_from_bits(sign | magnitude);
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
  std::uint32_t r = select_u32(a < 0x38800000u, subnormal, normal);
  r = select_u32(a >= 0x477ff000u, 0x7c00u, r);  // rounds to inf
  r = select_u32(a > 0x7f800000u, nan, r);
  return static_cast<std::uint16_t>(sign | r);
}

// The element types the CPU kernels read and write, mirroring
// cuda_elements.cuh: raw storage, fp32 load, round-to-nearest-even store, and
// a NaN/inf test on the raw bits.
namespace host_elements {

struct F32 {
  using T = float;
  static bool nonfinite(T v) { return f32_bits_nonfinite(f32_bits(v)); }
  static float load(T v) { return v; }
  static T store(float y) { return y; }
};

struct F16 {
  using T = std::uint16_t;
  static bool nonfinite(T v) { return (v & 0x7c00u) == 0x7c00u; }
  static float load(T v) { return f16_to_f32(v); }
  static T store(float y) { return f32_to_f16(y); }
};

struct BF16 {
  using T = std::uint16_t;
  static bool nonfinite(T v) { return (v & 0x7f80u) == 0x7f80u; }
  static float load(T v) { return bf16_to_f32(v); }
  static T store(float y) { return f32_to_bf16(y); }
};

}  // namespace host_elements

}  // namespace aamp
