// FlashAttention forward for Hopper (sm_90a): warpgroup MMA (wgmma).
//
// One CTA computes kM = 64 * kWarpGroups query rows of one (batch, head); each
// warpgroup owns 64 rows and issues its products as wgmma with operands read
// straight from shared memory (Q·Kᵀ) or with P from registers (P·V), so the
// tensor cores see 64 x N x 16 blocks instead of mma.sync's 16 x 8 x 16.
// K and V tiles of kN keys stream through two shared-memory stages each
// (cp.async, 128-byte swizzled layout, see wgmma.cuh), one tile ahead of use.
// Within a warpgroup the softmax of tile n overlaps the P·V product of tile
// n - 1, which is still running on the tensor cores. Masking, the online
// softmax and the epilogue are the sm80 kernel's code (common/fwd_blocks.cuh).
#pragma once

#include <cuda_runtime.h>

#include "common/fwd_blocks.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "common/softmax.cuh"
#include "jaxflash/params.h"
#include "sm90/launch_sm90.h"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

template <int kD_, int kWarpGroups_, int kN_, int kCtasPerSm_ = 1>
struct FwdTile {
  static constexpr bool kWarpSpecialised = false;
  static constexpr int kD = kD_;
  static constexpr int kWarpGroups = kWarpGroups_;
  static constexpr int kN = kN_;  // keys per K/V tile
  // CTAs that must fit on one SM (registers are capped to allow it): several
  // independent CTAs overlap one another's softmax, loads and barriers.
  // Takes every logit soft-cap; segment ids except with three CTAs an SM at
  // D 64, whose register cap their code spilled (88 bytes).
  static constexpr bool kTakesSoftCap = true;
  static constexpr bool kTakesSegments = !(kD_ == 64 && kCtasPerSm_ == 3);
  // ALiBi's bias: as segment ids (its code spilled the three-CTA D 64 tile too).
  static constexpr bool kTakesAlibi = kTakesSegments;
  static constexpr int kCtasPerSm = kCtasPerSm_;
  static constexpr int kM = 64 * kWarpGroups;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kNT = kN / 8;  // n8 tiles of scores per warp
  static constexpr int kDT = kD / 8;  // n8 tiles of output per warp
  static constexpr int kStages = 2;
  using QTile = SwizzledTile<kM, kD>;
  using KVTile = SwizzledTile<kN, kD>;
  // +1024: the dynamic shared-memory base is aligned up to a swizzle atom.
  static constexpr size_t kSmemBytes = size_t(QTile::kBytes) + 2 * kStages * KVTile::kBytes + 1024;
  static_assert(kN == 64 || kN == 128, "score tiles use the compiled wgmma widths");
};

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kCtasPerSm) FwdKernel(const FwdParams p) {
#if defined(JAXFLASH_SM90A)
  constexpr int kD = Tile::kD, kM = Tile::kM, kN = Tile::kN;
  constexpr int kNT = Tile::kNT, kDT = Tile::kDT;
  constexpr int kThreads = Tile::kThreads;
  using QTile = typename Tile::QTile;
  using KVTile = typename Tile::KVTile;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem = (tc::SmemAddr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sQ = smem;
  const uint32_t sK0 = sQ + QTile::kBytes;
  const uint32_t sV0 = sK0 + Tile::kStages * KVTile::kBytes;
  // Stage of K or V (base sK0 / sV0) holding the tile `it` steps into the walk.
  auto stage = [](uint32_t base, unsigned it) { return base + (it % Tile::kStages) * KVTile::kBytes; };

  const tc::FwdBlock<T> blk = tc::FwdBlock<T>::template OfGrid<kM, kN, Tile::kTakesSegments>(p);
  const MaskPolicy& pol = blk.pol;
  const tc::KeyTiles tiles = blk.tiles;
  const int r0 = blk.r0, r_end = blk.r_end;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warpgroup = tid >> 7;
  const int head_dim = static_cast<int>(p.shape.head_dim);

  // Keys at or past kv_valid are zero-filled: masked scores multiply V rows by
  // exactly 0, and 0 * (garbage in padding) could be NaN.
  auto load_tile = [&](uint32_t stage_base, const T* g, int nb) {
    const int c0 = nb * kN;
    LoadSwizzledTile<kN, kD, kThreads>(stage_base, g + int64_t(c0) * blk.kv_row_stride, blk.kv_row_stride,
                                       pol.kv_valid - c0, head_dim, tid);
  };

  // This warp's rows within the CTA: warpgroup w owns [64 w, 64 w + 64), and
  // its warp i the 16 rows from 16 i (the wgmma accumulator layout).
  const int warp_row0 = warpgroup * 64 + ((tid >> 5) & 3) * 16;
  // The warpgroup's 64 rows of Q, as the A operand of Q·Kᵀ.
  const uint32_t sQ_rows = sQ + warpgroup * 64 * 128;

  float o[1][kDT][4];
  tc::Zero(o[0]);
  tc::OnlineSoftmax<1> softmax;
  softmax.Init();
  uint32_t pa[kN / 16][4];  // P of the previous key tile, packed as the A operand of P·V

  // O += P·V for the previous tile, V read MN-major from stage `sV`.
  auto issue_pv = [&](uint32_t sV) {
    ProductRS<T, KVTile, kN, kD>(o[0], pa, sV, 0);
    WgmmaCommit();
  };

  if (tiles.begin < tiles.end) {
    LoadSwizzledTile<kM, kD, kThreads>(sQ, blk.q, blk.q_row_stride, r_end - r0, head_dim, tid);
    load_tile(sK0, blk.k, tiles.begin);
    tc::CpAsyncCommit();
  }
  const float scale_log2 = p.scale * tc::kLog2e;

  // Software pipeline, one barrier per key tile: iteration n computes
  // S_n = Q·K_nᵀ and, while its softmax runs, P_{n-1}·V_{n-1} on the tensor
  // cores. At its top every thread has finished iteration n - 1, so the stages
  // of K_{n-1} and V_{n-2} are free: K_{n+1} and V_n are copied into them.
  for (int nb = tiles.begin; nb < tiles.end; ++nb) {
    const int it = nb - tiles.begin;
    const int c0 = nb * kN;
    tc::CpAsyncWait<0>();
    FenceSharedForAsyncProxy();  // this thread's copies, visible to wgmma
    __syncthreads();             // K_n and V_{n-1} landed; iteration n - 1 is done everywhere
    if (nb + 1 < tiles.end) load_tile(stage(sK0, it + 1), blk.k, nb + 1);
    load_tile(stage(sV0, it), blk.v, nb);
    tc::CpAsyncCommit();

    // ---- S = Q Kᵀ (the first k step overwrites s), then P_{n-1}·V_{n-1}
    const uint32_t sK = stage(sK0, it);
    float s[1][kNT][4];
    WgmmaFence();
    ProductSS<T, QTile, KVTile, kD, kN>(s[0], sQ_rows, sK);
    WgmmaCommit();
    if (it > 0) {
      issue_pv(stage(sV0, it - 1));
      WgmmaWait<1>();  // S done; P·V may still run
    } else {
      WgmmaWait<0>();
    }
    FenceAccumulator(s[0]);

    // ---- scale into log2 units, mask, online softmax
    const bool full = pol.TileIsFull(r0, r_end, c0, c0 + kN);
    tc::ScaleAndMask(s, pol, full, r0, warp_row0, c0, lane, scale_log2, tc::SameRow{}, tc::SoftCap::Of(p),
                     tc::AlibiBias::Of<Tile::kTakesAlibi>(p, pol, blk.batch, blk.head));
    float alpha[2];
    softmax.Scores(s, alpha);

    // ---- once P·V is done: rescale O to the new row max, keep P for the next step
    WgmmaWait<0>();
    FenceAccumulator(o[0]);
    softmax.Rescale(o, alpha);
    tc::PackAFragments<T>(s[0], pa);
  }

  // ---- the last tile's P·V
  if (tiles.begin < tiles.end) {
    tc::CpAsyncWait<0>();
    FenceSharedForAsyncProxy();
    __syncthreads();
    WgmmaFence();
    issue_pv(stage(sV0, tiles.end - 1 - tiles.begin));
    WgmmaWait<0>();
    FenceAccumulator(o[0]);
  }

  tc::StoreOutput<T>(softmax, o, p, pol, blk.batch, blk.head, r0, warp_row0, lane);
#endif  // JAXFLASH_SM90A
}

}  // namespace sm90
}  // namespace jaxflash
