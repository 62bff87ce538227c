// The shmgrad command line: serve, stop, status, resize, stress and bench, parsed with
// CLI11. It links no libtorch: the TorchScript workers are the program shmgrad-worker
// (tools/worker_main.cc), and eager workers are Python. Each command's options are declared in its
// add*() function and run by its run*() function; main() parses, dispatches, and turns errors into
// exit codes.
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "engine/control.h"
#include "engine/coordinator.h"
#include "ipc/config.h"
#include "ipc/error.h"
#include "ipc/layout.h"

namespace {

namespace engine = shmgrad::engine;

// Exit codes. A usage error is anything CLI11 refuses (unknown option, bad value,
// missing argument); a failure is a command that ran and failed (a shmgrad::Error).
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitCannotExec = shmgrad::config::kExitCannotExec;

// Limits the command line checks itself; the coordinator checks them again.
// segment.cc keeps an explicit batch's input capacity under 2^44 bytes.
constexpr uint64_t kMaxInputCapacityMb = (uint64_t{1} << 24) - 1;
// --startup-timeout: more than nothing, at most a day.
constexpr double kMinStartupTimeoutS = 0.001;
constexpr double kMaxStartupTimeoutS = 86400;

// The interpreter that runs `stress`, `bench` and `serve --eager`: the one the
// environment names (the installed `shmgrad` command, python/shmgrad_tools/cli.py, names its
// own), else python3 on the PATH.
constexpr char kPythonEnv[] = "SHMGRAD_PYTHON";

const char* kDescription =
    "A gradient engine for data-parallel training on one machine: worker processes\n"
    "with their own libtorch model write gradients straight into shared memory and\n"
    "reduce them in place; trainers attach by name.";

// An integer option: CLI11 first checks that the value is an integer at all (its
// message names the option and the value), then that it lies in [lo, hi].
template <typename T>
CLI::Option* integerIn(CLI::Option* option, T lo, T hi) {
  return option->check(CLI::TypeValidator<int64_t>("").description(""))->check(CLI::Range(lo, hi));
}

// --status-fd must name a descriptor this process has open.
const CLI::Validator kOpenDescriptor(
    [](std::string& value) -> std::string {
      int fd = -1;
      if (!CLI::detail::lexical_cast(value, fd) || fd < 0) {
        return "not a file descriptor: " + value + " (use an integer >= 0)";
      }
      if (::fcntl(fd, F_GETFD) == -1) {
        return "file descriptor " + value + " is not open (" + std::strerror(errno) + ")";
      }
      return {};
    },
    "");

// A parsed command: its CLI11 subcommand and what running it does.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

// ---------------------------------------------------------------------------------
// serve

// The one JSON line of --status-fd when serve fails (the coordinator writes it when
// the engine is serving). A failure to write it is printed, not allowed to hide the
// error being reported.
void reportServeFailure(const engine::ServeOptions& o, const char* kind, const char* message) {
  if (o.status_fd < 0) return;
  try {
    engine::writeServeReport(o.status_fd, "failed", kind, message);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmgrad serve: cannot write to --status-fd %d: %s\n", o.status_fd,
                 e.what());
  }
}

// `serve --eager MODULE:FUNCTION`: Python builds the job (it must import the user's
// module), then execs `shmgrad serve` again with --eager-job and the rest of the options.
std::string g_eager_spec;

// "cross_entropy | nll | mse" (ipc::kLossNames: the help names what the segment accepts).
std::string lossChoices() {
  std::string out;
  for (uint32_t i = 1; i <= shmgrad::ipc::kNumLossKinds; ++i) {
    out += (i > 1 ? " | " : "") + std::string(shmgrad::ipc::kLossNames[i]);
  }
  return out;
}
std::vector<std::string> g_serve_args;  // the arguments after "serve", as given

int execPython(const char* module, const std::vector<std::string>& rest);

