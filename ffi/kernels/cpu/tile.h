// Building blocks of the CPU kernels: element conversion and fp32 tile loads.
//
// The kernels compute in fp32 whatever the storage type. Loops are written so
// the innermost one runs over contiguous memory without a reduction, which the
// compiler vectorises without needing reassociation (-ffast-math).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "common/decode.h"
#include "common/mask.h"
#include "jaxflash/launch.h"
#include "jaxflash/params.h"

// The per-tile work functions are compiled twice, for baseline x86-64 and for
// x86-64-v3 (AVX2 + FMA); the loader picks the best one for the machine, so
// the wheel stays portable and recent CPUs get 8-wide vectors.
// The loop helpers below are force-inlined so each clone compiles its own
// copy; an out-of-line helper would be built for the baseline only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JAXFLASH_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define JAXFLASH_CPU_INLINE inline __attribute__((always_inline))
#else
#define JAXFLASH_CPU_CLONES
#define JAXFLASH_CPU_INLINE inline
#endif

namespace jaxflash::cpu {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// Query rows and keys per tile. Small enough that a tile of each operand stays
// in L1/L2 for head_dim <= 256, large enough to amortise the loads. The
// scratch tiles hold head dims up to kMaxHeadDim; a call touches only `dim`
// columns of them, so the wider allocation costs smaller calls nothing.
constexpr int kRowsPerTile = 32;
constexpr int kKeysPerTile = 64;
// Rows that AccumulateVisible multiplies together over the keys they all see.
constexpr int kRowGroup = 4;
static_assert(kRowsPerTile % kRowGroup == 0, "row tiles start on a group");
constexpr int kMaxHeadDim = static_cast<int>(kMaxCpuHeadDim);

// Why the CPU kernels cannot take a call's head dims (q/k's and v's), or Ok.
inline Status HeadDimRefusal(const AttentionShape& sh) {
  if (sh.head_dim <= kMaxHeadDim && sh.v_dim() <= kMaxHeadDim) return Status::Ok();
  return Status::Unimplemented("CPU kernels support head dims <= " + std::to_string(kMaxHeadDim) + ", got " +
                               std::to_string(sh.head_dim) + " and " + std::to_string(sh.v_dim()));
}

inline float Bits2Float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint32_t Float2Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// IEEE half <-> float, round to nearest even.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return Bits2Float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return Bits2Float(sign | ((exp + 112) << 23) | (mant << 13));
  // Subnormal (or zero): mant * 2^-24.
  const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t x = Float2Bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds past the largest half
  if (abs < 0x38800000u) {                         // half subnormal or zero
    // Scale so the half's subnormal unit is 1, and let fp32 rounding (nearest
    // even) do the work.
    const float scaled = Bits2Float(abs) * 16777216.0f;  // 2^24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  const uint32_t mant_lsb = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xfffu + mant_lsb;
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

// 2^x without a libm call, written branch-free so loops over it vectorise
// (baseline x86-64 has no vector floor: truncation of a positive value does
// it). Relative error below 2e-7 (degree-7 Taylor of e^(f ln 2), |f| <= 1/2);
// exactly 0 for x < -126, which covers the -inf of masked scores; NaN for NaN
// and inf above 126.
JAXFLASH_CPU_INLINE float Exp2(float x) {
  // Written so that a NaN x clamps to a finite value here (comparisons with NaN
  // are false) and is passed through by the final select.
  const float clamped = x > -126.f ? (x < 126.f ? x : 126.f) : -126.f;
  const int biased = static_cast<int>(clamped + 127.5f);  // round(x) + 127, positive
  const float f = clamped - static_cast<float>(biased - 127);
  const float t = f * kLn2;
  float p = 1.f / 5040.f;
  p = p * t + 1.f / 720.f;
  p = p * t + 1.f / 120.f;
  p = p * t + 1.f / 24.f;
  p = p * t + 1.f / 6.f;
  p = p * t + 0.5f;
  p = p * t + 1.f;
  p = p * t + 1.f;
  const float scale = Bits2Float(static_cast<uint32_t>(biased) << 23);
  const float y = x < -126.f ? 0.f : (x > 126.f ? std::numeric_limits<float>::infinity() : p * scale);
  return x != x ? x : y;
}

// tanh from Exp2, so loops over it vectorise: 1 - 2 / (e^(2x) + 1). Exactly
// +-1 past Exp2's range (so an infinite score caps to +-c), NaN for NaN;
// absolute error about 1e-7 (the subtraction near 0), the rounding of a
// score of a few units anyway.
JAXFLASH_CPU_INLINE float Tanh(float x) { return 1.f - 2.f / (Exp2(x * (2.f * kLog2e)) + 1.f); }

// The logit soft-cap (params.h) on scores in log2 units, s = log2(e) * u with
// u = scale * q.k: s becomes log2(e) * c * tanh(u / c). Applied before the
// mask, which overrides it.
struct SoftCap {
  float cap;  // > 0
  JAXFLASH_CPU_INLINE void Apply(float* s, int n) const {
    const float in = kLn2 / cap, out = cap * kLog2e;
    for (int i = 0; i < n; ++i) s[i] = out * Tanh(s[i] * in);  // vectorised
  }
  // tanh(u / c) of a capped score: its slope d s / d u is 1 - tanh^2.
  JAXFLASH_CPU_INLINE float TanhOf(float capped) const { return capped * (kLn2 / cap); }
};

// max that propagates NaN (std::max and fmax drop it): a NaN score must make
// its row NaN, not vanish from the running max.
JAXFLASH_CPU_INLINE float MaxNaN(float a, float b) { return (a != a || a > b) ? a : b; }

inline float BFloat16ToFloat(uint16_t b) { return Bits2Float(static_cast<uint32_t>(b) << 16); }

inline uint16_t FloatToBFloat16(float f) {
  const uint32_t x = Float2Bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Storage formats: how one element is read as, and written from, fp32.
struct Float32Format {
  using Storage = float;
  static float Load(float x) { return x; }
  static float Store(float x) { return x; }
};
struct Float16Format {
  using Storage = uint16_t;
  static float Load(uint16_t x) { return HalfToFloat(x); }
  static uint16_t Store(float x) { return FloatToHalf(x); }
};
struct BFloat16Format {
  using Storage = uint16_t;
  static float Load(uint16_t x) { return BFloat16ToFloat(x); }
  static uint16_t Store(float x) { return FloatToBFloat16(x); }
};

// Calls fn(Format{}) for the storage format of `dtype`: the switch runs once
// per tile, not once per element, so the element loops stay vectorisable.
template <typename Fn>
JAXFLASH_CPU_INLINE void WithFormat(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(Float32Format{}); return;
    case DType::kFloat16: fn(Float16Format{}); return;
    case DType::kBFloat16: fn(BFloat16Format{}); return;
  }
}

template <typename Format>
JAXFLASH_CPU_INLINE const typename Format::Storage* As(const void* base) {
  return static_cast<const typename Format::Storage*>(base);
}

// Copies `rows` rows of `dim` elements, `row_stride` apart in `base` starting
// at element `offset`, into dst[rows][dim] as fp32 times `multiplier`.
JAXFLASH_CPU_INLINE void LoadRows(const void* base, int64_t offset, int64_t row_stride, int rows,
                                  int dim, DType dtype, float multiplier, float* dst) {
  WithFormat(dtype, [&](auto format) {
    using Format = decltype(format);
    const auto* src = As<Format>(base) + offset;
    for (int r = 0; r < rows; ++r) {
      for (int d = 0; d < dim; ++d) dst[r * dim + d] = Format::Load(src[r * row_stride + d]) * multiplier;
    }
  });
}

// The same rows stored transposed: dst[dim][rows_capacity], column r = row r.
JAXFLASH_CPU_INLINE void LoadRowsTransposed(const void* base, int64_t offset, int64_t row_stride,
                                            int rows, int dim, DType dtype, int rows_capacity,
                                            float* dst) {
  WithFormat(dtype, [&](auto format) {
    using Format = decltype(format);
    const auto* src = As<Format>(base) + offset;
    for (int r = 0; r < rows; ++r) {
      for (int d = 0; d < dim; ++d) dst[d * rows_capacity + r] = Format::Load(src[r * row_stride + d]);
    }
  });
}

JAXFLASH_CPU_INLINE void StoreRows(void* base, int64_t offset, int64_t row_stride, int rows, int dim,
                                   DType dtype, const float* src) {
  WithFormat(dtype, [&](auto format) {
    using Format = decltype(format);
    auto* dst = static_cast<typename Format::Storage*>(base) + offset;
    for (int r = 0; r < rows; ++r) {
      for (int d = 0; d < dim; ++d) dst[r * row_stride + d] = Format::Store(src[r * dim + d]);
    }
  });
}

// The tile product, written with GCC/Clang vector extensions: Vec is a vector
// of kLanes floats, and a block of kRows output rows by 2 * kLanes columns
// stays in registers across the whole k loop, so each load of b feeds kRows
// multiply-adds (one row at a time gave one per load, and the loads, not the
// arithmetic units, set the pace). Spelled out because the compiler's own
// vectoriser splits such a block into 128-bit pieces and spills them.
namespace product {

template <typename Vec>
JAXFLASH_CPU_INLINE Vec Load(const float* p) {
  typedef float Unaligned __attribute__((vector_size(sizeof(Vec)), aligned(4)));
  return *reinterpret_cast<const Unaligned*>(p);
}
template <typename Vec>
JAXFLASH_CPU_INLINE void Store(float* p, Vec v) {
  typedef float Unaligned __attribute__((vector_size(sizeof(Vec)), aligned(4)));
  *reinterpret_cast<Unaligned*>(p) = v;
}

// out[m][0..kVecs * kLanes) += sum_k a[m][k] * b[k][...] for m < kRows, k <
// inner: kRows x kVecs vectors of accumulators held across the k loop.
template <typename Vec, int kRows, int kVecs>
JAXFLASH_CPU_INLINE void Block(const float* a, int a_stride, int inner, const float* b, int b_stride, float* out,
                               int out_stride) {
  constexpr int kLanes = sizeof(Vec) / sizeof(float);
  Vec acc[kRows][kVecs];
  for (int m = 0; m < kRows; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = Load<Vec>(out + m * out_stride + v * kLanes);
  for (int k = 0; k < inner; ++k) {
    Vec bk[kVecs];
    for (int v = 0; v < kVecs; ++v) bk[v] = Load<Vec>(b + k * b_stride + v * kLanes);
    for (int m = 0; m < kRows; ++m) {
      const float x = a[m * a_stride + k];
      for (int v = 0; v < kVecs; ++v) acc[m][v] += x * bk[v];
    }
  }
  for (int m = 0; m < kRows; ++m)
    for (int v = 0; v < kVecs; ++v) Store<Vec>(out + m * out_stride + v * kLanes, acc[m][v]);
}

// out[m][0..n) += sum_k a[m][k] * b[k][0..n) for m < kRows, k < inner: blocks
// of two vectors of columns, then one, then the last n % kLanes one at a time.
template <typename Vec, int kRows>
JAXFLASH_CPU_INLINE void Rows(const float* a, int a_stride, int inner, const float* b, int b_stride, int n,
                              float* out, int out_stride) {
  constexpr int kLanes = sizeof(Vec) / sizeof(float);
  int d0 = 0;
  for (; d0 + 2 * kLanes <= n; d0 += 2 * kLanes) {
    Block<Vec, kRows, 2>(a, a_stride, inner, b + d0, b_stride, out + d0, out_stride);
  }
  if (d0 + kLanes <= n) {
    Block<Vec, kRows, 1>(a, a_stride, inner, b + d0, b_stride, out + d0, out_stride);
    d0 += kLanes;
  }
  for (int m = 0; d0 < n && m < kRows; ++m) {
    for (int k = 0; k < inner; ++k) {
      const float x = a[m * a_stride + k];
      const float* bk = b + k * b_stride;
      for (int j = d0; j < n; ++j) out[m * out_stride + j] += x * bk[j];
    }
  }
}

// Blocks of 4 rows: with 8-float vectors (AVX2) 8 accumulators, 2 loads of b
// and a broadcast fit the 16 vector registers; with 4-float ones (SSE) too.
template <typename Vec>
JAXFLASH_CPU_INLINE void Accumulate(const float* a, int a_stride, int rows, int inner, const float* b,
                                    int b_stride, int n, float* out, int out_stride) {
  int m = 0;
  for (; m + 4 <= rows; m += 4) {
    Rows<Vec, 4>(a + m * a_stride, a_stride, inner, b, b_stride, n, out + m * out_stride, out_stride);
  }
  for (; m < rows; ++m) {
    Rows<Vec, 1>(a + m * a_stride, a_stride, inner, b, b_stride, n, out + m * out_stride, out_stride);
  }
}

typedef float Vec4 __attribute__((vector_size(16)));
typedef float Vec8 __attribute__((vector_size(32)));

// Two builds, chosen once per process: 8-float vectors and FMA where the CPU
// has AVX2 (x86-64-v3), else 4-float vectors, which every x86-64 and ARM64
// CPU has. (Inside the kernels' target clones an 8-float vector would be
// split into 128-bit halves through the stack in the baseline clone.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v3"))) inline void AccumulateWide(const float* a, int a_stride, int rows,
                                                                      int inner, const float* b, int b_stride,
                                                                      int n, float* out, int out_stride) {
  Accumulate<Vec8>(a, a_stride, rows, inner, b, b_stride, n, out, out_stride);
}
inline bool HasWide() {
  static const bool wide = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return wide;
}
#else
inline bool HasWide() { return false; }
inline void AccumulateWide(const float*, int, int, int, const float*, int, int, float*, int) {}
#endif
inline void AccumulateNarrow(const float* a, int a_stride, int rows, int inner, const float* b, int b_stride,
                             int n, float* out, int out_stride) {
  Accumulate<Vec4>(a, a_stride, rows, inner, b, b_stride, n, out, out_stride);
}

}  // namespace product

// out[m][0..n) += sum_k a[m][k] * b[k][0..n) for m < rows, k < inner: every
// tile product of the kernels (Q K^T with K stored transposed, P V, dS K, ...).
inline void AccumulateProduct(const float* a, int a_stride, int rows, int inner, const float* b, int b_stride,
                              int n, float* out, int out_stride) {
  (product::HasWide() ? product::AccumulateWide : product::AccumulateNarrow)(a, a_stride, rows, inner, b,
                                                                             b_stride, n, out, out_stride);
}

// dst[c][r] = src[r][c] * multiplier for r < rows, c < cols.
JAXFLASH_CPU_INLINE void Transpose(const float* src, int src_stride, int rows, int cols, float multiplier,
                      float* dst, int dst_stride) {
  for (int c = 0; c < cols; ++c) {
    for (int r = 0; r < rows; ++r) dst[c * dst_stride + r] = src[r * src_stride + c] * multiplier;
  }
}

// scores[r][0..cols) = sum_d a[r][d] * bt[d][c]; bt is a tile stored
// transposed, `bt_stride` columns wide.
JAXFLASH_CPU_INLINE void RowsTimesTransposed(const float* a, int rows, int dim, const float* bt,
                                             int bt_stride, int cols, float* scores,
                                             int scores_stride) {
  for (int r = 0; r < rows; ++r) std::fill(scores + r * scores_stride, scores + r * scores_stride + cols, 0.f);
  AccumulateProduct(a, dim, rows, dim, bt, bt_stride, cols, scores, scores_stride);
}

// Visible keys of a row lie in one interval, and so do the rows that see a
// key, so a partly masked tile product can run over exactly the visible pairs
// and never multiply a masked pair's zero weight into a NaN or Inf. Segment
// ids can leave gaps in an interval (`exact` false): then each index of it is
// asked (`sees`).
struct VisibleSpan {
  int begin, end;  // relative to the tile's first column (row), within the tile
  bool exact;
};
// The columns of the tile [c0, c0 + cols) that `row` sees.
JAXFLASH_CPU_INLINE VisibleSpan VisibleColsOf(const MaskPolicy& mask, int row, int c0, int cols) {
  if (!mask.HasKeys(row)) return {0, 0, true};
  const int begin = std::clamp(mask.KeyBegin(row) - c0, 0, cols);  // keys from past the tile: empty
  return {begin, std::max(begin, std::min(mask.KeyEnd(row) - c0, cols)), mask.KeysExact(row)};
}
// The scores s[0..cols) of keys c0.. that `row` does not see set to -inf: outside its
// span a fill, inside asked key by key only where segment ids leave gaps (asked for
// every key, MaskPolicy::Visible recomputes the row's bounds each time).
JAXFLASH_CPU_INLINE void HideUnseen(const MaskPolicy& mask, int row, int c0, int cols, float* s) {
  const VisibleSpan span = VisibleColsOf(mask, row, c0, cols);
  std::fill(s, s + span.begin, kNegInf);
  std::fill(s + span.end, s + cols, kNegInf);
  if (span.exact) return;
  for (int c = span.begin; c < span.end; ++c) {
    if (!mask.SameSegment(row, c0 + c)) s[c] = kNegInf;
  }
}
// The rows of the tile [r0, r0 + rows) that see key `col`.
JAXFLASH_CPU_INLINE VisibleSpan VisibleRowsOf(const MaskPolicy& mask, int col, int r0, int rows) {
  const int begin = std::clamp(mask.RowBegin(col) - r0, 0, rows);
  return {begin, std::max(begin, std::min(mask.RowEnd(col) - r0, rows)), mask.RowsExact(col)};
}

// AccumulateProduct over `rows` x `inner` of a partly masked tile: output row m
// sums only the inner indices span_of(m) (all of them when the tile is full),
// and of a span with gaps only those i for which sees(m, i). Rows go in fours
// over the indices all four see (on a causal diagonal tile nearly all of
// their spans), in the product's 4-row register blocks; the rest of each span
// row by row, whose one-row blocks run at a fraction of the rate (a 64-row
// causal call spent most of its backward there). A row's sum thus depends on
// its group: callers whose row tiles must agree bit for bit start them at a
// multiple of kRowGroup (backward.cc's schemes).
template <typename SpanOf, typename Sees>
JAXFLASH_CPU_INLINE void AccumulateVisible(bool full, const float* a, int a_stride, int rows, int inner,
                                           const float* b, int b_stride, int n, float* out, int out_stride,
                                           SpanOf&& span_of, Sees&& sees) {
  if (full) {
    AccumulateProduct(a, a_stride, rows, inner, b, b_stride, n, out, out_stride);
    return;
  }
  // Row m over the indices [begin, end) of its exact span.
  auto row_part = [&](int m, int begin, int end) {
    if (end > begin) {
      AccumulateProduct(a + m * a_stride + begin, a_stride, 1, end - begin, b + begin * b_stride, b_stride, n,
                        out + m * out_stride, out_stride);
    }
  };
  auto row = [&](int m, const VisibleSpan& s) {
    if (s.exact) {
      row_part(m, s.begin, s.end);
      return;
    }
    for (int i = s.begin; i < s.end; ++i) {
      if (sees(m, i)) row_part(m, i, i + 1);
    }
  };
  static_assert(kRowGroup == 4, "the groups are the product's 4-row blocks");
  int m = 0;
  for (; m + kRowGroup <= rows; m += kRowGroup) {
    const VisibleSpan s[kRowGroup] = {span_of(m), span_of(m + 1), span_of(m + 2), span_of(m + 3)};
    int begin = 0, end = inner;  // the indices all four rows see
    bool exact = true;
    for (const VisibleSpan& x : s) {
      begin = std::max(begin, x.begin);
      end = std::min(end, x.end);
      exact = exact && x.exact;
    }
    if (!exact || end <= begin) {
      for (int j = 0; j < kRowGroup; ++j) row(m + j, s[j]);
      continue;
    }
    AccumulateProduct(a + m * a_stride + begin, a_stride, kRowGroup, end - begin, b + begin * b_stride, b_stride,
                      n, out + m * out_stride, out_stride);
    for (int j = 0; j < kRowGroup; ++j) {
      row_part(m + j, s[j].begin, begin);
      row_part(m + j, end, s[j].end);
    }
  }
  for (; m < rows; ++m) row(m, span_of(m));
}

}  // namespace jaxflash::cpu
