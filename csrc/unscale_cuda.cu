// CUDA implementation of the unscale family (contract in unscale.h).
//
// Stage 1: one block per chunk of kUnscaleChunk elements, 16-byte vector
// loads when the tensor is aligned (a scalar path otherwise), the check, the
// scaling and the store fused; with stats, each warp of a chunk writes one
// partial (or, for a tensor of one chunk, the block writes the tensor's result).
// Stage 2 (stats, only when some tensor has several chunks or none): one block
// per tensor sums its partials in chunk order.
// Both stages are deterministic; found_inf is only ever set to 1.0f.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda_elements.cuh"
#include "cuda_utils.cuh"
#include "multi_tensor.cuh"
#include "unscale.h"

namespace aamp {

namespace {

#ifndef AAMP_UNSCALE_THREADS
#define AAMP_UNSCALE_THREADS 256
#endif
#ifndef AAMP_UNSCALE_UNROLL
#define AAMP_UNSCALE_UNROLL 4
#endif
// Both are build-time knobs for tuning sweeps (ADAPTIVE_AMP_NVCC_FLAGS).
constexpr int kThreads = AAMP_UNSCALE_THREADS;
constexpr int kUnroll = AAMP_UNSCALE_UNROLL;  // 16-byte loads in flight per thread
// The register budget allows two resident blocks per SM on every dtype path
// without spilling; lists of one dtype get a leaner kernel (kOnly below) that
// fits four.
constexpr int kMinBlocks = 2;
constexpr int kAnyDType = -1;

using elements::BF16;
using elements::F16;
using elements::F32;
using elements::Vec16;

struct Accum {
  bool bad = false;
  float sumsq = 0.0f;
  unsigned amax_bits = 0;
};

template <class E, bool kWrite, bool kStats>
__device__ __forceinline__ typename E::T step(typename E::T v, float inv, bool one, Accum& acc) {
  acc.bad |= E::nonfinite(v);
  const float f = E::load(v);
  const float y = one ? f : f * inv;
  if (kStats) {
    acc.sumsq = fmaf(y, y, acc.sumsq);
    acc.amax_bits = max(acc.amax_bits, __float_as_uint(y) & 0x7fffffffu);
  }
  return kWrite ? E::store(y) : v;
}


template <class E, bool kWrite, bool kStats>
__device__ __forceinline__ void run_chunk(typename E::T* __restrict__ x, int n, float inv, bool one, bool write,
                                          Accum& acc) {
  using T = typename E::T;
  constexpr int kPer = 16 / sizeof(T);
  int done = 0;
  if ((reinterpret_cast<std::uintptr_t>(x) & 15u) == 0) {
    uint4* xv = reinterpret_cast<uint4*>(x);
    const int nvec = n / kPer;
    for (int base = threadIdx.x; base < nvec; base += kThreads * kUnroll) {
      Vec16<E> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int idx = base + u * kThreads;
        if (idx < nvec) v[u].raw = xv[idx];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int idx = base + u * kThreads;
        if (idx < nvec) {
#pragma unroll
          for (int k = 0; k < kPer; ++k) v[u].e[k] = step<E, kWrite, kStats>(v[u].e[k], inv, one, acc);
          if (kWrite && write) xv[idx] = v[u].raw;
        }
      }
    }
    done = nvec * kPer;
  }
  for (int i = done + threadIdx.x; i < n; i += kThreads) {
    T r = step<E, kWrite, kStats>(x[i], inv, one, acc);
    if (kWrite && write) x[i] = r;
  }
}

constexpr int kWarps = kThreads / 32;
static_assert(kWarps <= kUnscalePartialsPerChunk, "workspace holds kUnscalePartialsPerChunk partials a chunk");

// Warp-wide reduction in a fixed order (shuffle tree). Valid in lane 0.
__device__ __forceinline__ void warp_reduce(float& sumsq, unsigned& amax_bits) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sumsq += __shfl_down_sync(0xffffffffu, sumsq, o);
    amax_bits = max(amax_bits, __shfl_down_sync(0xffffffffu, amax_bits, o));
  }
}

