#include "engine/model_file.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "ipc/error.h"
#include "ipc/layout.h"

namespace shmgrad::engine {
namespace {

constexpr char kMagic[8] = {'S', 'H', 'M', 'G', 'R', 'A', 'D', 'P'};
constexpr uint32_t kVersion = 3;

void checkName(const std::string& path, const std::string& name) {
  SHMGRAD_CHECK(!name.empty() && name.size() < ipc::kNameLen, ErrorKind::kInvalidArgument,
                "model file ", path, ": a name of ", name.size(), " bytes (1 to ",
                ipc::kNameLen - 1, ")");
}

uint64_t numelOf(const std::string& path, const std::string& name,
                 const std::vector<int64_t>& dims) {
  SHMGRAD_CHECK(dims.size() <= ipc::kMaxDims, ErrorKind::kInvalidArgument, "model file ", path,
                ": ", name, " has ", dims.size(), " dimensions");
  return ipc::checkedNumel(ErrorKind::kInvalidArgument, name.c_str(), dims.data(), dims.size());
}

}  // namespace

ModelDescription readModelFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SHMGRAD_CHECK(f.good(), ErrorKind::kNotFound, "model file ", path, " cannot be opened");
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)),
                                   std::istreambuf_iterator<char>());
  return parseModelFile(bytes, path);
}

ModelDescription parseModelFile(const std::vector<uint8_t>& file, const std::string& path) {
  size_t at = 0;  // bytes consumed
  // Checked before every copy, and before every allocation a size read from the file asks
  // for (a truncated file's huge shape fails here, not in the allocator).
  auto need = [&](uint64_t n) {
    SHMGRAD_CHECK(n <= file.size() - at, ErrorKind::kInvalidArgument, "model file ", path,
                  " is truncated");
  };
  auto read = [&](void* out, size_t n) {
    need(n);
    if (n > 0) std::memcpy(out, file.data() + at, n);
    at += n;
  };
  auto readU32 = [&] {
    uint32_t v = 0;
    read(&v, sizeof(v));
    return v;
  };
  char magic[8];
  read(magic, sizeof(magic));
  const uint32_t version = readU32();
  SHMGRAD_CHECK(std::memcmp(magic, kMagic, 8) == 0 && version == kVersion,
                ErrorKind::kInvalidArgument, "model file ", path,
                " is not a shmgrad model description (version ", kVersion, ")");
  // One record: u32 name length, the name, u32 tag (a parameter's memory format, a
  // buffer's dtype), u32 ndim, i64 dims, the values (a parameter's in its memory format's
  // order).
  auto readRecord = [&](bool is_param, std::string* name, std::vector<int64_t>* dims,
                        ipc::DType* dtype, ipc::MemoryFormat* format, std::vector<uint8_t>* bytes) {
    const uint32_t name_len = readU32();
    SHMGRAD_CHECK(name_len >= 1 && name_len < ipc::kNameLen, ErrorKind::kInvalidArgument,
                  "model file ", path, ": a name of ", name_len, " bytes");
    name->assign(name_len, '\0');
    read(name->data(), name_len);
    *dtype = ipc::DType::kFloat32;
    const uint32_t tag = readU32();
    if (!is_param) {
      SHMGRAD_CHECK(tag == static_cast<uint32_t>(ipc::DType::kFloat32) ||
                        tag == static_cast<uint32_t>(ipc::DType::kInt64),
                    ErrorKind::kInvalidArgument, "model file ", path, ": ", *name, " has dtype ",
                    tag);
      *dtype = static_cast<ipc::DType>(tag);
    }
    const uint32_t ndim = readU32();
    SHMGRAD_CHECK(ndim <= ipc::kMaxDims, ErrorKind::kInvalidArgument, "model file ", path, ": ",
                  *name, " has ", ndim, " dimensions");
    if (is_param) {
      SHMGRAD_CHECK(ipc::memoryFormatFits(tag, ndim), ErrorKind::kInvalidArgument, "model file ",
                    path, ": ", *name, " has memory format ", tag, " for ", ndim, " dimensions");
      *format = static_cast<ipc::MemoryFormat>(tag);
    }
    dims->resize(ndim);
    if (ndim > 0) read(dims->data(), ndim * sizeof(int64_t));
    const uint64_t numel = numelOf(path, *name, *dims);
    need(numel * ipc::dtypeSize(*dtype));  // numel <= 2^40 (numelOf): no overflow
    bytes->resize(numel * ipc::dtypeSize(*dtype));
    read(bytes->data(), bytes->size());
  };
  ModelDescription out;
  const uint32_t count = readU32();
  SHMGRAD_CHECK(count >= 1 && count <= ipc::kMaxParams, ErrorKind::kInvalidArgument, "model file ",
                path, " holds ", count, " parameters; use 1 to ", ipc::kMaxParams);
  for (uint32_t i = 0; i < count; ++i) {
    std::string name;
    std::vector<int64_t> dims;
    ipc::DType dtype;
    ipc::MemoryFormat format;
    std::vector<uint8_t> bytes;
    readRecord(/*is_param=*/true, &name, &dims, &dtype, &format, &bytes);
    std::vector<float> values(bytes.size() / sizeof(float));
    if (!values.empty()) std::memcpy(values.data(), bytes.data(), bytes.size());
    out.params.push_back({name, dims, format});
    out.param_values.push_back(std::move(values));
  }
  const uint32_t buffers = readU32();
  SHMGRAD_CHECK(buffers <= ipc::kMaxBuffers, ErrorKind::kInvalidArgument, "model file ", path,
                " holds ", buffers, " buffers; at most ", ipc::kMaxBuffers, " are shared");
  for (uint32_t i = 0; i < buffers; ++i) {
    std::string name;
    std::vector<int64_t> dims;
    ipc::DType dtype;
    ipc::MemoryFormat format;
    std::vector<uint8_t> bytes;
    readRecord(/*is_param=*/false, &name, &dims, &dtype, &format, &bytes);
    out.buffers.push_back({name, dims, dtype});
    out.buffer_values.push_back(std::move(bytes));
  }
  SHMGRAD_CHECK(at == file.size(), ErrorKind::kInvalidArgument, "model file ", path, " has ",
                file.size() - at, " bytes after its last record");
  return out;
}

