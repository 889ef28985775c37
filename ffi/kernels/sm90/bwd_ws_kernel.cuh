// The fused FlashAttention backward for Hopper (sm_90a), warp-specialised.
//
// One CTA per (key tile of kN keys, kv head, batch): it keeps dK and dV of
// its keys in registers while it walks the query tiles of every head of the
// GQA group that see them, and adds each step's dQ = dS·K into the float32
// sums (BwdParams::dq_accum) that DqFromSumsKernel converts afterwards
// (common/bwd_blocks.cuh). The roles, as in the forward (fwd_ws_kernel.cuh):
//
//   producer   warp 0 copies K and V once and then, per step, Q and dO of kM
//              query rows through the TMA into a ring of kStages stages, with
//              the rows' LSE and delta; it zeroes padding rows (of a ragged
//              batch element) before the consumers see a stage.
//   consumers  kConsumers warpgroups of 64 keys each. Per step:
//                Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ; Pᵀ while dPᵀ runs; dSᵀ;
//                dV += Pᵀ·dO, dK += dSᵀ·Q;
//              dSᵀ goes transposed into a shared dS tile (two buffers, so no
//              warpgroup waits for the other to finish reading one), and
//              once every consumer's keys are in it (one named barrier),
//              dQ = dS·K over all kN keys goes into a float32 staging tile:
//              at D ≥ 128 consumer c computes columns [64c, 64c + 64); at
//              D = 64 (one 64-column block) the consumers take whole steps in
//              turn, and the other one only arrives at the barrier.
//   dQ writer  lane 0 of warp 1 adds the staging tile into the sums with
//              one bulk tensor reduction per 32-column block (the copy engine
//              does the float32 adds; no atomic instruction on the consumers'
//              path) and frees it for the next step.
//
// The two-kernel backward (bwd_kernel.cuh) had every thread load with
// cp.async and meet at two __syncthreads per step, and the consumers issue
// 64 float2 atomics each per step: latency-bound, 33% SM throughput
// (docs/performance.md, ninth session).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>

#include "common/bwd_blocks.cuh"
#include "common/fwd_blocks.cuh"
#include "common/grid_order.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "jaxflash/params.h"
#include "sm90/barrier.cuh"
#include "sm90/bwd_steps.cuh"
#include "sm90/tensor_map.h"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

