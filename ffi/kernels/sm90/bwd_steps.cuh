// The first step of every sm90 dK/dV kernel (the two-kernel backward's and the
// warp-specialised fused one's): a warpgroup's 64 keys against kM queries,
//   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ issued as two wgmma groups, then Pᵀ from Sᵀ
//   (common/bwd_blocks.cuh) while dPᵀ is still on the tensor cores.
// On return dPᵀ may still be running: the caller waits for it.
#pragma once

#include "common/bwd_blocks.cuh"
#include "common/mask.h"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

// kLseFirst: the LSE of the step's queries read into registers before the
// products are issued (16 at kM = 64), else as the exponents need them;
// kLseLog2: `lse` holds them in log2 units (else natural-log).
// `is_full()`: whether the step's tile needs no mask, asked while the products
// run. `kept`: a tc::KeptTanh that receives a capped tile's tanh
// (score_mod.cuh). VTile and DOTile: V's and dO's, where v has a head dim of
// its own (dPᵀ then reduces over its columns).
template <typename T, typename KVTile, typename QTile, int kD, int kM, bool kLseFirst = false,
          bool kLseLog2 = false, typename VTile = KVTile, typename DOTile = QTile, typename Full,
          typename Kept = tc::NoKeptTanh>
__device__ __forceinline__ void KeyMajorScores(float (&st)[kM / 8][4], float (&dp)[kM / 8][4], uint32_t k_rows,
                                               uint32_t v_rows, uint32_t q, uint32_t d_o, const MaskPolicy& pol,
                                               int r0, int key0, Full&& is_full, const float* lse, int lane,
                                               float scale_log2, tc::SoftCap cap = {}, tc::AlibiBias alibi = {},
                                               Kept&& kept = {}) {
  float lse_log2[kLseFirst ? kM / 8 : 1][2];
  if constexpr (kLseFirst) {
#pragma unroll
    for (int nt = 0; nt < kM / 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) lse_log2[nt][j] = tc::KeyMajorLseLog2<kLseLog2>(lse, lane, nt, j);
  }
  WgmmaFence();
  ProductSS<T, KVTile, QTile, kD, kM>(st, k_rows, q);
  WgmmaCommit();
  ProductSS<T, VTile, DOTile, 64 * VTile::kBlocks, kM>(dp, v_rows, d_o);
  WgmmaCommit();
  // Whether the step needs its mask, while the products run (asked after
  // the wait, the segment table's chain of loads sat between Sᵀ and Pᵀ).
  const bool full = is_full();
  WgmmaWait<1>();
  FenceAccumulator(st);
  if constexpr (kLseFirst) {
    tc::KeyMajorProbsFrom(st, pol, full, r0, key0, [&](int nt, int j) { return lse_log2[nt][j]; }, lane,
                          scale_log2, cap, alibi, kept);
  } else {
    tc::KeyMajorProbs<kLseLog2>(st, pol, full, r0, key0, lse, lane, scale_log2, cap, alibi, kept);
  }
}

}  // namespace sm90
}  // namespace jaxflash
