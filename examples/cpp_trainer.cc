// A C++ trainer: attaches to a running engine that has a dataset, trains with
// torch::optim::SGD on parameters that alias the engine's shared parameters, and
// prints the loss.
//
//   shmgrad serve --name demo --model model.pt --workers 2 --dataset fashion-mnist &
//   bazel run //examples:cpp_trainer -- demo [steps] [batch]
#include <cstdio>
#include <cstdlib>

#include <torch/torch.h>

#include "engine/trainer.h"
#include "ipc/error.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: cpp_trainer ENGINE_NAME [steps=200] [batch=128] [lr=0.05]\n");
    return 2;
  }
  const int steps = argc > 2 ? std::atoi(argv[2]) : 200;
  const int64_t batch = argc > 3 ? std::atoll(argv[3]) : 128;
  const double lr = argc > 4 ? std::atof(argv[4]) : 0.05;
  try {
    // This process only steps the optimizer: on one thread, its idle intra-op threads do
    // not spin on the workers' cores after each opt.step() (docs/DESIGN.md, "The trainer's
    // threads"; the Python client does this itself).
    at::set_num_threads(1);
    auto trainer = shmgrad::Trainer::attach(argv[1]);
    const int64_t n = trainer->datasetSize();
    if (n == 0) {
      std::fprintf(stderr, "engine %s has no dataset: start it with --dataset\n", argv[1]);
      return 2;
    }
    std::vector<torch::Tensor> params = trainer->parameterViews();
    std::vector<torch::Tensor> grads = trainer->gradientViews();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].set_requires_grad(true);
      params[i].mutable_grad() = grads[i];  // the optimizer reads the reduced gradient
    }
    torch::optim::SGD opt(params, torch::optim::SGDOptions(lr).momentum(0.9));
    shmgrad::GradientOptions options;
    options.mean = true;
    double running = 0;
    for (int step = 1; step <= steps; ++step) {
      torch::Tensor idx = torch::randint(0, n, {batch}, torch::kInt64);
      shmgrad::GradientStats s = trainer->gradient(idx, options);
      opt.step();  // in place on the shared parameters: every worker sees it
      running += s.loss;
      if (step % 50 == 0 || step == steps) {
        std::printf("step %d: mean loss %.4f (last 50 steps), %zu workers, %.2f ms/step\n", step,
                    running / (step % 50 == 0 ? 50 : step % 50), s.workers.size(),
                    s.wall_seconds * 1e3);
        running = 0;
      }
    }
  } catch (const shmgrad::Error& e) {
    std::fprintf(stderr, "cpp_trainer: %s: %s\n", shmgrad::errorKindName(e.kind()), e.what());
    return 1;
  }
  return 0;
}