// kWithDq = false: dK and dV only (the deterministic backward's first pass,
// before the dQ kernel): no dS tile, no dQ staging, no writer.
template <int kD_, int kConsumers_ = 2, int kM_ = 64, int kStages_ = 2, bool kWithDq_ = true>
struct WsBwdTile {
  static constexpr bool kWarpSpecialised = true;
  static constexpr bool kWithDq = kWithDq_;
  static constexpr int kD = kD_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kM = kM_;                // query rows per step
  static constexpr int kN = 64 * kConsumers;    // keys per CTA
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // dQ of a step: split in 64-column blocks over the consumers, or (one
  // block) computed whole by consumer `step % kConsumers`.
  static constexpr bool kDqByColumns = kD / kConsumers >= 64;
  static constexpr int kDqCols = kDqByColumns ? kD / kConsumers : kD;  // dQ columns per computing consumer
  static constexpr int kDqWriters = kDqByColumns ? kConsumers : 1;     // consumers staging each step
  using QTile = SwizzledTile<kM, kD>;
  using KVTile = SwizzledTile<kN, kD>;
  using DsTile = SwizzledTile<kM, kN>;
  // dQ staging: kM rows of kD floats in 128-byte-swizzled blocks of 32
  // columns (SwizzledTile counts 16-bit columns), each the box of one bulk
  // tensor reduction. One reduction per 512-byte row instead (64 per step)
  // kept the consumers waiting for the copy engine 16% of the time
  // (docs/performance.md, eleventh session).
  using DqStage = SwizzledTile<kM, 2 * kD>;
  static constexpr size_t kDqBytes = kWithDq ? DqStage::kBytes : 0;
  static constexpr size_t kDsBytes = kWithDq ? 2 * size_t(DsTile::kBytes) : 0;  // two buffers
  // A stage: Q, dO, then kM LSE and kM delta values (1024-byte aligned).
  static constexpr size_t kStatsOffset = 2 * size_t(QTile::kBytes);
  static constexpr size_t kStageBytes = (kStatsOffset + 2 * kM * sizeof(float) + 1023) / 1024 * 1024;
  // Barriers: K/V full, K/V tail, Q tail, dQ full, dQ empty, then per stage
  // full and empty.
  static constexpr int kBarriers = 5 + 2 * kStages;
  // After the barriers: the CTA's place in the grid.
  static constexpr size_t kSmemBytes = 2 * size_t(KVTile::kBytes) + kStages * kStageBytes + kDsBytes + kDqBytes +
                                       8 * kBarriers + sizeof(tc::GridTile) + 1024;
  static_assert((2 * size_t(KVTile::kBytes) + kStages * kStageBytes + kDsBytes) % 1024 == 0,
                "the dQ staging starts on a swizzle period");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
  static_assert(kM == 64, "dQ = dS·K is one wgmma row block");
  static_assert(kDqCols == 64, "a consumer's dQ columns are one 64-column block of K (32 registers)");
  // Registers once the producer warpgroup has handed its surplus over (at
  // 24 the producer spills).
  static constexpr int kProducerRegs = kConsumers == 2 ? 40 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 232 : 160;
  // The dQ staging stores take one wavefront per half-warp when lanes t = 2,
  // 3 write their blocks in flipped order; the flip's selects need registers
  // that three consumers (160 each) do not have, so they take two.
  static constexpr bool kFlipStaging = kConsumers == 2;
  static_assert(RegisterSplitFits(kConsumers + 1, kProducerRegs, kConsumerRegs), "register budget");
  // Named: every consumer's dS of a step is in place. Consumers taking turns
  // alternate two, so one that only arrives and runs a step ahead cannot
  // complete its partner's wait on the same barrier (with two stages no
  // consumer gets two steps ahead: a stage is refilled only once every
  // consumer has released it).
  static constexpr int kDsBarrier = 1;
  static constexpr int kDsBarriers = kDqByColumns ? 1 : 2;
};

template <typename Tile>
struct WsBwdSmem {
  uint32_t k, v, stages, ds, dq, bars, place;

  __device__ __forceinline__ static WsBwdSmem At(uint32_t base) {
    WsBwdSmem s;
    s.k = base;
    s.v = s.k + Tile::KVTile::kBytes;
    s.stages = s.v + Tile::KVTile::kBytes;
    s.ds = s.stages + Tile::kStages * uint32_t(Tile::kStageBytes);
    s.dq = s.ds + uint32_t(Tile::kDsBytes);
    s.bars = s.dq + uint32_t(Tile::kDqBytes);
    s.place = s.bars + 8 * Tile::kBarriers;
    return s;
  }
  __device__ __forceinline__ uint32_t Q(int stage) const { return stages + stage * uint32_t(Tile::kStageBytes); }
  __device__ __forceinline__ uint32_t DO(int stage) const { return Q(stage) + Tile::QTile::kBytes; }
  __device__ __forceinline__ uint32_t Stats(int stage) const { return Q(stage) + uint32_t(Tile::kStatsOffset); }
  // A stage's LSE (then delta) values as a pointer, from the first stage's.
  __device__ __forceinline__ static float* StatsPointer(float* first, int stage) {
    return first + stage * (Tile::kStageBytes / sizeof(float));
  }
  __device__ __forceinline__ uint32_t Ds(int it) const { return ds + (it & 1) * Tile::DsTile::kBytes; }
  __device__ __forceinline__ uint32_t KvFull() const { return bars; }
  __device__ __forceinline__ uint32_t KvTail() const { return bars + 8; }
  __device__ __forceinline__ uint32_t QTail() const { return bars + 16; }
  __device__ __forceinline__ uint32_t DqFull() const { return bars + 24; }
  __device__ __forceinline__ uint32_t DqEmpty() const { return bars + 32; }
  __device__ __forceinline__ uint32_t Full(int s) const { return bars + 40 + 8 * s; }
  __device__ __forceinline__ uint32_t Empty(int s) const { return Full(Tile::kStages + s); }

