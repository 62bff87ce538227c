// What every fuzz target shares (tests/fuzz, tools/fuzz.sh): the one outcome a reader may
// have besides success is shmgrad's typed Error; anything else (another exception, a
// property of an accepted input that does not hold) is a crash that libFuzzer keeps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <typeinfo>

#include "ipc/error.h"

namespace shmgrad::fuzz {

// Runs `read`; a shmgrad::Error is the reader refusing the input (fine); any other
// exception escaping a reader of untrusted bytes is a bug (an untyped error, or an
// allocation a size read from the input asked for). Returns true if `read` accepted it.
template <typename F>
bool accepts(F&& read) {
  try {
    read();
    return true;
  } catch (const Error&) {
    return false;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: a reader threw %s (%s), not shmgrad::Error\n", typeid(e).name(),
                 e.what());
    std::abort();
  }
}

// A property of an accepted input: abort (a crash libFuzzer keeps) when it does not hold.
#define FUZZ_EXPECT(cond)                                                            \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "fuzz: %s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                  \
    }                                                                                \
  } while (0)

// Reads the fuzz input from the front, a field at a time; what runs out reads as zeros.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  template <typename T>
  T take() {
    T v{};
    const size_t n = size_ - at_ < sizeof(T) ? size_ - at_ : sizeof(T);
    std::memcpy(&v, data_ + at_, n);
    at_ += n;
    return v;
  }
  const uint8_t* rest() const { return data_ + at_; }
  size_t left() const { return size_ - at_; }
  void skip(size_t n) { at_ += n < left() ? n : left(); }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

}  // namespace shmgrad::fuzz
