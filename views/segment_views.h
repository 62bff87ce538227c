// Tensors over a segment's memory, nothing copied: parameter-shaped buffers, batches of
// examples, and the shared model buffers, for every process that maps them (TorchScript worker,
// eager worker, trainer). Header only: each user already links libtorch.
#pragma once

#include <torch/types.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ipc/error.h"
#include "ipc/segment.h"

namespace shmgrad::views {

inline torch::ScalarType torchType(ipc::DType t) {
  return t == ipc::DType::kInt64 ? torch::kInt64 : torch::kFloat32;
}

// A structured batch's leaf type as a torch dtype, and back (kUndefined / 0: not one).
inline torch::ScalarType leafTorchType(uint32_t t) {
  constexpr torch::ScalarType kTypes[] = {torch::ScalarType::Undefined,
                                          torch::kFloat32,
                                          torch::kInt64,
                                          torch::kFloat64,
                                          torch::kFloat16,
                                          torch::kBFloat16,
                                          torch::kInt32,
                                          torch::kInt16,
                                          torch::kInt8,
                                          torch::kUInt8,
                                          torch::kBool};
  return t < sizeof(kTypes) / sizeof(kTypes[0]) ? kTypes[t] : torch::ScalarType::Undefined;
}
inline uint32_t leafTypeOf(torch::ScalarType t) {
  for (uint32_t v = 1; v <= static_cast<uint32_t>(ipc::LeafType::kBool); ++v) {
    if (leafTorchType(v) == t) return v;
  }
  return 0;
}

// n examples of leaf's shape and type at `data`: [n, *example] over the segment.
inline torch::Tensor leafView(const void* data, int64_t n, const ipc::LeafEntry& leaf) {
  int64_t dims[ipc::kMaxDims + 1];
  dims[0] = n;
  for (uint32_t d = 0; d < leaf.example_shape.ndim; ++d) dims[d + 1] = leaf.example_shape.dims[d];
  return torch::from_blob(const_cast<void*>(data),
                          c10::IntArrayRef(dims, leaf.example_shape.ndim + 1),
                          leafTorchType(leaf.type));
}

// n examples of `example`'s shape and `dtype` at `data` (a request region or a dataset):
// one tensor [n, *example] over the segment, nothing copied. Shapes on the stack.
inline torch::Tensor examplesView(const void* data, int64_t n, const ipc::Shape& example,
                                  ipc::DType dtype) {
  int64_t dims[ipc::kMaxDims + 1];
  dims[0] = n;
  for (uint32_t d = 0; d < example.ndim; ++d) dims[d + 1] = example.dims[d];
  return torch::from_blob(const_cast<void*>(data), c10::IntArrayRef(dims, example.ndim + 1),
                          torchType(dtype));
}

// The dataset the coordinator loaded into the segment: inputs [count, *example] (float32)
// and targets [count, *target] (their dtype) over the segment, nothing copied. Undefined
// tensors when the segment holds none (no dataset, or one that eager workers hold).
// `keep` as below.
inline std::pair<torch::Tensor, torch::Tensor> datasetViews(
    const ipc::Segment& segment, std::function<void(void*)> keep = [](void*) {}) {
  const ipc::SegmentHeader* h = segment.header();
  if (h->data_count <= 0 || h->data_inputs.size == 0) return {};
  auto view = [&](void* data, const ipc::Shape& example, ipc::DType dtype) {
    int64_t dims[ipc::kMaxDims + 1];
    dims[0] = h->data_count;
    for (uint32_t d = 0; d < example.ndim; ++d) dims[d + 1] = example.dims[d];
    return torch::from_blob(data, c10::IntArrayRef(dims, example.ndim + 1), keep, torchType(dtype));
  };
  return {view(segment.region<float>(h->data_inputs), h->data_example_shape, ipc::DType::kFloat32),
          view(segment.region<uint8_t>(h->data_targets), h->data_target_shape,
               static_cast<ipc::DType>(h->data_target_dtype))};
}

// Tensor options for float32 memory on CUDA device `tensor_device`, or the host (-1).
inline torch::TensorOptions floatOptions(int tensor_device) {
  auto options = torch::TensorOptions().dtype(torch::kFloat32);
  if (tensor_device < 0) return options;
  return options.device(torch::kCUDA, static_cast<c10::DeviceIndex>(tensor_device));
}

// The memory format a parameter is laid out in: channels_last (3d) where it is that and
// not row-major (a model converted with .to(memory_format=...)), else row-major.
inline ipc::MemoryFormat memoryFormatOf(const torch::Tensor& t) {
  if (t.is_contiguous()) return ipc::MemoryFormat::kContiguous;
  if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return ipc::MemoryFormat::kChannelsLast;
  }
  if (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d)) {
    return ipc::MemoryFormat::kChannelsLast3d;
  }
  return ipc::MemoryFormat::kContiguous;
}

