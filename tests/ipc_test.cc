// Unit tests of the ipc library: the reduction kernels, slice bounds, segment layout,
// header validation against corruption, segment lifecycle errors and the futex waits.
// No libtorch here.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ipc/device_table.h"
#include "ipc/error.h"
#include "ipc/futex.h"
#include "ipc/layout.h"
#include "ipc/reduce.h"
#include "ipc/segment.h"
#include "tests/segment_testing.h"

namespace shmgrad::ipc {
namespace {

using testing::SegmentGuard;
using testing::throwsKind;

// ---------------------------------------------------------------------------------
// Helpers

std::string uniqueEngineName() {
  static int counter = 0;
  return "ipctest-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

// A small model: shapes whose sizes are and are not multiples of 16 floats, a scalar
// and an empty tensor.
SegmentSpec smallSpec(const std::string& name, bool with_dataset = true) {
  SegmentSpec s;
  s.name = name;
  s.model_path = "/nonexistent/model.pt";
  s.loss = LossKind::kCrossEntropy;
  s.num_slots = 3;
  s.threads_per_worker = 1;
  s.params = {{"fc1.weight", {7, 5}},
              {"fc1.bias", {7}},
              {"conv.weight", {4, 1, 3, 3}, MemoryFormat::kChannelsLast},
              {"scale", {}},
              {"empty", {0, 3}},
              {"fc2.weight", {16}},
              {"fc2.bias", {2, 3, 4}}};
  s.max_batch = 100;
  s.input_bytes = 4096 + 3;  // not a multiple of 64
  s.target_bytes = 1000;
  if (with_dataset) {
    s.data_count = 10;
    s.data_example_shape = {3, 4};
    s.data_target_dtype = DType::kInt64;
    s.data_target_shape = {};
    s.data_description = "ten examples";
  }
  return s;
}

// A byte copy of a segment at a 64-byte aligned address (SegmentHeader is alignas(64)).
class HeaderCopy {
 public:
  explicit HeaderCopy(const Segment& seg) : bytes_(seg.size() + kAlign), size_(seg.size()) {
    uintptr_t p = reinterpret_cast<uintptr_t>(bytes_.data());
    offset_ = static_cast<size_t>(alignUp(p, kAlign) - p);
    std::memcpy(data(), seg.base(), size_);
    pristine_.assign(data(), data() + size_);
  }
  uint8_t* data() { return bytes_.data() + offset_; }
  uint64_t size() const { return size_; }
  SegmentHeader* header() { return reinterpret_cast<SegmentHeader*>(data()); }
  ParamEntry* table() {
    return reinterpret_cast<ParamEntry*>(data() + header()->params_table.offset);
  }
  void reset() { std::memcpy(data(), pristine_.data(), size_); }
  void validate() { validateHeader(header(), size_); }

 private:
  std::vector<uint8_t> bytes_;
  std::vector<uint8_t> pristine_;
  uint64_t size_;
  size_t offset_ = 0;
};

// A pid that certainly has no process: a forked child that exited and was reaped.
pid_t deadPid() {
  pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

// ---------------------------------------------------------------------------------
// reduceSlice / sliceBounds / anyNonFinite

TEST(ReduceTest, ReduceSliceMatchesDoubleSum) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> dist(-10.0f, 10.0f);
  for (uint32_t n = 1; n <= 7; ++n) {
    for (uint64_t len : {0ull, 1ull, 15ull, 16ull, 17ull, 1000ull, 70001ull}) {
      std::vector<std::vector<float>> inputs(n, std::vector<float>(len));
      for (auto& v : inputs)
        for (auto& x : v) x = dist(rng);
      std::vector<const float*> ptrs;
      for (auto& v : inputs) ptrs.push_back(v.data());
      for (float scale : {1.0f, 1.0f / 7.0f, 1.0f / 256.0f}) {
        SCOPED_TRACE("n " + std::to_string(n) + " len " + std::to_string(len) + " scale " +
                     std::to_string(scale));
        // Guard floats on both sides catch writes outside [begin, end).
        std::vector<float> out(len + 2, -12345.0f);
        reduceSlice(out.data() + 1, ptrs.data(), n, 0, len, scale);
        EXPECT_EQ(out.front(), -12345.0f);
        EXPECT_EQ(out.back(), -12345.0f);
        int bad = 0;
        for (uint64_t i = 0; i < len; ++i) {
          double sum = 0, mag = 0;
          for (uint32_t k = 0; k < n; ++k) {
            sum += inputs[k][i];
            mag += std::fabs(inputs[k][i]);
          }
          double want = sum * scale;
          double tol = 1e-6 * mag * scale * n + 1e-30;
          if (std::fabs(out[i + 1] - want) > tol && ++bad <= 5) {
            ADD_FAILURE() << "element " << i << ": " << out[i + 1] << " != " << want;
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

TEST(ReduceTest, ReduceSliceOnlyWritesItsSlice) {
  // A slice in the middle of the buffer, as a worker reduces it, with begin/end not on
  // block edges.
  const uint64_t total = 20000;
  const uint32_t n = 5;
  std::vector<std::vector<float>> inputs(n, std::vector<float>(total));
  for (uint32_t k = 0; k < n; ++k)
    for (uint64_t i = 0; i < total; ++i) inputs[k][i] = static_cast<float>((i % 97) + k);
  std::vector<const float*> ptrs;
  for (auto& v : inputs) ptrs.push_back(v.data());
  std::vector<float> out(total, -1.0f);
  const uint64_t begin = 4096 + 16, end = 3 * 4096 + 48;
  reduceSlice(out.data(), ptrs.data(), n, begin, end, 0.5f);
  for (uint64_t i = 0; i < total; ++i) {
    float want = -1.0f;
    if (i >= begin && i < end) {
      want = 0.0f;
      for (uint32_t k = 0; k < n; ++k) want += inputs[k][i];
      want *= 0.5f;
    }
    ASSERT_FLOAT_EQ(out[i], want) << "index " << i;
  }
}

TEST(ReduceTest, BucketCutsFallOnParametersInOrder) {
  ParamEntry table[6] = {};
  const uint64_t offsets[6] = {0, 800, 816, 1824, 1840, 2000};  // numels 800, 16, 1008, ...
  for (int i = 0; i < 6; ++i) table[i].offset = offsets[i];
  uint64_t cuts[kMaxBuckets + 1];
  // At least 500 floats each but the last: cut before the 2nd and the 4th parameter.
  ASSERT_EQ(bucketCuts(table, 6, 2016, 500, cuts), 3u);
  EXPECT_EQ(std::vector<uint64_t>(cuts, cuts + 4), (std::vector<uint64_t>{0, 800, 1824, 2016}));
  EXPECT_EQ(bucketCuts(table, 6, 2016, 0, cuts), 0u);     // buckets off
  EXPECT_EQ(bucketCuts(table, 6, 2016, 5000, cuts), 0u);  // one bucket: none
  // Never more than kMaxBuckets, however small the target.
  ParamEntry many[40] = {};
  for (int i = 0; i < 40; ++i) many[i].offset = 16 * i;
  const uint32_t k = bucketCuts(many, 40, 640, 1, cuts);  // each >= 640 / 16 floats
  ASSERT_GE(k, 2u);
  ASSERT_LE(k, kMaxBuckets);
  for (uint32_t i = 0; i + 1 < k; ++i) EXPECT_GE(cuts[i + 1] - cuts[i], 40u);
  EXPECT_LT(cuts[k - 1], cuts[k]);
  EXPECT_EQ(cuts[k], 640u);
  // Offsets that do not increase, or lie off a cache line: no buckets.
  many[3].offset = 8;
  EXPECT_EQ(bucketCuts(many, 40, 640, 1, cuts), 0u);
}

TEST(ReduceTest, SliceBoundsPartitionOnCacheLines) {
  for (uint32_t parts = 1; parts <= 9; ++parts) {
    for (uint64_t total = 0; total <= 200; ++total) {
      SCOPED_TRACE("parts " + std::to_string(parts) + " total " + std::to_string(total));
      uint64_t expect_begin = 0;
      for (uint32_t rank = 0; rank < parts; ++rank) {
        uint64_t b = 99999, e = 99999;
        sliceBounds(total, parts, rank, &b, &e);
        ASSERT_LE(b, e);
        ASSERT_LE(e, total);
        // Consecutive: slice rank starts where slice rank-1 ended (disjoint, no gap).
        ASSERT_EQ(b, expect_begin);
        if (b != 0 && b != total) {
          ASSERT_EQ(b % 16, 0u);
        }
        if (e != 0 && e != total) {
          ASSERT_EQ(e % 16, 0u);
        }
        expect_begin = e;
      }
      ASSERT_EQ(expect_begin, total);  // covers [0, total)
    }
  }
}

TEST(ReduceTest, AnyNonFiniteFindsNanAndInf) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (uint64_t len : {1ull, 15ull, 16ull, 17ull, 1000ull, 70001ull}) {
    std::vector<float> data(len);
    for (uint64_t i = 0; i < len; ++i) data[i] = std::sin(static_cast<float>(i)) * 1e30f;
    EXPECT_FALSE(anyNonFinite(data.data(), 0, len)) << "len " << len;
    std::vector<uint64_t> positions = {0, len / 2, len - 1};
    if (len > 20) positions.push_back(17);
    for (uint64_t pos : positions) {
      for (float bad : {nan, inf, -inf}) {
        float saved = data[pos];
        data[pos] = bad;
        EXPECT_TRUE(anyNonFinite(data.data(), 0, len))
            << "len " << len << " pos " << pos << " value " << bad;
        // Outside the checked range it does not count.
        if (pos > 0) {
          EXPECT_FALSE(anyNonFinite(data.data(), 0, pos));
        }
        if (pos + 1 < len) {
          EXPECT_FALSE(anyNonFinite(data.data(), pos + 1, len));
        }
        EXPECT_TRUE(anyNonFinite(data.data(), pos, pos + 1));
        data[pos] = saved;
      }
    }
    EXPECT_FALSE(anyNonFinite(data.data(), 0, len));
  }
  EXPECT_FALSE(anyNonFinite(nullptr, 0, 0));
  // Large finite values whose sum overflows are still finite data.
  std::vector<float> big(100, std::numeric_limits<float>::max());
  EXPECT_FALSE(anyNonFinite(big.data(), 0, big.size()));
}

TEST(ReduceTest, MaxMagnitudeBitsOrderAsMagnitudesAndFlagNonFinite) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u & 0x7fffffffu;
  };
  for (uint64_t len : {1ull, 15ull, 16ull, 17ull, 1000ull}) {
    std::vector<float> data(len);
    float most = 0;
    for (uint64_t i = 0; i < len; ++i) {
      data[i] = std::sin(static_cast<float>(i) * 1.7f) * 3.25f;
      most = std::max(most, std::fabs(data[i]));
    }
    EXPECT_EQ(maxMagnitudeBits(data.data(), len), bits(most)) << "len " << len;
    data[len / 2] = -7.5f;  // a negative value's magnitude
    EXPECT_EQ(maxMagnitudeBits(data.data(), len), bits(7.5f)) << "len " << len;
    for (float bad : {nan, inf, -inf}) {
      data[len - 1] = bad;
      EXPECT_GE(maxMagnitudeBits(data.data(), len), 0x7f800000u) << "len " << len << " " << bad;
    }
  }
  EXPECT_EQ(maxMagnitudeBits(nullptr, 0), 0u);
}

TEST(ReduceTest, ProductFiniteOnlyUnderItsBound) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u & 0x7fffffffu;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(productFinite(32, bits(3.5f), bits(1e3f)));
  EXPECT_TRUE(productFinite(32, bits(0.0f), bits(0.0f)));
  EXPECT_FALSE(productFinite(32, bits(inf), bits(1.0f)));
  EXPECT_FALSE(productFinite(32, bits(1.0f), bits(nan)));
  // k * a * b * 4 against FLT_MAX (3.4e38): 1e18 * 1e18 * 256 * 4 = 1e39 is refused, even
  // though a float holds each factor.
  EXPECT_FALSE(productFinite(256, bits(1e18f), bits(1e18f)));
  EXPECT_TRUE(productFinite(256, bits(1e17f), bits(1e18f)));
  EXPECT_FALSE(productFinite(uint64_t{1} << 24, bits(1.0f), bits(1.0f)));  // rounding unbounded
  // What it vouches for holds: the product summed in float, in the worst order, is finite.
  const uint64_t k = 1000;
  const float a = 1.0e16f, b = 8.0e18f;  // k * a * b = 8e37, times 4 under FLT_MAX
  ASSERT_TRUE(productFinite(k, bits(a), bits(b)));
  float sum = 0;
  for (uint64_t i = 0; i < k; ++i) sum += a * b;
  EXPECT_TRUE(std::isfinite(sum));
}

// ---------------------------------------------------------------------------------
// Layout and creation

TEST(SegmentTest, LayoutIsAlignedAndDisjoint) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  SegmentSpec spec = smallSpec(name);
  Layout l = computeLayout(spec);
  ASSERT_EQ(l.param_offsets.size(), spec.params.size());
  for (size_t i = 0; i < l.param_offsets.size(); ++i) {
    EXPECT_EQ(l.param_offsets[i] % kAlignFloats, 0u) << spec.params[i].name;
  }
  EXPECT_EQ(l.param_floats % kAlignFloats, 0u);

  auto seg = Segment::create(spec);
  ASSERT_NE(seg, nullptr);
  const SegmentHeader* h = seg->header();
  EXPECT_EQ(h->total_size, l.total_size);
  EXPECT_EQ(seg->size(), l.total_size);
  EXPECT_EQ(h->num_slots, spec.num_slots);
  EXPECT_EQ(h->num_params, spec.params.size());
  EXPECT_EQ(h->param_floats, l.param_floats);
  EXPECT_EQ(h->coordinator_pid, getpid());
  EXPECT_EQ(h->owner_uid, getuid());
  EXPECT_STREQ(h->model_path, spec.model_path.c_str());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(seg->base()) % kAlign, 0u);

  // Parameter table: offsets aligned, entries inside param_floats and disjoint; each
  // keeps its memory format.
  const ParamEntry* table = seg->paramTable();
  for (size_t i = 0; i < spec.params.size(); ++i) {
    EXPECT_EQ(table[i].memory_format, static_cast<uint32_t>(spec.params[i].memory_format));
  }
  EXPECT_EQ(table[2].memory_format, static_cast<uint32_t>(MemoryFormat::kChannelsLast));
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (uint32_t i = 0; i < h->num_params; ++i) {
    const ParamEntry& e = table[i];
    SCOPED_TRACE(spec.params[i].name);
    EXPECT_STREQ(e.name, spec.params[i].name.c_str());
    EXPECT_EQ(e.offset, l.param_offsets[i]);
    EXPECT_EQ(e.offset % kAlignFloats, 0u);
    EXPECT_LE(e.offset + e.numel, h->param_floats);
    ASSERT_EQ(e.shape.ndim, spec.params[i].shape.size());
    uint64_t numel = 1;
    for (uint32_t d = 0; d < e.shape.ndim; ++d) {
      EXPECT_EQ(e.shape.dims[d], spec.params[i].shape[d]);
      numel *= e.shape.dims[d];
    }
    EXPECT_EQ(e.numel, numel);
    if (e.numel > 0) spans.push_back({e.offset, e.offset + e.numel});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first);

  // Regions: aligned, inside the segment, disjoint from each other and from the header.
  struct Named {
    const char* name;
    Region r;
  };
  std::vector<Named> regions = {
      {"params_table", h->params_table},
      {"params", h->params},
      {"slots", h->slots},
      {"reduced", h->reduced},
      {"req_indices", h->req_indices},
      {"req_inputs", h->req_inputs},
      {"req_targets", h->req_targets},
      {"data_inputs", h->data_inputs},
      {"data_targets", h->data_targets},
      {"device", h->device},
  };
  EXPECT_GE(h->params_table.size, sizeof(ParamEntry) * spec.params.size());
  EXPECT_GE(h->params.size, h->param_floats * sizeof(float));
  EXPECT_EQ(h->slot_stride % kAlign, 0u);
  EXPECT_GE(h->slot_stride, h->param_floats * sizeof(float));
  EXPECT_GE(h->slots.size, h->slot_stride * spec.num_slots);
  EXPECT_GE(h->reduced.size, h->param_floats * sizeof(float));
  EXPECT_GE(h->req_indices.size, static_cast<uint64_t>(spec.max_batch) * 8);
  EXPECT_GE(h->req_inputs.size, spec.input_bytes);
  EXPECT_GE(h->req_targets.size, spec.target_bytes);
  EXPECT_GE(h->data_inputs.size, 10u * 12u * 4u);
  EXPECT_GE(h->data_targets.size, 10u * 8u);
  EXPECT_EQ(h->device.size, kDeviceReserved);
  std::vector<std::pair<uint64_t, uint64_t>> used = {{0, sizeof(SegmentHeader)}};
  for (const auto& n : regions) {
    SCOPED_TRACE(n.name);
    EXPECT_EQ(n.r.offset % kAlign, 0u);
    EXPECT_GE(n.r.offset, sizeof(SegmentHeader));
    EXPECT_LE(n.r.offset + n.r.size, h->total_size);
    if (n.r.size > 0) used.push_back({n.r.offset, n.r.offset + n.r.size});
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i) {
    EXPECT_LE(used[i - 1].second, used[i].first) << "regions overlap at " << used[i].first;
  }
  // Slot pointers step by the stride and stay inside the slots region.
  for (uint32_t i = 0; i < spec.num_slots; ++i) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(seg->slot(i));
    EXPECT_EQ(static_cast<uint64_t>(p - seg->base()), h->slots.offset + i * h->slot_stride);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kAlign, 0u);
  }

