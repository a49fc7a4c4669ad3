// CPU implementation of the fused optimizers (contract in optim.h).
//
// The list is cut into blocks of kBlock elements (whole Philox groups), and
// the blocks of all tensors are spread over OpenMP threads. A block first
// draws the random words of the values it writes to bf16 into small buffers,
// then updates its elements with the rule the CUDA kernel uses
// (optim_rule.h), so the two agree bit for bit. With gradient statistics each
// block sums its g*g in fp32; a tensor's blocks are then added in block order
// in double, so the result does not depend on the number of threads.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "optim.h"
#include "optim_rule.h"
#include "philox.h"
#include "sround.h"

namespace aamp {

namespace {

constexpr std::int64_t kBlock = 4096;
static_assert(kBlock % kSroundGroup == 0, "a block must hold whole Philox groups");
static_assert(kOptimSumsqChunk % kBlock == 0, "a statistics chunk must hold whole blocks");

struct Item {
  std::size_t k;
  std::int64_t begin, n;
};

template <class T>
float load(const void* base, std::int64_t i) {
  if constexpr (sizeof(T) == 4) {
    return static_cast<const float*>(base)[i];
  } else {
    return bf16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
  }
}

template <class T>
void store(void* base, std::int64_t i, float y, std::uint32_t r, bool sr) {
  if constexpr (sizeof(T) == 4) {
    static_cast<float*>(base)[i] = y;
  } else {
    static_cast<std::uint16_t*>(base)[i] = optim_rule::to_bf16(y, r, sr);
  }
}

// The words of stream s for elements [begin, begin + n) of tensor k.
void draw(std::uint32_t* out, std::uint64_t seed, std::uint64_t offset, std::size_t k, std::uint64_t s,
          std::int64_t begin, std::int64_t n) {
  const std::uint64_t off = offset + kOptimStreams * static_cast<std::uint64_t>(k) + s;
  const std::uint64_t g0 = static_cast<std::uint64_t>(begin / kSroundGroup);
  const std::int64_t groups = (n + kSroundGroup - 1) / kSroundGroup;
  for (std::int64_t g = 0; g < groups; ++g) {
    const PhiloxBits w = philox_group(seed, off, g0 + static_cast<std::uint64_t>(g));
    std::memcpy(out + g * kSroundGroup, w.w, sizeof(w.w));
  }
}

// P: the parameter's storage (float or bf16 bits), M: the moments'. Returns the block's sum of g*g (fp32, in
// element order) when `stats`, else 0.
template <class P, class M>
float run_item(const OptimArgs& a, const optim_rule::Scalars& s, const Item& it, std::uint64_t seed,
               std::uint64_t offset, bool stats) {
  constexpr bool kP16 = sizeof(P) == 2, kM16 = sizeof(M) == 2;
  const bool adam = a.kind == OptimKind::kAdamW;
  const bool sr = a.stochastic_rounding;
  const std::size_t k = it.k;
  const bool has_buf = adam || s.momentum;
  std::uint32_t rp[kBlock], rm[kBlock], rv[kBlock];
  if (kP16 && sr) draw(rp, seed, offset, k, 0, it.begin, it.n);
  if (kM16 && sr && has_buf) draw(rm, seed, offset, k, 1, it.begin, it.n);
  if (kM16 && sr && adam) draw(rv, seed, offset, k, 2, it.begin, it.n);
  void* param = a.params[k].data;
  const void* grad = a.grads[k].data;
  void* m = has_buf ? a.exp_avgs[k].data : nullptr;
  void* v = adam ? a.exp_avg_sqs[k].data : nullptr;
  float ss = 0.0f;
  if (adam) {
    const BiasCorrection bc = optim_bias_correction(s.c.beta1_d, s.c.beta2_d, *a.steps[k] + 1.0f);
    const float step_size = optim_rule::div(s.c.lr, bc.bc1);
    for (std::int64_t j = 0; j < it.n; ++j) {
      const std::int64_t i = it.begin + j;
      float p = load<P>(param, i), mv = load<M>(m, i), vv = load<M>(v, i);
      const float g = optim_rule::grad_in(load<P>(grad, i), s);
      if (stats) ss = optim_rule::add(ss, optim_rule::mul(g, g));
      optim_rule::adamw(p, mv, vv, g, step_size, bc.bc2_sqrt, s);
      store<M>(m, i, mv, kM16 && sr ? rm[j] : 0u, sr);
      store<M>(v, i, vv, kM16 && sr ? rv[j] : 0u, sr);
      store<P>(param, i, p, kP16 && sr ? rp[j] : 0u, sr);
    }
  } else {
    const bool first = has_buf && a.first[k] != 0;
    for (std::int64_t j = 0; j < it.n; ++j) {
      const std::int64_t i = it.begin + j;
      float p = load<P>(param, i);
      float buf = has_buf ? load<M>(m, i) : 0.0f;
      const float g = optim_rule::grad_in(load<P>(grad, i), s);
      if (stats) ss = optim_rule::add(ss, optim_rule::mul(g, g));
      optim_rule::sgd(p, buf, g, first, s);
      if (has_buf) store<M>(m, i, buf, kM16 && sr ? rm[j] : 0u, sr);
      store<P>(param, i, p, kP16 && sr ? rp[j] : 0u, sr);
    }
  }
  return ss;
}

float run_item_any(const OptimArgs& a, const optim_rule::Scalars& s, const Item& it, std::uint64_t seed,
                   std::uint64_t offset, bool stats) {
  const bool p16 = a.params[it.k].dtype == DType::kBFloat16;
  const bool has_m = a.kind == OptimKind::kAdamW || s.momentum;
  const bool m16 = has_m && a.exp_avgs[it.k].dtype == DType::kBFloat16;
  if (p16) {
    return m16 ? run_item<std::uint16_t, std::uint16_t>(a, s, it, seed, offset, stats)
               : run_item<std::uint16_t, float>(a, s, it, seed, offset, stats);
  }
  return m16 ? run_item<float, std::uint16_t>(a, s, it, seed, offset, stats)
             : run_item<float, float>(a, s, it, seed, offset, stats);
}

}  // namespace

void optim_step_cpu(const OptimArgs& a) {
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) {  // a skipped step writes nothing but "not measured"
    if (a.grad_sumsq != nullptr) std::fill_n(a.grad_sumsq, a.params.size(), std::numeric_limits<float>::quiet_NaN());
    return;
  }
  optim_rule::Scalars s;
  s.c = optim_consts(a);
  s.has_grad_scale = a.grad_scale != nullptr;
  s.grad_scale = s.has_grad_scale ? *a.grad_scale : 1.0f;
  s.maximize = a.maximize;
  s.wd = a.weight_decay != 0.0;
  s.momentum = a.kind == OptimKind::kSGD && a.momentum != 0.0;
  s.nesterov = a.nesterov;
  const std::uint64_t seed = a.seed_offset != nullptr ? a.seed_offset[0] : a.seed;
  const std::uint64_t offset = a.seed_offset != nullptr ? a.seed_offset[1] : a.offset;

