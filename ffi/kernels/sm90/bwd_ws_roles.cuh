// The roles of the warp-specialised fused backward (bwd_ws_kernel.cuh) that
// do not depend on how its consumers split the work: the shared-memory
// layout, the CTA's place and walk, the producer warp (K and V once, then Q,
// dO and the rows' statistics per step through the TMA), the dQ writer
// (staged dQ into the float32 sums by bulk tensor reductions) and the frame
// of a consumer's walk (StartKeyGrads, WaitForStage, FinishStep). A Tile says
// what the consumers need: tiles, stages, dS buffers and dQ staging.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include "common/bwd_blocks.cuh"
#include "common/grid_order.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "jaxflash/params.h"
#include "sm90/barrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

template <typename Tile>
struct WsBwdSmem {
  // Per stage Q and dO (and a dense tile's bias: Tile::kBiasBytes), whole
  // swizzle periods, the dS buffers and the dQ
  // staging (also swizzled), then per stage kM LSE and kM delta values and
  // the step's mask flag (StepIsFull; padded to 16 bytes): kept out of
  // the stages, so that at D 256 none is rounded up to 1024 bytes.
  static constexpr size_t kStageBytes = size_t(Tile::QTile::kBytes) + Tile::DOTile::kBytes + Tile::kBiasBytes;
  static constexpr int kStatsFloats = 2 * Tile::kM + (Tile::kFlagWriter ? 4 : 0);
  static constexpr size_t kStatsBytes = Tile::kStages * kStatsFloats * sizeof(float);
  static constexpr size_t kKvBytes = size_t(Tile::KTile::kBytes) + Tile::VTile::kBytes;
  static constexpr size_t kBytes = kKvBytes + Tile::kStages * kStageBytes + Tile::kDsBytes +
                                   Tile::kDqBytes + kStatsBytes + 8 * Tile::kBarriers + sizeof(tc::GridTile);
  static_assert((kKvBytes + Tile::kStages * kStageBytes + Tile::kDsBytes) % 1024 == 0,
                "the dQ staging starts on a swizzle period");
  // What a launch asks for: the base is aligned up to a swizzle period.
  static constexpr size_t kLaunchBytes = kBytes + 1024;
  static_assert(kLaunchBytes <= kSm90SmemPerCta, "shared memory of one CTA");
  uint32_t k, v, stages, ds, dq, stats, bars, place;

  __device__ __forceinline__ static WsBwdSmem At(uint32_t base) {
    WsBwdSmem s;
    s.k = base;
    s.v = s.k + Tile::KTile::kBytes;
    s.stages = s.v + Tile::VTile::kBytes;
    s.ds = s.stages + Tile::kStages * uint32_t(kStageBytes);
    s.dq = s.ds + uint32_t(Tile::kDsBytes);
    s.stats = s.dq + uint32_t(Tile::kDqBytes);
    s.bars = s.stats + uint32_t(kStatsBytes);
    s.place = s.bars + 8 * Tile::kBarriers;
    return s;
  }
  __device__ __forceinline__ uint32_t Q(int stage) const { return stages + stage * uint32_t(kStageBytes); }
  __device__ __forceinline__ uint32_t DO(int stage) const { return Q(stage) + Tile::QTile::kBytes; }
  __device__ __forceinline__ uint32_t Bias(int stage) const { return DO(stage) + Tile::DOTile::kBytes; }
  // A stage's LSE (then delta, then the flag) values as a pointer, from the
  // first stage's.
  __device__ __forceinline__ static float* StatsPointer(float* first, int stage) {
    return first + stage * kStatsFloats;
  }
  // The dS buffer of step `it` (two, alternating).
  __device__ __forceinline__ uint32_t Ds(int it) const { return ds + (it & 1) * uint32_t(Tile::kDsBytes / 2); }
  __device__ __forceinline__ uint32_t KvFull() const { return bars; }
  __device__ __forceinline__ uint32_t KvTail() const { return bars + 8; }
  __device__ __forceinline__ uint32_t QTail() const { return bars + 16; }
  // dQ staging buffer b, and its pair of barriers.
  __device__ __forceinline__ uint32_t Dq(int b) const {
    return dq + b * uint32_t(Tile::kDqBytes / Tile::kDqBuffers);
  }
  __device__ __forceinline__ uint32_t DqFull(int b) const { return bars + 24 + 8 * b; }
  __device__ __forceinline__ uint32_t DqEmpty(int b) const { return DqFull(Tile::kDqBuffers + b); }
  __device__ __forceinline__ uint32_t Full(int s) const { return DqFull(2 * Tile::kDqBuffers + s); }
  __device__ __forceinline__ uint32_t Empty(int s) const { return Full(Tile::kStages + s); }

