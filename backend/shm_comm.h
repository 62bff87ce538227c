// The collectives of the `shmgrad` torch.distributed backend, on one node, through one
// owner-only shared-memory segment per process group. No libtorch here: the c10d adapter
// (backend/process_group.h) turns tensors into spans of bytes and calls these.
//
// How a collective runs (docs/BACKEND.md): every rank has a staging area of two buffers
// in the segment; a tensor goes through in rounds of at most one buffer. In a round each
// rank copies its piece in, all meet at a futex barrier, then each rank either reads what
// it needs (broadcast, gathers, scatter, all-to-all) or reduces its own slice of every
// rank's buffer in place (all-reduce: a second barrier, then everyone copies the result
// out). Rounds alternate between the two buffers, so one round's readers never race the
// next round's writers. Each rank also has an arena in the segment (ArenaPool): tensors
// the backend allocates there (DDP's gradient buckets, through c10d's allocateTensor) are
// all-reduced in place, without staging, when every rank passes one. Every wait has a deadline and
// checks its peers' liveness (pidfds); the first failure seen is recorded in the segment and ends
// every later collective of every rank with an error naming the rank.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ipc/error.h"
#include "ipc/futex.h"

namespace shmgrad::backend {

namespace detail {
struct GroupHeader;
struct RankRecord;
struct Channel;

// The readers of what another process wrote, over bytes alone (ShmComm runs them on its
// store's text and its mapping; tests/fuzz on any bytes).
//
// The name a group's rank 0 publishes, "/proc/<pid>/fd/<fd>" (ShmComm::name()): true and
// its pid and fd for exactly that form, false for any other text.
bool parseGroupName(const std::string& name, unsigned* pid, unsigned* fd);
// Whether the first `mapped` bytes at `header` (a segment of `size` bytes) hold the header of
// a group of `world` ranks of user `uid`, of this shmgrad version and layout.
bool groupHeaderValid(const void* header, uint64_t mapped, uint64_t size, uint32_t world,
                      uint32_t uid);
// Bytes of a group segment's header.
uint64_t groupHeaderBytes();
// Whether a channel chunk's header (its message's `total` bytes, this chunk's `len`, its
// `tag`), read at byte `off` of a message of `expected` bytes with `expected_tag` over
// chunks of at most `slot_bytes`, is the chunk the receiver waits for.
bool chunkExpected(uint64_t total, uint64_t len, int64_t tag, uint64_t expected,
                   int64_t expected_tag, uint64_t off, uint64_t slot_bytes);
// A broken group's reason as stored (`bytes` of an array another rank wrote): its text
// up to the first NUL, or the whole array but its last byte.
std::string reasonText(const char* stored, size_t bytes);
}  // namespace detail

// Element types the collectives reduce (c10d's CPU dtypes).
enum class ElemType : uint32_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kUInt8,
  kInt16,
  kInt32,
  kInt64,
  kBool,
};
enum class ReduceKind : uint32_t { kSum, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

const char* elemTypeName(ElemType t);
const char* reduceKindName(ReduceKind r);
uint32_t elemSize(ElemType t);
// Throws InvalidArgument naming the operation and the type when `r` is not defined on `t`
// (AVG on integers, bitwise operations on floating point).
void checkReduce(ElemType t, ReduceKind r);

// dst[i] = in[0][i] op in[1][i] op ... op in[n-1][i] for i < count, in list order
// (floating-point types accumulate in float or double and round once; integers wrap);
// AVG divides the sum by n. dst may be any in[j] (the same elements). Allocates nothing.
void reduceElements(void* dst, const void* const* in, uint32_t n, uint64_t count, ElemType t,
                    ReduceKind r);

// A range of bytes in this process: a tensor's storage, or part of one.
struct Span {
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
};

// The largest group on one node (ranks of the segment).
constexpr uint32_t kMaxRanks = 256;

// A mapping of a group's segment, unmapped when its last holder lets go: the ShmComm and
// every block of its arena still in use (a DDP model may outlive its process group).
struct Mapping {
  uint8_t* base = nullptr;
  uint64_t size = 0;
  Mapping(uint8_t* b, uint64_t s) : base(b), size(s) {}
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

// This rank's arena: the part of the segment that only this rank allocates in and every
// rank maps. Blocks are whole pages, first fit; their pages are reserved when allocated
// (no fault later) and given back when freed. Thread-safe (a private mutex: no other
// process ever takes it). Only the process that created it allocates and frees: a forked
// child (a DataLoader worker) that drops a copy of a tensor neither frees nor clears the
// memory its parent still uses.
class ArenaPool {
 public:
  ArenaPool(std::shared_ptr<Mapping> mapping, uint8_t* base, uint64_t bytes);
  // A block of at least `bytes` (page-aligned), or nullptr when the arena has no room or
  // the memory cannot be had.
  uint8_t* allocate(uint64_t bytes);
  // Gives back a block allocate() returned.
  void release(uint8_t* block);
  uint64_t capacity() const { return bytes_; }
  uint64_t inUse() const;
  // Whether [p, p + bytes) lies in the arena, and its offset there.
  bool offsetOf(const uint8_t* p, uint64_t bytes, uint64_t* offset) const;

