#include "backend/process_group.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <utility>

#include "ipc/futex.h"

namespace shmgrad::backend {
namespace {

std::exception_ptr distError(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

// Runs a check of the core (shmgrad::Error) in the caller's thread, as a c10::Error
// (RuntimeError in Python) with the same message.
template <typename F>
auto checked(F f) {
  try {
    return f();
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

const char* kCudaFix =
    "the shmgrad backend moves CPU tensors through shared memory; for CUDA tensors name a "
    "backend per device: dist.init_process_group(\"cpu:shmgrad,cuda:nccl\")";

void checkTensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "shmgrad backend: ", op, " got an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "shmgrad backend: ", op, " got a tensor on ", t.device(), ": ",
              kCudaFix);
  TORCH_CHECK(t.layout() == at::kStrided, "shmgrad backend: ", op, " got a ", t.layout(),
              " tensor; only dense (strided) tensors are supported: call .to_dense() first");
}

ElemType elemTypeOf(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ElemType::kFloat32;
    case at::kDouble:
      return ElemType::kFloat64;
    case at::kHalf:
      return ElemType::kFloat16;
    case at::kBFloat16:
      return ElemType::kBFloat16;
    case at::kChar:
      return ElemType::kInt8;
    case at::kByte:
      return ElemType::kUInt8;
    case at::kShort:
      return ElemType::kInt16;
    case at::kInt:
      return ElemType::kInt32;
    case at::kLong:
      return ElemType::kInt64;
    case at::kBool:
      return ElemType::kBool;
    default:
      TORCH_CHECK(false, "shmgrad backend: ", op, " of ", t.scalar_type(),
                  " tensors is not supported: use float32, float64, float16, bfloat16, an "
                  "integer type or bool (complex tensors: torch.view_as_real)");
  }
}

ReduceKind reduceKindOf(const c10d::ReduceOp& op, const char* name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return ReduceKind::kSum;
    case c10d::ReduceOp::AVG:
      return ReduceKind::kAvg;
    case c10d::ReduceOp::PRODUCT:
      return ReduceKind::kProduct;
    case c10d::ReduceOp::MIN:
      return ReduceKind::kMin;
    case c10d::ReduceOp::MAX:
      return ReduceKind::kMax;
    case c10d::ReduceOp::BAND:
      return ReduceKind::kBand;
    case c10d::ReduceOp::BOR:
      return ReduceKind::kBor;
    case c10d::ReduceOp::BXOR:
      return ReduceKind::kBxor;
    default:
      TORCH_CHECK(false, "shmgrad backend: ", name,
                  " with this reduce op (PREMUL_SUM?) is not supported: use SUM, AVG, "
                  "PRODUCT, MIN, MAX, BAND, BOR or BXOR (scale the tensor first)");
  }
}

// A tensor as a flat range of bytes: itself when contiguous, else a contiguous copy whose
// result is written back after the collective.
struct Dense {
  at::Tensor user, flat;
  explicit Dense(const at::Tensor& t) : user(t), flat(t.is_contiguous() ? t : t.contiguous()) {}
  Span span() const {
    return Span{static_cast<uint8_t*>(flat.data_ptr()),
                static_cast<uint64_t>(flat.numel()) * flat.element_size()};
  }
  void writeBack() const {
    if (!flat.is_same(user)) user.copy_(flat);
  }
};

std::vector<Dense> denseAll(const std::vector<at::Tensor>& ts, const char* op) {
  std::vector<Dense> out;
  out.reserve(ts.size());
  for (const auto& t : ts) {
    checkTensor(t, op);
    out.emplace_back(t);
  }
  return out;
}
std::vector<Span> spansOf(const std::vector<Dense>& ds) {
  std::vector<Span> out;
  out.reserve(ds.size());
  for (const auto& d : ds) out.push_back(d.span());
  return out;
}
void writeBackAll(const std::vector<Dense>& ds) {
  for (const auto& d : ds) d.writeBack();
}

// `whole` split into `parts` equal spans (the flat buffers of the *_base collectives).
std::vector<Span> splitEqually(const Span& whole, uint64_t parts) {
  std::vector<Span> out(parts);
  const uint64_t each = whole.bytes / parts;
  for (uint64_t j = 0; j < parts; ++j) out[j] = Span{whole.data + j * each, each};
  return out;
}

void checkSameAs(const at::Tensor& t, const at::Tensor& like, const char* op) {
  checkTensor(t, op);
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.numel() == like.numel(),
              "shmgrad backend: ", op, ": every tensor must have the input's type and size (",
              like.scalar_type(), ", ", like.numel(), " elements), got ", t.scalar_type(), ", ",
              t.numel());
}

