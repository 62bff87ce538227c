#include "ipc/config.h"

#include <cstdlib>
#include <cstring>

#include "ipc/error.h"

namespace shmgrad::config {

const char* tunable(const char* name) {
  for (const Tunable& t : kTunables) {
    if (std::strcmp(t.name, name) == 0) return std::getenv(name);
  }
  raise(ErrorKind::kInvalidArgument, "tunable ", name,
        " is not declared in ipc/config.h's kTunables: declare it there, with its default");
}

}  // namespace shmgrad::config
