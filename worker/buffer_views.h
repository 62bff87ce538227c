// Tensors over a segment's shared parameter-shaped buffers and its shared model buffers,
// for every process that maps them (TorchScript worker, eager worker, trainer). Header
// only: each user already links libtorch.
#pragma once

#include <torch/types.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ipc/segment.h"

namespace shmgrad::worker {

// One tensor per entry of the segment's buffer table (BatchNorm statistics...), in
// table order, with the names. `keep` (may be empty) is held by every tensor's deleter,
// to keep the mapping alive while a view exists.
inline std::vector<std::pair<std::string, torch::Tensor>> sharedBufferViews(
    const ipc::Segment& segment, std::function<void(void*)> keep = [](void*) {}) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  const ipc::BufferEntry* table = segment.bufferTable();
  for (uint32_t i = 0; i < segment.header()->num_buffers; ++i) {
    const ipc::BufferEntry& b = table[i];
    std::vector<int64_t> shape(b.shape.dims, b.shape.dims + b.shape.ndim);
    const auto dtype = b.dtype == static_cast<uint32_t>(ipc::DType::kInt64) ? torch::kInt64
                                                                            : torch::kFloat32;
    out.emplace_back(b.name, torch::from_blob(segment.buffers() + b.offset, shape, keep, dtype));
  }
  return out;
}

}  // namespace shmgrad::worker
