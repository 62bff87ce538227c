// libshmgrad_cuda.so, loaded as shmgrad loads it (dlopen): its interface and error codes
// everywhere; device memory, the step's operations and IPC handles where a device is.
// The same tests run against tests/fake_cuda.cc (gpu_fake_test), the interface on host
// memory, so that every semantic checked here runs on machines without a GPU too.
// Usage: gpu_test PATH/libshmgrad_cuda.so [MEMORY_KIND] [gtest flags]
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/cuda_ops.h"
#include "ipc/reduce.h"

namespace {

const char* g_library = nullptr;
int g_memory_kind = -1;  // the kind the library must report; -1: not given

// The library's functions, resolved by name as the engine resolves them.
struct Cuda {
  void* handle = nullptr;
  decltype(&shmgrad_cuda_api_version) api_version;
  decltype(&shmgrad_cuda_runtime_version) runtime_version;
  decltype(&shmgrad_cuda_driver_version) driver_version;
  decltype(&shmgrad_cuda_error_name) error_name;
  decltype(&shmgrad_cuda_error_string) error_string;
  decltype(&shmgrad_cuda_device_count) device_count;
  decltype(&shmgrad_cuda_device_info) device_info;
  decltype(&shmgrad_cuda_alloc) alloc;
  decltype(&shmgrad_cuda_free) free;
  decltype(&shmgrad_cuda_ipc_handle) ipc_handle;
  decltype(&shmgrad_cuda_ipc_open) ipc_open;
  decltype(&shmgrad_cuda_ipc_close) ipc_close;
  decltype(&shmgrad_cuda_copy_to_device) copy_to_device;
  decltype(&shmgrad_cuda_copy_to_host) copy_to_host;
  decltype(&shmgrad_cuda_memory_kind) memory_kind;
  decltype(&shmgrad_cuda_zero) zero;
  decltype(&shmgrad_cuda_synchronize) synchronize;
  decltype(&shmgrad_cuda_can_access_peer) can_access_peer;
  decltype(&shmgrad_cuda_copy) copy;
  decltype(&shmgrad_cuda_reduce) reduce;
  decltype(&shmgrad_cuda_any_nonfinite) any_nonfinite;
  decltype(&shmgrad_cuda_device_uuid) device_uuid;
  decltype(&shmgrad_cuda_error_is_sticky) error_is_sticky;
  decltype(&shmgrad_cuda_host_register) host_register;
  decltype(&shmgrad_cuda_host_unregister) host_unregister;
};

template <typename F>
void bind(void* h, const char* name, F* f) {
  *f = reinterpret_cast<F>(dlsym(h, name));
  ASSERT_NE(*f, nullptr) << name << " missing from " << g_library;
}

void load(Cuda* c) {
  ASSERT_NE(g_library, nullptr) << "usage: gpu_test PATH/libshmgrad_cuda.so";
  c->handle = dlopen(g_library, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(c->handle, nullptr) << dlerror();
  bind(c->handle, "shmgrad_cuda_api_version", &c->api_version);
  bind(c->handle, "shmgrad_cuda_runtime_version", &c->runtime_version);
  bind(c->handle, "shmgrad_cuda_driver_version", &c->driver_version);
  bind(c->handle, "shmgrad_cuda_error_name", &c->error_name);
  bind(c->handle, "shmgrad_cuda_error_string", &c->error_string);
  bind(c->handle, "shmgrad_cuda_device_count", &c->device_count);
  bind(c->handle, "shmgrad_cuda_device_info", &c->device_info);
  bind(c->handle, "shmgrad_cuda_alloc", &c->alloc);
  bind(c->handle, "shmgrad_cuda_free", &c->free);
  bind(c->handle, "shmgrad_cuda_ipc_handle", &c->ipc_handle);
  bind(c->handle, "shmgrad_cuda_ipc_open", &c->ipc_open);
  bind(c->handle, "shmgrad_cuda_ipc_close", &c->ipc_close);
  bind(c->handle, "shmgrad_cuda_copy_to_device", &c->copy_to_device);
  bind(c->handle, "shmgrad_cuda_copy_to_host", &c->copy_to_host);
  bind(c->handle, "shmgrad_cuda_memory_kind", &c->memory_kind);
  bind(c->handle, "shmgrad_cuda_zero", &c->zero);
  bind(c->handle, "shmgrad_cuda_synchronize", &c->synchronize);
  bind(c->handle, "shmgrad_cuda_can_access_peer", &c->can_access_peer);
  bind(c->handle, "shmgrad_cuda_copy", &c->copy);
  bind(c->handle, "shmgrad_cuda_reduce", &c->reduce);
  bind(c->handle, "shmgrad_cuda_any_nonfinite", &c->any_nonfinite);
  bind(c->handle, "shmgrad_cuda_device_uuid", &c->device_uuid);
  bind(c->handle, "shmgrad_cuda_error_is_sticky", &c->error_is_sticky);
  bind(c->handle, "shmgrad_cuda_host_register", &c->host_register);
  bind(c->handle, "shmgrad_cuda_host_unregister", &c->host_unregister);
}

constexpr int kCudaErrorInvalidValue = 1;
constexpr int kCudaErrorInsufficientDriver = 35;
constexpr int kCudaErrorNoDevice = 100;
constexpr int kCudaErrorInvalidDevice = 101;
constexpr int kCudaErrorPeerAccessUnsupported = 217;
constexpr int kHostMemory = 1;  // shmgrad_cuda_memory_kind of the test double

// Sets an environment variable for a scope, restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// Device memory holding `values`, freed at the end of the scope.
class DeviceFloats {
 public:
  DeviceFloats(const Cuda& c, int device, const std::vector<float>& values)
      : c_(c), device_(device) {
    EXPECT_EQ(c.alloc(device, values.size() * 4, &ptr_), 0);
    if (ptr_ != 0) {
      EXPECT_EQ(c.copy_to_device(device, ptr_, values.data(), values.size() * 4), 0);
    }
    n_ = values.size();
  }
  ~DeviceFloats() {
    if (ptr_ != 0) {
      EXPECT_EQ(c_.free(device_, ptr_), 0);
    }
  }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;

  uint64_t ptr() const { return ptr_; }
  std::vector<float> read() const {
    std::vector<float> v(n_);
    EXPECT_EQ(c_.copy_to_host(device_, v.data(), ptr_, n_ * 4), 0);
    return v;
  }

 private:
  const Cuda& c_;
  int device_;
  uint64_t ptr_ = 0;
  size_t n_ = 0;
};

std::vector<float> normals(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Skips (with the reason printed) where no device can be used.
#define REQUIRE_DEVICE(c)                                                   \
  do {                                                                      \
    int n = 0;                                                              \
    const int rc = (c).device_count(&n);                                    \
    if (rc != 0 || n == 0) {                                                \
      GTEST_SKIP() << "no CUDA device here: " << (c).error_name(rc) << " (" \
                   << (c).error_string(rc) << ")";                          \
    }                                                                       \
  } while (0)

// Skips (with the reason printed) where fewer than `need` devices are visible.
#define REQUIRE_DEVICES(c, need)                                                             \
  do {                                                                                       \
    REQUIRE_DEVICE(c);                                                                       \
    int n = 0;                                                                               \
    ASSERT_EQ((c).device_count(&n), 0);                                                      \
    if (n < (need)) GTEST_SKIP() << n << " CUDA device(s) here: this test needs " << (need); \
  } while (0)

TEST(CudaLibraryTest, LoadsWithItsInterfaceEverywhere) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  EXPECT_EQ(c.api_version(), SHMGRAD_CUDA_API_VERSION);
  EXPECT_GE(c.runtime_version(), 12000);
  EXPECT_STREQ(c.error_name(kCudaErrorNoDevice), "cudaErrorNoDevice");
}

TEST(CudaLibraryTest, NoDriverOrDeviceIsAnErrorCodeNotACrash) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  // The test double shows "no device" when told to (FAKE_CUDA_DEVICES=0).
  ScopedEnv no_fake_devices("FAKE_CUDA_DEVICES", "0");
  int n = -1;
  const int rc = c.device_count(&n);
  if (rc == 0 && n > 0) GTEST_SKIP() << n << " CUDA device(s) here: the no-device path is not";
  EXPECT_TRUE(rc == kCudaErrorInsufficientDriver || rc == kCudaErrorNoDevice)
      << c.error_name(rc) << ": " << c.error_string(rc);
  EXPECT_EQ(n, 0);
  if (rc == kCudaErrorInsufficientDriver) {
    EXPECT_EQ(c.driver_version(), 0);
  }
  uint64_t p = 1;
  EXPECT_NE(c.alloc(0, 1024, &p), 0);
  EXPECT_EQ(p, 0u);
  char name[64];
  int major = 0, minor = 0;
  EXPECT_NE(c.device_info(0, name, sizeof name, &major, &minor), 0);
  // The step's operations, with valid arguments: an error code each.
  const uint64_t fake = 4096, ins[2] = {8192, 12288};
  EXPECT_NE(c.zero(0, fake, 16), 0);
  EXPECT_NE(c.synchronize(0), 0);
  EXPECT_NE(c.copy(0, fake, ins[0], 16), 0);
  int can = -1;
  EXPECT_NE(c.can_access_peer(0, 0, &can), 0);
  EXPECT_EQ(can, 0);
  EXPECT_NE(c.reduce(0, fake, 0, ins, 2, 0, 4, 0.0f, 1.0f), 0);
  int found = -1;
  EXPECT_NE(c.any_nonfinite(0, fake, 0, 4, &found), 0);
  EXPECT_EQ(found, 0);
}

TEST(CudaLibraryTest, MemoryKindSaysWhereAllocationsLive) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  const int kind = c.memory_kind();
  EXPECT_TRUE(kind == 0 || kind == kHostMemory) << kind;
  if (g_memory_kind >= 0) {
    EXPECT_EQ(kind, g_memory_kind);
  }
  if (kind != kHostMemory) return;  // device memory: nothing this process can read directly
  REQUIRE_DEVICE(c);
  DeviceFloats d(c, 0, {1.0f, 2.0f});
  auto* p = reinterpret_cast<float*>(static_cast<uintptr_t>(d.ptr()));
  EXPECT_EQ(p[1], 2.0f);  // host memory: addressable here
  p[0] = -3.0f;
  EXPECT_EQ(d.read()[0], -3.0f);
}

