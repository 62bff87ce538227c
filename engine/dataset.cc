#include "engine/dataset.h"

#include <zlib.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <type_traits>

#include "ipc/config.h"
#include "ipc/error.h"
#include "ipc/segment.h"

namespace shmgrad::engine {
namespace {

// Reads a whole file, gunzipping it when its name ends in .gz.
std::vector<uint8_t> readMaybeGz(const std::string& path) {
  std::vector<uint8_t> out;
  gzFile f = gzopen(path.c_str(), "rb");
  SHMGRAD_CHECK(f != nullptr, ErrorKind::kNotFound, "cannot open '", path,
                "'; install Debian's dataset-fashion-mnist package (apt-get install "
                "dataset-fashion-mnist) or set SHMGRAD_FASHION_MNIST_DIR");
  uint8_t buf[1 << 16];
  for (;;) {
    int n = gzread(f, buf, sizeof(buf));
    if (n < 0) {
      gzclose(f);
      raise(ErrorKind::kInvalidArgument, "'", path, "' is not a readable (gzip) file");
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  gzclose(f);
  return out;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Parses an IDX file (ubyte data): returns dims and a pointer to the data. The element
// count is checked (ipc::checkedNumel) before the size comparison, so no product of four
// 32-bit dimensions can wrap to the file's size.
std::vector<int64_t> parseIdx(const std::vector<uint8_t>& buf, const std::string& path,
                              const uint8_t** data) {
  SHMGRAD_CHECK(buf.size() >= 4 && buf[0] == 0 && buf[1] == 0 && buf[2] == 0x08,
                ErrorKind::kInvalidArgument, "'", path, "' is not an IDX ubyte file");
  uint32_t ndim = buf[3];
  SHMGRAD_CHECK(ndim >= 1 && ndim <= 4 && buf.size() >= 4 + 4 * ndim, ErrorKind::kInvalidArgument,
                "'", path, "' has a bad IDX header");
  std::vector<int64_t> dims;
  for (uint32_t i = 0; i < ndim; ++i) dims.push_back(be32(&buf[4 + 4 * i]));
  const uint64_t numel =
      ipc::checkedNumel(ErrorKind::kInvalidArgument, ("'" + path + "' (IDX header)").c_str(),
                        dims.data(), dims.size());
  SHMGRAD_CHECK(buf.size() - (4 + 4 * ndim) == numel, ErrorKind::kInvalidArgument, "'", path,
                "' is truncated: header says ", numel, " bytes of data");
  *data = buf.data() + 4 + 4 * ndim;
  return dims;
}

struct Npy {
  char kind = 0;       // 'f', 'i', 'u' or 'b' (numpy's type characters)
  uint64_t width = 0;  // bytes per element
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  const uint8_t* data = nullptr;  // numel * width bytes, inside the parsed buffer
};

// A non-negative decimal integer, all of `text` but surrounding spaces; -1 if it is not one
// (or exceeds `max`).
int64_t parseCount(const std::string& text, int64_t max) {
  const size_t b = text.find_first_not_of(' ');
  if (b == std::string::npos) return -1;
  const size_t e = text.find_last_not_of(' ');
  int64_t v = 0;
  for (size_t i = b; i <= e; ++i) {
    if (text[i] < '0' || text[i] > '9') return -1;
    const int digit = text[i] - '0';
    if (v > (max - digit) / 10) return -1;
    v = v * 10 + digit;
  }
  return v;
}

// Parses a .npy file's bytes: format version 1, 2 or 3, a C-order array of one of the
// element types convert() takes. Every field is checked before use.
Npy parseNpy(const std::vector<uint8_t>& buf, const std::string& path) {
  SHMGRAD_CHECK(buf.size() >= 10 && std::memcmp(buf.data(), "\x93NUMPY", 6) == 0,
                ErrorKind::kInvalidArgument, "'", path,
                "' is not a .npy file (save it with numpy.save)");
  const uint8_t major = buf[6];
  SHMGRAD_CHECK(major >= 1 && major <= 3, ErrorKind::kInvalidArgument, "'", path,
                "' has .npy format version ", int(major), "; shmgrad reads 1 to 3");
  size_t hlen, hstart;
  if (major == 1) {
    hlen = buf[8] | (buf[9] << 8);
    hstart = 10;
  } else {
    SHMGRAD_CHECK(buf.size() >= 12, ErrorKind::kInvalidArgument, "'", path, "' is truncated");
    hlen = buf[8] | (buf[9] << 8) | (buf[10] << 16) | (size_t{buf[11]} << 24);
    hstart = 12;
  }
  SHMGRAD_CHECK(hlen <= buf.size() - hstart, ErrorKind::kInvalidArgument, "'", path,
                "' has a truncated header");
  const std::string header(buf.begin() + hstart, buf.begin() + hstart + hlen);
  // The value of 'key': the text after its colon, up to the end of the header.
  auto field = [&](const std::string& key) {
    size_t p = header.find("'" + key + "'");
    SHMGRAD_CHECK(p != std::string::npos, ErrorKind::kInvalidArgument, "'", path,
                  "': header lacks ", key);
    p = header.find(':', p);
    SHMGRAD_CHECK(p != std::string::npos, ErrorKind::kInvalidArgument, "'", path, "': header's ",
                  key, " has no value");
    return header.substr(p + 1);
  };
  const std::string d = field("descr");
  const size_t q1 = d.find('\'');
  const size_t q2 = q1 == std::string::npos ? q1 : d.find('\'', q1 + 1);
  SHMGRAD_CHECK(q2 != std::string::npos, ErrorKind::kInvalidArgument, "'", path,
                "': header's descr is not a quoted dtype");
  const std::string descr = d.substr(q1 + 1, q2 - q1 - 1);
  // "<f4", "|u1", ...: byte order, type character, width in bytes (at most 8).
  const int64_t width = descr.size() >= 3 ? parseCount(descr.substr(2), 8) : -1;
  Npy out;
  out.kind = descr.size() >= 2 ? descr[1] : 0;
  out.width = width > 0 ? static_cast<uint64_t>(width) : 0;
  const bool known = (out.kind == 'f' && (width == 4 || width == 8)) ||
                     (out.kind == 'i' && (width == 1 || width == 4 || width == 8)) ||
                     ((out.kind == 'u' || out.kind == 'b') && width == 1);
  SHMGRAD_CHECK(known, ErrorKind::kInvalidArgument, "'", path, "' has dtype ", descr,
                "; use float32, float64, int64, int32, int8 or uint8");
  SHMGRAD_CHECK(descr[0] != '>' || width == 1, ErrorKind::kInvalidArgument, "'", path,
                "' is big-endian; save it little-endian");
  const std::string fortran = field("fortran_order");
  SHMGRAD_CHECK(fortran.find("True") >= fortran.find(','), ErrorKind::kInvalidArgument, "'", path,
                "' is in Fortran order; save a C-contiguous array (numpy.ascontiguousarray)");
  const std::string s = field("shape");
  const size_t l = s.find('('), r = l == std::string::npos ? l : s.find(')', l);
  SHMGRAD_CHECK(r != std::string::npos, ErrorKind::kInvalidArgument, "'", path,
                "': header's shape is not a tuple");
  std::stringstream ss(s.substr(l + 1, r - l - 1));
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    if (tok.find_first_not_of(' ') == std::string::npos) continue;
    const int64_t dim = parseCount(tok, ipc::kMaxDimSize - 1);
    SHMGRAD_CHECK(dim >= 0 && out.shape.size() < ipc::kMaxDims, ErrorKind::kInvalidArgument, "'",
                  path, "': shape ", s.substr(l, r - l + 1), " is not one of at most ",
                  ipc::kMaxDims, " sizes");
    out.shape.push_back(dim);
  }
  out.numel = ipc::checkedNumel(ErrorKind::kInvalidArgument, ("'" + path + "'").c_str(),
                                out.shape.data(), out.shape.size());
  const uint64_t data_bytes = buf.size() - hstart - hlen;
  SHMGRAD_CHECK(out.numel <= data_bytes / out.width, ErrorKind::kInvalidArgument, "'", path,
                "' is truncated: its shape needs ", out.numel * out.width,
                " bytes of data, it has ", data_bytes);
  out.data = buf.data() + hstart + hlen;
  return out;
}

// The array's elements as T (parseNpy checked the type and the size). Each element goes
// to T from its own type: an int64 through a double rounded to 2^63 for values near the
// top of its range, which no int64 holds (a float-to-integer conversion out of range).
template <typename T>
void convert(const Npy& a, std::vector<T>* out) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, int64_t>);
  // Integer targets come from integer arrays only (parseNpyPair sends float ones to float).
  SHMGRAD_CHECK(std::is_floating_point_v<T> || a.kind != 'f', ErrorKind::kInvalidArgument,
                "a float array read as integers");
  out->resize(a.numel);
  const uint8_t* p = a.data;
  auto load = [&p](auto x) {
    std::memcpy(&x, p, sizeof x);
    return static_cast<T>(x);
  };
  for (uint64_t i = 0; i < a.numel; ++i, p += a.width) {
    T v;
    if (a.kind == 'f' && a.width == 4) {
      v = load(float{});
    } else if (a.kind == 'f' && a.width == 8) {
      v = load(double{});  // to float only (checked above)
    } else if (a.kind == 'i' && a.width == 8) {
      v = load(int64_t{});
    } else if (a.kind == 'i' && a.width == 4) {
      v = load(int32_t{});
    } else if (a.kind == 'i' && a.width == 1) {
      v = load(int8_t{});
    } else {  // 'u' or 'b', one byte
      v = load(uint8_t{});
    }
    (*out)[i] = v;
  }
}

std::vector<uint8_t> readFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SHMGRAD_CHECK(f.good(), ErrorKind::kNotFound, "cannot open .npy file '", path, "'");
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)),
                              std::istreambuf_iterator<char>());
}

}  // namespace

