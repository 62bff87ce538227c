#include "backend/shm_comm.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "ipc/config.h"
#include "ipc/futex.h"
#include "ipc/segment.h"

namespace shmgrad::backend {

// ----------------------------------------------------------------------------- elements

const char* elemTypeName(ElemType t) {
  static constexpr const char* kNames[] = {"float32", "float64", "float16", "bfloat16", "int8",
                                           "uint8",   "int16",   "int32",   "int64",    "bool"};
  const auto i = static_cast<uint32_t>(t);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

const char* reduceKindName(ReduceKind r) {
  static constexpr const char* kNames[] = {"SUM", "AVG",  "PRODUCT", "MIN",
                                           "MAX", "BAND", "BOR",     "BXOR"};
  const auto i = static_cast<uint32_t>(r);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

uint32_t elemSize(ElemType t) {
  switch (t) {
    case ElemType::kFloat64:
    case ElemType::kInt64:
      return 8;
    case ElemType::kFloat32:
    case ElemType::kInt32:
      return 4;
    case ElemType::kFloat16:
    case ElemType::kBFloat16:
    case ElemType::kInt16:
      return 2;
    default:
      return 1;
  }
}

namespace {
bool isFloating(ElemType t) {
  return t == ElemType::kFloat32 || t == ElemType::kFloat64 || t == ElemType::kFloat16 ||
         t == ElemType::kBFloat16;
}
bool isBitwise(ReduceKind r) {
  return r == ReduceKind::kBand || r == ReduceKind::kBor || r == ReduceKind::kBxor;
}
}  // namespace

void checkReduce(ElemType t, ReduceKind r) {
  SHMGRAD_CHECK(static_cast<uint32_t>(r) <= static_cast<uint32_t>(ReduceKind::kBxor),
                ErrorKind::kInvalidArgument, "shmgrad backend: reduce op ", static_cast<int>(r),
                " is not supported: use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR");
  SHMGRAD_CHECK(!(isFloating(t) && isBitwise(r)), ErrorKind::kInvalidArgument,
                "shmgrad backend: ", reduceKindName(r), " is a bitwise operation and ",
                elemTypeName(t), " is floating point: use it on integer or bool tensors");
  SHMGRAD_CHECK(!(r == ReduceKind::kAvg && t == ElemType::kBool), ErrorKind::kInvalidArgument,
                "shmgrad backend: AVG of bool tensors is not defined: use SUM (any) or "
                "PRODUCT (all), or a floating-point tensor");
}

namespace {

float halfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

// Round to nearest, ties to even (as torch's c10::Half).
uint16_t floatToHalf(float x) {
  uint32_t f = std::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint16_t>((f >> 16) & 0x8000);
  f &= 0x7fffffffu;
  if (f > 0x7f800000u) return sign | 0x7e00;                     // NaN
  if (f >= 0x477ff000u) return sign | 0x7c00;                    // rounds to infinity
  if (f < 0x38800000u) {                                         // below the smallest normal half
    const float scaled = std::bit_cast<float>(f) * 16777216.0f;  // exact: a power of two
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  f += 0xfffu + ((f >> 13) & 1u);
  return sign | static_cast<uint16_t>((f >> 13) - (112u << 10));
}

float bf16ToFloat(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }
uint16_t floatToBf16(float x) {
  const uint32_t f = std::bit_cast<uint32_t>(x);
  if ((f & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}

// How each type is loaded into its accumulator and stored back.
template <typename T, typename A>
struct Plain {
  using Stored = T;
  using Acc = A;
  static A load(T v) { return static_cast<A>(v); }
  static T store(A v) { return static_cast<T>(v); }
};
struct Half {
  using Stored = uint16_t;
  using Acc = float;
  static float load(uint16_t v) { return halfToFloat(v); }
  static uint16_t store(float v) { return floatToHalf(v); }
};
struct BFloat {
  using Stored = uint16_t;
  using Acc = float;
  static float load(uint16_t v) { return bf16ToFloat(v); }
  static uint16_t store(float v) { return floatToBf16(v); }
};

constexpr uint64_t kBlock = 1024;

// Blocks keep the accumulators in L1 while the inputs stream through, in list order.
template <typename Codec, typename Op>
void reduceBlocks(void* dst_v, const void* const* in_v, uint32_t n, uint64_t count, Op op,
                  uint32_t divide_by) {
  using T = typename Codec::Stored;
  using A = typename Codec::Acc;
  T* dst = static_cast<T*>(dst_v);
  A acc[kBlock];
  for (uint64_t b = 0; b < count; b += kBlock) {
    const uint64_t m = std::min(kBlock, count - b);
    const T* first = static_cast<const T*>(in_v[0]) + b;
    for (uint64_t i = 0; i < m; ++i) acc[i] = Codec::load(first[i]);
    for (uint32_t j = 1; j < n; ++j) {
      const T* x = static_cast<const T*>(in_v[j]) + b;
      for (uint64_t i = 0; i < m; ++i) acc[i] = op(acc[i], Codec::load(x[i]));
    }
    if (divide_by > 1) {
      if constexpr (std::is_floating_point_v<A>) {
        for (uint64_t i = 0; i < m; ++i) acc[i] = acc[i] / static_cast<A>(divide_by);
      }
    }
    for (uint64_t i = 0; i < m; ++i) dst[b + i] = Codec::store(acc[i]);
  }
}

template <typename Codec>
void reduceFloating(void* dst, const void* const* in, uint32_t n, uint64_t count, ReduceKind r) {
  using A = typename Codec::Acc;
  switch (r) {
    case ReduceKind::kSum:
      return reduceBlocks<Codec>(
          dst, in, n, count, [](A a, A b) { return a + b; }, 1);
    case ReduceKind::kAvg:
      return reduceBlocks<Codec>(
          dst, in, n, count, [](A a, A b) { return a + b; }, n);
    case ReduceKind::kProduct:
      return reduceBlocks<Codec>(
          dst, in, n, count, [](A a, A b) { return a * b; }, 1);
    // NaN wins, as torch's minimum and maximum.
    case ReduceKind::kMin:
      return reduceBlocks<Codec>(
          dst, in, n, count, [](A a, A b) { return (a != a || a < b) ? a : b; }, 1);
    case ReduceKind::kMax:
      return reduceBlocks<Codec>(
          dst, in, n, count, [](A a, A b) { return (a != a || a > b) ? a : b; }, 1);
    default:
      raise(ErrorKind::kInvalidArgument, "bitwise reduction of floating point");
  }
}

// Integers wrap on overflow (as torch's): sums and products run in uint64_t and are
// truncated to the type. AVG (NCCL has it; Lightning's sync_dist averages integer counts
// with it): the sum in 64 bits divided by n, truncated toward zero.
template <typename T>
void reduceInteger(void* dst, const void* const* in, uint32_t n, uint64_t count, ReduceKind r) {
  using Wide = Plain<T, uint64_t>;
  using Same = Plain<T, T>;
  using Signed = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
  switch (r) {
    case ReduceKind::kAvg: {
      T* out = static_cast<T*>(dst);
      for (uint64_t i = 0; i < count; ++i) {
        uint64_t sum = 0;
        for (uint32_t j = 0; j < n; ++j)
          sum += static_cast<uint64_t>(static_cast<Signed>(static_cast<const T*>(in[j])[i]));
        out[i] = static_cast<T>(static_cast<Signed>(sum) / static_cast<Signed>(n));
      }
      return;
    }
    case ReduceKind::kSum:
      return reduceBlocks<Wide>(
          dst, in, n, count, [](uint64_t a, uint64_t b) { return a + b; }, 1);
    case ReduceKind::kProduct:
      return reduceBlocks<Wide>(
          dst, in, n, count, [](uint64_t a, uint64_t b) { return a * b; }, 1);
    case ReduceKind::kMin:
      return reduceBlocks<Same>(
          dst, in, n, count, [](T a, T b) { return b < a ? b : a; }, 1);
    case ReduceKind::kMax:
      return reduceBlocks<Same>(
          dst, in, n, count, [](T a, T b) { return b > a ? b : a; }, 1);
    case ReduceKind::kBand:
      return reduceBlocks<Same>(
          dst, in, n, count, [](T a, T b) { return T(a & b); }, 1);
    case ReduceKind::kBor:
      return reduceBlocks<Same>(
          dst, in, n, count, [](T a, T b) { return T(a | b); }, 1);
    case ReduceKind::kBxor:
      return reduceBlocks<Same>(
          dst, in, n, count, [](T a, T b) { return T(a ^ b); }, 1);
  }
}

// bool: SUM, MAX and BOR are "any", PRODUCT, MIN and BAND "all" (as ProcessGroupNCCL maps
// them), BXOR parity; the result is always 0 or 1.
void reduceBool(void* dst, const void* const* in, uint32_t n, uint64_t count, ReduceKind r) {
  using B = Plain<uint8_t, uint8_t>;
  switch (r) {
    case ReduceKind::kSum:
    case ReduceKind::kMax:
    case ReduceKind::kBor:
      return reduceBlocks<B>(
          dst, in, n, count, [](uint8_t a, uint8_t b) { return uint8_t((a | b) != 0); }, 1);
    case ReduceKind::kProduct:
    case ReduceKind::kMin:
    case ReduceKind::kBand:
      return reduceBlocks<B>(
          dst, in, n, count, [](uint8_t a, uint8_t b) { return uint8_t(a != 0 && b != 0); }, 1);
    case ReduceKind::kBxor:
      return reduceBlocks<B>(
          dst, in, n, count, [](uint8_t a, uint8_t b) { return uint8_t((a != 0) != (b != 0)); }, 1);
    default:
      raise(ErrorKind::kInvalidArgument, "AVG of bool");
  }
}

}  // namespace

void reduceElements(void* dst, const void* const* in, uint32_t n, uint64_t count, ElemType t,
                    ReduceKind r) {
  if (count == 0 || n == 0) return;
  switch (t) {
    case ElemType::kFloat32:
      return reduceFloating<Plain<float, float>>(dst, in, n, count, r);
    case ElemType::kFloat64:
      return reduceFloating<Plain<double, double>>(dst, in, n, count, r);
    case ElemType::kFloat16:
      return reduceFloating<Half>(dst, in, n, count, r);
    case ElemType::kBFloat16:
      return reduceFloating<BFloat>(dst, in, n, count, r);
    case ElemType::kInt8:
      return reduceInteger<int8_t>(dst, in, n, count, r);
    case ElemType::kUInt8:
      return reduceInteger<uint8_t>(dst, in, n, count, r);
    case ElemType::kInt16:
      return reduceInteger<int16_t>(dst, in, n, count, r);
    case ElemType::kInt32:
      return reduceInteger<int32_t>(dst, in, n, count, r);
    case ElemType::kInt64:
      return reduceInteger<int64_t>(dst, in, n, count, r);
    case ElemType::kBool:
      return reduceBool(dst, in, n, count, r);
  }
}

// ------------------------------------------------------------------------------ segment

namespace {

constexpr uint64_t kMagic = 0x7367706731707368ull;  // "hsp1gpgs"
constexpr uint32_t kVersion = 2;                    // 2: the ranks' arenas
constexpr uint64_t kPage = 4096;
constexpr uint64_t kLine = ipc::kAlign;  // a cache line
constexpr uint64_t kMinStaging = 256 << 10;
constexpr uint64_t kMaxStaging = 8 << 20;
constexpr uint64_t kDefaultStagingTotal = 64 << 20;
constexpr uint64_t kDefaultArena = 4ull << 30;        // per rank: address space, not memory
constexpr uint64_t kDefaultArenaTotal = 64ull << 30;  // over the ranks
constexpr uint64_t kMaxArena = 1ull << 40;
// A waiter checks its peers' liveness at least this often.
constexpr auto kPollSlice = std::chrono::milliseconds(50);
constexpr uint64_t kDefaultSpinNs = 50'000;
// reduce() and gather() to every rank: all-reduce and all-gather.
constexpr uint32_t kAllRanks = UINT32_MAX;

enum RankState : uint32_t { kNotAttached = 0, kAttached = 1, kLeft = 2 };
enum Op : uint32_t {
  kOpBarrier = 1,
  kOpAllreduce,
  kOpReduce,
  kOpBroadcast,
  kOpAllgather,
  kOpGather,
  kOpScatter,
  kOpReduceScatter,
  kOpAlltoall,
};
const char* opName(uint32_t op) {
  static constexpr const char* kNames[] = {
      "?",         "barrier", "allreduce", "reduce",         "broadcast",
      "allgather", "gather",  "scatter",   "reduce_scatter", "alltoall"};
  return op < std::size(kNames) ? kNames[op] : "?";
}

using ipc::alignUp;

// Where rank j's slice of a reduction over `len` bytes starts (rank `world`'s: the end):
// whole cache lines, so that no two ranks write one line. The staged and the in-place
// all-reduce cut alike, so that both add the same elements in the same order.
uint64_t sliceStart(uint64_t len, uint32_t j, uint32_t world) {
  const uint64_t lines = (len + kLine - 1) / kLine;
  return std::min(len, lines * j / world * kLine);
}

}  // namespace

namespace detail {

// Field by field. Written by rank 0 before any other rank can open the segment; then
// read-only but for the atomics.
struct alignas(64) GroupHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t world;
  uint32_t owner_uid;
  uint32_t reserved;
  uint64_t staging_bytes;  // per buffer; two buffers per rank
  uint64_t arena_bytes;    // per rank
  uint64_t total_size;
  alignas(64) std::atomic<uint32_t> arrivals;  // barrier arrivals, all barriers, mod 2^32
  alignas(64) std::atomic<uint32_t> sleepers;  // waiters asleep on `arrivals`
  alignas(64) std::atomic<uint32_t> broken;    // 0; kClaimed while written; 1 + culprit rank
  std::atomic<uint32_t> broken_kind;           // ErrorKind of the failure
  char broken_reason[512];                     // NUL-terminated within the array
};

// What a rank is about to do, compared with the others' after the first barrier.
struct Signature {
  uint64_t seq;  // collectives this rank began before it
  uint64_t bytes;
  uint32_t op, type, reduce, root;
  uint64_t arena_offset;  // an all-reduce's data in this rank's arena, or kNoArena
};

struct alignas(64) RankRecord {
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> state;  // RankState
  std::atomic<uint32_t> barrier_gen;
  uint32_t reserved;
  Signature sig[2];  // by the parity of seq: a rank is at most one collective ahead
};

// One direction of one pair of ranks, for send/recv: kChannelSlots chunks in a ring. The
// sender writes slot `sent % kChannelSlots` while `sent - taken < kChannelSlots`, then
// bumps `sent`; the receiver reads slot `taken % kChannelSlots` while `sent != taken`,
// then bumps `taken`. So a few small sends complete before their recvs are posted, as
// gloo's do. The slots (a ChunkHeader, then the data) follow the record.
struct alignas(64) Channel {
  std::atomic<uint32_t> sent;
  alignas(64) std::atomic<uint32_t> taken;
};
struct alignas(64) ChunkHeader {
  uint64_t total;  // the message's bytes (every chunk says it)
  uint64_t chunk;  // this chunk's bytes
  int64_t tag;
};
constexpr uint32_t kChannelSlots = 8;

}  // namespace detail

using detail::GroupHeader;
using detail::RankRecord;
using detail::Signature;

namespace {

constexpr uint32_t kClaimed = 0x80000000u;

// records | all-to-all tables | point-to-point channels | staging (2 buffers per rank) |
// arenas (one per rank), page-aligned regions. All but the arenas are allocated at once.
struct Layout {
  uint64_t records, a2a, channels, channel_bytes, staging, arenas, total;
};
// A channel slot's data: 16 MiB shared by the world x world channels' slots, 1 KiB to
// 128 KiB each.
uint64_t channelBytesFor(uint32_t world) {
  const uint64_t slots = std::max<uint64_t>(1, uint64_t{world} * world * detail::kChannelSlots);
  return alignUp(std::clamp<uint64_t>((16ull << 20) / slots, 1024, 128 << 10), kLine);
}
uint64_t channelStride(uint64_t slot_bytes) {
  return sizeof(detail::Channel) +
         detail::kChannelSlots * (sizeof(detail::ChunkHeader) + slot_bytes);
}
Layout layoutFor(uint32_t world, uint64_t staging, uint64_t arena) {
  Layout l;
  l.records = alignUp(sizeof(GroupHeader), kPage);
  l.a2a = alignUp(l.records + world * sizeof(RankRecord), kPage);
  // Two parities x (sent, expected) x world x world sizes.
  l.channels = alignUp(l.a2a + 2ull * 2 * world * world * sizeof(uint64_t), kPage);
  l.channel_bytes = channelBytesFor(world);
  l.staging = alignUp(l.channels + uint64_t{world} * world * channelStride(l.channel_bytes), kPage);
  l.arenas = l.staging + 2ull * world * staging;
  l.total = l.arenas + uint64_t{world} * arena;
  return l;
}

uint64_t stagingFor(uint64_t asked) {
  return std::clamp(alignUp(asked, kPage), kMinStaging, uint64_t{1} << 30);
}
uint64_t arenaFor(uint64_t asked) { return alignUp(std::min(asked, kMaxArena), kPage); }

// What to do when mapping a group of `arena` bytes of arenas per rank (unknown: 1) fails
// with `err`: they are most of its address space, which a limit (ulimit -v) may refuse.
std::string mappingHint(int err, uint64_t arena) {
  if (err != ENOMEM || arena == 0) return "";
  return " (most of a group's address space is its arenas, SHMGRAD_BACKEND_ARENA_MB per "
         "rank: under a limit on address space, ulimit -v, set it lower, or 0, in every "
         "rank)";
}

int pidfdOpen(int pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

namespace detail {

namespace {
// A decimal number at name[*at] as std::to_string writes an int: digits without a sign,
// spaces or a leading zero, at most INT_MAX. sscanf's %u would take " +0012" and wrap.
bool parseDecimal(const std::string& name, size_t* at, unsigned* out) {
  const size_t begin = *at;
  uint64_t v = 0;
  while (*at < name.size() && name[*at] >= '0' && name[*at] <= '9' && v <= INT32_MAX) {
    v = v * 10 + static_cast<uint64_t>(name[(*at)++] - '0');
  }
  const size_t digits = *at - begin;
  *out = static_cast<unsigned>(v);
  return digits > 0 && v <= INT32_MAX && (digits == 1 || name[begin] != '0');
}
}  // namespace

bool parseGroupName(const std::string& name, unsigned* pid, unsigned* fd) {
  static constexpr char kProc[] = "/proc/", kFd[] = "/fd/";
  size_t at = sizeof(kProc) - 1;
  if (name.compare(0, at, kProc) != 0 || !parseDecimal(name, &at, pid)) return false;
  if (name.compare(at, sizeof(kFd) - 1, kFd) != 0) return false;
  at += sizeof(kFd) - 1;
  return parseDecimal(name, &at, fd) && at == name.size();
}

uint64_t groupHeaderBytes() { return sizeof(GroupHeader); }

bool groupHeaderValid(const void* header, uint64_t mapped, uint64_t size, uint32_t world,
                      uint32_t uid) {
  if (mapped < sizeof(GroupHeader) || world < 1 || world > kMaxRanks) return false;
  const auto* h = static_cast<const GroupHeader*>(header);
  const uint64_t staging = h->staging_bytes, arena = h->arena_bytes;
  return h->magic == kMagic && h->version == kVersion && h->world == world && h->owner_uid == uid &&
         staging >= kMinStaging && staging <= (1ull << 30) && staging % kPage == 0 &&
         arena <= kMaxArena && arena % kPage == 0 && h->total_size == size &&
         layoutFor(world, staging, arena).total == size;
}

bool chunkExpected(uint64_t total, uint64_t len, int64_t tag, uint64_t expected,
                   int64_t expected_tag, uint64_t off, uint64_t slot_bytes) {
  return total == expected && tag == expected_tag && len <= slot_bytes &&
         len == std::min(slot_bytes, total - off);
}

std::string reasonText(const char* stored, size_t bytes) {
  if (bytes == 0) return "";
  std::string text(stored, bytes);
  text[bytes - 1] = '\0';  // never trust the array to be terminated
  return text.c_str();
}

}  // namespace detail

uint64_t ShmComm::defaultStagingBytes(uint32_t world) {
  if (const char* mb = config::tunable("SHMGRAD_BACKEND_STAGING_MB")) {
    double v = 0;
    SHMGRAD_CHECK(config::parseNumber(mb, &v) && v > 0 && v <= 1024, ErrorKind::kInvalidArgument,
                  "SHMGRAD_BACKEND_STAGING_MB='", mb,
                  "' is not a size in MiB: use a number from 0.25 to 1024");
    return stagingFor(static_cast<uint64_t>(v * (1 << 20)));
  }
  const uint64_t share = kDefaultStagingTotal / (2ull * std::max<uint32_t>(world, 1));
  return alignUp(std::clamp(share, kMinStaging, kMaxStaging), kPage);
}

uint64_t ShmComm::defaultArenaBytes(uint32_t world) {
  if (const char* mb = config::tunable("SHMGRAD_BACKEND_ARENA_MB")) {
    double v = 0;
    SHMGRAD_CHECK(config::parseNumber(mb, &v) && v >= 0 && v <= (kMaxArena >> 20),
                  ErrorKind::kInvalidArgument, "SHMGRAD_BACKEND_ARENA_MB='", mb,
                  "' is not a size in MiB: use a number from 0 (no arena) to ", kMaxArena >> 20);
    return arenaFor(static_cast<uint64_t>(v * (1 << 20)));
  }
  return arenaFor(std::min(kDefaultArena, kDefaultArenaTotal / std::max<uint32_t>(world, 1)));
}

Mapping::~Mapping() { munmap(base, size); }

ArenaPool::ArenaPool(std::shared_ptr<Mapping> mapping, uint8_t* base, uint64_t bytes)
    : mapping_(std::move(mapping)), base_(base), bytes_(bytes), owner_(getpid()) {
  if (bytes_ > 0) free_.emplace(0, bytes_);
}

uint8_t* ArenaPool::allocate(uint64_t bytes) {
  const uint64_t want = alignUp(std::max<uint64_t>(bytes, 1), kPage);
  uint64_t at = 0;
  if (getpid() != owner_) return nullptr;  // a forked child: ordinary memory
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = std::find_if(free_.begin(), free_.end(),
                           [&](const auto& block) { return block.second >= want; });
    if (it == free_.end()) return nullptr;
    at = it->first;
    const uint64_t left = it->second - want;
    free_.erase(it);
    if (left > 0) free_.emplace(at + want, left);
    used_.emplace(at, want);
  }
  // Take the memory now, where a failure can be answered (by ordinary memory), rather
  // than as a fault in the middle of a collective. Kernels before 5.14 lack the advice:
  // their pages come at first touch.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  if (madvise(base_ + at, want, MADV_POPULATE_WRITE) != 0 && errno != EINVAL) {
    release(base_ + at);
    return nullptr;
  }
  return base_ + at;
}

void ArenaPool::release(uint8_t* block) {
  if (getpid() != owner_) return;  // a forked child's copy: the parent still owns it
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = used_.find(static_cast<uint64_t>(block - base_));
  if (it == used_.end()) return;  // not a block of this arena: nothing to give back
  uint64_t at = it->first, len = it->second;
  used_.erase(it);
  madvise(base_ + at, len, MADV_REMOVE);  // the memory goes back; the address range stays
  auto next = free_.lower_bound(at);
  if (next != free_.end() && next->first == at + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {
      at = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(at, len);
}

uint64_t ArenaPool::inUse() const {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t total = 0;
  for (const auto& [at, len] : used_) total += len;
  return total;
}

bool ArenaPool::offsetOf(const uint8_t* p, uint64_t bytes, uint64_t* offset) const {
  if (bytes_ == 0 || p < base_ || p >= base_ + bytes_) return false;
  const auto off = static_cast<uint64_t>(p - base_);
  if (bytes > bytes_ - off) return false;
  *offset = off;
  return true;
}

ShmComm::ShmComm(std::string name, uint8_t* base, uint64_t size, uint32_t world, uint32_t rank,
                 uint64_t staging, uint64_t arena)
    : name_(std::move(name)),
      mapping_(std::make_shared<Mapping>(base, size)),
      base_(base),
      size_(size),
      world_(world),
      rank_(rank),
      staging_(staging),
      header_(reinterpret_cast<GroupHeader*>(base)),
      pidfds_(world, -1) {
  const Layout l = layoutFor(world, staging, arena);
  records_offset_ = l.records;
  arena_offset_ = l.arenas;
  arena_bytes_ = arena;
  if (arena > 0) arena_pool_ = std::make_shared<ArenaPool>(mapping_, arenaBase(rank), arena);
  channels_offset_ = l.channels;
  channel_bytes_ = l.channel_bytes;
  a2a_offset_ = l.a2a;
  staging_offset_ = l.staging;
}

ShmComm::~ShmComm() {
  leave();
  for (int fd : pidfds_) {
    if (fd >= 0) ::close(fd);
  }
  release();
  // The mapping goes with the last of this and the arena's blocks still in use.
}

std::unique_ptr<ShmComm> ShmComm::create(uint32_t world, uint64_t staging_bytes,
                                         uint64_t arena_bytes) {
  SHMGRAD_CHECK(world >= 1 && world <= kMaxRanks, ErrorKind::kInvalidArgument,
                "shmgrad backend: a group of ", world, " ranks on one node; at most ", kMaxRanks);
  const uint64_t staging = stagingFor(staging_bytes);
  const uint64_t arena = arenaFor(arena_bytes);
  const Layout l = layoutFor(world, staging, arena);
  // An anonymous memory file: it has no name in /dev/shm or anywhere, so nothing can be
  // left behind. The other ranks open it through /proc/<pid>/fd/<fd> (only this uid can)
  // while this rank holds the descriptor, until every rank has attached (release()).
  const int fd =
      static_cast<int>(SHMGRAD_SYSCHECK(memfd_create("shmgrad-pg", MFD_CLOEXEC), "memfd_create"));
  auto fail_with = [&](ErrorKind kind, const std::string& message) {
    close(fd);
    throw Error(kind, message);
  };
  if (fchmod(fd, 0600) != 0)
    fail_with(ErrorKind::kSystem, "fchmod failed: " + ::shmgrad::detail::errnoText());
  if (ftruncate(fd, static_cast<off_t>(l.total)) != 0)
    fail_with(ErrorKind::kSystem, "ftruncate failed: " + ::shmgrad::detail::errnoText());
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(l.arenas));
  if (rc != 0) {
    errno = rc;
    fail_with(rc == ENOSPC ? ErrorKind::kNoSpace : ErrorKind::kSystem,
              "shmgrad backend: shared memory for a group of " + std::to_string(world) +
                  " ranks (" + std::to_string(l.arenas >> 20) + " MiB) could not be allocated: " +
                  ::shmgrad::detail::errnoText() + " (set SHMGRAD_BACKEND_STAGING_MB lower)");
  }
  void* map = mmap(nullptr, l.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    const int err = errno;
    fail_with(ErrorKind::kSystem,
              "shmgrad backend: mapping the group's " + std::to_string(l.total >> 20) +
                  " MiB failed: " + ::shmgrad::detail::errnoText() + mappingHint(err, arena));
  }
  const std::string name = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd);
  auto* h = new (map) GroupHeader();
  h->magic = kMagic;
  h->version = kVersion;
  h->world = world;
  h->owner_uid = getuid();
  h->staging_bytes = staging;
  h->arena_bytes = arena;
  h->total_size = l.total;
  auto comm = std::unique_ptr<ShmComm>(
      new ShmComm(name, static_cast<uint8_t*>(map), l.total, world, 0, staging, arena));
  comm->creator_fd_ = fd;
  for (uint32_t r = 0; r < world; ++r) new (&comm->record(r)) RankRecord();
  comm->record(0).pid.store(getpid());
  comm->record(0).state.store(kAttached, std::memory_order_release);
  return comm;
}

std::unique_ptr<ShmComm> ShmComm::attach(const std::string& name, uint32_t world, uint32_t rank) {
  SHMGRAD_CHECK(rank < world && world <= kMaxRanks, ErrorKind::kInvalidArgument,
                "shmgrad backend: rank ", rank, " of ", world);
  // Only a name of the form create() makes, /proc/<pid>/fd/<fd> of a live process of
  // this user, naming one of shmgrad's memory files: nothing else is opened.
  unsigned pid = 0, fdnum = 0;
  SHMGRAD_CHECK(detail::parseGroupName(name, &pid, &fdnum), ErrorKind::kCorrupt,
                "shmgrad backend: the store names segment '", name,
                "', not one of shmgrad's (/proc/<pid>/fd/<fd>)");
  char target[256] = {};
  const ssize_t n = readlink(name.c_str(), target, sizeof(target) - 1);
  SHMGRAD_CHECK(n > 0, ErrorKind::kNotFound, "shmgrad backend: the group's memory (", name,
                ") is gone: the rank that created it (pid ", pid,
                ") exited or failed before the others attached; start the group again");
  SHMGRAD_CHECK(std::string(target, n).rfind("/memfd:shmgrad-pg", 0) == 0, ErrorKind::kCorrupt,
                "shmgrad backend: ", name, " is ", std::string(target, n),
                ", not a shmgrad group's memory");
  const int fd = open(name.c_str(), O_RDWR | O_CLOEXEC);
  SHMGRAD_CHECK(fd >= 0, ErrorKind::kNotFound, "shmgrad backend: the group's memory (", name,
                ") could not be opened: ", ::shmgrad::detail::errnoText(), " (its creator, pid ",
                pid, ", exited, or belongs to another user)");
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    raise(ErrorKind::kSystem, "fstat failed: ", ::shmgrad::detail::errnoText());
  }
  if (st.st_uid != getuid() || (st.st_mode & 077) != 0) {
    close(fd);
    raise(ErrorKind::kCorrupt, "shmgrad backend: segment ", name, " belongs to uid ", st.st_uid,
          " with mode ", std::oct, (st.st_mode & 0777),
          ": only the owner's own segments (mode 0600) are used");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < sizeof(GroupHeader)) {
    close(fd);
    raise(ErrorKind::kCorrupt, "shmgrad backend: segment ", name, " is too small");
  }
  void* map = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (map == MAP_FAILED) {
    errno = err;
    raise(ErrorKind::kSystem, "shmgrad backend: mapping the group's ", size >> 20,
          " MiB failed: ", ::shmgrad::detail::errnoText(), mappingHint(err, 1));
  }
  const uint64_t staging = static_cast<const GroupHeader*>(map)->staging_bytes;
  const uint64_t arena = static_cast<const GroupHeader*>(map)->arena_bytes;
  if (!detail::groupHeaderValid(map, size, size, world, getuid())) {
    munmap(map, size);
    raise(ErrorKind::kCorrupt, "shmgrad backend: segment ", name, " does not hold a group of ",
          world,
          " ranks of this shmgrad version (another version's rank 0?): start every rank with "
          "the same shmgrad");
  }
  auto comm = std::unique_ptr<ShmComm>(
      new ShmComm(name, static_cast<uint8_t*>(map), size, world, rank, staging, arena));
  RankRecord& me = comm->record(rank);
  uint32_t expected = kNotAttached;
  SHMGRAD_CHECK(me.state.compare_exchange_strong(expected, kAttached), ErrorKind::kInvalidArgument,
                "shmgrad backend: rank ", rank,
                " attached twice: every process needs its own rank");
  me.pid.store(getpid(), std::memory_order_release);
  return comm;
}

void ShmComm::release() {
  if (creator_fd_ >= 0) ::close(creator_fd_);
  creator_fd_ = -1;
}

void ShmComm::watchPeers() {
  for (uint32_t r = 0; r < world_; ++r) {
    if (r == rank_ || pidfds_[r] >= 0) continue;
    const int pid = record(r).pid.load(std::memory_order_acquire);
    if (pid <= 0) continue;
    pidfds_[r] = pidfdOpen(pid);  // -1 (gone already): found dead at the first wait
    if (pidfds_[r] < 0 && errno == ESRCH) {
      fail(ErrorKind::kWorkerFailed, r,
           "rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
               ") died while the group started");
    }
  }
}

uint8_t* ShmComm::staging(uint32_t rank, uint32_t parity) const {
  return base_ + staging_offset_ + (2ull * rank + parity) * staging_;
}

RankRecord& ShmComm::record(uint32_t rank) const {
  return reinterpret_cast<RankRecord*>(base_ + records_offset_)[rank];
}

uint64_t* ShmComm::a2aTable(uint64_t seq) const {
  return reinterpret_cast<uint64_t*>(base_ + a2a_offset_) + (seq & 1) * 2ull * world_ * world_;
}

std::string ShmComm::brokenReason() const {
  // Shared memory only (any thread may ask): "" while it works or its text is being written.
  const uint32_t b = header_->broken.load(std::memory_order_acquire);
  if (b == 0 || b == kClaimed) return "";
  return detail::reasonText(header_->broken_reason, sizeof(header_->broken_reason));
}

void ShmComm::fail(ErrorKind kind, uint32_t culprit, const std::string& why) {
  std::string message;
  if (!why.empty()) {
    std::ostringstream os;
    os << "shmgrad backend: " << why << " (seen by rank " << rank_ << " in " << op_name_
       << ", collective #" << op_seq_ << " of this group); the group cannot go on: destroy it "
       << "(dist.destroy_process_group()) and start a new one, or let torchrun --max-restarts "
          "restart every rank";
    message = os.str();
  }
  if (why.empty() || !breakGroup(kind, culprit, message)) {
    // Someone else broke it first: theirs is the cause. Wait a moment for its text.
    for (int i = 0; i < 1000 && header_->broken.load(std::memory_order_acquire) == kClaimed; ++i)
      usleep(100);
    message = brokenReason();
    kind = static_cast<ErrorKind>(header_->broken_kind.load(std::memory_order_relaxed));
    if (static_cast<uint32_t>(kind) > static_cast<uint32_t>(ErrorKind::kSystem))
      kind = ErrorKind::kWorkerFailed;
  }
  throw Error(kind, message);
}

bool ShmComm::peersOk() {
  const uint32_t b = header_->broken.load(std::memory_order_acquire);
  if (b != 0) fail(ErrorKind::kWorkerFailed, 0, "");
  pollfd fds[kMaxRanks];
  uint32_t ranks[kMaxRanks];
  nfds_t n = 0;
  for (uint32_t r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    if (record(r).state.load(std::memory_order_acquire) == kLeft) {
      fail(ErrorKind::kWorkerFailed, r,
           "rank " + std::to_string(r) +
               " left the group (destroyed its process group or "
               "exited) while this rank waited for it");
    }
    if (pidfds_[r] >= 0) {
      fds[n] = pollfd{pidfds_[r], POLLIN, 0};
      ranks[n++] = r;
    }
  }
  if (n > 0 && poll(fds, n, 0) > 0) {
    for (nfds_t i = 0; i < n; ++i) {
      if (fds[i].revents != 0) {
        const uint32_t r = ranks[i];
        fail(ErrorKind::kWorkerFailed, r,
             "rank " + std::to_string(r) + " (pid " + std::to_string(record(r).pid.load()) +
                 ") died");
      }
    }
  }
  return true;
}

void ShmComm::leave() {
  RankRecord& me = record(rank_);
  if (me.state.load(std::memory_order_acquire) == kLeft) return;
  me.state.store(kLeft, std::memory_order_release);
  ipc::futexWake(&header_->arrivals);  // waiters look again and find this rank gone
}

void ShmComm::begin(uint32_t op, ElemType t, ReduceKind r, uint32_t root, uint64_t bytes,
                    uint64_t arena_offset) {
  op_name_ = opName(op);
  if (header_->broken.load(std::memory_order_acquire) != 0) {
    fail(ErrorKind::kWorkerFailed, 0, "");
  }
  SHMGRAD_CHECK(root < world_, ErrorKind::kInvalidArgument, "shmgrad backend: ", op_name_,
                " with root rank ", root, " in a group of ", world_, " ranks");
  Signature& s = record(rank_).sig[op_seq_ & 1];
  s.seq = op_seq_;
  s.bytes = bytes;
  s.op = op;
  s.type = static_cast<uint32_t>(t);
  s.reduce = static_cast<uint32_t>(r);
  s.root = root;
  s.arena_offset = arena_offset;
  ++op_seq_;
  first_meet_ = true;
}

void ShmComm::checkSignatures() {
  const uint64_t seq = op_seq_ - 1;
  const Signature mine = record(rank_).sig[seq & 1];
  auto describe = [&](const Signature& s) {
    std::ostringstream os;
    os << opName(s.op < 16 ? s.op : 0) << "(";
    if (s.op == kOpAllreduce || s.op == kOpReduce || s.op == kOpReduceScatter)
      os << elemTypeName(static_cast<ElemType>(s.type)) << " "
         << reduceKindName(static_cast<ReduceKind>(s.reduce)) << ", ";
    if (s.op == kOpReduce || s.op == kOpBroadcast || s.op == kOpGather || s.op == kOpScatter)
      os << "root " << s.root << ", ";
    os << s.bytes << " bytes) as its collective #" << s.seq;
    return os.str();
  };
  // Every rank compares every record with rank 0's, so all reach the same verdict.
  const Signature first = record(0).sig[seq & 1];
  for (uint32_t r = 0; r < world_; ++r) {
    const Signature other = record(r).sig[seq & 1];
    if (other.seq != first.seq || other.op != first.op || other.bytes != first.bytes ||
        other.type != first.type || other.reduce != first.reduce || other.root != first.root) {
      raise(ErrorKind::kInvalidArgument, "shmgrad backend: rank 0 called ", describe(first),
            " but rank ", r, " called ", describe(other),
            ": every rank of a group must call the same collectives in the same order, with "
            "the same sizes (this rank called ",
            describe(mine), "; the group still works)");
    }
  }
}

void ShmComm::meet(uint64_t deadline_ns) {
  const uint32_t gen = ++barrier_gen_;
  const uint32_t target = gen * world_;
  record(rank_).barrier_gen.store(gen, std::memory_order_relaxed);
  std::atomic<uint32_t>& arrivals = header_->arrivals;
  const uint32_t count = arrivals.fetch_add(1, std::memory_order_seq_cst) + 1;
  auto done = [&] {
    return static_cast<int32_t>(arrivals.load(std::memory_order_acquire) - target) >= 0;
  };
  if (count == target) {
    if (header_->sleepers.load(std::memory_order_seq_cst) != 0) ipc::futexWake(&arrivals);
  } else if (!ipc::adaptiveSpinUntil(done, kDefaultSpinNs, &spin_)) {
    uint64_t next_poll = ipc::monotonicNs() + kPollSlice.count() * 1000000ull;
    for (;;) {
      header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t seen = arrivals.load(std::memory_order_seq_cst);
      if (done()) {
        header_->sleepers.fetch_sub(1, std::memory_order_relaxed);
        break;
      }
      const uint64_t now = ipc::monotonicNs();
      if (now >= deadline_ns) {
        header_->sleepers.fetch_sub(1, std::memory_order_relaxed);
        std::string late;
        for (uint32_t r = 0; r < world_; ++r) {
          if (static_cast<int32_t>(record(r).barrier_gen.load() - gen) < 0)
            late += (late.empty() ? "" : ", ") + std::to_string(r);
        }
        fail(ErrorKind::kTimeout, rank_,
             "timed out: rank(s) " + (late.empty() ? std::string("?") : late) +
                 " did not reach the collective within the group's timeout (a rank that "
                 "skipped it, or is stuck)");
      }
      const uint64_t left = std::min<uint64_t>(deadline_ns - now, kPollSlice.count() * 1000000ull);
      ipc::futexWait(&arrivals, seen, std::chrono::nanoseconds(left));
      header_->sleepers.fetch_sub(1, std::memory_order_relaxed);
      if (done()) break;
      // Cheap checks after every wake; the liveness poll once a slice.
      if (header_->broken.load(std::memory_order_acquire) != 0) peersOk();
      for (uint32_t r = 0; r < world_; ++r) {
        if (r != rank_ && record(r).state.load(std::memory_order_acquire) == kLeft) peersOk();
      }
      if (closing_.load(std::memory_order_acquire)) {
        throw Error(ErrorKind::kWorkerFailed, std::string("shmgrad backend: the process group "
                                                          "was destroyed during ") +
                                                  op_name_);
      }
      if (ipc::monotonicNs() >= next_poll) {
        peersOk();
        next_poll = ipc::monotonicNs() + kPollSlice.count() * 1000000ull;
      }
    }
  }
  if (first_meet_) {
    first_meet_ = false;
    checkSignatures();
  }
}

// ------------------------------------------------------------------------- collectives

namespace {

// Reads and writes a flat range of bytes of a list of spans, in order.
class SpanCursor {
 public:
  explicit SpanCursor(const std::vector<Span>& spans) : spans_(spans) {}
  // Copies [offset, offset + len) of the spans' concatenation to dst. Offsets only grow.
  void read(uint64_t offset, uint64_t len, uint8_t* dst) { walk(offset, len, dst, true); }
  void write(uint64_t offset, uint64_t len, const uint8_t* src) {
    walk(offset, len, const_cast<uint8_t*>(src), false);
  }

 private:
  void walk(uint64_t offset, uint64_t len, uint8_t* buf, bool reading) {
    while (i_ < spans_.size() && offset >= start_ + spans_[i_].bytes) {
      start_ += spans_[i_].bytes;
      ++i_;
    }
    uint64_t done = 0;
    size_t i = i_;
    uint64_t start = start_;
    while (done < len && i < spans_.size()) {
      const uint64_t in = offset + done - start;
      const uint64_t n = std::min(len - done, spans_[i].bytes - in);
      if (reading) {
        std::memcpy(buf + done, spans_[i].data + in, n);
      } else {
        std::memcpy(spans_[i].data + in, buf + done, n);
      }
      done += n;
      start += spans_[i].bytes;
      ++i;
    }
  }
  const std::vector<Span>& spans_;
  size_t i_ = 0;
  uint64_t start_ = 0;
};

uint64_t totalBytes(const std::vector<Span>& spans) {
  uint64_t n = 0;
  for (const Span& s : spans) n += s.bytes;
  return n;
}

}  // namespace

void ShmComm::barrier(uint64_t deadline_ns) {
  begin(kOpBarrier, ElemType::kUInt8, ReduceKind::kSum, 0, 0);
  nextParity();
  meet(deadline_ns);
}

void ShmComm::allreduce(const std::vector<Span>& data, ElemType t, ReduceKind r,
                        uint64_t deadline_ns) {
  reduce(data, t, r, kAllRanks, deadline_ns);
}

void ShmComm::reduce(const std::vector<Span>& data, ElemType t, ReduceKind r, uint32_t root,
                     uint64_t deadline_ns) {
  checkReduce(t, r);
  const bool all = root == kAllRanks;
  const uint64_t total = totalBytes(data);
  const uint32_t es = elemSize(t);
  SHMGRAD_CHECK(total % es == 0, ErrorKind::kInvalidArgument, "shmgrad backend: ", total,
                " bytes are not whole ", elemTypeName(t), " elements");
  // An all-reduce of one span in this rank's arena offers to run in place.
  uint64_t mine = kNoArena;
  if (!all || data.size() != 1 || !arena_pool_ ||
      !arena_pool_->offsetOf(data[0].data, total, &mine))
    mine = kNoArena;
  begin(all ? kOpAllreduce : kOpReduce, t, r, all ? 0 : root, total, mine);
  SpanCursor in(data), out(data);
  const void* inputs[kMaxRanks];
  uint64_t off = 0;
  bool first = true;
  do {
    const uint64_t len = std::min(staging_, total - off);
    const uint32_t p = nextParity();
    if (!first || mine == kNoArena) in.read(off, len, staging(rank_, p));
    meet(deadline_ns);
    if (first) {
      first = false;
      // Every rank sees the same records, so all take the same path.
      const uint32_t placed = all ? ranksInArena(total) : 0;
      if (placed == world_) return allreduceInPlace(total, t, r, deadline_ns);
      if (placed > 0) {  // some did not stage: they do now, and all meet once more
        if (mine != kNoArena) in.read(off, len, staging(rank_, p));
        meet(deadline_ns);
      }
    }
    // This rank's slice of the chunk: whole cache lines, in elements.
    const uint64_t b = sliceStart(len, rank_, world_), e = sliceStart(len, rank_ + 1, world_);
    if (e > b) {
      for (uint32_t j = 0; j < world_; ++j) inputs[j] = staging(j, p) + b;
      reduceElements(staging(0, p) + b, inputs, world_, (e - b) / es, t, r);
    }
    meet(deadline_ns);
    if (all || rank_ == root) out.write(off, len, staging(0, p));
    off += len;
  } while (off < total);
}

uint32_t ShmComm::ranksInArena(uint64_t bytes) {
  const uint64_t seq = op_seq_ - 1;
  uint32_t placed = 0;
  for (uint32_t j = 0; j < world_; ++j) {
    const uint64_t at = record(j).sig[seq & 1].arena_offset;
    if (at == kNoArena) continue;
    if (at > arena_bytes_ || bytes > arena_bytes_ - at) {
      fail(ErrorKind::kCorrupt, j,
           "rank " + std::to_string(j) + " posted " + std::to_string(bytes) + " bytes at offset " +
               std::to_string(at) + " of its arena of " + std::to_string(arena_bytes_) +
               " bytes (a corrupted segment?)");
    }
    ++placed;
  }
  return placed;
}

// Rank r reduces its slice of every rank's block into its own block, then copies every
// other slice from the rank that reduced it; the last barrier keeps each block unchanged
// until no rank reads it any more. Per rank: reads n + (w-1)/w n, writes n, against
// (5 + 1/w) n through staging. The slices and the sum order are the staged path's.
void ShmComm::allreduceInPlace(uint64_t bytes, ElemType t, ReduceKind r, uint64_t deadline_ns) {
  const uint64_t seq = op_seq_ - 1;
  uint8_t* block[kMaxRanks];
  for (uint32_t j = 0; j < world_; ++j)
    block[j] = arenaBase(j) + record(j).sig[seq & 1].arena_offset;  // checked by ranksInArena
  auto cut = [&](uint32_t j) { return sliceStart(bytes, j, world_); };
  const uint64_t b = cut(rank_), e = cut(rank_ + 1);
  if (e > b) {
    const void* inputs[kMaxRanks];
    for (uint32_t j = 0; j < world_; ++j) inputs[j] = block[j] + b;
    reduceElements(block[rank_] + b, inputs, world_, (e - b) / elemSize(t), t, r);
  }
  meet(deadline_ns);
  for (uint32_t j = 0; j < world_; ++j) {
    if (j != rank_ && cut(j + 1) > cut(j))
      std::memcpy(block[rank_] + cut(j), block[j] + cut(j), cut(j + 1) - cut(j));
  }
  meet(deadline_ns);
  in_place_.fetch_add(1, std::memory_order_relaxed);
}

void ShmComm::broadcast(const std::vector<Span>& data, uint32_t root, uint64_t deadline_ns) {
  const uint64_t total = totalBytes(data);
  begin(kOpBroadcast, ElemType::kUInt8, ReduceKind::kSum, root, total);
  SpanCursor cursor(data);
  uint64_t off = 0;
  do {
    const uint64_t len = std::min(staging_, total - off);
    const uint32_t p = nextParity();
    if (rank_ == root) cursor.read(off, len, staging(root, p));
    meet(deadline_ns);
    if (rank_ != root) cursor.write(off, len, staging(root, p));
    off += len;
  } while (off < total);
}

void ShmComm::allgather(Span in, const std::vector<Span>& out, uint64_t deadline_ns) {
  gather(in, out, kAllRanks, deadline_ns);
}

void ShmComm::gather(Span in, const std::vector<Span>& out, uint32_t root, uint64_t deadline_ns) {
  const bool all = root == kAllRanks;
  begin(all ? kOpAllgather : kOpGather, ElemType::kUInt8, ReduceKind::kSum, all ? 0 : root,
        in.bytes);
  const bool receives = all || rank_ == root;
  if (receives) {
    SHMGRAD_CHECK(out.size() == world_, ErrorKind::kInvalidArgument, "shmgrad backend: ", op_name_,
                  " needs ", world_, " outputs, got ", out.size());
    for (const Span& s : out)
      SHMGRAD_CHECK(s.bytes == in.bytes, ErrorKind::kInvalidArgument, "shmgrad backend: ", op_name_,
                    ": an output of ", s.bytes, " bytes for an input of ", in.bytes);
  }
  uint64_t off = 0;
  do {
    const uint64_t len = std::min(staging_, in.bytes - off);
    const uint32_t p = nextParity();
    if (len > 0) std::memcpy(staging(rank_, p), in.data + off, len);
    meet(deadline_ns);
    if (receives && len > 0) {
      for (uint32_t j = 0; j < world_; ++j) std::memcpy(out[j].data + off, staging(j, p), len);
    }
    off += len;
  } while (off < in.bytes);
}

void ShmComm::scatter(const std::vector<Span>& in, Span out, uint32_t root, uint64_t deadline_ns) {
  begin(kOpScatter, ElemType::kUInt8, ReduceKind::kSum, root, out.bytes);
  if (rank_ == root) {
    SHMGRAD_CHECK(in.size() == world_, ErrorKind::kInvalidArgument,
                  "shmgrad backend: scatter needs ", world_, " inputs on the root, got ",
                  in.size());
    for (const Span& s : in)
      SHMGRAD_CHECK(s.bytes == out.bytes, ErrorKind::kInvalidArgument,
                    "shmgrad backend: scatter: an input of ", s.bytes, " bytes for an output of ",
                    out.bytes);
  }
  const uint64_t region = std::max(kLine, staging_ / world_ / kLine * kLine);
  uint64_t off = 0;
  do {
    const uint64_t len = std::min(region, out.bytes - off);
    const uint32_t p = nextParity();
    if (rank_ == root && len > 0) {
      for (uint32_t j = 0; j < world_; ++j)
        std::memcpy(staging(root, p) + j * region, in[j].data + off, len);
    }
    meet(deadline_ns);
    if (len > 0) std::memcpy(out.data + off, staging(root, p) + rank_ * region, len);
    off += len;
  } while (off < out.bytes);
}

void ShmComm::reduceScatter(const std::vector<Span>& in, Span out, ElemType t, ReduceKind r,
                            uint64_t deadline_ns) {
  checkReduce(t, r);
  const uint32_t es = elemSize(t);
  SHMGRAD_CHECK(in.size() == world_, ErrorKind::kInvalidArgument,
                "shmgrad backend: reduce_scatter needs ", world_, " inputs, got ", in.size());
  for (const Span& s : in)
    SHMGRAD_CHECK(s.bytes == out.bytes, ErrorKind::kInvalidArgument,
                  "shmgrad backend: reduce_scatter: an input of ", s.bytes,
                  " bytes for an output of ", out.bytes);
  SHMGRAD_CHECK(out.bytes % es == 0, ErrorKind::kInvalidArgument, "shmgrad backend: ", out.bytes,
                " bytes are not whole ", elemTypeName(t), " elements");
  begin(kOpReduceScatter, t, r, 0, out.bytes);
  const uint64_t region = std::max(kLine, staging_ / world_ / kLine * kLine);
  const void* inputs[kMaxRanks];
  uint64_t off = 0;
  do {
    const uint64_t len = std::min(region, out.bytes - off);
    const uint32_t p = nextParity();
    for (uint32_t j = 0; j < world_ && len > 0; ++j)
      std::memcpy(staging(rank_, p) + j * region, in[j].data + off, len);
    meet(deadline_ns);
    if (len > 0) {
      for (uint32_t j = 0; j < world_; ++j) inputs[j] = staging(j, p) + rank_ * region;
      reduceElements(out.data + off, inputs, world_, len / es, t, r);
    }
    off += len;
  } while (off < out.bytes);
}

void ShmComm::alltoall(const std::vector<Span>& in, const std::vector<Span>& out,
                       uint64_t deadline_ns) {
  SHMGRAD_CHECK(in.size() == world_ && out.size() == world_, ErrorKind::kInvalidArgument,
                "shmgrad backend: alltoall needs ", world_, " input and output blocks, got ",
                in.size(), " and ", out.size());
  begin(kOpAlltoall, ElemType::kUInt8, ReduceKind::kSum, 0, 0);
  // Sizes first: every rank publishes what it sends and expects, all check the whole
  // table (the same verdict everywhere) and agree on the number of rounds.
  uint64_t* table = a2aTable(op_seq_ - 1);
  const uint64_t w = world_;
  for (uint32_t j = 0; j < world_; ++j) {
    table[rank_ * w + j] = in[j].bytes;
    table[w * w + rank_ * w + j] = out[j].bytes;
  }
  nextParity();
  meet(deadline_ns);
  uint64_t most = 0;
  for (uint32_t i = 0; i < world_; ++i) {
    for (uint32_t j = 0; j < world_; ++j) {
      const uint64_t sent = table[i * w + j], expected = table[w * w + j * w + i];
      SHMGRAD_CHECK(sent == expected, ErrorKind::kInvalidArgument,
                    "shmgrad backend: alltoall: rank ", i, " sends ", sent, " bytes to rank ", j,
                    ", which expects ", expected,
                    " (input_split_sizes and output_split_sizes must match across ranks)");
      most = std::max(most, sent);
    }
  }
  const uint64_t region = std::max(kLine, staging_ / world_ / kLine * kLine);
  for (uint64_t off = 0; off < most; off += region) {
    const uint32_t p = nextParity();
    for (uint32_t j = 0; j < world_; ++j) {
      if (in[j].bytes > off)
        std::memcpy(staging(rank_, p) + j * region, in[j].data + off,
                    std::min(region, in[j].bytes - off));
    }
    meet(deadline_ns);
    for (uint32_t j = 0; j < world_; ++j) {
      if (out[j].bytes > off)
        std::memcpy(out[j].data + off, staging(j, p) + rank_ * region,
                    std::min(region, out[j].bytes - off));
    }
  }
}

// ------------------------------------------------------------------------- send / recv

detail::Channel& ShmComm::channel(uint32_t from, uint32_t to) const {
  return *reinterpret_cast<detail::Channel*>(
      base_ + channels_offset_ + (uint64_t{from} * world_ + to) * channelStride(channel_bytes_));
}

void ShmComm::waitPeer(std::atomic<uint32_t>& word, const std::function<bool()>& ready,
                       uint32_t peer, uint64_t deadline_ns, const char* what) {
  if (ipc::spinUntil(ready, 20'000)) return;
  uint64_t next_poll = 0;
  for (;;) {
    const uint32_t seen = word.load(std::memory_order_acquire);
    if (ready()) return;
    const uint64_t now = ipc::monotonicNs();
    auto why = [&](const std::string& s) {
      return "shmgrad backend: " + std::string(what) + " with rank " + std::to_string(peer) + ": " +
             s;
    };
    if (closing_.load(std::memory_order_acquire))
      throw Error(ErrorKind::kWorkerFailed, why("the process group was destroyed meanwhile"));
    if (now >= deadline_ns)
      throw Error(ErrorKind::kTimeout, why("timed out (the peer never posted the matching "
                                           "send or recv within the group's timeout)"));
    if (header_->broken.load(std::memory_order_acquire) != 0)
      throw Error(ErrorKind::kWorkerFailed, why("the group broke: " + brokenReason()));
    if (record(peer).state.load(std::memory_order_acquire) == kLeft)
      throw Error(ErrorKind::kWorkerFailed, why("it left the group"));
    if (now >= next_poll) {
      if (pidfds_[peer] >= 0) {
        pollfd fd{pidfds_[peer], POLLIN, 0};
        if (poll(&fd, 1, 0) > 0)
          throw Error(ErrorKind::kWorkerFailed,
                      why("it (pid " + std::to_string(record(peer).pid.load()) + ") died"));
      }
      next_poll = now + kPollSlice.count() * 1000000ull;
    }
    const uint64_t left = std::min<uint64_t>(deadline_ns - now, kPollSlice.count() * 1000000ull);
    ipc::futexWait(&word, seen, std::chrono::nanoseconds(left));
  }
}

namespace {
// Slot i of a channel: its header, then its data.
detail::ChunkHeader* slotOf(detail::Channel& c, uint32_t i, uint64_t slot_bytes) {
  return reinterpret_cast<detail::ChunkHeader*>(
      reinterpret_cast<uint8_t*>(&c) + sizeof(detail::Channel) +
      (i % detail::kChannelSlots) * (sizeof(detail::ChunkHeader) + slot_bytes));
}
}  // namespace

void ShmComm::send(uint32_t to, Span data, int64_t tag, uint64_t deadline_ns) {
  SHMGRAD_CHECK(to < world_ && to != rank_, ErrorKind::kInvalidArgument,
                "shmgrad backend: send to rank ", to, " from rank ", rank_, " in a group of ",
                world_);
  detail::Channel& c = channel(rank_, to);
  uint64_t off = 0;
  do {
    waitPeer(
        c.taken,
        [&] {
          return c.sent.load(std::memory_order_relaxed) - c.taken.load(std::memory_order_acquire) <
                 detail::kChannelSlots;
        },
        to, deadline_ns, "send");
    const uint32_t seq = c.sent.load(std::memory_order_relaxed);  // only this thread writes it
    detail::ChunkHeader* h = slotOf(c, seq, channel_bytes_);
    const uint64_t len = std::min(channel_bytes_, data.bytes - off);
    if (len > 0) std::memcpy(h + 1, data.data + off, len);
    h->total = data.bytes;
    h->chunk = len;
    h->tag = tag;
    c.sent.store(seq + 1, std::memory_order_release);
    ipc::futexWake(&c.sent);
    off += len;
  } while (off < data.bytes);
}

void ShmComm::recv(uint32_t from, Span data, int64_t tag, uint64_t deadline_ns) {
  SHMGRAD_CHECK(from < world_ && from != rank_, ErrorKind::kInvalidArgument,
                "shmgrad backend: recv from rank ", from, " on rank ", rank_, " in a group of ",
                world_);
  detail::Channel& c = channel(from, rank_);
  uint64_t off = 0;
  do {
    waitPeer(
        c.sent,
        [&] {
          return c.sent.load(std::memory_order_acquire) != c.taken.load(std::memory_order_relaxed);
        },
        from, deadline_ns, "recv");
    const uint32_t seq = c.taken.load(std::memory_order_relaxed);  // only this thread writes it
    const detail::ChunkHeader* h = slotOf(c, seq, channel_bytes_);
    // Read once, then checked: the sizes come from another process.
    const uint64_t total = h->total, len = h->chunk;
    const int64_t their_tag = h->tag;
    if (!detail::chunkExpected(total, len, their_tag, data.bytes, tag, off, channel_bytes_)) {
      const std::string message =
          "shmgrad backend: rank " + std::to_string(from) + " sent " + std::to_string(total) +
          " bytes with tag " + std::to_string(their_tag) + " but rank " + std::to_string(rank_) +
          " expected " + std::to_string(data.bytes) + " bytes with tag " + std::to_string(tag) +
          ": sends and recvs between two ranks are matched in order and must agree";
      breakGroup(ErrorKind::kInvalidArgument, from, message);
      throw Error(ErrorKind::kInvalidArgument, message);
    }
    if (len > 0) std::memcpy(data.data + off, h + 1, len);
    c.taken.store(seq + 1, std::memory_order_release);
    ipc::futexWake(&c.taken);
    off += len;
  } while (off < data.bytes);
}

bool ShmComm::breakGroup(ErrorKind kind, uint32_t culprit, const std::string& message) {
  uint32_t expected = 0;
  if (!header_->broken.compare_exchange_strong(expected, kClaimed, std::memory_order_acq_rel))
    return false;
  std::snprintf(header_->broken_reason, sizeof(header_->broken_reason), "%s", message.c_str());
  header_->broken_kind.store(static_cast<uint32_t>(kind), std::memory_order_relaxed);
  header_->broken.store(1 + culprit, std::memory_order_release);
  ipc::futexWake(&header_->arrivals);
  return true;
}

void ShmComm::shutdown() {
  closing_.store(true, std::memory_order_release);
  ipc::futexWake(&header_->arrivals);
}

}  // namespace shmgrad::backend
