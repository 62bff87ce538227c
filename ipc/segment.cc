#include "ipc/segment.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <new>

#include "ipc/device_table.h"
#include "ipc/error.h"

namespace bip = boost::interprocess;

namespace shmgrad::ipc {
namespace {

std::string bipName(const std::string& engine_name) {
  return "shmgrad-" + std::to_string(getuid()) + "-" + engine_name;
}

uint64_t numelOf(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

void fillShape(Shape* out, const std::vector<int64_t>& shape) {
  SHMGRAD_CHECK(shape.size() <= kMaxDims, ErrorKind::kInvalidArgument, "a tensor has ",
                shape.size(), " dimensions; shmgrad supports at most ", kMaxDims);
  std::memset(out, 0, sizeof(*out));
  out->ndim = static_cast<uint32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) out->dims[i] = shape[i];
}

// What a ParamEntry and a BufferEntry have in common: cleared, then name, shape, offset.
template <typename Entry>
void fillEntry(Entry* e, const std::string& name, const std::vector<int64_t>& shape,
               uint64_t offset) {
  std::memset(e, 0, sizeof(*e));
  std::snprintf(e->name, kNameLen, "%s", name.c_str());
  fillShape(&e->shape, shape);
  e->offset = offset;
}

// What kind of thing a stat describes, for an error message.
const char* fileKind(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device node";
  return "a regular file";
}

// The gate before any process opens a segment by its name. /dev/shm is writable by every
// user (mode 1777), and the uid in the name is only a convention, so another user can
// plant a file, a symbolic link or a FIFO under one of our engines' names. Whatever is
// not a regular file of this uid is refused here, before it is opened, followed or
// removed: a link could redirect the owner's writes, a FIFO would block open(), and a
// stranger's file would hand them the engine's memory. Returns false when the name is
// free; `st` is what lstat saw, for the caller to compare with what it then opens.
bool checkOwnEntry(const std::string& path, struct stat* st) {
  if (::lstat(path.c_str(), st) != 0) {
    SHMGRAD_CHECK(errno == ENOENT, ErrorKind::kSystem, "lstat ", path, ": ", detail::errnoText());
    return false;
  }
  const bool regular = S_ISREG(st->st_mode);
  if (!regular || st->st_uid != getuid()) {
    raise(ErrorKind::kBusy, path, " is ", fileKind(st->st_mode), " owned by uid ", st->st_uid,
          ", not a segment of yours (uid ", getuid(),
          "): it is refused, neither opened, followed nor removed. Another user may have "
          "planted it under this engine's name; pick another --name, or have its owner or "
          "root remove it");
  }
  return true;
}

// After open(): the file opened must be the one lstat checked (not swapped in between),
// still a regular file of this uid. Closes fd and raises otherwise.
void checkOpenedEntry(const std::string& path, int fd, const struct stat& seen, struct stat* st) {
  if (::fstat(fd, st) != 0) {
    ::close(fd);
    raise(ErrorKind::kSystem, "fstat ", path, ": ", detail::errnoText());
  }
  if (st->st_dev != seen.st_dev || st->st_ino != seen.st_ino || !S_ISREG(st->st_mode) ||
      st->st_uid != getuid()) {
    ::close(fd);
    raise(ErrorKind::kBusy, path, " was replaced while it was being opened (now ",
          fileKind(st->st_mode), " owned by uid ", st->st_uid,
          "): refused; another process is changing this engine's name in /dev/shm");
  }
}

// open() flags for a segment: never through a symbolic link, never blocking (a FIFO
// swapped in after the lstat must not hang the caller; checkOpenedEntry refuses it).
constexpr int kSegmentOpenFlags = O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;

std::string describe(const Region& r) {
  return "[" + std::to_string(r.offset) + ", +" + std::to_string(r.size) + ")";
}

void checkRegion(const char* what, const Region& r, uint64_t total, uint64_t min_size) {
  SHMGRAD_CHECK(r.offset >= alignUp(sizeof(SegmentHeader), kAlign), ErrorKind::kCorrupt,
                "segment header: region ", what, " ", describe(r), " overlaps the header");
  SHMGRAD_CHECK(r.offset % kAlign == 0, ErrorKind::kCorrupt, "segment header: region ", what, " ",
                describe(r), " is not ", kAlign, "-byte aligned");
  SHMGRAD_CHECK(r.offset <= total && r.size <= total - r.offset, ErrorKind::kCorrupt,
                "segment header: region ", what, " ", describe(r), " lies outside the segment of ",
                total, " bytes");
  SHMGRAD_CHECK(r.size >= min_size, ErrorKind::kCorrupt, "segment header: region ", what, " ",
                describe(r), " is smaller than the ", min_size, " bytes its header implies");
}

uint64_t checkShape(const char* what, const Shape& s) {
  return checkedNumel(ErrorKind::kCorrupt, (std::string("segment header: ") + what).c_str(), s.dims,
                      s.ndim);
}

bool terminated(const char* s, size_t n) { return std::memchr(s, '\0', n) != nullptr; }

}  // namespace

uint64_t checkedNumel(ErrorKind kind, const char* what, const int64_t* dims, uint64_t ndim) {
  SHMGRAD_CHECK(ndim <= kMaxDims, kind, what, " has ", ndim,
                " dimensions; shmgrad supports at most ", kMaxDims);
  uint64_t n = 1;
  for (uint64_t i = 0; i < ndim; ++i) {
    const int64_t d = dims[i];
    SHMGRAD_CHECK(d >= 0 && d < kMaxDimSize, kind, what, " has dimension ", d);
    SHMGRAD_CHECK(d == 0 || n <= kMaxNumel / static_cast<uint64_t>(d), kind, what, " is too large");
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

void checkEngineName(const std::string& name) {
  bool ok = !name.empty() && name.size() <= 64;
  for (char c : name) {
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '_' || c == '-' || c == '.');
  }
  SHMGRAD_CHECK(ok, ErrorKind::kInvalidArgument, "engine name '", name,
                "' is invalid: use 1 to 64 letters, digits, '_', '-' or '.'");
}

LossKind parseLoss(const std::string& name) {
  for (uint32_t k = 1; k <= kNumLossKinds; ++k) {
    if (name == kLossNames[k]) return static_cast<LossKind>(k);
  }
  if (name == "ce") return LossKind::kCrossEntropy;  // accepted short form
  std::string choices;
  for (uint32_t k = 1; k <= kNumLossKinds; ++k)
    choices += (k > 1 ? ", " : "") + std::string(kLossNames[k]);
  raise(ErrorKind::kInvalidArgument, "unknown loss '", name, "': use one of ", choices,
        " (each summed over the batch)");
}

LossReduction parseLossReduction(const std::string& name) {
  for (uint32_t k = 1; k < std::size(kLossReductionNames); ++k) {
    if (name == kLossReductionNames[k]) return static_cast<LossReduction>(k);
  }
  raise(ErrorKind::kInvalidArgument, "unknown loss reduction '", name,
        "': use sum, mean or weighted (a forward's (loss_sum, count))");
}

namespace {
// The boolean keys of --numerics and their flags.
struct NumericsKey {
  const char* name;
  uint32_t flag;
};
constexpr NumericsKey kNumericsKeys[] = {
    {"cudnn_tf32", kCudnnTf32},
    {"cudnn_benchmark", kCudnnBenchmark},
    {"cudnn_deterministic", kCudnnDeterministic},
};
// torch's defaults: cuDNN may use TF32; no benchmark, no determinism; "highest".
constexpr uint32_t kTorchDefaultFlags = kCudnnTf32;
}  // namespace

Numerics parseNumerics(const std::string& spec) {
  Numerics n;
  if (spec.empty()) return n;
  n.flags = kNumericsSet | kTorchDefaultFlags;
  size_t at = 0;
  while (at <= spec.size()) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, comma - at);
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq),
                      value = eq == std::string::npos ? "" : item.substr(eq + 1);
    bool known = false;
    if (key == "matmul_precision") {
      for (uint32_t k = 0; k < std::size(kMatmulPrecisionNames); ++k) {
        if (value == kMatmulPrecisionNames[k]) {
          n.matmul_precision = k;
          known = true;
        }
      }
      SHMGRAD_CHECK(known, ErrorKind::kInvalidArgument, "--numerics: matmul_precision='", value,
                    "' is not highest, high or medium");
    }
    for (const NumericsKey& b : kNumericsKeys) {
      if (key != b.name) continue;
      SHMGRAD_CHECK(value == "0" || value == "1", ErrorKind::kInvalidArgument, "--numerics: ", key,
                    "='", value, "' must be 0 or 1");
      n.flags = value == "1" ? (n.flags | b.flag) : (n.flags & ~b.flag);
      known = true;
    }
    SHMGRAD_CHECK(known, ErrorKind::kInvalidArgument, "--numerics: unknown key '", key,
                  "' (matmul_precision, cudnn_tf32, cudnn_benchmark, cudnn_deterministic)");
    at = comma + 1;
  }
  return n;
}