// async_op=False (torch 2.7 on sets opts.asyncOp; older ones do not say).
template <typename Options>
bool isSync(const Options& opts) {
  if constexpr (requires { opts.asyncOp; }) {
    return !opts.asyncOp;
  } else {
    return false;
  }
}

std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }
std::string stringOf(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

// The c10d Work of one collective: complete() or error() once, from the communication
// thread; wait() (Work's) and the future see the same outcome.
class ShmWork : public c10d::Work {
 public:
  ShmWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<at::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  void complete() {
    future_->markCompleted(c10::IValue(outputs_));
    finish();
  }
  void error(std::exception_ptr e) {
    future_->setError(e);
    finish(e);
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<at::ivalue::Future> future_;
};

}  // namespace

struct ProcessGroupShm::Pending {
  c10::intrusive_ptr<ShmWork> work;
  std::chrono::milliseconds timeout;
  std::function<void(uint64_t)> run;
};

// Point-to-point operations run on one thread per peer and direction, in order: a send
// to one peer never waits behind a send to another, nor behind a collective.
struct ProcessGroupShm::Lane {
  std::deque<std::shared_ptr<Pending>> queue;
  bool stop = false;
  std::thread thread;
};

c10::intrusive_ptr<c10d::Backend> ProcessGroupShm::create(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    const std::chrono::duration<float>& timeout, const std::string& key_prefix,
    const std::vector<int64_t>& node_of_rank, const c10::intrusive_ptr<c10d::Backend>& leaders,
    const c10::intrusive_ptr<c10d::Backend>& everyone) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "shmgrad backend: rank ", rank, " of ", size);
  TORCH_CHECK(node_of_rank.size() == static_cast<size_t>(size),
              "shmgrad backend: a node for each of the ", size, " ranks");
  Topology topo;
  topo.node_of_rank = node_of_rank;
  topo.local_rank_of_rank.resize(size);
  std::vector<int> seen(size, 0);
  for (int r = 0; r < size; ++r) {
    const int64_t n = node_of_rank[r];
    TORCH_CHECK(n >= 0 && n < size, "shmgrad backend: node index ", n, " of rank ", r);
    topo.local_rank_of_rank[r] = seen[n]++;
  }
  topo.node = node_of_rank[rank];
  topo.local_size = seen[topo.node];
  topo.local_rank = topo.local_rank_of_rank[rank];
  topo.nodes = 0;
  for (int n : seen) topo.nodes += n > 0 ? 1 : 0;
  TORCH_CHECK(static_cast<uint32_t>(topo.local_size) <= kMaxRanks,
              "shmgrad backend: ", topo.local_size, " ranks on one node; at most ", kMaxRanks);
  TORCH_CHECK(topo.nodes == 1 || (everyone && (topo.local_rank != 0 || leaders)),
              "shmgrad backend: ranks on ", topo.nodes,
              " nodes need the gloo groups between them (shmgrad._backend creates them)");
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
  // This node's ranks share one segment: its local rank 0 creates it.
  const std::string key = key_prefix + "node" + std::to_string(topo.node) + "/";
  const auto local_size = static_cast<uint32_t>(topo.local_size);
  std::unique_ptr<ShmComm> comm;
  if (topo.local_rank == 0) {
    comm = checked([&] {
      return ShmComm::create(local_size, ShmComm::defaultStagingBytes(local_size),
                             ShmComm::defaultArenaBytes(local_size));
    });
    store->set(key + "segment", bytesOf(comm->name()));
  } else {
    const std::string name = stringOf(store->get(key + "segment"));
    comm = checked(
        [&] { return ShmComm::attach(name, local_size, static_cast<uint32_t>(topo.local_rank)); });
  }
  // Every rank waits for all to attach (the store's timeout), then the first closes the
  // descriptor the others opened the memory through.
  if (store->add(key + "attached", 1) == topo.local_size) store->set(key + "ready", bytesOf("1"));
  store->wait({key + "ready"}, ms);
  comm->release();
  checked([&] { comm->watchPeers(); });
  return c10::make_intrusive<ProcessGroupShm>(std::move(comm), rank, size, ms, std::move(topo),
                                              leaders, everyone);
}