  // Every thread that wrote (or read) a buffer with ordinary instructions
  // arrives itself, so each access is ordered by its own thread's arrival
  // (and compute-sanitizer's racecheck sees that it is).
  __device__ __forceinline__ void InitBarriers() const {
    constexpr int kConsumerThreads = 128 * Tile::kConsumers;
    MBarrier::Init(KvFull(), 32);  // the producer warp's lanes (plus the copied bytes)
    MBarrier::Init(KvTail(), 1);
    MBarrier::Init(QTail(), 1);
    if constexpr (Tile::kStagedDq) {
      for (int b = 0; b < Tile::kDqBuffers; ++b) {
        MBarrier::Init(DqFull(b), 128 * Tile::kDqWriters);  // every staging consumer thread has written its share
        MBarrier::Init(DqEmpty(b), 1);                      // the writer's bulk reductions have read the tile
      }
    }
    for (int s = 0; s < Tile::kStages; ++s) {
      // the producer warp's lanes (the stats among them), and the flag
      // writer's lane (kFlagWriter), each arriving after its own stores
      MBarrier::Init(Full(s), 32 + Tile::kFlagWriter);
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
  // Head and first row of step after step, counted: the producer warpgroup's
  // roles run in 24 registers, where a division and modulo per step spilled,
  // and in the consumers they were ~35 dependent instructions at the top of
  // each step (with the ALiBi slope's load), between the last step's dK and
  // the next Sᵀ.
  struct Steps {
    int head, q_tile, begin, end;
    __device__ __forceinline__ int Row0() const { return q_tile * Tile::kM; }
    __device__ __forceinline__ void Next() {
      if (++q_tile == end) {
        q_tile = begin;
        ++head;
      }
    }
  };
  __device__ __forceinline__ Steps FirstStep() const {
    return {KvHead() * group, q_tiles.begin, q_tiles.begin, q_tiles.begin + q_tiles.count};
  }
};

// ------------------------------------------------------------------ a consumer's step
// What every consumer kind reads in step `it`: its first query row and the
// stage's Q, dO, LSE and delta, with (StepIsFull) whether the step's tile (the
// stage's kM rows, the CTA's keys) is visible throughout, so its scores skip
// the mask. Returned once the producer has filled the stage (the caller
// releases it on sm.Empty).
struct WsBwdStage {
  int r0;
  uint32_t q, d_o;
  const float* lse;    // kM values, in log2 units where Tile::kLseLog2
  const float* delta;  // kM values (then, where Tile::kFlagWriter, 1 if the tile is full)
};
// Whether the step's tile is full (MaskPolicy::TileIsFull): the flag where a
// warp writes it (WsBwdFlagWriter; with segment ids the question reads the
// rows' table from global memory, an L2 round trip that outlasted the step's
// first products when each consumer asked it: docs/performance-log.md,
// forty-fifth session), else asked here. The flag is read where it is used,
// under the products: read at the stage's wait and held, or through a pointer
// of its own, it spilled the D 128 consumers.
// (AskStepIsFull is the question itself, of the step whose first row is r0.)
template <typename Tile>
__device__ __forceinline__ bool AskStepIsFull(const WsBwdWork<Tile>& w, int r0) {
  return w.pol.template TileIsFull<true>(r0, r0 + Tile::kM, w.C0(), w.C0() + Tile::kN);
}
template <typename Tile>
__device__ __forceinline__ bool StepIsFull(const WsBwdWork<Tile>& w, const WsBwdStage& in) {
  if constexpr (Tile::kFlagWriter) {
    return in.delta[Tile::kM] != 0.f;
  } else {
    return AskStepIsFull(w, in.r0);
  }
}
template <typename Tile>
__device__ __forceinline__ WsBwdStage WaitForStage(const WsBwdSmem<Tile>& sm,
                                                   const typename WsBwdWork<Tile>::Steps& step, float* stats_base,
                                                   const RingPosition<Tile::kStages>& ring) {
  WsBwdStage st;
  st.r0 = step.Row0();
  st.q = WarpUniform(sm.Q(ring.stage));
  st.d_o = WarpUniform(sm.DO(ring.stage));
  st.lse = sm.StatsPointer(stats_base, ring.stage);
  st.delta = st.lse + Tile::kM;
  MBarrier::Wait(sm.Full(ring.stage), ring.parity);
  return st;
}

// A consumer's start: dK and dV zeroed, and (when it has a step) K and V of
// the CTA's keys landed.
template <typename Tile, int kKT, int kVT>
__device__ __forceinline__ void StartKeyGrads(const WsBwdSmem<Tile>& sm, const WsBwdWork<Tile>& w,
                                              float (&dk)[kKT][4], float (&dv)[kVT][4]) {
  tc::Zero(dk);
  tc::Zero(dv);
  if (w.steps > 0) MBarrier::Wait(sm.KvFull(), 0);
}

// A consumer's step end: its dV and dK products are done, so Q, dO and the
// stats of the stage are read; the stage goes back to the producer.
template <typename Tile, int kKT, int kVT>
__device__ __forceinline__ void FinishStep(const WsBwdSmem<Tile>& sm, RingPosition<Tile::kStages>& ring,
                                           float (&dk)[kKT][4], float (&dv)[kVT][4]) {
  WgmmaWait<0>();
  FenceAccumulator(dv);
  FenceAccumulator(dk);
  MBarrier::Arrive(sm.Empty(ring.stage));
  ring.Advance();
}

// A consumer's end: its dK (times the scale) and dV staged in its part of
// the K and V tiles, in the swizzled layout the K and V maps load, and
// stored with the TMA. A key-split consumer (bwd_ws_kernel.cuh) holds keys
// [key0, key0 + 64) of the tile, all columns; a column consumer
// (bwd_ws_columns.cuh) all 64 keys, columns [dk_col0, dk_col0 + 8 kKT) of dK
// and [dv_col0, dv_col0 + 8 kVT) of dV, whole 64-column blocks no other
// consumer stages or, past its last dS barrier, reads. Stored from
// registers instead (64 four-byte stores a thread at D 128, every CTA of a
// wave at once) they took 5-10 µs of a CTA's ~80 at D 128 S 2k, its largest
// fixed cost (docs/performance.md, twenty-eighth session's timeline).
// Entries a NaN reached are recomputed exactly first, as tc::StoreKeyGrads
// does.
template <typename T, typename Tile, int kKT, int kVT>
__device__ __forceinline__ void StoreKeyGradsByTma(const BwdParams& p, const WsBwdSmem<Tile>& sm,
                                                   const WsBwdWork<Tile>& w, int consumer, int key0,
                                                   float (&dk)[kKT][4], int dk_col0, float (&dv)[kVT][4],
                                                   int dv_col0, const CUtensorMap& dk_map,
                                                   const CUtensorMap& dv_map) {
  using KTile = typename Tile::KTile;
  using VTile = typename Tile::VTile;
  static_assert(kKT % 8 == 0 && kVT % 8 == 0, "whole 64-column blocks");
  constexpr int kCT = kKT > kVT ? kKT : kVT;
  const AttentionShape& sh = p.shape;
  const int tid = threadIdx.x - 128 * (consumer + 1), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  // Key-split consumers with dQ read every consumer's rows of K up to their
  // last step (dQ = dS·K over all kN keys): the tiles are free once all are
  // done. Otherwise a consumer's products read only its own rows, or (the
  // column consumers' Sᵀ and dPᵀ) its partner's columns before the step's dS
  // barrier, which both have passed.
  if constexpr (Tile::kWithDq && !Tile::kSharedKeys) NamedBarrierSync(Tile::kKeysFreeBarrier, 128 * Tile::kConsumers);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = key0 + warp * 16 + g + half * 8;
    const int key = w.C0() + row;
    if (key < sh.kv_len && (tc::LaneHasNan(dk, half) || tc::LaneHasNan(dv, half))) {
      tc::ExactKeyGradLane<T, (Tile::kDv != Tile::kD)>(p, w.Batch(), w.KvHead(), key, t, half, dk, dk_col0, dv,
                                                       dv_col0);
    }
#pragma unroll
    for (int dt = 0; dt < kCT; ++dt) {
      if (dt < kKT) {
        const uint32_t k_val = tc::ElemTraits<T>::Pack(dk[dt][2 * half] * p.scale, dk[dt][2 * half + 1] * p.scale);
        StoreShared32(sm.k + PairOffset<KTile>(row, dk_col0 / 8 + dt, t), k_val);
      }
      if (dt < kVT) {
        const uint32_t v_val = tc::ElemTraits<T>::Pack(dv[dt][2 * half], dv[dt][2 * half + 1]);
        StoreShared32(sm.v + PairOffset<VTile>(row, dv_col0 / 8 + dt, t), v_val);
      }
    }
  }
  __syncwarp();
  FenceSharedForAsyncProxy();  // the staged rows, for the copy engine
  NamedBarrierSync(Tile::kKeyGradsBarrier + consumer, 128);
  const int first_key = w.C0() + key0;
  if (tid == 0 && first_key < sh.kv_len) {  // rows past kv_len are clipped by the maps, and columns past head_dim
    // (A block wholly past head_dim is not stored; in today's buckets none is.)
    for (int i = 0; i < kCT / 8; ++i) {
      const int bk = dk_col0 / 64 + i, bv = dv_col0 / 64 + i;
      if (i < kKT / 8 && 64 * bk < sh.head_dim) {
        TmaStore4d(dk_map, sm.k + bk * KTile::kBlockBytes + key0 * 128, 64 * bk, w.KvHead(), first_key, w.Batch());
      }
      if (i < kVT / 8 && 64 * bv < sh.v_dim()) {
        TmaStore4d(dv_map, sm.v + bv * VTile::kBlockBytes + key0 * 128, 64 * bv, w.KvHead(), first_key, w.Batch());
      }
    }
    TmaStoreCommit();
    TmaStoreWait<0>();  // complete (and the tiles read) before the CTA retires
  }
}

// ------------------------------------------------------------------ producer
template <typename Tile>
__device__ __forceinline__ void WsBwdProducer(const BwdParams& p, const WsBwdSmem<Tile>& sm,
                                              const WsBwdWork<Tile>& w, float* stats_base, const CUtensorMap& q_map,
                                              const CUtensorMap& do_map, const CUtensorMap& k_map,
                                              const CUtensorMap& v_map, const CUtensorMap& bias_map) {
  constexpr int kM = Tile::kM, kN = Tile::kN;
  using QTile = typename Tile::QTile;
  using DOTile = typename Tile::DOTile;
  using KTile = typename Tile::KTile;
  using VTile = typename Tile::VTile;
  const AttentionShape& sh = p.shape;
  const int lane = threadIdx.x & 31;
  const int q_len = static_cast<int>(sh.q_len);
  if (w.steps == 0) return;  // no query sees these keys: the consumers store zeros
  if (lane == 0) {
    PrefetchTensorMap(q_map);
    PrefetchTensorMap(do_map);
    PrefetchTensorMap(k_map);
    PrefetchTensorMap(v_map);
    if constexpr (Tile::kTakesDense) PrefetchTensorMap(bias_map);
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
    MBarrier::ArriveExpectBytes(bar, KTile::kBytes + VTile::kBytes);
    for (int b = 0; b < KTile::kBlocks; ++b) {
      TmaLoad4d(sm.k + b * KTile::kBlockBytes, k_map, bar, 64 * b, w.KvHead(), w.C0(), w.Batch());
    }
    for (int b = 0; b < VTile::kBlocks; ++b) {
      TmaLoad4d(sm.v + b * VTile::kBlockBytes, v_map, bar, 64 * b, w.KvHead(), w.C0(), w.Batch());
    }
  }
  if (kv_tail) {
    MBarrier::Wait(sm.KvTail(), 0);
    ZeroTileRows<KTile>(sm.k, w.pol.kv_valid - w.C0(), lane);
    ZeroTileRows<VTile>(sm.v, w.pol.kv_valid - w.C0(), lane);
    FenceSharedForAsyncProxy();
  }
  if (kv_tail || lane != 0) MBarrier::Arrive(sm.KvFull());

  RingPosition<Tile::kStages> ring;
  uint32_t tail_parity = 0;
  auto step = w.FirstStep();
  for (int it = 0; it < w.steps; ++it, step.Next()) {
    const int head = step.head, r0 = step.Row0();
    const int s = ring.stage;
    MBarrier::Wait(sm.Empty(s), ring.parity ^ 1);  // every lane: they all write the stage
    // LSE and delta of the tile's rows (zeros past q_len, whose rows are masked).
    float* stats = sm.StatsPointer(stats_base, s);
    const int64_t row_off = (int64_t(w.Batch()) * sh.q_heads + head) * sh.q_len + r0;
    for (int i = lane; i < kM; i += 32) {
      const bool ok = r0 + i < q_len;
      stats[i] = ok ? p.lse[row_off + i] * (Tile::kLseLog2 ? tc::kLog2e : 1.f) : 0.f;
      stats[kM + i] = ok ? p.delta[row_off + i] : 0.f;
    }
    const bool q_tail = w.pol.q_valid < q_len && r0 + kM > w.pol.q_valid;
    if (lane == 0) {
      const uint32_t bar = q_tail ? sm.QTail() : sm.Full(s);
      MBarrier::ArriveExpectBytes(bar, QTile::kBytes + DOTile::kBytes + Tile::kBiasBytes);
      for (int b = 0; b < QTile::kBlocks; ++b) {
        TmaLoad4d(sm.Q(s) + b * QTile::kBlockBytes, q_map, bar, 64 * b, head, r0, w.Batch());
      }
      for (int b = 0; b < DOTile::kBlocks; ++b) {
        TmaLoad4d(sm.DO(s) + b * DOTile::kBlockBytes, do_map, bar, 64 * b, head, r0, w.Batch());
      }
      if constexpr (Tile::kTakesDense) {  // the bias of the step's rows and the CTA's keys, 64 keys a box
        using BiasTile = typename Tile::BiasTile;
        const DenseTerm& bias = p.dense.bias;
        for (int b = 0; b < BiasTile::kBlocks; ++b) {
          TmaLoad4d(sm.Bias(s) + b * BiasTile::kBlockBytes, bias_map, bar, w.C0() + 64 * b, r0, bias.OwnHead(head),
                    bias.OwnBatch(w.Batch()));
        }
      }
    }
    if (q_tail) {  // padding queries: zero Q and dO rows (a NaN there would reach dK, dV)
      MBarrier::Wait(sm.QTail(), tail_parity);
      __syncwarp();  // every lane has seen this phase before lane 0 can start the next one
      tail_parity ^= 1;
      const int first = MaxInt(w.pol.q_valid - r0, 0);
      ZeroTileRows<QTile>(sm.Q(s), first, lane);
      ZeroTileRows<DOTile>(sm.DO(s), first, lane);
      if constexpr (Tile::kTakesDense) ZeroTileRows<typename Tile::BiasTile>(sm.Bias(s), first, lane);
      FenceSharedForAsyncProxy();
    }
    if (q_tail || lane != 0) MBarrier::Arrive(sm.Full(s));  // the stats (and zeroed rows) are written
    ring.Advance();
  }
}

// ------------------------------------------------------------------ mask flags
// One lane of another warp: per step, whether the step's tile needs its mask
// (StepIsFull), into the stage after LSE and delta. Its own warp, as the
// producer's 24 registers spilled with the segment table's reads; asked
// before the stage is free, so the reads overlap the wait.
template <typename Tile>
__device__ __forceinline__ void WsBwdFlagWriter(const WsBwdSmem<Tile>& sm, const WsBwdWork<Tile>& w,
                                                float* stats_base) {
  if ((threadIdx.x & 31) != 0) return;
  RingPosition<Tile::kStages> ring;
  auto step = w.FirstStep();
#pragma unroll 1  // unrolled by two, it spilled a register
  for (int it = 0; it < w.steps; ++it, step.Next()) {
    const bool full = AskStepIsFull(w, step.Row0());
    MBarrier::Wait(sm.Empty(ring.stage), ring.parity ^ 1);
    sm.StatsPointer(stats_base, ring.stage)[2 * Tile::kM] = full ? 1.f : 0.f;
    MBarrier::Arrive(sm.Full(ring.stage));
    ring.Advance();
  }
}

// ------------------------------------------------------------------ dQ writer
// One lane: per step, the staged tile goes into the sums of its (batch, head,
// rows) with one bulk tensor reduction per 32-column block; the tile is free
// once the copy engine has read it. Rows past q_len are clipped by the map;
// rows in [q_valid, q_len) (padding queries) add into sums DqFromSumsKernel
// never reads. With dS out (a dense tile's, BwdParams::ds_out) the step's dS
// tile, complete since every consumer staged its dQ after the step's dS
// barrier, goes into its entries there beside, one box of 64 keys at a time
// (rows and keys past the call clipped; masked pairs hold dS = 0): stored,
// or added where another (batch, head) adds there too. The consumers
// overwrite that dS buffer two steps later, past their wait for this step's
// dQ buffer, which the writer frees only once the copy engine has read both.
// (Store or add is chosen once, outside the loop: a branch between the two in
// the loop cost the producers' few registers a spill.)
template <typename Tile>
__device__ __forceinline__ void WsBwdDqWriter(const WsBwdSmem<Tile>& sm, const WsBwdWork<Tile>& w,
                                              const CUtensorMap& dq_map, const CUtensorMap& ds_map,
                                              const BwdParams& p) {
  using DqStage = typename Tile::DqStage;
  constexpr int kBuffers = Tile::kDqBuffers;
  static_assert(Tile::kStagedDq && (kBuffers == 2 || Tile::kTakesDense), "two dQ staging buffers, or a dense tile's one");
  if ((threadIdx.x & 31) != 0 || w.steps == 0) return;
  PrefetchTensorMap(dq_map);
  const DenseTerm& ds_out = p.ds_out;
  if (Tile::kTakesDense && ds_out.On()) PrefetchTensorMap(ds_map);
  auto steps = [&](auto adds_ds) {
    auto step = w.FirstStep();
    for (int it = 0; it < w.steps; ++it, step.Next()) {
      const int buf = it % kBuffers;
      MBarrier::Wait(sm.DqFull(buf), (it / kBuffers) & 1);
#pragma unroll
      for (int b = 0; b < DqStage::kBlocks; ++b) {
        TmaReduceAdd4d(dq_map, sm.Dq(buf) + b * DqStage::kBlockBytes, 32 * b, step.head, step.Row0(), w.Batch());
      }
      if constexpr (Tile::kTakesDense) {
        using DsTile = typename Tile::DsTile;
        if (ds_out.On()) {
          const int head = ds_out.OwnHead(step.head), batch = ds_out.OwnBatch(w.Batch());
          for (int b = 0; b < DsTile::kBlocks; ++b) {
            const uint32_t box = sm.Ds(it) + b * DsTile::kBlockBytes;
            if constexpr (decltype(adds_ds)::value) {
              TmaReduceAdd4d(ds_map, box, w.C0() + 64 * b, step.Row0(), head, batch);
            } else {
              TmaStore4d(ds_map, box, w.C0() + 64 * b, step.Row0(), head, batch);
            }
          }
        }
      }
      TmaStoreCommit();
      if constexpr (kBuffers == 1 || Tile::kTakesDense) {
        // This step's tiles read: free them (a dense tile's consumers wait
        // for it before their dS of two steps on, WsBwdConsumer).
        TmaStoreWaitRead<0>();
        MBarrier::Arrive(sm.DqEmpty(buf));
      } else {
        // The step before's tile has been read (this step's reductions stay in
        // flight): free its buffer.
        TmaStoreWaitRead<1>();
        if (it > 0) MBarrier::Arrive(sm.DqEmpty(buf ^ 1));
      }
    }
  };
  if (Tile::kTakesDense && ds_out.On() && ds_out.Sharers(p.shape) > 1) {
    steps(std::true_type{});
  } else {
    steps(std::false_type{});
  }
  TmaStoreWait<0>();  // the sums are complete before the CTA retires (no step waits for the last buffer)
}

}  // namespace sm90
}  // namespace jaxflash
