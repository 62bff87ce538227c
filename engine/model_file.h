// A model's description as the coordinator needs it: its parameters' and shared buffers'
// names, shapes and initial values, nothing else. The coordinator links no libtorch: the
// process that loads the model writes this file (the TorchScript worker program,
// `shmgrad-worker describe`, or the Python launcher for eager workers, through
// shmgrad._C.write_model_file), and the coordinator reads it to create the segment.
//
// The format, written and read only here: "SHMGRADP", u32 version 3, u32 count, then per
// parameter u32 name length, the name, u32 memory format (ipc::MemoryFormat), u32 ndim,
// i64 dims[ndim] and the float32 values in that format's order (as they lie in the
// segment); then u32 count and per shared buffer u32 name length, the name, u32 dtype
// (ipc::DType), u32 ndim, i64 dims and the values. Every size is checked before it is used.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ipc/segment.h"

namespace shmgrad::engine {

struct ModelDescription {
  std::vector<ipc::ParamSpec> params;
  std::vector<std::vector<float>> param_values;     // one per parameter, numel floats
  std::vector<ipc::BufferSpec> buffers;             // shared buffers (BatchNorm statistics)
  std::vector<std::vector<uint8_t>> buffer_values;  // numel * dtypeSize bytes each
};

// Throws Error(kNotFound) when the file cannot be opened and Error(kInvalidArgument) when
// it is not a complete, valid description.
ModelDescription readModelFile(const std::string& path);
// The same reader over a file's bytes (what tests/fuzz feeds it); `path` names it in
// errors. Every size is checked against the bytes left before anything is allocated.
ModelDescription parseModelFile(const std::vector<uint8_t>& bytes, const std::string& path);

// Writes `m` to `path` (mode 0600 unless it exists). Checks what readModelFile checks.
void writeModelFile(const std::string& path, const ModelDescription& m);

}  // namespace shmgrad::engine
