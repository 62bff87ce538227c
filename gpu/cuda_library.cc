#include "gpu/cuda_library.h"

#include <dlfcn.h>
#include <limits.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "ipc/config.h"
#include "ipc/error.h"

namespace shmgrad::gpu {
namespace {

constexpr int kErrorMemoryAllocation = 2;     // cudaErrorMemoryAllocation
constexpr int kErrorInsufficientDriver = 35;  // no driver, or one older than the runtime
constexpr int kErrorNoDevice = 100;

template <typename F>
void bind(void* handle, const std::string& path, const char* name, F* f) {
  *f = reinterpret_cast<F>(dlsym(handle, name));
  SHMGRAD_CHECK(*f != nullptr, ErrorKind::kInvalidArgument, path, " has no ", name,
                ": it is not shmgrad's CUDA library (libshmgrad_cuda.so); reinstall shmgrad");
}

}  // namespace

std::string CudaLibrary::defaultPath() {
  if (const char* env = config::tunable("SHMGRAD_CUDA_LIBRARY")) return env;
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "libshmgrad_cuda.so";
  buf[n] = '\0';
  std::string dir(buf);
  dir = dir.substr(0, dir.rfind('/'));  // .../shmgrad/bin
  return dir.substr(0, dir.rfind('/') + 1) + "libshmgrad_cuda.so";
}

std::shared_ptr<CudaLibrary> CudaLibrary::load(const std::string& path) {
  SHMGRAD_CHECK(access(path.c_str(), R_OK) == 0, ErrorKind::kNotFound, "devices need ", path,
                ", which is not there: this shmgrad was built without its CUDA path (no nvcc "
                "when it was installed); install the CUDA toolkit and reinstall shmgrad, or "
                "serve without devices");
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  SHMGRAD_CHECK(handle != nullptr, ErrorKind::kInvalidArgument, "could not load ", path, ": ",
                dlerror());
  std::shared_ptr<CudaLibrary> lib(new CudaLibrary());
  lib->path_ = path;
  lib->handle_ = handle;
  bind(handle, path, "shmgrad_cuda_api_version", &lib->api_version_);
  const int version = lib->api_version_();
  SHMGRAD_CHECK(version == SHMGRAD_CUDA_API_VERSION, ErrorKind::kInvalidArgument, path,
                " has interface ", version, ", this program ", SHMGRAD_CUDA_API_VERSION,
                ": reinstall shmgrad");
  bind(handle, path, "shmgrad_cuda_error_name", &lib->error_name_);
  bind(handle, path, "shmgrad_cuda_error_string", &lib->error_string_);
  bind(handle, path, "shmgrad_cuda_device_count", &lib->device_count_);
  bind(handle, path, "shmgrad_cuda_alloc", &lib->alloc_);
  bind(handle, path, "shmgrad_cuda_free", &lib->free_);
  bind(handle, path, "shmgrad_cuda_ipc_handle", &lib->ipc_handle_);
  bind(handle, path, "shmgrad_cuda_ipc_open", &lib->ipc_open_);
  bind(handle, path, "shmgrad_cuda_ipc_close", &lib->ipc_close_);
  bind(handle, path, "shmgrad_cuda_copy_to_device", &lib->copy_to_device_);
  bind(handle, path, "shmgrad_cuda_copy_to_host", &lib->copy_to_host_);
  bind(handle, path, "shmgrad_cuda_zero", &lib->zero_);
  bind(handle, path, "shmgrad_cuda_synchronize", &lib->synchronize_);
  bind(handle, path, "shmgrad_cuda_can_access_peer", &lib->can_access_peer_);
  bind(handle, path, "shmgrad_cuda_copy", &lib->copy_);
  bind(handle, path, "shmgrad_cuda_reduce", &lib->reduce_);
  bind(handle, path, "shmgrad_cuda_any_nonfinite", &lib->any_nonfinite_);
  bind(handle, path, "shmgrad_cuda_device_uuid", &lib->device_uuid_);
  bind(handle, path, "shmgrad_cuda_error_is_sticky", &lib->error_is_sticky_);
  bind(handle, path, "shmgrad_cuda_host_register", &lib->host_register_);
  bind(handle, path, "shmgrad_cuda_host_unregister", &lib->host_unregister_);
  // Read once: where the library's allocations live does not change while it is loaded.
  decltype(&shmgrad_cuda_memory_kind) memory_kind = nullptr;
  bind(handle, path, "shmgrad_cuda_memory_kind", &memory_kind);
  const int kind = memory_kind();
  SHMGRAD_CHECK(kind == 0 || kind == 1, ErrorKind::kInvalidArgument, path,
                " says its memory is of kind ", kind,
                ", which this program does not know (0: device, 1: host): reinstall shmgrad");
  lib->host_memory_ = kind == 1;
  return lib;
}

CudaLibrary::~CudaLibrary() {
  // Left loaded: the CUDA runtime inside it may still hold the device's context, which
  // the process's exit tears down.
}

std::string CudaLibrary::describe(int code) const {
  const char* name = error_name_(code);
  const char* text = error_string_(code);
  return std::string(name ? name : "unknown CUDA error") + ": " + (text ? text : "");
}

void CudaLibrary::check(int code, const char* what, int device) const {
  if (code == 0) return;
  const std::string where = device < 0 ? "" : " on cuda:" + std::to_string(device);
  if (error_is_sticky_(code) != 0) {
    faulted_.store(true, std::memory_order_relaxed);
    raise(ErrorKind::kSystem, what, where, " failed: ", describe(code),
          "; this process's CUDA context is unusable from now on (a sticky error)");
  }
  SHMGRAD_CHECK(code != kErrorMemoryAllocation, ErrorKind::kNoSpace, what, where,
                " failed: the device is out of memory (", describe(code),
                "); free memory there or serve fewer workers on it");
  raise(ErrorKind::kSystem, what, where, " failed: ", describe(code));
}

int CudaLibrary::deviceCount() const {
  int count = 0;
  const int code = device_count_(&count);
  SHMGRAD_CHECK(code != kErrorInsufficientDriver, ErrorKind::kInvalidArgument,
                "devices need an NVIDIA GPU and its driver, and this machine has no usable "
                "driver (",
                describe(code),
                "); leave devices= out (--devices, for shmgrad serve) to train "
                "on the CPU");
  SHMGRAD_CHECK(code != kErrorNoDevice && !(code == 0 && count == 0), ErrorKind::kInvalidArgument,
                "devices need a GPU, and the CUDA runtime sees none (CUDA_VISIBLE_DEVICES may "
                "hide them); leave devices= out (--devices, for shmgrad serve) to train on the "
                "CPU");
  SHMGRAD_CHECK(code == 0, ErrorKind::kSystem, "the CUDA runtime failed: ", describe(code));
  return count;
}

std::string uuidText(const DeviceUuid& uuid) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "GPU-";
  for (size_t i = 0; i < uuid.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += kHex[uuid[i] >> 4];
    out += kHex[uuid[i] & 15];
  }
  return out;
}