  // The file: size == total_size, mode 0600, owned by us.
  struct stat st;
  ASSERT_EQ(::stat(segmentPath(name).c_str(), &st), 0) << segmentPath(name);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), h->total_size);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, getuid());
  EXPECT_TRUE(Segment::exists(name));

  // Another process view of the same segment sees the same bytes.
  auto other = Segment::open(name);
  EXPECT_EQ(other->size(), seg->size());
  seg->params()[0] = 3.5f;
  EXPECT_EQ(other->params()[0], 3.5f);
  other.reset();

  seg.reset();
  EXPECT_TRUE(Segment::remove(name));
  EXPECT_FALSE(Segment::exists(name));
  EXPECT_FALSE(Segment::remove(name));
}

// The workers' numerics (serve --numerics): parsed, stored, written back; hostile values.
TEST(SegmentTest, NumericsAreParsedStoredAndChecked) {
  EXPECT_EQ(parseNumerics("").flags, 0u);  // none set: torch's defaults
  EXPECT_EQ(numericsText(parseNumerics("")), "");
  const Numerics defaults = parseNumerics("matmul_precision=highest");
  EXPECT_EQ(numericsText(defaults),
            "matmul_precision=highest,cudnn_tf32=1,cudnn_benchmark=0,cudnn_deterministic=0");
  const std::string all =
      "matmul_precision=medium,cudnn_tf32=0,cudnn_benchmark=1,cudnn_deterministic=1";
  const Numerics n = parseNumerics(all);
  EXPECT_EQ(numericsText(n), all);
  EXPECT_EQ(n.flags, kNumericsSet | kCudnnBenchmark | kCudnnDeterministic);
  EXPECT_EQ(n.matmul_precision, 2u);
  std::string message;
  for (const char* bad : {"matmul_precision=low", "cudnn_tf32=yes", "tf32=1", "cudnn_tf32"}) {
    SCOPED_TRACE(bad);
    EXPECT_TRUE(throwsKind(
        ErrorKind::kInvalidArgument, [&] { parseNumerics(bad); }, &message));
    EXPECT_NE(message.find("--numerics"), std::string::npos) << message;
  }
  EXPECT_FALSE(numericsValid(Numerics{kNumericsSet | (1u << 7), 0}));
  EXPECT_FALSE(numericsValid(Numerics{kNumericsSet, 3}));
  EXPECT_EQ(numericsText(Numerics{kNumericsSet, 99}), "");  // never a name past the table

  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  SegmentSpec spec = smallSpec(name);
  spec.numerics = n;
  auto seg = Segment::create(spec);
  EXPECT_EQ(numericsText(seg->header()->control.numerics), all);
}

