// CUDA implementation of stochastic rounding (contract in sround.h).
//
// Built for bandwidth, in the pattern of torch's vectorized casts: a thread
// takes 16 bytes of the source per vector (4 fp32 or 8 fp16/bf16 elements)
// and stores the same elements of the target (4 to 16 bytes); lanes take
// consecutive vectors, so each load and store instruction of a warp covers
// one contiguous span, and a tile of Step::kUnroll vectors per thread (16
// elements; 32 for fp32 -> e4m3) is loaded before any is computed. One Philox call yields the words of 4 consecutive elements.
// The vector loop rounds with cheaper forms of the rule that are exact on
// the common values (see "fast forms" below) and redoes a vector with the
// full rule when one of its values is outside them; amax is a template
// argument, so calls without it keep no running max.
// Unaligned data (views with storage offsets) and the tail take a scalar
// path, one Philox group per thread step. The random words depend only on
// the element index, never on the thread that handles it, so both paths and
// every grid size give the same bits; the per-element rule is shared with the
// CPU kernel (sround_rule.h). One launch per call, 64-bit indexing, no
// allocation, no synchronization; with amax, one asynchronous memset first.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda_elements.cuh"
#include "cuda_utils.cuh"
#include "philox.h"
#include "sround.h"
#include "sround_rule.h"

namespace aamp {

namespace {

constexpr int kThreads = 256;

// Build-time knobs for tuning sweeps (ADAPTIVE_AMP_NVCC_FLAGS): elements
// per thread and tile, and the resident blocks per SM that __launch_bounds__
// asks for (default 16 and 4: 64 registers). fp32 -> e4m3 (launch_e4m3)
// ignores them and takes 32-element tiles at 2 blocks (128 registers): its
// eight 16-byte loads per thread are all issued before the first vector is
// rounded, where under 64 registers ptxas issued the 2nd to 4th loads of a
// 16-element tile only after rounding the 1st vector. Results are bitwise the
// same under any tile (the random word of an element depends only on its
// index); on an H200, 256M elements took 0.414 ms instead of 0.469 ms.
#ifndef AAMP_SR_ELEMS
#define AAMP_SR_ELEMS 16
#endif
#ifndef AAMP_SR_MIN_BLOCKS
#define AAMP_SR_MIN_BLOCKS 4
#endif

// Sources are read through the shared element types.
using SrcF32 = elements::F32;
using SrcF16 = elements::F16;
using SrcBF16 = elements::BF16;

struct KernelParams {
  const void* x;
  void* out;
  const std::uint32_t* bits;
  std::int64_t n;
  std::uint64_t seed;
  std::uint64_t offset;
  const std::uint64_t* seed_offset;
  const float* scale;
  float scale_value;
  bool saturate;
  bool vec;
  float* amax;
};

// One vector of a thread: 16 bytes of the source (4 fp32 or 8 fp16/bf16
// elements, one or two Philox groups) and the same elements of the target (4
// to 16 bytes). Lanes take consecutive vectors, so every load and store
// instruction of a warp covers one contiguous span, as torch's own
// vectorized casts do.
template <class Src, class Fmt, int kTileElems = AAMP_SR_ELEMS>
struct Step {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(typename Src::T));
  static constexpr int kGroups = kElems / static_cast<int>(kSroundGroup);
  static constexpr int kOutBytes = kElems * static_cast<int>(sizeof(typename Fmt::T));
  // Vectors in flight per thread: 16 elements (64 or 32 bytes of x; with
  // random_bits, another 64 bytes) per thread and tile.
  static constexpr int kUnroll = kTileElems / kElems;
  using OutVec = typename std::conditional<
      kOutBytes == 16, uint4, typename std::conditional<kOutBytes == 8, uint2, unsigned>::type>::type;
};

// Four resident blocks (1024 threads, 64 registers each) keep 32 to 64 KB of
// loads in flight per SM, enough to cover HBM latency, without spilling.
constexpr int kMinBlocks = AAMP_SR_MIN_BLOCKS;

template <class Src, class Fmt>
__device__ __forceinline__ typename Fmt::T round_one(typename Src::T xv, std::uint32_t r, float s, unsigned s_sign,
                                                     bool saturate, unsigned& amax_bits) {
  const float v = Src::load(xv);
  const unsigned vb = __float_as_uint(v);
  amax_bits = max(amax_bits, vb & 0x7fffffffu);
  // __fmul_rn: a product rounded once, never contracted into anything else.
  return static_cast<typename Fmt::T>(sround_element<Fmt>(__float_as_uint(__fmul_rn(v, s)), vb ^ s_sign, r, saturate));
}

// Block-wide max of the |v| patterns, then one integer atomicMax: exact and
// independent of the order in which blocks arrive.
__device__ __forceinline__ void block_amax(unsigned m, float* amax) {
  __shared__ unsigned s_max[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, s_max[w]);
    if (m != 0) atomicMax(reinterpret_cast<unsigned*>(amax), m);
  }
}

