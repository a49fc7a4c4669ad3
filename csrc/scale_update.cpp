// Validation and dispatch of the loss-scale update (contract in scale_update.h).
#include "scale_update.h"

#include <string>

namespace aamp {

namespace {

constexpr float kFloatMax = 3.4028234663852886e38f;

void validate(const ScaleUpdateArgs& a) {
  if (a.scale == nullptr) throw_argument("scale", "is a null pointer; pass a 1-element float32 tensor");
  if (a.growth_tracker == nullptr) {
    throw_argument("growth_tracker", "is a null pointer; pass a 1-element int32 tensor");
  }
  if (a.found_inf == nullptr) throw_argument("found_inf", "is a null pointer; pass a 1-element float32 tensor");
  if (a.counters == nullptr) throw_argument("counters", "is a null pointer; pass a 4-element int32 tensor");
  if (!(a.growth_factor > 1.0)) throw_argument("growth_factor", "must be > 1.0, got " + std::to_string(a.growth_factor));
  if (!(a.backoff_factor > 0.0 && a.backoff_factor < 1.0)) {
    throw_argument("backoff_factor", "must be in (0, 1), got " + std::to_string(a.backoff_factor));
  }
  // growth_interval: any value, as torch (growth happens when the count of
  // clean steps equals it, so 0 or a negative value means "never grow").
  if (a.hysteresis < 1) throw_argument("hysteresis", "must be >= 1 (1 backs off at every overflow, as torch)");
  if (!(a.min_scale >= 0.0f && a.min_scale <= kFloatMax)) throw_argument("min_scale", "must be finite and >= 0");
  if (!(a.max_scale >= 0.0f && a.max_scale <= kFloatMax)) {
    throw_argument("max_scale", "must be finite and > 0 (0 means no upper bound)");
  }
  if (a.max_scale != 0.0f && !(a.max_scale >= a.min_scale)) throw_argument("max_scale", "must be >= min_scale");
  if (a.predictive) {
    if (a.step_amax == nullptr) throw_argument("step_amax", "is needed in predictive mode");
    if (a.amax_history == nullptr || a.history < 1) {
      throw_argument("amax_history", "is needed in predictive mode (at least one entry)");
    }
    if (!(a.fmt_max > 0.0f && a.fmt_max <= kFloatMax)) {
      throw_argument("fmt_max", "must be finite and > 0 (65504 for float16)");
    }
  }
  // Every output is written by the same step; one aliasing another would
  // overwrite it (and found_inf and step_amax are read after writes begin).
  const std::size_t history_bytes = a.predictive ? static_cast<std::size_t>(a.history) * 4 : 0;
  check_disjoint({{a.scale, 4, "scale"},
                  {a.growth_tracker, 4, "growth_tracker"},
                  {a.counters, 16, "counters"},
                  {a.inv_scale, 4, "inv_scale"},
                  {a.predictive ? a.amax_history : nullptr, history_bytes, "amax_history"},
                  {a.found_inf, 4, "found_inf"},
                  {a.predictive ? a.step_amax : nullptr, 4, "step_amax"}});
  if (a.place.is_cuda() && !cuda_built()) {
    throw CudaError("scale: a CUDA tensor was given, but adaptive_amp was built without CUDA kernels");
  }
}

}  // namespace

void update_scale(const ScaleUpdateArgs& a) {
  validate(a);
#ifdef AAMP_WITH_CUDA
  if (a.place.is_cuda()) return update_scale_cuda(a);
#endif
  update_scale_rule(a);
}

}  // namespace aamp
