#include "engine/dataset.h"

#include <zlib.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "ipc/config.h"
#include "ipc/error.h"

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

// Parses an IDX file (ubyte data): returns dims and a pointer to the data.
std::vector<int64_t> parseIdx(const std::vector<uint8_t>& buf, const std::string& path,
                              const uint8_t** data) {
  SHMGRAD_CHECK(buf.size() >= 4 && buf[0] == 0 && buf[1] == 0 && buf[2] == 0x08,
                ErrorKind::kInvalidArgument, "'", path, "' is not an IDX ubyte file");
  uint32_t ndim = buf[3];
  SHMGRAD_CHECK(ndim >= 1 && ndim <= 4 && buf.size() >= 4 + 4 * ndim, ErrorKind::kInvalidArgument,
                "'", path, "' has a bad IDX header");
  std::vector<int64_t> dims;
  uint64_t numel = 1;
  for (uint32_t i = 0; i < ndim; ++i) {
    dims.push_back(be32(&buf[4 + 4 * i]));
    numel *= static_cast<uint64_t>(dims.back());
  }
  SHMGRAD_CHECK(buf.size() == 4 + 4 * ndim + numel, ErrorKind::kInvalidArgument, "'", path,
                "' is truncated: header says ", numel, " bytes of data");
  *data = buf.data() + 4 + 4 * ndim;
  return dims;
}

struct Npy {
  std::string descr;
  bool fortran = false;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

Npy readNpy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SHMGRAD_CHECK(f.good(), ErrorKind::kNotFound, "cannot open .npy file '", path, "'");
  std::vector<uint8_t> buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  SHMGRAD_CHECK(buf.size() >= 10 && std::memcmp(buf.data(), "\x93NUMPY", 6) == 0,
                ErrorKind::kInvalidArgument, "'", path,
                "' is not a .npy file (save it with numpy.save)");
  uint8_t major = buf[6];
  size_t hlen, hstart;
  if (major == 1) {
    hlen = buf[8] | (buf[9] << 8);
    hstart = 10;
  } else {
    SHMGRAD_CHECK(buf.size() >= 12, ErrorKind::kInvalidArgument, "'", path, "' is truncated");
    hlen = buf[8] | (buf[9] << 8) | (buf[10] << 16) | (size_t{buf[11]} << 24);
    hstart = 12;
  }
  SHMGRAD_CHECK(hstart + hlen <= buf.size(), ErrorKind::kInvalidArgument, "'", path,
                "' has a truncated header");
  std::string header(buf.begin() + hstart, buf.begin() + hstart + hlen);
  Npy out;
  auto field = [&](const std::string& key) {
    size_t p = header.find("'" + key + "'");
    SHMGRAD_CHECK(p != std::string::npos, ErrorKind::kInvalidArgument, "'", path,
                  "': header lacks ", key);
    p = header.find(':', p);
    return header.substr(p + 1);
  };
  std::string d = field("descr");
  size_t q1 = d.find('\''), q2 = d.find('\'', q1 + 1);
  out.descr = d.substr(q1 + 1, q2 - q1 - 1);
  out.fortran = field("fortran_order").find("True") < field("fortran_order").find(',');
  std::string s = field("shape");
  size_t l = s.find('('), r = s.find(')');
  std::stringstream ss(s.substr(l + 1, r - l - 1));
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    if (tok.find_first_not_of(" ") == std::string::npos) continue;
    out.shape.push_back(std::stoll(tok));
  }
  SHMGRAD_CHECK(!out.fortran, ErrorKind::kInvalidArgument, "'", path,
                "' is in Fortran order; save a C-contiguous array (numpy.ascontiguousarray)");
  out.bytes.assign(buf.begin() + hstart + hlen, buf.end());
  return out;
}

template <typename T>
void convert(const Npy& a, const std::string& path, std::vector<T>* out) {
  uint64_t n = 1;
  for (int64_t d : a.shape) n *= static_cast<uint64_t>(d);
  const std::string& t = a.descr;
  size_t width = t.size() >= 3 ? std::stoul(t.substr(2)) : 0;
  SHMGRAD_CHECK(width > 0 && a.bytes.size() >= n * width, ErrorKind::kInvalidArgument, "'", path,
                "' is truncated or has dtype ", t);
  SHMGRAD_CHECK(t[0] != '>' || width == 1, ErrorKind::kInvalidArgument, "'", path,
                "' is big-endian; save it little-endian");
  out->resize(n);
  const uint8_t* p = a.bytes.data();
  char kind = t[1];
  for (uint64_t i = 0; i < n; ++i, p += width) {
    double v;
    if (kind == 'f' && width == 4) {
      float x;
      std::memcpy(&x, p, 4);
      v = x;
    } else if (kind == 'f' && width == 8) {
      std::memcpy(&v, p, 8);
    } else if (kind == 'i' && width == 8) {
      int64_t x;
      std::memcpy(&x, p, 8);
      v = static_cast<double>(x);
    } else if (kind == 'i' && width == 4) {
      int32_t x;
      std::memcpy(&x, p, 4);
      v = x;
    } else if (kind == 'u' && width == 1) {
      v = *p;
    } else if (kind == 'i' && width == 1) {
      v = static_cast<int8_t>(*p);
    } else if (kind == 'b' && width == 1) {
      v = *p;
    } else
      raise(ErrorKind::kInvalidArgument, "'", path, "' has dtype ", t,
            "; use float32, float64, int64, int32, int8 or uint8");
    (*out)[i] = static_cast<T>(v);
  }
}

}  // namespace