// Argument errors are cudaErrorInvalidValue, found before any device work (no device here
// either), with pointers that are never dereferenced.
TEST(CudaLibraryTest, ArgumentsAreCheckedBeforeAnyDeviceWork) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  const uint64_t out = 256, prev = 512;
  const uint64_t ins[SHMGRAD_MAX_REDUCE_INPUTS + 1] = {1024, 2048};
  const uint64_t with_null[2] = {1024, 0};
  // end before begin; a != 0 without prev; no output; inputs missing, too many or null.
  EXPECT_EQ(c.reduce(0, out, 0, ins, 2, 8, 4, 0.0f, 1.0f), kCudaErrorInvalidValue);
  EXPECT_EQ(c.reduce(0, out, 0, ins, 2, 0, 4, 0.5f, 1.0f), kCudaErrorInvalidValue);
  EXPECT_EQ(c.reduce(0, 0, prev, ins, 2, 0, 4, 0.0f, 1.0f), kCudaErrorInvalidValue);
  EXPECT_EQ(c.reduce(0, out, 0, nullptr, 2, 0, 4, 0.0f, 1.0f), kCudaErrorInvalidValue);
  EXPECT_EQ(c.reduce(0, out, 0, ins, SHMGRAD_MAX_REDUCE_INPUTS + 1, 0, 4, 0.0f, 1.0f),
            kCudaErrorInvalidValue);
  EXPECT_EQ(c.reduce(0, out, 0, with_null, 2, 0, 4, 0.0f, 1.0f), kCudaErrorInvalidValue);
  // any_nonfinite: no result pointer, end before begin, no memory; *found cleared.
  int found = -1;
  EXPECT_EQ(c.any_nonfinite(0, out, 0, 4, nullptr), kCudaErrorInvalidValue);
  EXPECT_EQ(c.any_nonfinite(0, out, 8, 4, &found), kCudaErrorInvalidValue);
  EXPECT_EQ(found, 0);
  found = -1;
  EXPECT_EQ(c.any_nonfinite(0, 0, 0, 4, &found), kCudaErrorInvalidValue);
  EXPECT_EQ(found, 0);
  // No memory to zero or to copy.
  EXPECT_EQ(c.zero(0, 0, 16), kCudaErrorInvalidValue);
  EXPECT_EQ(c.copy(0, 0, prev, 16), kCudaErrorInvalidValue);
  EXPECT_EQ(c.copy(0, out, 0, 16), kCudaErrorInvalidValue);
  EXPECT_EQ(c.can_access_peer(0, 0, nullptr), kCudaErrorInvalidValue);
}

