// How the CUDA kernels modify a score before the softmax: the logit soft-cap
// of params.h and ALiBi's bias (AlibiBias, below), on scores in the log2
// units every kernel works in (x = scale * log2(e) * q·k becomes
// cap2 * tanh(x / cap2), cap2 = softcap * log2(e)).
//
// Kept in one place for the forward tiles (fwd_blocks.cuh's ScaleAndMask, and
// CapAndMask, which leaves tanh and folds cap2 into the exponent),
// the backward's element-wise steps (bwd_blocks.cuh), the exact
// recomputation of NaN rows (exact_rows.cuh) and the SIMT kernels. A call
// without a cap takes each kernel's old path through a uniform branch per
// tile, so it pays nothing.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "common/alibi.h"
#include "jaxflash/params.h"

namespace jaxflash {
namespace tc {

__device__ __forceinline__ float TanhApprox(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float Log2Approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

struct SoftCap {
  float cap2 = 0.f;  // softcap * log2(e); 0: no cap
  float in = 0.f;    // multiplier of a raw product q·k inside the tanh: scale / softcap
  float inv = 0.f;   // 1 / cap2, for scores already in log2 units

  // Built where it is used, per tile: the empty asm keeps the compiler from
  // hoisting the floats out of a kernel's loop and holding them in registers
  // across it (they made the sm90 D 64 dK/dV kernel spill). A kernel uses
  // one or two of them; the others are never computed.
  __device__ __forceinline__ static SoftCap Of(float softcap, float scale) {
    asm volatile("" : "+f"(softcap));
    SoftCap c;
    if (softcap > 0.f) {
      c.cap2 = softcap * 1.4426950408889634f;
      c.in = scale / softcap;
      c.inv = 1.f / c.cap2;
    }
    return c;
  }
  // The cap of a call (FwdParams or BwdParams); with kTakes false, none: the
  // kernels of a tile that takes no cap compile as they would without one.
  template <bool kTakes = true, typename Params>
  __device__ __forceinline__ static SoftCap Of(const Params& p) {
    if constexpr (kTakes) {
      return Of(p.softcap, p.scale);
    } else {
      return SoftCap{};
    }
  }
  __device__ __forceinline__ bool On() const { return cap2 > 0.f; }

  // The capped score in log2 units from a raw product q·k (the scale folded
  // into `in`: one multiply, and the caller's scale register is not needed).
  // tanh.approx is one special-function op with a relative error of 2^-11:
  // the 16-bit kernels round P to 8 or 11 bits anyway. tanh takes +-inf to
  // +-1 and keeps NaN.
  __device__ __forceinline__ float Apply(float qk) const { return cap2 * Tanh(qk); }
  // The same in units of cap2 (tanh itself), for kernels that fold cap2 into
  // the softmax's exponent (fwd_blocks.cuh's CapAndMask).
  __device__ __forceinline__ float Tanh(float qk) const { return TanhApprox(qk * in); }
  // From a score already in log2 units, with tanhf, for the float32 kernels;
  // *th receives tanh, whose slope 1 - tanh^2 the backward multiplies in.
  __device__ __forceinline__ float ApplyExact(float x, float* th) const {
    *th = tanhf(x * inv);
    return cap2 * *th;
  }

  // The slope d capped / d uncapped = 1 - tanh^2 of a pair, recovered from its
  // probability p = exp2(capped - lse2): the tile kernels keep P, and most
  // have no registers for a second tile with the tanh (KeptTanh, below: the
  // D 64 warp-specialised backward has). A pair with p = 0 (masked, or
  // underflowed) has dS = 0 whatever the slope; a NaN p stays NaN through the
  // product.
  __device__ __forceinline__ float SlopeFromProb(float p, float lse2) const {
    const float th = (Log2Approx(p) + lse2) * inv;
    return p > 0.f ? 1.f - th * th : 0.f;
  }
};

// The tanh of a soft-capped score tile (kT accumulator n8 tiles, this lane's
// four entries each), kept in float16 pairs for the slope 1 - tanh^2 that the
// backward multiplies dS by: 16 registers for a 64 x 64 tile's 32 entries a
// thread, in tiles that have them (the D 64 warp-specialised dK/dV passes,
// fused and without dQ). It replaces SoftCap::SlopeFromProb's lg2, the capped
// backward's third special-function op a score, which bounds it at D 64
// (docs/performance-log.md, thirty-ninth session). float16 keeps 11
// significant bits of tanh (within 2^-12 near +-1, so the slope is off by up
// to ~5e-4 there, about 1.5x what tanh.approx's own error gives); dS is
// rounded to 16 bits for its products anyway.
template <int kT>
struct KeptTanh {
  static constexpr bool kOn = true;
  uint32_t h[kT][2];  // entries (0, 1) and (2, 3) of n8 tile nt, the first in the low half

  __device__ __forceinline__ void Keep(int nt, int pair, float first, float second) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(h[nt][pair]) : "f"(second), "f"(first));
  }
  // The slope of entry i of tile nt whose probability is p: 0 where p = 0
  // (masked, or underflowed: dS = 0 whatever the slope, and a non-finite
  // score the mask hid must not reach dS), as SlopeFromProb.
  __device__ __forceinline__ float Slope(int nt, int i, float p) const {
    const __half2 pair = *reinterpret_cast<const __half2*>(&h[nt][i >> 1]);
    const float th = (i & 1) ? __high2float(pair) : __low2float(pair);
    return p > 0.f ? 1.f - th * th : 0.f;
  }
};
// No kept tanh: the slope comes from P (SoftCap::SlopeFromProb).
struct NoKeptTanh {
  static constexpr bool kOn = false;
  __device__ __forceinline__ void Keep(int, int, float, float) {}
  __device__ __forceinline__ float Slope(int, int, float) const { return 0.f; }
};

// ALiBi (common/alibi.h) in the tensor-core kernels: the bias of this lane's
// accumulator entries. An accumulator row (half = 0, 1: rows g and g + 8 of a
// 16-row slab) is one position, its columns col0 + nt * 8 + j (col0 = the
// tile's first column + 2t). Distances are float differences; the positions
// are converted once per row and per tile, not per element.
struct AlibiBias {
  float neg_slope2 = 0.f;  // -slope * log2(e); 0: no bias (the kernels skip it)
  float offset = 0.f;      // the policy's diagonal offset