// ---------------------------------------------------------------------------
// The vector loop's fast forms of the rule (sround_rule.h states it; the
// forms below are checked against sround_element over every fp32 pattern).
// Each turns kPack scaled values y (fp32 bits) and their random words into
// one 32-bit word of output and sets `bad` when some value is outside the
// set where the form is exact; the caller then redoes the whole vector with
// sround_element, so specials, overflow and the rare tiny values cost
// nothing on the common path. Outside NaN, the sign of y is the sign the
// contract asks for (sign(x) XOR sign(scale)).
//
// Most forms add the random word's top bits to the fp32 pattern below the
// cut: with F the 32-bit fraction and r the word, F + r carries out of 32
// bits exactly when (low bits of y) + (r >> (32 - drop)) carries out of the
// low `drop` bits, so truncating y + (r >> (32 - drop)) is RZ plus the carry.
// Where the target's ulp is a fixed number of fp32 ulps (its normal range),
// the truncation is a plain conversion toward zero, which the hardware does
// for two elements in one instruction (cvt.rz for fp16; cvt.rn of a value
// already cut to the grid, hence exact, for fp8).

struct FastArgs {
  float hi;  // bf16: |y| above it (or NaN) leaves the fast form
  unsigned two, two9;  // 2 and 2^9 that ptxas cannot fold (see FastInt)
};

// 0 < |y| < lo (2 * |y| - 2 below 2 * lo - 2, unsigned; 0 wraps to the top): the
// nonzero values below the fast form's range. One IMAD and one compare.
__device__ __forceinline__ bool tiny_nonzero(unsigned y, unsigned lo) { return (y << 1) - 2u < (lo << 1) - 2u; }

template <class Fmt, bool kHw>
struct Fast;

// v, as a value the compiler cannot see through. Used (1) on the seed once
// per tile with 16-bit sources, so that the Philox key schedule is added up
// per tile (18 adds shared by the tile's 4 groups) rather than hoisted out of
// the loop into 18 live registers, which spill there (fp32 sources already
// get the per-tile form); (2) on the inputs of the rare exact path, so
// that its subexpressions are not shared with, and computed on, the common
// path.
__device__ __forceinline__ std::uint64_t opaque(std::uint64_t v) {
  asm volatile("" : "+l"(v));
  return v;
}
__device__ __forceinline__ uint4 opaque(uint4 v) {
  asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w));
  return v;
}

// bf16 has fp32's exponent range: the cut is the same at every |y| (fp32
// subnormals included), and with the sign bit left in place the top half of
// y + (r >> 16) is the whole result. Exact for every |y| <= hi (inf included
// unless saturating); only NaN and, with saturate, |y| > max leave.
template <bool kHw>
struct Fast<SrBF16, kHw> {
  static constexpr int kPack = 2;
  __device__ static unsigned word(const unsigned (&y)[2], const std::uint32_t (&r)[2], const FastArgs& fa, bool& bad) {
    bad |= !(fabsf(__uint_as_float(y[0])) <= fa.hi) | !(fabsf(__uint_as_float(y[1])) <= fa.hi);
    return __byte_perm(y[0] + (r[0] >> 16), y[1] + (r[1] >> 16), 0x7632);
  }
};

// fp16: y + (r >> 19) converted toward zero, exact on the normal range up to
// the largest finite value (and for +-0: the added bits stay far below the
// smallest subnormal). Subnormal targets, values above 65504 (inf with
// probability f, or saturation) and NaN leave.
template <bool kHw>
struct Fast<SrF16, kHw> {
  static constexpr int kPack = 2;
  __device__ static unsigned word(const unsigned (&y)[2], const std::uint32_t (&r)[2], const FastArgs&, bool& bad) {
    constexpr unsigned kMinNormal = 0x38800000u;  // 2^-14
#pragma unroll
    for (int i = 0; i < 2; ++i) bad |= !(fabsf(__uint_as_float(y[i])) <= 65504.0f) | tiny_nonzero(y[i], kMinNormal);
    const float z0 = __uint_as_float(y[0] + (r[0] >> 19)), z1 = __uint_as_float(y[1] + (r[1] >> 19));
    unsigned out;
    asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(z1), "f"(z0));
    return out;
  }
};

