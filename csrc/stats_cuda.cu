// CUDA implementation of the statistics family (contract in stats.h).
//
// Stage 1: one block per chunk of kStatsChunk elements, 16-byte vector loads
// when the tensor is aligned (a scalar path otherwise), kUnroll of them in
// flight per thread; a whole aligned chunk runs without bounds checks. Each
// thread first takes a lean fast path that assumes what nearly all data
// satisfy (finite values whose squares neither overflow nor underflow fp32,
// and the chunk's pivot, its first element (or, when that is not finite, one
// that search_pivot finds), near their mean): fp32 sums of
// x - pivot, float min/max, integer counts. A thread whose elements break the
// fast path's assumption (fp32_sums_trusted) visits them again with every
// special handled and fp64 sums. Every thread of a chunk sums against the
// same pivot, so the reductions only add: each warp reduces its threads in a
// fixed order (integer reductions for counts and extrema, a shuffle tree of
// fp64 additions for the sums), warp 0 does the same over the block's warps
// through shared memory (one barrier per chunk), and the chunk's sums
// against its pivot are its partial. (A pivot per thread needed a Chan
// merge, with its fp64 division, at every step of those trees: a third of
// the kernel's instructions.)
// Stage 2: one block per tensor (one warp, in lists of small tensors) shifts
// its partials to one reference and adds them in a fixed order (StatsTotals,
// stats_math.h: again no division per merge; a second pass against the mean
// when the first cancelled), and writes the final statistics, so one
// transfer reads them all.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda_elements.cuh"
#include "cuda_utils.cuh"
#include "multi_tensor.cuh"
#include "stats.h"
#include "stats_math.h"

namespace aamp {

namespace {

#ifndef AAMP_STATS_THREADS
#define AAMP_STATS_THREADS 256
#endif
#ifndef AAMP_STATS_UNROLL
#define AAMP_STATS_UNROLL 4
#endif
// Build-time knobs for tuning sweeps (ADAPTIVE_AMP_NVCC_FLAGS).
constexpr int kThreads = AAMP_STATS_THREADS;
constexpr int kUnroll = AAMP_STATS_UNROLL;  // 16-byte loads in flight per thread
constexpr int kWarps = kThreads / 32;
static_assert(kWarps <= 32, "warp 0 merges the warp partials, one a lane");
constexpr int kAnyDType = -1;

using elements::BF16;
using elements::F16;
using elements::F32;
using elements::Vec16;


// Calls f(value) for this thread's elements of a chunk. The assignment of
// elements to threads depends only on n and the alignment, never on timing.
// kFull: a whole chunk (n == kStatsChunk) on 16 bytes, whose vectors divide
// evenly into the batches, so no load needs a bounds check.
template <class E, bool kFull, class F>
__device__ __forceinline__ void for_each(const typename E::T* __restrict__ x, int n, F& f) {
  using T = typename E::T;
  constexpr int kPer = 16 / sizeof(T);
  static_assert(kStatsChunk / kPer % (kThreads * kUnroll) == 0, "whole chunks are whole batches of vectors");
  int nvec = 0;
  if (kFull || (reinterpret_cast<std::uintptr_t>(x) & 15u) == 0) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    nvec = kFull ? static_cast<int>(kStatsChunk) / kPer : n / kPer;
    for (int base = threadIdx.x; base < nvec; base += kThreads * kUnroll) {
      Vec16<E> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int idx = base + u * kThreads;
        if (kFull || idx < nvec) v[u].raw = __ldg(xv + idx);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (kFull || base + u * kThreads < nvec) {
#pragma unroll
          for (int k = 0; k < kPer; ++k) f(E::load(v[u].e[k]));
        }
      }
    }
  }
  if constexpr (!kFull) {
    for (int i = nvec * kPer + threadIdx.x; i < n; i += kThreads) f(E::load(x[i]));
  }
}