Numerics checkedNumerics(const Numerics& shared) {
  const Numerics n = shared;  // one read of shared memory, then checked
  SHMGRAD_CHECK(numericsValid(n), ErrorKind::kCorrupt, "segment: numerics ", n.flags, "/",
                n.matmul_precision, " are not valid");
  return n;
}

std::string numericsText(const Numerics& n) {
  if ((n.flags & kNumericsSet) == 0 || !numericsValid(n)) return "";
  std::string out = std::string("matmul_precision=") + kMatmulPrecisionNames[n.matmul_precision];
  for (const NumericsKey& b : kNumericsKeys) {
    out += std::string(",") + b.name + ((n.flags & b.flag) ? "=1" : "=0");
  }
  return out;
}

std::string segmentName(const std::string& engine_name) { return "/" + bipName(engine_name); }
std::string segmentPath(const std::string& engine_name) {
  return "/dev/shm/" + bipName(engine_name);
}

uint64_t shmFreeBytes() {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) return 0;
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

bool processAlive(int pid) {
  if (pid <= 0) return false;
  return kill(pid, 0) == 0 || errno == EPERM;
}

Layout computeLayout(const SegmentSpec& spec) {
  SHMGRAD_CHECK(spec.num_slots >= 1 && spec.num_slots <= kMaxWorkers, ErrorKind::kInvalidArgument,
                "--workers ", spec.num_slots, " is out of range: use 1 to ", kMaxWorkers);
  SHMGRAD_CHECK(!spec.trainer_slot || spec.num_slots < kMaxWorkers, ErrorKind::kInvalidArgument,
                "--workers ", spec.num_slots, " leaves no slot for the trainer: use 1 to ",
                kMaxWorkers - 1);
  SHMGRAD_CHECK(!spec.params.empty(), ErrorKind::kInvalidArgument,
                "the model has no parameters: nothing to compute a gradient of");
  SHMGRAD_CHECK(spec.params.size() <= kMaxParams, ErrorKind::kInvalidArgument, "the model has ",
                spec.params.size(), " parameter tensors; shmgrad supports at most ", kMaxParams);
  SHMGRAD_CHECK(spec.max_batch >= 1 && spec.max_batch < kMaxBatch, ErrorKind::kInvalidArgument,
                "--max-batch ", spec.max_batch, " is out of range: use 1 to ", kMaxBatch - 1);
  SHMGRAD_CHECK(
      spec.input_bytes < config::kMaxCapacityBytes && spec.target_bytes < config::kMaxCapacityBytes,
      ErrorKind::kInvalidArgument, "explicit-batch capacity is too large");
  auto checkSpecShape = [](const std::string& what, const std::vector<int64_t>& shape) {
    checkedNumel(ErrorKind::kInvalidArgument, what.c_str(), shape.data(), shape.size());
  };
  for (const auto& p : spec.params) {
    checkSpecShape("parameter " + p.name, p.shape);
    SHMGRAD_CHECK(memoryFormatFits(static_cast<uint32_t>(p.memory_format),
                                   static_cast<uint32_t>(p.shape.size())),
                  ErrorKind::kInvalidArgument, "parameter ", p.name, " has memory format ",
                  static_cast<uint32_t>(p.memory_format), " for ", p.shape.size(), " dimensions");
  }
  SHMGRAD_CHECK(spec.buffers.size() <= kMaxBuffers, ErrorKind::kInvalidArgument, "the model has ",
                spec.buffers.size(), " buffers; shmgrad shares at most ", kMaxBuffers);
  for (const auto& b : spec.buffers) {
    checkSpecShape("buffer " + b.name, b.shape);
    SHMGRAD_CHECK(b.name.size() < kNameLen, ErrorKind::kInvalidArgument, "buffer name '", b.name,
                  "' is longer than ", kNameLen - 1, " characters");
    SHMGRAD_CHECK(b.dtype == DType::kFloat32 || b.dtype == DType::kInt64,
                  ErrorKind::kInvalidArgument, "buffer ", b.name,
                  ": only float32 and int64 "
                  "buffers are shared");
  }
  if (spec.data_count > 0) {
    SHMGRAD_CHECK(spec.data_count < kMaxBatch, ErrorKind::kInvalidArgument, "dataset of ",
                  spec.data_count, " examples is too large");
    checkSpecShape("dataset example shape", spec.data_example_shape);
    checkSpecShape("dataset target shape", spec.data_target_shape);
  }
  Layout l;
  uint64_t off = 0;
  for (const auto& p : spec.params) {
    SHMGRAD_CHECK(p.name.size() < kNameLen, ErrorKind::kInvalidArgument, "parameter name '", p.name,
                  "' is longer than ", kNameLen - 1, " characters");
    SHMGRAD_CHECK(p.shape.size() <= kMaxDims, ErrorKind::kInvalidArgument, "parameter ", p.name,
                  " has more than ", kMaxDims, " dimensions");
    l.param_offsets.push_back(off);
    off = alignUp(off + numelOf(p.shape), kAlignFloats);
  }
  l.param_floats = off;
  uint64_t pos = alignUp(sizeof(SegmentHeader), kAlign);
  auto take = [&pos](uint64_t bytes) {
    Region r{pos, bytes};
    pos = alignUp(pos + bytes, kAlign);
    return r;
  };
  l.params_table = take(sizeof(ParamEntry) * spec.params.size());
  l.buffers_table = take(sizeof(BufferEntry) * spec.buffers.size());
  uint64_t buffer_bytes = 0;
  for (const auto& b : spec.buffers) {
    l.buffer_offsets.push_back(buffer_bytes);
    buffer_bytes += alignUp(numelOf(b.shape) * dtypeSize(b.dtype), kAlign);
  }
  l.buffers = take(buffer_bytes);
  l.params = take(l.param_floats * sizeof(float));
  l.slot_stride = alignUp(slotBufferOffset(l.param_floats) + buffer_bytes, kAlign);
  l.slots = take(l.slot_stride * (spec.num_slots + (spec.trainer_slot ? 1 : 0)));
  l.reduced = take(l.param_floats * sizeof(float));
  l.accum = take(l.param_floats * sizeof(float));
  l.req_indices = take(static_cast<uint64_t>(spec.max_batch) * sizeof(int64_t));
  l.req_inputs = take(alignUp(spec.input_bytes, kAlign));
  l.req_targets = take(alignUp(spec.target_bytes, kAlign));
  uint64_t data_in = 0, data_tg = 0;
  if (spec.data_count > 0) {
    data_in = static_cast<uint64_t>(spec.data_count) * numelOf(spec.data_example_shape) * 4;
    data_tg = static_cast<uint64_t>(spec.data_count) * numelOf(spec.data_target_shape) *
              dtypeSize(spec.data_target_dtype);
  }
  l.data_inputs = take(data_in);
  l.data_targets = take(data_tg);
  l.device = take(kDeviceReserved);
  l.total_size = pos;
  return l;
}