  // Every thread that wrote (or read) a buffer with ordinary instructions
  // arrives itself, so each access is ordered by its own thread's arrival
  // (and compute-sanitizer's racecheck sees that it is).
  __device__ __forceinline__ void InitBarriers() const {
    constexpr int kConsumerThreads = 128 * Tile::kConsumers;
    MBarrier::Init(KvFull(), 32);  // the producer warp's lanes (plus the copied bytes)
    MBarrier::Init(KvTail(), 1);
    MBarrier::Init(QTail(), 1);
    MBarrier::Init(DqFull(), 128 * Tile::kDqWriters);  // every staging consumer thread has written its share
    MBarrier::Init(DqEmpty(), 1);                // the writer's bulk reductions have read the tile
    for (int s = 0; s < Tile::kStages; ++s) {
      MBarrier::Init(Full(s), 32);                // the producer warp's lanes, the stats among them
      MBarrier::Init(Empty(s), kConsumerThreads);  // every consumer thread is done with the stage
    }
    MBarrier::FenceInit();
  }
};

// What every role derives from the CTA's place: its keys, the query tiles
// that see them (per head of the group) and step `it`'s head and first row.
// The place itself (key tile, kv head, batch: grid_order.cuh) is read from
// shared memory where it is used: ordered places are computed values, and
// held through the loop the consumers have no registers for them (ptxas
// spills at D 64), where a grid-order place was an index read again for free.
template <typename Tile>
struct WsBwdWork {
  uint32_t place;  // shared-memory address of the tc::GridTile
  MaskPolicy pol;
  tc::QueryTiles q_tiles;
  int group, steps;

  __device__ __forceinline__ static WsBwdWork At(const BwdParams& p, uint32_t place) {
    WsBwdWork w;
    const AttentionShape& sh = p.shape;
    w.place = place;
    w.group = static_cast<int>(sh.group_size());
    w.pol = MaskPolicy::For(p.mask, static_cast<int>(sh.q_len), static_cast<int>(sh.kv_len), p.q_lengths,
                            p.kv_lengths, w.Batch());
    w.q_tiles = tc::QueryTileRange<Tile::kM, Tile::kN>(w.pol, w.C0());
    w.steps = w.group * w.q_tiles.count;
    return w;
  }
  __device__ __forceinline__ int KvHead() const { return Field(offsetof(tc::GridTile, y)); }
  __device__ __forceinline__ int Batch() const { return Field(offsetof(tc::GridTile, z)); }
  __device__ __forceinline__ int C0() const { return Field(offsetof(tc::GridTile, tile)) * Tile::kN; }  // first key
  __device__ __forceinline__ int Field(uint32_t offset) const {
    int v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(place + offset));
    return v;
  }
  __device__ __forceinline__ int Head(int it) const { return KvHead() * group + it / q_tiles.count; }
  __device__ __forceinline__ int Row0(int it) const { return (q_tiles.begin + it % q_tiles.count) * Tile::kM; }
};

