// A stand-in for libshmgrad_cuda.so with its C interface (gpu/cuda_ops.h) on host memory,
// for tests of everything around the device on machines without one: each "device"
// allocation is a POSIX shared-memory object mapped here, and its "IPC handle" is the
// object's name, so a handle opens in another process as a real one does. Frees unlink
// the object: a test sees in /dev/shm whether every allocation was freed.
// FAKE_CUDA_DEVICES (default 2) devices are visible; 0 acts as "no device".
// FAKE_CUDA_HANG_FILE names a file: a shmgrad_cuda_synchronize that finds it there does
// not return for ten minutes, whatever happens to the file (a kernel that hangs).
// FAKE_CUDA_FAULT_FILE names a file: a shmgrad_cuda_zero that finds it there faults as a
// kernel would (cudaErrorIllegalAddress), and like a real fault it is sticky: every later
// call of that process fails with it.
// FAKE_CUDA_VISIBLE lists the devices this process sees, as CUDA_VISIBLE_DEVICES does
// ("1,0": its cuda:0 is device 1); each device's UUID is the same in every process.
// A free of an allocation that another live process still maps (CUDA leaves it undefined)
// fails with fakeErrorFreedWhileMapped, is said on stderr and appended to the file that
// FAKE_CUDA_VIOLATIONS names: the tests hold the engine to freeing after every detach.
// Contexts as CUDA has them: an allocation is mapped in its device's context, an opened
// handle in the context of the device it was opened on (another device's allocation
// opened there through peer access; FAKE_CUDA_NO_PEER=1: devices that are no peers, whose
// opening fails as CUDA's does), and the operations on `device` refuse an address not
// mapped in its context (cudaErrorIllegalAddress, where a GPU would fault).
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "gpu/cuda_ops.h"

#define FAKE_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kSuccess = 0, kInvalidValue = 1, kMemoryAllocation = 2, kNoDevice = 100,
              kInvalidDevice = 101, kAlreadyMapped = 208, kPeerAccessUnsupported = 217,
              kInvalidHandle = 400, kIllegalAddress = 700, kFreedWhileMapped = 9001;

struct Mapping {
  std::string name;    // the object this process allocated; empty for an opened handle
  std::string opened;  // the object an opened handle names
  uint64_t bytes;
  int context;  // the device in whose context it is mapped
};
std::mutex g_mu;
std::map<uint64_t, Mapping> g_maps;
std::atomic<bool> g_faulted{false};  // a "kernel" of this process faulted: sticky
std::atomic<int> g_counter{0};

int physicalDevices() {
  const char* env = std::getenv("FAKE_CUDA_DEVICES");
  return env ? std::atoi(env) : 2;
}