void validateHeader(const SegmentHeader* h, uint64_t size) {
  SHMGRAD_CHECK(size >= sizeof(SegmentHeader), ErrorKind::kCorrupt, "segment of ", size,
                " bytes is smaller than a shmgrad header (", sizeof(SegmentHeader), " bytes)");
  SHMGRAD_CHECK(h->magic == kMagic, ErrorKind::kCorrupt,
                "segment is not a shmgrad engine (bad magic); remove it or pick another name");
  SHMGRAD_CHECK(h->layout_version == kLayoutVersion, ErrorKind::kCorrupt,
                "segment has layout version ", h->layout_version, " but this shmgrad reads ",
                kLayoutVersion, "; use the same shmgrad build for engine and trainer");
  SHMGRAD_CHECK(h->header_size == sizeof(SegmentHeader), ErrorKind::kCorrupt,
                "segment header size ", h->header_size, " differs from this build's ",
                sizeof(SegmentHeader));
  SHMGRAD_CHECK(h->total_size == size, ErrorKind::kCorrupt, "segment header says ", h->total_size,
                " bytes but the segment has ", size);
  SHMGRAD_CHECK(h->num_slots >= 1 && h->num_slots <= kMaxWorkers, ErrorKind::kCorrupt,
                "segment header: num_slots ", h->num_slots);
  SHMGRAD_CHECK(h->trainer_slots <= 1 && allSlots(*h) <= kMaxWorkers, ErrorKind::kCorrupt,
                "segment header: trainer_slots ", h->trainer_slots);
  SHMGRAD_CHECK(h->num_params >= 1 && h->num_params <= kMaxParams, ErrorKind::kCorrupt,
                "segment header: num_params ", h->num_params);
  SHMGRAD_CHECK(lossKindValid(h->loss), ErrorKind::kCorrupt, "segment header: loss ", h->loss);
  SHMGRAD_CHECK(h->max_batch >= 1 && h->max_batch < kMaxBatch, ErrorKind::kCorrupt,
                "segment header: max_batch ", h->max_batch);
  SHMGRAD_CHECK(h->param_floats % kAlignFloats == 0 && h->param_floats < kMaxParamFloats,
                ErrorKind::kCorrupt, "segment header: param_floats ", h->param_floats);
  SHMGRAD_CHECK(h->worker_kind <= static_cast<uint32_t>(WorkerKind::kEager), ErrorKind::kCorrupt,
                "segment header: worker kind ", h->worker_kind);
  SHMGRAD_CHECK(terminated(h->model_path, kPathLen) && terminated(h->job_path, kPathLen) &&
                    terminated(h->data_description, sizeof(h->data_description)),
                ErrorKind::kCorrupt, "segment header: unterminated string");
  const uint64_t pbytes = h->param_floats * sizeof(float);
  checkRegion("params_table", h->params_table, size, sizeof(ParamEntry) * h->num_params);
  SHMGRAD_CHECK(h->num_buffers <= kMaxBuffers, ErrorKind::kCorrupt, "segment header: num_buffers ",
                h->num_buffers);
  checkRegion("buffers_table", h->buffers_table, size, sizeof(BufferEntry) * h->num_buffers);
  checkRegion("buffers", h->buffers, size, 0);
  checkRegion("params", h->params, size, pbytes);
  SHMGRAD_CHECK(h->slot_stride >= slotBufferOffset(h->param_floats) + h->buffers.size &&
                    h->slot_stride % kAlign == 0 && h->slot_stride <= size,
                ErrorKind::kCorrupt, "segment header: slot_stride ", h->slot_stride);
  checkRegion("slots", h->slots, size, h->slot_stride * allSlots(*h));
  checkRegion("reduced", h->reduced, size, pbytes);
  checkRegion("accum", h->accum, size, pbytes);
  checkRegion("req_indices", h->req_indices, size, static_cast<uint64_t>(h->max_batch) * 8);
  checkRegion("req_inputs", h->req_inputs, size, 0);
  checkRegion("req_targets", h->req_targets, size, 0);
  // Every engine has the table (a CPU engine's all zeros, no device), and every reader of
  // the header may read all of it (status, the trainer, the workers): its region must
  // hold it. A GPU engine's table is checked in full.
  static_assert(kAlign % alignof(DeviceTable) == 0, "an aligned region aligns the table");
  checkRegion("device", h->device, size, sizeof(DeviceTable));
  const auto& devices =
      *reinterpret_cast<const DeviceTable*>(reinterpret_cast<const uint8_t*>(h) + h->device.offset);
  validateDeviceTable(devices, h->num_slots, h->param_floats, h->buffers.size, -1);
  SHMGRAD_CHECK(h->trainer_slots == 0 || devices.count == 0, ErrorKind::kCorrupt,
                "segment header: a trainer slot on an engine with devices");
  {
    // No two regions may overlap: a worker writing its slot must never touch another.
    Region all[] = {h->params_table, h->params,       h->slots,      h->reduced,
                    h->accum,        h->req_indices,  h->req_inputs, h->req_targets,
                    h->data_inputs,  h->data_targets, h->device,     h->buffers_table,
                    h->buffers};
    const size_t n = sizeof(all) / sizeof(all[0]);
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = i + 1; j < n; ++j) {
        if (all[i].size == 0 || all[j].size == 0) continue;
        const bool apart = all[i].offset + all[i].size <= all[j].offset ||
                           all[j].offset + all[j].size <= all[i].offset;
        SHMGRAD_CHECK(apart, ErrorKind::kCorrupt, "segment header: regions ", describe(all[i]),
                      " and ", describe(all[j]), " overlap");
      }
    }
  }
  SHMGRAD_CHECK(h->data_count >= 0 && h->data_count < kMaxBatch, ErrorKind::kCorrupt,
                "segment header: data_count ", h->data_count);
  if (h->data_count > 0) {
    uint64_t in = checkShape("dataset example shape", h->data_example_shape);
    uint64_t tg = checkShape("dataset target shape", h->data_target_shape);
    SHMGRAD_CHECK(h->data_target_dtype == static_cast<uint32_t>(DType::kInt64) ||
                      h->data_target_dtype == static_cast<uint32_t>(DType::kFloat32),
                  ErrorKind::kCorrupt, "segment header: dataset target dtype ",
                  h->data_target_dtype);
    const uint64_t tsize = dtypeSize(h->data_target_dtype);  // 4 or 8: checked above
    uint64_t n = static_cast<uint64_t>(h->data_count);
    SHMGRAD_CHECK(in == 0 || n <= size / (in * 4), ErrorKind::kCorrupt,
                  "segment header: dataset larger than the segment");
    SHMGRAD_CHECK(tg == 0 || n <= size / (tg * tsize), ErrorKind::kCorrupt,
                  "segment header: dataset targets larger than the segment");
    checkRegion("data_inputs", h->data_inputs, size, n * in * 4);
    checkRegion("data_targets", h->data_targets, size, n * tg * tsize);
  }
  // Every parameter inside the parameter buffer, aligned, with a sane shape.
  const auto* table = reinterpret_cast<const ParamEntry*>(reinterpret_cast<const uint8_t*>(h) +
                                                          h->params_table.offset);
  for (uint32_t i = 0; i < h->num_params; ++i) {
    const ParamEntry& p = table[i];
    SHMGRAD_CHECK(terminated(p.name, kNameLen), ErrorKind::kCorrupt, "segment header: parameter ",
                  i, " has an unterminated name");
    uint64_t n = checkShape("parameter shape", p.shape);
    SHMGRAD_CHECK(n == p.numel && p.offset % kAlignFloats == 0 && p.offset <= h->param_floats &&
                      p.numel <= h->param_floats - p.offset,
                  ErrorKind::kCorrupt, "segment header: parameter ", p.name,
                  " lies outside the parameter buffer");
    SHMGRAD_CHECK(memoryFormatFits(p.memory_format, p.shape.ndim), ErrorKind::kCorrupt,
                  "segment header: parameter ", p.name, " has memory format ", p.memory_format,
                  " for ", p.shape.ndim, " dimensions");
  }
  // Every buffer inside the buffers region, with a sane shape and dtype.
  const auto* buffers = reinterpret_cast<const BufferEntry*>(reinterpret_cast<const uint8_t*>(h) +
                                                             h->buffers_table.offset);
  for (uint32_t i = 0; i < h->num_buffers; ++i) {
    const BufferEntry& b = buffers[i];
    SHMGRAD_CHECK(terminated(b.name, kNameLen), ErrorKind::kCorrupt, "segment header: buffer ", i,
                  " has an unterminated name");
    const uint64_t esize = dtypeSize(b.dtype);
    SHMGRAD_CHECK(esize != 0, ErrorKind::kCorrupt, "segment header: buffer ", b.name, " dtype ",
                  b.dtype);
    const uint64_t n = checkShape("buffer shape", b.shape);
    SHMGRAD_CHECK(b.nbytes == n * esize && b.offset % kAlign == 0 && b.offset <= h->buffers.size &&
                      b.nbytes <= h->buffers.size - b.offset,
                  ErrorKind::kCorrupt, "segment header: buffer ", b.name,
                  " lies outside the buffers region");
  }
}