// The loss reduction: names, the value stored, and hostile values read back.
TEST(SegmentTest, LossReductionIsStoredParsedAndReadSafely) {
  for (auto r : {LossReduction::kSum, LossReduction::kMean, LossReduction::kWeighted}) {
    EXPECT_EQ(parseLossReduction(lossReductionName(static_cast<uint32_t>(r))), r);
  }
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kInvalidArgument, [] { parseLossReduction("unknown"); }, &message));
  EXPECT_NE(message.find("use sum, mean or weighted"), std::string::npos) << message;
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [] { parseLossReduction("avg"); }));
  // A value read from shared memory outside the enumeration reads as "unknown".
  EXPECT_STREQ(lossReductionName(4), "unknown");
  EXPECT_STREQ(lossReductionName(0xffffffffu), "unknown");

  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  SegmentSpec spec = smallSpec(name);
  EXPECT_EQ(spec.loss_reduction, LossReduction::kSum);  // named losses are sums
  // An eager job's whose workers are to find it out.
  spec.loss_reduction = LossReduction::kUnknown;
  auto seg = Segment::create(spec);
  EXPECT_EQ(seg->header()->control.loss_reduction.load(),
            static_cast<uint32_t>(LossReduction::kUnknown));
}

// Shared buffers (BatchNorm statistics): laid out aligned in their own region, and a
// header that puts one outside it, or gives it another dtype or size, is corrupt.
TEST(SegmentTest, BuffersAreLaidOutAndCheckedOnAttach) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  SegmentSpec spec = smallSpec(name);
  spec.buffers = {{"bn.running_mean", {7}, DType::kFloat32},
                  {"bn.num_batches_tracked", {}, DType::kInt64}};
  auto seg = Segment::create(spec);
  const BufferEntry* t = seg->bufferTable();
  ASSERT_EQ(seg->header()->num_buffers, 2u);
  EXPECT_STREQ(t[0].name, "bn.running_mean");
  EXPECT_EQ(t[0].nbytes, 7u * 4);
  EXPECT_EQ(t[1].nbytes, 8u);
  EXPECT_EQ(t[1].offset % kAlign, 0u);
  EXPECT_GE(t[1].offset, t[0].offset + t[0].nbytes);
  HeaderCopy copy(*seg);
  seg.reset();
  ASSERT_NO_THROW(copy.validate());
  auto* bt = reinterpret_cast<BufferEntry*>(reinterpret_cast<uint8_t*>(copy.header()) +
                                            copy.header()->buffers_table.offset);
  bt[1].offset = copy.header()->buffers.size;  // past the region
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] { copy.validate(); }));
  copy.reset();
  bt[0].dtype = 7;
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] { copy.validate(); }));
  copy.reset();
  bt[0].nbytes += 4;  // not numel * element size
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] { copy.validate(); }));
  copy.reset();
  copy.header()->num_buffers = kMaxBuffers + 1;
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] { copy.validate(); }));
  // A spec with another dtype is refused before anything is created.
  spec.buffers = {{"mask", {3}, DType::kNone}};
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { Segment::create(spec); }));
}

