// Pieces of the tensor-core forward that do not depend on how the products
// are computed, shared by the sm80 (mma.sync) and sm90 (wgmma) mainloops:
// the CTA's rows and the key tiles they visit (FwdBlock), the scale-and-mask
// step on a tile of scores, P packed as an A operand, and the epilogue that
// writes O and LSE.
//
// Scores and outputs are held in the mma.sync accumulator layout (mma.cuh):
// a warp owns kMT m16 row tiles starting at CTA row `warp_row0`; lane (g, t)
// holds rows g and g + 8 of each, columns 8 nt + 2t and 8 nt + 2t + 1. The
// wgmma accumulator of one warp has the same layout, so both kernels call
// these with their own warp_row0.
#pragma once

#include <cmath>

#include "common/dense_tile.cuh"
#include "common/exact_rows.cuh"
#include "common/grid_order.cuh"
#include "common/mask.h"
#include "common/mma.cuh"
#include "common/score_mod.cuh"
#include "common/segment_mask.cuh"
#include "common/softmax.cuh"
#include "jaxflash/params.h"

namespace jaxflash {
namespace tc {

// Key tiles of kN keys that rows [r0, r_end) must visit: [begin, end).
// Tiles the mask excludes for every one of these rows are never visited.
struct KeyTiles {
  int begin = 0;
  int end = 0;
};
template <int kN>
__device__ __forceinline__ KeyTiles KeyTileRange(const MaskPolicy& pol, int r0, int r_end) {
  KeyTiles tiles;
  if (r_end > r0) {
    const int key_begin = pol.BlockKeyBegin(r0);
    const int key_end = pol.BlockKeyEnd(r_end - 1);
    if (key_end > key_begin) {
      tiles.begin = key_begin / kN;
      tiles.end = (key_end + kN - 1) / kN;
    }
  }
  return tiles;
}

// The key tiles, within `tiles`, that every row of [r0, r_end) sees whole
// (no element masked): kernels run those without the mask. They are the
// tiles inside the policy's FullKeys, so contiguous. Empty (begin == end) when there is none,
// and never past tiles.end: the last row's window can start beyond the keys
// (a local window with q_len > kv_len), and a begin past tiles.end made the
// warp-specialised forward's unmasked loop wait for a tile its producer never
// loads (a hang, twelfth session; a brute-force check of the bounds over
// random shapes, masks and tile sizes found 5035 such blocks before, none after).
template <int kN>
__device__ __forceinline__ KeyTiles FullKeyTiles(const MaskPolicy& pol, int r0, int r_end, KeyTiles tiles) {
  KeyTiles full;
  const MaskPolicy::Keys keys = pol.FullKeys(r0, r_end);
  full.begin = MinInt(tiles.end, MaxInt(tiles.begin, (keys.begin + kN - 1) / kN));
  full.end = MaxInt(full.begin, MinInt(tiles.end, keys.end / kN));
  return full;
}

// One CTA's share of the forward (or of the dQ pass of the backward, which
// walks keys the same way): query rows [r0, r_end) of (batch, head), the key
// tiles those rows visit, and where their Q, K and V start in global memory
// (K and V of the head's GQA group, found by index arithmetic).
template <typename T>
struct FwdBlock {
  int batch, head;
  MaskPolicy pol;
  int r0, r_end;  // r_end stops at the batch element's real query rows
  KeyTiles tiles;
  int64_t q_row_stride, kv_row_stride;
  const T* q;  // row r0 of this head
  const T* k;  // key 0 of this head's K/V head
  const T* v;

  // Element offset of row r0 of (batch, head) in q (and o where v's head dim
  // is q's), and in o.
  __device__ __forceinline__ static int64_t QOffset(const AttentionShape& sh, int batch, int head, int r0) {
    return batch * sh.q_batch_stride() + r0 * sh.q_row_stride() + head * sh.head_dim;
  }
  __device__ __forceinline__ static int64_t OOffset(const AttentionShape& sh, int batch, int head, int r0) {
    return batch * sh.o_batch_stride() + r0 * sh.o_row_stride() + head * sh.v_dim();
  }