// Packs four magnitude patterns (< 0x80) with the signs of their y.
__device__ __forceinline__ unsigned pack_fp8(const unsigned (&t)[4], const unsigned (&y)[4]) {
  const unsigned mag = __byte_perm(__byte_perm(t[0], t[1], 0x0040), __byte_perm(t[2], t[3], 0x0040), 0x5410);
  const unsigned sgn = __byte_perm(__byte_perm(y[0], y[1], 0x0073), __byte_perm(y[2], y[3], 0x0073), 0x5410);
  return mag | (sgn & 0x80808080u);
}

// Each device pass uses one of the two e5m2 forms below (sm_89+ the
// conversion, older GPUs the integer form); the other is compiled but not
// referenced there, which is expected, not a warning.
#pragma nv_diag_suppress 177
// fp8 in integers (sround_magnitude_fast_na): exact for every |y| from 2^-17
// (e4m3) / 2^-24 (e5m2) up to the largest finite value, subnormal targets
// included, and for +-0. e4m3's subnormals are common in practice (|y| <
// 2^-6), so this form serves e4m3 everywhere, and e5m2 where the GPU has no
// fp8 conversion. Overflow leaves too (the exact rule clamps it), so no clamp
// here.
//
// This form saturates the ALU pipe (Philox's XORs run there too), so two of
// its steps are written as integer multiply-adds, which run on the FMA pipe:
// 2|y| - 2 of the tiny test and the exponent step mi = (na >> 23) + kMiOff,
// the high word of na * 2^9 (fp32 -> e4m3 on an H200: 1.236x -> 1.217x the
// time of .to(), every fp32 pattern bitwise unchanged).
template <class Fmt>
struct FastInt {
  static constexpr int kPack = 4;
  using K = SroundFast<Fmt>;
  // |y| pattern of the largest finite value: RZ plus carry stays within it.
  static constexpr unsigned kMaxBits =
      (Fmt::kMax << (23 - Fmt::kMant)) + (static_cast<unsigned>(127 - Fmt::kBias) << 23);
  __device__ static unsigned word(const unsigned (&y)[4], const std::uint32_t (&r)[4], const FastArgs& fa, bool& bad) {
    unsigned t[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned na = ~y[i] & 0x7fffffffu;  // 0x7fffffff - |y|
      // Overflow, inf or NaN; or 0 < |y| < kLo (2|y| - 2 below 2 kLo - 2, unsigned; +-0 wrap to the top).
      bad |= (na < 0x7fffffffu - kMaxBits) | (imad(y[i], fa.two, ~1u) < (K::kLo << 1) - 2u);
      const int mi = static_cast<int>(imad_hi(na, fa.two9, static_cast<unsigned>(K::kMiOff)));
      t[i] = sround_magnitude_fast_na<Fmt>(na, mi, r[i]);
    }
    return pack_fp8(t, y);
  }
};

template <bool kHw>
struct Fast<SrE4M3, kHw> : FastInt<SrE4M3> {};

// e5m2 with an fp8 conversion (sm_89+): y + (r >> 11) cut to the e5m2 grid
// (low 21 bits cleared) is exactly representable, so the round-to-nearest
// conversion returns it; normal range up to 57344 and +-0, as fp16 above.
template <bool kHw>
struct Fast<SrE5M2, kHw> : FastInt<SrE5M2> {};
template <>
struct Fast<SrE5M2, true> {
  static constexpr int kPack = 4;
  __device__ static unsigned word(const unsigned (&y)[4], const std::uint32_t (&r)[4], const FastArgs&, bool& bad) {
    constexpr unsigned kMinNormal = 0x38800000u;  // 2^-14
    float z[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      bad |= !(fabsf(__uint_as_float(y[i])) <= 57344.0f) | tiny_nonzero(y[i], kMinNormal);
      z[i] = __uint_as_float((y[i] + (r[i] >> 11)) & ~0x1fffffu);
    }
    unsigned out;
    asm("{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e5m2x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e5m2x2.f32 hi, %4, %3;\n\t"
        "mov.b32 %0, {lo, hi};\n\t}"
        : "=r"(out) : "f"(z[0]), "f"(z[1]), "f"(z[2]), "f"(z[3]));
    return out;
  }
};

