// CPU implementation of the statistics family (contract in stats.h).
//
// The same fixed chunks as on the GPU, spread over OpenMP threads; each
// chunk writes its own partial and the per-tensor results are merged in
// chunk order afterwards, so nothing depends on the number of threads.
//
// Inside a chunk, blocks of kBlock elements take a vectorizable fast path that
// assumes what nearly all data satisfy (finite values whose squares neither
// overflow nor underflow fp32, a block's first element near its mean) and sums
// x - first in fp32; a block where that does not hold (fp32_sums_trusted) is
// done again element by element in fp64. Either way the block's (count, mean,
// M2) then merge into the chunk's with Chan's formula; the chunk's partial is
// its mean as the reference, s = 0 and ss = M2.
#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "float_bits.h"
#include "stats.h"
#include "stats_math.h"

namespace aamp {

namespace {

constexpr std::int64_t kBlock = 1024;

using host_elements::BF16;
using host_elements::F16;
using host_elements::F32;

struct Limits {
  std::uint32_t lo, hi, max;  // fp32 bit patterns of FormatLimits
};

// A chunk's moments so far: count, mean and M2 of its finite elements.
struct Moments {
  double n = 0.0, mean = 0.0, m2 = 0.0;

  void add_sums(double count, double pivot, double s, double ss) {
    double block_mean, block_m2;
    moments_from_sums(count, pivot, s, ss, block_mean, block_m2);
    merge_moments(n, mean, m2, count, block_mean, block_m2);
  }
};

// One block on the fast path. Returns false when its result cannot be trusted.
template <class E, bool kFmt>
bool fast_block(const typename E::T* x, std::int64_t n, float pivot, float scale, Limits lim, StatsPartial& p,
                Moments& m) {
  float s = 0.0f, ss = 0.0f;
  unsigned zero = 0, lo = 0, hi = 0, over = 0;
  int mn = INT_MAX, mx = INT_MIN;
  unsigned ak = 0xffffffffu;
#pragma omp simd reduction(+ : s, ss, zero, lo, hi, over) reduction(min : mn, ak) reduction(max : mx)
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = E::load(x[i]);
    const std::uint32_t u = f32_bits(v);
    const int k = order_key(u);
    mn = k < mn ? k : mn;
    mx = k > mx ? k : mx;
    const std::uint32_t a = abs_key(u);
    ak = a < ak ? a : ak;
    zero += (u << 1) == 0 ? 1u : 0u;
    const float d = v - pivot;
    s += d;
    ss += d * d;
    if (kFmt) {
      const std::uint32_t ay = f32_bits(v * scale) & 0x7fffffffu;
      lo += ay <= lim.lo ? 1u : 0u;
      hi += ay < lim.hi ? 1u : 0u;
      over += (ay > lim.max && ay <= 0x7f800000u) ? 1u : 0u;  // inf from the product counts, NaN does not
    }
  }
  const float amax = std::max(std::fabs(key_float(mn)), std::fabs(key_float(mx)));
  if (!fp32_sums_trusted(s, ss, static_cast<double>(n), amax)) return false;
  m.add_sums(static_cast<double>(n), pivot, s, ss);
  p.zero += zero;
  p.at_most_lo += lo;
  p.below_hi += hi;
  p.over += over;
  p.min_key = std::min(p.min_key, mn);
  p.max_key = std::max(p.max_key, mx);
  p.abs_key = std::min(p.abs_key, ak);
  return true;
}

// The same block element by element in fp64, with every special handled.
// Its pivot is its first finite element (the block's first element may not
// be one, and summing |mean| >> std data against 0 would cancel).
template <class E, bool kFmt>
void careful_block(const typename E::T* x, std::int64_t n, float scale, Limits lim, StatsPartial& p, Moments& m) {
  double s = 0.0, ss = 0.0, finite = 0.0;
  float pivot = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = E::load(x[i]);
    const std::uint32_t u = f32_bits(v);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
      ++p.nan;
      continue;
    }
    if (a == 0x7f800000u) {
      ++p.inf;
      continue;
    }
    if (finite == 0.0) pivot = v;
    finite += 1.0;
    p.zero += a == 0 ? 1u : 0u;
    p.min_key = std::min(p.min_key, order_key(u));
    p.max_key = std::max(p.max_key, order_key(u));
    p.abs_key = std::min(p.abs_key, abs_key(u));
    const double d = static_cast<double>(v) - pivot;
    s += d;
    ss += d * d;
    if (kFmt) {
      const std::uint32_t ay = f32_bits(v * scale) & 0x7fffffffu;
      p.at_most_lo += ay <= lim.lo ? 1u : 0u;
      p.below_hi += ay < lim.hi ? 1u : 0u;
      p.over += (ay > lim.max && ay <= 0x7f800000u) ? 1u : 0u;
    }
  }
  m.add_sums(finite, pivot, s, ss);
}