// ------------------------------------------------------------------ producer
template <typename Tile>
__device__ __forceinline__ void WsBwdProducer(const BwdParams& p, const WsBwdSmem<Tile>& sm,
                                              const WsBwdWork<Tile>& w, float* stats_base, const CUtensorMap& q_map,
                                              const CUtensorMap& do_map, const CUtensorMap& k_map,
                                              const CUtensorMap& v_map) {
  constexpr int kM = Tile::kM, kN = Tile::kN, kBlocks = Tile::kD / 64;
  using QTile = typename Tile::QTile;
  using KVTile = typename Tile::KVTile;
  const AttentionShape& sh = p.shape;
  const int lane = threadIdx.x & 31;
  const int q_len = static_cast<int>(sh.q_len);
  if (w.steps == 0) return;  // no query sees these keys: the consumers store zeros
  if (lane == 0) {
    PrefetchTensorMap(q_map);
    PrefetchTensorMap(do_map);
    PrefetchTensorMap(k_map);
    PrefetchTensorMap(v_map);
  }
  // K and V of the CTA's keys, once. A full barrier of the producer's
  // completes with its 32 lanes' arrivals and the copied bytes: lane 0 issues
  // the copies onto it, or, for a ragged tail, onto the tail barrier, and
  // every lane zeroes the padding rows once they land (a NaN there would
  // reach dQ through dS = 0 times it; a visited key tile starts before
  // kv_valid).
  const bool kv_tail = w.pol.kv_valid < sh.kv_len && w.C0() + kN > w.pol.kv_valid;
  if (lane == 0) {
    const uint32_t bar = kv_tail ? sm.KvTail() : sm.KvFull();
    MBarrier::ArriveExpectBytes(bar, 2 * KVTile::kBytes);
    for (int b = 0; b < kBlocks; ++b) {
      TmaLoad4d(sm.k + b * KVTile::kBlockBytes, k_map, bar, 64 * b, w.KvHead(), w.C0(), w.Batch());
      TmaLoad4d(sm.v + b * KVTile::kBlockBytes, v_map, bar, 64 * b, w.KvHead(), w.C0(), w.Batch());
    }
  }
  if (kv_tail) {
    MBarrier::Wait(sm.KvTail(), 0);
    ZeroTileRows<KVTile>(sm.k, w.pol.kv_valid - w.C0(), lane);
    ZeroTileRows<KVTile>(sm.v, w.pol.kv_valid - w.C0(), lane);
    FenceSharedForAsyncProxy();
  }
  if (kv_tail || lane != 0) MBarrier::Arrive(sm.KvFull());

  RingPosition<Tile::kStages> ring;
  uint32_t tail_parity = 0;
  for (int it = 0; it < w.steps; ++it) {
    const int head = w.Head(it), r0 = w.Row0(it);
    const int s = ring.stage;
    MBarrier::Wait(sm.Empty(s), ring.parity ^ 1);  // every lane: they all write the stage
    // LSE and delta of the tile's rows (zeros past q_len, whose rows are masked).
    float* stats = sm.StatsPointer(stats_base, s);
    const int64_t row_off = (int64_t(w.Batch()) * sh.q_heads + head) * sh.q_len + r0;
    for (int i = lane; i < kM; i += 32) {
      const bool ok = r0 + i < q_len;
      stats[i] = ok ? p.lse[row_off + i] : 0.f;
      stats[kM + i] = ok ? p.delta[row_off + i] : 0.f;
    }
    const bool q_tail = w.pol.q_valid < q_len && r0 + kM > w.pol.q_valid;
    if (lane == 0) {
      const uint32_t bar = q_tail ? sm.QTail() : sm.Full(s);
      MBarrier::ArriveExpectBytes(bar, 2 * QTile::kBytes);
      for (int b = 0; b < kBlocks; ++b) {
        TmaLoad4d(sm.Q(s) + b * QTile::kBlockBytes, q_map, bar, 64 * b, head, r0, w.Batch());
        TmaLoad4d(sm.DO(s) + b * QTile::kBlockBytes, do_map, bar, 64 * b, head, r0, w.Batch());
      }
    }
    if (q_tail) {  // padding queries: zero Q and dO rows (a NaN there would reach dK, dV)
      MBarrier::Wait(sm.QTail(), tail_parity);
      __syncwarp();  // every lane has seen this phase before lane 0 can start the next one
      tail_parity ^= 1;
      const int first = MaxInt(w.pol.q_valid - r0, 0);
      ZeroTileRows<QTile>(sm.Q(s), first, lane);
      ZeroTileRows<QTile>(sm.DO(s), first, lane);
      FenceSharedForAsyncProxy();
    }
    if (q_tail || lane != 0) MBarrier::Arrive(sm.Full(s));  // the stats (and zeroed rows) are written
    ring.Advance();
  }
}