TEST(SegmentTest, LayoutWithoutDatasetHasEmptyDataRegions) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name, /*with_dataset=*/false));
  EXPECT_EQ(seg->header()->data_count, 0);
  EXPECT_EQ(seg->header()->data_inputs.size, 0u);
  EXPECT_EQ(seg->header()->data_targets.size, 0u);
  EXPECT_NO_THROW(validateHeader(seg->header(), seg->size()));
}

TEST(SegmentTest, ComputeLayoutRejectsBadSpecs) {
  SegmentSpec s = smallSpec("unused");
  s.num_slots = 0;
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { computeLayout(s); }));
  s.num_slots = kMaxWorkers + 1;
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { computeLayout(s); }));
  s = smallSpec("unused");
  s.params.clear();
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { computeLayout(s); }));
  s = smallSpec("unused");
  s.params[0].name = std::string(kNameLen, 'x');
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { computeLayout(s); }));
  s = smallSpec("unused");
  s.params[0].shape = std::vector<int64_t>(kMaxDims + 1, 1);
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { computeLayout(s); }));
  s = smallSpec("unused");
  s.max_batch = 0;
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { computeLayout(s); }));
  s = smallSpec("unused");
  s.params[0].memory_format = MemoryFormat::kChannelsLast;  // a 2-D weight
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { computeLayout(s); }));
}

// ---------------------------------------------------------------------------------
// validateHeader

