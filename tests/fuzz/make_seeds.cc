// Writes the seed corpora of the fuzz targets (tools/fuzz.sh runs it before fuzzing):
// real segments, device tables, step requests, worker records, model files, dataset
// files and strings, made by shmgrad's own writers where it has them, each a few KB at
// most. Also writes OUT/build.dict: the values of this build that the targets' inputs
// hold (sizes, offsets), for libFuzzer's dictionary beside tests/fuzz/<target>.dict.
//
//   make_seeds OUT   writes OUT/<target>/seed-<n> and OUT/build.dict
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "backend/shm_comm.h"
#include "engine/model_file.h"
#include "ipc/device_table.h"
#include "ipc/layout.h"
#include "ipc/segment.h"

using namespace shmgrad;

namespace {

std::string out_dir;
std::string dict;

using Bytes = std::vector<uint8_t>;

template <typename T>
void put(Bytes* b, const T& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b->insert(b->end(), p, p + sizeof(T));
}
void put(Bytes* b, const void* p, size_t n) {
  b->insert(b->end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
}
void put(Bytes* b, const std::string& s) { put(b, s.data(), s.size()); }

void write(const std::string& target, const Bytes& b) {
  static std::string last;
  static int n = 0;
  if (target != last) n = 0;
  last = target;
  const std::string dir = out_dir + "/" + target;
  ::mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/seed-" + std::to_string(n++), std::ios::binary)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// A dictionary entry: the bytes of v, as libFuzzer's "\xNN" escapes.
template <typename T>
void entry(const char* name, const T& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  char buf[8];
  dict += std::string(name) + "=\"";
  for (size_t i = 0; i < sizeof(T); ++i) {
    std::snprintf(buf, sizeof buf, "\\x%02x", p[i]);
    dict += buf;
  }
  dict += "\"\n";
}

size_t prefixBytes() {
  alignas(ipc::SegmentHeader) static uint8_t probe[sizeof(ipc::SegmentHeader)];
  auto* h = reinterpret_cast<ipc::SegmentHeader*>(probe);
  return static_cast<size_t>(reinterpret_cast<uint8_t*>(&h->control) - probe);
}

ipc::SegmentSpec smallSpec(const std::string& name) {
  ipc::SegmentSpec s;
  s.name = name;
  s.model_path = "/tmp/model.pt";
  s.num_slots = 2;
  s.params = {{"fc.weight", {3, 4}, ipc::MemoryFormat::kContiguous},
              {"fc.bias", {3}, ipc::MemoryFormat::kContiguous}};
  s.max_batch = 8;
  s.input_bytes = 256;
  s.target_bytes = 64;
  return s;
}

// A real segment (Segment::create, as the coordinator makes it) as segment_header_fuzz
// reads its input: the header up to the control block, then the bytes after the header.
void segmentSeed(const ipc::SegmentSpec& spec, bool devices) {
  ipc::Segment::remove(spec.name);
  auto seg = ipc::Segment::create(spec);
  const ipc::SegmentHeader* h = seg->header();
  if (devices) {
    ipc::initDeviceTable(seg->region<ipc::DeviceTable>(h->device), {0, 1}, h->num_slots,
                         h->param_floats, h->buffers.size);
  }
  ipc::validateHeader(h, seg->size());
  const size_t tables = ipc::alignUp(sizeof(ipc::SegmentHeader), ipc::kAlign);
  Bytes b;
  put(&b, seg->base(), prefixBytes());
  put(&b, seg->base() + tables, seg->size() - tables);
  write("segment_header", b);
  entry("total_size", seg->size());
  entry("params_table", h->params_table.offset);
  entry("device_offset", h->device.offset);
  entry("param_floats", h->param_floats);
  ipc::Segment::remove(spec.name);
}

void segmentSeeds() {
  const std::string base = "fuzzseed-" + std::to_string(getpid());
  segmentSeed(smallSpec(base), false);
  ipc::SegmentSpec s = smallSpec(base);
  s.buffers = {{"bn.running_mean", {3}, ipc::DType::kFloat32},
               {"bn.num_batches_tracked", {}, ipc::DType::kInt64}};
  s.params.push_back({"conv.weight", {2, 3, 1, 1}, ipc::MemoryFormat::kChannelsLast});
  s.data_count = 3;
  s.data_example_shape = {2};
  s.data_target_dtype = ipc::DType::kInt64;
  s.data_description = "npy:x.npy,y.npy";
  segmentSeed(s, true);
  ipc::SegmentSpec e = smallSpec(base);
  e.worker_kind = ipc::WorkerKind::kEager;
  e.job_path = "/tmp/job.pkl";
  e.numerics = ipc::parseNumerics("matmul_precision=high");
  segmentSeed(e, false);
  entry("header_size", static_cast<uint32_t>(sizeof(ipc::SegmentHeader)));
  entry("tables", static_cast<uint64_t>(ipc::alignUp(sizeof(ipc::SegmentHeader), ipc::kAlign)));
}

void deviceTableSeeds() {
  struct Case {
    std::vector<int> ordinals;
    uint32_t slots;
    uint64_t param_floats, buffer_bytes;
  };
  for (const Case& c :
       {Case{{0}, 2, 64, 0}, Case{{0, 1}, 4, 1024, 128}, Case{{2, 0, 1}, 5, 160, 64}}) {
    auto* t = new ipc::DeviceTable();
    ipc::initDeviceTable(t, c.ordinals, c.slots, c.param_floats, c.buffer_bytes);
    t->devices[0].state.store(static_cast<uint32_t>(ipc::DeviceState::kPublished));
    ipc::validateDeviceTable(*t, c.slots, c.param_floats, c.buffer_bytes, 4);
    Bytes b;
    put(&b, c.slots);
    put(&b, c.param_floats);
    put(&b, c.buffer_bytes);
    put(&b, int32_t{4});
    put(&b, t, sizeof(*t));
    write("device_table", b);
    entry("layout_bytes", t->devices[0].layout.bytes);
    delete t;
  }
}

// Step requests as the trainer writes them (engine/trainer.cc), one of each kind.
void stepRequestSeeds() {
  for (uint32_t kind = 1; kind <= 3; ++kind) {
    auto* r = new ipc::StepRequest();
    std::memset(static_cast<void*>(r), 0, sizeof(*r));
    r->epoch = 7;
    r->kind = kind;
    r->num_examples = 4;
    r->num_participants = 2;
    r->reduction = static_cast<uint32_t>(ipc::Reduction::kMean);
    r->scale = 0.25f;
    r->loss_scale = 1.0f;
    r->train_mode = 1;
    r->participants[0] = 0;
    r->participants[1] = 1;
    if (kind == 2) {
      r->input_dtype = static_cast<uint32_t>(ipc::DType::kFloat32);
      r->example_shape.ndim = 1;
      r->example_shape.dims[0] = 3;
      r->target_dtype = static_cast<uint32_t>(ipc::DType::kInt64);
    }
    if (kind == 3) {
      r->num_leaves = 2;
      std::snprintf(r->structure, ipc::kStructureLen, "{\"input_ids\":0,\"mask\":1}");
      r->leaves[0].type = static_cast<uint32_t>(ipc::LeafType::kInt64);
      r->leaves[0].example_shape.ndim = 1;
      r->leaves[0].example_shape.dims[0] = 5;
      r->leaves[1].type = static_cast<uint32_t>(ipc::LeafType::kBool);
      r->leaves[1].example_shape.ndim = 1;
      r->leaves[1].example_shape.dims[0] = 5;
      r->leaves[1].offset = 192;
    }
    Bytes b;
    put(&b, uint8_t{2});      // slots
    put(&b, uint8_t{1});      // rank
    put(&b, uint32_t{7});     // max batch - 1
    put(&b, int64_t{10});     // dataset size
    put(&b, uint32_t{1024});  // input region bytes
    put(&b, uint32_t{64});    // target region bytes
    put(&b, r, sizeof(*r));
    for (int64_t i : {3, 1, 4, 1}) put(&b, i);
    write("step_request", b);
    delete r;
  }
}

void workerRecordSeeds() {
  for (int error = 0; error <= 1; ++error) {
    auto* w = new ipc::WorkerRecord();
    w->result_epoch = 7;
    w->examples = 2;
    w->loss_sum = 1.5;
    w->count = 2;
    w->compute_ns = 1000;
    ipc::setParamBit(w->grad_params, 0);
    if (error) {
      w->error = 1;
      std::snprintf(w->error_type, ipc::kErrorTypeLen, "ValueError");
      std::snprintf(w->error_text, ipc::kErrorLen, "bad batch\nTraceback: ...");
    }
    Bytes b;
    put(&b, uint32_t{7});
    put(&b, uint32_t{0});
    put(&b, uint8_t{1});
    // The record up to its error text's first bytes: the rest reads as zeros.
    put(&b, w,
        reinterpret_cast<const uint8_t*>(w->error_text) + 64 - reinterpret_cast<const uint8_t*>(w));
    write("worker_record", b);
    delete w;
  }
}

Bytes readFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Model files as writeModelFile writes them.
void modelFileSeeds() {
  const std::string path = out_dir + "/tmp.model";
  engine::ModelDescription m;
  m.params = {{"fc.weight", {2, 3}, ipc::MemoryFormat::kContiguous}, {"fc.bias", {2}, {}}};
  m.param_values = {{1, 2, 3, 4, 5, 6}, {0.5f, -0.5f}};
  engine::writeModelFile(path, m);
  write("model_file", readFile(path));
  m.params.push_back({"conv.weight", {1, 2, 1, 1}, ipc::MemoryFormat::kChannelsLast});
  m.param_values.push_back({1, 2});
  m.buffers = {{"bn.running_var", {2}, ipc::DType::kFloat32},
               {"bn.num_batches_tracked", {}, ipc::DType::kInt64}};
  m.buffer_values = {Bytes(8, 0), Bytes(8, 0)};
  engine::writeModelFile(path, m);
  write("model_file", readFile(path));
  ::unlink(path.c_str());
}

// A .npy file as numpy.save writes it (format 1.0: magic, version, u16 header length,
// the header dict padded with spaces to a multiple of 64 bytes and ended by a newline).
Bytes npy(const std::string& descr, const std::string& shape, const Bytes& data) {
  std::string header =
      "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  Bytes b;
  put(&b, std::string("\x93NUMPY\x01\x00", 8));
  put(&b, static_cast<uint16_t>(header.size()));
  put(&b, header);
  put(&b, data.data(), data.size());
  return b;
}

void npySeeds() {
  auto pair = [](const Bytes& x, const Bytes& y) {
    Bytes b;
    put(&b, static_cast<uint16_t>(x.size()));
    put(&b, x.data(), x.size());
    put(&b, y.data(), y.size());
    write("npy", b);
  };
  pair(npy("<f4", "(3, 2)", Bytes(24, 0x3f)), npy("<i8", "(3,)", Bytes(24, 1)));
  pair(npy("|u1", "(2, 1, 2, 2)", Bytes(8, 200)), npy("<f8", "(2, 3)", Bytes(48, 0)));
  pair(npy("<i4", "(2, 2)", Bytes(16, 0)), npy("|b1", "(2,)", Bytes(2, 1)));
}

void idxSeeds() {
  Bytes images = {0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 3};
  for (int i = 0; i < 18; ++i) images.push_back(static_cast<uint8_t>(i * 14));
  const Bytes labels = {0, 0, 8, 1, 0, 0, 0, 2, 7, 9};
  Bytes b;
  put(&b, static_cast<uint32_t>(images.size()));
  put(&b, images.data(), images.size());
  put(&b, labels.data(), labels.size());
  write("idx", b);
}

void specStringSeeds() {
  auto str = [](uint8_t which, const std::string& s) {
    Bytes b{which};
    put(&b, s);
    write("spec_strings", b);
  };
  str(0, "my-engine_1.0");
  str(1, "cross_entropy");
  str(2, "weighted");
  str(3, "matmul_precision=high,cudnn_tf32=1,cudnn_benchmark=0,cudnn_deterministic=1");
  str(4, "npy:inputs.npy,targets.npy");
  str(4, "fashion-mnist:test");
  // The name of a real group, as rank 0 publishes it in the store.
  auto comm = backend::ShmComm::create(2, 256 << 10);
  str(5, comm->name());
}

void shmGroupSeeds(uint64_t arena) {
  auto comm = backend::ShmComm::create(2, 256 << 10, arena);
  struct stat st {};
  ::stat(comm->name().c_str(), &st);
  Bytes header = readFile(comm->name());
  header.resize(backend::detail::groupHeaderBytes());
  for (uint32_t msg : {0u, 100u, 5000u}) {
    Bytes b;
    put(&b, uint16_t{2});
    put(&b, static_cast<uint64_t>(st.st_size));
    put(&b, header.data(), header.size());
    put(&b, msg);
    put(&b, int64_t{0});
    put(&b, uint8_t{3});  // 4 KiB slots
    for (uint64_t off = 0; off < msg || off == 0; off += 4096) {
      put(&b, uint64_t{msg});
      put(&b, std::min<uint64_t>(4096, msg - off));
      put(&b, int64_t{0});
      if (msg == 0) break;
    }
    write("shm_group", b);
  }
  if (arena == 0) entry("group_size", static_cast<uint64_t>(st.st_size));
}

// A real group's header (ShmComm::create), read through the name the other ranks open:
// without and with arenas.
void shmGroupSeeds() {
  for (uint64_t arena : {uint64_t{0}, uint64_t{1} << 20}) shmGroupSeeds(arena);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUT\n");
    return 2;
  }
  out_dir = argv[1];
  ::mkdir(out_dir.c_str(), 0755);
  try {
    segmentSeeds();
    deviceTableSeeds();
    stepRequestSeeds();
    workerRecordSeeds();
    modelFileSeeds();
    npySeeds();
    idxSeeds();
    specStringSeeds();
    shmGroupSeeds();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  std::ofstream(out_dir + "/build.dict") << dict;
  return 0;
}
