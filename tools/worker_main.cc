// shmgrad-worker: the TorchScript worker program, the one part of the engine's programs
// that links libtorch (`shmgrad`, the coordinator and the CLI, does not).
//   shmgrad-worker run NAME SLOT PPID    a worker process: the coordinator execs it per slot
//   shmgrad-worker describe MODEL OUT    loads the TorchScript file MODEL and writes its
//                                        description (engine/model_file.h) to OUT, for the
//                                        coordinator to size and fill the segment
// Exit codes: run, those of worker::runWorker; describe, 0, or 2 when the model cannot be
// used (its message on stderr is the error `shmgrad serve` reports).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <limits>
#include <string>

#include "engine/model_file.h"
#include "ipc/config.h"
#include "ipc/error.h"
#include "ipc/layout.h"
#include "worker/replica.h"
#include "worker/worker_loop.h"

namespace {

constexpr int kExitRejected = shmgrad::config::kExitDescribeRejected;

int describe(const std::string& model, const std::string& out) {
  shmgrad::engine::ModelDescription d;
  try {
    const shmgrad::worker::ModelParams m = shmgrad::worker::describeModel(model);
    d.params = m.specs;
    d.buffers = m.buffer_specs;
    for (const auto& t : m.values) {
      const float* p = t.data_ptr<float>();
      d.param_values.emplace_back(p, p + t.numel());
    }
    for (const auto& t : m.buffer_values) {
      const auto* p = static_cast<const uint8_t*>(t.data_ptr());
      d.buffer_values.emplace_back(p, p + t.numel() * t.element_size());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return kExitRejected;
  }
  shmgrad::engine::writeModelFile(out, d);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("shmgrad's TorchScript worker program: started by `shmgrad serve`, not by hand",
               "shmgrad-worker");
  app.require_subcommand(1);
  shmgrad::worker::WorkerOptions o;
  CLI::App* run = app.add_subcommand("run", "a worker process");
  run->add_option("NAME", o.engine_name, "engine name")->required();
  run->add_option("SLOT", o.slot, "gradient slot")
      ->required()
      ->check(CLI::Range(0u, shmgrad::ipc::kMaxWorkers - 1));
  run->add_option("PPID", o.parent_pid, "the coordinator's pid")
      ->required()
      ->check(CLI::Range(1, std::numeric_limits<int>::max()));
  std::string model, out;
  CLI::App* desc = app.add_subcommand("describe", "write a TorchScript file's description");
  desc->add_option("MODEL", model, "TorchScript file")->required();
  desc->add_option("OUT", out, "where to write the description")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitRejected;
  }
  try {
    if (run->parsed()) return shmgrad::worker::runWorker(o);
    return describe(model, out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmgrad-worker: %s\n", e.what());
    return 1;
  }
}