TEST(ValidateHeaderTest, TargetedCorruptionsAreCorrupt) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  HeaderCopy copy(*seg);
  seg.reset();
  Segment::remove(name);

  ASSERT_NO_THROW(copy.validate());
  const uint64_t size = copy.size();
  ASSERT_EQ(size % kAlign, 0u);
  const uint32_t last = copy.header()->num_params - 1;

  std::vector<std::pair<std::string, std::function<void(SegmentHeader*, ParamEntry*)>>> cases = {
      {"bad magic", [](SegmentHeader* h, ParamEntry*) { h->magic ^= 0x100; }},
      {"magic zero", [](SegmentHeader* h, ParamEntry*) { h->magic = 0; }},
      {"layout_version",
       [](SegmentHeader* h, ParamEntry*) { h->layout_version = kLayoutVersion + 1; }},
      {"header_size", [](SegmentHeader* h, ParamEntry*) { h->header_size -= 64; }},
      {"total_size larger", [](SegmentHeader* h, ParamEntry*) { h->total_size += 64; }},
      {"total_size smaller", [](SegmentHeader* h, ParamEntry*) { h->total_size -= 64; }},
      {"num_slots 0", [](SegmentHeader* h, ParamEntry*) { h->num_slots = 0; }},
      {"num_slots 1000", [](SegmentHeader* h, ParamEntry*) { h->num_slots = 1000; }},
      {"num_slots 65", [](SegmentHeader* h, ParamEntry*) { h->num_slots = kMaxWorkers + 1; }},
      {"num_slots past the slots region",
       [](SegmentHeader* h, ParamEntry*) { h->num_slots = kMaxWorkers; }},
      {"trainer_slots 2", [](SegmentHeader* h, ParamEntry*) { h->trainer_slots = 2; }},
      {"a trainer slot past the slots region",
       [](SegmentHeader* h, ParamEntry*) { h->trainer_slots = 1; }},
      {"num_params 0", [](SegmentHeader* h, ParamEntry*) { h->num_params = 0; }},
      {"num_params huge", [](SegmentHeader* h, ParamEntry*) { h->num_params = 0xffffffffu; }},
      {"num_params past the table", [](SegmentHeader* h, ParamEntry*) { h->num_params += 1; }},
      {"loss 0", [](SegmentHeader* h, ParamEntry*) { h->loss = 0; }},
      {"loss 4", [](SegmentHeader* h, ParamEntry*) { h->loss = 4; }},
      {"max_batch 0", [](SegmentHeader* h, ParamEntry*) { h->max_batch = 0; }},
      {"max_batch negative", [](SegmentHeader* h, ParamEntry*) { h->max_batch = -5; }},
      {"max_batch past req_indices", [](SegmentHeader* h, ParamEntry*) { h->max_batch *= 1000; }},
      {"param_floats misaligned", [](SegmentHeader* h, ParamEntry*) { h->param_floats += 1; }},
      {"param_floats huge",
       [](SegmentHeader* h, ParamEntry*) { h->param_floats = uint64_t{1} << 62; }},
      {"param_floats past params",
       [](SegmentHeader* h, ParamEntry*) { h->param_floats += 1 << 20; }},
      {"model_path unterminated",
       [](SegmentHeader* h, ParamEntry*) { std::memset(h->model_path, 'm', kPathLen); }},
      {"description unterminated",
       [](SegmentHeader* h, ParamEntry*) {
         std::memset(h->data_description, 'd', sizeof(h->data_description));
       }},
      {"region offset beyond end",
       [size](SegmentHeader* h, ParamEntry*) { h->reduced.offset = size + 64 * 10; }},
      {"region offset at uint64 max",
       [](SegmentHeader* h, ParamEntry*) { h->params.offset = ~uint64_t{63}; }},
      {"region offset+size overflows",
       [size](SegmentHeader* h, ParamEntry*) {
         h->device.offset = size - 64;
         h->device.size = std::numeric_limits<uint64_t>::max() - 10;
       }},
      {"table offset+size overflows",
       [](SegmentHeader* h, ParamEntry*) {
         h->params_table.size = std::numeric_limits<uint64_t>::max() - h->params_table.offset + 64;
       }},
      {"region too small", [](SegmentHeader* h, ParamEntry*) { h->params.size = 0; }},
      // Found by fuzzing: status read the whole table past a region that could not hold it.
      {"device table region smaller than the table",
       [](SegmentHeader* h, ParamEntry*) { h->device.size = sizeof(DeviceTable) - 8; }},
      {"region misaligned", [](SegmentHeader* h, ParamEntry*) { h->params.offset += 4; }},
      {"table misaligned", [](SegmentHeader* h, ParamEntry*) { h->params_table.offset += 8; }},
      {"slots misaligned", [](SegmentHeader* h, ParamEntry*) { h->slots.offset += 1; }},
      {"slot_stride small", [](SegmentHeader* h, ParamEntry*) { h->slot_stride = 64; }},
      {"slot_stride misaligned", [](SegmentHeader* h, ParamEntry*) { h->slot_stride += 4; }},
      {"slot_stride huge",
       [](SegmentHeader* h, ParamEntry*) { h->slot_stride = uint64_t{1} << 60; }},
      {"param offset outside param_floats",
       [last](SegmentHeader* h, ParamEntry* t) {
         t[last].offset = h->param_floats + kAlignFloats;
       }},
      {"param offset at param_floats",
       [last](SegmentHeader* h, ParamEntry* t) { t[last].offset = h->param_floats; }},
      {"param offset huge", [](SegmentHeader*, ParamEntry* t) { t[0].offset = ~uint64_t{0} - 15; }},
      {"param offset misaligned", [](SegmentHeader*, ParamEntry* t) { t[1].offset += 1; }},
      {"param numel mismatch", [](SegmentHeader*, ParamEntry* t) { t[0].numel += 1; }},
      {"param name unterminated",
       [last](SegmentHeader*, ParamEntry* t) { std::memset(t[last].name, 'x', kNameLen); }},
      {"param negative dim", [](SegmentHeader*, ParamEntry* t) { t[0].shape.dims[0] = -1; }},
      {"param negative dim, numel kept",
       [](SegmentHeader*, ParamEntry* t) {
         t[0].shape.dims[0] = -t[0].shape.dims[0];
         t[0].shape.dims[1] = -t[0].shape.dims[1];
       }},
      {"param ndim too large",
       [](SegmentHeader*, ParamEntry* t) { t[0].shape.ndim = kMaxDims + 1; }},
      {"param ndim huge", [](SegmentHeader*, ParamEntry* t) { t[0].shape.ndim = 0xffffffffu; }},
      {"param memory format unknown",
       [](SegmentHeader*, ParamEntry* t) { t[2].memory_format = 3; }},
      {"param channels_last for 2 dims",
       [](SegmentHeader*, ParamEntry* t) {
         t[0].memory_format = static_cast<uint32_t>(MemoryFormat::kChannelsLast);
       }},
      {"param channels_last_3d for 4 dims",
       [](SegmentHeader*, ParamEntry* t) {
         t[2].memory_format = static_cast<uint32_t>(MemoryFormat::kChannelsLast3d);
       }},
      {"param shape overflows",
       [](SegmentHeader*, ParamEntry* t) {
         t[0].shape.ndim = kMaxDims;
         for (uint32_t d = 0; d < kMaxDims; ++d) t[0].shape.dims[d] = int64_t{1} << 39;
         t[0].numel = 0;  // the wrapped product of these dims
       }},
      {"data_count huge", [](SegmentHeader* h, ParamEntry*) { h->data_count = int64_t{1} << 50; }},
      {"data_count max",
       [](SegmentHeader* h, ParamEntry*) { h->data_count = std::numeric_limits<int64_t>::max(); }},
      {"data_count negative", [](SegmentHeader* h, ParamEntry*) { h->data_count = -1; }},
      {"data_count past the segment",
       [](SegmentHeader* h, ParamEntry*) { h->data_count = int64_t{1} << 39; }},
      {"data_count past data_inputs",
       [](SegmentHeader* h, ParamEntry*) { h->data_count = h->data_count * 1000; }},
      {"data example shape negative",
       [](SegmentHeader* h, ParamEntry*) { h->data_example_shape.dims[0] = -3; }},
      {"data example ndim", [](SegmentHeader* h, ParamEntry*) { h->data_example_shape.ndim = 9; }},
      {"data target dtype", [](SegmentHeader* h, ParamEntry*) { h->data_target_dtype = 7; }},
      {"data target dtype none", [](SegmentHeader* h, ParamEntry*) { h->data_target_dtype = 0; }},
      {"data example shape huge",
       [](SegmentHeader* h, ParamEntry*) {
         h->data_example_shape.ndim = 2;
         h->data_example_shape.dims[0] = int64_t{1} << 30;
         h->data_example_shape.dims[1] = int64_t{1} << 30;
       }},
  };

  for (auto& [what, corrupt] : cases) {
    SCOPED_TRACE(what);
    copy.reset();
    corrupt(copy.header(), copy.table());
    std::string message;
    EXPECT_TRUE(throwsKind(
        ErrorKind::kCorrupt, [&] { copy.validate(); }, &message));
    EXPECT_FALSE(message.empty());
  }

  // A mapped size too small for a header is rejected before anything is read.
  copy.reset();
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt,
                         [&] { validateHeader(copy.header(), sizeof(SegmentHeader) - 1); }));
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] { validateHeader(copy.header(), 0); }));
  // The untouched copy still validates: the cases above did not share state.
  copy.reset();
  EXPECT_NO_THROW(copy.validate());
}

TEST(ValidateHeaderTest, RandomByteFlipsNeverCrash) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  HeaderCopy copy(*seg);
  const uint64_t table_begin = seg->header()->params_table.offset;
  const uint64_t table_end = table_begin + seg->header()->params_table.size;
  // Identity, region table and dataset description: the fields validation reads.
  const uint64_t fields_end = static_cast<uint64_t>(
      reinterpret_cast<const uint8_t*>(&seg->header()->control) - seg->base());
  seg.reset();
  Segment::remove(name);

  std::mt19937_64 rng(20240501);
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    copy.reset();
    // The first half flips bytes of the header only (every other iteration only of the
    // fields before the control block); the second half also of the parameter table.
    const uint64_t lo = 0;
    const uint64_t hi =
        iter < 2000 ? (iter % 2 == 0 ? sizeof(SegmentHeader) : fields_end) : table_end;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      uint64_t pos = lo + rng() % (hi - lo);
      if (iter >= 2000 && f == 0) pos = table_begin + rng() % (table_end - table_begin);
      uint8_t mask = static_cast<uint8_t>(rng() % 255 + 1);
      copy.data()[pos] ^= mask;
    }
    try {
      copy.validate();
      ++accepted;
    } catch (const Error& e) {
      ASSERT_EQ(e.kind(), ErrorKind::kCorrupt) << "iteration " << iter << ": " << e.what();
      ++rejected;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iter << ": non-shmgrad exception " << e.what();
    }
  }
  // Both outcomes happen: flips in control words and padding are harmless, flips in
  // identity and layout fields are not.
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
  std::printf("random flips: %d accepted, %d rejected\n", accepted, rejected);
}