int runServe(const engine::ServeOptions& o) {
  if (!g_eager_spec.empty()) return execPython("shmgrad._serve_eager", g_serve_args);
  if (o.model_path.empty()) {
    throw shmgrad::Error(shmgrad::ErrorKind::kInvalidArgument,
                         "give --model PATH (a TorchScript file) or --eager MODULE:FUNCTION");
  }
  try {
    // The coordinator execs its workers: they must not hold the report's descriptor
    // open (its reader would wait for their exit to see the end of the stream).
    if (o.status_fd > STDERR_FILENO) {
      const int flags = ::fcntl(o.status_fd, F_GETFD);
      SHMGRAD_SYSCHECK(flags, "fcntl(--status-fd, F_GETFD)");
      SHMGRAD_SYSCHECK(::fcntl(o.status_fd, F_SETFD, flags | FD_CLOEXEC),
                       "fcntl(--status-fd, F_SETFD, FD_CLOEXEC)");
    }
    return engine::serve(o);
  } catch (const shmgrad::Error& e) {
    reportServeFailure(o, shmgrad::errorKindName(e.kind()), e.what());
    throw;
  } catch (const std::exception& e) {
    reportServeFailure(o, shmgrad::errorKindName(shmgrad::ErrorKind::kSystem), e.what());
    throw;
  }
}

Command addServe(CLI::App& app, engine::ServeOptions* o) {
  CLI::App* cmd = app.add_subcommand("serve", "start an engine and run until stopped");
  cmd->footer(
      "Starts an engine: creates its shared-memory segment (/dev/shm/shmgrad-<uid>-NAME,\n"
      "mode 0600), forks N worker processes and serves gradients until `shmgrad stop NAME`,\n"
      "SIGTERM or SIGINT, then removes everything.");
  cmd->add_option("--name", o->name, "engine name: 1-64 of [A-Za-z0-9_.-] (required)")
      ->required()
      ->type_name("NAME");
  CLI::Option* model = cmd->add_option("--model", o->model_path,
                                       "TorchScript model file, from torch.jit.save or\n"
                                       "shmgrad.save_model (required unless --eager)")
                           ->type_name("PATH");
  CLI::Option* eager = cmd->add_option("--eager", g_eager_spec,
                                       "eager Python workers instead: MODULE:FUNCTION, where\n"
                                       "FUNCTION() returns a dict with model, loss, dataset\n"
                                       "(optionally collate_fn, forward, loss_reduction);\n"
                                       "any nn.Module, any loss, any torch Dataset (python3 -m\n"
                                       "shmgrad._serve_eager prepares it)")
                           ->type_name("MODULE:FUNCTION");
  model->excludes(eager);
  // Set by the eager launcher (shmgrad._serve_eager or shmgrad.Engine); not for users.
  cmd->add_option("--eager-job", o->eager_job, "pickled eager job")->group("");
  cmd->add_option("--loss-reduction", o->loss_reduction, "sum, mean or weighted")->group("");
  cmd->add_option("--numerics", o->numerics,
                  "the workers' torch numerics, e.g. matmul_precision=high,cudnn_tf32=1,\n"
                  "cudnn_benchmark=0,cudnn_deterministic=0 (default: torch's; Engine and\n"
                  "shmgrad.serve give the trainer's own)")
      ->type_name("SPEC");
  cmd->add_option("--python", o->python, "interpreter of the eager workers")->group("");
  cmd->add_option("--eager-dataset-size", o->eager_dataset_size, "examples the workers hold")
      ->group("")
      ->check(CLI::Range(int64_t{0}, shmgrad::ipc::kMaxBatch - 1));
  cmd->add_option("--owned-dir", o->owned_dir, "removed with the engine")->group("");
  cmd->add_option_function<std::string>(
         "--workers",
         [o](const std::string& v) {
           if (v == "auto") {
             o->auto_placement = true;
             return;
           }
           int64_t n = 0;
           if (!CLI::detail::lexical_cast(v, n) || n < 1 || n > shmgrad::ipc::kMaxWorkers) {
             throw CLI::ValidationError("--workers", "'" + v + "' must be 1 to " +
                                                         std::to_string(shmgrad::ipc::kMaxWorkers) +
                                                         " or auto");
           }
           o->workers = static_cast<uint32_t>(n);
         },
         "worker processes (default 1), or auto: one per core, and\n"
         "the trainer times workers x threads per worker on its\n"
         "first steps and keeps the fastest (status shows it)")
      ->type_name("N|auto");
  integerIn(cmd->add_option("--max-workers", o->max_workers,
                            "gradient slots, the most workers `resize` may ask for\n"
                            "(default: --workers)")
                ->type_name("N"),
            uint32_t{0}, shmgrad::ipc::kMaxWorkers);
  cmd->add_option("--loss", o->loss,
                  lossChoices() + " (default " + shmgrad::ipc::kLossNames[1] +
                      "); the loss\nis summed over the batch")
      ->type_name("LOSS");
  cmd->add_option("--dataset", o->dataset,
                  "load a dataset once into shared memory: fashion-mnist\n"
                  "(Debian's dataset-fashion-mnist, train split),\n"
                  "fashion-mnist:test, or npy:INPUTS.npy,TARGETS.npy")
      ->type_name("SPEC");
  integerIn(cmd->add_option("--threads-per-worker", o->threads_per_worker,
                            "intra-op threads of each worker")
                ->default_val(shmgrad::config::kDefaultThreadsPerWorker)
                ->type_name("T"),
            uint32_t{1}, shmgrad::ipc::kMaxThreadsPerWorker);
  integerIn(cmd->add_option("--max-batch", o->max_batch, "most examples in one step")
                ->default_val(shmgrad::config::kDefaultMaxBatch)
                ->type_name("N"),
            int64_t{1}, shmgrad::ipc::kMaxBatch - 1);
  integerIn(cmd->add_option("--input-capacity-mb", o->input_capacity_mb,
                            "room for an explicit batch's inputs")
                ->default_val(shmgrad::config::kDefaultInputCapacityMb)
                ->type_name("M"),
            uint64_t{0}, kMaxInputCapacityMb);
  cmd->add_option("--startup-timeout", o->startup_timeout_s,
                  "seconds for all workers to load the model")
      ->default_val(shmgrad::config::kDefaultStartupTimeoutS)
      ->type_name("S")
      ->check(CLI::Range(kMinStartupTimeoutS, kMaxStartupTimeoutS));
  cmd->add_option("--status-fd", o->status_fd,
                  "write one JSON line to this open file descriptor:\n"
                  "{\"event\":\"serving\",...} once the workers are ready, or\n"
                  "{\"event\":\"failed\",\"kind\":...,\"message\":...} if serve fails")
      ->type_name("FD")
      ->check(kOpenDescriptor);
  cmd->add_option("--devices", o->devices,
                  "CUDA ordinals (0,1): the workers compute on these GPUs,\n"
                  "round-robin; the first holds the trainer's parameters and\n"
                  "reduced gradient (docs/GPU.md)")
      ->delimiter(',')
      ->type_name("N,N");
  cmd->add_flag("--quiet", o->quiet, "print nothing but errors");
  // Tests run workers from another binary; not for users.
  cmd->add_option("--worker-binary", o->worker_binary,
                  "the TorchScript worker program (default: shmgrad-worker next to this one)")
      ->group("");
  return {cmd, [o, cmd] {
            if (o->auto_placement && cmd->count("--threads-per-worker") > 0) {
              throw shmgrad::Error(shmgrad::ErrorKind::kInvalidArgument,
                                   "--workers auto chooses the threads per worker too: leave "
                                   "out --threads-per-worker, or give --workers N");
            }
            return runServe(*o);
          }};
}