void writeModelFile(const std::string& path, const ModelDescription& m) {
  SHMGRAD_CHECK(!m.params.empty() && m.params.size() <= ipc::kMaxParams &&
                    m.params.size() == m.param_values.size(),
                ErrorKind::kInvalidArgument, "the model has ", m.params.size(),
                " parameters; shmgrad needs 1 to ", ipc::kMaxParams);
  SHMGRAD_CHECK(m.buffers.size() <= ipc::kMaxBuffers && m.buffers.size() == m.buffer_values.size(),
                ErrorKind::kInvalidArgument, "the model has ", m.buffers.size(),
                " shared buffers; at most ", ipc::kMaxBuffers);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  SHMGRAD_CHECK(f.good(), ErrorKind::kSystem, "cannot write the model file ", path);
  auto put = [&](const void* data, size_t n) {
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  };
  auto putU32 = [&](uint32_t v) { put(&v, sizeof(v)); };
  auto putRecord = [&](const std::string& name, const std::vector<int64_t>& dims, ipc::DType dtype,
                       uint32_t tag, const void* values, size_t bytes) {
    checkName(path, name);
    SHMGRAD_CHECK(numelOf(path, name, dims) * ipc::dtypeSize(dtype) == bytes,
                  ErrorKind::kInvalidArgument, name, ": ", bytes, " bytes of values for its shape");
    putU32(static_cast<uint32_t>(name.size()));
    put(name.data(), name.size());
    putU32(tag);
    putU32(static_cast<uint32_t>(dims.size()));
    put(dims.data(), dims.size() * sizeof(int64_t));
    put(values, bytes);
  };
  put(kMagic, sizeof(kMagic));
  putU32(kVersion);
  putU32(static_cast<uint32_t>(m.params.size()));
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ipc::ParamSpec& p = m.params[i];
    SHMGRAD_CHECK(ipc::memoryFormatFits(static_cast<uint32_t>(p.memory_format),
                                        static_cast<uint32_t>(p.shape.size())),
                  ErrorKind::kInvalidArgument, p.name, ": memory format ",
                  static_cast<uint32_t>(p.memory_format), " for ", p.shape.size(), " dimensions");
    putRecord(p.name, p.shape, ipc::DType::kFloat32, static_cast<uint32_t>(p.memory_format),
              m.param_values[i].data(), m.param_values[i].size() * sizeof(float));
  }
  putU32(static_cast<uint32_t>(m.buffers.size()));
  for (size_t i = 0; i < m.buffers.size(); ++i) {
    const ipc::BufferSpec& b = m.buffers[i];
    putRecord(b.name, b.shape, b.dtype, static_cast<uint32_t>(b.dtype), m.buffer_values[i].data(),
              m.buffer_values[i].size());
  }
  f.flush();
  SHMGRAD_CHECK(f.good(), ErrorKind::kSystem, "writing the model file ", path, " failed");
}

}  // namespace shmgrad::engine
