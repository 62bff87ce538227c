#include "ipc/device_table.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "ipc/error.h"

namespace shmgrad::ipc {
namespace {

uint64_t alignUp(uint64_t v) { return (v + kDeviceAlign - 1) / kDeviceAlign * kDeviceAlign; }

bool sameLayout(const DeviceLayout& a, const DeviceLayout& b) {
  return a.params == b.params && a.buffers == b.buffers && a.slots == b.slots &&
         a.slot_stride == b.slot_stride && a.reduced == b.reduced && a.accum == b.accum &&
         a.bytes == b.bytes;
}

}  // namespace

DeviceLayout layoutDevice(uint64_t param_floats, uint64_t buffer_bytes, uint32_t slots,
                          bool reduces) {
  SHMGRAD_CHECK(param_floats <= kMaxParamFloats && buffer_bytes <= kMaxParamFloats * 4,
                ErrorKind::kInvalidArgument, "a device copy of ", param_floats, " parameters and ",
                buffer_bytes, " bytes of buffers exceeds the limit of ", kMaxParamFloats,
                " floats");
  SHMGRAD_CHECK(slots <= kMaxWorkers, ErrorKind::kInvalidArgument, slots,
                " gradient slots on one device exceed the limit of ", kMaxWorkers);
  // Each term is at most 2^42 bytes and there are at most 68 of them: no overflow.
  const uint64_t grad = alignUp(param_floats * sizeof(float));
  DeviceLayout l{};
  l.params = 0;
  l.buffers = l.params + grad;
  l.slots = l.buffers + alignUp(buffer_bytes);
  l.slot_stride = grad;
  const uint64_t end = l.slots + uint64_t{slots} * grad;
  if (!reduces) {
    l.bytes = std::max<uint64_t>(end, kDeviceAlign);
    return l;
  }
  l.reduced = end;
  l.accum = l.reduced + grad;
  l.bytes = std::max<uint64_t>(l.accum + grad, kDeviceAlign);
  return l;
}

Placement placeRoundRobin(uint32_t slots, uint32_t devices) {
  SHMGRAD_CHECK(devices >= 1 && devices <= kMaxDevices, ErrorKind::kInvalidArgument,
                "an engine serves 1 to ", kMaxDevices, " devices, not ", devices);
  SHMGRAD_CHECK(slots <= kMaxWorkers, ErrorKind::kInvalidArgument, slots,
                " worker slots exceed the limit of ", kMaxWorkers);
  Placement p;
  p.slots_per_device.assign(devices, 0);
  for (uint32_t i = 0; i < slots; ++i) {
    const uint32_t d = i % devices;
    p.device.push_back(static_cast<int>(d));
    p.local.push_back(static_cast<int>(p.slots_per_device[d]++));
  }
  return p;
}

void initDeviceTable(DeviceTable* table, const std::vector<int>& ordinals, uint32_t num_slots,
                     uint64_t param_floats, uint64_t buffer_bytes) {
  const auto n = static_cast<uint32_t>(ordinals.size());
  const Placement p = placeRoundRobin(num_slots, n);
  for (uint32_t d = 0; d < n; ++d) {
    SHMGRAD_CHECK(ordinals[d] >= 0, ErrorKind::kInvalidArgument, "device ordinal ", ordinals[d],
                  " is negative");
    for (uint32_t e = 0; e < d; ++e) {
      SHMGRAD_CHECK(ordinals[e] != ordinals[d], ErrorKind::kInvalidArgument,
                    "device cuda:", ordinals[d],
                    " is listed twice: give each device once (several workers "
                    "share a device by round-robin placement)");
    }
  }
  table->count = n;
  table->flags = 0;
  for (uint32_t d = 0; d < kMaxDevices; ++d) {
    DeviceEntry& e = table->devices[d];
    e.ordinal = d < n ? ordinals[d] : -1;
    e.slots = d < n ? p.slots_per_device[d] : 0;
    e.state.store(static_cast<uint32_t>(DeviceState::kEmpty), std::memory_order_relaxed);
    e.reserved = 0;
    e.layout = d < n ? layoutDevice(param_floats, buffer_bytes, e.slots, d == 0) : DeviceLayout{};
    std::memset(e.ipc_handle, 0, sizeof e.ipc_handle);
  }
  for (uint32_t i = 0; i < kMaxWorkers; ++i) {
    table->slot_device[i] = i < num_slots ? static_cast<int8_t>(p.device[i]) : kNoDevice;
    table->slot_local[i] = i < num_slots ? static_cast<uint8_t>(p.local[i]) : 0;
  }
}

void validateDeviceTable(const DeviceTable& t, uint32_t num_slots, uint64_t param_floats,
                         uint64_t buffer_bytes, int visible_devices) {
  SHMGRAD_CHECK(t.count <= kMaxDevices, ErrorKind::kCorrupt, "device table: ", t.count,
                " devices, more than ", kMaxDevices);
  SHMGRAD_CHECK(num_slots <= kMaxWorkers, ErrorKind::kCorrupt, "device table: ", num_slots,
                " slots, more than ", kMaxWorkers);
  SHMGRAD_CHECK((t.flags & ~static_cast<uint32_t>(kDeviceTableFlags)) == 0, ErrorKind::kCorrupt,
                "device table: unknown flags ", t.flags);
  if (t.count == 0) return;  // a CPU engine: nothing on a device
  SHMGRAD_CHECK(param_floats <= kMaxParamFloats && buffer_bytes <= kMaxParamFloats * 4,
                ErrorKind::kCorrupt, "device table: sizes out of range (", param_floats,
                " parameters, ", buffer_bytes, " bytes of buffers)");
  std::vector<uint32_t> used(t.count, 0);
  std::vector<uint64_t> taken(t.count, 0);  // bit per local slot (slots <= kMaxWorkers = 64)
  for (uint32_t i = 0; i < num_slots; ++i) {
    const int d = t.slot_device[i];
    SHMGRAD_CHECK(d >= 0 && static_cast<uint32_t>(d) < t.count, ErrorKind::kCorrupt,
                  "device table: slot ", i, " is placed on device index ", d, " of ", t.count);
    const uint32_t local = t.slot_local[i];
    // local < kMaxWorkers too (a device's slot count is bounded only below): it indexes
    // the 64 bits of taken[d].
    SHMGRAD_CHECK(local < t.devices[d].slots && local < kMaxWorkers, ErrorKind::kCorrupt,
                  "device table: slot ", i, " is slot ", local, " of device ", d, ", which has ",
                  t.devices[d].slots);
    SHMGRAD_CHECK(!(taken[d] >> local & 1u), ErrorKind::kCorrupt, "device table: slot ", local,
                  " of device ", d, " is given to two workers");
    taken[d] |= uint64_t{1} << local;
    ++used[d];
  }
  for (uint32_t d = 0; d < t.count; ++d) {
    const DeviceEntry& e = t.devices[d];
    SHMGRAD_CHECK(e.ordinal >= 0 && (visible_devices < 0 || e.ordinal < visible_devices),
                  ErrorKind::kCorrupt, "device table: device ", d, " has ordinal ", e.ordinal, " (",
                  visible_devices, " visible)");
    for (uint32_t o = 0; o < d; ++o) {
      SHMGRAD_CHECK(t.devices[o].ordinal != e.ordinal, ErrorKind::kCorrupt,
                    "device table: ordinal ", e.ordinal, " appears twice");
    }
    SHMGRAD_CHECK(e.slots <= kMaxWorkers && used[d] <= e.slots, ErrorKind::kCorrupt,
                  "device table: device ", d, " has ", e.slots, " slots for ", used[d], " workers");
    const uint32_t state = e.state.load(std::memory_order_acquire);
    SHMGRAD_CHECK(state <= static_cast<uint32_t>(DeviceState::kPublished), ErrorKind::kCorrupt,
                  "device table: device ", d, " is in unknown state ", state);
    SHMGRAD_CHECK(sameLayout(e.layout, layoutDevice(param_floats, buffer_bytes, e.slots, d == 0)),
                  ErrorKind::kCorrupt, "device table: device ", d,
                  "'s layout differs from the one its sizes give (", e.layout.bytes, " bytes)");
  }
}

}  // namespace shmgrad::ipc