// ---------------------------------------------------------------------------------
// stop, status, resize

struct StopArgs {
  std::string name;
  double timeout_s = engine::kDefaultStopTimeoutS;
};

Command addStop(CLI::App& app, StopArgs* a) {
  CLI::App* cmd = app.add_subcommand("stop", "stop a running engine");
  cmd->footer("Asks engine NAME to stop and waits (default " +
              CLI::detail::to_string(engine::kDefaultStopTimeoutS) +
              " s) until its segment is gone.");
  cmd->add_option("NAME", a->name, "engine name")->required();
  cmd->add_option("--timeout", a->timeout_s, "seconds to wait for the engine to stop")
      ->type_name("S")
      ->default_str(CLI::detail::to_string(engine::kDefaultStopTimeoutS))
      ->check(CLI::Range(0.0, engine::kMaxStopTimeoutS));
  return {cmd, [a] {
            if (!engine::requestStop(a->name, a->timeout_s)) {
              std::fprintf(stderr, "shmgrad: engine '%s' did not stop within %.0f s\n",
                           a->name.c_str(), a->timeout_s);
              return kExitFailure;
            }
            std::printf("shmgrad: engine '%s' stopped\n", a->name.c_str());
            return kExitOk;
          }};
}

Command addStatus(CLI::App& app, std::string* name) {
  CLI::App* cmd =
      app.add_subcommand("status", "print an engine's workers, steps served and time breakdown");
  cmd->footer(
      "Prints the engine's workers, the trainer holding it, steps served, and the last\n"
      "steps' time breakdown: wall = compute (slowest worker) + reduce + wait.");
  cmd->add_option("NAME", *name, "engine name")->required();
  return {cmd, [name] {
            std::fputs(engine::formatStatus(engine::readStatus(*name)).c_str(), stdout);
            return kExitOk;
          }};
}

