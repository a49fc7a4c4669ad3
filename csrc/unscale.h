// Op family: fused unscale-and-check of gradients (the GradScaler hot path).
//
// Contract (CPU and CUDA implementations have identical semantics):
//
//   for every tensor t and element x of t:
//     if x is NaN or +-inf:       *found_inf = 1.0f       (else left as it was)
//     y = (*inv_scale == 1.0f) ? float(x) : float(x) * (*inv_scale)
//     unless check_only:          x = dtype(t)(y)         (round to nearest even)
//     with stats:                 sumsq[i] = sum(y*y), amax[i] = max|y|
//                                 (NaN if any y is NaN; 0 for an empty tensor)
//
//   This is torch's `_amp_foreach_non_finite_check_and_unscale_` element for
//   element (product in fp32, rounded back, the inv_scale == 1 shortcut),
//   extended to bf16, mixed dtypes in one list, a read-only mode, and the
//   per-tensor statistics that gradient clipping and the stability monitor
//   need, computed from the same read.
//
//   * inv_scale and found_inf are single fp32 values in the memory of the
//     place (device memory for CUDA): read and written there, no host sync.
//   * tensors: float32, float16 or bfloat16, any mix; empty ones are skipped.
//     In-place mode refuses tensors that overlap in memory.
//   * Deterministic: sumsq and amax reduce per fixed-size chunk, then per
//     tensor in chunk order, so results are bitwise the same run to run and
//     independent of the thread or block count.
//   * The caller provides `workspace` of unscale_workspace_bytes(...) bytes
//     when stats are requested (the core allocates nothing); it may be null
//     otherwise.
//   * Every argument is validated before any element is written; errors name
//     the argument (tensors[i], found_inf, inv_scale, sumsq, amax, workspace).
#pragma once

#include <cstdint>
#include <vector>

#include "core.h"

namespace aamp {

struct UnscaleArgs {
  std::vector<TensorRef> tensors;
  float* found_inf = nullptr;
  const float* inv_scale = nullptr;
  bool check_only = false;
  float* sumsq = nullptr;   // one per tensor, or null for no stats
  float* amax = nullptr;    // one per tensor, or null for no stats
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  Place place;
};

// Elements per chunk: the unit of parallel work and of the deterministic
// partial reduction. Exposed so tests can place specials at chunk edges.
constexpr std::int64_t kUnscaleChunk = 16384;

// The per-chunk partial kept in the workspace. amax is kept as the bit
// pattern of |y|: for non-negative floats integer order is float order, with
// every NaN above +inf, so an integer max propagates NaN deterministically.
struct UnscalePartial {
  float sumsq;
  std::uint32_t amax_bits;
};

// Workspace slots per chunk: the CUDA kernel keeps one partial per warp (no
// block-wide barrier on the hot path), the CPU one per chunk.
constexpr int kUnscalePartialsPerChunk = 16;

std::size_t unscale_workspace_bytes(const std::vector<TensorRef>& tensors, bool stats);

// Validates everything; throws before any write.
void validate_unscale(const UnscaleArgs& a);

void unscale_and_check(const UnscaleArgs& a);  // validates, then dispatches

void unscale_and_check_cpu(const UnscaleArgs& a);
void unscale_and_check_cuda(const UnscaleArgs& a);

}  // namespace aamp