DeviceUuid CudaLibrary::deviceUuid(int device) const {
  DeviceUuid uuid{};
  check(device_uuid_(device, uuid.data()), "cudaGetDeviceProperties (its UUID)", device);
  return uuid;
}

int CudaLibrary::localOrdinal(const ipc::DeviceEntry& entry) const {
  DeviceUuid uuid;
  std::memcpy(uuid.data(), entry.uuid, uuid.size());
  const int count = deviceCount();
  for (int d = 0; d < count; ++d) {
    if (deviceUuid(d) == uuid) return d;
  }
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  raise(ErrorKind::kInvalidArgument, "the engine computes on ", uuidText(uuid),
        " (cuda:", entry.ordinal,
        " where it was started), which this process does not see among its ", count,
        " GPU(s) (CUDA_VISIBLE_DEVICES=", visible ? visible : "(unset)",
        "): start it with the engine's CUDA_VISIBLE_DEVICES, or serve GPUs it sees");
}

void CudaLibrary::hostRegister(int device, void* ptr, uint64_t bytes) const {
  check(host_register_(device, ptr, bytes), "cudaHostRegister", device);
}

int CudaLibrary::hostUnregister(int device, void* ptr) const noexcept {
  return host_unregister_(device, ptr);
}

bool CudaLibrary::deviceFaulted(int device) const {
  if (faulted()) return true;
  const int code = synchronize_(device);
  if (code != 0 && error_is_sticky_(code) != 0) faulted_.store(true, std::memory_order_relaxed);
  return faulted();
}

uint64_t CudaLibrary::alloc(int device, uint64_t bytes) const {
  uint64_t ptr = 0;
  check(alloc_(device, bytes, &ptr), "cudaMalloc", device);
  return ptr;
}

int CudaLibrary::free(int device, uint64_t ptr) const noexcept { return free_(device, ptr); }

IpcHandle CudaLibrary::ipcHandle(int device, uint64_t ptr) const {
  IpcHandle h{};
  check(ipc_handle_(device, ptr, h.data()), "cudaIpcGetMemHandle", device);
  return h;
}

uint64_t CudaLibrary::ipcOpen(int device, const IpcHandle& handle) const {
  uint64_t ptr = 0;
  check(ipc_open_(device, handle.data(), &ptr), "cudaIpcOpenMemHandle", device);
  return ptr;
}

int CudaLibrary::ipcClose(int device, uint64_t ptr) const noexcept {
  return ipc_close_(device, ptr);
}

void CudaLibrary::copyToDevice(int device, uint64_t dst, const void* src, uint64_t bytes) const {
  check(copy_to_device_(device, dst, src, bytes), "a copy to the device", device);
}

void CudaLibrary::copyToHost(int device, void* dst, uint64_t src, uint64_t bytes) const {
  check(copy_to_host_(device, dst, src, bytes), "a copy from the device", device);
}

void CudaLibrary::zero(int device, uint64_t ptr, uint64_t bytes) const {
  check(zero_(device, ptr, bytes), "zeroing device memory", device);
}

