// The dQ pass of the Hopper backward (sm_90a), warp-specialised: the pass
// after the key-split pass without dQ (bwd_ws_kernel.cuh, kWithDq = false) on
// deterministic calls and where the fused pass is not the default (D 256).
//
// One CTA per (query tile of kM rows, head, batch), in the grid order of
// common/grid_order.cuh, that walks the key tiles its rows see:
//
//   producer   warp 0 copies Q and dO of the CTA's rows once, then K and V of
//              kN keys per step into a ring of kStages stages, through the
//              TMA; it zeroes the padding keys of a ragged batch element
//              (a NaN there would reach dQ through dS = 0 times it).
//   consumers  kConsumers warpgroups of 64 query rows, each walking the key
//              tiles its own rows see (as the forward's consumers do: under a
//              causal mask the first one passes over the last tiles). Per step:
//                S = Q·Kᵀ, dP = dO·Vᵀ, and dQ += dS·K of the step before;
//                P while dP runs, dS while that dQ runs;
//              so the tensor cores have the previous step's dQ to run while a
//              warpgroup's exponentials are computed. A stage is released
//              once the dQ product that reads its K is done, which is why the
//              ring needs three stages: the one being read by S and dP, the
//              one the previous dQ reads, and the one being filled.
//   epilogue   each consumer stages its rows of dQ in its rows of the Q tile
//              and stores them with the TMA (StoreQueryGradByTma: the scale,
//              zeros for padding rows, the exact recomputation of a lane that
//              a masked pair's 0 · NaN reached).
//
// Deterministic by construction: each CTA owns its rows' dQ and adds the key
// tiles in order. The cp.async kernel it replaced (DqKernel, bwd_kernel.cuh,
// still the forced-tile path) met at a __syncthreads every step, so its two
// warpgroups computed their exponentials at the same time and left the tensor
// cores idle then (docs/performance.md, twenty-seventh session).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <type_traits>

#include "common/bwd_blocks.cuh"
#include "common/fwd_blocks.cuh"
#include "common/grid_order.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "jaxflash/params.h"
#include "sm90/barrier.cuh"
#include "sm90/tensor_map.h"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

// kDv_: the value's head dim where it has its own (MLA: dO and V at it).
template <int kD_, int kN_, int kStages_ = 3, int kConsumers_ = 2, int kDv_ = kD_>
struct WsDqTile {
  static constexpr int kD = kD_;
  static constexpr int kDv = kDv_;
  static constexpr int kN = kN_;  // keys per step
  static constexpr int kStages = kStages_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kM = 64 * kConsumers;  // query rows per CTA
  static constexpr bool kTakesSoftCap = true;
  static constexpr bool kTakesSegments = true;
  static constexpr bool kTakesAlibi = true;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  using QTile = SwizzledTile<kM, kD>;
  using KVTile = SwizzledTile<kN, kD>;  // K's
  using DOTile = SwizzledTile<kM, kDv>;
  using VTile = SwizzledTile<kN, kDv>;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = ConsumerRegisters(kConsumers + 1, kProducerRegs);
  // Barriers: Q and dO full, the ragged tail, then per stage K full, V full
  // and empty.
  static constexpr int kBarriers = 2 + 3 * kStages;
  // Named, one a consumer, at the end (StoreQueryGradByTma): its staged dQ is
  // in place.
  static constexpr int kQueryGradBarrier = 1;
  static_assert(kQueryGradBarrier + kConsumers <= 16, "named barriers 1-15");
  // Q, dO, the K stages, the V stages, the barriers; +1024: the dynamic
  // shared-memory base is aligned up to a swizzle period.
  static constexpr size_t kSmemBytes =
      size_t(QTile::kBytes) + DOTile::kBytes + kStages * size_t(KVTile::kBytes + VTile::kBytes) + 8 * kBarriers + 1024;
  static_assert(kSmemBytes <= kSm90SmemPerCta, "shared memory of one CTA");
  static_assert(kStages >= 3, "a stage is read by S and dP while the one before is read by dQ");
  static_assert(kN == 32 || kN == 48 || kN == 64 || kN == 128, "score tiles use the compiled wgmma widths");
  static_assert(kM <= 256 && kN <= 256, "a TMA box has at most 256 rows");
};

template <typename Tile>
struct WsDqSmem {
  uint32_t q, d_o, k, v, bars;

