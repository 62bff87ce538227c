// What a torch.distributed rank (backend/shm_comm.cc) reads from memory other ranks wrote:
// the group segment's header as ShmComm::attach checks it (backend::detail::
// groupHeaderValid), a broken group's reason text (detail::reasonText, as brokenReason
// reads it) and the chunk headers of a point-to-point channel, through recv's loop: each
// chunk checked (detail::chunkExpected) before its bytes are copied into the receiver's
// buffer, which is an allocation of exactly the message's size here.
//
// Input: u16 world, u64 segment size, the header's bytes (groupHeaderBytes()), u32
// message bytes, i64 tag, u8 slot size in KiB, then chunk headers (u64 total, u64 len,
// i64 tag) until the message is complete or a chunk is refused.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/shm_comm.h"
#include "tests/fuzz/fuzz_util.h"

namespace detail = shmgrad::backend::detail;
using shmgrad::fuzz::Input;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const uint32_t world = in.take<uint16_t>();
  const auto claimed = in.take<uint64_t>();
  const size_t hbytes = detail::groupHeaderBytes();
  std::vector<uint8_t> header(hbytes, 0);
  std::memcpy(header.data(), in.rest(), std::min(in.left(), hbytes));
  in.skip(hbytes);
  (void)detail::groupHeaderValid(header.data(), header.size(), claimed, world, getuid());
  // The reason text: the header's last 512 bytes stand for the array another rank wrote.
  const std::string reason =
      detail::reasonText(reinterpret_cast<const char*>(header.data() + hbytes - 512), 512);
  FUZZ_EXPECT(reason.size() < 512);

  const uint64_t expected = in.take<uint32_t>() % (1u << 20);
  const auto tag = in.take<int64_t>();
  const uint64_t slot_bytes = (1 + in.take<uint8_t>() % 128) * 1024;
  std::unique_ptr<uint8_t[]> dst(new uint8_t[expected]);
  std::vector<uint8_t> slot(slot_bytes, 0x5a);
  uint64_t off = 0;
  do {  // recv's loop, a chunk at a time
    const auto total = in.take<uint64_t>();
    const auto len = in.take<uint64_t>();
    const auto their_tag = in.take<int64_t>();
    if (!detail::chunkExpected(total, len, their_tag, expected, tag, off, slot_bytes)) break;
    if (len > 0) std::memcpy(dst.get() + off, slot.data(), len);
    off += len;
    FUZZ_EXPECT(off <= expected);
  } while (off < expected && in.left() > 0);
  return 0;
}
