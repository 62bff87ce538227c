// Unit tests of the readers of files and strings that fuzzing covers (tests/fuzz): the
// npy: and Fashion-MNIST dataset readers, the model description file, --dataset specs,
// the backend's group name and the trainer's reading of a worker's record. Each refusal
// is a typed Error (kInvalidArgument, kCorrupt), never another exception, an allocation
// a size in the input asks for, or an input accepted with sizes that do not add up.
// No libtorch here.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <climits>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/shm_comm.h"
#include "engine/dataset.h"
#include "engine/model_file.h"
#include "engine/step_results.h"
#include "ipc/error.h"
#include "tests/segment_testing.h"

namespace shmgrad {
namespace {

using Bytes = std::vector<uint8_t>;
using testing::throwsKind;

void append(Bytes* b, const void* p, size_t n) {
  b->insert(b->end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
}
template <typename T>
void append(Bytes* b, T v) {
  append(b, &v, sizeof v);
}

// A .npy file as numpy.save writes it (format 1.0), with `header` as its dict.
Bytes npy(const std::string& dict, const Bytes& data) {
  std::string header = dict;
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  Bytes b;
  append(&b, "\x93NUMPY\x01\x00", 8);
  append(&b, static_cast<uint16_t>(header.size()));
  append(&b, header.data(), header.size());
  append(&b, data.data(), data.size());
  return b;
}
Bytes npyArray(const std::string& descr, const std::string& shape, const Bytes& data) {
  return npy("{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }", data);
}

TEST(NpyReader, ReadsWhatNumpySaveWrites) {
  Bytes x_data;
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f}) append(&x_data, v);
  Bytes y_data;
  for (int64_t v : {0, 2, 1}) append(&y_data, v);
  const engine::Dataset d = engine::parseNpyPair(npyArray("<f4", "(3, 2)", x_data), "x.npy",
                                                 npyArray("<i8", "(3,)", y_data), "y.npy");
  EXPECT_EQ(d.count, 3);
  EXPECT_EQ(d.example_shape, std::vector<int64_t>({2}));
  EXPECT_EQ(d.inputs, std::vector<float>({1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(d.target_dtype, ipc::DType::kInt64);
  EXPECT_EQ(d.targets_i64, std::vector<int64_t>({0, 2, 1}));
  EXPECT_TRUE(d.target_shape.empty());
}

// Integer targets are read exactly: through a double, 2^53 + 1 became 2^53 and a value
// near 2^63 rounded to 2^63, which no int64 holds (undefined behaviour; found by
// tests/fuzz/npy_fuzz.cc).
TEST(NpyReader, ReadsInt64TargetsExactly) {
  Bytes x_data;
  for (float v : {1.0f, 2.0f}) append(&x_data, v);
  const std::vector<int64_t> labels = {(int64_t{1} << 53) + 1, INT64_MAX};
  Bytes y_data;
  for (int64_t v : labels) append(&y_data, v);
  const engine::Dataset d = engine::parseNpyPair(npyArray("<f4", "(2,)", x_data), "x.npy",
                                                 npyArray("<i8", "(2,)", y_data), "y.npy");
  EXPECT_EQ(d.targets_i64, labels);
}

// Headers that once escaped as std::invalid_argument (std::stoll, std::stoul), or asked
// for an allocation of 2^64 elements (a negative or wrapping shape), or were taken apart
// at a missing quote or parenthesis: each is now refused as InvalidArgument naming it.
TEST(NpyReader, RefusesEveryMalformedHeaderWithATypedError) {
  const Bytes y = npyArray("<i8", "(1,)", Bytes(8, 0));
  const Bytes four(4, 0);
  const std::vector<Bytes> bad = {
      npyArray("<f4", "(a, 1)", four),  // not a number (was stoll's throw)
      npyArray("<f4", "(1, -4611686018427387904)",
               four),  // negative: 3 x 2^62 elements (was a resize)
      npyArray("<f4", "(1, 4294967296, 4294967296)",
               four),                                    // 2^64 elements (was accepted, no data)
      npyArray("<fX", "(1,)", four),                     // width not a number (was stoul's)
      npyArray("<f99999999999999999999", "(1,)", four),  // width out of range
      npyArray("<c8", "(1,)", Bytes(8, 0)),              // complex: not read
      npyArray("<f4", "(2,)", four),                     // truncated data
      npyArray("<f4", "1, 1", four),                     // shape not a tuple
      npy("{'descr': '<f4, 'fortran_order': False, 'shape': (1,), }", four),  // one quote
      npy("{'descr': '<f4', 'shape': (1,), }", four),                         // key missing
      npy("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }", four),  // Fortran
      npy("{'descr'", four),                                                  // no value
      Bytes{0x93, 'N', 'U', 'M', 'P', 'Y', 9, 0, 0, 0},                       // version 9
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument,
                           [&] { engine::parseNpyPair(bad[i], "x.npy", y, "y.npy"); }))
        << "case " << i;
  }
}

Bytes idx(const std::vector<uint32_t>& dims, size_t data_bytes) {
  Bytes b = {0, 0, 8, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<uint8_t>(d >> shift));
  }
  b.resize(b.size() + data_bytes, 128);
  return b;
}

TEST(FashionMnistReader, ReadsImagesAndLabels) {
  const engine::Dataset d =
      engine::parseFashionMnist(idx({2, 3, 3}, 18), "images", idx({2}, 2), "labels", "test");
  EXPECT_EQ(d.count, 2);
  EXPECT_EQ(d.example_shape, std::vector<int64_t>({1, 3, 3}));
  ASSERT_EQ(d.inputs.size(), 18u);
  EXPECT_FLOAT_EQ(d.inputs[0], 128 / 255.0f);
  EXPECT_EQ(d.targets_i64.size(), 2u);
}

// 2^22 x 2^21 x 2^21 images is 2^64 bytes, which wrapped to 0 and matched an empty data
// part: a dataset of 4194304 examples without inputs was accepted.
TEST(FashionMnistReader, RefusesDimensionsWhoseProductWraps) {
  const Bytes labels = idx({1u << 22}, 1u << 22);
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] {
    engine::parseFashionMnist(idx({1u << 22, 1u << 21, 1u << 21}, 0), "images", labels, "labels",
                              "train");
  }));
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] {
    engine::parseFashionMnist(idx({2, 3, 3}, 17), "images", idx({2}, 2), "labels", "train");
  }));
}