  std::vector<Item> items;
  std::int64_t total = 0;
  for (std::size_t k = 0; k < a.params.size(); ++k) {
    const std::int64_t n = a.params[k].numel;
    total += n;
    for (std::int64_t b = 0; b < n; b += kBlock) items.push_back({k, b, std::min(kBlock, n - b)});
  }
  const std::int64_t count = static_cast<std::int64_t>(items.size());
  const bool stats = a.grad_sumsq != nullptr;
  std::vector<float> partial(stats ? items.size() : 0);
  // Below about 32K elements threads cost more than they save.
#pragma omp parallel for schedule(static) if (count > 1 && total > (1 << 15))
  for (std::int64_t j = 0; j < count; ++j) {
    const std::size_t at = static_cast<std::size_t>(j);
    const float ss = run_item_any(a, s, items[at], seed, offset, stats);
    if (stats) partial[at] = ss;
  }
  if (stats) {  // the blocks of each tensor in block order (items are in tensor, then block order)
    std::vector<double> sums(a.params.size(), 0.0);
    for (std::size_t j = 0; j < items.size(); ++j) sums[items[j].k] += static_cast<double>(partial[j]);
    for (std::size_t k = 0; k < sums.size(); ++k) a.grad_sumsq[k] = static_cast<float>(sums[k]);
  }
}

}  // namespace aamp
