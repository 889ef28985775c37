// FlashAttention forward for Hopper at head dims 257-512 (one bucket, 512),
// warp-specialised, with O's columns split over two consumer warpgroups.
//
// O of 64 rows x 512 float columns is 256 registers a thread of one
// warpgroup: none holds it. Here a CTA works on one block of 64 query rows
// with two consumer warpgroups that each own half of the head dim:
//
//   producer   fwd_ws_kernel.cuh's (WsFwdProducer): Q once a work tile, K and
//              V tiles of 32 keys x 512 columns into a ring of two stages.
//   consumers  warpgroup c computes the partial scores of its 256 columns,
//              Q[:, c] · K[:, c]ᵀ, stores them in shared memory and adds the
//              other warpgroup's (one named barrier a step; two buffers by
//              step parity, so the next step's store never meets a read of
//              this one). a + b is b + a in floating point, so both hold the
//              same scores, run the same online softmax and get the same P;
//              each then adds P · V[:, c] into its own 256 columns of O.
//              S of step n overlaps P·V of step n - 1 on the tensor cores, as
//              in the other forwards (no ping-pong: the exchange keeps the two
//              warpgroups in step).
//   epilogue   each consumer stages its columns of O in the (now unread)
//              columns of Q's buffer it read and stores them with the TMA;
//              warpgroup 0 writes LSE.
//
// The FLOPs are the ideal ones (no score is computed twice); the softmax's
// exponentials are (each warpgroup runs it on the whole row block). Shared
// memory: Q 64 KiB, two stages of K and V 128 KiB, the exchange 32 KiB; most
// of S's A operand comes from registers instead (WideFwdTile::kQRegSteps:
// 2-3% on an H200, docs/performance-log.md).
// It takes the plain mask rule (causal, windows, lengths, offsets); segment
// ids, a soft-cap, ALiBi and dense terms run Pallas at these head dims
// (TakesWideForward, fwd_d512.cu).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <type_traits>

#include "sm90/fwd_ws_kernel.cuh"

namespace jaxflash {
namespace sm90 {

struct WideFwdTile {
  static constexpr bool kWarpSpecialised = true;
  static constexpr int kD = 512, kDv = 512;
  static constexpr int kHalf = kD / 2;  // the columns a consumer owns
  static constexpr int kN = 32;         // keys per K/V tile (two stages fit beside Q and the exchange)
  static constexpr int kStages = 2;
  static constexpr int kConsumers = 2;
  static constexpr int kM = 64;  // query rows: both consumers hold the same ones
  static constexpr int kQBuffers = 1;
  static constexpr bool kSeparateO = false;  // O staged in Q's buffer
  // What WsFwdProducer, WsFwdSmem and WsWalk ask of a tile: no dense bias,
  // segment ids or dynamic walk.
  static constexpr bool kTakesDense = false, kTakesSegments = false, kDynamicWalk = false;
  static constexpr int kRankedBlocks = 0;
  using QTile = SwizzledTile<kM, kD>;
  using KTile = SwizzledTile<kN, kD>;
  using VTile = SwizzledTile<kN, kDv>;
  using OTile = QTile;
  using BiasTile = SwizzledTile<kM, 64>;  // (never loaded: kTakesDense is false)
  static constexpr size_t kBiasStageBytes = 0;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // S's A operand: the first kQRegSteps of a consumer's 16 k steps from
  // registers (Q's fragments, loaded once a work tile), the rest from shared
  // memory, which every n32 product otherwise re-reads Q's 2 KiB for. ptxas
  // (sm_90a): 12 build without spills beside O's 128 registers, 14 spilled 4
  // bytes with 240 registers a consumer, 16 spilled and serialised the wgmma.
  static constexpr int kQRegSteps = 12;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = ConsumerRegisters(kConsumers + 1, kProducerRegs);
  static constexpr int kBarriers = WsFwdBarriers(kQBuffers, kStages);
  // The partial scores: a consumer's 64 x kN floats, per consumer and step
  // parity, after the barriers (WsFwdSmem::bars), 128-byte aligned.
  static constexpr uint32_t kExchangeOffset = (8 * kBarriers + 8 + 127) / 128 * 128;
  static constexpr uint32_t kExchangeBytes = kM * kN * 4;
  static constexpr size_t kSmemBytes = size_t(QTile::kBytes) + kStages * size_t(KTile::kBytes + VTile::kBytes) +
                                       kExchangeOffset + 2 * kConsumers * kExchangeBytes + 1024;
  static_assert(kSmemBytes <= kSm90SmemPerCta, "shared memory of one CTA");
  // Named barriers: the exchange (both consumers), then one per consumer's epilogue.
  static constexpr int kExchangeBarrier = 1;
  static constexpr int kEpilogueBarrier = 2;
};

// 16 bytes to and from shared memory (the exchange: a lane's four floats of an n8 tile).
__device__ __forceinline__ void StoreShared128(uint32_t addr, const float (&x)[4]) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(x[0]), "f"(x[1]), "f"(x[2]), "f"(x[3])
               : "memory");
}
__device__ __forceinline__ void AddShared128(uint32_t addr, float (&x)[4]) {
  float y[4];
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(y[0]), "=f"(y[1]), "=f"(y[2]), "=f"(y[3])
               : "r"(addr)
               : "memory");
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] += y[i];
}