// How many elements for_each gives this thread.
template <class E, bool kFull>
__device__ __forceinline__ int thread_share(const typename E::T* x, int n) {
  constexpr int kPer = 16 / sizeof(typename E::T);
  if (kFull) return static_cast<int>(kStatsChunk) / kThreads;
  const int tid = threadIdx.x;
  const bool aligned = (reinterpret_cast<std::uintptr_t>(x) & 15u) == 0;
  const int nvec = aligned ? n / kPer : 0;
  const int done = nvec * kPer;
  const int vecs = tid < nvec ? (nvec - 1 - tid) / kThreads + 1 : 0;
  const int tail = tid < n - done ? (n - done - 1 - tid) / kThreads + 1 : 0;
  return vecs * kPer + tail;
}

// Integer thresholds on |y| bits for the fast path: |y| and the format limits
// are non-negative floats, whose bit patterns order as unsigned integers, so
// one integer subtraction per threshold decides a comparison and its sign bit
// is the count's increment (0 or 1): two instructions per count (IADD3, then
// LEA.HI adds the sign bit), where a float compare plus a conditional add
// compiled to three (FSETP, VIADD, predicated move). Valid for |y| up to
// +inf; a NaN y (x * s with a non-finite s) would count as overflow, so a
// non-finite scale takes the careful path (uniform per chunk).
struct FormatBits {
  unsigned lo1;  // bits(lo) + 1: |y| <= lo  <=>  |y|bits - lo1 < 0
  unsigned hi;   // bits(hi):     |y| < hi   <=>  |y|bits - hi < 0
  unsigned max;  // bits(max):    |y| > max  <=>  max - |y|bits < 0
  __device__ explicit FormatBits(FormatLimits l)
      : lo1(f32_bits(l.lo) + 1u), hi(f32_bits(l.hi)), max(f32_bits(l.max)) {}
};

// The sign bit of d (as 0 or 1).
__device__ __forceinline__ unsigned sign_bit(unsigned d) { return d >> 31; }

// The fast path: assumes finite values (checked afterwards through ss).
template <bool kFmt>
struct Fast {
  float pivot, abs_scale;
  FormatBits lim;
  float s = 0.0f, ss = 0.0f;
  float mn = INFINITY, mx = -INFINITY;
  unsigned ak = 0xffffffffu, zero = 0, lo = 0, hi = 0, over = 0;

  __device__ Fast(float p, float sc, FormatLimits l) : pivot(p), abs_scale(fabsf(sc)), lim(l) {}

  __device__ __forceinline__ void operator()(float v) {
    const unsigned vb = __float_as_uint(v);
    mn = fminf(mn, v);
    mx = fmaxf(mx, v);
    ak = min(ak, abs_key(vb));
    // |v| == 0 <=> (|v|bits - 1) < 0; |v|bits comes from the abs key's 2*|v|bits.
    zero += sign_bit(((vb << 1) >> 1) - 1u);
    const float d = v - pivot;
    s += d;
    ss = fmaf(d, d, ss);
    if (kFmt) {
      // |v| * |s| is |v * s| bit for bit (the product's magnitude does not
      // depend on the signs), with no separate abs.
      const unsigned ay = __float_as_uint(fabsf(v) * abs_scale);
      lo += sign_bit(ay - lim.lo1);
      hi += sign_bit(ay - lim.hi);
      over += sign_bit(lim.max - ay);
    }
  }

  __device__ __forceinline__ bool trusted(int n) const {
    const float amax = fmaxf(-mn, mx);  // -inf for a thread without elements
    return fp32_sums_trusted(s, ss, static_cast<double>(n), amax);
  }

  __device__ __forceinline__ StatsPartial sums(int n) const {
    StatsPartial c;
    c.s = s;
    c.ss = ss;
    c.count = n;
    c.zero = zero;
    c.at_most_lo = lo;
    c.below_hi = hi;
    c.over = over;
    c.min_key = order_key(__float_as_uint(mn));
    c.max_key = order_key(__float_as_uint(mx));
    c.abs_key = ak;
    return c;
  }
};

// The careful path: every special, fp64 sums.
template <bool kFmt>
struct Careful {
  float pivot, scale;
  FormatLimits lim;
  StatsPartial c;

