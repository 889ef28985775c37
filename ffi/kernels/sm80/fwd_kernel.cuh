// FlashAttention-2 forward for sm80 and later (mma.sync; also the Hopper
// fallback).
//
// One CTA computes kM query rows of one (batch, head); warps split the rows
// (each owns kMT m16 tiles) and share every K/V tile, so no cross-warp
// reduction is ever needed. K/V tiles of kN keys stream through shared memory:
// the V load overlaps Q·Kᵀ and the softmax, the next K load overlaps P·V.
// Scores stay in registers and are re-packed as the A operand of P·V.
//
// Tiles the mask policy excludes are never visited; tiles it fully includes
// skip per-element masking. A dense bias (staged beside K where it can be)
// and mask come from dense_tile.cuh; tiles the dense mask hides are skipped.
// Head dims are compiled in buckets kD; columns past the real head_dim are
// zero-filled on load (so they add nothing to Q·Kᵀ or P·V) and never stored.
#pragma once

#include <cuda_runtime.h>

#include "common/fwd_blocks.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "common/mma.cuh"
#include "common/softmax.cuh"
#include "jaxflash/params.h"
#include "sm80/launch_sm80.h"

namespace jaxflash {
namespace sm80 {

template <int kD_, int kWarps_, int kMT_, int kN_>
struct FwdTile {
  static constexpr int kD = kD_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kMT = kMT_;  // m16 tiles per warp
  static constexpr int kN = kN_;    // keys per K/V tile
  static constexpr int kM = kWarps * 16 * kMT;
  static constexpr int kThreads = kWarps * 32;
  // Two 4-warp CTAs share an SM (each may use 255 registers per thread); an
  // 8-warp CTA has the SM's registers to itself.
  static constexpr int kCtasPerSm = kWarps <= 4 ? 2 : 1;
  // The extras a tile takes (launch_util.cuh, TileTakes): all, but ALiBi's
  // bias where two CTAs share an SM with two m16 tiles of 128 keys per warp
  // (its code spilled 16 bytes); such calls run another candidate of the bucket.
  static constexpr bool kTakesSoftCap = true;
  static constexpr bool kTakesSegments = true;
  static constexpr bool kTakesAlibi = !(kCtasPerSm == 2 && kMT * kN >= 256);
  // A dense bias and mask (dense_tile.cuh): tiles of one m16 row tile per warp,
  // and two of 64 keys at D <= 64 (the others spilled 132-184 bytes with them).
  static constexpr bool kTakesDense = kMT == 1 || (kD <= 64 && kMT * kN <= 128);
  // +8 elements (16 bytes) per row: 8 consecutive rows then start in 8
  // different 16-byte bank groups, so ldmatrix is conflict-free.
  static constexpr int kStride = kD + 8;
  static constexpr int kNT = kN / 8;  // n8 tiles of scores per m-tile
  static constexpr int kDT = kD / 8;  // n8 tiles of output per m-tile
  template <typename T>
  static constexpr size_t SmemBytes() {
    return size_t(kM + 2 * kN) * kStride * sizeof(T);
  }
  // With a staged dense bias (dense_tile.cuh), its tile too.
  template <typename T>
  static constexpr size_t DenseSmemBytes() {
    return SmemBytes<T>() + (kTakesDense ? tc::DenseTile::StageBytes<kM, kN>() : 0);
  }
  static_assert(kD % 16 == 0 && kN % 16 == 0, "tiles are built from 16x16 mma steps");
};

// Tile candidates per head-dim bucket (FwdTile<kD, warps, m16 tiles per warp,
// keys per tile>). Two m16 tiles per warp halve the shared-memory fragment
// loads per mma (each K/V fragment feeds both), which is what limits the
// one-tile layout; the O and S accumulators (kMT * (kD + kN) / 2 floats per
// lane) must then fit in 255 registers without spilling, which bounds kN.
// FwdTilePick chooses among them by measurement (docs/performance.md);
// `python -m jaxflash.tune` re-measures every candidate.
template <int kD>
struct FwdCandidates;
template <>
struct FwdCandidates<32> {
  using type = TileList<FwdTile<32, 4, 2, 128>, FwdTile<32, 8, 1, 128>>;
};
template <>
struct FwdCandidates<64> {
  using type = TileList<FwdTile<64, 4, 2, 64>, FwdTile<64, 4, 2, 80>, FwdTile<64, 8, 1, 128>>;
};
template <>
struct FwdCandidates<96> {
  using type = TileList<FwdTile<96, 4, 2, 48>, FwdTile<96, 4, 2, 32>, FwdTile<96, 8, 1, 64>>;
};
template <>
struct FwdCandidates<128> {
  using type = TileList<FwdTile<128, 4, 2, 32>, FwdTile<128, 8, 2, 32>, FwdTile<128, 8, 1, 64>>;
};
template <>
struct FwdCandidates<192> {
  using type = TileList<FwdTile<192, 8, 1, 64>, FwdTile<192, 8, 1, 32>, FwdTile<192, 4, 1, 64>>;
};
template <>
struct FwdCandidates<256> {
  using type = TileList<FwdTile<256, 8, 1, 64>, FwdTile<256, 8, 1, 32>, FwdTile<256, 4, 1, 64>>;
};

// The tile table: index into FwdCandidates<kD> for (causal or not). Measured
// on an H100 with tools/tune_tiles.py (2026-11-21, docs/performance.md); the
// buckets it did not sweep (32, 96, 192) take their first candidate, the shape
// that won at the neighbouring head dims.
inline int FwdTilePick(int head_dim_bucket, bool causal) {
  switch (head_dim_bucket) {
    case 64: return 1;             // 4 warps x 32 rows, 80 keys
    case 256: return causal ? 2 : 0;
    default: return 0;
  }
}

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kCtasPerSm) FwdKernel(const FwdParams p) {
  constexpr int kD = Tile::kD, kM = Tile::kM, kN = Tile::kN, kMT = Tile::kMT;
  constexpr int kNT = Tile::kNT, kDT = Tile::kDT, kStride = Tile::kStride;
  constexpr int kThreads = Tile::kThreads;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kM * kStride;
  T* sV = sK + kN * kStride;
  void* sBias = sV + kN * kStride;  // [kM][kN + pad] 16-bit, when the bias is staged (DenseTile::Stages)

  // The grid's own order, not grid_order.cuh's: with a computed head and
  // batch held to the epilogue, the two-CTA tiles at D 32 and 64 spill.
  const tc::FwdBlock<T> blk = tc::FwdBlock<T>::template At<kM, kN>(p, blockIdx.x, blockIdx.y, blockIdx.z);
  const MaskPolicy& pol = blk.pol;
  const int r0 = blk.r0, r_end = blk.r_end;
  const int n_begin = blk.tiles.begin, n_end = blk.tiles.end;
  const int64_t q_row_stride = blk.q_row_stride, kv_row_stride = blk.kv_row_stride;
  const T *gQ = blk.q, *gK = blk.k, *gV = blk.v;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int head_dim = static_cast<int>(p.shape.head_dim);

  // Rows this warp owns: [warp_row0, warp_row0 + 16 * kMT) within the CTA.
  const int warp_row0 = warp * 16 * kMT;

  float o[kMT][kDT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) tc::Zero(o[mt]);
  tc::OnlineSoftmax<kMT> softmax;
  softmax.Init();

  // Starts the copy of the K tile of keys from c (keys at or past kv_valid
  // zero-filled: masked scores multiply V rows by exactly 0, and 0 * (garbage
  // in padding) could be NaN) and of a staged bias tile with it.
  const bool stages = Tile::kTakesDense && tc::DenseTile::Stages(p);
  auto load_k = [&](int c) {
    tc::LoadTile<kN, kD, kThreads>(sK, kStride, gK + int64_t(c) * kv_row_stride, kv_row_stride, pol.kv_valid - c,
                                   head_dim, tid);
    if constexpr (Tile::kTakesDense) {
      if (stages) tc::DenseTile::Of(p, blockIdx.z, blockIdx.y).Stage<kM, kN, kThreads>(sBias, r0, c, tid);
    }
  };

  if (n_begin < n_end) {
    tc::LoadTile<kM, kD, kThreads>(sQ, kStride, gQ, q_row_stride, r_end - r0, head_dim, tid);
    load_k(n_begin * kN);
    tc::CpAsyncCommit();
  }

  const float scale_log2 = p.scale * tc::kLog2e;
  // A dense bias or mask (dense_tile.cuh; the grid's order: batch z, head y):
  // the mask's summary of each tile is the barrier below, and a tile it hides
  // is skipped, products and all; `seen` records rows it leaves a key.
  unsigned seen = 0;

  for (int nb = n_begin; nb < n_end; ++nb) {
    const int c0 = nb * kN;
    tc::CpAsyncWait<0>();
    // K[nb] visible to all; everyone is done reading V[nb-1]. With a dense
    // mask this barrier is its vote, and a tile it hides is skipped.
    const tc::DenseTile::View view =
        tc::DenseTile::TileBarrier<Tile::kTakesDense>(p, blockIdx.z, blockIdx.y, r0, r_end, c0, c0 + kN, tid, kThreads);
    if (view == tc::DenseTile::kHidden) {
      if (nb + 1 < n_end) {  // no one reads this K: the next one may replace it now
        load_k(c0 + kN);
        tc::CpAsyncCommit();
      }
      continue;
    }
    tc::LoadTile<kN, kD, kThreads>(sV, kStride, gV + int64_t(c0) * kv_row_stride, kv_row_stride,
                                   pol.kv_valid - c0, head_dim, tid);
    tc::CpAsyncCommit();

    // ---- S = Q Kᵀ
    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) tc::Zero(s[mt]);
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        tc::Ldmatrix4(a[mt], tc::AFragAddr(sQ, kStride, warp_row0 + mt * 16, kk * 16, lane));
      }
#pragma unroll
      for (int np = 0; np < kN / 16; ++np) {
        uint32_t b[4];
        tc::Ldmatrix4(b, tc::BFragAddrNK(sK, kStride, np * 16, kk * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          tc::Mma<T>(s[mt][2 * np], a[mt], b[0], b[1]);
          tc::Mma<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // ---- scale into log2 units; mask only tiles the policy does not fully admit
    const bool full = pol.TileIsFull(r0, r_end, c0, c0 + kN);
    tc::DenseTile dense = tc::DenseTile::Of<Tile::kTakesDense>(p, blockIdx.z, blockIdx.y, view);
    if constexpr (Tile::kTakesDense) {
      if (stages) dense = dense.Staged(sBias, kN, r0, c0);
    }
    tc::ScaleAndMask(s, pol, full, r0, warp_row0, c0, lane, scale_log2, tc::SameRow{}, tc::SoftCap::Of(p),
                     tc::AlibiBias::Of<Tile::kTakesAlibi>(p, pol, blockIdx.z, blockIdx.y),  // (held: spilled)
                     Tile::kTakesDense && dense.On() ? &dense : nullptr);
    dense.Seen<kMT, kNT>(seen, pol, r0 + warp_row0, c0, lane);

    softmax.Update(s, o);

    tc::CpAsyncWait<0>();
    __syncthreads();  // V[nb] visible; everyone is done reading K[nb]
    if (nb + 1 < n_end) {  // (the staged bias tile was read above, before the barrier)
      load_k(c0 + kN);
      tc::CpAsyncCommit();
    }

    // ---- O += P V, P straight from the score registers
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        tc::PackAFragment<T>(s[mt], kk, a[mt]);
      }
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        uint32_t b[4];
        tc::Ldmatrix4Trans(b, tc::BFragAddrKN(sV, kStride, kk * 16, dp * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          tc::Mma<T>(o[mt][2 * dp], a[mt], b[0], b[1]);
          tc::Mma<T>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  tc::StoreOutput<T, Tile::kTakesDense>(softmax, o, p, pol, blk.batch, blk.head, r0, warp_row0, lane,
                     Tile::kTakesDense ? tc::DenseTile::Of(p, blk.batch, blk.head).QuadSeen(seen) : ~0u);
}

// Launches the forward for one (dtype, head-dim bucket); defined per bucket in
// fwd_d*.cu so each translation unit stays small.
template <typename T, int kD>
Status LaunchForward(const FwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  const bool causal = p.mask.window_right >= 0;
  using Candidates = typename FwdCandidates<kD>::type;
  const int pick = Candidates::PickTaking(FwdTilePick(kD, causal), p);
  return Candidates::With(p.tile, pick, [&](auto tile) {
    using Tile = decltype(tile);
    if (!TileTakes<Tile>(p)) {
      return Status::Unimplemented("this forced sm80 forward tile takes no ALiBi slopes or dense terms");
    }
    // A staged dense bias takes more shared memory than the plain call (whose
    // size some tiles fill exactly on GPUs of 99 KB a block).
    const size_t smem = tc::DenseTile::Stages(p) ? Tile::template DenseSmemBytes<T>() : Tile::template SmemBytes<T>();
    return LaunchForwardGrid<FwdKernel<T, Tile>>(p, Tile::kM, Tile::kThreads, smem, device, stream,
                                                 "attention forward");
  });
}

}  // namespace sm80
}  // namespace jaxflash