// ---------------------------------------------------------------------------------
// Lifecycle errors

TEST(SegmentTest, OpenMissingIsNotFound) {
  const std::string name = uniqueEngineName();
  ASSERT_FALSE(Segment::exists(name));
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kNotFound, [&] { Segment::open(name); }, &message));
  EXPECT_NE(message.find(name), std::string::npos) << message;
}

TEST(SegmentTest, EngineNamesAreChecked) {
  for (const std::string& bad :
       {std::string(""), std::string("a/b"), std::string("../x"), std::string(65, 'a'),
        std::string("a b"), std::string("x\n"), std::string("na\0me", 5), std::string("/abs")}) {
    SCOPED_TRACE("name '" + bad + "'");
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { checkEngineName(bad); }));
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { Segment::open(bad); }));
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { Segment::exists(bad); }));
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { Segment::remove(bad); }));
    SegmentSpec s = smallSpec(bad);
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { Segment::create(s); }));
  }
  for (const std::string& good :
       {std::string("a"), std::string(64, 'z'), std::string("my-engine_1.2"), std::string("..")}) {
    EXPECT_NO_THROW(checkEngineName(good)) << good;
  }
}

TEST(SegmentTest, LiveSegmentIsBusyAndStaleSegmentIsReplaced) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  SegmentSpec spec = smallSpec(name);
  auto first = Segment::create(spec);
  ASSERT_EQ(first->header()->coordinator_pid, getpid());

  // Held by a live coordinator (this process): busy, naming the pid, segment kept.
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kBusy, [&] { Segment::create(spec); }, &message));
  EXPECT_NE(message.find(std::to_string(getpid())), std::string::npos) << message;
  EXPECT_TRUE(Segment::exists(name));
  first->params()[0] = 7.0f;
  {
    auto again = Segment::open(name);
    EXPECT_EQ(again->params()[0], 7.0f) << "the live segment must not have been replaced";
  }

  // The coordinator died: its lock on the segment went with it (simulated by
  // destroying the creating Segment, which holds the lock), so the segment is stale
  // and create replaces it.
  const pid_t dead = deadPid();
  ASSERT_FALSE(processAlive(dead));
  first->header()->coordinator_pid = dead;
  std::unique_ptr<Segment> observer = Segment::open(name);  // holds no lock
  first.reset();
  first = std::move(observer);
  std::unique_ptr<Segment> second;
  ASSERT_NO_THROW(second = Segment::create(spec));
  EXPECT_EQ(second->header()->coordinator_pid, getpid());
  EXPECT_EQ(second->params()[0], 0.0f) << "a fresh segment starts zeroed";
  // The old mapping stays valid but is no longer the named segment.
  EXPECT_EQ(first->params()[0], 7.0f);
  {
    auto now = Segment::open(name);
    EXPECT_EQ(now->header()->coordinator_pid, getpid());
    EXPECT_EQ(now->params()[0], 0.0f);
  }

  // A segment with a corrupt header counts as stale too.
  second->header()->magic = 0;
  second.reset();  // and its coordinator is gone
  std::unique_ptr<Segment> third;
  ASSERT_NO_THROW(third = Segment::create(spec));
  EXPECT_EQ(third->header()->magic, kMagic);
}

// What another user can plant under an engine's name in /dev/shm (mode 1777): a
// symbolic link, a FIFO, a file of theirs. Attach (open) and serve (create, which removes
// a stale segment first) refuse each one with kBusy naming the path, without following,
// opening or removing it.
class PlantedEntry {
 public:
  explicit PlantedEntry(std::string path) : path_(std::move(path)) {}
  ~PlantedEntry() { ::unlink(path_.c_str()); }
  PlantedEntry(const PlantedEntry&) = delete;
  PlantedEntry& operator=(const PlantedEntry&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void expectRefusedAndKept(const std::string& name, const std::string& path, const char* kind) {
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kBusy, [&] { Segment::open(name); }, &message));
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find(kind), std::string::npos) << message;
  SegmentSpec spec = smallSpec(name);
  EXPECT_TRUE(throwsKind(
      ErrorKind::kBusy, [&] { Segment::create(spec); }, &message));
  EXPECT_NE(message.find(kind), std::string::npos) << message;
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << "the planted entry must not be removed";
  EXPECT_TRUE(Segment::exists(name));
}

TEST(SegmentTest, PlantedSymlinkIsRefusedNotFollowed) {
  const std::string name = uniqueEngineName();
  // The link points at a file of ours that looks like a segment (this uid's, 0600):
  // following it would attach to (or, at serve, remove) that file.
  const std::string target = segmentPath(name) + "-target";
  PlantedEntry target_guard(target);
  {
    auto seg = Segment::create(smallSpec(name));
    ASSERT_EQ(::link(segmentPath(name).c_str(), target.c_str()), 0) << std::strerror(errno);
  }  // the creator has gone: the target is a stale segment, unlocked
  ASSERT_TRUE(Segment::remove(name));
  PlantedEntry link(segmentPath(name));
  ASSERT_EQ(::symlink(target.c_str(), link.path().c_str()), 0) << std::strerror(errno);
  expectRefusedAndKept(name, link.path(), "a symbolic link");
  struct stat st;
  EXPECT_EQ(::stat(target.c_str(), &st), 0) << "the link's target must not be removed";
}

TEST(SegmentTest, PlantedFifoIsRefusedWithoutBlocking) {
  const std::string name = uniqueEngineName();
  PlantedEntry fifo(segmentPath(name));
  ASSERT_EQ(::mkfifo(fifo.path().c_str(), 0666), 0) << std::strerror(errno);
  // An open(O_RDONLY) of a FIFO waits for a writer: the check comes before any open.
  const auto t0 = std::chrono::steady_clock::now();
  expectRefusedAndKept(name, fifo.path(), "a FIFO");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(SegmentTest, AnotherUsersFileUnderTheNameIsRefusedAndKept) {
  if (getuid() != 0) GTEST_SKIP() << "needs root to give a file to another uid";
  const std::string name = uniqueEngineName();
  PlantedEntry planted(segmentPath(name));
  {
    // A well-formed segment, then handed to uid 65534 (nobody) with a mode that lets us
    // read and write it: only the owner check stands between it and an attach.
    auto seg = Segment::create(smallSpec(name));
    ASSERT_EQ(::chown(planted.path().c_str(), 65534, 65534), 0) << std::strerror(errno);
    ASSERT_EQ(::chmod(planted.path().c_str(), 0666), 0) << std::strerror(errno);
  }
  expectRefusedAndKept(name, planted.path(), "owned by uid 65534");
}

TEST(SegmentTest, ProcessAlive) {
  EXPECT_TRUE(processAlive(getpid()));
  EXPECT_FALSE(processAlive(0));
  EXPECT_FALSE(processAlive(-1));
  EXPECT_FALSE(processAlive(deadPid()));
}

TEST(SegmentTest, TooLargeForDevShmIsNoSpace) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  SegmentSpec spec = smallSpec(name);
  const uint64_t free_bytes = shmFreeBytes();
  ASSERT_GT(free_bytes, 0u) << "statvfs /dev/shm failed";
  spec.input_bytes = free_bytes + (1ull << 30);
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kNoSpace, [&] { Segment::create(spec); }, &message));
  EXPECT_NE(message.find("/dev/shm"), std::string::npos) << message;
  EXPECT_FALSE(Segment::exists(name));
  struct stat st;
  EXPECT_NE(::stat(segmentPath(name).c_str(), &st), 0) << "segment file left behind";
}

