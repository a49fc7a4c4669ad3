// Op family: fused optimizer steps (AdamW, SGD with momentum) for pure-bf16
// training: fp32 arithmetic, parameters written back with stochastic rounding.
//
// Contract (CPU and CUDA implementations give bitwise the same results):
//
//   One call updates one list of parameters that share the hyperparameters
//   (one torch param group on one device). Nothing is written at all when
//   *found_inf != 0 but the NaNs of grad_sumsq (the step is skipped; the caller keeps torch's step
//   counter convention by undoing its increment). Otherwise, for every
//   tensor k of the list and every element i, in fp32 with every operation
//   rounded once to nearest even, in exactly this order (no FMA contraction):
//
//     g = float(grad[i]);  if grad_scale: g = g / *grad_scale;  if maximize: g = -g
//     p = float(param[i])
//
//   AdamW (t = *steps[k] + 1, the count of this step: the caller increments
//   steps[k] after the call, and undoes that where found_inf is set, as torch's
//   fused AdamW does; the kernel only reads steps, so a refused call changes nothing):
//     if weight_decay != 0:  p = p - lr_wd * p
//     m = beta1 * m + omb1 * g
//     v = beta2 * v + omb2 * (g * g)
//     step_size = lr / bc1
//     denom = sqrt(v) / bc2_sqrt + eps
//     p = p - (step_size * m) / denom
//   with host constants rounded once to fp32 from double: lr, beta1, beta2,
//   eps, lr_wd = lr * weight_decay, omb1 = 1 - beta1, omb2 = 1 - beta2; and
//   per tensor, from t (an integer-valued float): b^t by binary
//   exponentiation in double (result *= b for each set bit of t from the
//   lowest, b *= b between bits; every product rounded once), then
//   bc1 = fp32(1 - beta1^t), bc2_sqrt = fp32(sqrt(1 - beta2^t)) (double sqrt).
//
//   SGD (torch.optim.SGD's order):
//     if weight_decay != 0:  g = g + weight_decay * p
//     if momentum != 0:
//       buf = first ? g : momentum * buf + omd * g         (omd = fp32(1 - dampening))
//       g   = nesterov ? g + momentum * buf : buf
//     p = p - lr * g
//   `first` is per tensor (the buffer has just been created and holds no history).
//
//   Writes: moments (m, v, buf) in their dtype; p in the param's dtype. An fp32
//   value goes to bf16 by stochastic rounding (sround.h's rule, no saturation)
//   when stochastic_rounding is set, else round to nearest even; to fp32 as is.
//
//   Random bits: tensor k of the list (k counts from 0 over the whole list,
//   empty tensors included) takes, for the value of stream s written to bf16,
//     s = 0: the parameter, s = 1: exp_avg / momentum buffer, s = 2: exp_avg_sq,
//   the words that stochastic_round(x, seed=seed, offset=offset + 3*k + s)
//   uses for x of the tensor's size (offset + 3k + s mod 2^64): element i takes
//   word i % 4 of Philox4x32-10(key = seed, counter = (offset + 3k + s) +
//   2^64 * (i / 4)). The low 64 bits of the counter differ between tensors
//   and streams, so every value draws from its own disjoint counter range.
//
//   Gradient statistics (when grad_sumsq is set): grad_sumsq[k] = the sum over
//   i of g * g, g as above (after grad_scale: the gradient the step used; the
//   sign of maximize does not matter), 0 for an empty tensor, NaN for every k
//   when the step is skipped (found_inf). Deterministic: g*g summed in fp32
//   over pieces of a tensor (CPU: blocks of 4096 elements, in element order;
//   CUDA: chunks of kOptimSumsqChunk, in a fixed order of its threads, which
//   differs between the 16-byte-aligned vector path and the scalar path of
//   unaligned views), then a tensor's pieces in a fixed order in double,
//   rounded once to fp32. The CPU and CUDA sums, and CUDA's for the same
//   values at another alignment, agree to fp32 rounding, not bit for bit.
//   The CUDA path keeps one fp32 partial per chunk in `workspace`
//   (optim_workspace_bytes); the caller provides it (the core allocates nothing
//   on the device). This is the gradient norm a training loop wants from the
//   step that reads every gradient anyway: sqrt(sum_k grad_sumsq[k]).
//
//   * grad_scale, found_inf, steps[k], seed_offset: in the memory of the place
//     (device memory for CUDA), read there: no host sync, capturable in a CUDA
//     graph. seed_offset, when set, holds {seed, offset} and overrides them.
//   * params: float32 or bfloat16; grads[k] the dtype and size of params[k];
//     moments float32 or bfloat16 (exp_avg_sqs[k] of exp_avgs[k]'s dtype), the size of params[k]. Empty tensors are
//     skipped; views with storage offsets are fine (a scalar path when not
//     16-byte aligned).
//   * Every argument is validated before any element is written; errors name
//     the argument (params[3], grads[3], exp_avgs[3], exp_avg_sqs[3],
//     steps[3], grad_scale, found_inf, lr, betas, grad_sumsq, workspace, ...).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core.h"
#include "host_device.h"