#pragma nv_diag_default 177

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kHasFp8Cvt = true;
#else
constexpr bool kHasFp8Cvt = false;
#endif

// The kUnroll vectors base, base + kThreads, ... of one thread: all loads
// first (16 elements and their random words in flight), then the rounding.
template <class Src, class Fmt, bool kBits, bool kAmax, bool kCheck, int kTileElems>
__device__ __forceinline__ void vector_tile(const uint4* __restrict__ xv, const uint4* __restrict__ rv,
                                            typename Step<Src, Fmt, kTileElems>::OutVec* __restrict__ ov,
                                            std::int64_t base,
                                            std::int64_t nvec, std::uint64_t seed, std::uint64_t offset, float s,
                                            unsigned s_sign, bool saturate, const FastArgs& fa, unsigned& amax_bits) {
  using St = Step<Src, Fmt, kTileElems>;
  using F = Fast<Fmt, kHasFp8Cvt>;
  constexpr int kWords = St::kElems / F::kPack;
  union In {
    uint4 raw;
    typename Src::T e[St::kElems];
  } in[St::kUnroll];
  union Rnd {
    uint4 raw[St::kGroups];
    std::uint32_t w[St::kElems];
  } rnd[kBits ? St::kUnroll : 1];
  if (!kBits && sizeof(typename Src::T) == 2) seed = opaque(seed);
#pragma unroll
  for (int u = 0; u < St::kUnroll; ++u) {
    const std::int64_t v = base + u * kThreads;
    if (!kCheck || v < nvec) {
      in[u].raw = __ldcs(xv + v);
      if (kBits) {
#pragma unroll
        for (int k = 0; k < St::kGroups; ++k) rnd[kBits ? u : 0].raw[k] = __ldcs(rv + v * St::kGroups + k);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < St::kUnroll; ++u) {
    const std::int64_t v = base + u * kThreads;
    if (!kCheck || v < nvec) {
      Rnd& r = rnd[kBits ? u : 0];
      if (!kBits && sizeof(typename Src::T) == 2 && u > 0) seed = opaque(seed);
      if (!kBits) {
#pragma unroll
        for (int k = 0; k < St::kGroups; ++k) {
          const PhiloxBits w = philox_group(seed, offset, static_cast<std::uint64_t>(v * St::kGroups + k));
          r.raw[k] = make_uint4(w.w[0], w.w[1], w.w[2], w.w[3]);
        }
      }
      union {
        typename St::OutVec raw;
        unsigned word[kWords];
      } res;
      bool bad = false;
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        unsigned y[F::kPack];
        std::uint32_t rw[F::kPack];
#pragma unroll
        for (int i = 0; i < F::kPack; ++i) {
          const float xval = Src::load(in[u].e[w * F::kPack + i]);
          if (kAmax) amax_bits = max(amax_bits, __float_as_uint(xval) & 0x7fffffffu);
          y[i] = __float_as_uint(__fmul_rn(xval, s));
          rw[i] = r.w[w * F::kPack + i];
        }
        res.word[w] = F::word(y, rw, fa, bad);
      }
      if (bad) {  // rare: a special, an overflow or a tiny value somewhere in the vector
        // Whole words, built by shifts: writing single bytes or halves of
        // `res` would make the compiler split every word on the common path.
        constexpr int kPer = 4 / static_cast<int>(sizeof(typename Fmt::T));
        unsigned unused = 0;
        In xin;
        xin.raw = opaque(in[u].raw);
#pragma unroll
        for (int w = 0; w < St::kElems / kPer; ++w) {
          unsigned word = 0;
#pragma unroll
          for (int i = 0; i < kPer; ++i) {
            const int e = w * kPer + i;
            const unsigned t = round_one<Src, Fmt>(xin.e[e], r.w[e], s, s_sign, saturate, unused);
            word |= t << (8 * static_cast<int>(sizeof(typename Fmt::T)) * i);
          }
          res.word[w] = word;
        }
      }
      __stcs(ov + v, res.raw);
    }
  }
}

template <class Src, class Fmt, bool kBits, bool kAmax, int kBlocks, int kTileElems>
__global__ void __launch_bounds__(kThreads, kBlocks) sround_kernel(const KernelParams p) {
  using S = typename Src::T;
  using D = typename Fmt::T;
  using St = Step<Src, Fmt, kTileElems>;
  using OutVec = typename St::OutVec;
  std::uint64_t seed = p.seed, offset = p.offset;
  if (!kBits && p.seed_offset != nullptr) {
    seed = p.seed_offset[0];
    offset = p.seed_offset[1];
  }
  const float s = p.scale != nullptr ? *p.scale : p.scale_value;
  const unsigned s_sign = __float_as_uint(s) & 0x80000000u;
  const bool saturate = p.saturate;
  FastArgs fa;
  fa.hi = saturate ? __uint_as_float(SrBF16::kMax << 16) : __uint_as_float(0x7f800000u);
  fa.two = 2u + runtime_zero(p.n);
  fa.two9 = 512u + runtime_zero(p.n);
  const S* __restrict__ x = static_cast<const S*>(p.x);
  D* __restrict__ out = static_cast<D*>(p.out);
  const std::uint32_t* __restrict__ bits = p.bits;
  unsigned amax_bits = 0;

  std::int64_t first_group = 0;
  if (p.vec) {
    const std::int64_t nvec = p.n / St::kElems;
    const uint4* __restrict__ xv = reinterpret_cast<const uint4*>(x);
    const uint4* __restrict__ rv = reinterpret_cast<const uint4*>(bits);
    OutVec* __restrict__ ov = reinterpret_cast<OutVec*>(out);
    const std::int64_t tile = static_cast<std::int64_t>(kThreads) * St::kUnroll;
    std::int64_t base = blockIdx.x * tile + threadIdx.x;
    // Whole tiles need no bounds checks; the last one, if partial, does.
    for (; base + (St::kUnroll - 1) * kThreads < nvec; base += gridDim.x * tile) {
      vector_tile<Src, Fmt, kBits, kAmax, false, kTileElems>(xv, rv, ov, base, nvec, seed, offset, s, s_sign, saturate, fa,
                                                 amax_bits);
    }
    if (base < nvec) {
      vector_tile<Src, Fmt, kBits, kAmax, true, kTileElems>(xv, rv, ov, base, nvec, seed, offset, s, s_sign, saturate, fa,
                                                amax_bits);
    }
    first_group = nvec * St::kGroups;
  }

  // Scalar path (unaligned data, and the tail): one Philox group per step.
  const std::int64_t groups = (p.n + kSroundGroup - 1) / kSroundGroup;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  for (std::int64_t g = first_group + static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < groups;
       g += stride) {
    PhiloxBits w = {{0u, 0u, 0u, 0u}};
    if (!kBits) w = philox_group(seed, offset, static_cast<std::uint64_t>(g));
#pragma unroll
    for (int k = 0; k < static_cast<int>(kSroundGroup); ++k) {
      const std::int64_t i = g * kSroundGroup + k;
      if (i < p.n) out[i] = round_one<Src, Fmt>(x[i], kBits ? bits[i] : w.w[k], s, s_sign, saturate, amax_bits);
    }
  }

  if (kAmax) block_amax(amax_bits, p.amax);
}

bool aligned(const void* ptr, unsigned bytes) { return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0; }

template <class Src, class Fmt, bool kBits, bool kAmax, int kBlocks = kMinBlocks, int kTileElems = AAMP_SR_ELEMS>
void launch(const KernelParams& p, cudaStream_t stream, int device) {
  auto kernel = sround_kernel<Src, Fmt, kBits, kAmax, kBlocks, kTileElems>;
  // Resident blocks per SM of this kernel, asked once per device.
  static std::atomic<int> resident[64];
  int blocks_per_sm = device < 64 ? resident[device].load(std::memory_order_relaxed) : 0;
  if (blocks_per_sm == 0) {
    AAMP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kThreads, 0));
    blocks_per_sm = std::max(blocks_per_sm, 1);
    if (device < 64) resident[device].store(blocks_per_sm, std::memory_order_relaxed);
  }
  using St = Step<Src, Fmt, kTileElems>;
  const std::int64_t groups = (p.n + kSroundGroup - 1) / kSroundGroup;
  const std::int64_t tail = p.vec ? groups - (p.n / St::kElems) * St::kGroups : groups;
  const std::int64_t units = std::max<std::int64_t>(p.vec ? (p.n / St::kElems + St::kUnroll - 1) / St::kUnroll : 0, tail);
  const std::int64_t wanted = (units + kThreads - 1) / kThreads;
  // Several waves of blocks, each striding over its share: a single resident wave left the DRAM queue
  // short at every block's start and end (measured on an H200, 256M fp32 elements, graph replay:
  // 1 -> 32 waves took bf16 from 1.12x to 1.02x the time of .to(), e5m2 1.13x -> 1.06x; e4m3's
  // 2-blocks-per-SM kernel was best at 8 waves, 1.28x -> 1.24x; uncapped grids were slower for fp8).
  const std::int64_t waves = std::is_same<Fmt, SrE4M3>::value ? 8 : 32;
  const std::int64_t cap = static_cast<std::int64_t>(multiprocessor_count(device)) * blocks_per_sm * waves;
  const unsigned grid = static_cast<unsigned>(std::max<std::int64_t>(1, std::min(wanted, cap)));
  kernel<<<grid, kThreads, 0, stream>>>(p);
  AAMP_CUDA_CHECK_LAUNCH("sround_kernel");
}