// Regression tests for two defects found in review and fixed in ipc/segment.cc.

// Segment::create checks data shapes, negative dims and max_batch only after the file
// exists (fillShape, the final validateHeader) and leaves the file behind on that throw.
TEST(SegmentTest, FailedCreateLeavesNoFileAndIsInvalidArgument) {
  std::vector<std::pair<std::string, std::function<void(SegmentSpec*)>>> cases = {
      {"9-dim dataset example shape",
       [](SegmentSpec* s) { s->data_example_shape = std::vector<int64_t>(kMaxDims + 1, 1); }},
      {"negative parameter dim",
       [](SegmentSpec* s) {
         s->params[0].shape = {-1, 5};
       }},
      {"negative dataset dim",
       [](SegmentSpec* s) {
         s->data_example_shape = {-2, 4};
       }},
      {"max_batch 2^61", [](SegmentSpec* s) { s->max_batch = int64_t{1} << 61; }},
  };
  for (auto& [what, mutate] : cases) {
    SCOPED_TRACE(what);
    const std::string name = uniqueEngineName();
    SegmentGuard guard(name);
    SegmentSpec spec = smallSpec(name);
    mutate(&spec);
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { Segment::create(spec); }));
    EXPECT_FALSE(Segment::exists(name)) << "segment file left in /dev/shm";
  }
}

// validateHeader checks each region against the segment size but not against the
// header or the other regions: workers would write gradients over the control block.
TEST(ValidateHeaderTest, RegionsOverlappingHeaderOrEachOtherAreCorrupt) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  HeaderCopy copy(*seg);
  seg.reset();
  copy.header()->slots.offset = 0;
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] { copy.validate(); }));
  copy.reset();
  copy.header()->reduced = copy.header()->params;
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] { copy.validate(); }));
}

// ---------------------------------------------------------------------------------
// futex

// An anonymous shared mapping survives fork: parent and child share the word.
class SharedWord {
 public:
  SharedWord() {
    mem_ = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem_ == MAP_FAILED) throw std::runtime_error("mmap failed");
    word_ = new (mem_) std::atomic<uint32_t>(0);
  }
  ~SharedWord() { ::munmap(mem_, 4096); }
  std::atomic<uint32_t>* get() { return word_; }

 private:
  void* mem_;
  std::atomic<uint32_t>* word_;
};

TEST(FutexTest, ChildWakesWhenParentSets) {
  SharedWord w;
  std::atomic<uint32_t>* word = w.get();
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Child: wait up to 10 s for the parent's store; the slice is long, so only a real
    // wake (or the value having changed before the sleep) ends it quickly.
    const uint64_t start = monotonicNs();
    bool ok = waitUntil(
        word, [&] { return word->load(std::memory_order_acquire) == 1; }, [] { return true; },
        start + 10'000'000'000ull, std::chrono::seconds(5));
    const uint64_t waited = monotonicNs() - start;
    word->store(ok ? 2 : 3);
    _exit(ok && waited < 5'000'000'000ull ? 0 : 1);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  word->store(1, std::memory_order_release);
  futexWake(word);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(word->load(), 2u);
}

TEST(FutexTest, WaitUntilTimesOutWithoutWake) {
  SharedWord w;
  std::atomic<uint32_t>* word = w.get();
  for (auto timeout : {std::chrono::milliseconds(200), std::chrono::milliseconds(500)}) {
    const uint64_t t_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
    const uint64_t start = monotonicNs();
    int polls = 0;
    bool ok = waitUntil(
        word, [&] { return word->load() == 1; },
        [&] {
          ++polls;
          return true;
        },
        start + t_ns, std::chrono::milliseconds(20));
    const uint64_t took = monotonicNs() - start;
    EXPECT_FALSE(ok);
    EXPECT_GE(took, t_ns);
    EXPECT_LT(took, 2 * t_ns) << "waitUntil overslept its deadline";
    EXPECT_GE(polls, 1);
  }
  // poll() returning false ends the wait early.
  const uint64_t start = monotonicNs();
  bool ok = waitUntil(
      word, [] { return false; }, [] { return false; }, start + 5'000'000'000ull);
  EXPECT_FALSE(ok);
  EXPECT_LT(monotonicNs() - start, 1'000'000'000ull);
  // A deadline already passed returns at once; a true predicate returns true at once.
  EXPECT_FALSE(waitUntil(
      word, [] { return false; }, [] { return true; }, monotonicNs()));
  EXPECT_TRUE(waitUntil(
      word, [] { return true; }, [] { return true; }, 0));
}

TEST(FutexTest, FutexWaitReturnsOnValueMismatchAndTimeout) {
  SharedWord w;
  std::atomic<uint32_t>* word = w.get();
  word->store(5);
  const uint64_t start = monotonicNs();
  // Value differs from expected: returns at once (true: re-check).
  EXPECT_TRUE(futexWait(word, 4, std::chrono::seconds(5)));
  EXPECT_LT(monotonicNs() - start, 1'000'000'000ull);
  // Value matches and nobody wakes: times out.
  const uint64_t t0 = monotonicNs();
  EXPECT_FALSE(futexWait(word, 5, std::chrono::milliseconds(50)));
  const uint64_t took = monotonicNs() - t0;
  EXPECT_GE(took, 40'000'000ull);
  EXPECT_LT(took, 1'000'000'000ull);
  EXPECT_FALSE(futexWait(word, 5, std::chrono::nanoseconds(0)));
}

// ---------------------------------------------------------------------------------
// The device table (GPU engines): layout, placement and validation against hostile values

TEST(DeviceTableTest, LayoutIsAlignedOrderedAndSized) {
  const DeviceLayout l = layoutDevice(1000, 300, 3, true);
  for (uint64_t off : {l.params, l.buffers, l.slots, l.slot_stride, l.reduced, l.accum}) {
    EXPECT_EQ(off % kDeviceAlign, 0u);
  }
  EXPECT_GE(l.buffers, l.params + 1000 * 4);
  EXPECT_GE(l.slots, l.buffers + 300);
  EXPECT_GE(l.slot_stride, 1000u * 4);
  EXPECT_EQ(l.reduced, l.slots + 3 * l.slot_stride);
  EXPECT_GE(l.accum, l.reduced + 1000 * 4);
  EXPECT_GE(l.bytes, l.accum + 1000 * 4);
  // Devices after the first hold no reduced or accumulation buffer: the same regions
  // before them, and nothing after the slots.
  const DeviceLayout other = layoutDevice(1000, 300, 3, false);
  EXPECT_EQ(other.params, l.params);
  EXPECT_EQ(other.slots, l.slots);
  EXPECT_EQ(other.slot_stride, l.slot_stride);
  EXPECT_EQ(other.reduced, 0u);
  EXPECT_EQ(other.accum, 0u);
  EXPECT_EQ(other.bytes, l.reduced);
  EXPECT_EQ(layoutDevice(0, 0, 0, false).bytes, kDeviceAlign);
  EXPECT_TRUE(
      throwsKind(ErrorKind::kInvalidArgument, [] { layoutDevice(1, 0, kMaxWorkers + 1, true); }));
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument,
                         [] { layoutDevice(kMaxParamFloats + 1, 0, 1, true); }));
}

TEST(DeviceTableTest, RoundRobinPlacesSeveralWorkersPerDevice) {
  const Placement p = placeRoundRobin(5, 2);
  EXPECT_EQ(p.device, (std::vector<int>{0, 1, 0, 1, 0}));
  EXPECT_EQ(p.local, (std::vector<int>{0, 0, 1, 1, 2}));
  EXPECT_EQ(p.slots_per_device, (std::vector<uint32_t>{3, 2}));
  const Placement one = placeRoundRobin(4, 1);
  EXPECT_EQ(one.local, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [] { placeRoundRobin(2, 0); }));
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [] { placeRoundRobin(2, kMaxDevices + 1); }));
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [] { placeRoundRobin(kMaxWorkers + 1, 2); }));
}

