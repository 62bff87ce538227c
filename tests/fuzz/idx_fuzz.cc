// The Fashion-MNIST reader (engine/dataset.h): engine::parseFashionMnist, what
// loadFashionMnist runs on the two IDX files' bytes once gunzipped. Input: u32 n, then the
// images file's first n bytes, then the labels file.
#include <vector>

#include "engine/dataset.h"
#include "tests/fuzz/fuzz_util.h"

using namespace shmgrad;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const size_t n = std::min<size_t>(in.take<uint32_t>(), in.left());
  const std::vector<uint8_t> images(in.rest(), in.rest() + n);
  in.skip(n);
  const std::vector<uint8_t> labels(in.rest(), in.rest() + in.left());
  engine::Dataset d;
  if (!fuzz::accepts(
          [&] { d = engine::parseFashionMnist(images, "images", labels, "labels", "train"); })) {
    return 0;
  }
  FUZZ_EXPECT(d.example_shape.size() == 3 && d.example_shape[0] == 1);
  FUZZ_EXPECT(d.inputs.size() ==
              static_cast<uint64_t>(d.count * d.example_shape[1] * d.example_shape[2]));
  FUZZ_EXPECT(d.targets_i64.size() == static_cast<uint64_t>(d.count));
  for (float v : d.inputs) FUZZ_EXPECT(v >= 0.0f && v <= 1.0f);
  return 0;
}
