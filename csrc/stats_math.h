// The arithmetic the CPU and CUDA statistics share: format thresholds, the
// integer keys extrema reduce in, the merge of partials and the final
// formulas. Host and device code; no CUDA headers needed.
#pragma once

#include <cmath>
#include <cstdint>

#include "core.h"
#include "host_device.h"
#include "stats.h"

namespace aamp {

// Where |y| (an fp32 value) lands in a format under round-to-nearest-even:
//   |y| <= lo           rounds to zero       (lo = half the smallest subnormal: the tie goes to even, zero)
//   lo < |y| < hi       a nonzero subnormal  (hi = smallest normal - half a subnormal step: the tie goes
//                                             to the smallest normal, whose mantissa is even)
//   |y| > max           above the largest finite value
// Every threshold is exact in fp32, so fp32 comparisons decide exactly.
struct FormatLimits {
  float lo;
  float hi;
  float max;
};

inline FormatLimits format_limits(DType f) {
  switch (f) {
    case DType::kBFloat16: return {0x1p-134f, 0x1p-126f - 0x1p-134f, 0x1.fep127f};
    case DType::kFloat8E4M3FN: return {0x1p-10f, 0x1p-6f - 0x1p-10f, 448.0f};
    case DType::kFloat8E5M2: return {0x1p-17f, 0x1p-14f - 0x1p-17f, 57344.0f};
    case DType::kFloat16:
    default: return {0x1p-25f, 0x1p-14f - 0x1p-25f, 65504.0f};
  }
}

// A signed integer that orders like the float (-0 < +0); an involution.
AAMP_HD std::int32_t order_key(std::uint32_t bits) {
  const std::int32_t i = static_cast<std::int32_t>(bits);
  return i ^ ((i >> 31) & 0x7fffffff);
}
AAMP_HD float key_float(std::int32_t key) { return f32_from_bits(static_cast<std::uint32_t>(order_key(static_cast<std::uint32_t>(key)))); }

// 2*|x|bits - 2 as unsigned: monotone in |x| for nonzero x; +-0 wrap to 0xfffffffe.
AAMP_HD std::uint32_t abs_key(std::uint32_t bits) { return (bits << 1) - 2u; }
constexpr std::uint32_t kNoAbsKey = 0xfffffffeu;  // keys at or above: no nonzero finite value

// Chan et al.'s merge of (count, mean, M2) b into a; a fixed formula, so a
// fixed merge order gives bitwise fixed results.
AAMP_HD void merge_moments(double& n_a, double& mean_a, double& m2_a, double n_b, double mean_b, double m2_b) {
  if (n_b == 0.0) return;
  const double n = n_a + n_b;
  const double delta = mean_b - mean_a;
  const double w = n_b / n;
  mean_a += delta * w;
  m2_a += m2_b + delta * delta * n_a * w;
  n_a = n;
}

// A group's (count, mean, M2) from sums of d = x - pivot.
AAMP_HD void moments_from_sums(double n, double pivot, double s, double ss, double& mean, double& m2) {
  if (n == 0.0) {
    mean = 0.0;
    m2 = 0.0;
    return;
  }
  const double shift = s / n;
  mean = pivot + shift;
  m2 = ss - s * shift;
  m2 = m2 > 0.0 ? m2 : 0.0;
}

// Whether fp32 sums s, ss of the d = x - pivot of a group (all finite, amax
// its largest |x|) are accurate: no overflow or NaN, squares far from the
// fp32 subnormal range, and little cancellation in M2 = ss - s^2/n (the pivot
// within a few standard deviations of the group's mean; a group whose pivot is an
// outlier is summed again in fp64). ss <= C * M2 is tested as
// C * s^2 <= (C - 1) * ss * n, without a division (products of fp32 values
// and a count, exact enough in fp64 for a threshold).
constexpr float kStatsTinyAmax = 0x1p-30f;
constexpr double kStatsMaxCancellation = 16.0;
AAMP_HD bool fp32_sums_trusted(float s, float ss, double n, float amax) {
  if (!(ss <= 3.0e38f)) return false;  // inf or NaN
  if (amax > 0.0f && amax < kStatsTinyAmax) return false;
  if (ss == 0.0f || n == 0.0) return true;
  const double sd = s;
  return kStatsMaxCancellation * sd * sd <= (kStatsMaxCancellation - 1.0) * static_cast<double>(ss) * n;
}

// The mean of a partial's finite elements (0 without any).
AAMP_HD double partial_mean(const StatsPartial& p) {
  return p.count > 0 ? p.ref + p.s / static_cast<double>(p.count) : 0.0;
}

// The reduction of partials of one tensor. Moments are kept as sums against
// one reference point for the whole tensor (the mean of its first partial
// with a finite element), so partials merge by a shift and additions, and
// totals by additions alone: no division per merge, as Chan's formula would
// need at every step of a reduction tree.
struct StatsTotals {
  double ref = 0.0;
  double n = 0.0, s = 0.0, ss = 0.0;  // count, sum(x - ref), sum((x - ref)^2) over the finite x
  unsigned long long zero = 0, nan = 0, inf = 0, at_most_lo = 0, below_hi = 0, over = 0;
  std::int32_t min_key = 0x7fffffff, max_key = static_cast<std::int32_t>(0x80000000u);
  std::uint32_t abs_key = 0xffffffffu;