TEST(DeviceTableTest, HostileTablesAreCorruptNeverUsed) {
  auto table = std::make_unique<DeviceTable>();
  std::memset(static_cast<void*>(table.get()), 0, sizeof(DeviceTable));
  const uint64_t floats = 1000, buffer_bytes = 64;
  const uint32_t slots = 5;
  initDeviceTable(table.get(), {3, 1}, slots, floats, buffer_bytes);
  EXPECT_EQ(table->count, 2u);
  EXPECT_EQ(table->devices[0].ordinal, 3);
  EXPECT_EQ(table->devices[0].slots, 3u);
  EXPECT_EQ(table->devices[1].slots, 2u);
  ASSERT_NO_THROW(validateDeviceTable(*table, slots, floats, buffer_bytes, 4));
  // The same device twice is the caller's mistake, named.
  auto other = std::make_unique<DeviceTable>();
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kInvalidArgument,
      [&] {
        initDeviceTable(other.get(), {0, 0}, 2, 8, 0);
      },
      &message));
  EXPECT_NE(message.find("listed twice"), std::string::npos) << message;

  const std::vector<uint8_t> pristine(
      reinterpret_cast<const uint8_t*>(table.get()),
      reinterpret_cast<const uint8_t*>(table.get()) + sizeof(DeviceTable));
  auto hostile = [&](const char* what, const std::function<void(DeviceTable&)>& edit) {
    std::memcpy(static_cast<void*>(table.get()), pristine.data(), sizeof(DeviceTable));
    edit(*table);
    std::string msg;
    EXPECT_TRUE(throwsKind(
        ErrorKind::kCorrupt, [&] { validateDeviceTable(*table, slots, floats, buffer_bytes, 4); },
        &msg))
        << what;
    EXPECT_NE(msg.find("device table"), std::string::npos) << what << ": " << msg;
  };
  hostile("too many devices", [](DeviceTable& t) { t.count = kMaxDevices + 1; });
  hostile("slot on a device past count", [](DeviceTable& t) { t.slot_device[4] = 2; });
  hostile("slot on no device", [](DeviceTable& t) { t.slot_device[0] = kNoDevice; });
  hostile("local slot past the device's", [](DeviceTable& t) { t.slot_local[1] = 2; });
  hostile("two workers, one slot", [](DeviceTable& t) { t.slot_local[2] = 0; });
  hostile("negative ordinal", [](DeviceTable& t) { t.devices[1].ordinal = -3; });
  hostile("ordinal not visible", [](DeviceTable& t) { t.devices[0].ordinal = 4; });
  hostile("ordinal twice", [](DeviceTable& t) { t.devices[1].ordinal = 3; });
  hostile("more workers than slots", [](DeviceTable& t) { t.devices[1].slots = 1; });
  hostile("slots past the limit", [](DeviceTable& t) { t.devices[0].slots = kMaxWorkers + 1; });
  hostile("unknown state", [](DeviceTable& t) { t.devices[0].state.store(7); });
  hostile("allocation too small", [](DeviceTable& t) { t.devices[0].layout.bytes -= 256; });
  hostile("reduced moved", [](DeviceTable& t) { t.devices[1].layout.reduced += 256; });
  hostile("stride shrunk", [](DeviceTable& t) { t.devices[0].layout.slot_stride = 256; });
  // Sizes that no layout can have, from a hostile segment header.
  std::memcpy(static_cast<void*>(table.get()), pristine.data(), sizeof(DeviceTable));
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] {
    validateDeviceTable(*table, slots, kMaxParamFloats + 1, buffer_bytes, -1);
  }));
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [&] {
    validateDeviceTable(*table, kMaxWorkers + 1, floats, buffer_bytes, -1);
  }));
}

// The segment's device region holds the table: all zeros for a CPU engine, and every
// process that attaches checks a GPU engine's in full.
TEST(DeviceTableTest, SegmentsCheckTheirDeviceTableOnAttach) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  HeaderCopy copy(*seg);
  const SegmentHeader* h = copy.header();
  ASSERT_GE(h->device.size, sizeof(DeviceTable));
  auto* table = reinterpret_cast<DeviceTable*>(copy.data() + h->device.offset);
  EXPECT_EQ(table->count, 0u);
  ASSERT_NO_THROW(copy.validate());
  initDeviceTable(table, {0}, h->num_slots, h->param_floats, h->buffers.size);
  ASSERT_NO_THROW(copy.validate());
  table->slot_local[0] = 200;
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kCorrupt, [&] { copy.validate(); }, &message));
  EXPECT_NE(message.find("device table"), std::string::npos) << message;
}

TEST(SegmentTest, TheTrainersSlotFollowsTheWorkersAndIsHostOnly) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  SegmentSpec spec = smallSpec(name);
  spec.trainer_slot = true;
  auto seg = Segment::create(spec);
  const SegmentHeader* h = seg->header();
  EXPECT_EQ(h->trainer_slots, 1u);
  EXPECT_EQ(allSlots(*h), spec.num_slots + 1);
  EXPECT_EQ(trainerSlot(*h), spec.num_slots);
  EXPECT_GE(h->slots.size, h->slot_stride * (spec.num_slots + 1));
  const uint8_t* p = reinterpret_cast<const uint8_t*>(seg->slot(trainerSlot(*h)));
  EXPECT_EQ(static_cast<uint64_t>(p - seg->base()),
            h->slots.offset + spec.num_slots * h->slot_stride);
  HeaderCopy copy(*seg);
  ASSERT_NO_THROW(copy.validate());
  // A trainer slot beside devices: refused (the trainer computes on the host only).
  auto* table = reinterpret_cast<DeviceTable*>(copy.data() + copy.header()->device.offset);
  initDeviceTable(table, {0}, copy.header()->num_slots, copy.header()->param_floats,
                  copy.header()->buffers.size);
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kCorrupt, [&] { copy.validate(); }, &message));
  EXPECT_NE(message.find("trainer slot"), std::string::npos) << message;
  // No room for it beside kMaxWorkers workers.
  spec.num_slots = kMaxWorkers;
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { computeLayout(spec); }));
}

}  // namespace
}  // namespace shmgrad::ipc