  __device__ Careful(float pv, float sc, FormatLimits l) : pivot(pv), scale(sc), lim(l) {}

  __device__ void operator()(float v) {
    const unsigned u = __float_as_uint(v);
    const unsigned a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) {
      c.nan += a > 0x7f800000u;
      c.inf += a == 0x7f800000u;
      return;
    }
    c.count += 1;
    c.zero += a == 0;
    c.min_key = min(c.min_key, order_key(u));
    c.max_key = max(c.max_key, order_key(u));
    c.abs_key = min(c.abs_key, abs_key(u));
    const double d = static_cast<double>(v) - pivot;
    c.s += d;
    c.ss = fma(d, d, c.ss);
    if (kFmt) {
      const float ay = fabsf(v * scale);
      c.at_most_lo += ay <= lim.lo;
      c.below_hi += ay < lim.hi;
      c.over += ay > lim.max;
    }
  }
};

// A group's (a thread's, a warp's, the block's) results for a chunk are a
// StatsPartial whose sums are against the chunk's pivot (its ref is set once
// the block has reduced them): groups merge by adding.

// Warp-wide reductions in a fixed order. Valid in lane 0.
__device__ __forceinline__ void warp_reduce_counts(StatsPartial& c) {
  constexpr unsigned kAll = 0xffffffffu;
  c.count = __reduce_add_sync(kAll, c.count);
  c.zero = __reduce_add_sync(kAll, c.zero);
  c.nan = __reduce_add_sync(kAll, c.nan);
  c.inf = __reduce_add_sync(kAll, c.inf);
  c.at_most_lo = __reduce_add_sync(kAll, c.at_most_lo);
  c.below_hi = __reduce_add_sync(kAll, c.below_hi);
  c.over = __reduce_add_sync(kAll, c.over);
  c.min_key = __reduce_min_sync(kAll, c.min_key);
  c.max_key = __reduce_max_sync(kAll, c.max_key);
  c.abs_key = __reduce_min_sync(kAll, c.abs_key);
}

// Sums against one pivot add up (a shuffle tree).
__device__ __forceinline__ void warp_reduce(StatsPartial& c) {
  constexpr unsigned kAll = 0xffffffffu;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    c.s += __shfl_down_sync(kAll, c.s, o);
    c.ss += __shfl_down_sync(kAll, c.ss, o);
  }
  warp_reduce_counts(c);
}

struct ScaleArg {
  const float* ptr;  // place memory, or null
  int stride;        // 1: one per tensor (ptr already at this launch's first tensor), 0: one for all
  float value;       // without ptr
  __device__ __forceinline__ float of(int t) const { return ptr != nullptr ? ptr[t * stride] : value; }
};

// This thread's sums of a chunk: the fast path, or the careful one when its
// fp32 sums cannot be trusted (or the scale is not finite).
template <class E, bool kFmt, bool kFull>
__device__ __forceinline__ StatsPartial thread_sums(const typename E::T* __restrict__ x, int n, float pivot, float scale,
                                                 FormatLimits lim) {
  Fast<kFmt> fast(pivot, scale, lim);
  for_each<E, kFull>(x, n, fast);
  const bool finite_scale = !kFmt || (__float_as_uint(scale) & 0x7fffffffu) < 0x7f800000u;
  const int share = thread_share<E, kFull>(x, n);
  if (finite_scale && fast.trusted(share)) return fast.sums(share);
  Careful<kFmt> careful(pivot, scale, lim);
  for_each<E, false>(x, n, careful);
  return careful.c;
}

// The first finite element a thread sees in for_each order.
struct FirstFinite {
  float value = 0.0f;
  bool found = false;
  __device__ __forceinline__ void operator()(float v) {
    if (!found && (__float_as_uint(v) & 0x7fffffffu) < 0x7f800000u) {
      value = v;
      found = true;
    }
  }
};

