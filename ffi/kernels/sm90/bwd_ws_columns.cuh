// The warp-specialised fused backward's consumers at D 192 and 256 (sm_90a):
// two warpgroups share the CTA's 64 keys and split the columns of dK, dV and
// dQ.
//
// There the key-split consumers (bwd_ws_kernel.cuh) cannot hold dK and dV of
// their own 64 keys: 192-256 float registers per thread. Here each consumer
// keeps its share of the 64-column blocks of each (WsBwdColumnTile::Share: at
// D 256 columns [128c, 128c + 128) of all three, 128 registers; at D 192 the
// three blocks of dK, dV and dQ dealt 5 / 4 with dQ, 3 / 3 without) and the
// step's work is divided so that each of the five products is done once:
//
//   Sᵀ, dPᵀ    of the 64 keys against the step's query columns [32c, 32c + 32)
//              (64 x 32 wgmma blocks), then Pᵀ and dSᵀ of those columns,
//              stored as they are into two shared keys x queries tiles;
//   once both halves are in (one named barrier, buffers alternating by step):
//   dQ         = dS·K, the consumer's dQ columns, dS read transposed from the
//              dSᵀ tile, added into the float32 sums with vector atomics
//              while dV and dK run (no staging tile: at D 256 the stages,
//              K, V and the two buffers leave no room for one);
//   dV, dK     += Pᵀ·dO, dSᵀ·Q over the step's 64 queries, its dV and dK
//              columns, both operands from shared memory.
//
// At the end each stages its columns of dK and dV in the K and V tiles and
// stores them with the TMA (StoreKeyGradsByTma, bwd_ws_roles.cuh).
//
// The producer and flag-writer warps are the key-split kernel's
// (bwd_ws_roles.cuh); the dQ writer warp has nothing to do. The flag holds
// for the stage's 64 rows, so for each consumer's 32 (more conservative than
// asking for those 32: a boundary inside the 64 masks both halves).
#pragma once

#include "common/bwd_blocks.cuh"
#include "jaxflash/params.h"
#include "sm90/barrier.cuh"
#include "sm90/bwd_steps.cuh"
#include "sm90/bwd_ws_roles.cuh"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

