// The shmgrad command line: serve, stop, status, resize (and the hidden __worker
// entry point the coordinator execs for each worker process).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "engine/coordinator.h"
#include "ipc/error.h"
#include "worker/worker_loop.h"

namespace {

const char* kUsage =
    "usage: shmgrad <command> [options]\n"
    "\n"
    "A gradient engine for data-parallel training on one machine: worker processes\n"
    "with their own libtorch model write gradients straight into shared memory and\n"
    "reduce them in place; trainers attach by name.\n"
    "\n"
    "commands:\n"
    "  serve     start an engine and run until stopped\n"
    "  stop      stop a running engine\n"
    "  status    print an engine's workers, steps served and time breakdown\n"
    "  resize    change the number of worker processes of a running engine\n"
    "  stress    run the node-local stress test against an engine (Python package)\n"
    "  bench     run the benchmarks (Python package)\n"
    "\n"
    "`shmgrad <command> --help` documents each command's options.\n";

const char* kServeUsage =
    "usage: shmgrad serve --name NAME --model PATH --workers N --loss LOSS [options]\n"
    "\n"
    "Starts an engine: creates its shared-memory segment (/dev/shm/shmgrad-<uid>-NAME,\n"
    "mode 0600), forks N worker processes and serves gradients until `shmgrad stop NAME`,\n"
    "SIGTERM or SIGINT, then removes everything.\n"
    "\n"
    "  --name NAME              engine name: 1-64 of [A-Za-z0-9_.-] (required)\n"
    "  --model PATH             TorchScript model file, from torch.jit.save or\n"
    "                           shmgrad.save_model (required)\n"
    "  --workers N              worker processes (default 1)\n"
    "  --max-workers N          gradient slots, the most workers `resize` may ask for\n"
    "                           (default: --workers)\n"
    "  --loss LOSS              cross_entropy | nll | mse (default cross_entropy); the loss\n"
    "                           is summed over the batch\n"
    "  --dataset SPEC           load a dataset once into shared memory: fashion-mnist\n"
    "                           (Debian's dataset-fashion-mnist, train split),\n"
    "                           fashion-mnist:test, or npy:INPUTS.npy,TARGETS.npy\n"
    "  --threads-per-worker T   intra-op threads of each worker (default 1)\n"
    "  --max-batch N            most examples in one step (default 65536)\n"
    "  --input-capacity-mb M    room for an explicit batch's inputs (default 64)\n"
    "  --startup-timeout S      seconds for all workers to load the model (default 120)\n"
    "  --quiet                  print nothing but errors\n";

const char* kStopUsage =
    "usage: shmgrad stop NAME [--timeout S]\n\n"
    "Asks engine NAME to stop and waits (default 30 s) until its segment is gone.\n";
const char* kStatusUsage =
    "usage: shmgrad status NAME\n\n"
    "Prints the engine's workers, the trainer holding it, steps served, and the last\n"
    "steps' time breakdown: wall = compute (slowest worker) + reduce + wait.\n";
const char* kResizeUsage =
    "usage: shmgrad resize NAME N\n\n"
    "Runs N worker processes (1 to the engine's --max-workers). New workers map the\n"
    "current parameters; removed ones exit after their current step.\n";

bool wantsHelp(int argc, char** argv) {
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) return true;
  }
  return false;
}

[[noreturn]] void usageError(const std::string& msg, const char* usage) {
  std::fprintf(stderr, "shmgrad: %s\n\n%s", msg.c_str(), usage);
  std::exit(2);
}

long parseInt(const std::string& flag, const std::string& v, const char* usage) {
  char* end = nullptr;
  long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0') usageError(flag + " needs an integer, got '" + v + "'", usage);
  return x;
}