template <typename T>
__device__ __forceinline__ void WideFwdConsumer(const FwdParams& p, const WsFwdSmem<WideFwdTile>& sm,
                                                const TileScheduler& sched, const CUtensorMap& o_map, int consumer) {
  using Tile = WideFwdTile;
  consumer = WarpUniform(consumer);
  constexpr int kN = Tile::kN, kHalf = Tile::kHalf, kNT = kN / 8, kHT = kHalf / 8;
  constexpr int kHalfBlocks = kHalf / 64;
  using QTile = typename Tile::QTile;
  using KTile = typename Tile::KTile;
  using VTile = typename Tile::VTile;
  using OTile = typename Tile::OTile;
  const int tid = threadIdx.x - 128 * (consumer + 1);  // within the warpgroup
  const int lane = tid & 31;
  const int warp_row0 = (tid >> 5) * 16;  // this warp's rows in the work tile (the same in both consumers)
  const float scale_log2 = p.scale * tc::kLog2e;
  const AttentionShape& sh = p.shape;
  // This consumer's column blocks of Q, K, V and the staged O, and the two
  // consumers' exchange buffers (this lane's 16 bytes of each n8 tile).
  const uint32_t own_block = consumer * kHalfBlocks;
  const uint32_t exchange = sm.bars + Tile::kExchangeOffset + tid * 16;
  const uint32_t mine = exchange + consumer * 2 * Tile::kExchangeBytes;
  const uint32_t theirs = exchange + (1 - consumer) * 2 * Tile::kExchangeBytes;
  uint32_t steps = 0;  // exchanges so far: the buffer's parity

  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) MBarrier::Arrive(bar);
  };
  // This consumer's partial scores out, the other's in: whole rows after.
  auto exchange_scores = [&](float (&s)[kNT][4]) __attribute__((always_inline)) {
    const uint32_t parity = (steps & 1) * Tile::kExchangeBytes;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) StoreShared128(mine + parity + nt * 128 * 16, s[nt]);
    NamedBarrierSync(Tile::kExchangeBarrier, 256);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) AddShared128(theirs + parity + nt * 128 * 16, s[nt]);
    ++steps;
  };

  RingPosition<Tile::kStages> ring;
  RingPosition<Tile::kQBuffers> q_ring;
  WsWalk<Tile, false> walk;
  WsWork next;
  bool more = walk.ConsumerNext(p, sched, 0, &next);
  while (more) {
    const WsWork w = next;
    const int r0 = w.r0;
    float o[1][kHT][4];
    tc::Zero(o[0]);
    tc::OnlineSoftmax<1> softmax;
    softmax.Init();
    float inv[2], lse[2];
    if (w.Empty()) {
      more = walk.ConsumerNext(p, sched, 0, &next);
      softmax.Totals(inv, lse);
    } else {
      const int qb = q_ring.stage;
      MBarrier::Wait(sm.QFull(qb), q_ring.parity);
      q_ring.Advance();
      float s[1][kNT][4];
      // The first kQRegSteps k steps of this warp's 16 rows of Q's half as A
      // fragments, held for the work tile (S's products then read those
      // columns of K alone from shared memory); the rest from shared memory.
      uint32_t qa[Tile::kQRegSteps][4];
      {
        const int row = warp_row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < Tile::kQRegSteps; ++kk) {
          tc::Ldmatrix4(qa[kk], sm.Q(qb) + QTile::ChunkOffset(row, (consumer * kHalf + kk * 16) / 8 + (lane >> 4)));
        }
      }
      const uint32_t sQ = sm.Q(qb) + own_block * QTile::kBlockBytes;
      auto scores = [&](float (&dst)[1][kNT][4], uint32_t k_tile) __attribute__((always_inline)) {
        auto& flat = reinterpret_cast<float(&)[kN / 2]>(dst[0]);
#pragma unroll
        for (int kk = 0; kk < kHalf / 16; ++kk) {
          if (kk < Tile::kQRegSteps) {
            Wgmma<T, kN>::RSK(flat, qa[kk < Tile::kQRegSteps ? kk : 0], KMajorDescriptor<KTile>(k_tile, kk), kk > 0);
          } else {
            Wgmma<T, kN>::SS(flat, KMajorDescriptor<QTile>(tc::Unhoisted(sQ), kk), KMajorDescriptor<KTile>(k_tile, kk),
                             kk > 0);
          }
        }
      };
      auto own_k = [&](const RingPosition<Tile::kStages>& at) { return sm.K(at.stage) + own_block * KTile::kBlockBytes; };
      uint32_t pa[kN / 16][4];
      // Masks (if kMasked) and folds S_n into the softmax state; whether O
      // must be rescaled (by alpha). A positive scale rides in the exponent.
      auto softmax_step = [&](int nb, auto masked, float (&alpha)[2]) __attribute__((always_inline)) {
        constexpr bool kMasked = decltype(masked)::value;
        const int c0 = nb * kN;
        if (scale_log2 > 0.f) {
          if constexpr (kMasked) tc::MaskScores(s, w.pol, r0, warp_row0, c0, lane);
          return softmax.Scores<true>(s, alpha, scale_log2);
        }
        tc::ScaleAndMask(s, w.pol, !kMasked, r0, warp_row0, c0, lane, scale_log2);
        return softmax.Scores<true>(s, alpha);
      };
      // All mbarrier waits come before the products' fence (a wait loop among
      // wgmma in flight serialises them: fwd_ws_kernel.cuh).
      float alpha[2];
      int nb = w.keys.begin;
      const tc::KeyTiles full = tc::FullKeyTiles<kN>(w.pol, r0, w.r_end, w.keys);
      MBarrier::Wait(sm.KFull(ring.stage), ring.parity);
      WgmmaFence();
      scores(s, own_k(ring));
      WgmmaCommit();
      WgmmaWait<0>();
      FenceAccumulator(s[0]);
      release(sm.KEmpty(ring.stage));
      exchange_scores(s[0]);
      if (full.begin == nb && full.end > nb) {
        softmax_step(nb, std::false_type{}, alpha);
      } else {
        softmax_step(nb, std::true_type{}, alpha);
      }
      tc::PackAFragments<T>(s[0], pa);
      ring.Advance();
      ++nb;
      // Steady state: S_n (this consumer's half, then the exchange) and
      // O += P_{n-1}·V_{n-1}; the softmax of S_n runs while P·V is on the
      // tensor cores.
      auto steady_step = [&](int nb, auto masked) {
        const RingPosition<Tile::kStages> prev = ring.Previous();
        MBarrier::Wait(sm.KFull(ring.stage), ring.parity);
        MBarrier::Wait(sm.VFull(prev.stage), prev.parity);
        WgmmaFence();
        scores(s, own_k(ring));
        WgmmaCommit();
        ProductRS<T, VTile, kN, kHalf>(o[0], pa, sm.V(prev.stage), consumer * kHalf);
        WgmmaCommit();
        WgmmaWait<1>();  // S is done; P·V may still run
        FenceAccumulator(s[0]);
        release(sm.KEmpty(ring.stage));
        exchange_scores(s[0]);
        const bool moved = softmax_step(nb, masked, alpha);
        WgmmaWait<0>();
        FenceAccumulator(o[0]);
        release(sm.VEmpty(prev.stage));
        if (moved) softmax.Rescale(o, alpha);
        tc::PackAFragments<T>(s[0], pa);
        ring.Advance();
      };
      for (; nb < MinInt(full.begin, w.keys.end); ++nb) steady_step(nb, std::true_type{});
      for (; nb < full.end; ++nb) steady_step(nb, std::false_type{});
      for (; nb < w.keys.end; ++nb) steady_step(nb, std::true_type{});
      // The last tile's P·V.
      const RingPosition<Tile::kStages> prev = ring.Previous();
      MBarrier::Wait(sm.VFull(prev.stage), prev.parity);
      WgmmaFence();
      ProductRS<T, VTile, kN, kHalf>(o[0], pa, sm.V(prev.stage), consumer * kHalf);
      WgmmaCommit();
      more = walk.ConsumerNext(p, sched, 0, &next);
      softmax.Totals(inv, lse);
      WgmmaWait<0>();
      FenceAccumulator(o[0]);
      release(sm.VEmpty(prev.stage));
    }

    // ---- epilogue
    const int g = lane >> 2, t = lane & 3;
    softmax.Rescale(o, inv);
    const unsigned redo = tc::FinishRows(o, lse, w.pol, r0 + warp_row0, lane);
    if (consumer == 0) {
      float* gLse = p.lse + (int64_t(w.tile.batch) * sh.q_heads + w.tile.head) * sh.q_len;
      for (int half = 0; half < 2; ++half) {
        const int row = r0 + warp_row0 + g + half * 8;
        if (t == 0 && row < sh.q_len) gLse[row] = lse[half];
      }
    }
    if (w.Empty()) {
      // No Q was loaded and the buffer may be in flight for the next tile:
      // this consumer's columns of zeros straight to global memory.
      T* gO = static_cast<T*>(p.o) + tc::FwdBlock<T>::QOffset(sh, w.tile.batch, w.tile.head, r0);
      const int o_dim = static_cast<int>(sh.head_dim);
      for (int i = tc::Unhoisted(tid); i < 64 * kHalf / 8; i += 128) {
        const int row = i / (kHalf / 8), col = consumer * kHalf + (i % (kHalf / 8)) * 8;
        if (r0 + row < sh.q_len && col < o_dim) {
          *reinterpret_cast<uint4*>(gO + int64_t(row) * sh.q_row_stride() + col) = make_uint4(0, 0, 0, 0);
        }
      }
      continue;
    }
    // Stage this consumer's columns of O where it read Q's (its last Q·Kᵀ is done).
    for (int half = 0; half < 2; ++half) {
      const int row = tc::Unhoisted(warp_row0 + g + half * 8);
#pragma unroll
      for (int dt = 0; dt < kHT; ++dt) {
        const uint32_t value = tc::ElemTraits<T>::Pack(o[0][dt][2 * half], o[0][dt][2 * half + 1]);
        StoreShared32(sm.o + PairOffset<OTile>(row, consumer * kHT + dt, t), value);
      }
    }
    // Entries FinishRows flagged (a NaN a masked pair let in) are recomputed
    // into the staged tile.
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      if (!(redo >> half & 1u)) continue;
      const int row = warp_row0 + g + half * 8;
      tc::ExactOutputLane<T, kHT, false>(
          p, w.tile.batch, w.tile.head, r0 + row, lse[half], t,
          [&](int dt, float2 x) {
            StoreShared32(sm.o + PairOffset<OTile>(row, consumer * kHT + dt, t), tc::ElemTraits<T>::Pack(x.x, x.y));
          },
          consumer * kHalf);
    }
    __syncwarp();
    FenceSharedForAsyncProxy();
    NamedBarrierSync(Tile::kEpilogueBarrier + consumer, 128);
    if (tid == 0) {
      if (r0 < sh.q_len) {
        for (int b = 0; b < kHalfBlocks; ++b) {
          TmaStore4d(o_map, sm.o + (own_block + b) * OTile::kBlockBytes, 64 * (own_block + b), w.tile.head, r0,
                     w.tile.batch);
        }
        TmaStoreCommit();
        TmaStoreWaitRead<0>();
      }
      MBarrier::Arrive(sm.QEmpty(0));
    }
  }
  if (tid == 0) TmaStoreWait<0>();
}