  StatsTotals() = default;
  AAMP_HD explicit StatsTotals(double reference) : ref(reference) {}

  AAMP_HD void add(const StatsPartial& p) {
    // sum((x - ref)^2) = ss_p + 2 d s_p + c d^2 with d = ref_p - ref.
    const double c = static_cast<double>(p.count);
    const double d = p.ref - ref;
    n += c;
    s += fma(c, d, p.s);
    ss += fma(d, fma(c, d, 2.0 * p.s), p.ss);
    add_counts(p);
  }

  // o must have the same reference.
  AAMP_HD void add(const StatsTotals& o) {
    n += o.n;
    s += o.s;
    ss += o.ss;
    add_counts(o);
  }

  AAMP_HD double mean() const { return ref + s / n; }
  AAMP_HD double m2() const {
    const double m = ss - s * (s / n);
    return m > 0.0 ? m : 0.0;
  }

  // Whether M2 = ss - s^2/n cancelled more than kStatsMaxMergeCancellation
  // (the reference far from the mean: a first counted partial of a few
  // finite outliers). The partials are then added again against mean().
  AAMP_HD bool needs_second_pass() const;

 private:
  template <class P>
  AAMP_HD void add_counts(const P& p) {
    zero += p.zero;
    nan += p.nan;
    inf += p.inf;
    at_most_lo += p.at_most_lo;
    below_hi += p.below_hi;
    over += p.over;
    min_key = min_key < p.min_key ? min_key : p.min_key;
    max_key = max_key > p.max_key ? max_key : p.max_key;
    abs_key = abs_key < p.abs_key ? abs_key : p.abs_key;
  }
};

// ss may exceed M2 by this factor before the merge is redone against the
// mean: it costs about log2 of it in bits of M2 (16 of fp64's 52).
constexpr double kStatsMaxMergeCancellation = 65536.0;

AAMP_HD bool StatsTotals::needs_second_pass() const {
  if (n == 0.0 || ss == 0.0) return false;
  return !(ss <= kStatsMaxMergeCancellation * m2());  // also true for a NaN or inf ss
}

// The pivot of a group: one of its elements when finite, else 0.
AAMP_HD float stats_pivot(float x) { return (f32_bits(x) & 0x7fffffffu) < 0x7f800000u ? x : 0.0f; }

// The statistics of one tensor from its totals, into out[0 .. kStatFields).
AAMP_HD void finalize_stats(const StatsTotals& t, long long numel, float scale, bool has_format, double* out) {
  const double nan = NAN;
  const double n = t.n;
  out[kStatNumel] = static_cast<double>(numel);
  out[kStatNanCount] = static_cast<double>(t.nan);
  out[kStatInfCount] = static_cast<double>(t.inf);
  out[kStatZeroCount] = static_cast<double>(t.zero);
  double mn = nan, mx = nan, amax = nan, mean = nan, sd = nan, l2 = nan, man = nan, range = nan;
  if (n > 0.0) {
    mn = key_float(t.min_key);
    mx = key_float(t.max_key);
    amax = fabs(mn) > fabs(mx) ? fabs(mn) : fabs(mx);
    mean = t.mean();
    const double m2 = t.m2();
    if (n > 1.0) sd = sqrt(m2 / (n - 1.0));
    l2 = sqrt(m2 + n * mean * mean);
    if (t.abs_key < kNoAbsKey) {
      man = f32_from_bits((t.abs_key >> 1) + 1u);
      range = log2(amax / man);
    }
  }
  out[kStatMin] = mn;
  out[kStatMax] = mx;
  out[kStatAmax] = amax;
  out[kStatMinAbsNonzero] = man;
  out[kStatMean] = mean;
  out[kStatStd] = sd;
  out[kStatL2Norm] = l2;
  out[kStatDynamicRange] = range;
  double over = 0.0, under = 0.0, sub = 0.0;
  if (has_format) {
    over = static_cast<double>(t.over);
    // Zeros are at most lo (0 * s == 0); a zero or non-finite scale underflows nothing.
    const bool scaled = scale != 0.0f && (f32_bits(scale) & 0x7fffffffu) < 0x7f800000u;
    under = scaled ? static_cast<double>(t.at_most_lo - t.zero) : 0.0;
    sub = static_cast<double>(t.below_hi - t.at_most_lo);
  }
  out[kStatOverflowCount] = over;
  out[kStatUnderflowCount] = under;
  out[kStatSubnormalCount] = sub;
}

}  // namespace aamp