int cmdServe(int argc, char** argv) {
  shmgrad::engine::ServeOptions o;
  bool have_name = false, have_model = false;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quiet") {
      o.quiet = true;
      continue;
    }
    std::string v;
    size_t eq = a.find('=');
    if (eq != std::string::npos) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else {
      if (i + 1 >= argc) usageError(a + " needs a value", kServeUsage);
      v = argv[++i];
    }
    if (a == "--name") { o.name = v; have_name = true; }
    else if (a == "--model") { o.model_path = v; have_model = true; }
    else if (a == "--workers") o.workers = static_cast<uint32_t>(parseInt(a, v, kServeUsage));
    else if (a == "--max-workers") o.max_workers = static_cast<uint32_t>(parseInt(a, v, kServeUsage));
    else if (a == "--loss") o.loss = v;
    else if (a == "--dataset") o.dataset = v;
    else if (a == "--threads-per-worker") o.threads_per_worker = static_cast<uint32_t>(parseInt(a, v, kServeUsage));
    else if (a == "--max-batch") o.max_batch = parseInt(a, v, kServeUsage);
    else if (a == "--input-capacity-mb") o.input_capacity_mb = static_cast<uint64_t>(parseInt(a, v, kServeUsage));
    else if (a == "--startup-timeout") o.startup_timeout_s = std::atof(v.c_str());
    else if (a == "--worker-binary") o.worker_binary = v;
    else usageError("unknown option " + a, kServeUsage);
  }
  if (!have_name) usageError("--name is required", kServeUsage);
  if (!have_model) usageError("--model is required", kServeUsage);
  return shmgrad::engine::serve(o);
}

int cmdStop(int argc, char** argv) {
  if (argc < 3) usageError("stop needs the engine NAME", kStopUsage);
  double timeout = 30;
  for (int i = 3; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--timeout") == 0) timeout = std::atof(argv[i + 1]);
  }
  if (!shmgrad::engine::requestStop(argv[2], timeout)) {
    std::fprintf(stderr, "shmgrad: engine '%s' did not stop within %.0f s\n", argv[2], timeout);
    return 1;
  }
  std::printf("shmgrad: engine '%s' stopped\n", argv[2]);
  return 0;
}

int cmdStatus(int argc, char** argv) {
  if (argc < 3) usageError("status needs the engine NAME", kStatusUsage);
  std::fputs(shmgrad::engine::statusText(argv[2]).c_str(), stdout);
  return 0;
}

int cmdResize(int argc, char** argv) {
  if (argc < 4) usageError("resize needs NAME and N", kResizeUsage);
  long n = parseInt("N", argv[3], kResizeUsage);
  if (n < 1) usageError("N must be >= 1", kResizeUsage);
  shmgrad::engine::requestResize(argv[2], static_cast<uint32_t>(n));
  std::printf("shmgrad: engine '%s' asked to run %ld workers\n", argv[2], n);
  return 0;
}

int cmdWorker(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "shmgrad __worker is started by `shmgrad serve`, not by hand\n");
    return 2;
  }
  shmgrad::worker::WorkerOptions o;
  o.engine_name = argv[2];
  o.slot = static_cast<uint32_t>(std::atoi(argv[3]));
  o.parent_pid = std::atoi(argv[4]);
  return shmgrad::worker::runWorker(o);
}

// stress and bench live in the Python package (they drive trainers and compare
// against PyTorch); run them through Debian's python3.
int cmdPython(const char* module, int argc, char** argv) {
  std::vector<std::string> args = {"/usr/bin/python3", "-m", module};
  const char* py = std::getenv("SHMGRAD_PYTHON");
  if (py != nullptr && *py != '\0') args[0] = py;
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  std::vector<char*> av;
  for (auto& a : args) av.push_back(a.data());
  av.push_back(nullptr);
  execv(av[0], av.data());
  std::fprintf(stderr, "shmgrad: cannot run %s: %s\n", av[0], std::strerror(errno));
  return 127;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  static const std::map<std::string, const char*> usages = {
      {"serve", kServeUsage}, {"stop", kStopUsage}, {"status", kStatusUsage}, {"resize", kResizeUsage}};
  auto u = usages.find(cmd);
  if (u != usages.end() && wantsHelp(argc, argv)) {
    std::fputs(u->second, stdout);
    return 0;
  }
  try {
    if (cmd == "serve") return cmdServe(argc, argv);
    if (cmd == "stop") return cmdStop(argc, argv);
    if (cmd == "status") return cmdStatus(argc, argv);
    if (cmd == "resize") return cmdResize(argc, argv);
    if (cmd == "__worker") return cmdWorker(argc, argv);
    if (cmd == "stress") return cmdPython("shmgrad.stress", argc, argv);
    if (cmd == "bench") return cmdPython("shmgrad.bench", argc, argv);
  } catch (const shmgrad::Error& e) {
    std::fprintf(stderr, "shmgrad %s: error (%s): %s\n", cmd.c_str(),
                 shmgrad::errorKindName(e.kind()), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmgrad %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
  std::fprintf(stderr, "shmgrad: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
  return 2;
}