// The reduction against the same sum on the host, bitwise: the inputs added in list order
// in float32, with a and b powers of two (their products are exact, so a fused multiply-add
// on the device rounds as the host's two roundings do).
TEST(CudaLibraryTest, ReduceSumsSliceBySliceInListOrder) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICE(c);
  const uint64_t n = 100003;
  const std::vector<float> h0 = normals(n, 1), h1 = normals(n, 2), h2 = normals(n, 3),
                           hprev = normals(n, 4);
  DeviceFloats s0(c, 0, h0), s1(c, 0, h1), s2(c, 0, h2), prev(c, 0, hprev),
      out(c, 0, std::vector<float>(n, 7.0f));
  const uint64_t ins[3] = {s0.ptr(), s1.ptr(), s2.ptr()};
  // Two slices, as two workers would reduce them; an empty one changes nothing.
  const uint64_t mid = n / 2 / 64 * 64;
  ASSERT_EQ(c.reduce(0, out.ptr(), 0, ins, 3, 0, mid, 0.0f, 0.5f), 0);
  ASSERT_EQ(c.reduce(0, out.ptr(), 0, ins, 3, mid, n, 0.0f, 0.5f), 0);
  ASSERT_EQ(c.reduce(0, out.ptr(), 0, ins, 3, mid, mid, 0.0f, 0.0f), 0);
  std::vector<float> got = out.read();
  uint64_t order_matters = 0;  // elements where another order gives another float
  for (uint64_t i = 0; i < n; ++i) {
    const float sum = (h0[i] + h1[i]) + h2[i];
    ASSERT_EQ(got[i], 0.5f * sum) << "element " << i;
    order_matters += (h2[i] + h1[i]) + h0[i] != sum;
  }
  EXPECT_GT(order_matters, n / 100) << "the inputs do not tell one order from another";
  // Accumulating in place: out == prev, a = 0.25, b = 2.
  ASSERT_EQ(c.reduce(0, prev.ptr(), prev.ptr(), ins, 3, 0, n, 0.25f, 2.0f), 0);
  got = prev.read();
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], 0.25f * hprev[i] + 2.0f * ((h0[i] + h1[i]) + h2[i])) << "element " << i;
  }
  // Into the first input: out == ins[0].
  ASSERT_EQ(c.reduce(0, s0.ptr(), 0, ins, 3, 0, n, 0.0f, 1.0f), 0);
  got = s0.read();
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], (h0[i] + h1[i]) + h2[i]) << "element " << i;
  }
}

