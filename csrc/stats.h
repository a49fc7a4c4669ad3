// Op family: per-tensor statistics of many tensors in one pass.
//
// Contract (CPU and CUDA implementations have the same semantics; the
// counts, min, max, amax and min_abs_nonzero are exact and identical on both,
// mean, std and l2_norm agree to rounding):
//
//   for every tensor t of the list, with x its elements as fp32 (exact for
//   fp16 and bf16) and F the finite ones, out[t * kStatFields + field] is
//
//     numel            number of elements
//     nan_count        elements that are NaN
//     inf_count        elements that are +-inf
//     zero_count       elements that are +-0
//     min, max         smallest / largest value of F
//     amax             largest |x| of F
//     min_abs_nonzero  smallest nonzero |x| of F
//     mean             mean of F
//     std              standard deviation of F with correction 1 (as torch.std)
//     l2_norm          sqrt(sum of x^2 over F)
//     dynamic_range    log2(amax / min_abs_nonzero)
//   and, with a format (float16, bfloat16, float8_e4m3fn, float8_e5m2; M its
//   largest finite value), per x in F, with y = fp32(x * s) (the fp32
//   product, round to nearest even; s the tensor's scale, 1 without one):
//     overflow_count   |y| > M (including a product that overflows fp32)
//     underflow_count  x != 0, s != 0, and y cast to the format with round to
//                      nearest even is +-0
//     subnormal_count  y cast to the format is a nonzero subnormal
//   (written as 0 without a format).
//
//   A value statistic with nothing to measure is NaN: min, max, amax, mean
//   and l2_norm when F is empty, std when F has fewer than two elements,
//   min_abs_nonzero and dynamic_range when F has no nonzero element. All
//   fields are fp64; counts are exact integers.
//
//   * The scale is none, one value for every tensor (a host number, or one
//     fp32 value in the memory of the place), or one fp32 value per tensor in
//     the memory of the place: read there, no host sync. A non-finite or zero
//     scale is allowed (x * inf overflows; nothing underflows).
//   * tensors: float32, float16 or bfloat16, any mix; views at any element
//     alignment; empty ones get numel 0 and NaN statistics.
//   * Deterministic: every tensor is cut into fixed chunks of kStatsChunk
//     elements; each chunk's partial results are reduced in a fixed order,
//     then per tensor in chunk order, so results are bitwise the same run to
//     run and independent of thread and block counts. Counts and extrema are
//     integer reductions (order-free). Moments: small groups of elements
//     (a GPU thread's share of a chunk, a CPU block) sum x - pivot in fp32,
//     the pivot being a finite element of the chunk (GPU: its first
//     element, or when that is not finite, the first finite one of the
//     lowest thread that has one) or of the block (CPU: its first finite
//     one), 0 if there is none; a group whose sums cannot be trusted (a NaN
//     or inf, squares that overflow or underflow fp32, or a pivot far from
//     the group's mean, i.e. cancellation) is summed again in fp64. On the
//     GPU the groups of a chunk share its pivot and their sums add up in
//     fp64 in a fixed order; CPU blocks become (count, mean, M2) in fp64 and
//     merge with Chan's formula into their chunk. Per tensor, every chunk's
//     sums are shifted in fp64 to one reference, the mean of the tensor's
//     first chunk with a finite element, and added; M2 = ss - s^2/n. That
//     subtraction cancels at most a factor 1 + n/n0 (n0 the finite count of
//     that first chunk, because M2 >= n0 (mean0 - mean)^2): with a full
//     first chunk, n/65536, so std stays accurate for large tensors and for
//     |mean| >> std. When it cancelled more than kStatsMaxMergeCancellation
//     (a first counted chunk of a few finite outliers), the partials are
//     added again against the mean so found (stats_math.h).
//   * The caller provides `workspace` of stats_workspace_bytes(...) bytes and
//     `out` of tensors.size() * kStatFields doubles (the core allocates
//     nothing). Nothing is written before every argument is validated;
//     errors name the argument (tensors[i], format, scale, out, workspace).
#pragma once

