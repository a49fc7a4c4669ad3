// The per-element rules of the fused optimizers (stated in optim.h), written
// once for the host and the device so that the CPU and CUDA kernels agree
// bit for bit by construction. Every fp32 operation goes through one of the
// helpers below: on the device they are the _rn intrinsics, which the
// compiler never contracts into FMAs; on the host plain operators, built
// with -ffp-contract=off (setup.py) for the same reason.
#pragma once

#include <cmath>
#include <cstdint>

#include "optim.h"
#include "float_bits.h"
#include "host_device.h"
#include "philox.h"
#include "sround_rule.h"

namespace aamp {
namespace optim_rule {

AAMP_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
AAMP_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
AAMP_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
AAMP_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
AAMP_HD float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// What one call shares across elements: the contract's constants and flags.
struct Scalars {
  OptimConsts c;
  float grad_scale;    // 1 when none (then unused)
  bool has_grad_scale;
  bool maximize;
  bool wd;             // weight_decay != 0
  bool momentum;       // SGD: momentum != 0
  bool nesterov;
};

// The gradient as both optimizers see it.
AAMP_HD float grad_in(float g, const Scalars& s) {
  if (s.has_grad_scale) g = div(g, s.grad_scale);
  return s.maximize ? -g : g;
}

// AdamW on one element: p, m, v updated in place (fp32).
AAMP_HD void adamw(float& p, float& m, float& v, float g, float step_size, float bc2_sqrt, const Scalars& s) {
  if (s.wd) p = sub(p, mul(s.c.lr_wd, p));
  m = add(mul(s.c.beta1, m), mul(s.c.omb1, g));
  v = add(mul(s.c.beta2, v), mul(s.c.omb2, mul(g, g)));
  const float denom = add(div(sqrt(v), bc2_sqrt), s.c.eps);
  p = sub(p, div(mul(step_size, m), denom));
}

// SGD on one element: p (and buf with momentum) updated in place (fp32).
AAMP_HD void sgd(float& p, float& buf, float g, bool first, const Scalars& s) {
  if (s.wd) g = add(g, mul(s.c.weight_decay, p));
  if (s.momentum) {
    buf = first ? g : add(mul(s.c.momentum, buf), mul(s.c.omd, g));
    g = s.nesterov ? add(g, mul(s.c.momentum, buf)) : buf;
  }
  p = sub(p, mul(s.c.lr, g));
}

// An fp32 value to bf16 bits: stochastic rounding with word r, or round to
// nearest even (NaN quieted, as the hardware conversion does).
AAMP_HD std::uint16_t to_bf16(float y, std::uint32_t r, bool sr) {
  if (!sr) return f32_to_bf16(y);
  const std::uint32_t u = f32_bits(y);
  return static_cast<std::uint16_t>(sround_element<SrBF16>(u, u, r, false));
}

}  // namespace optim_rule
}  // namespace aamp