Segment::Segment(std::string name, uint8_t* base, uint64_t size)
    : name_(std::move(name)),
      base_(base),
      size_(size),
      header_(reinterpret_cast<SegmentHeader*>(base)) {}

Segment::~Segment() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

std::unique_ptr<Segment> Segment::create(const SegmentSpec& spec) {
  checkEngineName(spec.name);
  Layout l = computeLayout(spec);
  SHMGRAD_CHECK(spec.model_path.size() < kPathLen && spec.job_path.size() < kPathLen,
                ErrorKind::kInvalidArgument, "model or job path longer than ", kPathLen - 1,
                " characters");

  // A segment of this name may be left by a coordinator that was killed.
  removeIfStale(spec.name);

  uint64_t free_bytes = shmFreeBytes();
  SHMGRAD_CHECK(free_bytes >= l.total_size, ErrorKind::kNoSpace, "engine '", spec.name, "' needs ",
                l.total_size, " bytes of shared memory but /dev/shm has ", free_bytes,
                " free; free space in /dev/shm, enlarge it (mount -o remount,size=...), or ask "
                "for less (fewer --workers, smaller --max-batch/--input-capacity-mb, no dataset)");

  const std::string name = bipName(spec.name);
  std::unique_ptr<bip::shared_memory_object> shm;
  try {
    bip::permissions perm(0600);
    shm = std::make_unique<bip::shared_memory_object>(bip::create_only, name.c_str(),
                                                      bip::read_write, perm);
  } catch (const bip::interprocess_exception& e) {
    raise(ErrorKind::kSystem, "cannot create shared memory ", segmentPath(spec.name), ": ",
          e.what());
  }
  int fd = shm->get_mapping_handle().handle;
  auto fail = [&](ErrorKind kind, const std::string& msg) {
    bip::shared_memory_object::remove(name.c_str());
    raise(kind, msg);
  };
  if (detail::retryEintr([&] { return ::fchmod(fd, 0600); }) < 0) {
    fail(ErrorKind::kSystem, "fchmod 0600 failed: " + detail::errnoText());
  }
  // Reserve every page now: on tmpfs this fails with ENOSPC instead of a SIGBUS later.
  // posix_fallocate returns the error number itself (it does not set errno).
  int rc;
  do {
    rc = ::posix_fallocate(fd, 0, static_cast<off_t>(l.total_size));
  } while (rc == EINTR);
  if (rc != 0) {
    fail(rc == ENOSPC ? ErrorKind::kNoSpace : ErrorKind::kSystem,
         "cannot allocate " + std::to_string(l.total_size) + " bytes in /dev/shm (" +
             std::to_string(shmFreeBytes()) + " free): " + std::strerror(rc) +
             "; free space in /dev/shm or ask for a smaller engine");
  }
  void* base = ::mmap(nullptr, l.total_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) fail(ErrorKind::kSystem, "mmap failed: " + detail::errnoText());
  try {
    return initialize(spec, l, static_cast<uint8_t*>(base), fd);
  } catch (...) {
    ::munmap(base, l.total_size);
    bip::shared_memory_object::remove(name.c_str());
    throw;
  }
}

