// The first step of every sm90 dK/dV kernel (the two-kernel backward's and the
// warp-specialised fused one's): a warpgroup's 64 keys against kM queries,
//   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ issued as two wgmma groups, then Pᵀ from Sᵀ
//   (common/bwd_blocks.cuh) while dPᵀ is still on the tensor cores.
// On return dPᵀ may still be running: the caller waits for it.
#pragma once

#include "common/bwd_blocks.cuh"
#include "common/dense_tile.cuh"
#include "common/mask.h"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

// Scores as the products left them (KeyMajorScores' `pre` for calls without
// a staged bias).
struct NoStagedBias {
  template <int kQT>
  __device__ __forceinline__ void operator()(float (&)[kQT][4]) const {}
};

// A staged bias box (kQT * 8 query rows x 64 keys, 16-bit, float16 where
// `fp16`, swizzled as the TMA wrote it) added to a warp's key-major scores Sᵀ
// (its 16 keys from key 16 · `warp` of the box) in raw units, s + bias /
// scale (`inv_scale`; the scale stays in the exponent's FFMA, as for plain
// calls: one FFMA a score here). ldmatrix .trans reads the box's
// query-major 8 x 8 blocks straight into the accumulator's key-major layout
// (two queries of one key a 32-bit word): four blocks an instruction, one
// 16-byte row of a block a lane, each block's eight rows in eight distinct
// bank groups under the swizzle.
struct StagedBiasKeyMajor {
  uint32_t box;
  int warp, lane;
  float inv_scale;
  bool fp16;
  template <int kQT>
  __device__ __forceinline__ void operator()(float (&st)[kQT][4]) const {
    static_assert(kQT % 2 == 0, "two n8 query blocks an instruction");
    // Lane l gives row l % 8 of block l / 8: blocks (query block +0, keys of
    // half 0), (+0, half 1), (+1, half 0), (+1, half 1) of the warp's rows.
    const int m = lane >> 3, r = lane & 7;
    const uint32_t at = box + ((m >> 1) * 8 + r) * 128 + (((2 * warp + (m & 1)) ^ r) << 4);
#pragma unroll
    for (int qb = 0; qb < kQT; qb += 2) {
      uint32_t a[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                   : "r"(at + qb * 8 * 128));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int nt = qb + (i >> 1), half = i & 1;
        const float2 x = tc::DenseTile::Pair(a[i], fp16);
        st[nt][2 * half] = fmaf(x.x, inv_scale, st[nt][2 * half]);
        st[nt][2 * half + 1] = fmaf(x.y, inv_scale, st[nt][2 * half + 1]);
      }
    }
  }
};

// kLseFirst: the LSE of the step's queries read into registers before the
// products are issued (16 at kM = 64), else as the exponents need them;
// `pre`: what the scores take between the products and Pᵀ (a staged bias,
// StagedBiasKeyMajor);
// kLseLog2: `lse` holds them in log2 units (else natural-log).
// `is_full()`: whether the step's tile needs no mask, asked while the products
// run. `kept`: a tc::KeptTanh that receives a capped tile's tanh
// (score_mod.cuh). VTile and DOTile: V's and dO's, where v has a head dim of
// its own (dPᵀ then reduces over its columns).
template <typename T, typename KVTile, typename QTile, int kD, int kM, bool kLseFirst = false,
          bool kLseLog2 = false, typename VTile = KVTile, typename DOTile = QTile, typename Full,
          typename Kept = tc::NoKeptTanh, typename Pre = NoStagedBias>
__device__ __forceinline__ void KeyMajorScores(float (&st)[kM / 8][4], float (&dp)[kM / 8][4], uint32_t k_rows,
                                               uint32_t v_rows, uint32_t q, uint32_t d_o, const MaskPolicy& pol,
                                               int r0, int key0, Full&& is_full, const float* lse, int lane,
                                               float scale_log2, tc::SoftCap cap = {}, tc::AlibiBias alibi = {},
                                               Kept&& kept = {}, Pre&& pre = {}) {
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
  pre(st);
  if constexpr (kLseFirst) {
    tc::KeyMajorProbsFrom(st, pol, full, r0, key0, [&](int nt, int j) { return lse_log2[nt][j]; }, lane,
                          scale_log2, cap, alibi, kept);
  } else {
    tc::KeyMajorProbs<kLseLog2>(st, pol, full, r0, key0, lse, lane, scale_log2, cap, alibi, kept);
  }
}

}  // namespace sm90
}  // namespace jaxflash
