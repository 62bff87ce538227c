#include "ipc/reduce.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

namespace shmgrad::ipc {

void sliceBounds(uint64_t total, uint32_t parts, uint32_t rank, uint64_t* begin, uint64_t* end) {
  const uint64_t lines = (total + 15) / 16;
  const uint64_t lo = lines * rank / parts;
  const uint64_t hi = lines * (rank + 1) / parts;
  *begin = std::min(total, lo * 16);
  *end = std::min(total, hi * 16);
}

uint32_t bucketCuts(const ParamEntry* table, uint32_t num_params, uint64_t param_floats,
                    uint64_t target_floats, uint64_t cuts[kMaxBuckets + 1]) {
  if (target_floats == 0 || param_floats == 0) return 0;
  const uint64_t target = std::max(target_floats, (param_floats + kMaxBuckets - 1) / kMaxBuckets);
  uint32_t k = 0;
  cuts[0] = 0;
  uint64_t last = 0;
  for (uint32_t i = 0; i < num_params; ++i) {
    const uint64_t offset = table[i].offset;
    if (offset < last || offset >= param_floats || offset % kAlignFloats != 0) return 0;
    last = offset;
    if (offset - cuts[k] >= target && k + 1 < kMaxBuckets) cuts[++k] = offset;
  }
  cuts[++k] = param_floats;
  return k >= 2 ? k : 0;
}

namespace {

// Blocks keep the partial sums in L1/L2 while the inputs stream through.
constexpr uint64_t kBlock = 4096;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define SHMGRAD_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define SHMGRAD_MULTIVERSION
#endif

SHMGRAD_MULTIVERSION
void reduceBlock(float* __restrict out, const float* const* in, uint32_t n, uint64_t b, uint64_t e,
                 float scale) {
  // First pass writes out (no read of stale data), later passes add up to 3 inputs at a
  // time, and the scale is folded into the last pass.
  const float* __restrict a = in[0];
  if (n == 1) {
    for (uint64_t i = b; i < e; ++i) out[i] = a[i] * scale;
    return;
  }
  const float* __restrict c = in[1];
  if (n == 2) {
    for (uint64_t i = b; i < e; ++i) out[i] = (a[i] + c[i]) * scale;
    return;
  }
  for (uint64_t i = b; i < e; ++i) out[i] = a[i] + c[i];
  uint32_t k = 2;
  while (n - k > 3) {
    const float* __restrict x = in[k];
    const float* __restrict y = in[k + 1];
    const float* __restrict z = in[k + 2];
    // Strictly in list order, ((out + x) + y) + z: the device's reduction adds in the same
    // order, so a CPU engine and a GPU engine give the same bits (as many loads either way).
    for (uint64_t i = b; i < e; ++i) out[i] = out[i] + x[i] + y[i] + z[i];
    k += 3;
  }
  const uint32_t left = n - k;  // 1..3
  const float* __restrict x = in[k];
  if (left == 1) {
    for (uint64_t i = b; i < e; ++i) out[i] = (out[i] + x[i]) * scale;
  } else if (left == 2) {
    const float* __restrict y = in[k + 1];
    for (uint64_t i = b; i < e; ++i) out[i] = (out[i] + x[i] + y[i]) * scale;
  } else {
    const float* __restrict y = in[k + 1];
    const float* __restrict z = in[k + 2];
    for (uint64_t i = b; i < e; ++i) out[i] = (out[i] + x[i] + y[i] + z[i]) * scale;
  }
}

}  // namespace

void reduceSlice(float* out, const float* const* in, uint32_t n, uint64_t begin, uint64_t end,
                 float scale) {
  if (n == 0) {
    for (uint64_t i = begin; i < end; ++i) out[i] = 0.0f;
    return;
  }
  for (uint64_t b = begin; b < end; b += kBlock) {
    reduceBlock(out, in, n, b, std::min(end, b + kBlock), scale);
  }
}

SHMGRAD_MULTIVERSION
void accumulateBlock(float* __restrict out, const float* __restrict prev, float a,
                     const float* const* in, uint32_t n, uint64_t b, uint64_t e, float scale) {
  // The sum of the slots first (as reduceBlock), then one pass folds in the previous result.
  reduceBlock(out, in, n, b, e, scale);
  for (uint64_t i = b; i < e; ++i) out[i] += a * prev[i];
}

void accumulateSlice(float* out, const float* prev, float a, const float* const* in, uint32_t n,
                     uint64_t begin, uint64_t end, float scale) {
  for (uint64_t b = begin; b < end; b += kBlock) {
    accumulateBlock(out, prev, a, in, n, b, std::min(end, b + kBlock), scale);
  }
}

SHMGRAD_MULTIVERSION
void scaleSlice(float* data, uint64_t begin, uint64_t end, float scale) {
  for (uint64_t i = begin; i < end; ++i) data[i] *= scale;
}

// 1 when a float's bits are inf or NaN (an exponent of all ones). The loops below
// OR-reduce it over integers, which vectorises (a float sum would be one serial chain of
// dependent adds).
inline uint32_t nonFiniteBits(uint32_t u) {
  return static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
}

SHMGRAD_MULTIVERSION
bool anyNonFinite(const float* data, uint64_t begin, uint64_t end) {
  uint32_t bad = 0;
  for (uint64_t i = begin; i < end; ++i) {
    uint32_t u;
    std::memcpy(&u, data + i, sizeof(u));
    bad |= nonFiniteBits(u);
  }
  return bad != 0;
}

SHMGRAD_MULTIVERSION
bool copyAnyNonFinite(float* __restrict dst, const float* __restrict src, uint64_t begin,
                      uint64_t end) {
  uint32_t bad = 0;
  for (uint64_t i = begin; i < end; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    std::memcpy(dst + i, &u, sizeof(u));
    bad |= nonFiniteBits(u);
  }
  return bad != 0;
}

SHMGRAD_MULTIVERSION
uint32_t maxMagnitudeBits(const float* data, uint64_t n) {
  uint32_t most = 0;
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, data + i, sizeof(u));
    u &= 0x7fffffffu;
    most = u > most ? u : most;
  }
  return most;
}

bool productFinite(uint64_t k, uint32_t a_bits, uint32_t b_bits) {
  if (a_bits >= 0x7f800000u || b_bits >= 0x7f800000u || k >= (uint64_t{1} << 24)) return false;
  float a, b;
  std::memcpy(&a, &a_bits, sizeof(a));
  std::memcpy(&b, &b_bits, sizeof(b));
  return static_cast<double>(k) * a * b * 4.0 < static_cast<double>(FLT_MAX);
}

}  // namespace shmgrad::ipc