ProcessGroupShm::ProcessGroupShm(std::unique_ptr<ShmComm> comm, int rank, int size,
                                 std::chrono::milliseconds timeout, Topology topology,
                                 c10::intrusive_ptr<c10d::Backend> leaders,
                                 c10::intrusive_ptr<c10d::Backend> everyone)
    : c10d::Backend(rank, size),
      comm_(std::move(comm)),
      timeout_(timeout),
      topo_(std::move(topology)),
      leaders_(std::move(leaders)),
      everyone_(topo_.nodes > 1 ? std::move(everyone) : nullptr) {
  thread_ = std::thread([this] { loop(); });
}

ProcessGroupShm::~ProcessGroupShm() {
  std::deque<std::shared_ptr<Pending>> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    dropped.swap(queue_);
    for (auto& [key, lane] : lanes_) {
      lane->stop = true;
      for (auto& p : lane->queue) dropped.push_back(std::move(p));
      lane->queue.clear();
    }
  }
  cv_.notify_all();
  lanes_cv_.notify_all();
  comm_->shutdown();  // a wait in progress ends now, not at its deadline
  for (auto& [key, lane] : lanes_) lane->thread.join();
  for (auto& p : dropped) {
    p->work->error(
        distError("shmgrad backend: the process group was destroyed before this collective ran"));
  }
  if (thread_.joinable()) thread_.join();
  comm_.reset();  // leaves the group: peers still waiting fail at once, naming this rank
}

bool ProcessGroupShm::supportsTensorAlloc(c10::DeviceIndex device_index) {
  return device_index < 0 && comm_->arena() != nullptr;  // the CPU (index -1) only
}

at::Tensor ProcessGroupShm::allocateTensor(long size, at::TensorOptions options) {
  TORCH_CHECK(size >= 0, "shmgrad backend: allocateTensor of ", size, " elements");
  TORCH_CHECK(!options.has_device() || options.device().is_cpu(),
              "shmgrad backend: allocateTensor on ", options.device(),
              ": it allocates CPU memory only");
  options = options.device(at::kCPU);
  const auto itemsize = static_cast<uint64_t>(options.dtype().itemsize());
  TORCH_CHECK(static_cast<uint64_t>(size) <= (uint64_t{1} << 62) / itemsize,
              "shmgrad backend: allocateTensor of ", size, " elements is too large");
  const uint64_t bytes = static_cast<uint64_t>(size) * itemsize;
  const std::shared_ptr<ArenaPool> pool = comm_->arena();
  if (!pool) return at::empty({size}, options);  // SHMGRAD_BACKEND_ARENA_MB=0: asked for
  uint8_t* block = pool->allocate(bytes);
  if (block == nullptr) {
    TORCH_WARN_ONCE("shmgrad backend: a tensor of ", bytes,
                    " bytes does not fit in this rank's arena (", pool->capacity() >> 20, " MiB, ",
                    pool->inUse() >> 20,
                    " MiB in use), or this is a forked child of the rank: it is ordinary "
                    "memory and its all-reduce goes through staging. Set "
                    "SHMGRAD_BACKEND_ARENA_MB higher for the in-place path.");
    return at::empty({size}, options);
  }
  return at::from_blob(
      block, {size}, [pool](void* p) { pool->release(static_cast<uint8_t*>(p)); }, options);
}

std::map<std::string, uint64_t> ProcessGroupShm::arenaStats() const {
  const auto& pool = comm_->arena();
  return {{"in_place_allreduces", comm_->inPlaceAllreduces()},
          {"arena_bytes", pool ? pool->capacity() : 0},
          {"arena_in_use", pool ? pool->inUse() : 0}};
}

std::chrono::milliseconds ProcessGroupShm::remaining(uint64_t deadline_ns) {
  const uint64_t now = ipc::monotonicNs();
  return std::chrono::milliseconds(deadline_ns > now ? (deadline_ns - now) / 1000000 + 1 : 1);
}