struct ResizeArgs {
  std::string name;
  uint32_t workers = 0;
};

Command addResize(CLI::App& app, ResizeArgs* a) {
  CLI::App* cmd =
      app.add_subcommand("resize", "change the number of worker processes of a running engine");
  cmd->footer(
      "Runs N worker processes (1 to the engine's --max-workers). New workers map the\n"
      "current parameters; removed ones exit after their current step.");
  cmd->add_option("NAME", a->name, "engine name")->required();
  integerIn(cmd->add_option("N", a->workers, "worker processes")->required(), uint32_t{1},
            shmgrad::ipc::kMaxWorkers);
  return {cmd, [a] {
            engine::requestResize(a->name, a->workers);
            std::printf("shmgrad: engine '%s' asked to run %u workers\n", a->name.c_str(),
                        a->workers);
            return kExitOk;
          }};
}

// ---------------------------------------------------------------------------------
// stress, bench: the Python package's tools (they drive trainers and compare against
// PyTorch). Every argument after the command, --help included, goes to Python as is.

int execPython(const char* module, const std::vector<std::string>& rest) {
  std::vector<std::string> args = {shmgrad::config::tunableValue(kPythonEnv), "-m", module};
  args.insert(args.end(), rest.begin(), rest.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());  // returns only on failure
  std::fprintf(stderr, "shmgrad: cannot run %s: %s\n", argv[0], std::strerror(errno));
  return kExitCannotExec;
}

Command addPythonTool(CLI::App& app, const char* name, const char* description,
                      const char* module) {
  CLI::App* cmd = app.add_subcommand(name, description);
  cmd->prefix_command();  // stop parsing at the first argument: all of them are Python's
  cmd->allow_extras();
  cmd->set_help_flag();  // --help too: the Python tool documents its own options
  return {cmd, [cmd, module] { return execPython(module, cmd->remaining()); }};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(kDescription, "shmgrad");
  app.require_subcommand(0, 1);  // none is an error below, with CLI11's message
  app.get_formatter()->column_width(34);

  engine::ServeOptions serve_options;
  StopArgs stop_args;
  std::string status_name;
  ResizeArgs resize_args;
  const std::vector<Command> commands = {
      addServe(app, &serve_options),
      addStop(app, &stop_args),
      addStatus(app, &status_name),
      addResize(app, &resize_args),
      addPythonTool(app, "stress",
                    "run the node-local stress test against an engine (Python package)",
                    "shmgrad_tools.stress"),
      addPythonTool(app, "bench", "run the benchmarks (Python package)", "shmgrad_tools.bench"),
  };
  // After the commands: a subcommand inherits its parent's footer when it is added.
  app.footer("`shmgrad <command> --help` documents each command's options.");

  if (argc > 1 && std::strcmp(argv[1], "serve") == 0) g_serve_args.assign(argv + 2, argv + argc);
  try {
    app.parse(argc, argv);
    if (app.get_subcommands().empty()) throw CLI::RequiredError("A command");
  } catch (const CLI::ParseError& e) {
    // CLI11 prints --help to stdout (exit 0) and errors to stderr.
    return app.exit(e) == static_cast<int>(CLI::ExitCodes::Success) ? kExitOk : kExitUsage;
  }

  for (const Command& c : commands) {
    if (!c.app->parsed()) continue;
    const std::string& cmd = c.app->get_name();
    try {
      return c.run();
    } catch (const shmgrad::Error& e) {
      std::fprintf(stderr, "shmgrad %s: error (%s): %s\n", cmd.c_str(),
                   shmgrad::errorKindName(e.kind()), e.what());
      return kExitFailure;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shmgrad %s: error: %s\n", cmd.c_str(), e.what());
      return kExitFailure;
    }
  }
  return kExitUsage;  // unreachable: one command was required and parsed
}