// ------------------------------------------------------------------ dQ writer
// One lane: per step, the staged tile goes into the sums of its (batch, head,
// rows) with one bulk tensor reduction per 32-column block; the tile is free
// once the copy engine has read it. Rows past q_len are clipped by the map;
// rows in [q_valid, q_len) (padding queries) add into sums DqFromSumsKernel
// never reads.
template <typename Tile>
__device__ __forceinline__ void WsBwdDqWriter(const WsBwdSmem<Tile>& sm, const WsBwdWork<Tile>& w,
                                              const CUtensorMap& dq_map) {
  using DqStage = typename Tile::DqStage;
  if (!Tile::kWithDq || (threadIdx.x & 31) != 0 || w.steps == 0) return;
  PrefetchTensorMap(dq_map);
  for (int it = 0; it < w.steps; ++it) {
    MBarrier::Wait(sm.DqFull(), it & 1);
#pragma unroll
    for (int b = 0; b < DqStage::kBlocks; ++b) {
      TmaReduceAdd4d(dq_map, sm.dq + b * DqStage::kBlockBytes, 32 * b, w.Head(it), w.Row0(it), w.Batch());
    }
    TmaStoreCommit();
    TmaStoreWaitRead<0>();
    MBarrier::Arrive(sm.DqEmpty());
  }
  TmaStoreWait<0>();  // the sums are complete before the CTA retires
}