// `t` with its elements in `f`'s order (itself when they already are; else a copy): its
// data is what a parameter-shaped buffer holds for it.
inline torch::Tensor inMemoryFormat(const torch::Tensor& t, ipc::MemoryFormat f) {
  return t.contiguous(f == ipc::MemoryFormat::kChannelsLast     ? at::MemoryFormat::ChannelsLast
                      : f == ipc::MemoryFormat::kChannelsLast3d ? at::MemoryFormat::ChannelsLast3d
                                                                : at::MemoryFormat::Contiguous);
}

// Parameter `e` over `base` (the parameters, a slot or the reduced gradient): its shape,
// and the strides of its memory format (checked on attach), so that every process reads
// its elements in the same order. `keep` as below.
inline torch::Tensor parameterView(
    float* base, const ipc::ParamEntry& e, const torch::TensorOptions& options,
    std::function<void(void*)> keep = [](void*) {}) {
  int64_t strides[ipc::kMaxDims];
  ipc::memoryFormatStrides(e.shape.dims, e.shape.ndim,
                           static_cast<ipc::MemoryFormat>(e.memory_format), strides);
  return torch::from_blob(base + e.offset, c10::IntArrayRef(e.shape.dims, e.shape.ndim),
                          c10::IntArrayRef(strides, e.shape.ndim), std::move(keep), options);
}

// One float32 tensor per parameter, laid out over `base` (the parameters, a slot or the
// reduced gradient: host memory, or device memory of `tensor_device`), in table order.
// `keep` as below.
inline std::vector<torch::Tensor> parameterShapedViews(
    const ipc::Segment& segment, float* base, std::function<void(void*)> keep = [](void*) {},
    int tensor_device = -1) {
  std::vector<torch::Tensor> out;
  const ipc::ParamEntry* table = segment.paramTable();
  const torch::TensorOptions options = floatOptions(tensor_device);
  for (uint32_t i = 0; i < segment.header()->num_params; ++i) {
    out.push_back(parameterView(base, table[i], options, keep));
  }
  return out;
}

// One tensor per entry of the segment's buffer table (BatchNorm statistics...), in
// table order, with the names, over `base`: the shared buffers (nullptr) or a slot's copy
// of them (Segment::slotBuffers). `keep` (may be empty) is held by every tensor's deleter,
// to keep the mapping alive while a view exists.
inline std::vector<std::pair<std::string, torch::Tensor>> sharedBufferViews(
    const ipc::Segment& segment, std::function<void(void*)> keep = [](void*) {},
    uint8_t* base = nullptr) {
  if (base == nullptr) base = segment.buffers();
  std::vector<std::pair<std::string, torch::Tensor>> out;
  const ipc::BufferEntry* table = segment.bufferTable();
  for (uint32_t i = 0; i < segment.header()->num_buffers; ++i) {
    const ipc::BufferEntry& b = table[i];
    std::vector<int64_t> shape(b.shape.dims, b.shape.dims + b.shape.ndim);
    out.emplace_back(b.name, torch::from_blob(base + b.offset, shape, keep,
                                              torchType(static_cast<ipc::DType>(b.dtype))));
  }
  return out;
}

// The shared buffers' region as one byte tensor over `base` (the shared buffers, nullptr,
// or a slot's copy): a copy to or from it moves every buffer at once. `keep` as above.
inline torch::Tensor bufferBlockView(
    const ipc::Segment& segment, std::function<void(void*)> keep = [](void*) {},
    uint8_t* base = nullptr) {
  if (base == nullptr) base = segment.buffers();
  return torch::from_blob(base, {static_cast<int64_t>(segment.header()->buffers.size)},
                          std::move(keep), torch::kUInt8);
}

// One tensor per entry of the buffer table, each a view of `block`, a byte tensor laid out
// as the segment's buffer region (a worker's or trainer's own copy of it, on any device):
// a model whose buffers are these views loads and publishes them in one copy of the block
// (on a GPU, one transfer a step instead of one per buffer). Offsets and sizes were
// validated on attach (kAlign-aligned, inside the region); a block of another size or
// type is kInvalidArgument.
inline std::vector<torch::Tensor> bufferViewsOf(const ipc::Segment& segment,
                                                const torch::Tensor& block) {
  const uint64_t bytes = segment.header()->buffers.size;
  SHMGRAD_CHECK(block.scalar_type() == torch::kUInt8 && block.dim() == 1 &&
                    block.numel() == static_cast<int64_t>(bytes),
                ErrorKind::kInvalidArgument, "a buffer block is ", bytes,
                " bytes (uint8, one dimension)");
  std::vector<torch::Tensor> out;
  const ipc::BufferEntry* table = segment.bufferTable();
  for (uint32_t i = 0; i < segment.header()->num_buffers; ++i) {
    const ipc::BufferEntry& b = table[i];
    std::vector<int64_t> shape(b.shape.dims, b.shape.dims + b.shape.ndim);
    out.push_back(block.narrow(0, static_cast<int64_t>(b.offset), static_cast<int64_t>(b.nbytes))
                      .view(torchType(static_cast<ipc::DType>(b.dtype)))
                      .view(shape));
  }
  return out;
}

}  // namespace shmgrad::views