  // The row block a CTA of a grid-shaped kernel takes (grid (row blocks,
  // heads, batch), in the order of grid_order.cuh); the persistent kernels
  // name theirs from their scheduler.
  // kSegments: as MaskPolicy::For's (false in tiles that take no segment ids).
  template <int kM, int kN, bool kSegments = true, typename Params>  // FwdParams or BwdParams
  __device__ __forceinline__ static FwdBlock OfGrid(const Params& p) {
    const GridTile t = OrderedGridTile<HeavyTiles::kLast>(p);
    return At<kM, kN, kSegments>(p, t.tile, t.y, t.z);
  }
  template <int kM, int kN, bool kSegments = true, typename Params>
  __device__ __forceinline__ static FwdBlock At(const Params& p, int m_block, int head, int batch) {
    const AttentionShape& sh = p.shape;
    FwdBlock b;
    b.batch = batch;
    b.head = head;
    const int kv_head = b.head / static_cast<int>(sh.group_size());
    b.pol = MaskPolicy::For<kSegments>(p.mask, static_cast<int>(sh.q_len), static_cast<int>(sh.kv_len),
                                       p.q_lengths, p.kv_lengths, b.batch);
    b.r0 = m_block * kM;
    b.r_end = MinInt(b.r0 + kM, b.pol.q_valid);
    b.tiles = KeyTileRange<kN>(b.pol, b.r0, b.r_end);
    b.q_row_stride = sh.q_row_stride();
    b.kv_row_stride = sh.kv_row_stride();
    b.q = static_cast<const T*>(p.q) + QOffset(sh, b.batch, b.head, b.r0);
    const int64_t kv_offset = b.batch * sh.kv_batch_stride() + kv_head * sh.head_dim;
    b.k = static_cast<const T*>(p.k) + kv_offset;
    b.v = static_cast<const T*>(p.v) + kv_offset;
    return b;
  }
};

// The query row of CTA row r: the identity, except in the decode kernels,
// whose rows pack the query heads of a GQA group (decode/decode_kernel.cuh).
struct SameRow {
  __device__ __forceinline__ int operator()(int r) const { return r; }
};

// Adds ALiBi's bias (score_mod.cuh) to a query-major score tile: this warp's
// rows from `row0`, key tile [c0, c0 + kNT * 8).
template <int kMT, int kNT>
__device__ __forceinline__ void AddAlibi(float (&s)[kMT][kNT][4], const AlibiBias& alibi, int row0, int c0,
                                         int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) alibi.Add<true>(s[mt], half, row0 + mt * 16 + g + half * 8, c0 + 2 * t);
}

// AddAlibi for a kernel whose softmax takes per-row offsets: on a tile whose
// keys lie on one side of all of this warp's rows (AlibiBias::Side) only the
// per-column part goes into s, one FFMA a score where Add takes two, and each
// row's part into row_offset (OnlineSoftmax::Scores); a straddling tile gets
// Add and zero offsets.
template <int kMT, int kNT>
__device__ __forceinline__ void AddAlibiSplit(float (&s)[kMT][kNT][4], const AlibiBias& alibi, int row0, int c0,
                                              int lane, float (&row_offset)[2 * kMT]) {
  const int side = alibi.Side(row0, row0 + 16 * kMT - 1, c0, c0 + 8 * kNT - 1);
  if (side == 0) {
    AddAlibi(s, alibi, row0, c0, lane);
#pragma unroll
    for (int r = 0; r < 2 * kMT; ++r) row_offset[r] = 0.f;
    return;
  }
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      alibi.AddColumns(s[mt], half, side);
      row_offset[2 * mt + half] = alibi.RowOffset(row0 + mt * 16 + g + half * 8, c0 + 2 * t, side);
    }
}

// The same for tiles whose rows mix heads (the decode kernel: one slab of
// 16 packed rows per warp, its slopes and diagonals in `alibi`).
template <int kNT>
__device__ __forceinline__ void AddAlibi(float (&s)[1][kNT][4], const PackedAlibi& alibi, int /*row0*/, int c0,
                                         int lane) {
  alibi.Add(s[0], c0 + 2 * (lane & 3));
}

