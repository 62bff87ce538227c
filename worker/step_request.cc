// Reading a step request: the checks a participant runs on what the trainer wrote into
// the segment, over the header's bytes alone (no process, no device), so that
// tests/fuzz can run them on any bytes. Used by StepParticipant (step_protocol.cc).
#include <cmath>
#include <cstring>

#include "ipc/error.h"
#include "worker/step_protocol.h"

namespace shmgrad::worker {

bool stepRequestValid(const ipc::SegmentHeader& h, uint32_t e, uint32_t rank) {
  const ipc::StepRequest& r = h.request;
  const uint32_t n = r.num_participants;
  bool valid =
      n >= 1 && n <= ipc::allSlots(h) && rank < n && r.num_examples >= 1 &&
      r.num_examples <= h.max_batch && r.epoch == e &&
      r.kind >= static_cast<uint32_t>(ipc::BatchKind::kIndices) &&
      r.kind <= static_cast<uint32_t>(ipc::BatchKind::kStructured) &&
      r.max_examples_per_pass >= 0 && std::isfinite(r.scale) && std::isfinite(r.loss_scale) &&
      r.loss_scale > 0 && r.reduction <= static_cast<uint32_t>(ipc::Reduction::kSumThroughMean) &&
      r.buffer_rule <= static_cast<uint32_t>(ipc::BufferRule::kFirst) &&
      r.accumulate <= static_cast<uint32_t>(ipc::Accumulate::kAccumToReduced) &&
      std::isfinite(r.prev_count) && r.prev_count >= 0 && r.threads <= ipc::kMaxThreadsPerWorker;
  for (uint32_t k = 0; valid && k < n; ++k) valid = r.participants[k] < ipc::allSlots(h);
  // Buckets: increasing cuts of the whole gradient on cache lines, for a fresh step of
  // two or more participants (a piece count that fits the claim word's count).
  if (valid && r.num_buckets != 0) {
    valid = r.num_buckets <= ipc::kMaxBuckets && n >= 2 &&
            r.accumulate == static_cast<uint32_t>(ipc::Accumulate::kFresh) &&
            r.bucket_begin[0] == 0 && r.bucket_begin[r.num_buckets] == h.param_floats;
    for (uint32_t k = 0; valid && k < r.num_buckets; ++k) {
      valid =
          r.bucket_begin[k] < r.bucket_begin[k + 1] && r.bucket_begin[k] % ipc::kAlignFloats == 0;
    }
  }
  return valid;
}

void resolveBatch(const ipc::SegmentHeader& h, const uint8_t* base, Shard* s) {
  const ipc::StepRequest& r = h.request;
  const int64_t n = s->size();
  if (s->kind == ipc::BatchKind::kIndices) {
    SHMGRAD_CHECK(
        h.data_count > 0, ErrorKind::kInvalidArgument,
        "this engine has no dataset: pass inputs and targets, or start it with --dataset");
    const int64_t* idx = reinterpret_cast<const int64_t*>(base + h.req_indices.offset) + s->begin;
    for (int64_t i = 0; i < n; ++i) {
      SHMGRAD_CHECK(idx[i] >= 0 && idx[i] < h.data_count, ErrorKind::kInvalidArgument, "index ",
                    idx[i], " is out of range for the dataset of ", h.data_count, " examples");
    }
    s->indices = idx;
    return;
  }
  const uint64_t B = static_cast<uint64_t>(r.num_examples);
  if (s->kind == ipc::BatchKind::kStructured) {
    SHMGRAD_CHECK(r.num_leaves >= 1 && r.num_leaves <= ipc::kMaxLeaves &&
                      std::memchr(r.structure, '\0', ipc::kStructureLen) != nullptr,
                  ErrorKind::kCorrupt, "step request: structured batch header");
    const uint8_t* inputs = base + h.req_inputs.offset;
    for (uint32_t k = 0; k < r.num_leaves; ++k) {
      const ipc::LeafEntry& leaf = r.leaves[k];
      const uint64_t esize = ipc::leafTypeSize(leaf.type);
      SHMGRAD_CHECK(esize != 0, ErrorKind::kCorrupt, "step request: leaf ", k, " type ", leaf.type);
      const uint64_t numel = ipc::checkedNumel(ErrorKind::kCorrupt, "step request: leaf shape",
                                               leaf.example_shape.dims, leaf.example_shape.ndim);
      const uint64_t row = numel * esize;
      SHMGRAD_CHECK(leaf.offset % ipc::kAlign == 0 && leaf.offset <= h.req_inputs.size &&
                        (row == 0 || B <= (h.req_inputs.size - leaf.offset) / row),
                    ErrorKind::kCorrupt, "step request: leaf ", k,
                    " lies outside the input region");
      s->leaf_data[k] = inputs + leaf.offset + static_cast<uint64_t>(s->begin) * row;
    }
    s->num_leaves = r.num_leaves;
    s->leaves = r.leaves;
    s->structure = r.structure;
    return;
  }
  const uint64_t in_size = ipc::dtypeSize(r.input_dtype), tg_size = ipc::dtypeSize(r.target_dtype);
  SHMGRAD_CHECK(in_size != 0 && tg_size != 0, ErrorKind::kCorrupt,
                "step request: unknown input or target dtype");
  const uint64_t in_numel = ipc::checkedNumel(ErrorKind::kCorrupt, "step request: example shape",
                                              r.example_shape.dims, r.example_shape.ndim);
  const uint64_t tg_numel = ipc::checkedNumel(ErrorKind::kCorrupt, "step request: target shape",
                                              r.target_shape.dims, r.target_shape.ndim);
  SHMGRAD_CHECK(in_numel == 0 || B <= h.req_inputs.size / (in_numel * in_size), ErrorKind::kCorrupt,
                "step request: inputs larger than the input region");
  SHMGRAD_CHECK(tg_numel == 0 || B <= h.req_targets.size / (tg_numel * tg_size),
                ErrorKind::kCorrupt, "step request: targets larger than the target region");
  s->input_dtype = static_cast<ipc::DType>(r.input_dtype);
  s->target_dtype = static_cast<ipc::DType>(r.target_dtype);
  s->example_shape = &r.example_shape;
  s->target_shape = &r.target_shape;
  s->inputs = base + h.req_inputs.offset + static_cast<uint64_t>(s->begin) * in_numel * in_size;
  s->targets = base + h.req_targets.offset + static_cast<uint64_t>(s->begin) * tg_numel * tg_size;
}

}  // namespace shmgrad::worker
