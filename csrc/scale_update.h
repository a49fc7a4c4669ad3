// Op family: the loss-scale update at the end of a step (one thread of work,
// kept on the device so that a training step needs no host synchronization).
//
// Contract (CPU and CUDA identical):
//
//   found = (*found_inf != 0)        (found_inf may be a sum over optimizers)
//   if found:
//     *skipped += 1; *growth_tracker = 0
//     *hysteresis_left -= 1
//     if *hysteresis_left <= 0:      back off:
//       b = float(double(*scale) * backoff_factor)
//       *scale = b < min_scale ? min_scale : b       (a NaN scale stays NaN, as torch)
//       predictive: *extra_margin += 1
//   else:
//     *growth_tracker += 1
//     if *growth_tracker == growth_interval:
//       *growth_tracker = 0; *hysteresis_left = hysteresis
//       dynamic:    g = float(double(*scale) * growth_factor);
//                   if g is finite: *scale = min(g, max_scale)
//       predictive: *extra_margin = max(*extra_margin - 1, 0)
//     predictive (every clean step):
//       push *step_amax into the ring buffer amax_history (if finite and > 0;
//       a position outside [0, history) restarts at 0)
//       m = max of the finite entries of amax_history
//       if m > 0: k = floor(log2(fmt_max / m)) - margin - *extra_margin, clamped to
//                 [-200, 200] (beyond that the float32 result is 0 or inf anyway);
//                 *scale = clamp(2^k, min_scale, max_scale)
//
//   Every loop is bounded for any input (fmt_max is validated finite and > 0;
//   a non-finite history entry is skipped), so no argument can hang the update.
//
//   With hysteresis == 1, min_scale == 0, max_scale == inf and mode dynamic,
//   this is exactly torch's `_amp_update_scale_` (products in double, rounded
//   to float; growth only to a finite scale).
//
//   Hysteresis follows Megatron-LM's DynamicGradScaler (and DeepSpeed's
//   default, consecutive_hysteresis=False): overflows are counted since the
//   last growth, not only consecutive ones, so a scale that is really too
//   high still comes down while isolated spikes do not halve it.
//
//   counters (int32[4]): hysteresis_left, skipped, history position,
//   extra_margin. amax_history (fp32[history]) and step_amax are used in
//   predictive mode only.
#pragma once

#include <cstdint>

#include "core.h"

namespace aamp {

struct ScaleUpdateArgs {
  float* scale = nullptr;
  std::int32_t* growth_tracker = nullptr;
  const float* found_inf = nullptr;
  std::int32_t* counters = nullptr;  // [hysteresis_left, skipped, history_pos, extra_margin]
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int32_t growth_interval = 2000;
  std::int32_t hysteresis = 1;
  float min_scale = 0.0f;
  float max_scale = 0.0f;  // 0 means no upper bound
  bool predictive = false;
  const float* step_amax = nullptr;
  float* amax_history = nullptr;
  std::int32_t history = 0;
  std::int32_t margin = 0;
  float fmt_max = 65504.0f;
  // Optional: receives float(1 / double(scale)) after the update, the value
  // torch's GradScaler computes for unscaling (so a step needs no kernel for it).
  float* inv_scale = nullptr;
  Place place;
};

void update_scale(const ScaleUpdateArgs& a);  // validates, then dispatches

// The per-step rule on plain values; the CPU path and the CUDA kernel both
// run it, so they cannot drift apart.
#ifdef __CUDACC__
#define AAMP_HOST_DEVICE __host__ __device__
#else
#define AAMP_HOST_DEVICE
#endif

AAMP_HOST_DEVICE inline void update_scale_step(const ScaleUpdateArgs& a) {
  std::int32_t* c = a.counters;
  const bool found = *a.found_inf != 0.0f;
  const float upper = a.max_scale > 0.0f ? a.max_scale : 3.4028234663852886e38f;
  if (found) {
    c[1] += 1;
    *a.growth_tracker = 0;
    c[0] -= 1;
    if (c[0] <= 0) {
      const float backed = static_cast<float>(static_cast<double>(*a.scale) * a.backoff_factor);
      // Written so that NaN passes through: a NaN scale stays NaN (torch keeps
      // it, and every following step is skipped) instead of becoming min_scale.
      *a.scale = backed < a.min_scale ? a.min_scale : backed;
      if (a.predictive) c[3] += 1;
    }
    return;
  }
  const std::int32_t successful = *a.growth_tracker + 1;
  if (successful == a.growth_interval) {
    *a.growth_tracker = 0;
    c[0] = a.hysteresis;
    if (a.predictive) {
      c[3] = c[3] > 0 ? c[3] - 1 : 0;
    } else {
      const float grown = static_cast<float>(static_cast<double>(*a.scale) * a.growth_factor);
      const bool finite = grown - grown == 0.0f;  // false for inf and NaN
      if (finite) *a.scale = grown < upper ? grown : upper;
    }
  } else {
    *a.growth_tracker = successful;
  }
  if (a.predictive && a.history > 0) {
    const float amax = *a.step_amax;
    if (amax > 0.0f && amax - amax == 0.0f) {
      // The position lives in device memory the host never checked: a value
      // out of range (a hand-edited counters tensor) restarts the ring.
      if (c[2] < 0 || c[2] >= a.history) c[2] = 0;
      a.amax_history[c[2]] = amax;
      c[2] = c[2] + 1 == a.history ? 0 : c[2] + 1;
    }
    float m = 0.0f;
    for (std::int32_t i = 0; i < a.history; ++i) {
      const float v = a.amax_history[i];
      if (v - v == 0.0f && v > m) m = v;  // finite entries only (inf would make q = 0 below)
    }
    // 2^(floor(log2(fmt_max / m)) - margin - extra), exactly, by exponent arithmetic.
    // q is finite and > 0 here (fmt_max finite, m finite and > 0), so the two
    // normalising loops end within ~1100 iterations; k is clamped so the last
    // loops run at most 200 times.
    const double q0 = m > 0.0f ? static_cast<double>(a.fmt_max) / m : 0.0;
    if (q0 > 0.0 && q0 - q0 == 0.0) {
      int e = 0;
      double q = q0;
      while (q >= 2.0) { q *= 0.5; ++e; }
      while (q < 1.0) { q *= 2.0; --e; }
      long long k = static_cast<long long>(e) - a.margin - c[3];
      k = k < -200 ? -200 : (k > 200 ? 200 : k);
      double s = 1.0;
      for (; k > 0; --k) s *= 2.0;
      for (; k < 0; ++k) s *= 0.5;
      float target = static_cast<float>(s);
      target = target < a.min_scale ? a.min_scale : target;
      *a.scale = target < upper ? target : upper;
    }
  }
}

AAMP_HOST_DEVICE inline void update_scale_rule(const ScaleUpdateArgs& a) {
  update_scale_step(a);
  if (a.inv_scale != nullptr) *a.inv_scale = static_cast<float>(1.0 / static_cast<double>(*a.scale));
}

void update_scale_cuda(const ScaleUpdateArgs& a);

}  // namespace aamp
