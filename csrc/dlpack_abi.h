// The DLPack data structures (ABI of the open DLPack specification, v1.x),
// enough to read an array's pointer, shape, dtype and device from a capsule.
#pragma once

#include <cstdint>

namespace aamp {
namespace dlpack {

struct DLDevice {
  std::int32_t device_type;  // 1 = CPU, 2 = CUDA, 3 = CUDA host (pinned), 13 = CUDA managed
  std::int32_t device_id;
};

struct DLDataType {
  std::uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool, 10 float8_e4m3fn, 12 float8_e5m2
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; null means compact row-major
  std::uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

struct DLPackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};

struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  std::uint64_t flags;
  DLTensor dl_tensor;
};

constexpr std::uint64_t kFlagReadOnly = 1;

}  // namespace dlpack
}  // namespace aamp