std::string fashionMnistDir() { return config::tunableValue("SHMGRAD_FASHION_MNIST_DIR"); }

Dataset loadFashionMnist(const std::string& dir, const std::string& split) {
  SHMGRAD_CHECK(split == "train" || split == "test", ErrorKind::kInvalidArgument,
                "fashion-mnist split '", split, "': use train or test");
  const std::string prefix = dir + "/" + (split == "train" ? "train" : "t10k");
  const std::string ipath = prefix + "-images-idx3-ubyte.gz";
  const std::string lpath = prefix + "-labels-idx1-ubyte.gz";
  return parseFashionMnist(readMaybeGz(ipath), ipath, readMaybeGz(lpath), lpath, split);
}

Dataset parseFashionMnist(const std::vector<uint8_t>& images, const std::string& images_name,
                          const std::vector<uint8_t>& labels, const std::string& labels_name,
                          const std::string& split) {
  const uint8_t *idata, *ldata;
  auto idims = parseIdx(images, images_name, &idata);
  auto ldims = parseIdx(labels, labels_name, &ldata);
  SHMGRAD_CHECK(idims.size() == 3 && ldims.size() == 1 && idims[0] == ldims[0],
                ErrorKind::kInvalidArgument, "fashion-mnist files ", images_name, " and ",
                labels_name, " disagree on the number of examples");
  Dataset d;
  d.description = "fashion-mnist:" + split;
  d.count = idims[0];
  d.example_shape = {1, idims[1], idims[2]};
  const uint64_t n = images.size() - (4 + 4 * idims.size());  // parseIdx: the product of idims
  d.inputs.resize(n);
  for (uint64_t i = 0; i < n; ++i) d.inputs[i] = static_cast<float>(idata[i]) / 255.0f;
  d.target_dtype = ipc::DType::kInt64;
  d.targets_i64.assign(ldata, ldata + d.count);
  return d;
}