template <class Src, class Fmt, int kBlocks = kMinBlocks, int kTileElems = AAMP_SR_ELEMS>
void launch_bits(const KernelParams& p, bool bits, cudaStream_t stream, int device) {
  // amax is a template argument: without it the vector loop has no max to keep.
  if (p.amax != nullptr) {
    bits ? launch<Src, Fmt, true, true, kBlocks, kTileElems>(p, stream, device)
         : launch<Src, Fmt, false, true, kBlocks, kTileElems>(p, stream, device);
  } else {
    bits ? launch<Src, Fmt, true, false, kBlocks, kTileElems>(p, stream, device)
         : launch<Src, Fmt, false, false, kBlocks, kTileElems>(p, stream, device);
  }
}

// fp32 -> e4m3 with its own register budget and tile (see the knobs at the
// top); other sources keep the defaults.
template <class Src>
void launch_e4m3(const KernelParams& p, bool bits, cudaStream_t stream, int device) {
  if constexpr (std::is_same<Src, SrcF32>::value) {
    launch_bits<Src, SrE4M3, 2, 32>(p, bits, stream, device);
  } else {
    launch_bits<Src, SrE4M3>(p, bits, stream, device);
  }
}

template <class Src>
void launch_target(const KernelParams& p, DType target, bool bits, cudaStream_t stream, int device) {
  switch (target) {
    case DType::kBFloat16: return launch_bits<Src, SrBF16>(p, bits, stream, device);
    case DType::kFloat16: return launch_bits<Src, SrF16>(p, bits, stream, device);
    case DType::kFloat8E4M3FN: return launch_e4m3<Src>(p, bits, stream, device);
    case DType::kFloat8E5M2: return launch_bits<Src, SrE5M2>(p, bits, stream, device);
    default: return;  // rejected by validate_sround
  }
}

}  // namespace

