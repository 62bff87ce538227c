// Helpers shared by the C++ tests, torch-free so that the ipc and control tests need no
// libtorch: a segment removed on scope exit, and an assertion on the kind of
// shmgrad::Error a call throws.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>
#include <utility>

#include "ipc/error.h"
#include "ipc/segment.h"

namespace shmgrad::testing {

// Removes the segment on scope exit, whatever happened in between.
class SegmentGuard {
 public:
  explicit SegmentGuard(std::string name) : name_(std::move(name)) {}
  ~SegmentGuard() {
    try {
      ipc::Segment::remove(name_);
    } catch (...) {
    }
  }
  SegmentGuard(const SegmentGuard&) = delete;
  SegmentGuard& operator=(const SegmentGuard&) = delete;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

// Runs fn and succeeds if it threw a shmgrad::Error of `kind` (its message into
// *message); fails, saying what happened, if it threw nothing or something else.
template <typename Fn>
::testing::AssertionResult throwsKind(ErrorKind kind, Fn&& fn, std::string* message = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (message != nullptr) *message = e.what();
    if (e.kind() == kind) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "threw " << errorKindName(e.kind()) << " instead of "
                                         << errorKindName(kind) << ": " << e.what();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-shmgrad exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "threw nothing (expected " << errorKindName(kind) << ")";
}

}  // namespace shmgrad::testing
