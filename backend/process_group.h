// The `shmgrad` torch.distributed backend: a c10d::Backend over ShmComm (one node's
// shared memory), registered by `import shmgrad` (python/shmgrad/_backend.py), so that
// `dist.init_process_group("shmgrad")` and DDP's reducer reach it without Python in
// between. docs/BACKEND.md describes it.
//
// Collectives are checked in the caller's thread (device, dtype, sizes, op: an error at
// once naming the fix) and run in issue order on one communication thread per group, so
// DDP's bucket all-reduces overlap its backward. Each returns a Work whose wait() and
// get_future() complete when the collective has, with a DistBackendError if it failed.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/shm_comm.h"

namespace shmgrad::backend {

class ProcessGroupShm : public c10d::Backend {
 public:
  // Where the ranks run: node_of_rank[r] is rank r's node (0..nodes-1); a node's ranks
  // share one segment, ordered by rank.
  struct Topology {
    std::vector<int64_t> node_of_rank;
    std::vector<int> local_rank_of_rank;
    int node = 0, nodes = 1, local_rank = 0, local_size = 1;
  };

  // What shmgrad._backend's creator calls for each new group: the ranks of a node find
  // each other through `store`, under `key_prefix` (its first rank creates the segment and
  // publishes its name). Across nodes, `leaders` (the first rank of every node; null elsewhere) and
  // `everyone` are gloo groups the creator made: all-reduce, broadcast and barrier go
  // through shared memory within each node and `leaders` between them; the other
  // collectives go through `everyone`.
  static c10::intrusive_ptr<c10d::Backend> create(
      const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
      const std::chrono::duration<float>& timeout, const std::string& key_prefix,
      const std::vector<int64_t>& node_of_rank, const c10::intrusive_ptr<c10d::Backend>& leaders,
      const c10::intrusive_ptr<c10d::Backend>& everyone);

  ProcessGroupShm(std::unique_ptr<ShmComm> comm, int rank, int size,
                  std::chrono::milliseconds timeout, Topology topology,
                  c10::intrusive_ptr<c10d::Backend> leaders,
                  c10::intrusive_ptr<c10d::Backend> everyone);
  ~ProcessGroupShm() override;

  const std::string getBackendName() const override { return "shmgrad"; }

  // c10d's allocator hook: DDP's reducer asks for its gradient buckets here (when
  // DDP_DISABLE_COMM_MEM=0, which shmgrad._backend sets unless the user has set it): a
  // CPU tensor in this rank's arena, so that its all-reduce runs in place. Ordinary memory
  // when the arena is full or off (SHMGRAD_BACKEND_ARENA_MB=0), with a warning.
  bool supportsTensorAlloc(c10::DeviceIndex device_index) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
  // {"in_place_allreduces", "arena_bytes", "arena_in_use"}: what tests and the bench read.
  std::map<std::string, uint64_t> arenaStats() const;
  uint64_t getSequenceNumberForGroup() override { return issued_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // One collective, queued: `run` moves the data (in the communication thread) given its
  // deadline; `outputs` are what the Work's future holds.
  struct Pending;
  // sync: the caller waits for it at once (async_op=False); it runs in the caller's
  // thread when nothing is queued ahead of it.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                         std::chrono::milliseconds timeout,
                                         std::function<void(uint64_t)> run, bool sync = false);
  void execute(Pending& p);
  struct Lane;
  c10::intrusive_ptr<c10d::Work> submitToLane(bool sending, int peer, c10d::OpType type,
                                              std::vector<at::Tensor> outputs,
                                              std::function<void(uint64_t)> run);
  void allreduceAcrossNodes(const std::vector<Span>& spans, const std::vector<at::Tensor>& flats,
                            ElemType t, ReduceKind r, const c10d::ReduceOp& op,
                            uint64_t deadline_ns);
  static std::chrono::milliseconds remaining(uint64_t deadline_ns);
  uint64_t deadlineFor(std::chrono::milliseconds timeout) const;
  void loop();

  std::unique_ptr<ShmComm> comm_;  // this node's ranks
  std::chrono::milliseconds timeout_;
  Topology topo_;
  c10::intrusive_ptr<c10d::Backend> leaders_;   // across nodes, on each node's first rank
  c10::intrusive_ptr<c10d::Backend> everyone_;  // across nodes: the other collectives
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> queue_;
  bool stop_ = false;
  bool running_ = false;  // a collective is executing (in the thread or inline)
  std::map<std::pair<int, bool>, std::unique_ptr<Lane>> lanes_;  // (peer, sending)
  std::condition_variable lanes_cv_;
  uint64_t issued_ = 0;
  std::thread thread_;
};

}  // namespace shmgrad::backend