#include <cstdint>
#include <vector>

#include "core.h"

namespace aamp {

// The columns of `out`, in order. Part of the binding ABI: only append.
enum StatField : int {
  kStatNumel = 0,
  kStatNanCount,
  kStatInfCount,
  kStatZeroCount,
  kStatMin,
  kStatMax,
  kStatAmax,
  kStatMinAbsNonzero,
  kStatMean,
  kStatStd,
  kStatL2Norm,
  kStatDynamicRange,
  kStatOverflowCount,
  kStatUnderflowCount,
  kStatSubnormalCount,
  kStatFields
};

// Their names, as the Python API shows them (index = StatField).
extern const char* const kStatFieldNames[kStatFields];

struct StatsArgs {
  std::vector<TensorRef> tensors;
  bool has_format = false;
  DType format = DType::kFloat16;  // with has_format: float16, bfloat16, float8_e4m3fn or float8_e5m2
  const float* scale = nullptr;    // place memory: 1 value, or one per tensor with scale_per_tensor
  bool scale_per_tensor = false;
  bool has_scale_value = false;    // a host number instead (exclusive with scale)
  float scale_value = 1.0f;
  double* out = nullptr;           // tensors.size() * kStatFields, place memory
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  Place place;
};

// Elements per chunk: the unit of parallel work and of the deterministic
// partial reduction. On the H200, 65536 read the GPT-2 set at 89-90% of the
// read ceiling against 82% for 16384 and 32768 and 86% for 131072: a block
// that streams 256 KB spends less of its life starting and reducing, and
// the finishing kernel, whose slowest block is the one of the largest
// tensor, has a quarter of the partials to read.
constexpr std::int64_t kStatsChunk = 65536;

// Workspace slots per chunk: both the CUDA and the CPU kernel keep one
// partial per chunk.
constexpr int kStatsPartialsPerChunk = 1;

// The partial results of one chunk. Moments are of the finite x: their
// count and the sums s = sum(x - ref), ss = sum((x - ref)^2) against a
// reference point of the chunk's choosing (the GPU: the chunk's pivot, with
// its own sums; the CPU: the chunk's mean, s = 0 and ss = M2). Per tensor the
// partials are shifted to one reference and added (StatsTotals). Extrema are
// kept as integer keys so that they reduce exactly in any order:
// min_key/max_key order floats (-0 < +0), abs_key is 2*|x|bits - 2
// (unsigned, so zeros wrap to the top and never win a min). A default
// StatsPartial is empty: it adds nothing to a reduction.
struct alignas(16) StatsPartial {  // four 16-byte loads on the GPU
  double ref = 0.0;
  double s = 0.0;
  double ss = 0.0;
  std::uint32_t count = 0;  // finite elements
  std::uint32_t zero = 0, nan = 0, inf = 0;
  std::uint32_t at_most_lo = 0;  // finite x with |y| <= half the smallest subnormal of the format
  std::uint32_t below_hi = 0;    // finite x with |y| below the subnormal/normal rounding boundary
  std::uint32_t over = 0;        // finite x with |y| > M
  std::int32_t min_key = 0x7fffffff, max_key = static_cast<std::int32_t>(0x80000000u);
  std::uint32_t abs_key = 0xffffffffu;
};
static_assert(sizeof(StatsPartial) == 64, "the workspace holds one 64-byte partial per chunk");

std::size_t stats_workspace_bytes(const std::vector<TensorRef>& tensors);

bool is_stats_format(DType t);

// Validates everything; throws before any write.
void validate_stats(const StatsArgs& a);

void tensor_stats(const StatsArgs& a);  // validates, then dispatches

void tensor_stats_cpu(const StatsArgs& a);
void tensor_stats_cuda(const StatsArgs& a);

}  // namespace aamp