uint64_t ProcessGroupShm::deadlineFor(std::chrono::milliseconds timeout) const {
  const auto t = timeout == c10d::kUnsetTimeout ? timeout_ : timeout;
  return ipc::monotonicNs() + static_cast<uint64_t>(t.count()) * 1000000ull;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::enqueue(c10d::OpType type,
                                                        std::vector<at::Tensor> outputs,
                                                        std::chrono::milliseconds timeout,
                                                        std::function<void(uint64_t)> run,
                                                        bool sync) {
  auto work = c10::make_intrusive<ShmWork>(rank_, type, std::move(outputs));
  auto pending = std::make_shared<Pending>(Pending{work, timeout, std::move(run)});
  {
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(!stop_, "shmgrad backend: the process group is being destroyed");
    ++issued_;
    if (sync && queue_.empty() && !running_) {
      // The caller waits for it anyway (async_op=False) and nothing is ahead of it: run
      // it here, without the hand-over to the communication thread and back.
      running_ = true;
      lock.unlock();
      execute(*pending);
      lock.lock();
      running_ = false;
      lock.unlock();
      cv_.notify_all();
      return work;
    }
    queue_.push_back(std::move(pending));
  }
  cv_.notify_all();
  return work;
}

void ProcessGroupShm::execute(Pending& p) {
  try {
    p.run(deadlineFor(p.timeout));
  } catch (const Error& e) {
    p.work->error(distError(e.what()));
    return;
  } catch (...) {
    p.work->error(std::current_exception());
    return;
  }
  p.work->complete();
}

void ProcessGroupShm::loop() {
  for (;;) {
    std::shared_ptr<Pending> p;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return (stop_ && !running_) || (!queue_.empty() && !running_); });
      if (queue_.empty()) return;
      p = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    execute(*p);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = false;
    }
  }
}

// ---------------------------------------------------------------------------- collectives

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  TORCH_CHECK(opts.rootTensor == 0, "shmgrad backend: broadcast: rootTensor must be 0");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "shmgrad backend: broadcast from rank ",
              opts.rootRank, " in a group of ", size_);
  auto ds = denseAll(tensors, "broadcast");
  const auto root = static_cast<int>(opts.rootRank);
  return enqueue(
      c10d::OpType::BROADCAST, tensors, opts.timeout,
      [this, ds, root](uint64_t deadline) {
        // Within the root's node, from the root; between nodes, from its node's leader;
        // within the other nodes, from their leaders. One node: the first step alone.
        const int root_node = static_cast<int>(topo_.node_of_rank[root]);
        if (topo_.node == root_node && topo_.local_size > 1)
          comm_->broadcast(spansOf(ds), topo_.local_rank_of_rank[root], deadline);
        if (leaders_) {
          c10d::BroadcastOptions o;
          o.rootRank = root_node;
          o.timeout = remaining(deadline);
          for (const auto& d : ds) {
            std::vector<at::Tensor> v{d.flat};
            leaders_->broadcast(v, o)->wait();
          }
        }
        if (topo_.node != root_node && topo_.local_size > 1)
          comm_->broadcast(spansOf(ds), 0, deadline);
        writeBackAll(ds);
      },
      isSync(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "shmgrad backend: allreduce takes one tensor per rank, got ",
              tensors.size(), ": use allreduce_coalesced (dist.all_reduce_coalesced) for several");
  TORCH_CHECK(!opts.sparseIndices.has_value(),
              "shmgrad backend: sparse all-reduce is not supported");
  c10d::AllreduceCoalescedOptions coalesced;
  coalesced.reduceOp = opts.reduceOp;
  coalesced.timeout = opts.timeout;
  return allreduce_coalesced(tensors, coalesced);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "shmgrad backend: allreduce of no tensors");
  auto ds = denseAll(tensors, "allreduce");
  const ElemType t = elemTypeOf(tensors[0], "allreduce");
  for (const auto& x : tensors) {
    TORCH_CHECK(x.scalar_type() == tensors[0].scalar_type(),
                "shmgrad backend: allreduce_coalesced of tensors of different types (",
                tensors[0].scalar_type(), ", ", x.scalar_type(), "): reduce each type apart");
  }
  const ReduceKind r = reduceKindOf(opts.reduceOp, "allreduce");
  checked([&] { checkReduce(t, r); });
  const c10d::ReduceOp op = opts.reduceOp;
  return enqueue(
      c10d::OpType::ALLREDUCE, tensors, opts.timeout,
      [this, ds, t, r, op](uint64_t deadline) {
        if (!leaders_ && !everyone_) {
          comm_->allreduce(spansOf(ds), t, r, deadline);
        } else {
          std::vector<at::Tensor> flats;
          for (const auto& d : ds) flats.push_back(d.flat);
          allreduceAcrossNodes(spansOf(ds), flats, t, r, op, deadline);
        }
        writeBackAll(ds);
      },
      isSync(opts));
}