std::unique_ptr<Segment> Segment::initialize(const SegmentSpec& spec, const Layout& l,
                                             uint8_t* base, int fd) {
  // The coordinator holds an exclusive lock on the segment for the engine's life: a
  // later `serve` of the same name treats the segment as stale only if it can take
  // the lock, i.e. the coordinator is gone (the kernel drops the lock with it).
  int lock_fd = ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_CLOEXEC);
  SHMGRAD_CHECK(lock_fd >= 0 && ::flock(lock_fd, LOCK_EX | LOCK_NB) == 0, ErrorKind::kBusy,
                "engine '", spec.name, "' is being created by another process");
  try {
    writeHeader(spec, l, base);
  } catch (...) {
    ::close(lock_fd);
    throw;
  }
  auto seg = std::unique_ptr<Segment>(new Segment(spec.name, base, l.total_size));
  seg->lock_fd_ = lock_fd;
  return seg;
}

void Segment::writeHeader(const SegmentSpec& spec, const Layout& l, uint8_t* base) {
  // Fresh tmpfs pages are zero; construct the header's atomics in place.
  SegmentHeader* h = new (base) SegmentHeader();
  h->magic = kMagic;
  h->layout_version = kLayoutVersion;
  h->header_size = sizeof(SegmentHeader);
  h->total_size = l.total_size;
  h->owner_uid = getuid();
  h->coordinator_pid = getpid();
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  h->created_ns = static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
  std::snprintf(h->model_path, kPathLen, "%s", spec.model_path.c_str());
  std::snprintf(h->job_path, kPathLen, "%s", spec.job_path.c_str());
  h->worker_kind = static_cast<uint32_t>(spec.worker_kind);
  h->loss = static_cast<uint32_t>(spec.loss);
  h->num_slots = spec.num_slots;
  h->trainer_slots = spec.trainer_slot ? 1 : 0;
  h->num_params = static_cast<uint32_t>(spec.params.size());
  h->threads_per_worker = spec.threads_per_worker;
  h->param_floats = l.param_floats;
  h->max_batch = spec.max_batch;
  h->params_table = l.params_table;
  h->num_buffers = static_cast<uint32_t>(spec.buffers.size());
  h->buffers_table = l.buffers_table;
  h->buffers = l.buffers;
  h->params = l.params;
  h->slots = l.slots;
  h->slot_stride = l.slot_stride;
  h->reduced = l.reduced;
  h->accum = l.accum;
  h->req_indices = l.req_indices;
  h->req_inputs = l.req_inputs;
  h->req_targets = l.req_targets;
  h->data_inputs = l.data_inputs;
  h->data_targets = l.data_targets;
  h->device = l.device;
  h->data_count = spec.data_count;
  if (spec.data_count > 0) {
    fillShape(&h->data_example_shape, spec.data_example_shape);
    fillShape(&h->data_target_shape, spec.data_target_shape);
    h->data_target_dtype = static_cast<uint32_t>(spec.data_target_dtype);
    std::snprintf(h->data_description, sizeof(h->data_description), "%s",
                  spec.data_description.c_str());
  }
  h->control.engine_state.store(static_cast<uint32_t>(EngineState::kStarting));
  h->control.target_workers.store(spec.num_slots);
  h->control.loss_reduction.store(static_cast<uint32_t>(spec.loss_reduction));
  h->control.numerics = spec.numerics;
  h->control.placement_auto.store(spec.placement_auto ? 1 : 0);
  auto* table = reinterpret_cast<ParamEntry*>(base + l.params_table.offset);
  for (size_t i = 0; i < spec.params.size(); ++i) {
    fillEntry(&table[i], spec.params[i].name, spec.params[i].shape, l.param_offsets[i]);
    table[i].numel = numelOf(spec.params[i].shape);
    table[i].memory_format = static_cast<uint32_t>(spec.params[i].memory_format);
  }
  auto* btable = reinterpret_cast<BufferEntry*>(base + l.buffers_table.offset);
  for (size_t i = 0; i < spec.buffers.size(); ++i) {
    const BufferSpec& b = spec.buffers[i];
    fillEntry(&btable[i], b.name, b.shape, l.buffer_offsets[i]);
    btable[i].dtype = static_cast<uint32_t>(b.dtype);
    btable[i].nbytes = numelOf(b.shape) * dtypeSize(b.dtype);
  }
  validateHeader(h, l.total_size);
}