// The CPU engine's reduction (ipc::reduceSlice, ipc::accumulateSlice) and the library's give
// the same bits, for every number of inputs and for factors that are not powers of two (a
// fused multiply-add would round a * prev + b * sum once where the host rounds twice:
// nvcc --fmad=false keeps them apart), so an engine on a GPU accumulates as one on the CPU.
TEST(CudaLibraryTest, ReduceGivesTheCpuEnginesBits) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICE(c);
  const uint64_t n = 4099;  // past one of the CPU's blocks, not a multiple of anything
  const float a = 0.3f, b = 1.0f / 7.0f;
  for (uint32_t inputs : {1u, 2u, 3u, 5u, 6u, 7u, 8u, 13u}) {
    SCOPED_TRACE(std::to_string(inputs) + " inputs");
    std::vector<std::vector<float>> host;
    std::vector<std::unique_ptr<DeviceFloats>> dev;
    std::vector<const float*> host_ptrs;
    std::vector<uint64_t> dev_ptrs;
    for (uint32_t k = 0; k < inputs; ++k) {
      host.push_back(normals(n, 100 + k));
      dev.push_back(std::make_unique<DeviceFloats>(c, 0, host.back()));
      host_ptrs.push_back(host.back().data());
      dev_ptrs.push_back(dev.back()->ptr());
    }
    const std::vector<float> hprev = normals(n, 99);
    DeviceFloats prev(c, 0, hprev), out(c, 0, std::vector<float>(n, 0.0f));
    std::vector<float> want(n);
    shmgrad::ipc::reduceSlice(want.data(), host_ptrs.data(), inputs, 0, n, b);
    ASSERT_EQ(c.reduce(0, out.ptr(), 0, dev_ptrs.data(), inputs, 0, n, 0.0f, b), 0);
    std::vector<float> got = out.read();
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want[i]) << "sum, element " << i;
    shmgrad::ipc::accumulateSlice(want.data(), hprev.data(), a, host_ptrs.data(), inputs, 0, n, b);
    ASSERT_EQ(c.reduce(0, out.ptr(), prev.ptr(), dev_ptrs.data(), inputs, 0, n, a, b), 0);
    got = out.read();
    uint64_t fused_differs = 0;  // elements where one rounding would give another float
    for (uint64_t i = 0; i < n; ++i) {
      ASSERT_EQ(got[i], want[i]) << "accumulated, element " << i;
      float sum = host[0][i];
      for (uint32_t k = 1; k < inputs; ++k) sum += host[k][i];
      fused_differs += std::fma(a, hprev[i], b * sum) != want[i];
    }
    EXPECT_GT(fused_differs, 0u) << "the values do not tell a fused multiply-add apart";
  }
}

