// The in-place reduction of gradient slots: each worker sums one slice of every
// participating slot into the reduced buffer.
#pragma once

#include <cstdint>

namespace shmgrad::ipc {

// The slice [begin, end) of `total` floats that rank `rank` of `parts` reduces.
// Slice edges are multiples of 16 floats (one cache line), so no two workers write
// the same line of the reduced buffer.
void sliceBounds(uint64_t total, uint32_t parts, uint32_t rank, uint64_t* begin, uint64_t* end);

// out[i] = scale * (in[0][i] + ... + in[n-1][i]) for i in [begin, end). n >= 1.
// Allocates nothing; vectorised (AVX2 where the CPU has it, chosen at load time).
void reduceSlice(float* out, const float* const* in, uint32_t n, uint64_t begin, uint64_t end,
                 float scale);

// True if any of data[begin, end) is NaN or infinite.
bool anyNonFinite(const float* data, uint64_t begin, uint64_t end);

}  // namespace shmgrad::ipc
