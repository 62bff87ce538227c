// The `npy:` dataset reader (engine/dataset.h): engine::parseNpyPair, what loadNpyPair
// runs on the two files' bytes. Input: u16 n, then the inputs file's first n bytes, then
// the targets file. An accepted pair must hold the sizes the segment is made from.
#include <vector>

#include "engine/dataset.h"
#include "ipc/segment.h"
#include "tests/fuzz/fuzz_util.h"

using namespace shmgrad;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const size_t n = std::min<size_t>(in.take<uint16_t>(), in.left());
  const std::vector<uint8_t> inputs(in.rest(), in.rest() + n);
  in.skip(n);
  const std::vector<uint8_t> targets(in.rest(), in.rest() + in.left());
  engine::Dataset d;
  if (!fuzz::accepts([&] { d = engine::parseNpyPair(inputs, "x.npy", targets, "y.npy"); })) {
    return 0;
  }
  FUZZ_EXPECT(d.count > 0);
  const uint64_t in_numel =
      ipc::checkedNumel(ErrorKind::kCorrupt, "x", d.example_shape.data(), d.example_shape.size());
  const uint64_t tg_numel =
      ipc::checkedNumel(ErrorKind::kCorrupt, "y", d.target_shape.data(), d.target_shape.size());
  FUZZ_EXPECT(d.inputs.size() == static_cast<uint64_t>(d.count) * in_numel);
  const size_t targets_read =
      d.target_dtype == ipc::DType::kFloat32 ? d.targets_f32.size() : d.targets_i64.size();
  FUZZ_EXPECT(targets_read == static_cast<uint64_t>(d.count) * tg_numel);
  return 0;
}