template <class E, bool kFmt>
void run_chunk(const void* data, std::int64_t n, float scale, Limits lim, StatsPartial& p) {
  const auto* x = static_cast<const typename E::T*>(data);
  Moments m;
  for (std::int64_t b = 0; b < n; b += kBlock) {
    const std::int64_t len = std::min(kBlock, n - b);
    const float pivot = stats_pivot(E::load(x[b]));
    if (!fast_block<E, kFmt>(x + b, len, pivot, scale, lim, p, m)) {
      careful_block<E, kFmt>(x + b, len, scale, lim, p, m);
    }
  }
  p.count = static_cast<std::uint32_t>(m.n);
  p.ref = m.mean;
  p.s = 0.0;
  p.ss = m.m2;
}

template <bool kFmt>
void dispatch_chunk(DType t, const void* data, std::int64_t n, float scale, Limits lim, StatsPartial& p) {
  switch (t) {
    case DType::kFloat32: run_chunk<F32, kFmt>(data, n, scale, lim, p); break;
    case DType::kFloat16: run_chunk<F16, kFmt>(data, n, scale, lim, p); break;
    case DType::kBFloat16: run_chunk<BF16, kFmt>(data, n, scale, lim, p); break;
    default: break;  // rejected by validate_stats
  }
}

}  // namespace

void tensor_stats_cpu(const StatsArgs& a) {
  const std::size_t count = a.tensors.size();
  auto* partials = static_cast<StatsPartial*>(a.workspace);
  const FormatLimits fl = format_limits(a.format);
  const Limits lim{f32_bits(fl.lo), f32_bits(fl.hi), f32_bits(fl.max)};

  std::vector<std::int64_t> chunk_begin(count + 1, 0);
  std::vector<float> scale(count, 1.0f);
  std::int64_t elements = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const TensorRef& t = a.tensors[i];
    chunk_begin[i + 1] = chunk_begin[i] + (t.numel + kStatsChunk - 1) / kStatsChunk;
    elements += t.numel;
    if (a.has_scale_value) scale[i] = a.scale_value;
    if (a.scale != nullptr) scale[i] = a.scale[a.scale_per_tensor ? i : 0];
  }
  const std::int64_t total = chunk_begin[count];

  // Below about 64K elements threads cost more than they save.
#pragma omp parallel for schedule(static) if (total > 1 && elements > (1 << 16))
  for (std::int64_t c = 0; c < total; ++c) {
    const std::size_t t = static_cast<std::size_t>(
        std::upper_bound(chunk_begin.begin(), chunk_begin.end(), c) - chunk_begin.begin() - 1);
    const TensorRef& ref = a.tensors[t];
    const std::int64_t offset = (c - chunk_begin[t]) * kStatsChunk;
    const std::int64_t n = std::min(kStatsChunk, ref.numel - offset);
    const void* data = static_cast<const char*>(ref.data) + offset * static_cast<std::int64_t>(dtype_size(ref.dtype));
    StatsPartial p;
    if (a.has_format) {
      dispatch_chunk<true>(ref.dtype, data, n, scale[t], lim, p);
    } else {
      dispatch_chunk<false>(ref.dtype, data, n, scale[t], lim, p);
    }
    partials[c] = p;
  }

  for (std::size_t t = 0; t < count; ++t) {
    const std::int64_t begin = chunk_begin[t], end = chunk_begin[t + 1];
    const auto totals_against = [&](double ref) {
      StatsTotals tot(ref);
      for (std::int64_t c = begin; c < end; ++c) tot.add(partials[c]);
      return tot;
    };
    std::int64_t first = begin;
    while (first < end && partials[first].count == 0) ++first;
    StatsTotals totals = totals_against(first < end ? partial_mean(partials[first]) : 0.0);
    if (totals.needs_second_pass()) totals = totals_against(totals.mean());
    finalize_stats(totals, a.tensors[t].numel, scale[t], a.has_format, a.out + t * kStatFields);
  }
}

}  // namespace aamp