// kDv_: the value's head dim where it has its own (MLA: V, dO and dV at it).
template <int kD_, int kStages_ = 2, bool kWithDq_ = true, int kDv_ = kD_>
struct WsBwdColumnTile {
  static constexpr bool kSharedKeys = true;
  static constexpr bool kTakesSoftCap = true;  // (with 0 bytes of spills: D 256's consumers hold 64 x 32 tiles)
  static constexpr bool kTakesSegments = true;
  static constexpr bool kTakesAlibi = true;
  static constexpr bool kTakesDense = false;
  static constexpr size_t kBiasBytes = 0;
  static constexpr bool kWithDq = kWithDq_;
  static constexpr bool kStagedDq = false;
  static constexpr bool kFlagWriter = true;  // as WsBwdTile's
  static constexpr bool kLseLog2 = true;
  static constexpr int kD = kD_;
  static constexpr int kDv = kDv_;
  static_assert(kDv <= kD && kDv % 64 == 0, "v's blocks within q's");
  static constexpr int kConsumers = 2;
  static constexpr int kM = 64;                 // query rows per step
  static constexpr int kN = 64;                 // keys per CTA, shared by the consumers
  static constexpr int kQueries = kM / kConsumers;  // a consumer's query columns of Sᵀ and dPᵀ
  // A consumer's 64-column blocks of one gradient: whole blocks, as a chunk
  // of an MN-major product (dV += Pᵀ·dO, dK += dSᵀ·Q, dQ = dS·K) starts on
  // one (MnMajorDescriptor). An even count is halved; of an odd one (D 192's
  // three) consumer 0 takes the larger part of dK and dQ, consumer 1 of dV.
  // dQ's blocks are dK's: past its last dS barrier a consumer reads only the
  // K columns (for dQ) that it overwrites with dK, so neither stages into
  // columns the other still reads (StoreKeyGradsByTma).
  struct Share {
    int first, blocks;
  };
  static constexpr int kBlocks = kD / 64, kVBlocks = kDv / 64;
  __host__ __device__ static constexpr Share KeyShare(int c) {  // dK, and dQ
    return c == 0 ? Share{0, (kBlocks + 1) / 2} : Share{(kBlocks + 1) / 2, kBlocks / 2};
  }
  __host__ __device__ static constexpr Share ValueShare(int c) {  // dV
    return c == 0 ? Share{0, kVBlocks / 2} : Share{kVBlocks / 2, (kVBlocks + 1) / 2};
  }
  // Whether both consumers' shares are alike (one body serves both, its
  // columns from the consumer's index at run time).
  static constexpr bool kEvenShares = kBlocks % 2 == 0 && kVBlocks % 2 == 0;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  using WithoutDq = WsBwdColumnTile<kD, kStages, false, kDv>;
  using QTile = SwizzledTile<kM, kD>;
  using KVTile = SwizzledTile<kN, kD>;  // K's
  using KTile = KVTile;
  using VTile = SwizzledTile<kN, kDv>;
  using DOTile = SwizzledTile<kM, kDv>;
  using DsTile = SwizzledTile<kN, kM>;  // keys x queries: Pᵀ, then dSᵀ
  // Two buffers of Pᵀ and dSᵀ: a consumer writes step it + 1's while its
  // partner's products may still read step it's.
  static constexpr size_t kDsBytes = 2 * 2 * size_t(DsTile::kBytes);
  static constexpr size_t kDqBytes = 0;
  static constexpr int kDqBuffers = 1;
  static constexpr int kBarriers = 3 + 2 * kDqBuffers + 2 * kStages;  // as WsBwdTile (the dQ pair unused)
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = ConsumerRegisters(kConsumers + 1, kProducerRegs);  // 232
  static_assert(kQueries == 32 && kD % 64 == 0, "Sᵀ blocks of 32 queries; whole 64-column blocks of K");
  static constexpr int kDsBarrier = 1;  // named: both halves of a step's Pᵀ and dSᵀ are in place
  // Named, one a consumer, at the end (StoreKeyGradsByTma): its staged dK and
  // dV are in place. (No "keys free" barrier: past the last dS barrier a
  // consumer reads only its own columns of K and V.)
  static constexpr int kKeyGradsBarrier = kDsBarrier + 1;
};

