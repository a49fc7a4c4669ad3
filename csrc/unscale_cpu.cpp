// CPU implementation of the unscale family (contract in unscale.h).
//
// Work is split into the same fixed chunks as on the GPU and spread over
// OpenMP threads; each chunk writes its own partial, and the per-tensor
// results are summed in chunk order afterwards, so the statistics do not
// depend on the number of threads.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "float_bits.h"
#include "unscale.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define AAMP_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define AAMP_CPU_CLONES
#endif

namespace aamp {

namespace {

using host_elements::BF16;
using host_elements::F16;
using host_elements::F32;

// One chunk: check, scale, optionally write back and reduce. Returns whether
// a NaN or inf was seen. With inv_scale == 1 nothing is written (see below),
// and x * 1 == x for every non-NaN x, so the loop needs no select.
// Built for baseline x86-64 and for AVX2, picked at load time: twice the
// vector width matters on machines whose memory outruns SSE2 code.
template <class E, bool kWrite, bool kStats>
AAMP_CPU_CLONES bool run_chunk(typename E::T* x, std::int64_t n, float inv, UnscalePartial* partial) {
  unsigned bad = 0;
  float ss = 0.0f;
  std::uint32_t am = 0;
#pragma omp simd reduction(| : bad) reduction(+ : ss) reduction(max : am)
  for (std::int64_t i = 0; i < n; ++i) {
    typename E::T v = x[i];
    bad |= E::nonfinite(v) ? 1u : 0u;
    float f = E::load(v);
    float y = f * inv;
    if (kWrite) x[i] = E::store(y);
    if (kStats) {
      ss += y * y;
      std::uint32_t a = f32_bits(y) & 0x7fffffffu;
      am = a > am ? a : am;
    }
  }
  if (kStats) {
    partial->sumsq = ss;
    partial->amax_bits = am;
  }
  return bad != 0;
}

template <class E>
bool dispatch_chunk(void* data, std::int64_t n, float inv, bool write, UnscalePartial* partial) {
  auto* x = static_cast<typename E::T*>(data);
  if (partial != nullptr) {
    return write ? run_chunk<E, true, true>(x, n, inv, partial) : run_chunk<E, false, true>(x, n, inv, partial);
  }
  return write ? run_chunk<E, true, false>(x, n, inv, nullptr) : run_chunk<E, false, false>(x, n, inv, nullptr);
}

}  // namespace

void unscale_and_check_cpu(const UnscaleArgs& a) {
  const std::size_t count = a.tensors.size();
  const float inv = *a.inv_scale;
  // With inv_scale == 1 torch returns each value itself, so writing back
  // changes nothing: skip the stores (this also keeps NaN payloads intact).
  const bool write = !a.check_only && inv != 1.0f;
  const bool stats = a.sumsq != nullptr;
  auto* partials = static_cast<UnscalePartial*>(a.workspace);

  // chunk_begin[i] is the first global chunk of tensor i.
  std::vector<std::int64_t> chunk_begin(count + 1, 0);
  std::int64_t elements = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const std::int64_t n = a.tensors[i].numel;
    chunk_begin[i + 1] = chunk_begin[i] + (n + kUnscaleChunk - 1) / kUnscaleChunk;
    elements += n;
  }
  const std::int64_t total = chunk_begin[count];

  unsigned bad = 0;
  // Below about 64K elements threads cost more than they save.
#pragma omp parallel for schedule(static) reduction(| : bad) if (total > 1 && elements > (1 << 16))
  for (std::int64_t c = 0; c < total; ++c) {
    // Chunks are few per tensor on average; a binary search keeps this O(log n).
    std::size_t t = static_cast<std::size_t>(
        std::upper_bound(chunk_begin.begin(), chunk_begin.end(), c) - chunk_begin.begin() - 1);
    const TensorRef& ref = a.tensors[t];
    const std::int64_t local = c - chunk_begin[t];
    const std::int64_t offset = local * kUnscaleChunk;
    const std::int64_t n = std::min(kUnscaleChunk, ref.numel - offset);
    void* data = static_cast<char*>(ref.data) + offset * static_cast<std::int64_t>(dtype_size(ref.dtype));
    UnscalePartial* partial = stats ? partials + c : nullptr;
    bool found = false;
    switch (ref.dtype) {
      case DType::kFloat32: found = dispatch_chunk<F32>(data, n, inv, write, partial); break;
      case DType::kFloat16: found = dispatch_chunk<F16>(data, n, inv, write, partial); break;
      case DType::kBFloat16: found = dispatch_chunk<BF16>(data, n, inv, write, partial); break;
      default: break;  // rejected by validate_unscale
    }
    bad |= found ? 1u : 0u;
  }
  if (bad) *a.found_inf = 1.0f;

  if (stats) {
    for (std::size_t t = 0; t < count; ++t) {
      double s = 0.0;
      std::uint32_t m = 0;
      for (std::int64_t c = chunk_begin[t]; c < chunk_begin[t + 1]; ++c) {
        s += partials[c].sumsq;
        m = partials[c].amax_bits > m ? partials[c].amax_bits : m;
      }
      a.sumsq[t] = static_cast<float>(s);
      a.amax[t] = f32_from_bits(m);
    }
  }
}

}  // namespace aamp
