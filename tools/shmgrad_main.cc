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
#include <type_traits>
#include <vector>

#include "engine/control.h"
#include "engine/coordinator.h"
#include "engine/serve_options.h"
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

// A serve option's default as --help shows it ("=65536"): a value, not one that says
// "none" (0, -1, empty: the option's doc says what those mean), nor a switch's.
template <typename T>
std::string shownDefault(const T& value) {
  if constexpr (std::is_same_v<T, std::string>) {
    return value;
  } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    return value > 0 ? CLI::detail::to_string(value) : std::string();
  } else {
    return {};
  }
}

// One ServeOptions field's option from its list entry (engine/serve_options.h): `flag` is
// the option and its value's name ("--max-batch N"), then its help and shown default. A bool
// is a switch, a list takes commas.
template <typename T>
CLI::Option* addServeOption(CLI::App* cmd, const std::string& flag, const char* doc, T* value) {
  const size_t space = flag.find(' ');
  CLI::Option* option = cmd->add_option(flag.substr(0, space), *value, doc);
  if (space != std::string::npos) option->type_name(flag.substr(space + 1));
  if constexpr (std::is_same_v<T, std::vector<int>>) option->delimiter(',');
  return option->default_str(shownDefault(*value));
}
CLI::Option* addServeOption(CLI::App* cmd, const std::string& flag, const char* doc, bool* value) {
  return cmd->add_flag(flag, *value, doc);
}

#define SHMGRAD_ADD_SERVE_OPTION(type, name, default_value, flag, doc) \
  if (*(flag) != '\0') addServeOption(cmd, flag, doc, &o->name);
#define SHMGRAD_ADD_LAUNCHER_OPTION(type, name, default_value, flag, doc) \
  addServeOption(cmd, flag, doc, &o->name)->group("");

// --workers: a count, or auto (ServeOptions::auto_placement), which leaves the count at its
// default for the coordinator to replace (engine::autoStart).
std::string workersOrAuto(engine::ServeOptions* o, std::string& value) {
  if (value == "auto") {
    o->auto_placement = true;
    value = CLI::detail::to_string(engine::ServeOptions{}.workers);
    return {};
  }
  int64_t n = 0;
  if (!CLI::detail::lexical_cast(value, n) || n < 1 || n > shmgrad::ipc::kMaxWorkers) {
    return "'" + value + "' must be 1 to " + std::to_string(shmgrad::ipc::kMaxWorkers) + " or auto";
  }
  return {};
}

Command addServe(CLI::App& app, engine::ServeOptions* o) {
  CLI::App* cmd = app.add_subcommand("serve", "start an engine and run until stopped");
  cmd->footer(
      "Starts an engine: creates its shared-memory segment (/dev/shm/shmgrad-<uid>-NAME,\n"
      "mode 0600), forks N worker processes and serves gradients until `shmgrad stop NAME`,\n"
      "SIGTERM or SIGINT, then removes everything.");
  // Every option, its help and its default from ServeOptions' lists; what CLI11 cannot say
  // from the type follows, by flag.
  SHMGRAD_SERVE_USER_OPTIONS(SHMGRAD_ADD_SERVE_OPTION)
  SHMGRAD_SERVE_LAUNCHER_OPTIONS(SHMGRAD_ADD_LAUNCHER_OPTION)
  CLI::Option* eager = cmd->add_option("--eager", g_eager_spec,
                                       "eager Python workers instead: MODULE:FUNCTION, where\n"
                                       "FUNCTION() returns a dict with model, loss, dataset\n"
                                       "(optionally collate_fn, forward, loss_reduction);\n"
                                       "any nn.Module, any loss, any torch Dataset (python3 -m\n"
                                       "shmgrad._serve_eager prepares it)")
                           ->type_name("MODULE:FUNCTION");
  cmd->get_option("--name")->required();
  cmd->get_option("--model")->excludes(eager);
  cmd->get_option("--workers")
      ->transform(CLI::Validator([o](std::string& v) { return workersOrAuto(o, v); }, ""));
  integerIn(cmd->get_option("--max-workers"), uint32_t{0}, shmgrad::ipc::kMaxWorkers);
  CLI::Option* loss = cmd->get_option("--loss");
  loss->description(lossChoices() + ": " + loss->get_description());
  integerIn(cmd->get_option("--threads-per-worker"), uint32_t{1},
            shmgrad::ipc::kMaxThreadsPerWorker);
  integerIn(cmd->get_option("--max-batch"), int64_t{1}, shmgrad::ipc::kMaxBatch - 1);
  integerIn(cmd->get_option("--input-capacity-mb"), uint64_t{0}, kMaxInputCapacityMb);
  cmd->get_option("--startup-timeout")->check(CLI::Range(kMinStartupTimeoutS, kMaxStartupTimeoutS));
  cmd->get_option("--status-fd")->check(kOpenDescriptor);
  cmd->get_option("--eager-dataset-size")
      ->check(CLI::Range(int64_t{0}, shmgrad::ipc::kMaxBatch - 1));
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