// ------------------------------------------------------------------ consumer
template <typename T, typename Tile>
__device__ __forceinline__ void WsBwdConsumer(const BwdParams& p, const WsBwdSmem<Tile>& sm,
                                              const WsBwdWork<Tile>& w, float* stats_base, int consumer) {
  constexpr int kD = Tile::kD, kN = Tile::kN, kM = Tile::kM;
  constexpr int kQT = kM / 8, kDT = kD / 8, kDqCols = Tile::kDqCols;
  using QTile = typename Tile::QTile;
  using KVTile = typename Tile::KVTile;
  using DsTile = typename Tile::DsTile;
  const int tid = threadIdx.x - 128 * (consumer + 1);  // within the warpgroup
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int key_w = consumer * 64 + warp * 16;  // this warp's first key within the CTA's tile
  // This warpgroup's 64 keys of K and V, as A operands.
  const uint32_t sK_rows = sm.k + consumer * 64 * 128;
  const uint32_t sV_rows = sm.v + consumer * 64 * 128;
  const float scale_log2 = p.scale * tc::kLog2e;

  float dk[kDT][4], dv[kDT][4];
  tc::Zero(dk);
  tc::Zero(dv);
  if (w.steps > 0) MBarrier::Wait(sm.KvFull(), 0);

  RingPosition<Tile::kStages> ring;
  for (int it = 0; it < w.steps; ++it) {
    const int r0 = w.Row0(it);
    const int s = ring.stage;
    const uint32_t sQ = sm.Q(s), sdO = sm.DO(s);
    const float* lse = sm.StatsPointer(stats_base, s);
    const float* delta = lse + kM;
    MBarrier::Wait(sm.Full(s), ring.parity);

    // ---- Sᵀ, dPᵀ; Pᵀ while dPᵀ runs, then dSᵀ. Both are packed only once dSᵀ
    // is done, so Pᵀ in float32 and its packed form are never live together
    // (at the peak dK, dV, Pᵀ, dPᵀ: 192 registers; the other consumer's
    // products cover this warpgroup's element-wise work).
    float st[kQT][4], dp[kQT][4];
    KeyMajorScores<T, KVTile, QTile, kD, kM>(st, dp, sK_rows, sV_rows, sQ, sdO, w.pol, r0, w.C0(), w.C0() + key_w, kN,
                                             lse, lane, scale_log2);
    WgmmaWait<0>();
    FenceAccumulator(dp);
    uint32_t pa[kM / 16][4], da[kM / 16][4];
    tc::PackAFragments<T>(st, pa);
    tc::KeyMajorDs(st, dp, delta, lane);
    tc::PackAFragments<T>(dp, da);

    // ---- dSᵀ into the shared tile (for dQ); dV += Pᵀ dO
    const uint32_t sDs = sm.Ds(it);
    if constexpr (Tile::kWithDq) {
#pragma unroll
      for (int kk = 0; kk < kM / 16; ++kk) StoreTransposedFragment<DsTile>(sDs, da[kk], kk * 16, key_w, lane);
      FenceSharedForAsyncProxy();
    }
    WgmmaFence();
    ProductRS<T, QTile, kM, kD>(dv, pa, sdO, 0);
    WgmmaCommit();

    // ---- dQ = dS K over all kN keys, once every consumer's dS is in place,
    // then dK += dSᵀ Q, which runs on while dQ is staged. (Running it on into
    // the next step's scores as well needs more than 232 registers: ptxas
    // spills and serialises the products.)
    const int barrier = Tile::kDsBarrier + it % Tile::kDsBarriers;
    if (Tile::kWithDq && (Tile::kDqByColumns || it % Tile::kConsumers == consumer)) {
      NamedBarrierSync(barrier, 128 * Tile::kConsumers);
      const int col0 = Tile::kDqByColumns ? consumer * kDqCols : 0;
      float dq[kDqCols / 8][4];
      WgmmaFence();
      ProductSSMn<T, DsTile, KVTile, kN, kDqCols>(dq, sDs, sm.k, col0);
      WgmmaCommit();
      ProductRS<T, QTile, kM, kD>(dk, da, sQ, 0);
      WgmmaCommit();
      WgmmaWait<1>();  // dV and dQ
      FenceAccumulator(dq);
      MBarrier::Wait(sm.DqEmpty(), (it & 1) ^ 1);  // the last step's tile has been read
      // With kFlipStaging, lanes t = 2, 3 write the 8-column blocks in the
      // order k ^ 2, so the 16 lanes of a half-warp (4 rows, one swizzle phase
      // each) hit 8 different 16-byte chunks: one wavefront per half-warp,
      // where the same order for every lane takes two.
      const int flip = Tile::kFlipStaging ? t & 2 : 0;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp * 16 + g + half * 8;
#pragma unroll
        for (int k = 0; k < kDqCols / 8; ++k) {
          const int col = col0 + (k ^ flip) * 8 + 2 * t;  // float32 column; 16-byte chunks of 4
          const uint32_t at = sm.dq + Tile::DqStage::ChunkOffset(row, col >> 2) + (col & 3) * 4;
          const float x = flip ? dq[k ^ 2][2 * half] : dq[k][2 * half];
          const float y = flip ? dq[k ^ 2][2 * half + 1] : dq[k][2 * half + 1];
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(x), "f"(y) : "memory");
        }
      }
      FenceSharedForAsyncProxy();  // the staged dQ, for the copy engine
      MBarrier::Arrive(sm.DqFull());
    } else {
      if (Tile::kWithDq) NamedBarrierArrive(barrier, 128 * Tile::kConsumers);
      WgmmaFence();
      ProductRS<T, QTile, kM, kD>(dk, da, sQ, 0);
      WgmmaCommit();
    }
    WgmmaWait<0>();
    FenceAccumulator(dv);
    FenceAccumulator(dk);
    MBarrier::Arrive(sm.Empty(s));  // Q, dO and the stats are read (dK, dV done)
    ring.Advance();
  }

  tc::StoreKeyGrads<T>(dk, dv, p, w.Batch(), w.KvHead(), w.C0() + key_w, 0, lane);
}

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    WsBwdKernel(const __grid_constant__ BwdParams p, const __grid_constant__ CUtensorMap q_map,
                const __grid_constant__ CUtensorMap do_map, const __grid_constant__ CUtensorMap k_map,
                const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dq_map) {
#if defined(JAXFLASH_SM90A)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (tc::SmemAddr(smem_raw) + 1023u) & ~1023u;
  const auto sm = WsBwdSmem<Tile>::At(base);
  // The first stage's statistics as a pointer (StatsPointer finds the others).
  float* stats_base = reinterpret_cast<float*>(smem_raw + (sm.Stats(0) - tc::SmemAddr(smem_raw)));
  if (threadIdx.x == 0) {
    sm.InitBarriers();
    *reinterpret_cast<tc::GridTile*>(smem_raw + (sm.place - tc::SmemAddr(smem_raw))) =
        tc::OrderedGridTile<tc::HeavyTiles::kFirst>(p.mask);
  }
  __syncthreads();
  RunRoles<Tile::kProducerRegs, Tile::kConsumerRegs>(
      [&](int warp) {
        if (warp == 0) {
          WsBwdProducer<Tile>(p, sm, WsBwdWork<Tile>::At(p, sm.place), stats_base, q_map, do_map, k_map, v_map);
        } else if (warp == 1) {
          WsBwdDqWriter<Tile>(sm, WsBwdWork<Tile>::At(p, sm.place), dq_map);
        }
      },
      [&](int consumer) {
        WsBwdConsumer<T, Tile>(p, sm, WsBwdWork<Tile>::At(p, sm.place), stats_base, consumer);
      });
#endif  // JAXFLASH_SM90A
}

