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
constexpr std::int64_t kChunk = 32768;  // elements; a multiple of the 8-element vector
constexpr int kVec = 8;

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
};

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

template <class Table, class P, class M, bool kAdam>
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
  }
}

template <class Table>
std::size_t fill(Table& table, const OptimArgs& a, std::size_t first_k) {
  const bool adam = a.kind == OptimKind::kAdamW;
  const bool has_m = adam || a.momentum != 0.0;
  table.count = 0;
  std::uint64_t chunks = 0;
  std::size_t k = first_k;
  const DType pd = a.params[first_k].dtype;
  const DType md = has_m ? a.exp_avgs[first_k].dtype : DType::kFloat32;
  for (; k < a.params.size() && table.count < Table::capacity; ++k) {
    // One kernel instance per (param dtype, moment dtype): a change starts a new launch.
    if (a.params[k].dtype != pd || (has_m && a.exp_avgs[k].dtype != md)) break;
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
  return k;
}

template <class Table, class P, class M>
void launch_kinds(const Table& table, const Launch& l, bool adam, cudaStream_t stream, int device) {
  const unsigned total = table.chunk_begin[table.count];
  if (total == 0) return;
  // A few waves of blocks; each loops over its chunks.
  const unsigned cap = static_cast<unsigned>(multiprocessor_count(device)) * 8u;
  const unsigned grid = std::min(total, cap);
  if (adam) {
    optim_kernel<Table, P, M, true><<<grid, kThreads, 0, stream>>>(table, l);
  } else {
    optim_kernel<Table, P, M, false><<<grid, kThreads, 0, stream>>>(table, l);
  }
  AAMP_CUDA_CHECK_LAUNCH("optim_kernel");
}

template <class Table>
void launch_table(const Table& table, const OptimArgs& a, std::size_t first_k, const Launch& l, cudaStream_t stream,
                  int device) {
  const bool adam = a.kind == OptimKind::kAdamW;
  const bool p16 = a.params[first_k].dtype == DType::kBFloat16;
  const bool m16 = (adam || a.momentum != 0.0) && a.exp_avgs[first_k].dtype == DType::kBFloat16;
  if (p16) {
    m16 ? launch_kinds<Table, std::uint16_t, std::uint16_t>(table, l, adam, stream, device)
        : launch_kinds<Table, std::uint16_t, float>(table, l, adam, stream, device);
  } else {
    m16 ? launch_kinds<Table, float, std::uint16_t>(table, l, adam, stream, device)
        : launch_kinds<Table, float, float>(table, l, adam, stream, device);
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
  // The tables are large; keep them off the stack.
  static thread_local OptimSmallTable small;
  static thread_local OptimLargeTable large;
  std::size_t k = 0;
  while (k < a.params.size()) {
    std::size_t next;
    if (a.params.size() - k <= static_cast<std::size_t>(OptimSmallTable::capacity)) {
      next = fill(small, a, k);
      launch_table(small, a, k, l, stream, a.place.device);
    } else {
      next = fill(large, a, k);
      launch_table(large, a, k, l, stream, a.place.device);
    }
    k = next;
  }
}

}  // namespace aamp