void stochastic_round_cuda(const SroundArgs& a) {
  DeviceGuard guard(a.place.device);
  cudaStream_t stream = as_stream(a.place.stream);
  if (a.amax != nullptr) AAMP_CUDA_CHECK(cudaMemsetAsync(a.amax, 0, sizeof(float), stream));
  if (a.x.numel == 0) return;
  KernelParams p;
  p.x = a.x.data;
  p.out = a.out.data;
  p.bits = a.has_random_bits ? static_cast<const std::uint32_t*>(a.random_bits.data) : nullptr;
  p.n = a.x.numel;
  p.seed = a.seed;
  p.offset = a.offset;
  p.seed_offset = a.seed_offset;
  p.scale = a.scale;
  p.scale_value = a.has_scale_value ? a.scale_value : 1.0f;
  p.saturate = a.saturate;
  p.amax = a.amax;
  // The vector path needs x and random_bits on 16 bytes and out on the
  // bytes of one output vector (4 to 16; see Step).
  const unsigned out_vec = 16u / static_cast<unsigned>(dtype_size(a.x.dtype)) *
                           static_cast<unsigned>(dtype_size(a.out.dtype));
  p.vec = aligned(p.x, 16) && aligned(p.out, out_vec) && (!a.has_random_bits || aligned(p.bits, 16));
  switch (a.x.dtype) {
    case DType::kFloat32: return launch_target<SrcF32>(p, a.out.dtype, a.has_random_bits, stream, a.place.device);
    case DType::kFloat16: return launch_target<SrcF16>(p, a.out.dtype, a.has_random_bits, stream, a.place.device);
    case DType::kBFloat16: return launch_target<SrcBF16>(p, a.out.dtype, a.has_random_bits, stream, a.place.device);
    default: return;  // rejected by validate_sround
  }
}

}  // namespace aamp