// The warp-specialised pass over (key tiles, kv heads, batch): checks the
// launch limits, then encodes the tensor maps and launches. The caller runs
// it only on non-empty extents, which a map needs. Without dQ the sums' map
// is not encoded (deterministic calls have no sums) and the kernel's slot for
// it takes Q's map, which it never reads.
template <typename T, typename Tile>
Status RunWsPass(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  Status st = EnsureDynamicSmem<WsBwdKernel<T, Tile>>(Tile::kSmemBytes, device);
  if (!st.ok()) return st;
  const AttentionShape& sh = p.shape;
  if (CeilDiv(sh.kv_len, Tile::kN) > INT_MAX || sh.kv_heads > 65535 || sh.batch > 65535) {
    return Status::Unimplemented("backward grid beyond the launch limits");
  }
  CUtensorMap q_map, do_map, k_map, v_map, dq_map;
  if (!(st = EncodeRowsMap(&q_map, p.q, p.dtype, sh, true, Tile::kM)).ok() ||
      !(st = EncodeRowsMap(&do_map, p.dout, p.dtype, sh, true, Tile::kM)).ok() ||
      !(st = EncodeRowsMap(&k_map, p.k, p.dtype, sh, false, Tile::kN)).ok() ||
      !(st = EncodeRowsMap(&v_map, p.v, p.dtype, sh, false, Tile::kN)).ok()) {
    return st;
  }
  if (!Tile::kWithDq) {
    dq_map = q_map;
  } else if (!(st = EncodeRowsMap(&dq_map, p.dq_accum, DType::kFloat32, sh, true, Tile::kM)).ok()) {
    return st;
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(sh.kv_len, Tile::kN)), static_cast<unsigned>(sh.kv_heads),
                  static_cast<unsigned>(sh.batch));
  WsBwdKernel<T, Tile><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p, q_map, do_map, k_map, v_map,
                                                                                dq_map);
  return CheckLaunch(Tile::kWithDq ? "attention backward (sm90, warp-specialised: dK, dV and dQ sums)"
                                   : "attention backward (sm90, warp-specialised: dK, dV)");
}

// The fused backward: delta, the pass with dQ sums, dQ from the sums.
template <typename T, typename Tile>
Status LaunchWsBackward(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  static_assert(Tile::kWithDq, "the fused backward adds dQ into the sums");
  return tc::RunFusedBackward<T, Tile::kD>(p, stream, [&] { return RunWsPass<T, Tile>(p, device, stream); });
}

}  // namespace sm90
}  // namespace jaxflash