// Every GPU has one UUID, the same however a process numbers its devices; sticky errors are
// told apart from the others; host memory registers and unregisters.
TEST(CudaLibraryTest, UuidsStickyErrorsAndPinnedHostMemory) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  constexpr int kIllegalAddress = 700;  // cudaErrorIllegalAddress: a kernel fault
  EXPECT_EQ(c.error_is_sticky(kIllegalAddress), 1);
  EXPECT_EQ(c.error_is_sticky(kCudaErrorInvalidValue), 0);
  EXPECT_EQ(c.error_is_sticky(0), 0);
  EXPECT_EQ(c.device_uuid(0, nullptr), kCudaErrorInvalidValue);
  EXPECT_EQ(c.host_register(0, nullptr, 16), kCudaErrorInvalidValue);
  REQUIRE_DEVICE(c);
  int n = 0;
  ASSERT_EQ(c.device_count(&n), 0);
  std::vector<std::vector<uint8_t>> uuids;
  for (int d = 0; d < n; ++d) {
    std::vector<uint8_t> u(SHMGRAD_DEVICE_UUID_BYTES), again(SHMGRAD_DEVICE_UUID_BYTES);
    ASSERT_EQ(c.device_uuid(d, u.data()), 0);
    ASSERT_EQ(c.device_uuid(d, again.data()), 0);
    EXPECT_EQ(u, again) << "cuda:" << d;
    for (const auto& other : uuids) EXPECT_NE(u, other) << "cuda:" << d << " shares a UUID";
    uuids.push_back(u);
  }
  std::vector<uint8_t> u(SHMGRAD_DEVICE_UUID_BYTES);
  EXPECT_EQ(c.device_uuid(n, u.data()), kCudaErrorInvalidDevice);
  // Pinned host memory copies to the device as before.
  std::vector<float> host = normals(1024, 7);
  ASSERT_EQ(c.host_register(0, host.data(), host.size() * 4), 0);
  DeviceFloats dev(c, 0, host);
  EXPECT_EQ(dev.read(), host);
  EXPECT_EQ(c.host_unregister(0, host.data()), 0);
}