 private:
  std::shared_ptr<Mapping> mapping_;
  uint8_t* base_;
  uint64_t bytes_;
  int owner_;  // the pid that allocates and frees
  mutable std::mutex mutex_;
  std::map<uint64_t, uint64_t> free_;  // offset -> bytes, merged with their neighbours
  std::map<uint64_t, uint64_t> used_;  // offset -> bytes
};

// One rank's handle on the segment of its process group.
class ShmComm {
 public:
  // Rank 0: creates the segment, an anonymous memory file (memfd, mode 0600, allocated in
  // full: no memory fails here with kNoSpace naming the fix), with `staging_bytes` per
  // buffer, two buffers per rank. name() is what the other ranks attach to:
  // /proc/<pid>/fd/<fd>, which only this user's processes can open.
  // `arena_bytes` per rank (rounded to pages; 0: none) are reserved address space only:
  // memory is taken when the arena allocates.
  static std::unique_ptr<ShmComm> create(uint32_t world, uint64_t staging_bytes,
                                         uint64_t arena_bytes = 0);
  // Ranks 1..world-1: maps the segment and checks it (a shmgrad memory file, owner, mode,
  // size, header) before trusting a byte of it.
  static std::unique_ptr<ShmComm> attach(const std::string& name, uint32_t world, uint32_t rank);
  // The staging bytes per buffer for `world` ranks when none is asked for
  // (SHMGRAD_BACKEND_STAGING_MB or about 64 MiB in all, 256 KiB to 8 MiB each).
  static uint64_t defaultStagingBytes(uint32_t world);
  // The arena per rank when none is asked for (SHMGRAD_BACKEND_ARENA_MB, 0 for none; by
  // default 4 GiB, at most 64 GiB over the ranks).
  static uint64_t defaultArenaBytes(uint32_t world);

  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  const std::string& name() const { return name_; }
  uint32_t rank() const { return rank_; }
  uint32_t world() const { return world_; }
  uint64_t stagingBytes() const { return staging_; }
  // This rank's arena (null when the group has none).
  const std::shared_ptr<ArenaPool>& arena() const { return arena_pool_; }
  // All-reduces that ran in place in the arenas (every rank passed one block of its own).
  uint64_t inPlaceAllreduces() const { return in_place_; }
  // Rank 0: closes the memory file's descriptor through which the others attach (the
  // mappings stay), once every rank has attached. The memory has no name anywhere: it is
  // freed when the last rank unmaps it, however the ranks end.
  void release();
  // Opens a pidfd for each peer (after every rank has attached: their pids are known).
  void watchPeers();

  // The collectives. Every rank of the group calls the same ones in the same order with
  // matching sizes (checked: a mismatch is an error naming both, never a wrong result).
  // `deadline_ns` is on ipc::monotonicNs()'s clock. All throw shmgrad::Error (kTimeout,
  // kWorkerFailed naming the rank that died or left, kInvalidArgument for a mismatch).
  void barrier(uint64_t deadline_ns);
  // data: this rank's tensors, all of type t, reduced as one flat array (coalesced). When
  // every rank passes one span inside its own arena, the ranks reduce each other's
  // memory in place: no staging, no rounds, bit for bit the staged result.
  void allreduce(const std::vector<Span>& data, ElemType t, ReduceKind r, uint64_t deadline_ns);
  // The same, the result only in root's data.
  void reduce(const std::vector<Span>& data, ElemType t, ReduceKind r, uint32_t root,
              uint64_t deadline_ns);
  void broadcast(const std::vector<Span>& data, uint32_t root, uint64_t deadline_ns);
  // out: world spans of in.bytes each (out[j] receives rank j's in).
  void allgather(Span in, const std::vector<Span>& out, uint64_t deadline_ns);
  // out: on root, world spans of in.bytes each; ignored elsewhere.
  void gather(Span in, const std::vector<Span>& out, uint32_t root, uint64_t deadline_ns);
  // in: on root, world spans of out.bytes each; ignored elsewhere.
  void scatter(const std::vector<Span>& in, Span out, uint32_t root, uint64_t deadline_ns);
  // in: world spans of out.bytes each; out receives the reduction of every rank's in[rank].
  void reduceScatter(const std::vector<Span>& in, Span out, ElemType t, ReduceKind r,
                     uint64_t deadline_ns);
  // in[j] goes to rank j's out[this rank]; sizes may differ (out[j].bytes must equal
  // rank j's in[this rank].bytes: checked).
  void alltoall(const std::vector<Span>& in, const std::vector<Span>& out, uint64_t deadline_ns);