template <typename T>
__global__ void __launch_bounds__(WideFwdTile::kThreads, 1)
    WideFwdKernel(const __grid_constant__ FwdParams p, const __grid_constant__ CUtensorMap q_map,
                  const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                  const __grid_constant__ CUtensorMap o_map) {
#if defined(JAXFLASH_SM90A)
  using Tile = WideFwdTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const auto sm = WsFwdSmem<Tile>::At((tc::SmemAddr(smem_raw) + 1023u) & ~1023u);
  if (threadIdx.x == 0) sm.InitBarriers();
  __syncthreads();
  const TileScheduler sched = TileScheduler::For(p.shape, p.mask, Tile::kM, gridDim.x, sizeof(T), false, false);
  RunRoles<Tile::kProducerRegs, Tile::kConsumerRegs>(
      [&](int warp) {
        // (The bias map is never read: the tile takes no dense term.)
        if (warp == 0) WsFwdProducer<Tile, false>(p, sm, sched, WorkClaims{0}, q_map, k_map, v_map, q_map);
      },
      [&](int consumer) __attribute__((always_inline)) {
        WideFwdConsumer<T>(p, sm, sched, o_map, consumer);
      });
#endif  // JAXFLASH_SM90A
}

template <typename T>
Status LaunchWideForward(const FwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  using Tile = WideFwdTile;
  Status st = EnsureDynamicSmem<WideFwdKernel<T>>(Tile::kSmemBytes, device);
  if (!st.ok()) return st;
  const AttentionShape& sh = p.shape;
  if (sh.q_len == 0 || sh.batch == 0 || sh.q_heads == 0) return Status::Ok();
  const int64_t tiles = TileScheduler::Tiles(sh, Tile::kM);
  if (tiles > INT_MAX / 2 - device.sm_count) return Status::Unimplemented("more than 2^30 work tiles");
  AttentionShape maps_shape = sh;
  maps_shape.kv_len = sh.kv_len > 0 ? sh.kv_len : 1;  // a map needs a non-empty extent; no key is read then
  CUtensorMap q_map, k_map, v_map, o_map;
  if (!(st = EncodeRowsMap(&q_map, p.q, p.dtype, maps_shape, true, Tile::kM)).ok() ||
      !(st = EncodeRowsMap(&k_map, p.k, p.dtype, maps_shape, false, Tile::kN)).ok() ||
      !(st = EncodeRowsMap(&v_map, p.v, p.dtype, maps_shape, false, Tile::kN)).ok() ||
      !(st = EncodeRowsMap(&o_map, p.o, p.dtype, maps_shape, true, 64)).ok()) {
    return st;
  }
  const int grid = tiles < device.sm_count ? static_cast<int>(tiles) : device.sm_count;
  WideFwdKernel<T><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p, q_map, k_map, v_map, o_map);
  return CheckLaunch("attention forward (sm90, head dims past 256)");
}

}  // namespace sm90
}  // namespace jaxflash
