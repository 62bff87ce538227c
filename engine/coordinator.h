// The engine's coordinator: creates the segment, starts and supervises the worker
// processes, and removes everything on stop. See docs/DESIGN.md.
#pragma once

#include <string>

#include "engine/serve_options.h"

namespace shmgrad::engine {

// Runs the engine until `shmgrad stop`, SIGTERM or SIGINT. Returns the exit code.
// Throws shmgrad::Error for bad options (before anything is created) and for a failed
// start (a worker could not start: kWorkerFailed, with its message; everything created
// is removed first).
int serve(const ServeOptions& options);

// The structured start-up report on ServeOptions::status_fd (nothing when fd < 0): one
// JSON line, {"event":"serving","pid":P} once every worker is ready (serve writes it),
// or {"event":"failed","pid":P,"kind":K,"message":M} with K an errorKindName (the
// command line writes it when serve throws). A launcher reads it instead of parsing
// the log. The client operations (stop, resize, status) are in engine/control.h.
void writeServeReport(int fd, const std::string& event, const std::string& kind,
                      const std::string& message);

}  // namespace shmgrad::engine