std::unique_ptr<Segment> Segment::open(const std::string& engine_name) {
  checkEngineName(engine_name);
  const std::string path = segmentPath(engine_name);
  struct stat seen;
  const auto not_found = [&] {
    raise(ErrorKind::kNotFound, "no engine named '", engine_name, "' is running (", path,
          " does not exist); start one with `shmgrad serve --name ", engine_name, " ...`");
  };
  if (!checkOwnEntry(path, &seen)) not_found();
  int fd = ::open(path.c_str(), O_RDWR | kSegmentOpenFlags);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT) not_found();  // removed since the lstat
    SHMGRAD_CHECK(e != EACCES, ErrorKind::kBusy, "permission denied on ", path,
                  ": the engine belongs to another user; only its owner can attach");
    SHMGRAD_CHECK(e != ELOOP, ErrorKind::kBusy, path,
                  " became a symbolic link while it was being opened: refused, not followed");
    raise(ErrorKind::kSystem, "cannot open ", path, ": ", std::strerror(e));
  }
  struct stat st;
  checkOpenedEntry(path, fd, seen, &st);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < sizeof(SegmentHeader)) {
    ::close(fd);
    raise(ErrorKind::kCorrupt, path, " has ", size,
          " bytes, too few for a shmgrad header (the engine may still be starting)");
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  SHMGRAD_CHECK(base != MAP_FAILED, ErrorKind::kSystem, "mmap ", path, ": ", detail::errnoText());
  auto seg = std::unique_ptr<Segment>(new Segment(engine_name, static_cast<uint8_t*>(base), size));
  validateHeader(seg->header(), size);
  return seg;
}