  __device__ __forceinline__ static WsDqSmem At(uint32_t base) {
    WsDqSmem s;
    s.q = base;
    s.d_o = s.q + Tile::QTile::kBytes;
    s.k = s.d_o + Tile::DOTile::kBytes;
    s.v = s.k + Tile::kStages * Tile::KVTile::kBytes;
    s.bars = s.v + Tile::kStages * Tile::VTile::kBytes;
    return s;
  }
  __device__ __forceinline__ uint32_t K(int stage) const { return k + stage * Tile::KVTile::kBytes; }
  __device__ __forceinline__ uint32_t V(int stage) const { return v + stage * Tile::VTile::kBytes; }
  __device__ __forceinline__ uint32_t QFull() const { return bars; }
  __device__ __forceinline__ uint32_t Tail() const { return bars + 8; }
  __device__ __forceinline__ uint32_t KFull(int s) const { return bars + 16 + 8 * s; }
  __device__ __forceinline__ uint32_t VFull(int s) const { return KFull(Tile::kStages + s); }
  __device__ __forceinline__ uint32_t Empty(int s) const { return KFull(2 * Tile::kStages + s); }

  __device__ __forceinline__ void InitBarriers() const {
    MBarrier::Init(QFull(), 1);  // the producer's arrival, plus the copied bytes
    MBarrier::Init(Tail(), 1);
    for (int s = 0; s < Tile::kStages; ++s) {
      MBarrier::Init(KFull(s), 1);
      MBarrier::Init(VFull(s), 1);
      MBarrier::Init(Empty(s), 4 * Tile::kConsumers);  // every consumer warp is done with the stage
    }
    MBarrier::FenceInit();
  }
};

// ------------------------------------------------------------------ producer
template <typename T, typename Tile>
__device__ __forceinline__ void WsDqProducer(const BwdParams& p, const WsDqSmem<Tile>& sm, const tc::GridTile& at,
                                             const CUtensorMap& q_map, const CUtensorMap& do_map,
                                             const CUtensorMap& k_map, const CUtensorMap& v_map) {
  constexpr int kM = Tile::kM, kN = Tile::kN, kBlocks = Tile::kD / 64, kVBlocks = Tile::kDv / 64;
  using QTile = typename Tile::QTile;
  using KVTile = typename Tile::KVTile;
  using DOTile = typename Tile::DOTile;
  using VTile = typename Tile::VTile;
  const int lane = threadIdx.x & 31;
  const tc::FwdBlock<T> w = tc::FwdBlock<T>::template At<kM, kN>(p, at.tile, at.y, at.z);
  if (w.tiles.begin >= w.tiles.end) return;  // no key: the consumers store zeros
  const int kv_head = w.head / static_cast<int>(p.shape.group_size());
  const int kv_len = static_cast<int>(p.shape.kv_len);
  if (lane == 0) {
    PrefetchTensorMap(q_map);
    PrefetchTensorMap(do_map);
    PrefetchTensorMap(k_map);
    PrefetchTensorMap(v_map);
    // Q and dO rows past q_valid (padding) are not zeroed: they reach only
    // their own rows of dQ, which StoreQueryGrad writes as zeros.
    MBarrier::ArriveExpectBytes(sm.QFull(), QTile::kBytes + DOTile::kBytes);
    for (int b = 0; b < kBlocks; ++b) {
      TmaLoad4d(sm.q + b * QTile::kBlockBytes, q_map, sm.QFull(), 64 * b, w.head, w.r0, w.batch);
    }
    for (int b = 0; b < kVBlocks; ++b) {
      TmaLoad4d(sm.d_o + b * DOTile::kBlockBytes, do_map, sm.QFull(), 64 * b, w.head, w.r0, w.batch);
    }
  }
  RingPosition<Tile::kStages> ring;
  uint32_t tail_parity = 0;
  for (int nb = w.tiles.begin; nb < w.tiles.end; ++nb) {
    const int c0 = nb * kN, s = ring.stage;
    const bool ragged_tail = w.pol.kv_valid < kv_len && c0 + kN > w.pol.kv_valid;
    if (lane == 0) {
      MBarrier::Wait(sm.Empty(s), ring.parity ^ 1);
      // A ragged tail's copies land on the tail barrier; the stage's full
      // barriers complete once its padding rows are zeroed.
      const uint32_t k_bar = ragged_tail ? sm.Tail() : sm.KFull(s);
      const uint32_t v_bar = ragged_tail ? sm.Tail() : sm.VFull(s);
      if (ragged_tail) {
        MBarrier::ArriveExpectBytes(sm.Tail(), KVTile::kBytes + VTile::kBytes);
      } else {
        MBarrier::ArriveExpectBytes(k_bar, KVTile::kBytes);
        MBarrier::ArriveExpectBytes(v_bar, VTile::kBytes);
      }
      for (int b = 0; b < kBlocks; ++b) {  // K first: S reads it first
        TmaLoad4d(sm.K(s) + b * KVTile::kBlockBytes, k_map, k_bar, 64 * b, kv_head, c0, w.batch);
      }
      for (int b = 0; b < kVBlocks; ++b) {
        TmaLoad4d(sm.V(s) + b * VTile::kBlockBytes, v_map, v_bar, 64 * b, kv_head, c0, w.batch);
      }
    }
    if (ragged_tail) {  // padding keys: zero their K and V rows
      __syncwarp();
      MBarrier::Wait(sm.Tail(), tail_parity);
      tail_parity ^= 1;
      ZeroTileRows<KVTile>(sm.K(s), w.pol.kv_valid - c0, lane);
      ZeroTileRows<VTile>(sm.V(s), w.pol.kv_valid - c0, lane);
      FenceSharedForAsyncProxy();
      __syncwarp();
      if (lane == 0) {
        MBarrier::Arrive(sm.KFull(s));
        MBarrier::Arrive(sm.VFull(s));
      }
    }
    ring.Advance();
  }
}

