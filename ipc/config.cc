#include "ipc/config.h"

#include <cstdlib>
#include <cstring>

#include "ipc/error.h"

namespace shmgrad::config {

namespace {

const Tunable& declared(const char* name) {
  for (const Tunable& t : kTunables) {
    if (std::strcmp(t.name, name) == 0) return t;
  }
  raise(ErrorKind::kInvalidArgument, "tunable ", name,
        " is not declared in ipc/config.h's kTunables: declare it there, with its default");
}

}  // namespace

const char* tunable(const char* name) { return std::getenv(declared(name).name); }

const char* tunableValue(const char* name) {
  const Tunable& t = declared(name);
  SHMGRAD_CHECK(t.value != nullptr, ErrorKind::kInvalidArgument, "tunable ", name,
                " has no declared value (its default is ", t.default_doc,
                "): read it with config::tunable");
  const char* env = std::getenv(name);
  return env != nullptr && *env != '\0' ? env : t.value;
}

bool parseNumber(const char* text, double* value) {
  char* end = nullptr;
  *value = std::strtod(text, &end);
  return end != text && *end == '\0';
}

}  // namespace shmgrad::config
