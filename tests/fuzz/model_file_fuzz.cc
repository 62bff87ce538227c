// The model description file (engine/model_file.h) as the coordinator reads it:
// engine::parseModelFile, what readModelFile runs on the file's bytes. An accepted file's
// description must hold what the coordinator relies on: every value array the size its
// shape says, every name short enough for the segment's tables.
#include <vector>

#include "engine/model_file.h"
#include "tests/fuzz/fuzz_util.h"

using namespace shmgrad;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> bytes(data, data + size);
  engine::ModelDescription m;
  if (!fuzz::accepts([&] { m = engine::parseModelFile(bytes, "fuzz.model"); })) return 0;
  FUZZ_EXPECT(!m.params.empty() && m.params.size() <= ipc::kMaxParams);
  FUZZ_EXPECT(m.params.size() == m.param_values.size());
  FUZZ_EXPECT(m.buffers.size() == m.buffer_values.size());
  uint64_t total = 0;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const auto& p = m.params[i];
    FUZZ_EXPECT(!p.name.empty() && p.name.size() < ipc::kNameLen);
    FUZZ_EXPECT(ipc::memoryFormatFits(static_cast<uint32_t>(p.memory_format),
                                      static_cast<uint32_t>(p.shape.size())));
    const uint64_t n =
        ipc::checkedNumel(ErrorKind::kCorrupt, "param", p.shape.data(), p.shape.size());
    FUZZ_EXPECT(m.param_values[i].size() == n);
    total += n * 4;
  }
  for (size_t i = 0; i < m.buffers.size(); ++i) {
    const auto& b = m.buffers[i];
    FUZZ_EXPECT(!b.name.empty() && b.name.size() < ipc::kNameLen);
    const uint64_t n =
        ipc::checkedNumel(ErrorKind::kCorrupt, "buffer", b.shape.data(), b.shape.size());
    FUZZ_EXPECT(ipc::dtypeSize(b.dtype) != 0);
    FUZZ_EXPECT(m.buffer_values[i].size() == n * ipc::dtypeSize(b.dtype));
    total += n * ipc::dtypeSize(b.dtype);
  }
  FUZZ_EXPECT(total <= size);  // every value came from the file's bytes
  return 0;
}
