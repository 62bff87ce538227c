// The options of `shmgrad serve` (what engine::serve takes), declared once. Header only, no
// libtorch: the coordinator, the command line and the Python binding include it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ipc/config.h"
#include "ipc/layout.h"
#include "ipc/record.h"

namespace shmgrad::engine {

// X(type, name, default, flag, doc) (ipc/record.h): `flag` is the command line's option and
// the name of its value as --help and docs/CLI.md show them ("--max-batch N"; "" for a field
// no flag sets). From these lists come the struct, `shmgrad serve`'s flags, help and shown
// defaults (tools/shmgrad_main.cc; what CLI11 cannot say from the type, such as a range, is
// added there by flag), and shmgrad._C.SERVE_OPTIONS, from which the Python launcher takes
// its flags and defaults and shmgrad.serve and Engine their defaults; tests check Python's
// names and defaults and docs/CLI.md's table against it.
// To add an option: a line here (the launchers' list when users do not give it), its use in
// engine/coordinator.cc, its check in tools/shmgrad_main.cc if it needs one, in Python its
// ServeOptions field (python/shmgrad/_launcher.py) and serve()'s argument, a row of
// docs/CLI.md, and its test.
//
// workers: with --workers auto (auto_placement), one worker per physical core (at most
// max_workers, when given), each able to use every core (threads_per_worker is then the core
// count); the trainer probes workers x threads on its first steps and keeps the fastest
// (engine/placement.h).
#define SHMGRAD_SERVE_USER_OPTIONS(X)                                                           \
  X(std::string, name, "", "--name NAME", "engine name: 1-64 of [A-Za-z0-9_.-] (required)")     \
  X(std::string, model_path, "", "--model PATH",                                                \
    "TorchScript model file, from torch.jit.save or\n"                                          \
    "shmgrad.save_model (required unless --eager)")                                             \
  X(std::string, numerics, "", "--numerics SPEC",                                               \
    "the workers' torch numerics, e.g. matmul_precision=high,cudnn_tf32=1,\n"                   \
    "cudnn_benchmark=0,cudnn_deterministic=0 (default: torch's; Engine and\n"                   \
    "shmgrad.serve give the trainer's own)")                                                    \
  X(uint32_t, workers, 1, "--workers N|auto",                                                   \
    "worker processes, or auto: one per core, and\n"                                            \
    "the trainer times workers x threads per worker on its\n"                                   \
    "first steps and keeps the fastest (status shows it)")                                      \
  X(bool, auto_placement, false, "", "--workers auto: the trainer places each step")            \
  X(uint32_t, max_workers, 0, "--max-workers N",                                                \
    "gradient slots, the most workers `resize` may ask for\n"                                   \
    "(default: --workers)")                                                                     \
  X(std::string, loss, ipc::kLossNames[1], "--loss LOSS",                                       \
    "the loss of TorchScript\n"                                                                 \
    "workers, summed over the batch")                                                           \
  X(std::string, dataset, "", "--dataset SPEC",                                                 \
    "load a dataset once into shared memory: fashion-mnist\n"                                   \
    "(Debian's dataset-fashion-mnist, train split),\n"                                          \
    "fashion-mnist:test, or npy:INPUTS.npy,TARGETS.npy")                                        \
  X(uint32_t, threads_per_worker, config::kDefaultThreadsPerWorker, "--threads-per-worker T",   \
    "intra-op threads of each worker")                                                          \
  X(int64_t, max_batch, config::kDefaultMaxBatch, "--max-batch N", "most examples in one step") \
  X(uint64_t, input_capacity_mb, config::kDefaultInputCapacityMb, "--input-capacity-mb M",      \
    "room for an explicit batch's inputs")                                                      \
  X(double, startup_timeout, config::kDefaultStartupTimeoutS, "--startup-timeout S",            \
    "seconds for all workers to load the model")                                                \
  X(int, status_fd, -1, "--status-fd FD",                                                       \
    "write one JSON line to this open file descriptor:\n"                                       \
    "{\"event\":\"serving\",...} once the workers are ready, or\n"                              \
    "{\"event\":\"failed\",\"kind\":...,\"message\":...} if serve fails")                       \
  X(std::vector<int>, devices, {}, "--devices N,N",                                             \
    "CUDA ordinals (0,1): the workers compute on these GPUs,\n"                                 \
    "round-robin; the first holds the trainer's parameters and\n"                               \
    "reduced gradient (docs/GPU.md)")                                                           \
  X(bool, quiet, false, "--quiet", "print nothing but errors")

// Set by the launchers (shmgrad._serve_eager, shmgrad.Engine) and the tests; hidden in
// --help. Eager workers run `python -m shmgrad._eager_worker` on the pickled job instead of
// the TorchScript worker, and model_path then holds the parameters' holder the launcher
// wrote. loss_reduction: what the job's loss returns for a batch as the launcher found it
// (ipc::LossReduction; named losses are sums). worker_binary: tests run workers from another
// program (the slot number, engine name and parent pid are appended to its arguments).
#define SHMGRAD_SERVE_LAUNCHER_OPTIONS(X)                                                  \
  X(std::string, eager_job, "", "--eager-job PATH", "the pickled eager job")               \
  X(std::string, loss_reduction, "", "--loss-reduction R",                                 \
    "sum, mean or weighted (empty: the workers find out)")                                 \
  X(std::string, python, "", "--python PATH", "the interpreter of the eager workers")      \
  X(int64_t, eager_dataset_size, 0, "--eager-dataset-size N", "examples the workers hold") \
  X(std::string, owned_dir, "", "--owned-dir DIR",                                         \
    "removed (its plain files, then itself) when the engine stops")                        \
  X(std::string, worker_binary, "", "--worker-binary PATH",                                \
    "the TorchScript worker program (default: shmgrad-worker next to this one)")

#define SHMGRAD_SERVE_OPTIONS_FIELDS(X) \
  SHMGRAD_SERVE_USER_OPTIONS(X)         \
  SHMGRAD_SERVE_LAUNCHER_OPTIONS(X)

struct ServeOptions {
  SHMGRAD_SERVE_OPTIONS_FIELDS(SHMGRAD_DECLARE_OPTION)
};

}  // namespace shmgrad::engine