engine::ModelDescription smallModel() {
  engine::ModelDescription m;
  m.params = {{"fc.weight", {2, 2}, ipc::MemoryFormat::kContiguous}};
  m.param_values = {{1, 2, 3, 4}};
  m.buffers = {{"bn.num_batches_tracked", {}, ipc::DType::kInt64}};
  m.buffer_values = {Bytes(8, 7)};
  return m;
}

Bytes modelBytes(const engine::ModelDescription& m) {
  const std::string path = ::testing::TempDir() + "/readers_test_" + std::to_string(getpid());
  engine::writeModelFile(path, m);
  const Bytes b = [&] {
    FILE* f = std::fopen(path.c_str(), "rb");
    Bytes out;
    for (int c; (c = std::fgetc(f)) != EOF;) out.push_back(static_cast<uint8_t>(c));
    std::fclose(f);
    return out;
  }();
  ::unlink(path.c_str());
  return b;
}

TEST(ModelFileReader, ReadsWhatTheWriterWrites) {
  const engine::ModelDescription m = engine::parseModelFile(modelBytes(smallModel()), "m");
  ASSERT_EQ(m.params.size(), 1u);
  EXPECT_EQ(m.params[0].name, "fc.weight");
  EXPECT_EQ(m.param_values[0], std::vector<float>({1, 2, 3, 4}));
  ASSERT_EQ(m.buffers.size(), 1u);
  EXPECT_EQ(m.buffer_values[0], Bytes(8, 7));
}