void CudaLibrary::synchronize(int device) const {
  check(synchronize_(device), "cudaDeviceSynchronize", device);
}

bool CudaLibrary::canAccessPeer(int device, int peer) const {
  int can = 0;
  check(can_access_peer_(device, peer, &can), "cudaDeviceCanAccessPeer", device);
  return can != 0;
}

void CudaLibrary::copy(int device, uint64_t dst, uint64_t src, uint64_t bytes) const {
  check(copy_(device, dst, src, bytes), "a device-to-device copy", device);
}

void CudaLibrary::reduce(int device, uint64_t out, uint64_t prev, const uint64_t* ins,
                         uint32_t nins, uint64_t begin, uint64_t end, float a, float b) const {
  check(reduce_(device, out, prev, ins, nins, begin, end, a, b), "the reduction", device);
}

bool CudaLibrary::anyNonFinite(int device, uint64_t ptr, uint64_t begin, uint64_t end) const {
  int found = 0;
  check(any_nonfinite_(device, ptr, begin, end, &found), "the non-finite check", device);
  return found != 0;
}

namespace {

// CUDA maps a handle once per process (a second cudaIpcOpenMemHandle of a handle that is
// open fails): every DeviceMapping of the same allocation in this process shares one
// opening, in one device's context, closed with the last of them.
struct Opened {
  uint64_t ptr;
  int mappings;
  int context;
};
std::mutex g_opened_mu;
std::map<std::pair<int, IpcHandle>, Opened>& openedHandles() {
  static auto* opened = new std::map<std::pair<int, IpcHandle>, Opened>();
  return *opened;
}

}  // namespace

DeviceMapping::DeviceMapping(std::shared_ptr<const CudaLibrary> cuda, const ipc::Segment& segment,
                             uint32_t device_index, int context)
    : cuda_(std::move(cuda)) {
  const ipc::SegmentHeader* h = segment.header();
  const auto* table = segment.region<ipc::DeviceTable>(h->device);
  ipc::validateDeviceTable(*table, h->num_slots, h->param_floats, h->buffers.size, -1);
  SHMGRAD_CHECK(device_index < table->count, ErrorKind::kInvalidArgument, "device index ",
                device_index, " is past the engine's ", table->count, " devices");
  const ipc::DeviceEntry& e = table->devices[device_index];
  SHMGRAD_CHECK(e.state.load(std::memory_order_acquire) ==
                    static_cast<uint32_t>(ipc::DeviceState::kPublished),
                ErrorKind::kNotFound, "cuda:", e.ordinal,
                "'s buffers are not published yet: the coordinator is still starting");
  ordinal_ = cuda_->localOrdinal(e);
  slots_ = e.slots;
  layout_ = e.layout;
  std::memcpy(handle_.data(), e.ipc_handle, handle_.size());
  context_ = context < 0 ? ordinal_ : context;
  std::lock_guard<std::mutex> lock(g_opened_mu);
  auto it = openedHandles().find({ordinal_, handle_});
  if (it != openedHandles().end()) {
    SHMGRAD_CHECK(it->second.context == context_, ErrorKind::kInvalidArgument, "cuda:", ordinal_,
                  "'s buffers are open in this process for cuda:", it->second.context,
                  "'s kernels, not cuda:", context_,
                  "'s: CUDA maps an allocation once per process, so a process uses one device");
    ++it->second.mappings;
    base_ = it->second.ptr;
    return;
  }
  // Devices without peer access fail here with CUDA's error; the coordinator refused them
  // before any worker started.
  base_ = cuda_->ipcOpen(context_, handle_);
  openedHandles()[{ordinal_, handle_}] = {base_, 1, context_};
}

DeviceMapping::~DeviceMapping() {
  if (base_ == 0) return;
  std::lock_guard<std::mutex> lock(g_opened_mu);
  auto it = openedHandles().find({ordinal_, handle_});
  if (it == openedHandles().end() || --it->second.mappings > 0) return;
  openedHandles().erase(it);
  cuda_->ipcClose(context_, base_);
}

uint64_t DeviceMapping::reduced() const {
  SHMGRAD_CHECK(layout_.reduced != 0, ErrorKind::kInvalidArgument, "cuda:", ordinal_,
                " holds no reduced gradient: the engine's first device does");
  return base_ + layout_.reduced;
}

uint64_t DeviceMapping::accum() const {
  SHMGRAD_CHECK(layout_.accum != 0, ErrorKind::kInvalidArgument, "cuda:", ordinal_,
                " holds no accumulation buffer: the engine's first device does");
  return base_ + layout_.accum;
}

uint64_t DeviceMapping::slot(uint32_t local) const {
  SHMGRAD_CHECK(local < slots_, ErrorKind::kInvalidArgument, "slot ", local,
                " is past cuda:", ordinal_, "'s ", slots_, " slots");
  return base_ + layout_.slots + uint64_t{local} * layout_.slot_stride;
}

}  // namespace shmgrad::gpu