// The pivot of a chunk whose first element is not finite: the first finite
// element of the lowest thread that has one (0 if the chunk has none), for
// every thread. A second read of the chunk and a barrier, in a branch that
// is uniform per chunk and rare; a pivot of 0 instead would make the sums of
// |mean| >> std data cancel. Each warp leaves its first finite element, or
// NaN for none, in its slot. The caller's next barrier (run_chunk's) comes
// after every thread's reads here, so a later search cannot overwrite a slot
// still being read.
template <class E>
__device__ float search_pivot(const typename E::T* __restrict__ x, int n) {
  __shared__ float candidate[kWarps];
  FirstFinite f;
  for_each<E, false>(x, n, f);
  const unsigned ballot = __ballot_sync(0xffffffffu, f.found);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float first = __shfl_sync(0xffffffffu, f.value, ballot != 0 ? __ffs(ballot) - 1 : 0);
  if (lane == 0) candidate[warp] = ballot != 0 ? first : NAN;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) {
    const float v = candidate[w];
    if (v == v) return v;
  }
  return 0.0f;
}

// The chunk's partial, valid in thread 0. Its pivot is its first element
// (when finite; otherwise search_pivot), loaded by every thread next to its
// first batch. The warps' sums meet in slots[parity], reduced by warp 0 in a
// fixed order (lanes past kWarps hold empty sums, which add nothing); the
// slots alternate between two buffers by chunk parity, so the one barrier
// per chunk also orders warp 0's reads of chunk i before any write of chunk
// i + 2.
template <class E, bool kFmt>
__device__ __forceinline__ StatsPartial run_chunk(const typename E::T* __restrict__ x, int n, float scale,
                                                  FormatLimits lim, StatsPartial (*slots)[kWarps], int parity) {
  float pivot = E::load(x[0]);
  if ((__float_as_uint(pivot) & 0x7fffffffu) >= 0x7f800000u) pivot = search_pivot<E>(x, n);
  const bool full = n == static_cast<int>(kStatsChunk) && (reinterpret_cast<std::uintptr_t>(x) & 15u) == 0;
  StatsPartial c = full ? thread_sums<E, kFmt, true>(x, n, pivot, scale, lim)
                     : thread_sums<E, kFmt, false>(x, n, pivot, scale, lim);
  warp_reduce(c);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) slots[parity][warp] = c;
  __syncthreads();
  if (warp == 0) {
    c = lane < kWarps ? slots[parity][lane] : StatsPartial();
    warp_reduce(c);
    c.ref = pivot;
  }
  return c;
}

template <class Table, bool kFmt, int kOnly>
__global__ void __launch_bounds__(kThreads, kOnly == kAnyDType ? 2 : 4)
    stats_kernel(const __grid_constant__ Table table, ScaleArg scale, FormatLimits lim,
                 StatsPartial* __restrict__ partials) {
  __shared__ StatsPartial slots[2][kWarps];
  const unsigned total = table.chunk_begin[table.count];
  int parity = 0;
  for (unsigned c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = table_find(table, c);
    const unsigned local = c - table.chunk_begin[t];
    const unsigned last = table.chunk_begin[t + 1] - table.chunk_begin[t] - 1;
    const unsigned meta = table.meta[t];
    const int n = local == last ? static_cast<int>(meta >> 4) + 1 : static_cast<int>(kStatsChunk);
    const std::int64_t offset = static_cast<std::int64_t>(local) * kStatsChunk;
    const unsigned dtype = kOnly == kAnyDType ? (meta & 15u) : static_cast<unsigned>(kOnly);
    const float s = kFmt ? scale.of(t) : 1.0f;
    StatsPartial p;
    switch (static_cast<DType>(dtype)) {
      case DType::kFloat32: {
        const float* x = static_cast<const float*>(table.data[t]);
        p = run_chunk<F32, kFmt>(x + offset, n, s, lim, slots, parity);
        break;
      }
      case DType::kFloat16: {
        const unsigned short* x = static_cast<const unsigned short*>(table.data[t]);
        p = run_chunk<F16, kFmt>(x + offset, n, s, lim, slots, parity);
        break;
      }
      default: {
        const unsigned short* x = static_cast<const unsigned short*>(table.data[t]);
        p = run_chunk<BF16, kFmt>(x + offset, n, s, lim, slots, parity);
        break;
      }
    }
    parity ^= 1;
    if (threadIdx.x == 0) partials[c] = p;
  }
}