// The physical devices this process sees, in its ordinal order (FAKE_CUDA_VISIBLE).
std::vector<int> visible() {
  std::vector<int> out;
  const char* env = std::getenv("FAKE_CUDA_VISIBLE");
  if (env == nullptr) {
    for (int d = 0; d < physicalDevices(); ++d) out.push_back(d);
    return out;
  }
  for (const char* p = env; *p != '\0';) {
    char* end = nullptr;
    const long d = std::strtol(p, &end, 10);
    if (end == p) break;
    if (d >= 0 && d < physicalDevices()) out.push_back(static_cast<int>(d));
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

int devices() { return static_cast<int>(visible().size()); }

// This process's ordinal `device` as a physical device (-1 for -1).
int physical(int device) { return device < 0 ? -1 : visible().at(device); }

int use(int device) {
  if (devices() == 0) return kNoDevice;
  if (device < 0 || device >= devices()) return kInvalidDevice;
  return g_faulted.load() ? kIllegalAddress : kSuccess;
}

// Another live process that maps the shared-memory object `name` (its /proc/PID/maps).
int otherMapper(const std::string& name) {
  const std::string path = "/dev/shm" + name;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return 0;
  int found = 0;
  while (dirent* ent = readdir(proc)) {
    const int pid = std::atoi(ent->d_name);
    if (pid <= 0 || pid == getpid()) continue;
    std::ifstream maps("/proc/" + std::string(ent->d_name) + "/maps");
    std::string line;
    while (std::getline(maps, line)) {
      if (line.size() >= path.size() &&
          line.compare(line.size() - path.size(), path.size(), path) == 0) {
        found = pid;
        break;
      }
    }
    if (found != 0) break;
  }
  closedir(proc);
  return found;
}

void violation(const std::string& text) {
  std::fprintf(stderr, "fake cuda: %s\n", text.c_str());
  if (const char* file = std::getenv("FAKE_CUDA_VIOLATIONS")) {
    if (FILE* f = std::fopen(file, "a")) {
      std::fprintf(f, "%s\n", text.c_str());
      std::fclose(f);
    }
  }
}

bool peers() {
  const char* env = std::getenv("FAKE_CUDA_NO_PEER");
  return env == nullptr || std::strcmp(env, "1") != 0;
}

// Whether [ptr, ptr + bytes) lies in one mapping of `device`'s context (any context for
// device -1: a copy, which unified addressing resolves whatever the context).
bool mappedIn(int device, uint64_t ptr, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_maps.upper_bound(ptr);
  if (it == g_maps.begin()) return false;
  --it;
  return (device < 0 || it->second.context == physical(device)) &&
         ptr + bytes <= it->first + it->second.bytes;
}

int mapObject(const char* name, int flags, uint64_t bytes, int context, uint64_t* ptr) {
  const int fd = shm_open(name, flags, 0600);
  if (fd < 0) return flags & O_CREAT ? kMemoryAllocation : kInvalidHandle;
  if ((flags & O_CREAT) && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    shm_unlink(name);
    return kMemoryAllocation;
  }
  struct stat st;
  fstat(fd, &st);
  void* p =
      mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return kMemoryAllocation;
  *ptr = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(g_mu);
  g_maps[*ptr] = {flags & O_CREAT ? name : "", flags & O_CREAT ? "" : name,
                  static_cast<uint64_t>(st.st_size), context};
  return kSuccess;
}

int unmap(uint64_t ptr, bool unlink) {
  Mapping m;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_maps.find(ptr);
    if (it == g_maps.end()) return kInvalidValue;
    m = it->second;
    g_maps.erase(it);
  }
  munmap(reinterpret_cast<void*>(ptr), m.bytes);
  if (unlink && !m.name.empty()) shm_unlink(m.name.c_str());
  return kSuccess;
}

}  // namespace

