// adaptive_amp native core: the vocabulary every op family shares.
//
// The core is framework-agnostic. It sees raw pointers, element counts,
// dtype codes, a device index and a stream handle; it never includes torch
// headers, never allocates device memory, never synchronizes the device and
// never sees a Python object (bindings.cpp is the only file that does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace aamp {

// Element types the kernels know. The numbers are part of the binding ABI
// (adaptive_amp/_native.py mirrors them), so only ever append.
enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3FN = 3,
  kFloat8E5M2 = 4,
  kInt32 = 5,
};

const char* dtype_name(DType t);
std::size_t dtype_size(DType t);
// Throws TypeError (naming `arg`) unless `code` is one of the enum values.
DType dtype_from_code(int code, const std::string& arg);

// A contiguous run of `numel` elements of `dtype` starting at `data`.
// Views with storage offsets are ordinary TensorRefs: `data` need not be
// aligned beyond the element size.
struct TensorRef {
  void* data = nullptr;
  std::int64_t numel = 0;
  DType dtype = DType::kFloat32;
};

// Where a call runs: device < 0 is the host; otherwise a CUDA device index
// and a cudaStream_t passed as an integer handle (0 = legacy default stream).
struct Place {
  int device = -1;
  std::uintptr_t stream = 0;
  bool is_cuda() const { return device >= 0; }
};

// Errors. bindings.cpp maps them to Python exceptions:
//   ArgumentError (std::invalid_argument) -> ValueError
//   DTypeError                            -> TypeError
//   CudaError (std::runtime_error)        -> RuntimeError
// Messages name the offending argument, e.g. "tensors[3]: ...".
struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct DTypeError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_argument(const std::string& arg, const std::string& what);
[[noreturn]] void throw_dtype(const std::string& arg, const std::string& what);

inline std::string item_name(const char* list, std::size_t i) {
  return std::string(list) + "[" + std::to_string(i) + "]";
}

// Refuses in-place work on tensors that share memory: every shared element
// would be updated twice. O(n log n) over the list; names both culprits.
void check_no_overlap(const std::vector<TensorRef>& tensors, const char* list_name);

// Refuses a scalar (4 bytes at `p`, named `arg`) that lies inside one of the tensors.
void check_outside(const std::vector<TensorRef>& tensors, const char* list_name, const void* p, const char* arg);

// Refuses two of the named outputs (pointer, bytes; null pointers ignored) that share memory.
struct NamedSpan {
  const void* data;
  std::size_t bytes;
  const char* name;
};
void check_disjoint(const std::vector<NamedSpan>& spans);

// Build facts, for `adaptive_amp.build_info()`.
bool cuda_built();
std::string cuda_archs();
int cuda_runtime_version();  // 0 without CUDA
int cuda_device_count();     // 0 without CUDA, a driver or a GPU

}  // namespace aamp
