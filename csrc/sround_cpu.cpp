// CPU implementation of stochastic rounding (contract in sround.h).
//
// Blocks of kBlock elements (a multiple of the Philox group, so a block never
// splits a group) are spread over OpenMP threads. Each block first draws its
// random words into a small buffer, then rounds in a branch-free loop the
// compiler can vectorize; the per-element rule is the one the CUDA kernel
// uses (sround_rule.h), so the two agree bit for bit.
#include <algorithm>
#include <cstring>

#include "float_bits.h"
#include "philox.h"
#include "sround.h"
#include "sround_rule.h"

namespace aamp {

namespace {

constexpr std::int64_t kBlock = 4096;
static_assert(kBlock % kSroundGroup == 0, "a block must hold whole Philox groups");

// Sources are read through the shared element types.
using SrcF32 = host_elements::F32;
using SrcF16 = host_elements::F16;
using SrcBF16 = host_elements::BF16;

struct Params {
  std::uint64_t seed, offset;
  float scale;
  bool saturate;
};

template <class Src, class Fmt>
std::uint32_t round_block(const typename Src::T* __restrict x, typename Fmt::T* __restrict out,
                          const std::uint32_t* __restrict r, std::int64_t n, float s, bool saturate) {
  const std::uint32_t s_sign = f32_bits(s) & 0x80000000u;
  std::uint32_t am = 0;
#pragma omp simd reduction(max : am)
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = Src::load(x[i]);
    const std::uint32_t vb = f32_bits(v);
    const std::uint32_t mag = vb & 0x7fffffffu;
    am = mag > am ? mag : am;
    out[i] = static_cast<typename Fmt::T>(sround_element<Fmt>(f32_bits(v * s), vb ^ s_sign, r[i], saturate));
  }
  return am;
}

template <class Src, class Fmt>
void run(const SroundArgs& a, const Params& p) {
  const auto* x = static_cast<const typename Src::T*>(a.x.data);
  auto* out = static_cast<typename Fmt::T*>(a.out.data);
  const auto* bits = static_cast<const std::uint32_t*>(a.random_bits.data);
  const std::int64_t n = a.x.numel;
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  std::uint32_t am = 0;
  // Below about 32K elements threads cost more than they save.
#pragma omp parallel for schedule(static) reduction(max : am) if (blocks > 1 && n > (1 << 15))
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t i0 = b * kBlock;
    const std::int64_t m = std::min(kBlock, n - i0);
    const std::uint32_t* r = nullptr;
    std::uint32_t drawn[kBlock];
    if (a.has_random_bits) {
      r = bits + i0;
    } else {
      const std::uint64_t g0 = static_cast<std::uint64_t>(i0 / kSroundGroup);
      const std::int64_t groups = (m + kSroundGroup - 1) / kSroundGroup;
      for (std::int64_t g = 0; g < groups; ++g) {
        const PhiloxBits w = philox_group(p.seed, p.offset, g0 + static_cast<std::uint64_t>(g));
        std::memcpy(drawn + g * kSroundGroup, w.w, sizeof(w.w));
      }
      r = drawn;
    }
    const std::uint32_t bam = round_block<Src, Fmt>(x + i0, out + i0, r, m, p.scale, p.saturate);
    am = bam > am ? bam : am;
  }
  if (a.amax != nullptr) *a.amax = f32_from_bits(am);
}

template <class Src>
void dispatch_target(const SroundArgs& a, const Params& p) {
  switch (a.out.dtype) {
    case DType::kBFloat16: return run<Src, SrBF16>(a, p);
    case DType::kFloat16: return run<Src, SrF16>(a, p);
    case DType::kFloat8E4M3FN: return run<Src, SrE4M3>(a, p);
    case DType::kFloat8E5M2: return run<Src, SrE5M2>(a, p);
    default: return;  // rejected by validate_sround
  }
}

}  // namespace

void stochastic_round_cpu(const SroundArgs& a) {
  Params p;
  p.seed = a.seed_offset != nullptr ? a.seed_offset[0] : a.seed;
  p.offset = a.seed_offset != nullptr ? a.seed_offset[1] : a.offset;
  p.scale = a.scale != nullptr ? *a.scale : (a.has_scale_value ? a.scale_value : 1.0f);
  p.saturate = a.saturate;
  switch (a.x.dtype) {
    case DType::kFloat32: return dispatch_target<SrcF32>(a, p);
    case DType::kFloat16: return dispatch_target<SrcF16>(a, p);
    case DType::kBFloat16: return dispatch_target<SrcBF16>(a, p);
    default: return;  // rejected by validate_sround
  }
}

}  // namespace aamp
