// Device queries for the bindings and the launch heuristics.
#include <mutex>
#include <unordered_map>

#include "cuda_utils.cuh"

namespace aamp {

int cuda_device_count() {
  int n = 0;
  // No driver or no GPU is an answer here, not an error.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

int cuda_runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return 0;
  return v;
}

int multiprocessor_count(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int count = 0;
  AAMP_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  cache[device] = count;
  return count;
}

}  // namespace aamp