__device__ __forceinline__ StatsTotals shfl_down(const StatsTotals& t, int o) {
  constexpr unsigned kAll = 0xffffffffu;
  StatsTotals q(t.ref);
  q.n = __shfl_down_sync(kAll, t.n, o);
  q.s = __shfl_down_sync(kAll, t.s, o);
  q.ss = __shfl_down_sync(kAll, t.ss, o);
  q.zero = __shfl_down_sync(kAll, t.zero, o);
  q.nan = __shfl_down_sync(kAll, t.nan, o);
  q.inf = __shfl_down_sync(kAll, t.inf, o);
  q.at_most_lo = __shfl_down_sync(kAll, t.at_most_lo, o);
  q.below_hi = __shfl_down_sync(kAll, t.below_hi, o);
  q.over = __shfl_down_sync(kAll, t.over, o);
  q.min_key = __shfl_down_sync(kAll, t.min_key, o);
  q.max_key = __shfl_down_sync(kAll, t.max_key, o);
  q.abs_key = __shfl_down_sync(kAll, t.abs_key, o);
  return q;
}

// A fixed-order shuffle tree over the warp (valid in lane 0).
__device__ __forceinline__ void warp_reduce(StatsTotals& t) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t.add(shfl_down(t, o));
}

// The index of the first of partials[begin, end) with a finite element (end
// if none), for every thread of the block. Nearly always the first one is,
// and every thread reads it; otherwise the block searches.
template <int kFinishThreads>
__device__ unsigned first_counted(const StatsPartial* __restrict__ partials, unsigned begin, unsigned end) {
  if (begin == end || partials[begin].count > 0) return begin;
  __shared__ unsigned found[kFinishThreads / 32];
  unsigned mine = end;
  for (unsigned p = begin + threadIdx.x; p < end; p += kFinishThreads) {
    if (partials[p].count > 0) {
      mine = p;
      break;
    }
  }
  mine = __reduce_min_sync(0xffffffffu, mine);
  if ((threadIdx.x & 31) == 0) found[threadIdx.x >> 5] = mine;
  __syncthreads();
  unsigned first = end;
  for (int w = 0; w < kFinishThreads / 32; ++w) first = min(first, found[w]);
  return first;
}

// One block per tensor: the partials are shifted to the tensor's reference
// and added, each thread a fixed stride of them, then a shuffle tree per
// warp and one over the warps, and the final statistics. Empty tensors get
// their row too.
// Finishing blocks are wide when a tensor has many partials, so that each
// thread's chain of additions (GPT-2's embedding: 589 partials) is short.
// Lists with no tensor of more than 2048 partials take 256-thread blocks
// (and lists of small tensors a warp per tensor, below).
constexpr int kWideFinish = 512;

// The block's totals of partials[begin, end) against `ref` (valid in thread
// 0): each thread a fixed stride of them, a shuffle tree per warp, and one
// over the warps in warp 0 (through s_tot).
template <int kFinishThreads>
__device__ StatsTotals block_totals(const StatsPartial* __restrict__ partials, unsigned begin, unsigned end,
                                    double ref, StatsTotals* s_tot) {
  StatsTotals tot(ref);
  // Two partials in flight per step: a thread's chain of loads is the
  // kernel's latency (the order of the additions is unchanged).
  unsigned p = begin + threadIdx.x;
  for (; p + kFinishThreads < end; p += 2 * kFinishThreads) {
    const StatsPartial a = partials[p], b = partials[p + kFinishThreads];
    tot.add(a);
    tot.add(b);
  }
  if (p < end) tot.add(partials[p]);
  warp_reduce(tot);
  constexpr int kFinishWarps = kFinishThreads / 32;
  static_assert(kFinishWarps <= 32, "warp 0 reduces the warps' totals, one a lane");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) s_tot[warp] = tot;
  __syncthreads();
  if (warp == 0) {
    tot = lane < kFinishWarps ? s_tot[lane] : StatsTotals(ref);
    warp_reduce(tot);
  }
  return tot;
}