namespace aamp {

enum class OptimKind : int { kAdamW = 0, kSGD = 1 };

struct OptimArgs {
  OptimKind kind = OptimKind::kAdamW;
  std::vector<TensorRef> params;
  std::vector<TensorRef> grads;
  std::vector<TensorRef> exp_avgs;     // AdamW: exp_avg; SGD: momentum buffers (empty list when momentum == 0)
  std::vector<TensorRef> exp_avg_sqs;  // AdamW only
  std::vector<float*> steps;           // AdamW only: one float per tensor, in place memory
  std::vector<std::uint8_t> first;     // SGD only: 1 where the momentum buffer is new
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW
  double momentum = 0.0, dampening = 0.0;         // SGD
  bool nesterov = false;
  double weight_decay = 0.0;
  bool maximize = false;
  bool stochastic_rounding = true;
  const float* grad_scale = nullptr;  // 1 float in place memory, or null
  const float* found_inf = nullptr;   // 1 float in place memory, or null
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  const std::uint64_t* seed_offset = nullptr;  // {seed, offset} in place memory, or null
  float* grad_sumsq = nullptr;                  // params.size() floats in place memory, or null: no statistics
  std::size_t grad_sumsq_count = 0;             // the floats the caller allocated there
  void* workspace = nullptr;                    // CUDA with grad_sumsq: optim_workspace_bytes(params)
  std::size_t workspace_bytes = 0;
  Place place;
};

// Elements per chunk of the gradient statistics (see the contract): the CUDA
// kernel's unit of work, and one fp32 partial of the workspace each.
constexpr std::int64_t kOptimSumsqChunk = 32768;

// Bytes of workspace a CUDA step with grad_sumsq needs for these params.
std::size_t optim_workspace_bytes(const std::vector<TensorRef>& params);

// The fp32 constants every implementation computes the same way from the
// doubles of OptimArgs (see the contract).
struct OptimConsts {
  float lr, beta1, beta2, eps, lr_wd, omb1, omb2;  // AdamW
  float momentum, omd, weight_decay;               // SGD
  double beta1_d, beta2_d;                         // for the bias corrections
};
OptimConsts optim_consts(const OptimArgs& a);

// The per-tensor bias corrections of AdamW from the step count t, as the
// contract states: binary exponentiation in double, every operation rounded
// once (explicit intrinsics on the device, so nothing is contracted).
AAMP_HD double optim_dmul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

AAMP_HD double optim_pow(double b, float t) {
  std::uint64_t n = t > 0.0f ? static_cast<std::uint64_t>(t) : 0u;
  double r = 1.0;
  while (n != 0) {
    if (n & 1u) r = optim_dmul(r, b);
    b = optim_dmul(b, b);
    n >>= 1;
  }
  return r;
}

struct BiasCorrection {
  float bc1, bc2_sqrt;
};

AAMP_HD BiasCorrection optim_bias_correction(double beta1, double beta2, float t) {
#if defined(__CUDA_ARCH__)
  return BiasCorrection{__double2float_rn(__dsub_rn(1.0, optim_pow(beta1, t))),
                        __double2float_rn(__dsqrt_rn(__dsub_rn(1.0, optim_pow(beta2, t))))};
#else
  return BiasCorrection{static_cast<float>(1.0 - optim_pow(beta1, t)),
                        static_cast<float>(std::sqrt(1.0 - optim_pow(beta2, t)))};
#endif
}

// Philox offset stream of a value (see the contract).
constexpr std::uint64_t kOptimStreams = 3;

// Validates everything; throws before any write.
void validate_optim(const OptimArgs& a);

void optim_step(const OptimArgs& a);  // validates, then dispatches

void optim_step_cpu(const OptimArgs& a);
void optim_step_cuda(const OptimArgs& a);

}  // namespace aamp