// ------------------------------------------------------------------ epilogue
// A consumer's end: dQ of its 64 rows (times the scale; zeros for padding
// rows) staged in its rows of the Q tile, in the swizzled layout the Q map
// loads, and stored with the TMA, as the key-split passes store dK and dV
// (StoreKeyGradsByTma, bwd_ws_roles.cuh). Only this consumer's products read
// those rows, and they are done; but the producer's copy into them must have
// landed, which a consumer without a step of its own never waited for.
// Entries a NaN reached are recomputed exactly first, as tc::StoreQueryGrad
// does.
template <typename T, typename Tile, int kDT>
__device__ __forceinline__ void StoreQueryGradByTma(const BwdParams& p, const WsDqSmem<Tile>& sm,
                                                    const tc::FwdBlock<T>& w, float (&dq)[kDT][4], int consumer,
                                                    const CUtensorMap& dq_map) {
  using QTile = typename Tile::QTile;
  static_assert(kDT * 8 == Tile::kD, "whole rows of dQ");
  const AttentionShape& sh = p.shape;
  const int tid = threadIdx.x - 128 * (consumer + 1), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  if (w.tiles.begin < w.tiles.end) MBarrier::Wait(sm.QFull(), 0);  // no key tile: Q was never loaded
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = consumer * 64 + warp * 16 + g + half * 8;
    const int q_row = w.r0 + row;
    const bool real = q_row < w.pol.q_valid;
    if (real && q_row < sh.q_len && tc::LaneHasNan(dq, half)) {
      tc::ExactQueryGradLane<T, kDT, (Tile::kDv != Tile::kD)>(p, w.batch, w.head, q_row, t, dq, half);
    }
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const uint32_t value =
          real ? tc::ElemTraits<T>::Pack(dq[dt][2 * half] * p.scale, dq[dt][2 * half + 1] * p.scale) : 0u;
      StoreShared32(sm.q + PairOffset<QTile>(row, dt, t), value);
    }
  }
  __syncwarp();
  FenceSharedForAsyncProxy();  // the staged rows, for the copy engine
  NamedBarrierSync(Tile::kQueryGradBarrier + consumer, 128);
  const int first_row = w.r0 + consumer * 64;
  if (tid == 0 && first_row < sh.q_len) {  // rows past q_len (and columns past head_dim) are clipped by the map
#pragma unroll
    for (int b = 0; b < QTile::kBlocks; ++b) {
      TmaStore4d(dq_map, sm.q + b * QTile::kBlockBytes + consumer * 64 * 128, 64 * b, w.head, first_row, w.batch);
    }
    TmaStoreCommit();
    TmaStoreWait<0>();  // complete (and the tile read) before the CTA retires
  }
}