// One warp's totals of partials[begin, end) against `ref` (valid in every
// lane): each lane a fixed stride of them, then a shuffle tree.
__device__ StatsTotals warp_totals(const StatsPartial* __restrict__ partials, unsigned begin, unsigned end,
                                   double ref) {
  StatsTotals tot(ref);
  for (unsigned p = begin + (threadIdx.x & 31); p < end; p += 32) tot.add(partials[p]);
  warp_reduce(tot);
  return tot;
}

// Tensor t's row from its totals (valid in lane 0), by one warp: first the
// rare second pass, in this warp alone, so it needs no block barrier.
template <class Table, bool kFmt>
__device__ void finish_tensor(const Table& table, int t, unsigned begin, unsigned end, StatsTotals tot,
                              ScaleArg scale, const StatsPartial* __restrict__ partials, double* __restrict__ out) {
  // A lone partial is already summed against its own mean.
  if (end - begin > 1 && __shfl_sync(0xffffffffu, tot.needs_second_pass(), 0))
    tot = warp_totals(partials, begin, end, __shfl_sync(0xffffffffu, tot.mean(), 0));
  if ((threadIdx.x & 31) == 0) {
    const unsigned meta = table.meta[t];
    const long long chunks = end - begin;
    const long long numel = chunks > 0 ? (chunks - 1) * kStatsChunk + static_cast<long long>(meta >> 4) + 1 : 0;
    finalize_stats(tot, numel, kFmt ? scale.of(t) : 1.0f, kFmt, out + static_cast<std::size_t>(t) * kStatFields);
  }
}

template <class Table, bool kFmt, int kFinishThreads>
__global__ void __launch_bounds__(kFinishThreads)
    stats_finish_kernel(const __grid_constant__ Table table, ScaleArg scale, const StatsPartial* __restrict__ partials,
                        double* __restrict__ out) {
  const int t = blockIdx.x;
  const unsigned begin = table.chunk_begin[t], end = table.chunk_begin[t + 1];
  const unsigned first = first_counted<kFinishThreads>(partials, begin, end);
  __shared__ alignas(StatsTotals) unsigned char raw[sizeof(StatsTotals) * (kFinishThreads / 32)];
  const StatsTotals tot = block_totals<kFinishThreads>(partials, begin, end,
                                                       first < end ? partial_mean(partials[first]) : 0.0,
                                                       reinterpret_cast<StatsTotals*>(raw));
  if (threadIdx.x < 32) finish_tensor<Table, kFmt>(table, t, begin, end, tot, scale, partials, out);
}

// Lists whose tensors have at most kWarpFinishPartials partials each (up to
// 2M elements: lists of many small tensors) finish a tensor per warp. A
// block per tensor spent most of its time starting and meeting at barriers
// for one or a few partials. The sums are those of the block kernel's warp 0,
// in the same order.
constexpr unsigned kWarpFinishPartials = 32;

template <class Table, bool kFmt>
__global__ void __launch_bounds__(kThreads)
    stats_finish_warps_kernel(const __grid_constant__ Table table, ScaleArg scale,
                              const StatsPartial* __restrict__ partials, double* __restrict__ out) {
  const int t = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (t >= table.count) return;  // whole warps
  const unsigned begin = table.chunk_begin[t], end = table.chunk_begin[t + 1];
  const unsigned p = begin + (threadIdx.x & 31);  // this lane's partial, if p < end
  const unsigned counted = __ballot_sync(0xffffffffu, p < end && partials[p].count > 0);
  const unsigned first = counted != 0 ? begin + __ffs(counted) - 1 : end;
  const StatsTotals tot = warp_totals(partials, begin, end, first < end ? partial_mean(partials[first]) : 0.0);
  finish_tensor<Table, kFmt>(table, t, begin, end, tot, scale, partials, out);
}