  // Point to point, in order between each pair (a recv takes the oldest send of its peer;
  // sizes and tags must agree: a mismatch breaks the group, naming both). Thread-safe
  // against the collectives and against other peers' send/recv (one thread per peer and
  // direction at a time).
  void send(uint32_t to, Span data, int64_t tag, uint64_t deadline_ns);
  void recv(uint32_t from, Span data, int64_t tag, uint64_t deadline_ns);

  // Waits in progress end with an error (the process group is being destroyed).
  void shutdown();

  // This rank leaves the group (its process group is destroyed): peers waiting on it
  // fail at once naming it, instead of at their deadline.
  void leave();
  // The error that broke the group, as recorded in the segment, or "" while it works.
  std::string brokenReason() const;

 private:
  ShmComm(std::string name, uint8_t* base, uint64_t size, uint32_t world, uint32_t rank,
          uint64_t staging, uint64_t arena);

  uint8_t* staging(uint32_t rank, uint32_t parity) const;
  detail::RankRecord& record(uint32_t rank) const;
  uint64_t* a2aTable(uint64_t seq) const;  // [world][world] in sizes, by seq parity
  // Starts a collective: checks the group is not broken and publishes this rank's
  // signature of it (compared against the others' after the first barrier).
  void begin(uint32_t op, ElemType t, ReduceKind r, uint32_t root, uint64_t bytes,
             uint64_t arena_offset = kNoArena);
  // The all-reduce of `bytes` in place in every rank's arena, after the first barrier.
  void allreduceInPlace(uint64_t bytes, ElemType t, ReduceKind r, uint64_t deadline_ns);
  // How many ranks posted a block of their arena for the current collective (checked
  // against the arena's bounds: a peer's offset is never trusted).
  uint32_t ranksInArena(uint64_t bytes);
  uint8_t* arenaBase(uint32_t rank) const { return base_ + arena_offset_ + rank * arena_bytes_; }
  static constexpr uint64_t kNoArena = UINT64_MAX;
  // One barrier of the current collective; the first one also compares signatures.
  void meet(uint64_t deadline_ns);
  void checkSignatures();
  [[noreturn]] void fail(ErrorKind kind, uint32_t culprit, const std::string& why);
  // Records the first failure in the segment (every rank's later collectives end with it);
  // false if another was recorded first.
  bool breakGroup(ErrorKind kind, uint32_t culprit, const std::string& message);
  detail::Channel& channel(uint32_t from, uint32_t to) const;
  // Waits on `word` until ready(), the deadline, the peer's death or departure, the
  // group's failure or close().
  void waitPeer(std::atomic<uint32_t>& word, const std::function<bool()>& ready, uint32_t peer,
                uint64_t deadline_ns, const char* what);
  // Throws if the group is broken, a peer died or left (called between sleeps).
  bool peersOk();
  uint32_t nextParity() { return static_cast<uint32_t>(round_++ & 1); }

  std::string name_;
  std::shared_ptr<Mapping> mapping_;
  uint8_t* base_;
  uint64_t size_;
  uint32_t world_, rank_;
  uint64_t staging_;
  detail::GroupHeader* header_;
  uint64_t records_offset_ = 0, a2a_offset_ = 0, staging_offset_ = 0, channels_offset_ = 0;
  uint64_t channel_bytes_ = 0;
  uint64_t arena_offset_ = 0, arena_bytes_ = 0;
  std::shared_ptr<ArenaPool> arena_pool_;
  std::atomic<uint64_t> in_place_{0};
  std::atomic<bool> closing_{false};
  ipc::AdaptiveSpin spin_;    // how long meet() spins before it sleeps
  int creator_fd_ = -1;       // rank 0 until release()
  std::vector<int> pidfds_;   // per rank; -1 for self or not (yet) watched
  uint32_t barrier_gen_ = 0;  // barriers this rank has passed (all ranks pass the same)
  uint64_t round_ = 0;        // staging rounds (parity of the buffer in use)
  uint64_t op_seq_ = 0;       // collectives begun
  bool first_meet_ = false;   // the current collective has not met yet
  const char* op_name_ = "the group's start";
};

}  // namespace shmgrad::backend