// As many inputs as the interface allows (one worker per slot: ipc::kMaxWorkers), and none.
TEST(CudaLibraryTest, ReduceTakesUpToTheMostInputs) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICE(c);
  const uint64_t n = 1000;
  std::vector<float> values(n);
  for (uint64_t i = 0; i < n; ++i) values[i] = static_cast<float>(i);
  DeviceFloats in(c, 0, values), out(c, 0, std::vector<float>(n, 0.0f)),
      prev(c, 0, std::vector<float>(n, 3.0f));
  std::vector<uint64_t> ins(SHMGRAD_MAX_REDUCE_INPUTS, in.ptr());
  ASSERT_EQ(c.reduce(0, out.ptr(), 0, ins.data(), SHMGRAD_MAX_REDUCE_INPUTS, 0, n, 0.0f, 1.0f), 0);
  std::vector<float> got = out.read();
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], SHMGRAD_MAX_REDUCE_INPUTS * values[i]) << "element " << i;
  }
  // No inputs: out = a * prev.
  ASSERT_EQ(c.reduce(0, out.ptr(), prev.ptr(), nullptr, 0, 0, n, 0.5f, 1.0f), 0);
  got = out.read();
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], 1.5f) << "element " << i;
}

TEST(CudaLibraryTest, ZeroClearsExactlyTheBytesGiven) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICE(c);
  const uint64_t n = 1000;
  DeviceFloats d(c, 0, std::vector<float>(n, 1.0f));
  ASSERT_EQ(c.zero(0, d.ptr() + 100 * 4, 500 * 4), 0);
  ASSERT_EQ(c.zero(0, d.ptr(), 0), 0);  // nothing
  const std::vector<float> got = d.read();
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], i >= 100 && i < 600 ? 0.0f : 1.0f) << "element " << i;
  }
  EXPECT_EQ(c.synchronize(0), 0);
  EXPECT_EQ(c.synchronize(-1), kCudaErrorInvalidDevice);
}

TEST(CudaLibraryTest, AnyNonFiniteLooksOnlyInItsRange) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICE(c);
  const uint64_t n = 100003, nan_at = 300, inf_at = 70000;
  std::vector<float> values = normals(n, 5);
  values[nan_at] = std::numeric_limits<float>::quiet_NaN();
  values[inf_at] = -std::numeric_limits<float>::infinity();
  DeviceFloats d(c, 0, values);
  const auto check = [&](uint64_t begin, uint64_t end) {
    int found = -1;
    EXPECT_EQ(c.any_nonfinite(0, d.ptr(), begin, end, &found), 0);
    return found;
  };
  EXPECT_EQ(check(0, n), 1);
  EXPECT_EQ(check(nan_at, nan_at + 1), 1);
  EXPECT_EQ(check(inf_at, inf_at + 1), 1);
  EXPECT_EQ(check(nan_at + 1, n), 1);  // the inf alone
  EXPECT_EQ(check(0, nan_at), 0);
  EXPECT_EQ(check(nan_at + 1, inf_at), 0);
  EXPECT_EQ(check(inf_at + 1, n), 0);
  EXPECT_EQ(check(nan_at, nan_at), 0);  // empty
  // Again after a hit: the flag is cleared for every call.
  EXPECT_EQ(check(0, nan_at), 0);
  int found = -1;
  EXPECT_EQ(c.any_nonfinite(-1, d.ptr(), 0, n, &found), kCudaErrorInvalidDevice);
}

