// Datasets an engine can load once into its segment: Fashion-MNIST from Debian's
// dataset-fashion-mnist package, or a pair of .npy files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ipc/layout.h"

namespace shmgrad::engine {

struct Dataset {
  std::string description;
  int64_t count = 0;
  std::vector<int64_t> example_shape;  // shape of one input
  std::vector<float> inputs;           // count * numel(example_shape)
  ipc::DType target_dtype = ipc::DType::kInt64;
  std::vector<int64_t> target_shape;  // shape of one target ({} for class labels)
  std::vector<int64_t> targets_i64;   // when target_dtype == kInt64
  std::vector<float> targets_f32;     // when target_dtype == kFloat32
};

// The directory holding Debian's Fashion-MNIST (SHMGRAD_FASHION_MNIST_DIR overrides).
std::string fashionMnistDir();

// Fashion-MNIST: inputs [1, 28, 28] scaled to [0, 1], int64 labels 0..9.
// split is "train" (60000) or "test" (10000).
Dataset loadFashionMnist(const std::string& dir, const std::string& split = "train");

// A pair of .npy files: inputs (float32/float64/uint8/int*) become float32; targets of
// an integer dtype become int64 class labels, of a float dtype float32 values.
Dataset loadNpyPair(const std::string& inputs_path, const std::string& targets_path);

// "fashion-mnist[:train|:test]" or "npy:INPUTS.npy,TARGETS.npy". Throws
// InvalidArgument naming the accepted forms.
Dataset loadDatasetSpec(const std::string& spec);

// The readers behind the loaders above, over bytes already read (what tests/fuzz feeds
// them): `*_name` names the source in errors. Anything that is not a complete, valid file
// of its format throws Error(kInvalidArgument); nothing is allocated beyond what the
// bytes hold.
Dataset parseFashionMnist(const std::vector<uint8_t>& images, const std::string& images_name,
                          const std::vector<uint8_t>& labels, const std::string& labels_name,
                          const std::string& split);
Dataset parseNpyPair(const std::vector<uint8_t>& inputs, const std::string& inputs_name,
                     const std::vector<uint8_t>& targets, const std::string& targets_name);

// A --dataset spec, parsed (no file read): which dataset, and its split or its two files.
struct DatasetSpec {
  bool npy = false;
  std::string split;                      // fashion-mnist: "train" or "test"
  std::string inputs_path, targets_path;  // npy
};
DatasetSpec parseDatasetSpec(const std::string& spec);

}  // namespace shmgrad::engine
