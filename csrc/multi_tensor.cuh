// Multi-tensor launches: a table of tensors passed by value as a kernel
// parameter (CUDA 12.1+ allows 32 KB of parameters), so one launch covers a
// whole list with no host-to-device copy and no allocation.
//
// The list is cut into fixed chunks of kChunk elements; a block takes one
// chunk at a time and finds its tensor by binary search over the chunk
// prefix sums. Indexing inside the table is 32-bit in chunks and 64-bit in
// elements, so tensors of more than 2**31 elements are fine.
#pragma once

#include <cstdint>
#include <vector>

#include "core.h"

namespace aamp {

template <int kCapacity>
struct TensorTable {
  static constexpr int capacity = kCapacity;
  void* data[kCapacity];
  // dtype code in bits 0-3, (elements in the last chunk - 1) above.
  std::uint32_t meta[kCapacity];
  // chunk_begin[i]: the first chunk of tensor i; chunk_begin[count]: total.
  std::uint32_t chunk_begin[kCapacity + 1];
  int count;
};

// Small lists (a typical model) launch with a 4 KB table; long lists with a
// table just under the 32 KB limit (its fill leaves room for the other
// kernel arguments).
using SmallTable = TensorTable<192>;
using LargeTable = TensorTable<1984>;
static_assert(sizeof(LargeTable) <= 32764 - 512, "tensor table exceeds the kernel parameter limit");

// Fills `table` with tensors [first, ...) of `tensors` until the table is
// full; returns the index after the last one taken. Empty tensors take a
// slot with no chunks, so per-tensor outputs stay aligned with the list.
template <class Table>
std::size_t fill_table(Table& table, const std::vector<TensorRef>& tensors, std::size_t first,
                       std::int64_t chunk) {
  table.count = 0;
  std::uint64_t chunks = 0;
  std::size_t i = first;
  for (; i < tensors.size() && table.count < Table::capacity; ++i) {
    const TensorRef& t = tensors[i];
    const std::uint64_t n = static_cast<std::uint64_t>((t.numel + chunk - 1) / chunk);
    if (chunks + n > 0x7fffffffu) break;  // keep the block index in range
    const std::int64_t last = t.numel > 0 ? t.numel - static_cast<std::int64_t>(n - 1) * chunk : 1;
    table.data[table.count] = t.data;
    table.meta[table.count] =
        static_cast<std::uint32_t>(t.dtype) | (static_cast<std::uint32_t>(last - 1) << 4);
    table.chunk_begin[table.count] = static_cast<std::uint32_t>(chunks);
    chunks += n;
    ++table.count;
  }
  table.chunk_begin[table.count] = static_cast<std::uint32_t>(chunks);
  return i;
}

#ifdef __CUDACC__
// The tensor that owns `chunk`: the last i with chunk_begin[i] <= chunk.
template <class Table>
__device__ __forceinline__ int table_find(const Table& table, std::uint32_t chunk) {
  int lo = 0, hi = table.count - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (table.chunk_begin[mid] <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}
#endif

}  // namespace aamp