TEST(CudaLibraryTest, CopyWithinOneDevice) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICE(c);
  const std::vector<float> values = normals(4099, 6);
  DeviceFloats src(c, 0, values), dst(c, 0, std::vector<float>(values.size(), 0.0f));
  ASSERT_EQ(c.copy(0, dst.ptr(), src.ptr(), values.size() * 4), 0);
  EXPECT_EQ(dst.read(), values);
  int n = 0;
  ASSERT_EQ(c.device_count(&n), 0);
  EXPECT_EQ(c.copy(n, dst.ptr(), src.ptr(), 4), kCudaErrorInvalidDevice);
  EXPECT_EQ(c.copy(-1, dst.ptr(), src.ptr(), 4), kCudaErrorInvalidDevice);
}

TEST(CudaLibraryTest, CanAccessPeerNamesPeersAndEveryDeviceItself) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICE(c);
  int n = 0;
  ASSERT_EQ(c.device_count(&n), 0);
  for (int d = 0; d < n; ++d) {
    int can = -1;
    ASSERT_EQ(c.can_access_peer(d, d, &can), 0);
    EXPECT_EQ(can, 1) << "cuda:" << d << " and itself";
    for (int p = 0; p < n; ++p) {
      can = -1;
      ASSERT_EQ(c.can_access_peer(d, p, &can), 0);
      EXPECT_TRUE(can == 0 || can == 1) << can;
    }
  }
  int can = -1;
  EXPECT_EQ(c.can_access_peer(0, n, &can), kCudaErrorInvalidDevice);
  EXPECT_EQ(can, 0);
  EXPECT_EQ(c.can_access_peer(n, 0, &can), kCudaErrorInvalidDevice);
}

// A copy between two devices' memory, issued from either: unified addressing finds each
// address's device.
TEST(CudaLibraryTest, CopyAcrossDevices) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICES(c, 2);
  const std::vector<float> values = normals(4099, 7);
  DeviceFloats src(c, 1, values), dst(c, 0, std::vector<float>(values.size(), 0.0f));
  ASSERT_EQ(c.copy(0, dst.ptr(), src.ptr(), values.size() * 4), 0);
  EXPECT_EQ(dst.read(), values);
  DeviceFloats back(c, 1, std::vector<float>(values.size(), 0.0f));
  ASSERT_EQ(c.copy(1, back.ptr(), dst.ptr(), values.size() * 4), 0);
  EXPECT_EQ(back.read(), values);
}

// The other process of the IPC tests: a fresh program (exec'd: CUDA does not survive a
// fork), given the library, the handle in hex and the device to open it on; exit status 0
// when it read the parent's values through the handle, summed them with a reduction on
// that device (whose kernels must address the memory), and wrote -1 into the first; 7
// when the opening failed with cudaErrorPeerAccessUnsupported.
int ipcChild(const char* library, const char* hex, int device) {
  g_library = library;
  Cuda c;
  load(&c);
  if (::testing::Test::HasFatalFailure()) return 4;
  uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES];
  if (std::strlen(hex) != 2 * sizeof handle) return 5;
  for (size_t i = 0; i < sizeof handle; ++i) {
    handle[i] = static_cast<uint8_t>(std::stoi(std::string(hex + 2 * i, 2), nullptr, 16));
  }
  uint64_t p = 0;
  float v[4] = {0, 0, 0, 0};
  const int opened = c.ipc_open(device, handle, &p);
  if (opened == kCudaErrorPeerAccessUnsupported) return 7;
  if (opened != 0 || c.copy_to_host(device, v, p, sizeof v) != 0) return 2;
  if (v[3] != 4.0f) return 6;
  uint64_t out = 0;
  float sum[4] = {0, 0, 0, 0};
  const uint64_t ins[2] = {p, p};
  if (c.alloc(device, sizeof sum, &out) != 0 ||
      c.reduce(device, out, 0, ins, 2, 0, 4, 0.0f, 0.5f) != 0 ||
      c.copy_to_host(device, sum, out, sizeof sum) != 0 || c.free(device, out) != 0) {
    return 8;
  }
  if (std::memcmp(sum, v, sizeof v) != 0) return 9;
  v[0] = -1.0f;
  return c.copy_to_device(device, p, v, sizeof v) == 0 && c.ipc_close(device, p) == 0 ? 0 : 3;
}

