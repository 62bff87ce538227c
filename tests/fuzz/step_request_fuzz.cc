// The step request and its leaf table (ipc::StepRequest) as every participant reads it:
// worker::stepRequestValid, then shardBounds and worker::resolveBatch
// (worker/step_request.cc), what StepParticipant runs on each step the trainer publishes.
//
// Input: u8 slots, u8 rank, u32 max batch, i64 dataset size, u32 input and u32 target
// region bytes (the header's fields the reader uses, kept as validateHeader would accept
// them), then the request's bytes, then the index region's (int64 dataset indices).
// Each request region is its own allocation of exactly its size, so ASan sees any read
// past it; what resolveBatch hands the compute phase (pointers and sizes) must lie
// inside its region, which is checked here.
#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "ipc/reduce.h"
#include "ipc/segment.h"
#include "tests/fuzz/fuzz_util.h"
#include "worker/step_protocol.h"

using namespace shmgrad;

namespace {

constexpr uint32_t kMaxFuzzBatch = 4096;       // examples; a real engine allows far more
constexpr uint32_t kMaxFuzzRegion = 1u << 20;  // bytes of each request region

ipc::SegmentHeader* header() {
  static auto* h = static_cast<ipc::SegmentHeader*>(
      ::operator new (sizeof(ipc::SegmentHeader), std::align_val_t{alignof(ipc::SegmentHeader)}));
  return h;
}

bool inside(const void* p, uint64_t bytes, const uint8_t* region, uint64_t region_bytes) {
  const auto* q = static_cast<const uint8_t*>(p);
  return q >= region && static_cast<uint64_t>(q - region) <= region_bytes &&
         bytes <= region_bytes - static_cast<uint64_t>(q - region);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  ipc::SegmentHeader* h = header();
  std::memset(static_cast<void*>(h), 0, sizeof(ipc::SegmentHeader));
  h->num_slots = 1 + in.take<uint8_t>() % ipc::kMaxWorkers;
  const uint32_t rank = in.take<uint8_t>();
  h->max_batch = 1 + in.take<uint32_t>() % kMaxFuzzBatch;
  h->data_count = in.take<int64_t>() % ipc::kMaxBatch;
  if (h->data_count < 0) h->data_count = -h->data_count;
  const uint64_t input_bytes = in.take<uint32_t>() % kMaxFuzzRegion;
  const uint64_t target_bytes = in.take<uint32_t>() % kMaxFuzzRegion;
  std::memcpy(static_cast<void*>(&h->request), in.rest(),
              std::min(in.left(), sizeof(ipc::StepRequest)));
  in.skip(sizeof(ipc::StepRequest));

  // The three request regions, each an allocation of its own; the header's offsets are
  // relative to `base`, the lowest of them (as they are to the mapping's start).
  std::vector<int64_t> indices(static_cast<size_t>(h->max_batch));
  std::memcpy(indices.data(), in.rest(), std::min(in.left(), indices.size() * sizeof(int64_t)));
  std::unique_ptr<uint8_t[]> inputs(new uint8_t[input_bytes]);
  std::unique_ptr<uint8_t[]> targets(new uint8_t[target_bytes]);
  const auto* idx_at = reinterpret_cast<const uint8_t*>(indices.data());
  const uint8_t* base = std::min<const uint8_t*>({idx_at, inputs.get(), targets.get()});
  h->req_indices = {static_cast<uint64_t>(idx_at - base), indices.size() * sizeof(int64_t)};
  h->req_inputs = {static_cast<uint64_t>(inputs.get() - base), input_bytes};
  h->req_targets = {static_cast<uint64_t>(targets.get() - base), target_bytes};

  const uint32_t e = h->request.epoch;
  if (!worker::stepRequestValid(*h, e, rank)) return 0;
  const ipc::StepRequest& r = h->request;
  worker::Shard s;
  s.participants = r.num_participants;
  s.rank = rank;
  s.kind = static_cast<ipc::BatchKind>(r.kind);
  ipc::shardBounds(r.num_examples, s.participants, rank, &s.begin, &s.end);
  FUZZ_EXPECT(0 <= s.begin && s.begin <= s.end && s.end <= r.num_examples);
  if (s.size() <= 0) return 0;  // computePhase resolves no batch for an empty shard
  if (!fuzz::accepts([&] { worker::resolveBatch(*h, base, &s); })) return 0;
  const auto n = static_cast<uint64_t>(s.size());
  if (s.kind == ipc::BatchKind::kIndices) {
    FUZZ_EXPECT(inside(s.indices, n * sizeof(int64_t), idx_at, h->req_indices.size));
    for (uint64_t i = 0; i < n; ++i) FUZZ_EXPECT(s.indices[i] >= 0 && s.indices[i] < h->data_count);
  } else if (s.kind == ipc::BatchKind::kStructured) {
    FUZZ_EXPECT(s.num_leaves >= 1 && s.num_leaves <= ipc::kMaxLeaves);
    FUZZ_EXPECT(std::memchr(s.structure, '\0', ipc::kStructureLen) != nullptr);
    for (uint32_t k = 0; k < s.num_leaves; ++k) {
      const ipc::LeafEntry& leaf = s.leaves[k];
      const uint64_t row = ipc::checkedNumel(ErrorKind::kCorrupt, "leaf", leaf.example_shape.dims,
                                             leaf.example_shape.ndim) *
                           ipc::leafTypeSize(leaf.type);
      FUZZ_EXPECT(inside(s.leaf_data[k], n * row, inputs.get(), input_bytes));
    }
  } else {
    const uint64_t in_row =
        ipc::checkedNumel(ErrorKind::kCorrupt, "x", s.example_shape->dims, s.example_shape->ndim) *
        ipc::dtypeSize(s.input_dtype);
    const uint64_t tg_row =
        ipc::checkedNumel(ErrorKind::kCorrupt, "y", s.target_shape->dims, s.target_shape->ndim) *
        ipc::dtypeSize(s.target_dtype);
    FUZZ_EXPECT(inside(s.inputs, n * in_row, inputs.get(), input_bytes));
    FUZZ_EXPECT(inside(s.targets, n * tg_row, targets.get(), target_bytes));
  }
  return 0;
}
