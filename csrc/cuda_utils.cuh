// CUDA plumbing shared by the kernels: error checks that name what failed,
// a device guard, and cached device properties. The core never allocates
// and never synchronizes; these helpers only ask and check.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "core.h"

namespace aamp {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw CudaError(std::string(what) + " failed: " + cudaGetErrorString(err) + " (" + file + ":" +
                  std::to_string(line) + ")");
}

#define AAMP_CUDA_CHECK(expr)                                         \
  do {                                                                \
    cudaError_t aamp_err_ = (expr);                                   \
    if (aamp_err_ != cudaSuccess) {                                   \
      (void)cudaGetLastError(); /* clear the sticky launch error */  \
      ::aamp::throw_cuda(aamp_err_, #expr, __FILE__, __LINE__);       \
    }                                                                 \
  } while (0)

// Checks the launch that just happened (bad configuration, too many
// resources, missing kernel image for this GPU).
#define AAMP_CUDA_CHECK_LAUNCH(kernel_name) \
  ::aamp::check_launch(kernel_name, __FILE__, __LINE__)

inline void check_launch(const char* kernel_name, const char* file, int line) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda(err, (std::string("launch of ") + kernel_name).c_str(), file, line);
}

// Makes `device` current for this runtime for the guard's lifetime. The
// caller's framework has its own notion of the current device; ours must
// match the stream we were handed.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : target_(device) {
    AAMP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != target_) AAMP_CUDA_CHECK(cudaSetDevice(target_));
  }
  ~DeviceGuard() {
    if (previous_ != target_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int target_ = 0;
};

// Multiprocessor count of `device`, asked once per device.
int multiprocessor_count(int device);

inline cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// x * m + c and hi(x * m) + c as integer multiply-adds, which run on the FMA
// pipe. With m a power of two these are a shift and add, which ptxas would
// emit on the ALU pipe instead (LEA, LEA.HI); kernels that saturate the ALU
// pipe pass m in a register whose value ptxas cannot know (runtime_zero) to
// keep the multiply-add.
__device__ __forceinline__ unsigned imad(unsigned x, unsigned m, unsigned c) {
  unsigned d;
  asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(m), "r"(c));
  return d;
}
__device__ __forceinline__ unsigned imad_hi(unsigned x, unsigned m, unsigned c) {
  unsigned d;
  asm("mad.hi.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(m), "r"(c));
  return d;
}

// 0, from a value ptxas cannot fold (a count that is never negative, read
// from the kernel's parameters).
__device__ __forceinline__ unsigned runtime_zero(long long never_negative) {
  return static_cast<unsigned>(static_cast<unsigned long long>(never_negative) >> 63);
}

}  // namespace aamp