// ------------------------------------------------------------------ consumer
template <typename T, typename Tile>
__device__ __forceinline__ void WsDqConsumer(const BwdParams& p, const WsDqSmem<Tile>& sm, const tc::GridTile& at,
                                             int consumer, const CUtensorMap& dq_map) {
  consumer = WarpUniform(consumer);
  constexpr int kD = Tile::kD, kM = Tile::kM, kN = Tile::kN;
  constexpr int kNT = kN / 8, kDT = kD / 8;
  using QTile = typename Tile::QTile;
  using KVTile = typename Tile::KVTile;
  const int tid = threadIdx.x - 128 * (consumer + 1);  // within the warpgroup
  const int lane = tid & 31;
  const int warp_row0 = consumer * 64 + (tid >> 5) * 16;  // this warp's rows in the CTA tile
  const tc::FwdBlock<T> w = tc::FwdBlock<T>::template At<kM, kN>(p, at.tile, at.y, at.z);
  const MaskPolicy& pol = w.pol;
  const float scale_log2 = p.scale * tc::kLog2e;

  tc::RowStats rows;
  rows.Load(p, pol, w.batch, w.head, w.r0 + warp_row0, lane);
  float dq[kDT][4];
  tc::Zero(dq);

  if (w.tiles.begin < w.tiles.end) {
    // The key tiles this warpgroup's rows see, within the CTA's (which the
    // producer loads for both); empty for rows past the batch element's.
    const int own_r0 = w.r0 + consumer * 64;
    const int own_end = MinInt(own_r0 + 64, w.r_end);
    const tc::KeyTiles own = tc::KeyTileRange<kN>(pol, own_r0, own_end);
    // This warpgroup's 64 rows of Q and dO, as A operands.
    const uint32_t sQ_rows = WarpUniform(sm.q + consumer * 64 * 128);
    const uint32_t sdO_rows = WarpUniform(sm.d_o + consumer * 64 * 128);

    RingPosition<Tile::kStages> ring;
    // A stage is free once every consumer warp is done with it: one arrival
    // a warp.
    auto release = [&](int stage) {
      __syncwarp();
      if (lane == 0) MBarrier::Arrive(sm.Empty(stage));
    };
    // A stage the rows do not see is still waited for before its release:
    // arriving early would count towards the barrier's previous phase.
    auto pass_over = [&] {
      MBarrier::Wait(sm.KFull(ring.stage), ring.parity);
      MBarrier::Wait(sm.VFull(ring.stage), ring.parity);
      release(ring.stage);
      ring.Advance();
    };
    int nb = w.tiles.begin;
#pragma unroll 1
    for (; nb < own.begin; ++nb) pass_over();

    if (own.begin < own.end) {
      MBarrier::Wait(sm.QFull(), 0);
      uint32_t da[kN / 16][4];  // dS of the previous step, the A operand of its dQ product
      // Step nb: S and dP, then (kPrev) the previous step's dQ; P, dS. Every
      // product is issued right after its fence, in one basic block with
      // the waits before it (otherwise ptxas serialises the wgmma: C7520).
      auto step = [&](int nb, auto with_prev) {
        constexpr bool kPrev = decltype(with_prev)::value;
        const RingPosition<Tile::kStages> prev = ring.Previous();
        MBarrier::Wait(sm.KFull(ring.stage), ring.parity);
        MBarrier::Wait(sm.VFull(ring.stage), ring.parity);
        float s[kNT][4], dp[kNT][4];
        WgmmaFence();
        ProductSS<T, QTile, KVTile, kD, kN>(s, sQ_rows, sm.K(ring.stage));
        WgmmaCommit();
        ProductSS<T, typename Tile::DOTile, typename Tile::VTile, Tile::kDv, kN>(dp, sdO_rows, sm.V(ring.stage));
        WgmmaCommit();
        if constexpr (kPrev) {
          ProductRS<T, KVTile, kN, kD>(dq, da, sm.K(prev.stage), 0);
          WgmmaCommit();
        }
        WgmmaWait<kPrev ? 2 : 1>();  // S
        FenceAccumulator(s);
        const int c0 = nb * kN;
        const bool full = pol.TileIsFull(own_r0, own_r0 + 64, c0, c0 + kN);
        const tc::AlibiBias alibi = tc::AlibiBias::Of<Tile::kTakesAlibi>(p, pol, w.batch, w.head);
        tc::QueryMajorProbs(s, rows, pol, full, w.r0 + warp_row0, c0, lane, scale_log2,
                            tc::SoftCap::Of<Tile::kTakesSoftCap>(p), alibi);
        WgmmaWait<kPrev ? 1 : 0>();  // dP
        FenceAccumulator(dp);
        tc::QueryMajorDs(s, dp, rows, tc::SoftCap::Of<Tile::kTakesSoftCap>(p), alibi, {w.r0 + warp_row0, c0}, lane);
        if constexpr (kPrev) {
          WgmmaWait<0>();  // the previous dQ: its stage is read
          FenceAccumulator(dq);
          release(prev.stage);
        }
        tc::PackAFragments<T>(dp, da);
        ring.Advance();
      };
      step(nb++, std::false_type{});
#pragma unroll 1
      for (; nb < own.end; ++nb) step(nb, std::true_type{});
      // The last step's dQ.
      const RingPosition<Tile::kStages> prev = ring.Previous();
      WgmmaFence();
      ProductRS<T, KVTile, kN, kD>(dq, da, sm.K(prev.stage), 0);
      WgmmaCommit();
      WgmmaWait<0>();
      FenceAccumulator(dq);
      release(prev.stage);
    }
#pragma unroll 1
    for (; nb < w.tiles.end; ++nb) pass_over();
  }

  StoreQueryGradByTma<T, Tile>(p, sm, w, dq, consumer, dq_map);
}

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    WsDqKernel(const __grid_constant__ BwdParams p, const __grid_constant__ CUtensorMap q_map,
               const __grid_constant__ CUtensorMap do_map, const __grid_constant__ CUtensorMap k_map,
               const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dq_map) {
#if defined(JAXFLASH_SM90A)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const auto sm = WsDqSmem<Tile>::At((tc::SmemAddr(smem_raw) + 1023u) & ~1023u);
  if (threadIdx.x == 0) sm.InitBarriers();
  __syncthreads();
  const tc::GridTile at = tc::OrderedGridTile<tc::HeavyTiles::kLast>(p);
  RunRoles<Tile::kProducerRegs, Tile::kConsumerRegs>(
      [&](int warp) {
        if (warp == 0) WsDqProducer<T, Tile>(p, sm, at, q_map, do_map, k_map, v_map);
      },
      [&](int consumer) { WsDqConsumer<T, Tile>(p, sm, at, consumer, dq_map); });
#endif  // JAXFLASH_SM90A
}

