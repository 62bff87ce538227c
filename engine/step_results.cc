#include "engine/step_results.h"

#include <cstring>
#include <sstream>
#include <string>

#include "ipc/error.h"

namespace shmgrad::engine {

WorkerResult readWorkerResult(const ipc::WorkerRecord& w, uint32_t e, uint32_t slot) {
  SHMGRAD_CHECK(w.result_epoch == e, ErrorKind::kCorrupt, "worker ", slot,
                " reported a result for another step");
  if (w.error != 0) {
    // Copied out before use (a stale worker could still write), always terminated.
    std::string type(w.error_type, strnlen(w.error_type, ipc::kErrorTypeLen));
    std::string text(w.error_text, strnlen(w.error_text, ipc::kErrorLen));
    std::ostringstream os;
    os << "worker " << slot << " could not compute its shard: " << (type.empty() ? "" : type + ": ")
       << text;
    throw Error(ErrorKind::kWorkerFailed, os.str(), static_cast<int>(slot), type);
  }
  WorkerResult r;
  r.examples = w.examples;
  r.loss_sum = w.loss_sum;
  r.count = w.count;
  r.compute_ns = w.compute_ns;
  r.reduce_ns = w.reduce_ns;
  r.reduce_early_ns = w.reduce_early_ns;
  r.barrier_wait_ns = w.barrier_wait_ns;
  r.nonfinite_loss = w.nonfinite_loss != 0;
  const uint32_t grad = w.nonfinite_grad.load();
  r.nonfinite_grad = grad != 0;
  r.nonfinite_sum = grad == 2;
  std::memcpy(r.grad_params, w.grad_params, sizeof r.grad_params);
  return r;
}

}  // namespace shmgrad::engine