// Block-wide reduction in a fixed order: warps by shuffle, then warp 0 over
// the warp results. Valid in thread 0.
__device__ __forceinline__ void block_reduce(float& sumsq, unsigned& amax_bits) {
  __shared__ float s_sum[kThreads / 32];
  __shared__ unsigned s_max[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_reduce(sumsq, amax_bits);
  if (lane == 0) {
    s_sum[warp] = sumsq;
    s_max[warp] = amax_bits;
  }
  __syncthreads();
  if (warp == 0) {
    sumsq = lane < kThreads / 32 ? s_sum[lane] : 0.0f;
    amax_bits = lane < kThreads / 32 ? s_max[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sumsq += __shfl_down_sync(0xffffffffu, sumsq, o);
      amax_bits = max(amax_bits, __shfl_down_sync(0xffffffffu, amax_bits, o));
    }
  }
  __syncthreads();  // the next chunk reuses the shared arrays
}

// kOnly: the dtype of every tensor in the table, or kAnyDType for a mix
// (each chunk then dispatches on its tensor's dtype).
template <class Table, bool kWrite, bool kStats, int kOnly>
__global__ void __launch_bounds__(kThreads, kOnly == kAnyDType ? kMinBlocks : 2 * kMinBlocks)
    unscale_kernel(const __grid_constant__ Table table, float* __restrict__ found_inf,
                   const float* __restrict__ inv_scale, UnscalePartial* __restrict__ partials,
                   float* __restrict__ sumsq, float* __restrict__ amax) {
  const float inv = *inv_scale;
  const bool one = inv == 1.0f;
  // Writing y == x back changes nothing; skip the stores (torch writes them).
  const bool write = !one;
  const unsigned total = table.chunk_begin[table.count];
  bool bad = false;
  for (unsigned c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = table_find(table, c);
    const unsigned local = c - table.chunk_begin[t];
    const unsigned last = table.chunk_begin[t + 1] - table.chunk_begin[t] - 1;
    const unsigned meta = table.meta[t];
    const int n = local == last ? static_cast<int>(meta >> 4) + 1 : static_cast<int>(kUnscaleChunk);
    const std::int64_t offset = static_cast<std::int64_t>(local) * kUnscaleChunk;
    Accum acc;
    switch (kOnly == kAnyDType ? static_cast<DType>(meta & 15u) : static_cast<DType>(kOnly)) {
      case DType::kFloat32:
        run_chunk<F32, kWrite, kStats>(static_cast<float*>(table.data[t]) + offset, n, inv, one, write, acc);
        break;
      case DType::kFloat16:
        run_chunk<F16, kWrite, kStats>(static_cast<unsigned short*>(table.data[t]) + offset, n, inv, one, write,
                                       acc);
        break;
      default:
        run_chunk<BF16, kWrite, kStats>(static_cast<unsigned short*>(table.data[t]) + offset, n, inv, one, write,
                                        acc);
        break;
    }
    bad |= acc.bad;
    if (kStats) {
      if (last == 0) {  // a one-chunk tensor: reduce the block, write the result
        block_reduce(acc.sumsq, acc.amax_bits);
        if (threadIdx.x == 0) {
          sumsq[t] = static_cast<float>(static_cast<double>(acc.sumsq));
          amax[t] = __uint_as_float(acc.amax_bits);
        }
      } else {  // one partial per warp, no barrier; unscale_finish_kernel sums them
        warp_reduce(acc.sumsq, acc.amax_bits);
        if ((threadIdx.x & 31) == 0) {
          partials[static_cast<std::size_t>(c) * kWarps + (threadIdx.x >> 5)] =
              UnscalePartial{acc.sumsq, acc.amax_bits};
        }
      }
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

// One block per tensor of none or several chunks: its partials (chunk by
// chunk, warp by warp) in a fixed order, in double. (One-chunk tensors were finished by unscale_kernel.) A
// whole block, not a warp, so that the largest tensors' thousands of partials
// are read with many loads in flight rather than one latency at a time.
// The finishing blocks are wide: the largest tensor (GPT-2's embedding, ~19k
// warp partials) would otherwise keep one block busy long after the rest.
constexpr int kFinishThreads = 1024;

template <class Table>
__global__ void __launch_bounds__(kFinishThreads)
    unscale_finish_kernel(const __grid_constant__ Table table, const UnscalePartial* __restrict__ partials,
                          float* __restrict__ sumsq, float* __restrict__ amax) {
  const int t = blockIdx.x;
  const unsigned begin = table.chunk_begin[t], end = table.chunk_begin[t + 1];
  if (end - begin == 1) return;
  double s = 0.0;
  unsigned m = 0;
  const std::size_t last = static_cast<std::size_t>(end) * kWarps;
  std::size_t p = static_cast<std::size_t>(begin) * kWarps + threadIdx.x;
  // The largest tensors have tens of thousands of partials: load kBatch of a
  // thread's partials before adding any, so their latencies overlap. The
  // additions keep the plain loop's order, so the result does not change.
  constexpr int kBatch = 8;
  for (; p + (kBatch - 1) * kFinishThreads < last; p += kBatch * kFinishThreads) {
    UnscalePartial v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) v[u] = partials[p + u * kFinishThreads];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      s += v[u].sumsq;
      m = max(m, v[u].amax_bits);
    }
  }
  for (; p < last; p += kFinishThreads) {
    s += partials[p].sumsq;
    m = max(m, partials[p].amax_bits);
  }
  __shared__ double s_sum[kFinishThreads / 32];
  __shared__ unsigned s_max[kFinishThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_down_sync(0xffffffffu, s, o);
    m = max(m, __shfl_down_sync(0xffffffffu, m, o));
  }
  if (lane == 0) {
    s_sum[warp] = s;
    s_max[warp] = m;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kFinishThreads / 32; ++w) {
      s += s_sum[w];
      m = max(m, s_max[w]);
    }
    sumsq[t] = static_cast<float>(s);
    amax[t] = __uint_as_float(m);
  }
}

template <class Table, bool kWrite, bool kStats, int kOnly>
void launch(const Table& table, const UnscaleArgs& a, std::size_t first, UnscalePartial* partials,
            cudaStream_t stream, int device) {
  const unsigned total = table.chunk_begin[table.count];
  if (total > 0) {
    // One block per chunk up to a cap; the kernel loops past it.
    const unsigned cap = static_cast<unsigned>(multiprocessor_count(device)) * 256u;
    const unsigned grid = std::min(total, cap);
    unscale_kernel<Table, kWrite, kStats, kOnly><<<grid, kThreads, 0, stream>>>(
        table, a.found_inf, a.inv_scale, partials, kStats ? a.sumsq + first : nullptr,
        kStats ? a.amax + first : nullptr);
    AAMP_CUDA_CHECK_LAUNCH("unscale_kernel");
  }
  bool all_one_chunk = true;
  for (int i = 0; i < table.count; ++i) all_one_chunk &= table.chunk_begin[i + 1] - table.chunk_begin[i] == 1;
  if (kStats && !all_one_chunk) {
    unscale_finish_kernel<Table><<<static_cast<unsigned>(table.count), kFinishThreads, 0, stream>>>(table, partials, a.sumsq + first, a.amax + first);
    AAMP_CUDA_CHECK_LAUNCH("unscale_finish_kernel");
  }
}

template <class Table, int kOnly>
void launch_modes(const Table& table, const UnscaleArgs& a, std::size_t first, UnscalePartial* partials,
                  cudaStream_t stream, int device) {
  const bool stats = a.sumsq != nullptr;
  if (a.check_only) {
    stats ? launch<Table, false, true, kOnly>(table, a, first, partials, stream, device)
          : launch<Table, false, false, kOnly>(table, a, first, partials, stream, device);
  } else {
    stats ? launch<Table, true, true, kOnly>(table, a, first, partials, stream, device)
          : launch<Table, true, false, kOnly>(table, a, first, partials, stream, device);
  }
}

// fp32-only lists (the common case: fp32 master gradients) get the
// specialized kernel; anything else the mixed one.
template <class Table>
void launch_table(const Table& table, const UnscaleArgs& a, std::size_t first, UnscalePartial* partials,
                  cudaStream_t stream, int device) {
  bool all_f32 = true;
  for (int i = 0; i < table.count; ++i) all_f32 &= (table.meta[i] & 15u) == static_cast<unsigned>(DType::kFloat32);
  if (all_f32) {
    launch_modes<Table, static_cast<int>(DType::kFloat32)>(table, a, first, partials, stream, device);
  } else {
    launch_modes<Table, kAnyDType>(table, a, first, partials, stream, device);
  }
}

}  // namespace

void unscale_and_check_cuda(const UnscaleArgs& a) {
  if (a.tensors.empty()) return;
  DeviceGuard guard(a.place.device);
  cudaStream_t stream = as_stream(a.place.stream);
  auto* partials = static_cast<UnscalePartial*>(a.workspace);
  // The tables are large; keep them off the stack.
  static thread_local SmallTable small;
  static thread_local LargeTable large;
  std::size_t first = 0;
  while (first < a.tensors.size()) {
    std::size_t next;
    if (a.tensors.size() - first <= static_cast<std::size_t>(SmallTable::capacity)) {
      next = fill_table(small, a.tensors, first, kUnscaleChunk);
      launch_table(small, a, first, partials, stream, a.place.device);
    } else {
      next = fill_table(large, a.tensors, first, kUnscaleChunk);
      launch_table(large, a, first, partials, stream, a.place.device);
    }
    // Partials are indexed per launch; advance past this launch's chunks.
    std::int64_t used = 0;
    for (std::size_t i = first; i < next; ++i) used += (a.tensors[i].numel + kUnscaleChunk - 1) / kUnscaleChunk;
    if (partials != nullptr) partials += used * kWarps;
    first = next;
  }
}

}  // namespace aamp