Dataset loadNpyPair(const std::string& inputs_path, const std::string& targets_path) {
  return parseNpyPair(readFile(inputs_path), inputs_path, readFile(targets_path), targets_path);
}

Dataset parseNpyPair(const std::vector<uint8_t>& inputs, const std::string& inputs_name,
                     const std::vector<uint8_t>& targets, const std::string& targets_name) {
  Npy x = parseNpy(inputs, inputs_name);
  Npy y = parseNpy(targets, targets_name);
  SHMGRAD_CHECK(!x.shape.empty() && !y.shape.empty() && x.shape[0] == y.shape[0],
                ErrorKind::kInvalidArgument, "npy dataset: inputs have ",
                x.shape.empty() ? 0 : x.shape[0], " examples but targets have ",
                y.shape.empty() ? 0 : y.shape[0], "; give one target per input");
  SHMGRAD_CHECK(x.shape[0] > 0, ErrorKind::kInvalidArgument, "npy dataset is empty");
  Dataset d;
  d.description = "npy:" + inputs_name + "," + targets_name;
  d.count = x.shape[0];
  d.example_shape.assign(x.shape.begin() + 1, x.shape.end());
  convert(x, &d.inputs);
  d.target_shape.assign(y.shape.begin() + 1, y.shape.end());
  if (y.kind == 'f') {
    d.target_dtype = ipc::DType::kFloat32;
    convert(y, &d.targets_f32);
  } else {
    d.target_dtype = ipc::DType::kInt64;
    convert(y, &d.targets_i64);
  }
  return d;
}

DatasetSpec parseDatasetSpec(const std::string& spec) {
  DatasetSpec out;
  if (spec == "fashion-mnist" || spec == "fashion-mnist:train") {
    out.split = "train";
    return out;
  }
  if (spec == "fashion-mnist:test") {
    out.split = "test";
    return out;
  }
  if (spec.rfind("npy:", 0) == 0) {
    const std::string rest = spec.substr(4);
    const size_t comma = rest.find(',');
    SHMGRAD_CHECK(comma != std::string::npos, ErrorKind::kInvalidArgument, "--dataset '", spec,
                  "': npy needs two files, npy:INPUTS.npy,TARGETS.npy");
    out.npy = true;
    out.inputs_path = rest.substr(0, comma);
    out.targets_path = rest.substr(comma + 1);
    return out;
  }
  raise(ErrorKind::kInvalidArgument, "--dataset '", spec,
        "' is not understood: use fashion-mnist, fashion-mnist:test or npy:INPUTS.npy,TARGETS.npy");
}

Dataset loadDatasetSpec(const std::string& spec) {
  const DatasetSpec s = parseDatasetSpec(spec);
  if (s.npy) return loadNpyPair(s.inputs_path, s.targets_path);
  return loadFashionMnist(fashionMnistDir(), s.split);
}

}  // namespace shmgrad::engine