// Checks the launch limits, encodes the tensor maps and launches the pass
// over (query tiles, heads, batch); the caller runs it only when q_len > 0.
template <typename T, typename Tile>
Status RunWsDqPass(const BwdParams& p, cudaStream_t stream) {
  const AttentionShape& sh = p.shape;
  if (CeilDiv(sh.q_len, Tile::kM) > INT_MAX || sh.q_heads > 65535 || sh.batch > 65535) {
    return Status::Unimplemented("backward grid beyond the launch limits");
  }
  AttentionShape maps_shape = sh;
  maps_shape.kv_len = sh.kv_len > 0 ? sh.kv_len : 1;  // a map needs a non-empty extent; no key is read then
  CUtensorMap q_map, do_map, k_map, v_map, dq_map;
  Status st;
  if (!(st = EncodeRowsMap(&q_map, p.q, p.dtype, maps_shape, true, Tile::kM)).ok() ||
      !(st = EncodeRowsMap(&dq_map, p.dq, p.dtype, maps_shape, true, 64)).ok() ||  // a consumer's rows a box
      !(st = EncodeRowsMap(&do_map, p.dout, p.dtype, maps_shape, true, Tile::kM, sh.v_dim())).ok() ||
      !(st = EncodeRowsMap(&k_map, p.k, p.dtype, maps_shape, false, Tile::kN)).ok() ||
      !(st = EncodeRowsMap(&v_map, p.v, p.dtype, maps_shape, false, Tile::kN, sh.v_dim())).ok()) {
    return st;
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(sh.q_len, Tile::kM)), static_cast<unsigned>(sh.q_heads),
                  static_cast<unsigned>(sh.batch));
  WsDqKernel<T, Tile><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p, q_map, do_map, k_map, v_map, dq_map);
  return CheckLaunch("attention backward (sm90, warp-specialised: dQ)");
}

}  // namespace sm90
}  // namespace jaxflash
