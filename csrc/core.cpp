#include "core.h"

#include <algorithm>
#include <numeric>

namespace aamp {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3FN: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kInt32: return "int32";
  }
  return "unknown";
}

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3FN: return 1;
    case DType::kFloat8E5M2: return 1;
    case DType::kInt32: return 4;
  }
  return 0;
}

DType dtype_from_code(int code, const std::string& arg) {
  if (code < 0 || code > static_cast<int>(DType::kInt32)) {
    throw_dtype(arg, "unknown dtype code " + std::to_string(code));
  }
  return static_cast<DType>(code);
}

void throw_argument(const std::string& arg, const std::string& what) {
  throw ArgumentError(arg + ": " + what);
}

void throw_dtype(const std::string& arg, const std::string& what) {
  throw DTypeError(arg + ": " + what);
}

void check_no_overlap(const std::vector<TensorRef>& tensors, const char* list_name) {
  std::vector<std::size_t> order;
  order.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel > 0) order.push_back(i);
  }
  auto begin = [&](std::size_t i) { return reinterpret_cast<std::uintptr_t>(tensors[i].data); };
  auto end = [&](std::size_t i) {
    return begin(i) + static_cast<std::uintptr_t>(tensors[i].numel) * dtype_size(tensors[i].dtype);
  };
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return begin(a) < begin(b) || (begin(a) == begin(b) && a < b);
  });
  // After sorting by start, an overlap always shows between neighbours once
  // we carry the furthest end seen so far.
  std::size_t reach_owner = 0;
  std::uintptr_t reach = 0;
  for (std::size_t k = 0; k < order.size(); ++k) {
    std::size_t i = order[k];
    if (k > 0 && begin(i) < reach) {
      std::size_t a = std::min(i, reach_owner), b = std::max(i, reach_owner);
      throw_argument(item_name(list_name, b),
                     "shares memory with " + item_name(list_name, a) +
                         "; an in-place op would update the shared elements twice. "
                         "Pass each tensor once (deduplicate the list).");
    }
    if (end(i) > reach) {
      reach = end(i);
      reach_owner = i;
    }
  }
}

void check_outside(const std::vector<TensorRef>& tensors, const char* list_name, const void* p, const char* arg) {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto begin = reinterpret_cast<std::uintptr_t>(tensors[i].data);
    const auto end = begin + static_cast<std::uintptr_t>(tensors[i].numel) * dtype_size(tensors[i].dtype);
    if (tensors[i].numel > 0 && at + 4 > begin && at < end) {
      throw_argument(arg, "shares memory with " + item_name(list_name, i) + "; pass a separate 1-element tensor");
    }
  }
}

void check_disjoint(const std::vector<NamedSpan>& spans) {
  for (std::size_t i = 0; i < spans.size(); ++i) {
    for (std::size_t j = i + 1; j < spans.size(); ++j) {
      if (spans[i].data == nullptr || spans[j].data == nullptr) continue;
      const auto a = reinterpret_cast<std::uintptr_t>(spans[i].data);
      const auto b = reinterpret_cast<std::uintptr_t>(spans[j].data);
      if (a < b + spans[j].bytes && b < a + spans[i].bytes) {
        throw_argument(spans[j].name, std::string("shares memory with ") + spans[i].name +
                                          "; each state array must be its own tensor");
      }
    }
  }
}

bool cuda_built() {
#ifdef AAMP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string cuda_archs() {
#ifdef AAMP_CUDA_ARCHS
  return AAMP_CUDA_ARCHS;
#else
  return "";
#endif
}

#ifndef AAMP_WITH_CUDA
// CPU-only build: cuda_device.cu is not compiled.
int cuda_runtime_version() { return 0; }
int cuda_device_count() { return 0; }
#endif

}  // namespace aamp
