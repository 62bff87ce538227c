#include "tests/test_util.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <thread>

#include "ipc/config.h"
#include "ipc/futex.h"
#include "ipc/segment.h"

namespace shmgrad::testing {

std::string tempDir(const std::string& tag) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string root = base != nullptr ? base : "/tmp";
  std::string dir = root + "/shmgrad-" + tag + "-" + std::to_string(getpid());
  ::mkdir(dir.c_str(), 0700);
  return dir;
}

std::string uniqueName(const std::string& tag) {
  return "test-" + tag + "-" + std::to_string(getpid()) + "-" +
         std::to_string(ipc::monotonicNs() % 1000000);
}

std::string saveMlp(const std::string& path, int64_t in, int64_t hidden, int64_t out,
                    uint64_t seed) {
  torch::manual_seed(seed);
  torch::jit::Module m("Mlp");
  m.register_parameter("w1", (torch::randn({hidden, in}) / std::sqrt(double(in))).requires_grad_(),
                       false);
  m.register_parameter("b1", (torch::randn({hidden}) * 0.1).requires_grad_(), false);
  m.register_parameter(
      "w2", (torch::randn({out, hidden}) / std::sqrt(double(hidden))).requires_grad_(), false);
  m.register_parameter("b2", (torch::randn({out}) * 0.1).requires_grad_(), false);
  m.define(R"(
def forward(self, x):
    h = torch.relu(torch.matmul(torch.flatten(x, 1), self.w1.t()) + self.b1)
    return torch.matmul(h, self.w2.t()) + self.b2
)");
  m.save(path);
  return path;
}

std::string saveCnn(const std::string& path, int64_t side, int64_t out, uint64_t seed,
                    int64_t channels) {
  torch::manual_seed(seed);
  const int64_t pooled = (side - 2) / 2;
  torch::jit::Module m("Cnn");
  m.register_parameter("cw", (torch::randn({4, channels, 3, 3}) / 3.0).requires_grad_(), false);
  m.register_parameter("cb", (torch::randn({4}) * 0.1).requires_grad_(), false);
  m.register_parameter("fw",
                       (torch::randn({out, 4 * pooled * pooled}) / std::sqrt(4.0 * pooled * pooled))
                           .requires_grad_(),
                       false);
  m.register_parameter("fb", (torch::randn({out}) * 0.1).requires_grad_(), false);
  m.define(R"(
def forward(self, x):
    h = torch.relu(torch.conv2d(x, self.cw, self.cb))
    h = torch.max_pool2d(h, [2, 2])
    h = torch.flatten(h, 1)
    return torch.matmul(h, self.fw.t()) + self.fb
)");
  m.save(path);
  return path;
}

void writeNpy(const std::string& path, const torch::Tensor& t0) {
  torch::Tensor t = t0.contiguous();
  std::string descr = t.scalar_type() == torch::kInt64 ? "<i8" : "<f4";
  if (t.scalar_type() != torch::kInt64) t = t.to(torch::kFloat32);
  std::string shape = "(";
  for (int64_t d = 0; d < t.dim(); ++d)
    shape += std::to_string(t.size(d)) + (t.dim() == 1 ? "," : (d + 1 < t.dim() ? ", " : ""));
  shape += ")";
  std::string header =
      "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  f.write("\x93NUMPY\x01\x00", 8);
  uint16_t len = static_cast<uint16_t>(header.size());
  f.write(reinterpret_cast<const char*>(&len), 2);
  f.write(header.data(), header.size());
  f.write(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
}

std::vector<torch::Tensor> referenceGradient(const std::string& model_path, const std::string& loss,
                                             const torch::Tensor& inputs,
                                             const torch::Tensor& targets, bool mean) {
  torch::jit::Module m = torch::jit::load(model_path);
  m.train();
  torch::Tensor out = m.forward({inputs}).toTensor();
  auto red = mean ? torch::Reduction::Mean : torch::Reduction::Sum;
  torch::Tensor l;
  if (loss == "cross_entropy")
    l = torch::nll_loss(torch::log_softmax(out, 1), targets, {}, red);
  else if (loss == "nll")
    l = torch::nll_loss(out, targets, {}, red);
  else
    l = torch::mse_loss(out, targets, red);
  l.backward();
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
  return g;
}

double relativeError(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return 1e30;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].sizes() != b[i].sizes()) return 1e30;
    num += (a[i].to(torch::kFloat64) - b[i].to(torch::kFloat64)).pow(2).sum().item<double>();
    den += b[i].to(torch::kFloat64).pow(2).sum().item<double>();
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

std::string shmgradBinary() {
  const char* env = shmgrad::config::tunable("SHMGRAD_BINARY");
  if (env != nullptr) return env;
  return "tools/shmgrad";  // bazel test runs in the runfiles root
}

bool processRunning(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f.good()) return false;
  std::string line;
  std::getline(f, line);
  size_t p = line.rfind(')');
  return p != std::string::npos && p + 2 < line.size() && line[p + 2] != 'Z';
}

EngineProcess::EngineProcess(const std::string& name, const std::vector<std::string>& args)
    : name_(name) {
  std::vector<std::string> all = {shmgradBinary(), "serve", "--name", name, "--quiet"};
  all.insert(all.end(), args.begin(), args.end());
  pid_ = fork();
  if (pid_ == 0) {
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  if (pid_ < 0) throw std::runtime_error("fork failed");
}

void EngineProcess::stop() {
  if (pid_ <= 0) return;
  kill(pid_, SIGTERM);
  for (int i = 0; i < 1000; ++i) {
    int st;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
  ipc::Segment::remove(name_);
}

EngineProcess::~EngineProcess() { stop(); }

}  // namespace shmgrad::testing
