// Typed errors. Every message names the problem and, where there is one, the fix.
#pragma once

#include <cerrno>
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
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  // A worker's failure: which slot, and the type of the error it raised there
  // ("TypeError" from an eager worker, "" from C++).
  Error(ErrorKind kind, const std::string& message, int worker, std::string error_type)
      : std::runtime_error(message),
        kind_(kind),
        worker_(worker),
        error_type_(std::move(error_type)) {}
  ErrorKind kind() const { return kind_; }
  int worker() const { return worker_; }  // -1: not a worker's
  const std::string& errorType() const { return error_type_; }

 private:
  ErrorKind kind_;
  int worker_ = -1;
  std::string error_type_;
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
#define SHMGRAD_CHECK(cond, kind, ...)                \
  do {                                                \
    if (!(cond)) ::shmgrad::raise(kind, __VA_ARGS__); \
  } while (0)

namespace detail {
std::string errnoText();

// Runs an OS call that returns -1 and sets errno, again while it fails with EINTR.
// Returns its result, or -errno on failure (so callers can accept an expected errno).
template <typename Call>
long retryEintr(Call call) {
  for (;;) {
    const long rc = static_cast<long>(call());
    if (rc != -1) return rc;
    if (errno != EINTR) return -errno;
  }
}
}  // namespace detail

// Every system call is checked one way: SHMGRAD_SYSCHECK(call(...), "call_name") retries
// EINTR and throws Error(kSystem) naming the call and errno on any other failure; its
// value is the call's result. SHMGRAD_SYSCHECK_OK(call, "name", EXPECTED_ERRNO) also
// accepts that one errno (e.g. ESRCH from kill on a process that is already gone) and
// then yields -1.
#define SHMGRAD_SYSCHECK(expr, what) SHMGRAD_SYSCHECK_OK(expr, what, 0)
#define SHMGRAD_SYSCHECK_OK(expr, what, accepted_errno)                             \
  ([&]() -> long {                                                                  \
    const long shmgrad_rc_ = ::shmgrad::detail::retryEintr([&] { return (expr); }); \
    if (shmgrad_rc_ >= 0) return shmgrad_rc_;                                       \
    if ((accepted_errno) != 0 && -shmgrad_rc_ == (accepted_errno)) return -1;       \
    errno = static_cast<int>(-shmgrad_rc_);                                         \
    ::shmgrad::raise(::shmgrad::ErrorKind::kSystem, what,                           \
                     " failed: ", ::shmgrad::detail::errnoText());                  \
  }())

}  // namespace shmgrad
