// libshmgrad_cuda.so, loaded as shmgrad loads it (dlopen): its interface and error codes
// everywhere; device memory, the reduction kernel and IPC handles where a device is.
// Usage: gpu_test PATH/libshmgrad_cuda.so [gtest flags]
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/cuda_ops.h"

namespace {

const char* g_library = nullptr;

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
  decltype(&shmgrad_cuda_sum_slots) sum_slots;
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
  bind(c->handle, "shmgrad_cuda_sum_slots", &c->sum_slots);
}

constexpr int kCudaErrorInvalidValue = 1;
constexpr int kCudaErrorInsufficientDriver = 35;
constexpr int kCudaErrorNoDevice = 100;

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
}

TEST(CudaLibraryTest, ReductionArgumentsAreCheckedBeforeAnyDeviceWork) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  // end before begin; a != 0 without prev; no output; slots missing.
  EXPECT_EQ(c.sum_slots(0, 256, 0, 512, 2, 16, 8, 4, 0.0f, 1.0f, 0, 1), kCudaErrorInvalidValue);
  EXPECT_EQ(c.sum_slots(0, 256, 0, 512, 2, 16, 0, 4, 0.5f, 1.0f, 0, 1), kCudaErrorInvalidValue);
  EXPECT_EQ(c.sum_slots(0, 0, 0, 512, 2, 16, 0, 4, 0.0f, 1.0f, 0, 1), kCudaErrorInvalidValue);
  EXPECT_EQ(c.sum_slots(0, 256, 0, 0, 2, 16, 0, 4, 0.0f, 1.0f, 0, 1), kCudaErrorInvalidValue);
  EXPECT_EQ(c.sum_slots(0, 256, 0, 512, 2, 16, 4, 4, 0.0f, 1.0f, 0, 1), 0);  // empty slice
}

TEST(CudaLibraryTest, SlotsAreSummedSliceBySliceInSlotOrder) {
  Cuda c;
  ASSERT_NO_FATAL_FAILURE(load(&c));
  REQUIRE_DEVICE(c);
  const uint32_t slots = 3;
  const uint64_t n = 100003, stride = (n + 63) / 64 * 64;
  std::vector<float> host(slots * stride), prev(n);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (float& v : host) v = normal(rng);
  for (float& v : prev) v = normal(rng);
  uint64_t d_slots = 0, d_out = 0, d_prev = 0;
  ASSERT_EQ(c.alloc(0, host.size() * 4, &d_slots), 0);
  ASSERT_EQ(c.alloc(0, n * 4, &d_out), 0);
  ASSERT_EQ(c.alloc(0, n * 4, &d_prev), 0);
  ASSERT_EQ(c.copy_to_device(0, d_slots, host.data(), host.size() * 4), 0);
  ASSERT_EQ(c.copy_to_device(0, d_prev, prev.data(), n * 4), 0);
  // Two slices, as two workers would reduce them.
  const uint64_t mid = n / 2 / 64 * 64;
  ASSERT_EQ(c.sum_slots(0, d_out, 0, d_slots, slots, stride, 0, mid, 0.0f, 0.5f, 0, 1), 0);
  ASSERT_EQ(c.sum_slots(0, d_out, 0, d_slots, slots, stride, mid, n, 0.0f, 0.5f, 0, 1), 0);
  std::vector<float> out(n);
  ASSERT_EQ(c.copy_to_host(0, out.data(), d_out, n * 4), 0);
  for (uint64_t i = 0; i < n; ++i) {
    float s = 0.0f;
    for (uint32_t k = 0; k < slots; ++k) s += host[k * stride + i];
    ASSERT_EQ(out[i], 0.5f * s) << "element " << i;  // the same order: the same float
  }
  // Accumulating: out = a * prev + b * sum, in place over prev.
  ASSERT_EQ(c.sum_slots(0, d_prev, d_prev, d_slots, slots, stride, 0, n, 0.25f, 2.0f, 0, 1), 0);
  ASSERT_EQ(c.copy_to_host(0, out.data(), d_prev, n * 4), 0);
  for (uint64_t i = 0; i < n; ++i) {
    float s = 0.0f;
    for (uint32_t k = 0; k < slots; ++k) s += host[k * stride + i];
    ASSERT_NEAR(out[i], 0.25f * prev[i] + 2.0f * s, 1e-5f * (1 + std::fabs(out[i])));
  }
  EXPECT_EQ(c.free(0, d_slots), 0);
  EXPECT_EQ(c.free(0, d_out), 0);
  EXPECT_EQ(c.free(0, d_prev), 0);
}

// The other process of the IPC test: a fresh program (exec'd: CUDA does not survive a
// fork), given the library and the handle in hex; exit status 0 when it read the parent's
// values through the handle and wrote -1 into the first.
int ipcChild(const char* library, const char* hex) {
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
  if (c.ipc_open(0, handle, &p) != 0 || c.copy_to_host(0, v, p, sizeof v) != 0) return 2;
  if (v[3] != 4.0f) return 6;
  v[0] = -1.0f;
  return c.copy_to_device(0, p, v, sizeof v) == 0 && c.ipc_close(0, p) == 0 ? 0 : 3;
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
  std::string hex;
  char byte[3];
  for (uint8_t b : handle) {
    std::snprintf(byte, sizeof byte, "%02x", b);
    hex += byte;
  }
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    execl("/proc/self/exe", "gpu_test", "--ipc-child", g_library, hex.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = -1;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  float back[4];
  ASSERT_EQ(c.copy_to_host(0, back, p, sizeof back), 0);
  EXPECT_EQ(back[0], -1.0f);  // the child's write, through its mapping
  EXPECT_EQ(c.free(0, p), 0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--ipc-child") return ipcChild(argv[2], argv[3]);
  ::testing::InitGoogleTest(&argc, argv);
  if (argc > 1) g_library = argv[1];
  return RUN_ALL_TESTS();
}