template <class Table, bool kFmt, int kOnly>
void launch(const Table& table, ScaleArg scale, FormatLimits lim, StatsPartial* partials, double* out,
            cudaStream_t stream, int device) {
  const unsigned total = table.chunk_begin[table.count];
  if (total > 0) {
    // One block per chunk up to a cap; the kernel loops past it.
    const unsigned cap = static_cast<unsigned>(multiprocessor_count(device)) * 256u;
    stats_kernel<Table, kFmt, kOnly>
        <<<std::min(total, cap), kThreads, 0, stream>>>(table, scale, lim, partials);
    AAMP_CUDA_CHECK_LAUNCH("stats_kernel");
  }
  unsigned most = 0;  // the most chunks of one tensor
  for (int i = 0; i < table.count; ++i) most = std::max(most, table.chunk_begin[i + 1] - table.chunk_begin[i]);
  const unsigned blocks = static_cast<unsigned>(table.count);
  if (most <= kWarpFinishPartials) {
    stats_finish_warps_kernel<Table, kFmt>
        <<<(blocks + kWarps - 1) / kWarps, kThreads, 0, stream>>>(table, scale, partials, out);
  } else if (most > 8u * kThreads) {
    stats_finish_kernel<Table, kFmt, kWideFinish>
        <<<blocks, kWideFinish, 0, stream>>>(table, scale, partials, out);
  } else {
    stats_finish_kernel<Table, kFmt, kThreads><<<blocks, kThreads, 0, stream>>>(table, scale, partials, out);
  }
  AAMP_CUDA_CHECK_LAUNCH("stats_finish_kernel");
}

// fp32-only lists (the common case: fp32 gradients and master weights) get
// the specialized kernel; anything else the mixed one.
template <class Table>
void launch_table(const Table& table, const StatsArgs& a, ScaleArg scale, FormatLimits lim, StatsPartial* partials,
                  double* out, cudaStream_t stream) {
  bool all_f32 = true;
  for (int i = 0; i < table.count; ++i) all_f32 &= (table.meta[i] & 15u) == static_cast<unsigned>(DType::kFloat32);
  constexpr int kF32 = static_cast<int>(DType::kFloat32);
  const int device = a.place.device;
  if (a.has_format) {
    all_f32 ? launch<Table, true, kF32>(table, scale, lim, partials, out, stream, device)
            : launch<Table, true, kAnyDType>(table, scale, lim, partials, out, stream, device);
  } else {
    all_f32 ? launch<Table, false, kF32>(table, scale, lim, partials, out, stream, device)
            : launch<Table, false, kAnyDType>(table, scale, lim, partials, out, stream, device);
  }
}

}  // namespace

void tensor_stats_cuda(const StatsArgs& a) {
  DeviceGuard guard(a.place.device);
  cudaStream_t stream = as_stream(a.place.stream);
  auto* partials = static_cast<StatsPartial*>(a.workspace);
  const FormatLimits lim = format_limits(a.format);
  // The tables are large; keep them off the stack.
  static thread_local SmallTable small;
  static thread_local LargeTable large;
  std::size_t first = 0;
  while (first < a.tensors.size()) {
    ScaleArg scale{a.scale, a.scale_per_tensor ? 1 : 0, a.has_scale_value ? a.scale_value : 1.0f};
    if (a.scale != nullptr && a.scale_per_tensor) scale.ptr = a.scale + first;
    double* out = a.out + first * kStatFields;
    std::size_t next;
    if (a.tensors.size() - first <= static_cast<std::size_t>(SmallTable::capacity)) {
      next = fill_table(small, a.tensors, first, kStatsChunk);
      launch_table(small, a, scale, lim, partials, out, stream);
    } else {
      next = fill_table(large, a.tensors, first, kStatsChunk);
      launch_table(large, a, scale, lim, partials, out, stream);
    }
    // Partials are indexed per launch, one a chunk; advance past this
    // launch's chunks.
    std::int64_t used = 0;
    for (std::size_t i = first; i < next; ++i) used += (a.tensors[i].numel + kStatsChunk - 1) / kStatsChunk;
    partials += used;
    first = next;
  }
}

}  // namespace aamp
