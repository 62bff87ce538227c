// Typed errors. Every message names the problem and, where there is one, the fix.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace shmgrad {

enum class ErrorKind {
  kInvalidArgument,  // bad input from the caller (loss name, shapes, indices, ...)
  kNotFound,         // no engine / model / file of that name
  kBusy,             // another trainer holds the engine
  kTimeout,          // a wait ran past its timeout
  kWorkerFailed,     // a worker raised (model rejected the input) or died repeatedly
  kCorrupt,          // a segment header failed validation
  kNoSpace,          // /dev/shm cannot hold the segment
  kNonFinite,        // NaN or infinity in loss or gradient (when asked to raise)
  kSystem,           // an OS call failed
};

const char* errorKindName(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message)
      : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
inline void appendAll(std::ostringstream&) {}
template <typename T, typename... Rest>
void appendAll(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  appendAll(os, rest...);
}
}  // namespace detail

template <typename... Args>
[[noreturn]] void raise(ErrorKind kind, const Args&... args) {
  std::ostringstream os;
  detail::appendAll(os, args...);
  throw Error(kind, os.str());
}

// Throws shmgrad::Error of the given kind with the concatenated message if cond fails.
#define SHMGRAD_CHECK(cond, kind, ...)                    \
  do {                                                    \
    if (!(cond)) ::shmgrad::raise(kind, __VA_ARGS__);     \
  } while (0)

// Checks an OS call that returns -1 and sets errno.
#define SHMGRAD_SYSCHECK(expr, what)                                              \
  do {                                                                            \
    if ((expr) == -1) ::shmgrad::raise(::shmgrad::ErrorKind::kSystem, what, ": ", \
                                       ::shmgrad::detail::errnoText());           \
  } while (0)

namespace detail {
std::string errnoText();
}

}  // namespace shmgrad