// A record claiming 2^39 floats in a file that ends there: refused before the 2 TiB
// allocation its shape asked for (which crashed the reader under ASan).
TEST(ModelFileReader, RefusesAHugeShapeItDoesNotHoldWithoutAllocating) {
  Bytes b;
  append(&b, "SHMGRADP", 8);
  append(&b, uint32_t{3});  // version
  append(&b, uint32_t{1});  // one parameter
  append(&b, uint32_t{1});  // name length
  append(&b, "w", 1);
  append(&b, uint32_t{0});  // contiguous
  append(&b, uint32_t{1});  // one dimension
  append(&b, int64_t{1} << 39);
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { engine::parseModelFile(b, "m"); }));
}

TEST(ModelFileReader, RefusesTruncatedAndTrailingBytes) {
  Bytes b = modelBytes(smallModel());
  for (size_t n = 0; n < b.size(); ++n) {
    const Bytes cut(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { engine::parseModelFile(cut, "m"); }))
        << n << " bytes";
  }
  b.push_back(0);
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { engine::parseModelFile(b, "m"); }));
}

TEST(DatasetSpec, ParsesEachFormAndRefusesOthers) {
  const engine::DatasetSpec n = engine::parseDatasetSpec("npy:a.npy,b,c.npy");
  EXPECT_TRUE(n.npy);
  EXPECT_EQ(n.inputs_path, "a.npy");
  EXPECT_EQ(n.targets_path, "b,c.npy");
  EXPECT_EQ(engine::parseDatasetSpec("fashion-mnist").split, "train");
  EXPECT_EQ(engine::parseDatasetSpec("fashion-mnist:test").split, "test");
  for (const char* bad : {"npy:a.npy", "fashion-mnist:val", "", "NPY:a,b"}) {
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { engine::parseDatasetSpec(bad); }))
        << bad;
  }
}

// Only the name rank 0 publishes is opened; sscanf's %u took signs, spaces, leading zeros
// and values beyond 32 bits (wrapped).
TEST(GroupName, OnlyTheCanonicalFormParses) {
  unsigned pid = 0, fd = 0;
  ASSERT_TRUE(backend::detail::parseGroupName("/proc/1234/fd/0", &pid, &fd));
  EXPECT_EQ(pid, 1234u);
  EXPECT_EQ(fd, 0u);
  for (const char* bad :
       {"/proc/087170/fd/3", "/proc/+12/fd/3", "/proc/ 12/fd/3", "/proc/12/fd/3x", "/proc/12/fd/",
        "/proc//fd/3", "/proc/4294967308/fd/3", "/proc/12/fd/-1", "/proc/12", "/dev/shm/x", ""}) {
    EXPECT_FALSE(backend::detail::parseGroupName(bad, &pid, &fd)) << bad;
  }
}

// The trainer's reading of a failed worker's record: the message is cut at the arrays'
// ends when the worker left them unterminated.
TEST(WorkerResult, AnUnterminatedErrorIsCutAtItsArray) {
  auto w = std::make_unique<ipc::WorkerRecord>();
  w->result_epoch = 5;
  w->error = 1;
  std::memset(w->error_type, 'T', sizeof w->error_type);
  std::memset(w->error_text, 'x', sizeof w->error_text);
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kWorkerFailed, [&] { engine::readWorkerResult(*w, 5, 3); }, &message));
  EXPECT_NE(message.find(std::string(ipc::kErrorTypeLen, 'T') + ": "), std::string::npos);
  EXPECT_LT(message.size(), ipc::kErrorLen + ipc::kErrorTypeLen + 64);
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] { engine::readWorkerResult(*w, 6, 3); }));
}

}  // namespace
}  // namespace shmgrad
