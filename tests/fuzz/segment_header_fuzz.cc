// The segment header as every process attaching to an engine reads it: ipc::validateHeader
// (ipc/segment.cc; the device table's checks with it), then what `shmgrad status` takes
// from a header that validated (engine::statusOf, formatStatus).
//
// Input: the header's bytes up to its control block (identity, sizes, regions, dataset
// description), then the bytes from the end of the header on (the parameter and buffer
// tables and the regions, where a real segment has them). The mapping is the size the
// header claims, when that is at most kMaxMapped (else kMaxMapped, which the size check
// refuses), and ends where ASan's poisoned memory starts: a read past the segment's end is
// a crash, as it is a SIGBUS or SIGSEGV on a real mapping. The control block, the step
// request and the worker records stay zero (other targets read those).
#include <sanitizer/asan_interface.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "engine/control.h"
#include "ipc/layout.h"
#include "ipc/segment.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using shmgrad::ipc::SegmentHeader;

const size_t kTables = shmgrad::ipc::alignUp(sizeof(SegmentHeader), shmgrad::ipc::kAlign);
const size_t kMaxMapped = kTables + (256 << 10);

// The bytes of the header the input gives: up to its control block.
size_t prefixBytes() {
  static const size_t n = [] {
    alignas(SegmentHeader) static uint8_t probe[sizeof(SegmentHeader)];
    auto* h = reinterpret_cast<SegmentHeader*>(probe);
    return static_cast<size_t>(reinterpret_cast<uint8_t*>(&h->control) - probe);
  }();
  return n;
}

uint8_t* arena() {
  static uint8_t* a = static_cast<uint8_t*>(::operator new (kMaxMapped + 64, std::align_val_t{64}));
  static bool zeroed = (std::memset(a, 0, kMaxMapped + 64), true);
  (void)zeroed;
  return a;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  uint64_t claimed = 0;
  if (size >= 24) std::memcpy(&claimed, data + 16, sizeof claimed);  // SegmentHeader::total_size
  const uint64_t mapped =
      claimed >= sizeof(SegmentHeader) && claimed <= kMaxMapped ? claimed : kMaxMapped;
  uint8_t* const a = arena();
  uint8_t* const end = a + kMaxMapped + 64;
  // 64-byte aligned as a mapping is; whatever lies past `mapped` is poisoned.
  uint8_t* const base = a + ((static_cast<size_t>(end - a) - mapped) & ~size_t{63});
  ASAN_UNPOISON_MEMORY_REGION(a, kMaxMapped + 64);
  ASAN_POISON_MEMORY_REGION(base + mapped, end - (base + mapped));

  const size_t head = std::min(size, prefixBytes());
  std::memcpy(base, data, head);
  const size_t tail = size > head ? std::min<size_t>(size - head, mapped - kTables) : 0;
  std::memcpy(base + kTables, data + head, tail);

  const auto* h = reinterpret_cast<const SegmentHeader*>(base);
  if (shmgrad::fuzz::accepts([&] { shmgrad::ipc::validateHeader(h, mapped); })) {
    shmgrad::fuzz::accepts([&] {
      const auto status = shmgrad::engine::statusOf("fuzz", h);
      FUZZ_EXPECT(status.slots == h->num_slots && status.segment_bytes == mapped);
      shmgrad::engine::formatStatus(status);
    });
  }
  ASAN_UNPOISON_MEMORY_REGION(a, kMaxMapped + 64);
  std::memset(base, 0, head);
  std::memset(base + kTables, 0, tail);
  return 0;
}