  // The bias of (batch, query head) under `pol`; with kTakes false, none (a
  // tile whose registers cannot hold it: its launcher never gives it slopes).
  // Built per tile where it is used, like SoftCap::Of: the empty asm keeps
  // the compiler from loading the slope once and holding it (and the offset)
  // across a kernel's loop.
  template <bool kTakes = true, typename Params>
  __device__ __forceinline__ static AlibiBias Of(const Params& p, const MaskPolicy& pol, int batch, int head) {
    AlibiBias a;
    if constexpr (kTakes) {
      asm volatile("" : "+r"(head));
      a.neg_slope2 = Alibi::Of(p.alibi, batch, head, p.shape.q_heads).neg_slope2;
      a.offset = static_cast<float>(pol.offset);
    }
    return a;
  }
  __device__ __forceinline__ bool On() const { return neg_slope2 != 0.f; }
  // The bias in units of raw products q·k, for kernels that fold the scale
  // (`scale_log2` > 0) into the softmax's exponent: bias / scale_log2 (or,
  // under a cap, in units of its factor: CapAndMask passes cap2).
  __device__ __forceinline__ AlibiBias InRawUnits(float scale_log2) const {
    AlibiBias a = *this;
    a.neg_slope2 = neg_slope2 / scale_log2;
    return a;
  }