std::string fashionMnistDir() { return config::tunableValue("SHMGRAD_FASHION_MNIST_DIR"); }

Dataset loadFashionMnist(const std::string& dir, const std::string& split) {
  SHMGRAD_CHECK(split == "train" || split == "test", ErrorKind::kInvalidArgument,
                "fashion-mnist split '", split, "': use train or test");
  const std::string prefix = dir + "/" + (split == "train" ? "train" : "t10k");
  const std::string ipath = prefix + "-images-idx3-ubyte.gz";
  const std::string lpath = prefix + "-labels-idx1-ubyte.gz";
  auto ibuf = readMaybeGz(ipath);
  auto lbuf = readMaybeGz(lpath);
  const uint8_t *idata, *ldata;
  auto idims = parseIdx(ibuf, ipath, &idata);
  auto ldims = parseIdx(lbuf, lpath, &ldata);
  SHMGRAD_CHECK(idims.size() == 3 && ldims.size() == 1 && idims[0] == ldims[0],
                ErrorKind::kInvalidArgument, "fashion-mnist files in ", dir,
                " disagree on the number of examples");
  Dataset d;
  d.description = "fashion-mnist:" + split;
  d.count = idims[0];
  d.example_shape = {1, idims[1], idims[2]};
  const uint64_t n = static_cast<uint64_t>(idims[0] * idims[1] * idims[2]);
  d.inputs.resize(n);
  for (uint64_t i = 0; i < n; ++i) d.inputs[i] = static_cast<float>(idata[i]) / 255.0f;
  d.target_dtype = ipc::DType::kInt64;
  d.targets_i64.assign(ldata, ldata + d.count);
  return d;
}

Dataset loadNpyPair(const std::string& inputs_path, const std::string& targets_path) {
  Npy x = readNpy(inputs_path);
  Npy y = readNpy(targets_path);
  SHMGRAD_CHECK(!x.shape.empty() && !y.shape.empty() && x.shape[0] == y.shape[0],
                ErrorKind::kInvalidArgument, "npy dataset: inputs have ",
                x.shape.empty() ? 0 : x.shape[0], " examples but targets have ",
                y.shape.empty() ? 0 : y.shape[0], "; give one target per input");
  SHMGRAD_CHECK(x.shape[0] > 0, ErrorKind::kInvalidArgument, "npy dataset is empty");
  Dataset d;
  d.description = "npy:" + inputs_path + "," + targets_path;
  d.count = x.shape[0];
  d.example_shape.assign(x.shape.begin() + 1, x.shape.end());
  convert(x, inputs_path, &d.inputs);
  d.target_shape.assign(y.shape.begin() + 1, y.shape.end());
  if (y.descr.size() >= 2 && y.descr[1] == 'f') {
    d.target_dtype = ipc::DType::kFloat32;
    convert(y, targets_path, &d.targets_f32);
  } else {
    d.target_dtype = ipc::DType::kInt64;
    convert(y, targets_path, &d.targets_i64);
  }
  return d;
}

Dataset loadDatasetSpec(const std::string& spec) {
  if (spec == "fashion-mnist" || spec == "fashion-mnist:train") {
    return loadFashionMnist(fashionMnistDir(), "train");
  }
  if (spec == "fashion-mnist:test") return loadFashionMnist(fashionMnistDir(), "test");
  if (spec.rfind("npy:", 0) == 0) {
    std::string rest = spec.substr(4);
    size_t comma = rest.find(',');
    SHMGRAD_CHECK(comma != std::string::npos, ErrorKind::kInvalidArgument, "--dataset '", spec,
                  "': npy needs two files, npy:INPUTS.npy,TARGETS.npy");
    return loadNpyPair(rest.substr(0, comma), rest.substr(comma + 1));
  }
  raise(ErrorKind::kInvalidArgument, "--dataset '", spec,
        "' is not understood: use fashion-mnist, fashion-mnist:test or npy:INPUTS.npy,TARGETS.npy");
}

}  // namespace shmgrad::engine
