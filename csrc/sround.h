// Op family: stochastic rounding to bf16, fp16, fp8 e4m3fn and fp8 e5m2.
//
// Contract (CPU and CUDA implementations give bitwise the same results):
//
//   for every element i of x (i is the index in x, 0 .. numel-1):
//     v = float(x[i])                           (exact for fp16/bf16 sources)
//     y = v * s                                 (fp32 product, round to nearest even;
//                                                s = *scale, scale_value, or 1)
//     r = random_bits[i]                        (as unsigned), or, without random_bits,
//         word i % 4 of Philox4x32-10(key = seed,
//                                     counter = offset + 2^64 * (i / 4))
//     out[i] = SR(y, r) in the target format (below)
//     amax (if requested) = max |v| over all i  (before scaling; NaN if any v is NaN;
//                                                0 for an empty x)
//
//   SR(y, r): let RZ be y rounded toward zero to the target format, ulp the
//   spacing of the target at |y| (the subnormal spacing below the smallest
//   normal: subnormals are kept, nothing is flushed), f = (|y| - |RZ|) / ulp
//   in [0, 1) and F = floor(2^32 * f). The result is the neighbour of RZ away
//   from zero when F + r >= 2^32 (unsigned, i.e. the 32-bit sum carries),
//   else RZ. So P(away) = F / 2^32, which is exactly f whenever |y| is a
//   multiple of ulp * 2^-32: always for bf16 (f has at most 16 bits) and for
//   every fp32 value in the normal range of fp16/fp8 (13 to 21 bits); only
//   values with significant bits more than 32 places below the target's
//   smallest subnormal spacing have f truncated to 32 bits (a bias below
//   2^-32 ulp). Values the target holds exactly have F = 0 and never change;
//   SR(-y, r) = -SR(y, r); +-0 keep their sign.
//
//   Specials and range, per target:
//     NaN     -> NaN (quiet, sign of x XOR sign of the scale; payload not kept)
//     +-inf   -> +-inf for bf16, fp16, e5m2; +-448 for e4m3fn (it has no inf; as torch 2.13's CPU cast)
//     beyond the largest finite value M:
//       bf16, fp16, e5m2: the gap from M to inf counts as one more ulp: values in
//                         (M, M + ulp) go to inf with probability f, larger ones to inf;
//                         with saturate, every finite value beyond M gives +-M.
//       e4m3fn:           always +-448 (never NaN from a finite x, also when x * scale overflows
//                         fp32); saturate is moot.
//
//   * random_bits: int32, numel of x; given, no Philox bits are drawn.
//   * seed_offset, scale, amax: single values in the memory of the place
//     (device memory for CUDA): read and written there, no host sync.
//     seed_offset, when set, holds {seed, offset} and overrides seed/offset.
//   * amax is written (not accumulated): the CUDA path clears it with an
//     asynchronous memset on the stream, then takes an integer max of the
//     |v| bit patterns, which is exact and order-free (deterministic).
//   * Every argument is validated before any element is written; errors name
//     the argument (x, out, random_bits, scale, amax).
#pragma once

#include <cstdint>

#include "core.h"

namespace aamp {

struct SroundArgs {
  TensorRef x;                   // float32, float16 or bfloat16
  TensorRef out;                 // bfloat16, float16, float8_e4m3fn or float8_e5m2; x.numel elements
  bool has_random_bits = false;  // use random_bits instead of Philox
  TensorRef random_bits;         // int32, x.numel elements
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  const std::uint64_t* seed_offset = nullptr;  // {seed, offset} in place memory, or null
  const float* scale = nullptr;                // 1 float in place memory, or null
  bool has_scale_value = false;                // multiply by scale_value (a host number)
  float scale_value = 1.0f;
  bool saturate = false;
  float* amax = nullptr;  // 1 float in place memory, or null for no amax
  Place place;
};

// Philox words per call; element i takes word i % kSroundGroup of group i / kSroundGroup.
constexpr std::int64_t kSroundGroup = 4;

bool is_sround_source(DType t);
bool is_sround_target(DType t);

// Validates everything; throws before any write.
void validate_sround(const SroundArgs& a);

void stochastic_round(const SroundArgs& a);  // validates, then dispatches

void stochastic_round_cpu(const SroundArgs& a);
void stochastic_round_cuda(const SroundArgs& a);

}  // namespace aamp