// The consumer's walk with kKB blocks of dK and dQ from column k_col0 and kVB
// of dV from v_col0.
template <typename T, typename Tile, int kKB, int kVB>
__device__ __forceinline__ void WsBwdColumnWalk(const BwdParams& p, const WsBwdSmem<Tile>& sm,
                                                const WsBwdWork<Tile>& w, float* stats_base, int consumer,
                                                int k_col0, int v_col0, const CUtensorMap& dk_map,
                                                const CUtensorMap& dv_map) {
  constexpr int kD = Tile::kD, kN = Tile::kN, kM = Tile::kM, kQ = Tile::kQueries;
  constexpr int kKCols = 64 * kKB, kVCols = 64 * kVB;
  using QTile = typename Tile::QTile;
  using KVTile = typename Tile::KVTile;
  using DOTile = typename Tile::DOTile;
  using DsTile = typename Tile::DsTile;
  const int tid = threadIdx.x - 128 * (consumer + 1);  // within the warpgroup
  const int lane = tid & 31, warp = tid >> 5;
  const int key_w = warp * 16;        // this warp's first key
  const int q0 = consumer * kQ;       // this consumer's first query column of a step
  const float scale_log2 = p.scale * tc::kLog2e;

  float dk[kKCols / 8][4], dv[kVCols / 8][4];
  StartKeyGrads(sm, w, dk, dv);

  RingPosition<Tile::kStages> ring;
  auto step = w.FirstStep();
  for (int it = 0; it < w.steps; ++it, step.Next()) {
    const WsBwdStage in = WaitForStage(sm, step, stats_base, ring);

    // ---- Sᵀ, dPᵀ of this consumer's queries (rows q0.. of the Q and dO
    // tiles: a whole number of swizzle periods in), Pᵀ while dPᵀ runs, dSᵀ.
    float st[kQ / 8][4], dp[kQ / 8][4];
    const tc::AlibiBias alibi = tc::AlibiBias::Of<Tile::kTakesAlibi>(p, w.pol, w.Batch(), step.head);
    KeyMajorScores<T, KVTile, QTile, kD, kQ, false, Tile::kLseLog2, typename Tile::VTile, DOTile>(
        st, dp, sm.k, sm.v, in.q + q0 * 128, in.d_o + q0 * 128, w.pol, in.r0 + q0, w.C0() + key_w,
        [&] { return StepIsFull(w, in); }, in.lse + q0, lane, scale_log2, tc::SoftCap::Of<Tile::kTakesSoftCap>(p),
        alibi);
    WgmmaWait<0>();
    FenceAccumulator(dp);
    uint32_t pa[kQ / 16][4], da[kQ / 16][4];
    tc::PackAFragments<T>(st, pa);
    // A capped pair's slope comes from its probability (SoftCap::SlopeFromProb),
    // whose LSE and ALiBi bias the pair's origin gives.
    tc::KeyMajorDs<Tile::kLseLog2>(st, dp, in.delta + q0, lane, in.lse + q0, tc::SoftCap::Of<Tile::kTakesSoftCap>(p),
                                   alibi, {in.r0 + q0, w.C0() + key_w});
    tc::PackAFragments<T>(dp, da);
    const uint32_t sP = sm.Ds(it), sDs = sP + DsTile::kBytes;
#pragma unroll
    for (int kk = 0; kk < kQ / 16; ++kk) {
      StoreFragment<DsTile>(sP, pa[kk], key_w, q0 + kk * 16, lane);
      StoreFragment<DsTile>(sDs, da[kk], key_w, q0 + kk * 16, lane);
    }
    FenceSharedForAsyncProxy();
    NamedBarrierSync(Tile::kDsBarrier, 128 * Tile::kConsumers);

    // ---- dQ first (fused), so its sums are added while dV and dK run.
    auto key_grads = [&] {
      ProductSSMn<T, DsTile, DOTile, kM, kVCols>(dv, sP, in.d_o, v_col0, /*accumulate=*/true);
      ProductSSMn<T, DsTile, QTile, kM, kKCols>(dk, sDs, in.q, k_col0, /*accumulate=*/true);
      WgmmaCommit();
    };
    WgmmaFence();
    if constexpr (Tile::kWithDq) {
      float dq[kKCols / 8][4];
      ProductSSMn<T, DsTile, KVTile, kN, kKCols, Major::kMn>(dq, sDs, sm.k, k_col0);
      WgmmaCommit();
      key_grads();
      WgmmaWait<1>();
      FenceAccumulator(dq);
      tc::AddQueryGradSums(dq, p, w.pol.q_valid, w.Batch(), step.head, in.r0 + warp * 16, k_col0, lane);
    } else {
      key_grads();
    }
    FinishStep(sm, ring, dk, dv);
  }

  StoreKeyGradsByTma<T>(p, sm, w, consumer, 0, dk, k_col0, dv, v_col0, dk_map, dv_map);
}

template <typename T, typename Tile>
__device__ __forceinline__ void WsBwdColumnConsumer(const BwdParams& p, const WsBwdSmem<Tile>& sm,
                                                    const WsBwdWork<Tile>& w, float* stats_base, int consumer,
                                                    const CUtensorMap& dk_map, const CUtensorMap& dv_map) {
  constexpr typename Tile::Share k0 = Tile::KeyShare(0), k1 = Tile::KeyShare(1);
  constexpr typename Tile::Share v0 = Tile::ValueShare(0), v1 = Tile::ValueShare(1);
  if constexpr (Tile::kEvenShares) {
    WsBwdColumnWalk<T, Tile, k0.blocks, v0.blocks>(p, sm, w, stats_base, consumer, consumer * 64 * k0.blocks,
                                                   consumer * 64 * v0.blocks, dk_map, dv_map);
  } else if (consumer == 0) {
    WsBwdColumnWalk<T, Tile, k0.blocks, v0.blocks>(p, sm, w, stats_base, 0, 64 * k0.first, 64 * v0.first, dk_map,
                                                   dv_map);
  } else {
    WsBwdColumnWalk<T, Tile, k1.blocks, v1.blocks>(p, sm, w, stats_base, 1, 64 * k1.first, 64 * v1.first, dk_map,
                                                   dv_map);
  }
}

}  // namespace sm90
}  // namespace jaxflash
