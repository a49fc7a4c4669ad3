// CUDA implementation of the fused optimizers (contract in optim.h).
//
// One launch per table of tensors (a whole param group of a typical model;
// longer lists are cut into tables of kLargeCap): the tensors' pointers,
// step pointers and Philox indices travel in the kernel parameters, so the
// launch needs no copy and no allocation. The list is cut into chunks of
// kChunk elements; a block takes one chunk at a time (binary search for its
// tensor), computes the tensor's bias corrections once, and updates the
// chunk in vectors of 8 elements: one 16-byte load of each bf16 array (two
// of each fp32 one) and two Philox calls per bf16 array written. Chunks
// start at multiples of 8 elements, so a tensor whose four arrays are
// 16-byte aligned takes the vector path everywhere but its tail; views with
// storage offsets take a scalar path. The random words depend only on the
// tensor's index and the element's, never on the thread, and the
// per-element rule is optim_rule.h's, so the results equal the CPU kernel's.
// found_inf and grad_scale are read on the device: a skipped step returns
// before any load, with no host synchronization.
//
// Tensors are grouped by (param dtype, moment dtype) into tables, whatever
// their order in the list: a model whose bf16 matmul weights alternate with
// fp32 norms (bf16-weights) takes one launch per kind, not one per run of a
// dtype. The results do not depend on it: a tensor's random words follow its
// index in the list, which the table carries.
//
// Gradient statistics: each thread sums g*g over its elements of a chunk in
// fp32, the block adds its threads in a fixed tree and writes one partial per
// chunk to the workspace; optim_sumsq_kernel then adds a tensor's partials in
// a fixed order in double. Deterministic, and independent of the grid size.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda_utils.cuh"
#include "multi_tensor.cuh"  // table_find
#include "optim.h"
#include "optim_rule.h"
#include "philox.h"
#include "sround.h"

namespace aamp {

namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kChunk = kOptimSumsqChunk;  // elements; a multiple of the 8-element vector
constexpr int kVec = 8;
static_assert(kChunk % kVec == 0, "chunks start at whole vectors");

template <int kCap>
struct OptimTable {
  static constexpr int capacity = kCap;
  void* param[kCap];
  const void* grad[kCap];
  void* m[kCap];
  void* v[kCap];
  const float* step[kCap];
  std::uint32_t index[kCap];  // k: the tensor's place in the whole list (its Philox offsets)
  std::uint32_t meta[kCap];   // bit 0: SGD's first step; above: elements in the last chunk - 1
  std::uint32_t chunk_begin[kCap + 1];
  int count;
};
using OptimSmallTable = OptimTable<64>;
using OptimLargeTable = OptimTable<560>;
static_assert(sizeof(OptimLargeTable) <= 32764 - 512, "optimizer table exceeds the kernel parameter limit");

struct Launch {
  optim_rule::Scalars s;
  const float* grad_scale;
  const float* found_inf;
  std::uint64_t seed, offset;
  const std::uint64_t* seed_offset;
  bool sr;
  float* partials;  // with statistics: one per chunk of this launch's table, else null
};

// The sum of the block's `x` in a fixed order (warps by shuffle tree, then
// warp 0 over the warp sums). Valid in thread 0; every thread must call it.
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = __fadd_rn(x, __shfl_down_sync(0xffffffffu, x, o));
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kThreads / 32 ? warp_sums[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = __fadd_rn(x, __shfl_down_sync(0xffffffffu, x, o));
  }
  __syncthreads();  // the next chunk reuses warp_sums
  return x;
}