// Runs ipcChild in a fresh process; its exit status.
int runIpcChild(const uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES], int device) {
  std::string hex;
  char byte[3];
  for (size_t i = 0; i < SHMGRAD_IPC_HANDLE_BYTES; ++i) {
    std::snprintf(byte, sizeof byte, "%02x", handle[i]);
    hex += byte;
  }
  const std::string dev = std::to_string(device);
  const pid_t child = fork();
  if (child < 0) return -1;
  if (child == 0) {
    execl("/proc/self/exe", "gpu_test", "--ipc-child", g_library, hex.c_str(), dev.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = -1;
  if (waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// A handle made in one process and opened in another sees the same device memory.
TEST(CudaLibraryTest, IpcHandlesOpenInAnotherProcess) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICE(c);
  uint64_t p = 0;
  ASSERT_EQ(c.alloc(0, 4096, &p), 0);
  const float v[4] = {1, 2, 3, 4};
  ASSERT_EQ(c.copy_to_device(0, p, v, sizeof v), 0);
  uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES];
  ASSERT_EQ(c.ipc_handle(0, p, handle), 0);
  EXPECT_EQ(runIpcChild(handle, 0), 0);
  float back[4];
  ASSERT_EQ(c.copy_to_host(0, back, p, sizeof back), 0);
  EXPECT_EQ(back[0], -1.0f);  // the child's write, through its mapping
  EXPECT_EQ(c.free(0, p), 0);
}

// A reducer on one device opens another device's allocation in its own device's context,
// so that its kernels address it (peer access): an engine's worker on cuda:0 reads the
// slots on cuda:1 so. Devices that are no peers refuse the opening.
TEST(CudaLibraryTest, IpcHandlesOpenOnAnotherDeviceForItsKernels) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICES(c, 2);
  int can = -1;
  ASSERT_EQ(c.can_access_peer(0, 1, &can), 0);
  uint64_t p = 0;
  ASSERT_EQ(c.alloc(1, 4096, &p), 0);
  const float v[4] = {1, 2, 3, 4};
  ASSERT_EQ(c.copy_to_device(1, p, v, sizeof v), 0);
  uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES];
  ASSERT_EQ(c.ipc_handle(1, p, handle), 0);
  if (can == 1) {
    EXPECT_EQ(runIpcChild(handle, 0), 0);
    float back[4];
    ASSERT_EQ(c.copy_to_host(1, back, p, sizeof back), 0);
    EXPECT_EQ(back[0], -1.0f);
  } else {
    EXPECT_EQ(runIpcChild(handle, 0), 7) << "cuda:0 opened cuda:1's memory without peer access";
  }
  if (c.memory_kind() == kHostMemory) {  // the test double shows the other case too
    ScopedEnv no_peer("FAKE_CUDA_NO_PEER", "1");
    ASSERT_EQ(c.can_access_peer(0, 1, &can), 0);
    EXPECT_EQ(can, 0);
    EXPECT_EQ(runIpcChild(handle, 0), 7);
    EXPECT_EQ(runIpcChild(handle, 1), 0);  // its own device: no peer access needed
  }
  EXPECT_EQ(c.free(1, p), 0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--ipc-child") {
    return ipcChild(argv[2], argv[3], std::atoi(argv[4]));
  }
  ::testing::InitGoogleTest(&argc, argv);
  if (argc > 1) g_library = argv[1];
  if (argc > 2) g_memory_kind = std::atoi(argv[2]);
  return RUN_ALL_TESTS();
}
