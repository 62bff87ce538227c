// The device table (ipc/device_table.h) as a worker or trainer of an engine with GPUs
// reads it: ipc::validateDeviceTable against the segment's own sizes, then what a reader
// takes from a table that validated (each slot's device and its place there).
//
// Input: u32 slots, u64 parameter floats, u64 buffer bytes, i32 visible devices (as the
// header and the CUDA runtime would give them), then the table's bytes.
#include <algorithm>
#include <cstring>

#include "ipc/device_table.h"
#include "tests/fuzz/fuzz_util.h"

using namespace shmgrad;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const auto num_slots = in.take<uint32_t>();
  const auto param_floats = in.take<uint64_t>();
  const auto buffer_bytes = in.take<uint64_t>();
  const auto visible = in.take<int32_t>();
  // The table in its region's memory, exactly its size (ASan sees a read past it).
  auto* raw = static_cast<uint8_t*>(
      ::operator new (sizeof(ipc::DeviceTable), std::align_val_t{alignof(ipc::DeviceTable)}));
  std::memset(raw, 0, sizeof(ipc::DeviceTable));
  std::memcpy(raw, in.rest(), std::min(in.left(), sizeof(ipc::DeviceTable)));
  const auto& t = *reinterpret_cast<const ipc::DeviceTable*>(raw);
  if (fuzz::accepts(
          [&] { ipc::validateDeviceTable(t, num_slots, param_floats, buffer_bytes, visible); }) &&
      t.count > 0) {
    // What EngineMemory relies on once the table validated.
    for (uint32_t i = 0; i < num_slots; ++i) {
      const int d = t.slot_device[i];
      FUZZ_EXPECT(d >= 0 && static_cast<uint32_t>(d) < t.count);
      FUZZ_EXPECT(t.slot_local[i] < t.devices[d].slots);
      const ipc::DeviceLayout& l = t.devices[d].layout;
      FUZZ_EXPECT(l.slots + (uint64_t{t.slot_local[i]} + 1) * l.slot_stride <= l.bytes);
    }
    for (uint32_t d = 0; d < t.count; ++d) {
      FUZZ_EXPECT(visible < 0 || t.devices[d].ordinal < visible);
      const ipc::DeviceLayout& l = t.devices[d].layout;
      FUZZ_EXPECT(l.params + param_floats * 4 <= l.bytes);
    }
  }
  ::operator delete (raw, std::align_val_t{alignof(ipc::DeviceTable)});
  return 0;
}
