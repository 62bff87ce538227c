// The records the trainer and the coordinator read from the workers (ipc::WorkerRecord):
// engine::readWorkerResult (engine/step_results.cc, the trainer's collect phase: result
// epoch, error type and text, loss, count, the reached-parameter bits) and
// ipc::heldByAbandoned (ipc/step.h, the coordinator's check on a worker after an
// abandoned step).
//
// Input: u32 step epoch, u32 abandoned epoch, u8 slot, then the record's bytes, in an
// allocation of exactly its size.
#include <algorithm>
#include <cstring>
#include <new>

#include "engine/step_results.h"
#include "ipc/step.h"
#include "tests/fuzz/fuzz_util.h"

using namespace shmgrad;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const auto e = in.take<uint32_t>();
  const auto abandoned = in.take<uint32_t>();
  const uint32_t slot = in.take<uint8_t>() % ipc::kMaxWorkers;
  auto* raw = static_cast<uint8_t*>(
      ::operator new (sizeof(ipc::WorkerRecord), std::align_val_t{alignof(ipc::WorkerRecord)}));
  std::memset(raw, 0, sizeof(ipc::WorkerRecord));
  std::memcpy(raw, in.rest(), std::min(in.left(), sizeof(ipc::WorkerRecord)));
  const auto& w = *reinterpret_cast<const ipc::WorkerRecord*>(raw);
  try {
    const engine::WorkerResult r = engine::readWorkerResult(w, e, slot);
    FUZZ_EXPECT(w.result_epoch == e && w.error == 0);
    FUZZ_EXPECT(r.nonfinite_loss == (w.nonfinite_loss != 0));
  } catch (const Error& err) {
    // Refused: another step's result, or the worker's own error, whose text is bounded by
    // its arrays however they end.
    FUZZ_EXPECT(err.kind() == ErrorKind::kCorrupt || err.kind() == ErrorKind::kWorkerFailed);
    FUZZ_EXPECT(std::strlen(err.what()) < ipc::kErrorLen + ipc::kErrorTypeLen + 64);
  }
  (void)ipc::heldByAbandoned(w, abandoned);
  ::operator delete (raw, std::align_val_t{alignof(ipc::WorkerRecord)});
  return 0;
}
