#include "worker/step_protocol.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <thread>

#include "ipc/barrier.h"
#include "ipc/error.h"
#include "ipc/futex.h"
#include "ipc/reduce.h"

namespace shmgrad::worker {

namespace {
// A worker whose context faulted waits at most this long for its step to end before it
// exits (awaitStepEnd): its other participants finish their slices in far less.
constexpr auto kFaultExitWait = std::chrono::seconds(10);
}  // namespace

using ipc::WorkerState;

StepParticipant::StepParticipant(const ipc::Segment& segment, uint32_t slot, int parent_pid)
    : seg_(segment),
      h_(segment.header()),
      c_(segment.header()->control),
      me_(segment.header()->workers[slot]),
      slot_(slot),
      parent_pid_(parent_pid) {
  SHMGRAD_CHECK(slot < ipc::allSlots(*h_), ErrorKind::kInvalidArgument, "worker slot ", slot,
                " is out of range: the engine has ", ipc::allSlots(*h_), " slots");
  // The coordinator gives its workers the CUDA library it loaded ($SHMGRAD_CUDA_LIBRARY).
  mem_ = std::make_unique<gpu::EngineMemory>(segment, "", slot);
  if (mem_->onDevice()) {
    // The explicit batch's regions, copied to the device at every step: pinned, the copy
    // is one asynchronous transfer each (refused by the driver: copied as before).
    const int device = mem_->ordinal(slot);
    for (const ipc::Region& r : {h_->req_inputs, h_->req_targets}) {
      if (!mem_->pinHost(device, seg_.region<uint8_t>(r), r.size)) {
        std::fprintf(stderr,
                     "shmgrad worker %u: the request's memory could not be page-locked; "
                     "batches are copied to cuda:%d from pageable memory\n",
                     slot, device);
        break;
      }
    }
  }
}

bool StepParticipant::becomeReady() {
  me_.busy_epoch.store(0, std::memory_order_release);
  // A plain store would overwrite `retired` (a shrink while the model loaded) and leave
  // a worker beyond the target.
  uint32_t starting = static_cast<uint32_t>(WorkerState::kStarting);
  if (!me_.state.compare_exchange_strong(starting, static_cast<uint32_t>(WorkerState::kReady),
                                         std::memory_order_acq_rel)) {
    return false;
  }
  ipc::bumpAndWake(&c_.coordinator_wake);
  return true;
}

void StepParticipant::reportStartupFailure(const std::string& text) { setError("", text.c_str()); }

// A message that does not fit keeps its head and its tail (a traceback's last frames are
// at the end), with a marker between them.
void StepParticipant::setError(const char* type, const char* text) {
  me_.error = 1;
  std::snprintf(me_.error_type, ipc::kErrorTypeLen, "%s", type);
  const size_t len = std::strlen(text);
  if (len < ipc::kErrorLen) {
    std::memcpy(me_.error_text, text, len + 1);
    return;
  }
  static const char kCut[] = "\n[... cut to fit the engine's error record ...]\n";
  const size_t keep = ipc::kErrorLen - sizeof(kCut);  // bytes of the original kept
  const size_t head = keep / 2, tail = keep - head;
  std::memcpy(me_.error_text, text, head);
  std::memcpy(me_.error_text + head, kCut, sizeof(kCut) - 1);
  std::memcpy(me_.error_text + head + sizeof(kCut) - 1, text + len - tail, tail);
  me_.error_text[ipc::kErrorLen - 1] = '\0';
}

bool StepParticipant::stopRequested() {
  if (c_.stop_requested.load(std::memory_order_acquire) != 0 ||
      c_.engine_state.load(std::memory_order_acquire) ==
          static_cast<uint32_t>(ipc::EngineState::kStopping) ||
      me_.state.load(std::memory_order_acquire) == static_cast<uint32_t>(WorkerState::kRetired)) {
    exit_code_ = kExitStopped;
    return true;
  }
  return false;
}

// getppid() is a system call: called only after a wait slice passed with nothing to do
// (PR_SET_PDEATHSIG kills the worker with its parent anyway; this covers the race in
// which the parent died before the worker set it).
bool StepParticipant::coordinatorGone() {
  if (getppid() == parent_pid_) return false;
  exit_code_ = kExitCoordinatorGone;
  return true;
}

int StepParticipant::serve(ShardComputer& computer) {
  for (;;) {
    const uint32_t e = waitForStep();
    if (e == 0) return exit_code_;
    runStep(e, computer);
    if (deviceFaulted()) {
      awaitStepEnd(e);  // the step reports the fault, not this worker's death
      return exit_code_ = kExitDeviceFault;
    }
  }
}

// Until step `e` is done or aborted (the other participants may still be in it), at most
// kFaultExitWait: a worker about to exit would otherwise have the step aborted for a
// lost worker, and the trainer would report that instead of the error this worker
// recorded. Polls: the fault path, not the hot one.
void StepParticipant::awaitStepEnd(uint32_t e) {
  const auto deadline = std::chrono::steady_clock::now() + kFaultExitWait;
  while (c_.done_epoch.load(std::memory_order_acquire) != e &&
         c_.abort_epoch.load(std::memory_order_acquire) != e && !stopRequested() &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// After a step that failed on a device: whether the failure left the context unusable (a
// sticky error, this library's or torch's: they share the device's primary context). Only
// then is the device asked (a wait for it), so a step that went well costs nothing here.
bool StepParticipant::deviceFaulted() const {
  if (me_.error == 0 || !mem_->onDevice()) return false;
  try {
    return mem_->cuda()->deviceFaulted(mem_->ordinal(slot_));
  } catch (const std::exception&) {
    return true;  // the device cannot even be asked
  }
}

// A step is ours when step_epoch == assigned_epoch (the trainer stores the latter
// first). Comparing the two, rather than waiting for step_epoch to change from a value
// read at start-up, means a step published right after this worker became ready is not
// missed. Between steps only memory is read.
uint32_t StepParticipant::waitForStep() {
  for (;;) {
    me_.heartbeat_ns.store(ipc::monotonicNs(), std::memory_order_relaxed);
    if (stopRequested()) return 0;
    const uint32_t cur = c_.step_epoch.load(std::memory_order_acquire);
    if (cur != last_epoch_ && me_.assigned_epoch.load(std::memory_order_acquire) == cur) {
      last_epoch_ = cur;
      return cur;
    }
    // Right after a step the next one often follows within the trainer's optimizer
    // step: spin for it first when the last step said there are cores to spare.
    if (spin_ns_ > 0) {
      const uint64_t max = spin_ns_;
      spin_ns_ = 0;  // once per step: an idle worker sleeps
      if (ipc::adaptiveSpinUntil(
              [&] { return c_.step_epoch.load(std::memory_order_acquire) != cur; }, max,
              &next_step_spin_)) {
        continue;
      }
    }
    bool woken;
    if (cur == last_epoch_) {
      // The latest step's participant: the trainer wakes step_epoch for every step.
      woken = ipc::futexWait(&c_.step_epoch, cur, kIdleCheckSlice);
    } else {
      // The latest step went on without this worker: sleep where only a step that takes
      // it again (or the coordinator) wakes it. The word is read before the step is
      // looked at again, so a bump after that look ends the wait at once.
      const uint32_t idle = c_.idle_wake.load(std::memory_order_acquire);
      if (c_.step_epoch.load(std::memory_order_acquire) != cur) continue;
      woken = ipc::futexWait(&c_.idle_wake, idle, kIdleCheckSlice);
    }
    if (!woken && coordinatorGone()) return 0;
  }
}

void StepParticipant::runStep(uint32_t e, ShardComputer& computer, const ipc::LocalBatch& local) {
  local_ = local;
  me_.busy_epoch.store(e, std::memory_order_release);
  me_.error = 0;
  me_.error_type[0] = '\0';
  me_.error_text[0] = '\0';
  me_.examples = 0;
  me_.loss_sum = 0;
  me_.count = 0;
  me_.nonfinite_loss = 0;
  me_.nonfinite_grad.store(0, std::memory_order_relaxed);
  me_.reduce_ns = 0;
  me_.reduce_early_ns = 0;
  me_.barrier_wait_ns = 0;
  const uint64_t t0 = ipc::monotonicNs();
  me_.start_ns = t0;

  Shard shard;
  const bool valid = prepareShard(e, &shard);
  if (valid) computePhase(shard, computer);
  const bool average = valid && h_->num_buffers > 0 && shard.buffer_rule == ipc::BufferRule::kMean;
  if (average && me_.error == 0) {
    publishBuffers(computer, seg_.slotBuffers(slot_));  // averaged by rank 0 (shareBuffers)
  }
  const uint64_t t1 = ipc::monotonicNs();
  me_.compute_ns = t1 - t0;
  me_.result_epoch = e;

  if (valid && shard.num_buckets > 0) {
    // Bucketed: what backward's hooks did not mark yet is complete now (every bucket of a
    // worker without hooks); then take pieces as their buckets become ready.
    markAllBuckets();
    if (bucketedReduce(shard, computer, t1) &&
        ipc::arriveBarrier(c_.reduce_barrier, e) == shard.participants) {
      completeStep(e, shard.participants);
    }
  } else if (valid && barrier(c_.compute_barrier, e, shard.participants)) {
    // Compute barrier: every participant's slot is complete before anyone reads it. An
    // invalid request is not taken part in: the trainer's timeout or abort ends the step.
    const uint64_t t2 = ipc::monotonicNs();
    me_.barrier_wait_ns = t2 - t1;
    shareBuffers(shard, computer);
    try {
      reducePhase(shard);
    } catch (const std::exception& ex) {  // a device's error: the trainer reports it
      setError("", ex.what());
    }
    me_.reduce_ns = ipc::monotonicNs() - t2;
    // Reduce barrier: the last to finish its slice completes the step.
    if (ipc::arriveBarrier(c_.reduce_barrier, e) == shard.participants) {
      completeStep(e, shard.participants);
    }
  }
  local_ = {};
  me_.busy_epoch.store(0, std::memory_order_release);
}

void StepParticipant::publishBuffers(ShardComputer& computer, uint8_t* dst) {
  try {
    computer.publishBuffers(dst);
  } catch (const std::exception& ex) {
    setError("", ex.what());
  }
}

// The step's first participant, once every participant has computed (so has loaded the
// shared buffers and, by BufferRule::kMean, written its copy): the step's buffers.
void StepParticipant::shareBuffers(const Shard& shard, ShardComputer& computer) {
  if (shard.rank != 0 || h_->num_buffers == 0) return;
  if (shard.buffer_rule == ipc::BufferRule::kMean) {
    averageBuffers(shard);
  } else {
    publishBuffers(computer, seg_.buffers());
  }
}

void StepParticipant::watchGrad(uint32_t param, GradWatch how) {
  if (param >= ipc::kMaxParams) return;
  watch_[param] = how;
  mapped_buckets_ = 0;  // the buckets' hooked parameters are counted again
  write_first_ok_ = -1;
}

bool StepParticipant::writeFirstPossible() {
  if (write_first_ok_ < 0) {
    bool ok = !mem_->onDevice() && h_->num_params <= ipc::kMaxParams;
    for (uint32_t i = 0; ok && i < h_->num_params; ++i) ok = watch_[i] != GradWatch::kUnknown;
    write_first_ok_ = ok ? 1 : 0;
  }
  return write_first_ok_ == 1;
}

bool StepParticipant::gradFirstWrite(uint32_t param) {
  if (!writing_first_ || param >= ipc::kMaxParams) return false;
  if (ipc::paramBit(written_, param)) {
    ipc::clearParamBit(finite_, param);  // a later pass adds to it: no longer what was checked
    return false;
  }
  ipc::setParamBit(written_, param);
  return true;
}

void StepParticipant::gradWrittenFinite(uint32_t param) {
  if (writing_first_ && param < ipc::kMaxParams && ipc::paramBit(written_, param)) {
    ipc::setParamBit(finite_, param);
  }
}

// A shard alone, after its passes: whether the result holds a NaN or an infinity, read
// everywhere but in the parameters whose hooks checked what they wrote (gradWrittenFinite).
// Reads it all when the table's offsets do not ascend (the engine's layout makes them).
bool StepParticipant::anyNonFiniteUnchecked(const float* grads) {
  const ipc::ParamEntry* table = seg_.paramTable();  // validated on attach
  const uint64_t total = h_->param_floats;
  uint64_t from = 0;  // the start of what is still to be read
  for (uint32_t i = 0; i < h_->num_params && i < ipc::kMaxParams; ++i) {
    if (!ipc::paramBit(finite_, i)) continue;
    const uint64_t b = table[i].offset, e = b + table[i].numel;
    if (b < from || e > total) return ipc::anyNonFinite(grads, 0, total);
    if (ipc::anyNonFinite(grads, from, b)) return true;
    from = e;
  }
  return ipc::anyNonFinite(grads, from, total);
}

// After a write-first shard's passes: the hooked parameters backward did not reach still
// hold an earlier step's gradient; they get zeros, as a zeroed slot would hold.
void StepParticipant::zeroUnwritten(float* grads) {
  const ipc::ParamEntry* table = seg_.paramTable();  // validated on attach
  for (uint32_t i = 0; i < h_->num_params; ++i) {
    if (watch_[i] == GradWatch::kHooked && !ipc::paramBit(written_, i)) {
      std::memset(grads + table[i].offset, 0, table[i].numel * sizeof(float));
    }
  }
}

void StepParticipant::gradReady(uint32_t param) {
  if (!armed_ || param >= ipc::kMaxParams || watch_[param] != GradWatch::kHooked) return;
  if (ipc::paramBit(seen_, param)) return;  // counted once, however often it fires
  ipc::setParamBit(seen_, param);
  const uint32_t k = param_bucket_[param];
  if (k >= num_buckets_ || bucket_hooked_[k] == 0 || marked_[k] || pending_[k] == 0) return;
  if (--pending_[k] == 0) markBucket(k);
}

// This step's buckets: which parameter lies in which (when the cuts change) and, per
// bucket, the hooked parameters backward must complete before it is ready. A bucket with
// a parameter of unknown completion (not hooked, not frozen) or one across its cut is
// marked only at the end of this participant's compute (markAllBuckets).
void StepParticipant::prepareBuckets(const Shard& shard) {
  armed_ = false;
  num_buckets_ = shard.num_buckets;
  bucket_participants_ = shard.participants;
  bucket_epoch_ = shard.epoch;
  if (num_buckets_ == 0) return;
  const uint32_t K = num_buckets_;
  if (mapped_buckets_ != K ||
      std::memcmp(buckets_of_, shard.bucket_begin, (K + 1) * sizeof(uint64_t)) != 0) {
    std::memcpy(buckets_of_, shard.bucket_begin, (K + 1) * sizeof(uint64_t));
    bool eligible[ipc::kMaxBuckets];
    std::fill(eligible, eligible + K, true);
    std::fill(bucket_hooked_, bucket_hooked_ + ipc::kMaxBuckets, 0);
    const ipc::ParamEntry* table = seg_.paramTable();  // validated on attach
    const uint32_t np = std::min(h_->num_params, ipc::kMaxParams);
    for (uint32_t i = 0; i < np; ++i) {
      const uint64_t first = table[i].offset, numel = table[i].numel;
      // The bucket its first float lies in: the last cut at or before it.
      const uint32_t k = static_cast<uint32_t>(
          std::upper_bound(buckets_of_ + 1, buckets_of_ + K, first) - (buckets_of_ + 1));
      param_bucket_[i] = static_cast<uint8_t>(k);
      if (numel == 0) continue;
      for (uint32_t j = k + 1; j < K && buckets_of_[j] < first + numel; ++j) {
        eligible[j - 1] = eligible[j] = false;  // across a cut
      }
      if (watch_[i] == GradWatch::kHooked) {
        ++bucket_hooked_[k];
      } else if (watch_[i] != GradWatch::kNoGrad) {
        eligible[k] = false;
      }
    }
    for (uint32_t k = 0; k < K; ++k) {
      if (!eligible[k]) bucket_hooked_[k] = 0;
    }
    mapped_buckets_ = K;
  }
  std::copy(bucket_hooked_, bucket_hooked_ + K, pending_);
  std::fill(marked_, marked_ + K, false);
  std::memset(seen_, 0, sizeof seen_);
}

// This participant's backward has completed bucket k: one arrival at its word (tagged with
// the step, so a stale one never counts); the last participant's wakes who waits for it.
void StepParticipant::markBucket(uint32_t k) {
  if (marked_[k]) return;
  marked_[k] = true;
  const uint32_t got = ipc::arriveBarrier(c_.buckets[k].ready, bucket_epoch_);
  if (got == bucket_participants_ && got > 1) ipc::bumpAndWake(&c_.bucket_progress);
}

void StepParticipant::markAllBuckets() {
  armed_ = false;
  for (uint32_t k = 0; k < num_buckets_; ++k) markBucket(k);
}

// Reads this worker's share of the request. Every field read from shared memory is
// checked before use; a request that fails the structural checks is recorded as this
// worker's error (the batch's contents are checked later, in computePhase).
bool StepParticipant::prepareShard(uint32_t e, Shard* s) {
  const ipc::StepRequest& r = h_->request;
  const uint32_t n = r.num_participants;
  const uint32_t rank = me_.assigned_rank.load(std::memory_order_acquire);
  if (!stepRequestValid(*h_, e, rank)) {
    setError("",
             "corrupt step request (participants, rank, batch size, kind, reduction, scales or "
             "rules out of range)");
    return false;
  }
  const int64_t B = r.num_examples;
  s->epoch = e;
  s->rank = rank;
  s->participants = n;
  ipc::shardBounds(B, n, rank, &s->begin, &s->end);
  s->max_examples_per_pass = r.max_examples_per_pass;
  s->threads = r.threads;
  s->kind = static_cast<ipc::BatchKind>(r.kind);
  // One participant's statistics are the average: it publishes them directly.
  s->buffer_rule = n > 1 ? static_cast<ipc::BufferRule>(r.buffer_rule) : ipc::BufferRule::kFirst;
  s->accumulate = static_cast<ipc::Accumulate>(r.accumulate);
  // Alone, this worker's gradient is the result: backward writes into the reduced
  // buffer and applies the mean's scale itself, and there is nothing to reduce. Not when
  // accumulating: the previous result must stay intact until the step is done.
  // On devices, only where the reduced buffer is on this worker's device (the trainer's):
  // a parameter's .grad must be on its device.
  s->device = mem_->ordinal(slot_);
  s->alone =
      n == 1 && s->accumulate == ipc::Accumulate::kFresh && s->device == mem_->trainerOrdinal();
  s->grads = s->alone ? mem_->reduced() : mem_->slot(slot_);
  s->grad_scale = r.scale * r.loss_scale;
  s->seed = r.seed;
  s->train = r.train_mode != 0;
  spin_ns_ = std::min<uint64_t>(r.spin_ns, ipc::kMaxSpinNs);
  barrier_spin_ns_ = std::min<uint64_t>(r.barrier_spin_ns, ipc::kMaxSpinNs);
  // Buckets are reduced from the host's memory only (the trainer never asks otherwise).
  if (r.num_buckets != 0 && mem_->onDevice()) {
    setError("", "corrupt step request: a bucketed reduction on an engine with devices");
    return false;
  }
  s->num_buckets = r.num_buckets;
  s->bucket_begin = r.bucket_begin;
  prepareBuckets(*s);
  return true;
}

void StepParticipant::computePhase(const Shard& shard, ShardComputer& computer) {
  me_.examples = shard.size();
  std::memset(me_.grad_params, 0, sizeof me_.grad_params);  // an empty shard reaches none
  // Write-first (every parameter hooked, on the host): each parameter's first gradient of
  // the shard is written into the slot by its hook, the rest added by autograd; else the
  // slot is zeroed and autograd adds every gradient. The slot is never released either
  // way: .grad stays defined, so backward writes shared memory. Padding and frozen
  // parameters are never written, so they stay zero.
  writing_first_ = writeFirstPossible();
  alone_ = shard.alone;
  std::memset(written_, 0, sizeof written_);
  std::memset(direct_, 0, sizeof direct_);
  std::memset(finite_, 0, sizeof finite_);
  std::memset(vouched_, 0, sizeof vouched_);
  try {
    if (!writing_first_) mem_->zero(shard.device, shard.grads, h_->param_floats);
    if (shard.size() > 0) computePasses(shard, computer);
  } catch (const ShardError& ex) {
    setError(ex.type().c_str(), ex.what());
  } catch (const std::exception& ex) {
    setError("", ex.what());
  }
  // Write-first: what backward did not reach (an empty shard: everything; a failed pass:
  // whatever it left unwritten) gets zeros, so no earlier step's gradient stays.
  if (writing_first_) zeroUnwritten(shard.grads);
  writing_first_ = false;
  armed_ = false;
}

// The shard's passes, for every kind of worker: they bound the activation memory of a
// large shard, and the gradient of the sum accumulates in the slot across them.
void StepParticipant::computePasses(const Shard& shard, ShardComputer& computer) {
  Shard s = shard;
  resolveBatch(*h_, seg_.base(), &s);
  // The same rows where the trainer holds them (checked there against the same sizes): a
  // pointer `at` into a tensor of the request region starting at `in_region` moves to the
  // same offset in that tensor's local copy.
  const uint8_t* inputs = seg_.base() + h_->req_inputs.offset;
  const auto moved = [](const void* at, const uint8_t* in_region, const uint8_t* local) {
    return local + (static_cast<const uint8_t*>(at) - in_region);
  };
  if (s.kind == ipc::BatchKind::kExplicit && local_.inputs != nullptr) {
    s.inputs = moved(s.inputs, inputs, local_.inputs);
    s.targets = moved(s.targets, seg_.base() + h_->req_targets.offset, local_.targets);
  }
  if (s.kind == ipc::BatchKind::kStructured && local_.leaves[0] != nullptr) {
    for (uint32_t k = 0; k < s.num_leaves; ++k) {
      s.leaf_data[k] = moved(s.leaf_data[k], inputs + s.leaves[k].offset, local_.leaves[k]);
    }
  }
  computer.beginShard(s);
  const int64_t n = s.size();
  const int64_t pass = s.max_examples_per_pass > 0 ? s.max_examples_per_pass : n;
  double loss = 0, count = 0;
  for (int64_t b = 0; b < n; b += pass) {
    const int64_t stop = std::min(n, b + pass);
    armed_ = num_buckets_ > 0 && stop == n;  // the last pass completes gradients
    const PassResult r = computer.computePass(s, b, stop);
    loss += r.loss_sum;
    count += r.count;
  }
  computer.markGradParams(me_.grad_params, std::min(h_->num_params, ipc::kMaxParams));
  // Backward's kernels have written the slot before the others read it.
  mem_->synchronize(shard.device);
  me_.loss_sum = loss;
  me_.count = count;
  me_.nonfinite_loss = std::isfinite(loss) ? 0 : 1;
  SHMGRAD_CHECK(std::isfinite(count) && count >= 0, ErrorKind::kInvalidArgument,
                "the shard's count is ", count,
                ": forward must return (loss_sum, count) with a finite count >= 0");
}

// Arrives and waits for all n participants. False if the step was aborted or replaced.
// A retiring worker finishes its step; only a stop or the coordinator's death ends the
// wait early.
bool StepParticipant::barrier(std::atomic<uint32_t>& word, uint32_t e, uint32_t n) {
  return ipc::barrierWait(
      word, e, n, c_.abort_epoch, barrierDeadline(), [&] { return keepWaiting(); },
      barrier_spin_ns_, &barrier_spin_);
}

// The same wait without arriving (this participant arrived earlier): the compute barrier
// of a bucketed step, after the participant's pieces.
bool StepParticipant::awaitArrivals(std::atomic<uint32_t>& word, uint32_t e, uint32_t n) {
  return ipc::awaitBarrier(
      word, e, n, c_.abort_epoch, barrierDeadline(), [&] { return keepWaiting(); },
      barrier_spin_ns_, &barrier_spin_);
}

// What every wait of a step polls once per slice (a system call: not before every sleep),
// and when it gives up.
bool StepParticipant::keepWaiting() {
  return c_.stop_requested.load(std::memory_order_acquire) == 0 && !coordinatorGone();
}

uint64_t StepParticipant::barrierDeadline() const {
  return ipc::monotonicNs() +
         std::chrono::duration_cast<std::chrono::nanoseconds>(kBarrierTimeout).count();
}

// The step's count (the participants' counts, after the compute barrier): the same sum,
// in rank order, in every reducer. 0 when a count read from the segment is not a finite
// number >= 0 (the trainer then refuses the step).
double StepParticipant::stepCount(const Shard& shard) const {
  const ipc::StepRequest& r = h_->request;
  double total = 0;
  for (uint32_t k = 0; k < shard.participants; ++k) {
    const double c = h_->workers[r.participants[k]].count;
    if (!std::isfinite(c) || c < 0) return 0;
    total += c;
  }
  return total;
}

// What the reducers multiply the slots' sum by. A mean is over the participants' counts
// (the examples, where they are the counts). Backward already took the mean's
// r.scale = 1/B (prepareShard: the slots hold what plain PyTorch's backward of the batch's
// mean gives for their examples, so float16 overflows where it would); only a mean over
// other counts (tokens) rescales, by B / count (0 for a count of 0: the trainer refuses
// that step), and a sum through the mean's backward by B. Needs every participant's count:
// after the compute barrier.
float StepParticipant::stepRescale(const Shard& shard) const {
  const ipc::StepRequest& r = h_->request;
  const auto reduction = static_cast<ipc::Reduction>(r.reduction);
  const bool mean = reduction == ipc::Reduction::kMean;
  const double count = mean ? stepCount(shard) : 0;
  const double B = static_cast<double>(r.num_examples);
  return reduction == ipc::Reduction::kSumThroughMean ? static_cast<float>(B)
         : !mean || count == B                        ? 1.0f
         : count > 0                                  ? static_cast<float>(B / count)
                                                      : 0.0f;
}

// Where the result [b, end) holds a NaN or an infinity, names the culprits: whose slot
// holds the non-finite values there, or this reducer, whose sum of finite slots overflowed.
void StepParticipant::checkNonFinite(const float* out, const float* const* ins, uint32_t n,
                                     uint64_t b, uint64_t end) {
  const ipc::StepRequest& r = h_->request;
  const int dev = mem_->ordinal(slot_);
  if (!mem_->anyNonFinite(dev, out, b, end)) return;
  bool in_slots = false;
  for (uint32_t k = 0; k < n; ++k) {
    if (mem_->anyNonFinite(dev, ins[k], b, end)) {
      h_->workers[r.participants[k]].nonfinite_grad.store(1, std::memory_order_relaxed);
      in_slots = true;
    }
  }
  if (!in_slots) me_.nonfinite_grad.store(2, std::memory_order_relaxed);
}

void StepParticipant::reducePhase(const Shard& shard) {
  const ipc::StepRequest& r = h_->request;
  const uint32_t n = shard.participants;
  const bool mean = static_cast<ipc::Reduction>(r.reduction) == ipc::Reduction::kMean;
  const float rescale = stepRescale(shard);
  const int dev = shard.device;  // where this reducer runs: its own device, or the host
  if (shard.alone) {
    // The gradient is already in the reduced buffer (prepareShard). Then look for
    // non-finite values, as the reducers of a larger step do.
    // Parameters whose hook found them finite as it wrote them are not read again
    // (unless rescaled: scaling can overflow).
    if (rescale != 1.0f) mem_->scale(dev, shard.grads, 0, h_->param_floats, rescale);
    const bool found = rescale == 1.0f && dev < 0
                           ? anyNonFiniteUnchecked(shard.grads)
                           : mem_->anyNonFinite(dev, shard.grads, 0, h_->param_floats);
    if (found) {
      me_.nonfinite_grad.store(1, std::memory_order_relaxed);
    }
    return;
  }
  uint64_t b, end;
  ipc::sliceBounds(h_->param_floats, n, shard.rank, &b, &end);
  const float* ins[ipc::kMaxWorkers];
  for (uint32_t k = 0; k < n; ++k) ins[k] = mem_->slot(r.participants[k]);
  float* out = mem_->reduced();
  if (shard.accumulate == ipc::Accumulate::kFresh) {
    mem_->reduce(dev, out, nullptr, 0.0f, ins, n, b, end, rescale);
  } else {
    // out = a * prev + b * sum: the previous result is left intact (a retry adds once).
    const bool into_accum = shard.accumulate == ipc::Accumulate::kReducedToAccum;
    const float* prev = into_accum ? mem_->reduced() : mem_->accum();
    out = into_accum ? mem_->accum() : mem_->reduced();
    float a = 1.0f, s = rescale;
    if (mean) {  // the slots hold sums divided by the step's examples
      const auto w = ipc::accumulationWeights(true, r.prev_count, stepCount(shard), r.num_examples);
      a = static_cast<float>(w.prev);
      s = static_cast<float>(w.fresh);
    }
    mem_->reduce(dev, out, prev, a, ins, n, b, end, s);
  }
  checkNonFinite(out, ins, n, b, end);
}

// A bucketed step's reduction (docs/DESIGN.md, "Buckets"). This participant has computed
// and marked every bucket; it arrives at the compute barrier without waiting, then takes
// pieces of buckets every participant has completed (the last bucket first: backward
// completes them in about that order), sleeping on bucket_progress while none is left to
// take, until every piece is taken. So a participant that finished early reduces while the
// slowest still computes, and only what its last buckets hold remains after it. The sum is
// the one the unbucketed reduction makes, element for element (the same inputs in the same
// order, one rounding each); only the scale of a mean over counts other than the examples
// is not known before every count is (after the compute barrier): a piece reduced before
// then is reduced with the scale 1 (exact) and rescaled afterwards, one rounding, as the
// unbucketed reduction's one multiply.
bool StepParticipant::bucketedReduce(const Shard& shard, ShardComputer& computer, uint64_t t1) {
  const ipc::StepRequest& r = h_->request;
  const uint32_t e = shard.epoch, n = shard.participants, K = shard.num_buckets;
  const uint32_t arrived = ipc::arriveBarrier(c_.compute_barrier, e);
  if (arrived == 0) return false;  // replaced
  if (arrived == n) ipc::futexWake(&c_.compute_barrier);
  const auto complete = [&](const std::atomic<uint32_t>& word) {
    return ipc::barrierComplete(word, e, n);
  };
  const auto ended = [&] {  // aborted or replaced
    return c_.abort_epoch.load(std::memory_order_acquire) == e ||
           (c_.compute_barrier.load(std::memory_order_acquire) & ipc::kBarrierTagMask) !=
               ipc::barrierTag(e);
  };
  const float* ins[ipc::kMaxWorkers];
  for (uint32_t k = 0; k < n; ++k) ins[k] = mem_->slot(r.participants[k]);
  float* out = mem_->reduced();
  const float provisional =
      static_cast<ipc::Reduction>(r.reduction) == ipc::Reduction::kSumThroughMean
          ? static_cast<float>(r.num_examples)
          : 1.0f;
  const auto pieceBounds = [&](uint32_t k, uint32_t part, uint64_t* b, uint64_t* end) {
    uint64_t lo, hi;
    ipc::sliceBounds(shard.bucket_begin[k + 1] - shard.bucket_begin[k], n, part, &lo, &hi);
    *b = shard.bucket_begin[k] + lo;
    *end = shard.bucket_begin[k] + hi;
  };
  // Pieces reduced before the counts were in, as bucket * kMaxWorkers + part.
  uint16_t early[ipc::kMaxBuckets * ipc::kMaxWorkers];
  uint32_t num_early = 0;
  bool exhausted[ipc::kMaxBuckets] = {};  // every piece of it taken
  uint64_t work = 0, hidden = 0;
  float rescale = 1.0f;
  bool known = false;  // rescale holds the step's (every count is in)
  const uint64_t deadline = barrierDeadline();
  try {
    for (;;) {
      const uint32_t progress = c_.bucket_progress.load(std::memory_order_acquire);
      bool took = false, waiting = false;
      for (uint32_t k = K; k-- > 0 && !took;) {
        if (exhausted[k]) continue;
        if (!complete(c_.buckets[k].ready)) {
          waiting = true;
          continue;
        }
        const uint32_t claimed = ipc::arriveBarrier(c_.buckets[k].claimed, e);
        if (claimed == 0) return false;  // replaced
        if (claimed > n) {
          exhausted[k] = true;
          continue;
        }
        const uint64_t s0 = ipc::monotonicNs();
        if (!known && complete(c_.compute_barrier)) {
          rescale = stepRescale(shard);
          known = true;
        }
        uint64_t b, end;
        pieceBounds(k, claimed - 1, &b, &end);
        mem_->reduce(shard.device, out, nullptr, 0.0f, ins, n, b, end,
                     known ? rescale : provisional);
        if (known) {
          checkNonFinite(out, ins, n, b, end);
        } else {
          early[num_early++] = static_cast<uint16_t>(k * ipc::kMaxWorkers + claimed - 1);
        }
        const uint64_t s1 = ipc::monotonicNs();
        work += s1 - s0;
        if (!complete(c_.compute_barrier)) hidden += s1 - s0;
        took = true;
      }
      if (took) continue;
      if (!waiting) break;  // every piece is taken
      // Nothing to take until another bucket is complete (or the step ends).
      const bool woken = ipc::waitUntil(
          &c_.bucket_progress,
          [&] { return c_.bucket_progress.load(std::memory_order_acquire) != progress || ended(); },
          [&] { return keepWaiting(); }, deadline, std::chrono::milliseconds(200), barrier_spin_ns_,
          &bucket_spin_);
      if (!woken || ended()) return false;
    }
    if (!awaitArrivals(c_.compute_barrier, e, n)) return false;
    const uint64_t s0 = ipc::monotonicNs();
    if (!known) rescale = stepRescale(shard);
    shareBuffers(shard, computer);
    for (uint32_t i = 0; i < num_early; ++i) {
      uint64_t b, end;
      pieceBounds(early[i] / ipc::kMaxWorkers, early[i] % ipc::kMaxWorkers, &b, &end);
      if (rescale != provisional) mem_->scale(shard.device, out, b, end, rescale);
      checkNonFinite(out, ins, n, b, end);
    }
    work += ipc::monotonicNs() - s0;
  } catch (const std::exception& ex) {
    setError("", ex.what());
  }
  me_.reduce_ns = work;
  me_.reduce_early_ns = hidden;
  const uint64_t spent = ipc::monotonicNs() - t1;
  me_.barrier_wait_ns = spent > work ? spent - work : 0;
  return true;
}

// The step's first participant, BufferRule::kMean: the shared float32 buffers become the
// participants' copies averaged with their examples as weights; int64 ones (batch counts)
// take this participant's. Every copy was written before the compute barrier.
void StepParticipant::averageBuffers(const Shard& shard) {
  const ipc::StepRequest& r = h_->request;
  const uint32_t n = shard.participants;
  double total = 0;
  for (uint32_t k = 0; k < n; ++k)
    total += static_cast<double>(h_->workers[r.participants[k]].examples);
  if (total <= 0) return;
  const ipc::BufferEntry* table = seg_.bufferTable();
  uint8_t* shared = seg_.buffers();
  for (uint32_t i = 0; i < h_->num_buffers; ++i) {
    const ipc::BufferEntry& e = table[i];  // validated on attach (validateHeader)
    if (e.dtype != static_cast<uint32_t>(ipc::DType::kFloat32)) {
      std::memcpy(shared + e.offset, seg_.slotBuffers(slot_) + e.offset, e.nbytes);
      continue;
    }
    // first + sum_k w_k (copy_k - first), in double: exactly the first copy where every
    // copy agrees (eval mode leaves the statistics as loaded), however uneven the weights.
    auto copy = [&](uint32_t k) {
      return reinterpret_cast<const float*>(seg_.slotBuffers(r.participants[k]) + e.offset);
    };
    float* out = reinterpret_cast<float*>(shared + e.offset);
    const float* first = copy(0);
    const uint64_t m = e.nbytes / sizeof(float);
    for (uint64_t j = 0; j < m; ++j) {
      double delta = 0;
      for (uint32_t k = 1; k < n; ++k) {
        const double w = static_cast<double>(h_->workers[r.participants[k]].examples) / total;
        delta += w * (static_cast<double>(copy(k)[j]) - first[j]);
      }
      out[j] = static_cast<float>(first[j] + delta);
    }
  }
}

// The last reducer: writes the step record, publishes done_epoch and wakes the trainer.
void StepParticipant::completeStep(uint32_t e, uint32_t n) {
  const ipc::StepRequest& r = h_->request;
  ipc::StepRecord rec{};
  rec.epoch = e;
  rec.workers = n;
  rec.examples = r.num_examples;
  for (uint32_t k = 0; k < n; ++k) {
    const ipc::WorkerRecord& w = h_->workers[r.participants[k]];
    rec.loss_sum += w.loss_sum;
    rec.compute_max_ns = std::max(rec.compute_max_ns, w.compute_ns);
    rec.reduce_max_ns = std::max(rec.reduce_max_ns, w.reduce_ns);
    rec.reduce_early_max_ns = std::max(rec.reduce_early_max_ns, w.reduce_early_ns);
  }
  const uint64_t now = ipc::monotonicNs();
  rec.wall_ns = now > r.publish_ns ? now - r.publish_ns : 0;
  const uint64_t busy = rec.compute_max_ns + rec.reduce_max_ns;
  rec.wait_ns = rec.wall_ns > busy ? rec.wall_ns - busy : 0;
  const uint64_t served = c_.steps_served.load(std::memory_order_relaxed);
  h_->stats[served % ipc::kStatsRing] = rec;
  c_.steps_served.store(served + 1, std::memory_order_release);
  c_.done_ns = ipc::monotonicNs();
  c_.done_epoch.store(e, std::memory_order_release);  // publishes done_ns
  ipc::bumpAndWake(&c_.trainer_wake);
}

}  // namespace shmgrad::worker
