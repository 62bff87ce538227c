// How a step's work is split: the shards of a batch, and the in-place reduction of the
// gradient slots, in which each worker sums one slice of every
// participating slot into the reduced buffer.
#pragma once

#include <cstdint>

#include "ipc/layout.h"

namespace shmgrad::ipc {

// The buckets of a bucketed reduction (StepRequest::num_buckets): cuts at parameter
// offsets, each bucket but the last holding at least `target_floats` (raised so that there
// are at most kMaxBuckets), in the parameters' order. Writes cuts[0] = 0 < ... <
// cuts[K] = param_floats and returns K; returns 0 (no buckets) when target_floats is 0,
// when fewer than two buckets would result or when the offsets do not increase.
uint32_t bucketCuts(const ParamEntry* table, uint32_t num_params, uint64_t param_floats,
                    uint64_t target_floats, uint64_t cuts[kMaxBuckets + 1]);

// The slice [begin, end) of `total` floats that rank `rank` of `parts` reduces.
// Slice edges are multiples of 16 floats (one cache line), so no two workers write
// the same line of the reduced buffer.
void sliceBounds(uint64_t total, uint32_t parts, uint32_t rank, uint64_t* begin, uint64_t* end);

// The shard [begin, end) of a batch of `total` examples that rank `rank` of `parts`
// computes: contiguous, sizes differing by at most one. Workers split a step's batch by
// it, and nodes their global batch (shmgrad.multinode.shard).
inline void shardBounds(int64_t total, uint32_t parts, uint32_t rank, int64_t* begin,
                        int64_t* end) {
  *begin = total * rank / parts;
  *end = total * (rank + 1) / parts;
}

// The factor that turns a sum over `count` into its mean, as the gradient (float32) is
// scaled: by the workers on one node, by the trainer across nodes. The count is the
// examples, or a weight that need not be a whole number (tokens in a mean over tokens).
inline float meanScale(double count) { return static_cast<float>(1.0 / count); }

// How a micro-batch's result joins the accumulated one: acc = prev * acc + fresh * new
// (gradient accumulation; the workers on one node, the trainer across nodes). A sum adds
// (1, 1). A mean weights by what each counted: the accumulated result is a mean over
// prev_count, the new one a sum divided by `divisor` (its own count, where it is a mean
// over it; the step's examples, where the slots were scaled by them), and the result is
// the mean over prev_count + count. (0, 0) when nothing was counted.
struct AccumulationWeights {
  double prev, fresh;
};
inline AccumulationWeights accumulationWeights(bool mean, double prev_count, double count,
                                               double divisor) {
  if (!mean) return {1.0, 1.0};
  const double total = prev_count + count;
  if (!(total > 0)) return {0.0, 0.0};
  return {prev_count / total, divisor / total};
}

// out[i] = scale * (in[0][i] + ... + in[n-1][i]) for i in [begin, end). n >= 1. The
// inputs are added in list order, one rounding each, then scaled; accumulateSlice then adds
// a * prev[i] (one rounding for the product, one for the sum): libshmgrad_cuda.so's kernel
// (built with --fmad=false) rounds the same way, so the bits agree (tests/gpu_test.cc).
// Allocates nothing; vectorised (AVX2 where the CPU has it, chosen at load time).
void reduceSlice(float* out, const float* const* in, uint32_t n, uint64_t begin, uint64_t end,
                 float scale);

// out[i] = a * prev[i] + b * (in[0][i] + ... + in[n-1][i]) for i in [begin, end): an
// accumulating step (prev and out are different buffers, so a retried step adds once).
// n >= 1. Allocates nothing.
void accumulateSlice(float* out, const float* prev, float a, const float* const* in, uint32_t n,
                     uint64_t begin, uint64_t end, float b);

// data[i] *= scale for i in [begin, end).
void scaleSlice(float* data, uint64_t begin, uint64_t end, float scale);

// True if any of data[begin, end) is NaN or infinite.
bool anyNonFinite(const float* data, uint64_t begin, uint64_t end);

// dst[i] = src[i] (the same bits) for i in [begin, end), in the same pass true if any of
// them is NaN or infinite: a gradient written into the slot is checked while it is read.
bool copyAnyNonFinite(float* dst, const float* src, uint64_t begin, uint64_t end);

// The largest magnitude among data[0, n) as a float's bits (sign cleared, which orders
// them as the magnitudes): >= 0x7f800000 when any of them is NaN or infinite.
uint32_t maxMagnitudeBits(const float* data, uint64_t n);

// Whether a @ b, where a is [k, m] and b is [k, n] (float32, the product over k), can hold
// no NaN or infinity, given the largest magnitudes in each (maxMagnitudeBits): both finite
// and k * max|a| * max|b| under FLT_MAX / 4. Every element is a sum of k products, at most
// k * max|a| * max|b| in magnitude, and rounding in any order grows such a sum by less
// than a factor e for k < 2^24; finite inputs without overflow make no NaN. Reads a and b
// (k x (m + n) floats) instead of the product (m x n). b_bits 0x3f800000 (1.0): a's sum
// over k.
bool productFinite(uint64_t k, uint32_t a_bits, uint32_t b_bits);

}  // namespace shmgrad::ipc