// Multiplies the scores of key tile [c0, c0 + kNT * 8) by scale * log2(e)
// (unless kScale is false: MaskScores) and sets the entries the mask hides to
// -inf. `full` (the policy admits the whole tile for the CTA's rows) skips the
// per-element test; `r0` is the CTA's first row, `query_row` maps a row to the
// query row the mask knows.
// `cap` (score_mod.cuh, built with the call's scale) caps the scores instead
// of scaling them, and `alibi` adds ALiBi's bias after that (an AlibiBias,
// or the decode kernel's PackedAlibi, whose rows mix heads), then `dense`
// (dense_tile.cuh; null: none) its bias and mask, before the mask rule's;
// with any of them, kScale must be true.
template <bool kScale = true, int kMT, int kNT, typename QueryRow = SameRow, typename Bias = AlibiBias>
__device__ __forceinline__ void ScaleAndMask(float (&s)[kMT][kNT][4], const MaskPolicy& pol, bool full, int r0,
                                             int warp_row0, int c0, int lane, float scale_log2,
                                             QueryRow query_row = {}, SoftCap cap = {}, Bias alibi = {},
                                             const DenseTile* dense = nullptr) {
  if constexpr (kScale) {
    // Uniform branches: capped calls take the first, ALiBi's without a cap the
    // second, the others the loop below. (One branch for both, with a select
    // per score, spilled the 128-key D 128 forward tiles.)
    const bool capped = cap.On();
    if (capped || alibi.On() || dense != nullptr) {
      if (capped) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[mt][nt][i] = cap.Apply(s[mt][nt][i]);
      } else {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[mt][nt][i] *= scale_log2;
      }
      if (alibi.On()) AddAlibi(s, alibi, r0 + warp_row0, c0, lane);
      if (dense != nullptr) dense->ApplyRows(s, r0 + warp_row0, c0, lane);
      ScaleAndMask<false>(s, pol, full, r0, warp_row0, c0, lane, 1.f, query_row);
      return;
    }
  }
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // This lane's columns of the row are c0 + nt * 8 + 2t + j; the row sees
      // [lo, hi) of them, measured from c0 + 2t. Padding rows (past q_valid)
      // are not tested: whatever they compute, FinishRows gives them O = 0 and
      // kEmptyRowLse and never flags them for recomputation, and rows do not
      // mix in the forward. Leaving the test out saves the registers the
      // loaded diagonal offset costs (it kept three tiles from spilling).
      int lo = 0, hi = kNT * 8;
      if (!full) {
        const int row = query_row(r0 + warp_row0 + mt * 16 + g + half * 8);
        lo = pol.KeyBegin(row) - c0 - 2 * t;
        hi = pol.KeyEnd(row) - c0 - 2 * t;
        HideOtherSegments<true>(s[mt], half, pol, row, c0, t, -INFINITY);  // segment_mask.cuh
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = nt * 8 + j;
          float& x = s[mt][nt][2 * half + j];
          x = (full || (col >= lo && col < hi)) ? (kScale ? x * scale_log2 : x) : -INFINITY;
        }
    }
}

// Sets the entries the mask hides to -inf and leaves the others as they are,
// for kernels that fold the scale into the softmax's exponent (only boundary
// tiles, the ones the policy does not find full, need it).
template <int kMT, int kNT>
__device__ __forceinline__ void MaskScores(float (&s)[kMT][kNT][4], const MaskPolicy& pol, int r0, int warp_row0,
                                           int c0, int lane) {
  ScaleAndMask<false>(s, pol, false, r0, warp_row0, c0, lane, 1.f);
}

// Caps the scores of key tile [c0, c0 + kNT * 8) for kernels that fold a
// factor into the softmax's exponent: s becomes tanh(scale * q·k / softcap),
// the capped score in units of cap.cap2 (the caller passes cap.cap2 as the
// exponent's scale: one multiply a score fewer than ScaleAndMask's cap), then
// ALiBi's bias in the same units and the hidden entries at -inf, as
// ScaleAndMask does.
template <int kMT, int kNT>
__device__ __forceinline__ void CapAndMask(float (&s)[kMT][kNT][4], const MaskPolicy& pol, bool full, int r0,
                                          int warp_row0, int c0, int lane, const SoftCap& cap,
                                          const AlibiBias& alibi) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mt][nt][i] = cap.Tanh(s[mt][nt][i]);
  if (alibi.On()) AddAlibi(s, alibi.InRawUnits(cap.cap2), r0 + warp_row0, c0, lane);
  if (!full) ScaleAndMask<false>(s, pol, false, r0, warp_row0, c0, lane, 1.f);
}

