#include "ipc/error.h"

#include <cerrno>
#include <cstring>

namespace shmgrad {

const char* errorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return "InvalidArgument";
    case ErrorKind::kNotFound:
      return "NotFound";
    case ErrorKind::kBusy:
      return "Busy";
    case ErrorKind::kTimeout:
      return "Timeout";
    case ErrorKind::kWorkerFailed:
      return "WorkerFailed";
    case ErrorKind::kCorrupt:
      return "Corrupt";
    case ErrorKind::kNoSpace:
      return "NoSpace";
    case ErrorKind::kNonFinite:
      return "NonFinite";
    case ErrorKind::kSystem:
      return "System";
  }
  return "Unknown";
}

namespace detail {
std::string errnoText() {
  int e = errno;
  return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")";
}
}  // namespace detail

}  // namespace shmgrad
