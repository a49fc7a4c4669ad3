// CUDA loss-scale update: one thread runs update_scale_rule on device memory,
// so the step needs no host round trip and can be captured in a CUDA graph.
#include "cuda_utils.cuh"
#include "scale_update.h"

namespace aamp {

namespace {

__global__ void update_scale_kernel(ScaleUpdateArgs a) { update_scale_rule(a); }

}  // namespace

void update_scale_cuda(const ScaleUpdateArgs& a) {
  DeviceGuard guard(a.place.device);
  update_scale_kernel<<<1, 1, 0, as_stream(a.place.stream)>>>(a);
  AAMP_CUDA_CHECK_LAUNCH("update_scale_kernel");
}

}  // namespace aamp