// The A fragment (16 rows x 16 k) of P for k step kk, packed from two
// adjacent n8 tiles of probabilities: the accumulator of columns
// [16 kk, 16 kk + 16) is exactly the A layout of mma.sync and of wgmma's
// register operand, so P never leaves the registers.
template <typename T, int kNT>
__device__ __forceinline__ void PackAFragment(const float (&p)[kNT][4], int kk, uint32_t (&a)[4]) {
  a[0] = ElemTraits<T>::Pack(p[2 * kk][0], p[2 * kk][1]);
  a[1] = ElemTraits<T>::Pack(p[2 * kk][2], p[2 * kk][3]);
  a[2] = ElemTraits<T>::Pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
  a[3] = ElemTraits<T>::Pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
}

// All kNT / 2 A fragments of a tile of probabilities, one per k step.
template <typename T, int kNT>
__device__ __forceinline__ void PackAFragments(const float (&p)[kNT][4], uint32_t (&a)[kNT / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) PackAFragment<T>(p, kk, a[kk]);
}

// The rules every forward applies to this warp's rows once Finalize has run
// (o, lse in the accumulator layout; row0 is the warp's first row in the
// sequence): a row that sees no key (padding queries past q_valid among them,
// which full tiles did not mask) gets O = 0 and kEmptyRowLse. Returns a bit
// mask with bit r set where this lane's entries of row r (mt * 2 + half) with
// a finite LSE show a NaN (possibly a masked pair's 0 * NaN from P·V): the
// lane recomputes them exactly (ExactOutputLane). Lane by lane, no warp
// collective. (A mask, not an array: a caller indexing an array in a rolled
// loop had it kept in local memory.) `seen`: bit r clear where a dense mask
// left row r without keys (DenseTile::Seen, shared over the quad).
template <int kMT, int kDT>
__device__ __forceinline__ unsigned FinishRows(float (&o)[kMT][kDT][4], float (&lse)[2 * kMT],
                                               const MaskPolicy& pol, int row0, int lane, unsigned seen = ~0u) {
  unsigned redo = 0;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 2 + half;
      const bool keys = pol.HasKeys(row0 + mt * 16 + (lane >> 2) + half * 8) && (seen >> r & 1u);
      if (keys && isfinite(lse[r]) && LaneHasNan(o[mt], half)) redo |= 1u << r;
      if (!keys) {
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) o[mt][dt][2 * half] = o[mt][dt][2 * half + 1] = 0.f;
        lse[r] = kEmptyRowLse;
      }
    }
  }
  return redo;
}

// Normalises the output accumulator, then writes this warp's rows of O
// (columns below head_dim) and LSE, by the rules of FinishRows (`seen` as
// there); rows past q_len are not stored. The addresses are recomputed from
// the parameters (constant memory) rather than kept in registers through the
// main loop. kDense: the kernel takes a dense term (ExactOutputLane reads it).
template <typename T, bool kDense = false, int kMT, int kDT>
__device__ __forceinline__ void StoreOutput(OnlineSoftmax<kMT>& softmax, float (&o)[kMT][kDT][4],
                                            const FwdParams& p, const MaskPolicy& pol, int batch, int head,
                                            int r0, int warp_row0, int lane, unsigned seen = ~0u) {
  const AttentionShape& sh = p.shape;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(sh.head_dim);
  const int64_t q_row_stride = sh.q_row_stride();
  float lse[2 * kMT];
  softmax.Finalize(o, lse);
  const unsigned redo = FinishRows(o, lse, pol, r0 + warp_row0, lane, seen);
  T* gO = static_cast<T*>(p.o) + FwdBlock<T>::QOffset(sh, batch, head, r0);
  float* gLse = p.lse + (int64_t(batch) * sh.q_heads + head) * sh.q_len;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 2 + half;
      const int row = warp_row0 + mt * 16 + g + half * 8;  // within the CTA
      if (r0 + row >= sh.q_len) continue;
      if (t == 0) gLse[r0 + row] = lse[r];
      T* dst = gO + row * q_row_stride;
      if (redo >> r & 1u) {  // this lane's entries, exactly and straight to memory
        ExactOutputLane<T, kDT, true, kDense>(p, batch, head, r0 + row, lse[r], t, [&](int dt, float2 x) {
          *reinterpret_cast<uint32_t*>(dst + dt * 8 + 2 * t) = ElemTraits<T>::Pack(x.x, x.y);
        });
        continue;
      }
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        const int col = dt * 8 + 2 * t;
        if (col < head_dim) {
          *reinterpret_cast<uint32_t*>(dst + col) = ElemTraits<T>::Pack(o[mt][dt][2 * half], o[mt][dt][2 * half + 1]);
        }
      }
    }
  }
}

}  // namespace tc
}  // namespace jaxflash