template <class T>
struct Store;  // one array's 8 elements: raw storage and fp32 values
template <>
struct Store<float> {
  static constexpr int kLoads = 2;  // uint4 per 8 elements
  __device__ static float get(const uint4 (&raw)[2], int e) {
    const unsigned w[8] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w, raw[1].x, raw[1].y, raw[1].z, raw[1].w};
    return __uint_as_float(w[e]);
  }
  __device__ static float load1(const void* p, std::int64_t i) { return static_cast<const float*>(p)[i]; }
  __device__ static void store1(void* p, std::int64_t i, float y, std::uint32_t, bool) {
    static_cast<float*>(p)[i] = y;
  }
};
template <>
struct Store<std::uint16_t> {
  static constexpr int kLoads = 1;
  __device__ static float get(const uint4 (&raw)[1], int e) {
    const unsigned w[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
    const unsigned half = (e & 1) ? (w[e >> 1] >> 16) : (w[e >> 1] & 0xffffu);
    return __uint_as_float(half << 16);
  }
  __device__ static float load1(const void* p, std::int64_t i) {
    return bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
  }
  __device__ static void store1(void* p, std::int64_t i, float y, std::uint32_t r, bool sr) {
    static_cast<std::uint16_t*>(p)[i] = optim_rule::to_bf16(y, r, sr);
  }
};

template <class T>
__device__ __forceinline__ void load_vec(uint4 (&raw)[Store<T>::kLoads], const void* base, std::int64_t vec) {
  const uint4* p = static_cast<const uint4*>(base) + vec * Store<T>::kLoads;
#pragma unroll
  for (int u = 0; u < Store<T>::kLoads; ++u) raw[u] = p[u];
}

// 8 fp32 values into the array's storage; bf16 values take the words r.
template <class T>
__device__ __forceinline__ void store_vec(void* base, std::int64_t vec, const float (&y)[kVec],
                                          const std::uint32_t (&r)[kVec], bool sr) {
  if constexpr (sizeof(T) == 4) {
    uint4* p = static_cast<uint4*>(base) + vec * 2;
    p[0] = make_uint4(__float_as_uint(y[0]), __float_as_uint(y[1]), __float_as_uint(y[2]), __float_as_uint(y[3]));
    p[1] = make_uint4(__float_as_uint(y[4]), __float_as_uint(y[5]), __float_as_uint(y[6]), __float_as_uint(y[7]));
  } else {
    unsigned w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      w[q] = static_cast<unsigned>(optim_rule::to_bf16(y[2 * q], r[2 * q], sr)) |
             (static_cast<unsigned>(optim_rule::to_bf16(y[2 * q + 1], r[2 * q + 1], sr)) << 16);
    }
    static_cast<uint4*>(base)[vec] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// The words of stream s for the 8 elements from `first` (a multiple of 8).
__device__ __forceinline__ void draw8(std::uint32_t (&r)[kVec], std::uint64_t seed, std::uint64_t off,
                                      std::int64_t first) {
  const std::uint64_t g = static_cast<std::uint64_t>(first / kSroundGroup);
  const PhiloxBits a = philox_group(seed, off, g), b = philox_group(seed, off, g + 1);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    r[q] = a.w[q];
    r[q + 4] = b.w[q];
  }
}

__device__ __forceinline__ std::uint32_t word_of(std::uint64_t seed, std::uint64_t off, std::int64_t i) {
  const PhiloxBits w = philox_group(seed, off, static_cast<std::uint64_t>(i / kSroundGroup));
  return w.w[i % kSroundGroup];
}

template <class Table, class P, class M, bool kAdam, bool kStats>
__global__ void __launch_bounds__(kThreads) optim_kernel(const __grid_constant__ Table table, const Launch l) {
  if (l.found_inf != nullptr && *l.found_inf != 0.0f) return;  // skipped: nothing is read or written
  constexpr bool kP16 = sizeof(P) == 2, kM16 = sizeof(M) == 2;
  optim_rule::Scalars s = l.s;
  if (l.grad_scale != nullptr) s.grad_scale = *l.grad_scale;
  std::uint64_t seed = l.seed, offset = l.offset;
  if (l.seed_offset != nullptr) {
    seed = l.seed_offset[0];
    offset = l.seed_offset[1];
  }
  const bool sr = l.sr;
  const bool has_m = kAdam || s.momentum;
  const unsigned total = table.chunk_begin[table.count];
  for (unsigned c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = table_find(table, c);
    const unsigned local = c - table.chunk_begin[t];
    const unsigned last = table.chunk_begin[t + 1] - table.chunk_begin[t] - 1;
    const unsigned meta = table.meta[t];
    const std::int64_t n = local == last ? static_cast<std::int64_t>(meta >> 1) + 1 : kChunk;
    const std::int64_t begin = static_cast<std::int64_t>(local) * kChunk;
    const bool first = (meta & 1u) != 0;
    const std::uint64_t off0 = offset + kOptimStreams * static_cast<std::uint64_t>(table.index[t]);
    void* param = table.param[t];
    const void* grad = table.grad[t];
    void* m = table.m[t];
    void* v = table.v[t];
    float step_size = 0.0f, bc2_sqrt = 1.0f;
    if (kAdam) {
      const BiasCorrection bc = optim_bias_correction(s.c.beta1_d, s.c.beta2_d, __fadd_rn(*table.step[t], 1.0f));
      step_size = optim_rule::div(s.c.lr, bc.bc1);
      bc2_sqrt = bc.bc2_sqrt;
    }
    const auto aligned = [](const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; };
    // Element offsets in bytes of each array at `begin` keep the 16-byte alignment of its base.
    const bool vec = aligned(param) && aligned(grad) && (!has_m || aligned(m)) && (!kAdam || aligned(v));
    std::int64_t done = 0;
    float ss = 0.0f;  // this thread's g*g over the chunk (kStats)
    if (vec) {
      const std::int64_t nvec = n / kVec, v0 = begin / kVec;
      for (std::int64_t j = threadIdx.x; j < nvec; j += kThreads) {
        const std::int64_t vi = v0 + j, e0 = vi * kVec;
        uint4 praw[Store<P>::kLoads], graw[Store<P>::kLoads], mraw[Store<M>::kLoads], vraw[Store<M>::kLoads];
        load_vec<P>(praw, param, vi);
        load_vec<P>(graw, grad, vi);
        if (has_m) load_vec<M>(mraw, m, vi);
        if (kAdam) load_vec<M>(vraw, v, vi);
        float pv[kVec], mv[kVec], vv[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          float p = Store<P>::get(praw, e);
          const float g = optim_rule::grad_in(Store<P>::get(graw, e), s);
          if (kStats) ss = __fadd_rn(ss, __fmul_rn(g, g));
          float mm = has_m ? Store<M>::get(mraw, e) : 0.0f;
          if (kAdam) {
            float vq = Store<M>::get(vraw, e);
            optim_rule::adamw(p, mm, vq, g, step_size, bc2_sqrt, s);
            vv[e] = vq;
          } else {
            optim_rule::sgd(p, mm, g, first, s);
          }
          pv[e] = p;
          mv[e] = mm;
        }
        std::uint32_t r[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (kM16 && sr && has_m) draw8(r, seed, off0 + 1, e0);
        if (has_m) store_vec<M>(m, vi, mv, r, sr);
        if (kAdam) {
          if (kM16 && sr) draw8(r, seed, off0 + 2, e0);
          store_vec<M>(v, vi, vv, r, sr);
        }
        if (kP16 && sr) draw8(r, seed, off0, e0);
        store_vec<P>(param, vi, pv, r, sr);
      }
      done = nvec * kVec;
    }
    // Scalar path: unaligned views, and the tail of the last chunk.
    for (std::int64_t j = done + threadIdx.x; j < n; j += kThreads) {
      const std::int64_t i = begin + j;
      float p = Store<P>::load1(param, i);
      const float g = optim_rule::grad_in(Store<P>::load1(grad, i), s);
      if (kStats) ss = __fadd_rn(ss, __fmul_rn(g, g));
      float mm = has_m ? Store<M>::load1(m, i) : 0.0f;
      if (kAdam) {
        float vq = Store<M>::load1(v, i);
        optim_rule::adamw(p, mm, vq, g, step_size, bc2_sqrt, s);
        Store<M>::store1(v, i, vq, kM16 && sr ? word_of(seed, off0 + 2, i) : 0u, sr);
      } else {
        optim_rule::sgd(p, mm, g, first, s);
      }
      if (has_m) Store<M>::store1(m, i, mm, kM16 && sr ? word_of(seed, off0 + 1, i) : 0u, sr);
      Store<P>::store1(param, i, p, kP16 && sr ? word_of(seed, off0, i) : 0u, sr);
    }
    if (kStats) {
      ss = block_sum(ss);
      if (threadIdx.x == 0) l.partials[c] = ss;
    }
  }
}

// One block per tensor of the table: its chunks' partials in a fixed order, in
// double (each thread a strided run, then a fixed tree), rounded once to
// fp32; NaN for every tensor when the step was skipped (the partials were
// never written).
constexpr int kSumThreads = 128;

template <class Table>
__global__ void __launch_bounds__(kSumThreads)
    optim_sumsq_kernel(const __grid_constant__ Table table, const float* __restrict__ partials,
                       const float* __restrict__ found_inf, float* __restrict__ grad_sumsq) {
  const int t = blockIdx.x;
  float* out = grad_sumsq + table.index[t];
  if (found_inf != nullptr && *found_inf != 0.0f) {
    if (threadIdx.x == 0) *out = __int_as_float(0x7fc00000);
    return;
  }
  double x = 0.0;
  for (unsigned c = table.chunk_begin[t] + threadIdx.x; c < table.chunk_begin[t + 1]; c += kSumThreads) {
    x = __dadd_rn(x, static_cast<double>(partials[c]));
  }
  __shared__ double sums[kSumThreads];
  sums[threadIdx.x] = x;
  __syncthreads();
  for (int half = kSumThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) sums[threadIdx.x] = __dadd_rn(sums[threadIdx.x], sums[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = __double2float_rn(sums[0]);
}

// Tensors order[pos], order[pos + 1], ... (all of one kind) into the table, as many as fit; returns the
// position after the last one taken.
template <class Table>
std::size_t fill(Table& table, const OptimArgs& a, const std::vector<std::size_t>& order, std::size_t pos) {
  const bool adam = a.kind == OptimKind::kAdamW;
  const bool has_m = adam || a.momentum != 0.0;
  table.count = 0;
  std::uint64_t chunks = 0;
  for (; pos < order.size() && table.count < Table::capacity; ++pos) {
    const std::size_t k = order[pos];
    const std::int64_t numel = a.params[k].numel;
    const std::uint64_t nc = static_cast<std::uint64_t>((numel + kChunk - 1) / kChunk);
    if (chunks + nc > 0x7fffffffu) break;
    const std::int64_t last = numel > 0 ? numel - static_cast<std::int64_t>(nc - 1) * kChunk : 1;
    const int i = table.count;
    table.param[i] = a.params[k].data;
    table.grad[i] = a.grads[k].data;
    table.m[i] = has_m ? a.exp_avgs[k].data : nullptr;
    table.v[i] = adam ? a.exp_avg_sqs[k].data : nullptr;
    table.step[i] = adam ? a.steps[k] : nullptr;
    table.index[i] = static_cast<std::uint32_t>(k);
    table.meta[i] = (static_cast<std::uint32_t>(last - 1) << 1) | (!adam && has_m && a.first[k] ? 1u : 0u);
    table.chunk_begin[i] = static_cast<std::uint32_t>(chunks);
    chunks += nc;
    ++table.count;
  }
  table.chunk_begin[table.count] = static_cast<std::uint32_t>(chunks);
  return pos;
}

template <class Table, class P, class M, bool kStats>
void launch_kinds(const Table& table, const Launch& l, bool adam, float* grad_sumsq, cudaStream_t stream,
                  int device) {
  const unsigned total = table.chunk_begin[table.count];
  if (total > 0) {
    // A few waves of blocks; each loops over its chunks.
    const unsigned cap = static_cast<unsigned>(multiprocessor_count(device)) * 8u;
    const unsigned grid = std::min(total, cap);
    if (adam) {
      optim_kernel<Table, P, M, true, kStats><<<grid, kThreads, 0, stream>>>(table, l);
    } else {
      optim_kernel<Table, P, M, false, kStats><<<grid, kThreads, 0, stream>>>(table, l);
    }
    AAMP_CUDA_CHECK_LAUNCH("optim_kernel");
  }
  if (kStats && table.count > 0) {  // (empty tensors too: their sum is 0, or NaN for a skipped step)
    optim_sumsq_kernel<Table><<<static_cast<unsigned>(table.count), kSumThreads, 0, stream>>>(
        table, l.partials, l.found_inf, grad_sumsq);
    AAMP_CUDA_CHECK_LAUNCH("optim_sumsq_kernel");
  }
}

template <class Table, class P, class M>
void launch_stats(const Table& table, const Launch& l, bool adam, float* grad_sumsq, cudaStream_t stream,
                  int device) {
  grad_sumsq != nullptr ? launch_kinds<Table, P, M, true>(table, l, adam, grad_sumsq, stream, device)
                        : launch_kinds<Table, P, M, false>(table, l, adam, grad_sumsq, stream, device);
}

// One launch (two with statistics) for a table of one kind: p16, m16 say whether params / moments are bf16.
template <class Table>
void launch_table(const Table& table, const OptimArgs& a, bool p16, bool m16, const Launch& l, cudaStream_t stream,
                  int device) {
  const bool adam = a.kind == OptimKind::kAdamW;
  if (p16) {
    m16 ? launch_stats<Table, std::uint16_t, std::uint16_t>(table, l, adam, a.grad_sumsq, stream, device)
        : launch_stats<Table, std::uint16_t, float>(table, l, adam, a.grad_sumsq, stream, device);
  } else {
    m16 ? launch_stats<Table, float, std::uint16_t>(table, l, adam, a.grad_sumsq, stream, device)
        : launch_stats<Table, float, float>(table, l, adam, a.grad_sumsq, stream, device);
  }
}

}  // namespace

void optim_step_cuda(const OptimArgs& a) {
  if (a.params.empty()) return;
  DeviceGuard guard(a.place.device);
  cudaStream_t stream = as_stream(a.place.stream);
  Launch l;
  l.s.c = optim_consts(a);
  l.s.has_grad_scale = a.grad_scale != nullptr;
  l.s.grad_scale = 1.0f;
  l.s.maximize = a.maximize;
  l.s.wd = a.weight_decay != 0.0;
  l.s.momentum = a.kind == OptimKind::kSGD && a.momentum != 0.0;
  l.s.nesterov = a.nesterov;
  l.grad_scale = a.grad_scale;
  l.found_inf = a.found_inf;
  l.seed = a.seed;
  l.offset = a.offset;
  l.seed_offset = a.seed_offset;
  l.sr = a.stochastic_rounding;
  l.partials = a.grad_sumsq != nullptr ? static_cast<float*>(a.workspace) : nullptr;
  // The tables are large; keep them off the stack.
  static thread_local OptimSmallTable small;
  static thread_local OptimLargeTable large;
  // The tensors of each kind (param dtype, moment dtype), in list order.
  const bool has_m = a.kind == OptimKind::kAdamW || a.momentum != 0.0;
  std::vector<std::size_t> kinds[4];
  for (std::size_t k = 0; k < a.params.size(); ++k) {
    const bool p16 = a.params[k].dtype == DType::kBFloat16;
    const bool m16 = has_m && a.exp_avgs[k].dtype == DType::kBFloat16;
    kinds[(p16 ? 2 : 0) + (m16 ? 1 : 0)].push_back(k);
  }
  for (int kind = 0; kind < 4; ++kind) {
    const std::vector<std::size_t>& order = kinds[kind];
    const bool p16 = kind >= 2, m16 = (kind & 1) != 0;
    std::size_t pos = 0;
    while (pos < order.size()) {
      std::size_t next;
      std::uint32_t chunks;
      if (order.size() - pos <= static_cast<std::size_t>(OptimSmallTable::capacity)) {
        next = fill(small, a, order, pos);
        launch_table(small, a, p16, m16, l, stream, a.place.device);
        chunks = small.chunk_begin[small.count];
      } else {
        next = fill(large, a, order, pos);
        launch_table(large, a, p16, m16, l, stream, a.place.device);
        chunks = large.chunk_begin[large.count];
      }
      if (l.partials != nullptr) l.partials += chunks;  // each launch's partials after the last one's
      pos = next;
    }
  }
}

}  // namespace aamp