  // Adds the bias to s; `row` is the position of accumulator row `half`, and
  // kRowsAreQueries says whether rows are query rows (columns keys) or keys.
  // |q + offset - k| with q, k the row and column in either order is
  // |base - (nt * 8 + j)|, base = row +- offset - col0 converted once: per
  // score one subtraction of a constant and one FFMA (with |.|).
  template <bool kRowsAreQueries, int kT>
  __device__ __forceinline__ void Add(float (&s)[kT][4], int half, int row, int col0) const {
    const float base = Base<kRowsAreQueries>(row, col0);
#pragma unroll
    for (int nt = 0; nt < kT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) s[nt][2 * half + j] += neg_slope2 * fabsf(base - float(nt * 8 + j));
  }
  // Which side of the rows' diagonal a tile's keys lie on: +1 when every key
  // of [c0, c_last] is at or before every row of [row_first, row_last] (the
  // causal tiles below the diagonal), -1 when at or after every row (the
  // tiles wholly above it), 0 when the tile straddles it. On one side
  // |base - k| is side * (base - k), so the bias splits into side * slope * k
  // per column (one FFMA with an immediate a score, AddColumns) and
  // -side * slope * base per row (RowOffset), which the softmax adds once a
  // row (OnlineSoftmax::Scores' row_offset) instead of per score.
  __device__ __forceinline__ int Side(int row_first, int row_last, int c0, int c_last) const {
    if (static_cast<float>(row_first) + offset >= static_cast<float>(c_last)) return 1;
    if (static_cast<float>(row_last) + offset <= static_cast<float>(c0)) return -1;
    return 0;
  }
  // Add's per-column part on a one-sided tile (`side` from Side, not 0).
  template <int kT>
  __device__ __forceinline__ void AddColumns(float (&s)[kT][4], int half, int side) const {
    const float per_key = side > 0 ? -neg_slope2 : neg_slope2;
#pragma unroll
    for (int nt = 0; nt < kT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) s[nt][2 * half + j] = fmaf(per_key, float(nt * 8 + j), s[nt][2 * half + j]);
  }
  // Add's per-row part on a one-sided tile: the bias of the row's first column.
  __device__ __forceinline__ float RowOffset(int row, int col0, int side) const {
    const float base = Base<true>(row, col0);
    return side > 0 ? neg_slope2 * base : -neg_slope2 * base;
  }
  // The signed distance of `row`'s diagonal from column col0 (Add's base).
  template <bool kRowsAreQueries>
  __device__ __forceinline__ float Base(int row, int col0) const {
    return static_cast<float>(row - col0) + (kRowsAreQueries ? offset : -offset);
  }
  // The bias of one pair (the soft-capped backward's slope, SlopeFromProb).
  __device__ __forceinline__ float At(int query, int key) const {
    return Alibi{neg_slope2}.Bias(static_cast<float>(query) + offset, static_cast<float>(key));
  }
};

// ALiBi for tiles whose rows mix the query heads of a GQA group (the decode
// kernel's packed rows, common/decode.h): each of a lane's two accumulator
// rows has its own head's slope and its own query row, looked up once per
// tile (two loads per lane); the bias itself is AlibiBias's.
struct PackedAlibi {
  float neg_slope2[2] = {0.f, 0.f};  // per accumulator row (half); 0: no bias
  int row[2] = {0, 0};               // the half's query row
  float offset = 0.f;                // the policy's diagonal offset
  bool on = false;

  // This lane's rows of the 16-row slab starting at packed row `row0`; rows
  // past `total` (padding) get no bias.
  template <typename Params, typename Rows>
  __device__ __forceinline__ static PackedAlibi Of(const Params& p, const MaskPolicy& pol, const Rows& rows,
                                                   int batch, int kv_head, int row0, int lane) {
    PackedAlibi a;
    a.on = p.alibi != nullptr;
    if (!a.on) return a;
    a.offset = static_cast<float>(pol.offset);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + (lane >> 2) + 8 * half;
      if (r < rows.total) {
        a.neg_slope2[half] = Alibi::Of(p.alibi, batch, rows.Head(kv_head, r), p.shape.q_heads).neg_slope2;
        a.row[half] = rows.QueryRow(r);
      }
    }
    return a;
  }
  __device__ __forceinline__ bool On() const { return on; }
  // Adds the bias to this lane's scores of a query-major slab's key tile
  // (col0: the lane's first column).
  template <int kNT>
  __device__ __forceinline__ void Add(float (&s)[kNT][4], int col0) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) AlibiBias{neg_slope2[half], offset}.Add<true>(s, half, row[half], col0);
  }
};

}  // namespace tc
}  // namespace jaxflash