FAKE_API int shmgrad_cuda_api_version(void) { return SHMGRAD_CUDA_API_VERSION; }
FAKE_API int shmgrad_cuda_runtime_version(void) { return 13000; }
FAKE_API int shmgrad_cuda_driver_version(void) { return 13000; }
FAKE_API const char* shmgrad_cuda_error_name(int code) {
  switch (code) {
    case kSuccess:
      return "cudaSuccess";
    case kInvalidValue:
      return "cudaErrorInvalidValue";
    case kMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case kNoDevice:
      return "cudaErrorNoDevice";
    case kInvalidDevice:
      return "cudaErrorInvalidDevice";
    case kAlreadyMapped:
      return "cudaErrorAlreadyMapped";
    case kPeerAccessUnsupported:
      return "cudaErrorPeerAccessUnsupported";
    case kIllegalAddress:
      return "cudaErrorIllegalAddress";
    case kInvalidHandle:
      return "cudaErrorInvalidResourceHandle";
    case kFreedWhileMapped:
      return "fakeErrorFreedWhileMapped";
    default:
      return "cudaErrorUnknown";
  }
}
FAKE_API const char* shmgrad_cuda_error_string(int) { return "(fake device)"; }
FAKE_API int shmgrad_cuda_device_count(int* count) {
  *count = devices();
  return *count == 0 ? kNoDevice : kSuccess;
}
FAKE_API int shmgrad_cuda_device_info(int device, char* name, size_t len, int* major, int* minor) {
  if (int e = use(device)) return e;
  std::snprintf(name, len, "fake device %d", device);
  *major = 9;
  *minor = 0;
  return kSuccess;
}
FAKE_API int shmgrad_cuda_device_uuid(int device, uint8_t uuid[SHMGRAD_DEVICE_UUID_BYTES]) {
  if (uuid == nullptr) return kInvalidValue;
  if (int e = use(device)) return e;
  // The same bytes for a physical device in every process, whatever its ordinal there.
  for (int i = 0; i < SHMGRAD_DEVICE_UUID_BYTES; ++i) uuid[i] = static_cast<uint8_t>(0xf0 + i);
  uuid[SHMGRAD_DEVICE_UUID_BYTES - 1] = static_cast<uint8_t>(physical(device));
  return kSuccess;
}
FAKE_API int shmgrad_cuda_error_is_sticky(int code) { return code == kIllegalAddress ? 1 : 0; }
FAKE_API int shmgrad_cuda_host_register(int device, void* ptr, uint64_t bytes) {
  if (ptr == nullptr || bytes == 0) return kInvalidValue;
  return use(device);  // host memory already
}
FAKE_API int shmgrad_cuda_host_unregister(int device, void* ptr) {
  if (ptr == nullptr) return kInvalidValue;
  return use(device);
}
FAKE_API int shmgrad_cuda_alloc(int device, uint64_t bytes, uint64_t* ptr) {
  *ptr = 0;
  if (int e = use(device)) return e;
  // The name ends with the device: an opening knows the allocation's device, as CUDA's does.
  const std::string name = "/shmgrad-fakecuda-" + std::to_string(getpid()) + "-" +
                           std::to_string(g_counter++) + "-" + std::to_string(physical(device));
  return mapObject(name.c_str(), O_CREAT | O_EXCL | O_RDWR, bytes, physical(device), ptr);
}
FAKE_API int shmgrad_cuda_free(int device, uint64_t ptr) {
  if (int e = use(device)) return e;
  std::string name;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_maps.find(ptr);
    if (it != g_maps.end()) name = it->second.name;
  }
  const int mapper = name.empty() ? 0 : otherMapper(name);
  const int freed = unmap(ptr, true);
  if (freed != kSuccess || mapper == 0) return freed;
  violation("cudaFree of " + name + " (cuda:" + std::to_string(device) + ") while pid " +
            std::to_string(mapper) + " still maps it: CUDA leaves this undefined");
  return kFreedWhileMapped;
}
FAKE_API int shmgrad_cuda_ipc_handle(int device, uint64_t ptr,
                                     uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES]) {
  if (int e = use(device)) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_maps.find(ptr);
  if (it == g_maps.end() || it->second.name.empty()) return kInvalidValue;
  std::memset(handle, 0, SHMGRAD_IPC_HANDLE_BYTES);
  std::strncpy(reinterpret_cast<char*>(handle), it->second.name.c_str(),
               SHMGRAD_IPC_HANDLE_BYTES - 1);
  return kSuccess;
}
FAKE_API int shmgrad_cuda_ipc_open(int device, const uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES],
                                   uint64_t* ptr) {
  *ptr = 0;
  if (int e = use(device)) return e;
  char name[SHMGRAD_IPC_HANDLE_BYTES + 1] = {};
  std::memcpy(name, handle, SHMGRAD_IPC_HANDLE_BYTES);
  if (std::strncmp(name, "/shmgrad-fakecuda-", 18) != 0) return kInvalidHandle;
  const char* dash = std::strrchr(name, '-');
  if (std::atoi(dash + 1) != physical(device) && !peers()) return kPeerAccessUnsupported;
  {
    // As CUDA: a process cannot open its own allocation's handle, nor open a handle that
    // it has open already (one mapping per handle per context).
    std::lock_guard<std::mutex> lock(g_mu);
    for (const auto& [p, m] : g_maps) {
      if (m.name == name) return kInvalidHandle;
      if (m.opened == name) return kAlreadyMapped;
    }
  }
  return mapObject(name, O_RDWR, 0, physical(device), ptr);
}
FAKE_API int shmgrad_cuda_ipc_close(int device, uint64_t ptr) {
  if (int e = use(device)) return e;
  return unmap(ptr, false);
}
FAKE_API int shmgrad_cuda_can_access_peer(int device, int peer, int* can) {
  if (can == nullptr) return kInvalidValue;
  *can = 0;
  if (int e = use(device)) return e;
  if (int e = use(peer)) return e;
  *can = peer == device || peers() ? 1 : 0;
  return kSuccess;
}
FAKE_API int shmgrad_cuda_copy_to_device(int device, uint64_t dst, const void* src,
                                         uint64_t bytes) {
  if (int e = use(device)) return e;
  std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
  return kSuccess;
}
FAKE_API int shmgrad_cuda_copy_to_host(int device, void* dst, uint64_t src, uint64_t bytes) {
  if (int e = use(device)) return e;
  std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
  return kSuccess;
}
FAKE_API int shmgrad_cuda_memory_kind(void) { return 1; }
FAKE_API int shmgrad_cuda_zero(int device, uint64_t ptr, uint64_t bytes) {
  if (ptr == 0) return kInvalidValue;
  const char* fault = std::getenv("FAKE_CUDA_FAULT_FILE");
  if (fault != nullptr && access(fault, F_OK) == 0) g_faulted = true;
  if (int e = use(device)) return e;
  if (!mappedIn(device, ptr, bytes)) return kIllegalAddress;
  std::memset(reinterpret_cast<void*>(ptr), 0, bytes);
  return kSuccess;
}
FAKE_API int shmgrad_cuda_synchronize(int device) {
  const char* hang = std::getenv("FAKE_CUDA_HANG_FILE");
  if (hang != nullptr && access(hang, F_OK) == 0) sleep(600);
  return use(device);
}
FAKE_API int shmgrad_cuda_copy(int device, uint64_t dst, uint64_t src, uint64_t bytes) {
  if (dst == 0 || src == 0) return kInvalidValue;
  if (int e = use(device)) return e;
  if (!mappedIn(-1, dst, bytes) || !mappedIn(-1, src, bytes)) return kIllegalAddress;
  std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
  return kSuccess;
}
// The real library's argument checks and order: inputs summed in list order in float32,
// everything of element i read before out[i] is written (out may alias prev or an input).
FAKE_API int shmgrad_cuda_reduce(int device, uint64_t out, uint64_t prev, const uint64_t* ins,
                                 uint32_t nins, uint64_t begin, uint64_t end, float a, float b) {
  if (end < begin || out == 0 || (a != 0.0f && prev == 0) || nins > SHMGRAD_MAX_REDUCE_INPUTS ||
      (nins > 0 && ins == nullptr)) {
    return kInvalidValue;
  }
  for (uint32_t k = 0; k < nins; ++k) {
    if (ins[k] == 0) return kInvalidValue;
  }
  if (int e = use(device)) return e;
  const uint64_t first = begin * sizeof(float), bytes = (end - begin) * sizeof(float);
  if (end > begin) {
    if (!mappedIn(device, out + first, bytes) ||
        (a != 0.0f && !mappedIn(device, prev + first, bytes))) {
      return kIllegalAddress;
    }
    for (uint32_t k = 0; k < nins; ++k) {
      if (!mappedIn(device, ins[k] + first, bytes)) return kIllegalAddress;
    }
  }
  auto* o = reinterpret_cast<float*>(out);
  const auto* p = reinterpret_cast<const float*>(prev);
  for (uint64_t i = begin; i < end; ++i) {
    float s = 0.0f;
    if (nins > 0) s = reinterpret_cast<const float*>(ins[0])[i];
    for (uint32_t k = 1; k < nins; ++k) s += reinterpret_cast<const float*>(ins[k])[i];
    o[i] = a == 0.0f ? b * s : a * p[i] + b * s;
  }
  return kSuccess;
}
FAKE_API int shmgrad_cuda_any_nonfinite(int device, uint64_t ptr, uint64_t begin, uint64_t end,
                                        int* found) {
  if (found == nullptr) return kInvalidValue;
  *found = 0;
  if (end < begin || ptr == 0) return kInvalidValue;
  if (int e = use(device)) return e;
  if (end > begin &&
      !mappedIn(device, ptr + begin * sizeof(float), (end - begin) * sizeof(float))) {
    return kIllegalAddress;
  }
  const auto* p = reinterpret_cast<const float*>(ptr);
  for (uint64_t i = begin; i < end; ++i) {
    if (!std::isfinite(p[i])) {
      *found = 1;
      break;
    }
  }
  return kSuccess;
}
