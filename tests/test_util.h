// Helpers shared by the C++ tests: small TorchScript models, .npy writers, a
// single-process reference gradient, and an engine run as a child process.
#pragma once

#include <sys/types.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace shmgrad::testing {

// A fresh directory under TEST_TMPDIR (or /tmp).
std::string tempDir(const std::string& tag);

// MLP in -> hidden -> out with ReLU; CNN: conv3x3(1->4) ReLU maxpool2 linear(->out)
// on [1, side, side] inputs. Saved with torch.jit-compatible Module::save.
std::string saveMlp(const std::string& path, int64_t in, int64_t hidden, int64_t out,
                    uint64_t seed);
// Inputs [B, channels, side, side].
std::string saveCnn(const std::string& path, int64_t side, int64_t out, uint64_t seed,
                    int64_t channels = 1);

void writeNpy(const std::string& path, const torch::Tensor& t);  // float32 or int64

// Gradient of the loss (sum over the batch, or mean) of a freshly loaded model,
// computed in this process: the reference every engine result is compared with.
std::vector<torch::Tensor> referenceGradient(const std::string& model_path, const std::string& loss,
                                             const torch::Tensor& inputs,
                                             const torch::Tensor& targets, bool mean = false);
// ||a - b|| / max(||b||, tiny) over all tensors together.
double relativeError(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b);

// Runs `shmgrad serve` as a child process; stops it (and waits) on destruction.
class EngineProcess {
 public:
  EngineProcess(const std::string& name, const std::vector<std::string>& args);
  ~EngineProcess();
  void stop();
  pid_t pid() const { return pid_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  pid_t pid_ = -1;
};

std::string shmgradBinary();
// A name no other test run uses at the same time.
std::string uniqueName(const std::string& tag);
// True if the process exists (and is not a zombie).
bool processRunning(pid_t pid);

}  // namespace shmgrad::testing