bool Segment::removeIfStale(const std::string& engine_name) {
  checkEngineName(engine_name);
  // Stale only if no coordinator holds its lock (a live one holds it until it exits,
  // and the kernel drops it when the coordinator dies, however it dies).
  // Only our own regular file is ever opened, locked or removed (checkOwnEntry).
  const std::string path = segmentPath(engine_name);
  struct stat seen;
  if (!checkOwnEntry(path, &seen)) return false;
  int fd = ::open(path.c_str(), O_RDONLY | kSegmentOpenFlags);
  if (fd < 0) {
    SHMGRAD_CHECK(errno == ENOENT, ErrorKind::kBusy, "cannot open ", path, " (",
                  detail::errnoText(), "): refused; pick another --name");
    return false;
  }
  struct stat st;
  checkOpenedEntry(path, fd, seen, &st);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    int pid = 0;
    try {
      pid = open(engine_name)->header()->coordinator_pid;
    } catch (const Error&) {
    }
    raise(ErrorKind::kBusy, "an engine named '", engine_name,
          "' is already running (coordinator pid ", pid, "); stop it with `shmgrad stop ",
          engine_name, "` or pick another --name");
  }
  // Holding the lock, unlink: a new coordinator creates a new file under the name.
  bool removed = remove(engine_name);
  ::close(fd);
  return removed;
}

bool Segment::remove(const std::string& engine_name) {
  checkEngineName(engine_name);
  return bip::shared_memory_object::remove(bipName(engine_name).c_str());
}

bool Segment::exists(const std::string& engine_name) {
  checkEngineName(engine_name);
  // Anything under the name counts, a dangling symbolic link too: the name is taken.
  struct stat st;
  return ::lstat(segmentPath(engine_name).c_str(), &st) == 0;
}

}  // namespace shmgrad::ipc