// Within each node to its leader, between the leaders (gloo), back within each node.
// AVG is summed and divided once at the end (gloo has no AVG).
void ProcessGroupShm::allreduceAcrossNodes(const std::vector<Span>& spans,
                                           const std::vector<at::Tensor>& flats, ElemType t,
                                           ReduceKind r, const c10d::ReduceOp& op,
                                           uint64_t deadline) {
  const ReduceKind local = r == ReduceKind::kAvg ? ReduceKind::kSum : r;
  if (topo_.local_size > 1) comm_->reduce(spans, t, local, 0, deadline);
  if (leaders_) {
    c10d::AllreduceOptions o;
    o.reduceOp = r == ReduceKind::kAvg ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
    o.timeout = remaining(deadline);
    for (const auto& flat : flats) {
      std::vector<at::Tensor> v{flat};
      leaders_->allreduce(v, o)->wait();
      if (r == ReduceKind::kAvg) {
        if (v[0].is_floating_point()) {
          v[0].div_(size_);
        } else {
          v[0].div_(size_, "trunc");  // integers: as one node's AVG
        }
      }
    }
  }
  if (topo_.local_size > 1) comm_->broadcast(spans, 0, deadline);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  if (everyone_) return everyone_->reduce(tensors, opts);  // across nodes: gloo
  TORCH_CHECK(tensors.size() == 1 && opts.rootTensor == 0,
              "shmgrad backend: reduce takes one tensor per rank");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "shmgrad backend: reduce to rank ",
              opts.rootRank, " in a group of ", size_);
  auto ds = denseAll(tensors, "reduce");
  const ElemType t = elemTypeOf(tensors[0], "reduce");
  const ReduceKind r = reduceKindOf(opts.reduceOp, "reduce");
  checked([&] { checkReduce(t, r); });
  const auto root = static_cast<uint32_t>(opts.rootRank);
  return enqueue(c10d::OpType::REDUCE, tensors, opts.timeout,
                 [this, ds, t, r, root](uint64_t deadline) {
                   comm_->reduce(spansOf(ds), t, r, root, deadline);
                   if (comm_->rank() == root) writeBackAll(ds);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (everyone_) return everyone_->allgather(outputs, inputs, opts);  // across nodes: gloo
  TORCH_CHECK(inputs.size() == 1 && outputs.size() == 1,
              "shmgrad backend: allgather takes one input tensor and one list of outputs");
  TORCH_CHECK(outputs[0].size() == static_cast<size_t>(size_), "shmgrad backend: allgather needs ",
              size_, " output tensors (one per rank), got ", outputs[0].size());
  checkTensor(inputs[0], "allgather");
  for (const auto& o : outputs[0]) checkSameAs(o, inputs[0], "allgather");
  Dense in(inputs[0]);
  auto outs = denseAll(outputs[0], "allgather");
  return enqueue(c10d::OpType::ALLGATHER, outputs[0], opts.timeout,
                 [this, in, outs](uint64_t deadline) {
                   comm_->allgather(in.span(), spansOf(outs), deadline);
                   writeBackAll(outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  if (everyone_) return everyone_->_allgather_base(output, input, opts);  // across nodes: gloo
  checkTensor(input, "all_gather_into_tensor");
  checkTensor(output, "all_gather_into_tensor");
  TORCH_CHECK(
      output.scalar_type() == input.scalar_type() && output.numel() == input.numel() * size_,
      "shmgrad backend: all_gather_into_tensor: the output must hold ", size_,
      " times the input's ", input.numel(), " ", input.scalar_type(), " elements, got ",
      output.numel(), " ", output.scalar_type());
  Dense in(input), out(output);
  const uint64_t world = static_cast<uint64_t>(size_);
  return enqueue(c10d::OpType::_ALLGATHER_BASE, {output}, opts.timeout,
                 [this, in, out, world](uint64_t deadline) {
                   comm_->allgather(in.span(), splitEqually(out.span(), world), deadline);
                   out.writeBack();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (everyone_)
    return everyone_->allgather_coalesced(outputs, inputs, opts);  // across nodes: gloo
  TORCH_CHECK(outputs.size() == inputs.size(),
              "shmgrad backend: allgather_coalesced needs one output list per input");
  std::vector<Dense> ins;
  std::vector<std::vector<Dense>> outs;
  std::vector<at::Tensor> flat_outputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "allgather_coalesced");
    TORCH_CHECK(outputs[i].size() == static_cast<size_t>(size_),
                "shmgrad backend: allgather_coalesced needs ", size_, " outputs per input");
    for (const auto& o : outputs[i]) checkSameAs(o, inputs[i], "allgather_coalesced");
    ins.emplace_back(inputs[i]);
    outs.push_back(denseAll(outputs[i], "allgather_coalesced"));
    flat_outputs.insert(flat_outputs.end(), outputs[i].begin(), outputs[i].end());
  }
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, flat_outputs, opts.timeout,
                 [this, ins, outs](uint64_t deadline) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     comm_->allgather(ins[i].span(), spansOf(outs[i]), deadline);
                     writeBackAll(outs[i]);
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (everyone_)
    return everyone_->allgather_into_tensor_coalesced(outputs, inputs, opts);  // across nodes: gloo
  TORCH_CHECK(outputs.size() == inputs.size(),
              "shmgrad backend: allgather_into_tensor_coalesced needs one output per input");
  std::vector<Dense> ins, outs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "allgather_into_tensor_coalesced");
    checkTensor(outputs[i], "allgather_into_tensor_coalesced");
    TORCH_CHECK(outputs[i].scalar_type() == inputs[i].scalar_type() &&
                    outputs[i].numel() == inputs[i].numel() * size_,
                "shmgrad backend: allgather_into_tensor_coalesced: output ", i, " must hold ",
                size_, " times its input");
    ins.emplace_back(inputs[i]);
    outs.emplace_back(outputs[i]);
  }
  const uint64_t world = static_cast<uint64_t>(size_);
  return enqueue(c10d::OpType::COALESCED, outputs, opts.timeout,
                 [this, ins, outs, world](uint64_t deadline) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     comm_->allgather(ins[i].span(), splitEqually(outs[i].span(), world), deadline);
                     outs[i].writeBack();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  if (everyone_) return everyone_->gather(outputs, inputs, opts);  // across nodes: gloo
  TORCH_CHECK(inputs.size() == 1, "shmgrad backend: gather takes one input tensor");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "shmgrad backend: gather to rank ",
              opts.rootRank, " in a group of ", size_);
  checkTensor(inputs[0], "gather");
  const auto root = static_cast<uint32_t>(opts.rootRank);
  std::vector<Dense> outs;
  std::vector<at::Tensor> result;
  if (rank_ == opts.rootRank) {
    TORCH_CHECK(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_),
                "shmgrad backend: gather needs ", size_, " output tensors on the root");
    for (const auto& o : outputs[0]) checkSameAs(o, inputs[0], "gather");
    outs = denseAll(outputs[0], "gather");
    result = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "shmgrad backend: gather takes output tensors on the root only");
  }
  Dense in(inputs[0]);
  return enqueue(c10d::OpType::GATHER, result, opts.timeout,
                 [this, in, outs, root](uint64_t deadline) {
                   comm_->gather(in.span(), spansOf(outs), root, deadline);
                   writeBackAll(outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  if (everyone_) return everyone_->scatter(outputs, inputs, opts);  // across nodes: gloo
  TORCH_CHECK(outputs.size() == 1, "shmgrad backend: scatter takes one output tensor");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "shmgrad backend: scatter from rank ",
              opts.rootRank, " in a group of ", size_);
  checkTensor(outputs[0], "scatter");
  const auto root = static_cast<uint32_t>(opts.rootRank);
  std::vector<Dense> ins;
  if (rank_ == opts.rootRank) {
    TORCH_CHECK(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
                "shmgrad backend: scatter needs ", size_, " input tensors on the root");
    for (const auto& i : inputs[0]) checkSameAs(i, outputs[0], "scatter");
    ins = denseAll(inputs[0], "scatter");
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "shmgrad backend: scatter takes input tensors on the root only");
  }
  Dense out(outputs[0]);
  return enqueue(c10d::OpType::SCATTER, outputs, opts.timeout,
                 [this, ins, out, root](uint64_t deadline) {
                   comm_->scatter(spansOf(ins), out.span(), root, deadline);
                   out.writeBack();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (everyone_) return everyone_->reduce_scatter(outputs, inputs, opts);  // across nodes: gloo
  TORCH_CHECK(
      outputs.size() == 1 && inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
      "shmgrad backend: reduce_scatter takes one output and ", size_, " inputs");
  checkTensor(outputs[0], "reduce_scatter");
  for (const auto& i : inputs[0]) checkSameAs(i, outputs[0], "reduce_scatter");
  const ElemType t = elemTypeOf(outputs[0], "reduce_scatter");
  const ReduceKind r = reduceKindOf(opts.reduceOp, "reduce_scatter");
  checked([&] { checkReduce(t, r); });
  auto ins = denseAll(inputs[0], "reduce_scatter");
  Dense out(outputs[0]);
  return enqueue(c10d::OpType::REDUCE_SCATTER, outputs, opts.timeout,
                 [this, ins, out, t, r](uint64_t deadline) {
                   comm_->reduceScatter(spansOf(ins), out.span(), t, r, deadline);
                   out.writeBack();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  if (everyone_) return everyone_->_reduce_scatter_base(output, input, opts);  // across nodes: gloo
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (everyone_)
    return everyone_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);  // across nodes: gloo
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
              "shmgrad backend: reduce_scatter_tensor needs one output per input");
  const ReduceKind r = reduceKindOf(opts.reduceOp, "reduce_scatter_tensor");
  std::vector<Dense> ins, outs;
  std::vector<ElemType> types;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "reduce_scatter_tensor");
    checkTensor(outputs[i], "reduce_scatter_tensor");
    TORCH_CHECK(outputs[i].scalar_type() == inputs[i].scalar_type() &&
                    inputs[i].numel() == outputs[i].numel() * size_,
                "shmgrad backend: reduce_scatter_tensor: the input must hold ", size_,
                " times the output's ", outputs[i].numel(), " ", outputs[i].scalar_type(),
                " elements, got ", inputs[i].numel(), " ", inputs[i].scalar_type());
    types.push_back(elemTypeOf(outputs[i], "reduce_scatter_tensor"));
    checked([&] { checkReduce(types.back(), r); });
    ins.emplace_back(inputs[i]);
    outs.emplace_back(outputs[i]);
  }
  const uint64_t world = static_cast<uint64_t>(size_);
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, outputs, opts.timeout,
                 [this, ins, outs, types, r, world](uint64_t deadline) {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     comm_->reduceScatter(splitEqually(ins[i].span(), world), outs[i].span(),
                                          types[i], r, deadline);
                     outs[i].writeBack();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  if (everyone_)
    return everyone_->alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                    opts);  // across nodes: gloo
  checkTensor(input, "all_to_all_single");
  checkTensor(output, "all_to_all_single");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(),
              "shmgrad backend: all_to_all_single: input and output types differ");
  // Blocks of whole rows (dim 0), as the split sizes count them.
  auto blocks = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* which) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const uint64_t row_bytes =
        rows == 0 ? 0 : static_cast<uint64_t>(t.numel() / rows) * t.element_size();
    std::vector<uint64_t> out(size_);
    if (splits.empty()) {
      TORCH_CHECK(rows % size_ == 0, "shmgrad backend: all_to_all_single: the ", which, "'s ", rows,
                  " rows do not split evenly over ", size_, " ranks: give split sizes");
      for (auto& b : out) b = static_cast<uint64_t>(rows / size_) * row_bytes;
    } else {
      TORCH_CHECK(splits.size() == static_cast<size_t>(size_), "shmgrad backend: ", which,
                  "_split_sizes has ", splits.size(), " entries for ", size_, " ranks");
      int64_t sum = 0;
      for (size_t j = 0; j < splits.size(); ++j) {
        TORCH_CHECK(splits[j] >= 0, "shmgrad backend: a negative split size");
        sum += splits[j];
        out[j] = static_cast<uint64_t>(splits[j]) * row_bytes;
      }
      TORCH_CHECK(sum == rows, "shmgrad backend: ", which, "_split_sizes add up to ", sum,
                  " rows, the tensor has ", rows);
    }
    return out;
  };
  const auto in_sizes = blocks(input, input_split_sizes, "input");
  const auto out_sizes = blocks(output, output_split_sizes, "output");
  Dense in(input), out(output);
  return enqueue(c10d::OpType::ALLTOALL_BASE, {output}, opts.timeout,
                 [this, in, out, in_sizes, out_sizes](uint64_t deadline) {
                   auto cut = [](const Span& whole, const std::vector<uint64_t>& sizes) {
                     std::vector<Span> parts;
                     uint64_t off = 0;
                     for (uint64_t b : sizes) {
                       parts.push_back(Span{whole.data + off, b});
                       off += b;
                     }
                     return parts;
                   };
                   comm_->alltoall(cut(in.span(), in_sizes), cut(out.span(), out_sizes), deadline);
                   out.writeBack();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  if (everyone_) return everyone_->alltoall(outputs, inputs, opts);  // across nodes: gloo
  TORCH_CHECK(
      outputs.size() == static_cast<size_t>(size_) && inputs.size() == static_cast<size_t>(size_),
      "shmgrad backend: all_to_all takes ", size_, " input and ", size_, " output tensors");
  auto ins = denseAll(inputs, "all_to_all");
  auto outs = denseAll(outputs, "all_to_all");
  return enqueue(c10d::OpType::ALLTOALL, outputs, opts.timeout,
                 [this, ins, outs](uint64_t deadline) {
                   comm_->alltoall(spansOf(ins), spansOf(outs), deadline);
                   writeBackAll(outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(
      c10d::OpType::BARRIER, {}, opts.timeout,
      [this](uint64_t deadline) {
        comm_->barrier(deadline);
        if (leaders_) {
          c10d::BarrierOptions o;
          o.timeout = remaining(deadline);
          leaders_->barrier(o)->wait();
        }
        if (leaders_ || everyone_) comm_->barrier(deadline);
      },
      isSync(opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::send(std::vector<at::Tensor>& tensors, int dst,
                                                     int tag) {
  if (everyone_) return everyone_->send(tensors, dst, tag);  // across nodes: gloo
  TORCH_CHECK(tensors.size() == 1, "shmgrad backend: send takes one tensor");
  TORCH_CHECK(dst >= 0 && dst < size_ && dst != rank_, "shmgrad backend: send to rank ", dst,
              " from rank ", rank_, " in a group of ", size_);
  checkTensor(tensors[0], "send");
  Dense d(tensors[0]);
  const auto peer = static_cast<uint32_t>(topo_.local_rank_of_rank[dst]);
  return submitToLane(
      true, dst, c10d::OpType::SEND, tensors,
      [this, d, peer, tag](uint64_t deadline) { comm_->send(peer, d.span(), tag, deadline); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::recv(std::vector<at::Tensor>& tensors, int src,
                                                     int tag) {
  if (everyone_) return everyone_->recv(tensors, src, tag);  // across nodes: gloo
  TORCH_CHECK(tensors.size() == 1, "shmgrad backend: recv takes one tensor");
  TORCH_CHECK(src >= 0 && src < size_ && src != rank_, "shmgrad backend: recv from rank ", src,
              " on rank ", rank_, " in a group of ", size_);
  checkTensor(tensors[0], "recv");
  Dense d(tensors[0]);
  const auto peer = static_cast<uint32_t>(topo_.local_rank_of_rank[src]);
  return submitToLane(false, src, c10d::OpType::RECV, tensors,
                      [this, d, peer, tag](uint64_t deadline) {
                        comm_->recv(peer, d.span(), tag, deadline);
                        d.writeBack();
                      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false,
              "shmgrad backend: recv from any source is not supported: name the source rank "
              "(dist.recv(tensor, src=...)), or use a gloo group for it");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::submitToLane(bool sending, int peer,
                                                             c10d::OpType type,
                                                             std::vector<at::Tensor> outputs,
                                                             std::function<void(uint64_t)> run) {
  auto work = c10::make_intrusive<ShmWork>(rank_, type, std::move(outputs));
  auto pending = std::make_shared<Pending>(Pending{work, c10d::kUnsetTimeout, std::move(run)});
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!stop_, "shmgrad backend: the process group is being destroyed");
  auto& lane = lanes_[{peer, sending}];
  if (!lane) {
    lane = std::make_unique<Lane>();
    Lane* l = lane.get();
    l->thread = std::thread([this, l] {
      for (;;) {
        std::shared_ptr<Pending> p;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          lanes_cv_.wait(lock, [&] { return l->stop || !l->queue.empty(); });
          if (l->queue.empty()) return;
          p = std::move(l->queue.front());
          l->queue.pop_front();
        }
        execute(*p);
      }
    });
  }
  lane->queue.push_back(std::move(pending));
  lanes_cv_.notify_all();
  return work;
}

}  // namespace shmgrad::backend
