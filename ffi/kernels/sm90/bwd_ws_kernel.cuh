// The fused FlashAttention backward for Hopper (sm_90a), warp-specialised.
//
// One CTA per (key tile of kN keys, kv head, batch): it keeps dK and dV of
// its keys in registers while it walks the query tiles of every head of the
// GQA group that see them, and adds each step's dQ = dS·K into the float32
// sums (BwdParams::dq_accum) that DqFromSumsKernel converts afterwards
// (common/bwd_blocks.cuh). The roles, as in the forward (fwd_ws_kernel.cuh;
// the producer, the writer and the shared-memory layout: bwd_ws_roles.cuh):
//
//   producer   warp 0 copies K and V once and then, per step, Q and dO of kM
//              query rows through the TMA into a ring of kStages stages, with
//              the rows' LSE and delta; it zeroes padding rows (of a ragged
//              batch element) before the consumers see a stage.
//   consumers  kConsumers warpgroups of 64 keys each (at D = 256 two that
//              share 64 keys and split the columns: bwd_ws_columns.cuh). Per step:
//                Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ; Pᵀ while dPᵀ runs; dSᵀ;
//                dV += Pᵀ·dO, dK += dSᵀ·Q;
//              dSᵀ goes transposed into a shared dS tile (two buffers, so no
//              warpgroup waits for the other to finish reading one), and
//              once every consumer's keys are in it (one named barrier),
//              dQ = dS·K over all kN keys goes into a float32 staging tile:
//              at D ≥ 128 consumer c computes columns [64c, 64c + 64); at
//              D = 64 (one 64-column block) the consumers take whole steps in
//              turn, and the other one only arrives at the barrier. At the
//              end each stages its dK and dV in its rows of the K and V tiles
//              and stores them with the TMA (StoreKeyGradsByTma; the column
//              consumers their columns of all 64 keys).
//   dQ writer  lane 0 of warp 1 adds the staging tile into the sums with
//              one bulk tensor reduction per 32-column block (the copy engine
//              does the float32 adds; no atomic instruction on the consumers'
//              path) and frees it for the next step.
//   flag writer  lane 0 of warp 2 (where Tile::kFlagWriter) asks ahead
//              whether each step's tile needs its mask and puts the answer in
//              the stage beside LSE and delta (StepIsFull).
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
#include <type_traits>

#include "common/bwd_blocks.cuh"
#include "common/fwd_blocks.cuh"
#include "common/grid_order.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "jaxflash/params.h"
#include "sm90/barrier.cuh"
#include "sm90/bwd_steps.cuh"
#include "sm90/bwd_ws_columns.cuh"
#include "sm90/bwd_ws_roles.cuh"
#include "sm90/tensor_map.h"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

// kWithDq = false: dK and dV only (the deterministic backward's first pass,
// before the dQ kernel): no dS tile, no dQ staging, no writer. kForCap: the
// tile for calls with a logit soft-cap (no early dV, which frees registers).
// kDense: the tile for calls with a staged bias (kTakesDense, below).
template <int kD_, int kConsumers_ = 2, int kM_ = 64, int kStages_ = 2, bool kWithDq_ = true, bool kForCap_ = false,
          bool kDense_ = false>
struct WsBwdTile {
  // A dense tile adds a 16-bit bias that the producer stages beside each
  // step's Q and dO (BiasTile: the step's kM rows x the CTA's keys, one TMA
  // box a consumer; StagedBiasKeyMajor) and takes no mask, soft-cap,
  // segment ids or ALiBi (LaunchBackward sends it only biases
  // DenseTile::Stages allows, as the forward's dense tile). Where the caller
  // asks for dB (BwdParams::ds_out), the dQ writer puts each step's dS tile,
  // which the consumers put in shared memory for dQ anyway, into dB with the
  // TMA: the bias's gradient with no pass of its own. At D 128 its stage's
  // third box takes the room of the second dQ buffer (kDqBuffers).
  static constexpr bool kTakesDense = kDense_;
  static constexpr bool kSharedKeys = false;  // each consumer owns 64 keys (bwd_ws_columns.cuh: they share them)
  // Whether the tile applies a logit soft-cap (score_mod.cuh): the D 64 and
  // 128 dK/dV passes without dQ, the fused D 64 pass of two consumers
  // (capped D 64 calls run it: FusedBwdTile<64>::capped) and a kForCap tile,
  // the fused D 128 pass without the early dV (with it the cap's code
  // spilled 24 bytes). Capped calls without such a tile take the pass
  // without dQ, then the dQ pass (LaunchBackward).
  static constexpr bool kTakesSoftCap =
      !kDense_ && kD_ <= 128 && (!kWithDq_ || (kD_ == 64 && kConsumers_ == 2) || kForCap_);
  // Whether a capped step keeps its tanh for the slope (score_mod.cuh's
  // KeptTanh: 16 registers more, one special-function op a score fewer).
  static constexpr bool kKeepsTanh = kTakesSoftCap && kD_ == 64;  // (the D 128 pass spilled 32 bytes with it)
  static constexpr bool kTakesSegments = !kDense_;
  static constexpr bool kTakesAlibi = !kDense_ && !(kD_ == 128 && !kWithDq_);  // that pass spilled 8 bytes with it
  static constexpr bool kWithDq = kWithDq_;
  static constexpr bool kStagedDq = kWithDq;  // dQ through the staging tile and the writer warp
  // Whether a warp asks each step's mask ahead (WsBwdFlagWriter), else each
  // consumer asks it under its products: the D 128 dK/dV pass's consumers
  // spilled 32 bytes beside the writer.
  static constexpr bool kFlagWriter = !(kD_ == 128 && !kWithDq_);
  // Whether the producer stores each stage's LSE in log2 units
  // (WsBwdStage::lse), which spares each consumer thread 16 multiplies a step
  // at kM = 64 (the same products, made once): D 64's producers spilled 4
  // bytes of their 24 registers with the multiply.
  static constexpr bool kLseLog2 = kD_ != 64;
  static constexpr int kD = kD_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kM = kM_;                // query rows per step
  static constexpr int kN = 64 * kConsumers;    // keys per CTA
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // The deterministic pass of this tile (two consumers: with three, the pass
  // without dQ spills 4 bytes at D 64).
  using WithoutDq = WsBwdTile<kD, 2, kM, kStages, false>;
  // dQ of a step: split in 64-column blocks over the consumers, or (one
  // block) computed whole by consumer `step % kConsumers`.
  static constexpr bool kDqByColumns = kD / kConsumers >= 64;
  static constexpr int kDqCols = kDqByColumns ? kD / kConsumers : kD;  // dQ columns per computing consumer
  static constexpr int kDqWriters = kDqByColumns ? kConsumers : 1;     // consumers staging each step
  using QTile = SwizzledTile<kM, kD>;
  using KVTile = SwizzledTile<kN, kD>;
  static constexpr int kDv = kD;  // one head dim (the column tiles take v's own)
  using KTile = KVTile;
  using VTile = KVTile;
  using DOTile = QTile;
  using DsTile = SwizzledTile<kM, kN>;
  using BiasTile = SwizzledTile<kM, kN>;  // queries x keys, as dS
  static constexpr size_t kBiasBytes = kDense_ ? BiasTile::kBytes : 0;  // a stage's
  // dQ staging: kM rows of kD floats in 128-byte-swizzled blocks of 32
  // columns (SwizzledTile counts 16-bit columns), each the box of one bulk
  // tensor reduction. One reduction per 512-byte row instead (64 per step)
  // kept the consumers waiting for the copy engine 16% of the time
  // (docs/performance.md, eleventh session).
  using DqStage = SwizzledTile<kM, 2 * kD>;
  // Two staging buffers, taken by turns: a step waits for the copy engine to
  // have read the tile of two steps before, not of the step before (with one,
  // the dQ writer's DqEmpty wait was 2.8% of the fused D 128 kernel's stall
  // samples). The D 128 dense tile's third stage box takes the second
  // buffer's room; D 64's three-consumer tile (208 KiB) keeps both.
  static constexpr int kDqBuffers = kWithDq && !(kDense_ && kD_ == 128) ? 2 : 1;
  static constexpr size_t kDqBytes = kWithDq ? kDqBuffers * DqStage::kBytes : 0;
  static constexpr size_t kDsBytes = kWithDq ? 2 * size_t(DsTile::kBytes) : 0;  // two buffers
  // Barriers: K/V full, K/V tail, Q tail, dQ full and dQ empty per dQ
  // buffer, then per stage full and empty.
  static constexpr int kBarriers = 3 + 2 * kDqBuffers + 2 * kStages;
  static_assert(kM == 64, "dQ = dS·K is one wgmma row block");
  static_assert(kDqCols == 64, "a consumer's dQ columns are one 64-column block of K (32 registers)");
  // Registers once the producer warpgroup has handed its surplus over: all
  // but 24 a thread with two consumers (the producer and the dQ writer fit
  // in 24 since they count their steps' heads and rows, WsBwdWork::Steps, and
  // ZeroTileRows does not divide).
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = ConsumerRegisters(kConsumers + 1, kProducerRegs);  // 240, 160
  // dV += Pᵀ·dO issued as soon as Pᵀ is packed, so it runs under dSᵀ and its
  // store: Pᵀ packed and in float32, dPᵀ, dK and dV are then live together,
  // which needs 240 registers (at 232 ptxas spilled 16 bytes and serialised
  // the products; with three consumers' 160 it spills). A kForCap tile gives
  // it up for the cap's registers.
  static constexpr bool kEarlyDv = kConsumers == 2 && !kForCap_;
  // The dQ staging stores take one wavefront per half-warp when lanes t = 2,
  // 3 write their blocks in flipped order; the flip's selects need registers
  // that three consumers (160 each) do not have, so they take two.
  static constexpr bool kFlipStaging = kConsumers == 2;
  // Named: every consumer's dS of a step is in place. Consumers taking turns
  // alternate two, so one that only arrives and runs a step ahead cannot
  // complete its partner's wait on the same barrier (with two stages no
  // consumer gets two steps ahead: a stage is refilled only once every
  // consumer has released it).
  static constexpr int kDsBarrier = 1;
  static constexpr int kDsBarriers = kDqByColumns ? 1 : 2;
  // Named, at the end (StoreKeyGradsByTma): every consumer is done with K and
  // V (with dQ only: without it each reads only its own rows); then each
  // consumer's staged dK and dV are in place (one a consumer).
  static constexpr int kKeysFreeBarrier = kDsBarrier + kDsBarriers;
  static constexpr int kKeyGradsBarrier = kKeysFreeBarrier + 1;
  static_assert(kKeyGradsBarrier + kConsumers <= 16, "named barriers 1-15");
};

// ------------------------------------------------------------------ consumer
template <typename T, typename Tile>
__device__ __forceinline__ void WsBwdConsumer(const BwdParams& p, const WsBwdSmem<Tile>& sm,
                                              const WsBwdWork<Tile>& w, float* stats_base, int consumer,
                                              const CUtensorMap& dk_map, const CUtensorMap& dv_map) {
  constexpr int kD = Tile::kD, kN = Tile::kN, kM = Tile::kM;
  constexpr int kQT = kM / 8, kDT = kD / 8, kDqCols = Tile::kDqCols;
  using QTile = typename Tile::QTile;
  using KVTile = typename Tile::KVTile;
  using DsTile = typename Tile::DsTile;
  using DqStage = typename Tile::DqStage;
  const int tid = threadIdx.x - 128 * (consumer + 1);  // within the warpgroup
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int key_w = consumer * 64 + warp * 16;  // this warp's first key within the CTA's tile
  // This warpgroup's 64 keys of K and V, as A operands. (Every operand
  // address is WarpUniform; the consumer index itself is not, since marked
  // it moves more of the loop's values into registers and the pass spills.)
  const uint32_t sK_rows = WarpUniform(sm.k + consumer * 64 * 128);
  const uint32_t sV_rows = WarpUniform(sm.v + consumer * 64 * 128);
  const float scale_log2 = p.scale * tc::kLog2e;

  float dk[kDT][4], dv[kDT][4];
  StartKeyGrads(sm, w, dk, dv);

  RingPosition<Tile::kStages> ring;
  auto step = w.FirstStep();
  for (int it = 0; it < w.steps; ++it, step.Next()) {
    const WsBwdStage in = WaitForStage(sm, step, stats_base, ring);

    // ---- Sᵀ, dPᵀ; Pᵀ while dPᵀ runs, then dSᵀ, dV += Pᵀ dO issued before
    // dSᵀ (kEarlyDv) or after its store. Without the early dV, Pᵀ is packed
    // only once dSᵀ is done, so Pᵀ in float32 and packed are never live
    // together (at the peak dK, dV, Pᵀ, dPᵀ: 192 registers).
    float st[kQT][4], dp[kQT][4];
    // Two-consumer tiles (the fused pass at D 128 and the capped one at D 64,
    // the dK/dV pass of the two kernels at D 64 and 128) read the step's LSE
    // before the products are issued: the fused D 128 pass 1.5% faster
    // (twenty-fourth session); the three-consumer D 64 tile, at 160
    // registers a thread, was not measured.
    constexpr bool kLseFirst = Tile::kConsumers == 2;
    const tc::AlibiBias alibi = tc::AlibiBias::Of<Tile::kTakesAlibi>(p, w.pol, w.Batch(), step.head);
    std::conditional_t<Tile::kKeepsTanh, tc::KeptTanh<kM / 8>, tc::NoKeptTanh> kept;
    // A dense tile's bias: this consumer's box of the stage (its 64 keys).
    std::conditional_t<Tile::kTakesDense, StagedBiasKeyMajor, NoStagedBias> bias;
    if constexpr (Tile::kTakesDense) {
      bias = {WarpUniform(sm.Bias(ring.stage) + consumer * Tile::BiasTile::kBlockBytes), warp, lane,
              __fdividef(1.f, p.scale), p.dense.bias.dtype == DType::kFloat16};  // (scale > 0: TakesDenseBackward)
    }
    KeyMajorScores<T, KVTile, QTile, kD, kM, kLseFirst, Tile::kLseLog2>(
        st, dp, sK_rows, sV_rows, in.q, in.d_o, w.pol, in.r0, w.C0() + key_w, [&] { return StepIsFull(w, in); },
        in.lse, lane, scale_log2, tc::SoftCap::Of<Tile::kTakesSoftCap>(p), alibi, kept,
        bias);
    uint32_t pa[kM / 16][4], da[kM / 16][4];
    auto issue_dv = [&] {
      tc::PackAFragments<T>(st, pa);
      WgmmaFence();
      ProductRS<T, QTile, kM, kD>(dv, pa, in.d_o, 0);
      WgmmaCommit();
    };
    if constexpr (Tile::kEarlyDv) {
      issue_dv();
      WgmmaWait<1>();  // dPᵀ; dV runs on
    } else {
      WgmmaWait<0>();
    }
    FenceAccumulator(dp);
    tc::KeyMajorDs<Tile::kLseLog2>(st, dp, in.delta, lane, in.lse, tc::SoftCap::Of<Tile::kTakesSoftCap>(p),
                                   alibi, {in.r0, w.C0() + key_w}, kept);
    tc::PackAFragments<T>(dp, da);

    // ---- dSᵀ into the shared tile (for dQ)
    const uint32_t sDs = WarpUniform(sm.Ds(it));
    if constexpr (Tile::kTakesDense && !Tile::kDqByColumns) {
      // With dS out the writer stores this buffer too, two steps before; a
      // consumer that computes no dQ there (one of three takes each step's)
      // waits for the writer to free that step, as the one that stages dQ
      // does for its buffer (below).
      if (p.ds_out.On()) {
        MBarrier::Wait(sm.DqEmpty(it % Tile::kDqBuffers), ((it / Tile::kDqBuffers) & 1) ^ 1);
      }
    }
    if constexpr (Tile::kWithDq) {
#pragma unroll
      for (int kk = 0; kk < kM / 16; ++kk) StoreTransposedFragment<DsTile>(sDs, da[kk], kk * 16, key_w, lane);
      FenceSharedForAsyncProxy();
    }
    if constexpr (!Tile::kEarlyDv) issue_dv();

    // ---- dQ = dS K over all kN keys, once every consumer's dS is in place,
    // then dK += dSᵀ Q, which runs on while dQ is staged. (Running it on into
    // the next step's scores as well needs more than 232 registers: ptxas
    // spills and serialises the products.)
    const int barrier = Tile::kDsBarrier + it % Tile::kDsBarriers;
    if (Tile::kWithDq && (Tile::kDqByColumns || it % Tile::kConsumers == consumer)) {
      NamedBarrierSync(barrier, 128 * Tile::kConsumers);
      const int col0 = Tile::kDqByColumns ? WarpUniform(consumer * kDqCols) : 0;
      float dq[kDqCols / 8][4];
      WgmmaFence();
      ProductSSMn<T, DsTile, KVTile, kN, kDqCols>(dq, sDs, sm.k, col0);
      WgmmaCommit();
      ProductRS<T, QTile, kM, kD>(dk, da, in.q, 0);
      WgmmaCommit();
      WgmmaWait<1>();  // dV and dQ
      FenceAccumulator(dq);
      // The buffer's tile of kDqBuffers steps before has been read.
      const int buf = it % Tile::kDqBuffers;
      MBarrier::Wait(sm.DqEmpty(buf), ((it / Tile::kDqBuffers) & 1) ^ 1);
      // With kFlipStaging, lanes t = 2, 3 write the 8-column blocks in the
      // order k ^ 2, so the 16 lanes of a half-warp (4 rows, one swizzle phase
      // each) hit 8 different 16-byte chunks: one wavefront per half-warp,
      // where the same order for every lane takes two.
      const int flip = Tile::kFlipStaging ? t & 2 : 0;
      // Block k's float pair (columns col0 + 8k + 2t, +1) of row r = 16 warp
      // + g + 8 half sits in chunk 2 (k & 3) + t / 2 of the row's 128 bytes in
      // column block col0 / 32 + k / 4, at chunk position (2 (k & 3) + t / 2)
      // ^ g (DqStage::ChunkOffset): its bit 0 is (t / 2) ^ (g & 1) and its
      // bits 1-2 are (k & 3) ^ (g / 2), so the address is one base XOR
      // (k & 3) · 32 plus constants: one register and a logic op a block,
      // where ChunkOffset per store took ~100 instructions a step (or,
      // hoisted, 16 registers).
      const uint32_t row_base = sm.Dq(buf) + (col0 / 32) * DqStage::kBlockBytes + (warp * 16 + g) * 128 + (t & 1) * 8 +
                                ((((t >> 1) ^ g) << 4) ^ (flip << 5));
#pragma unroll
      for (int k = 0; k < kDqCols / 8; ++k) {
        const uint32_t at = (row_base ^ ((k & 3) << 5)) + (k >> 2) * DqStage::kBlockBytes;  // block k ^ flip
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float x = flip ? dq[k ^ 2][2 * half] : dq[k][2 * half];
          const float y = flip ? dq[k ^ 2][2 * half + 1] : dq[k][2 * half + 1];
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at + half * 8 * 128), "f"(x), "f"(y) : "memory");
        }
      }
      FenceSharedForAsyncProxy();  // the staged dQ, for the copy engine
      MBarrier::Arrive(sm.DqFull(buf));
    } else {
      if (Tile::kWithDq) NamedBarrierArrive(barrier, 128 * Tile::kConsumers);
      WgmmaFence();
      ProductRS<T, QTile, kM, kD>(dk, da, in.q, 0);
      WgmmaCommit();
    }
    FinishStep(sm, ring, dk, dv);
  }

  StoreKeyGradsByTma<T>(p, sm, w, consumer, consumer * 64, dk, 0, dv, 0, dk_map, dv_map);
}

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    WsBwdKernel(const __grid_constant__ BwdParams p, const __grid_constant__ CUtensorMap q_map,
                const __grid_constant__ CUtensorMap do_map, const __grid_constant__ CUtensorMap k_map,
                const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dq_map,
                const __grid_constant__ CUtensorMap dk_map, const __grid_constant__ CUtensorMap dv_map,
                const __grid_constant__ CUtensorMap bias_map, const __grid_constant__ CUtensorMap ds_map) {
#if defined(JAXFLASH_SM90A)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (tc::SmemAddr(smem_raw) + 1023u) & ~1023u;
  const auto sm = WsBwdSmem<Tile>::At(base);
  // The first stage's statistics as a pointer (StatsPointer finds the others).
  float* stats_base = reinterpret_cast<float*>(smem_raw + (sm.stats - tc::SmemAddr(smem_raw)));
  if (threadIdx.x == 0) {
    sm.InitBarriers();
    *reinterpret_cast<tc::GridTile*>(smem_raw + (sm.place - tc::SmemAddr(smem_raw))) =
        tc::OrderedGridTile<tc::HeavyTiles::kFirst>(p);
  }
  __syncthreads();
  RunRoles<Tile::kProducerRegs, Tile::kConsumerRegs>(
      [&](int warp) {
        if (warp == 0) {
          WsBwdProducer<Tile>(p, sm, WsBwdWork<Tile>::At(p, sm.place), stats_base, q_map, do_map, k_map, v_map,
                              bias_map);
        } else if (warp == 1) {
          if constexpr (Tile::kStagedDq) {
            WsBwdDqWriter<Tile>(sm, WsBwdWork<Tile>::At(p, sm.place), dq_map, ds_map, p);
          }
        } else if (warp == 2) {
          if constexpr (Tile::kFlagWriter) WsBwdFlagWriter<Tile>(sm, WsBwdWork<Tile>::At(p, sm.place), stats_base);
        }
      },
      [&](int consumer) {
        if constexpr (Tile::kSharedKeys) {
          WsBwdColumnConsumer<T, Tile>(p, sm, WsBwdWork<Tile>::At(p, sm.place), stats_base, consumer, dk_map,
                                       dv_map);
        } else {
          WsBwdConsumer<T, Tile>(p, sm, WsBwdWork<Tile>::At(p, sm.place), stats_base, consumer, dk_map, dv_map);
        }
      });
#endif  // JAXFLASH_SM90A
}

// The warp-specialised pass over (key tiles, kv heads, batch): checks the
// launch limits, then encodes the tensor maps and launches. The caller runs
// it only on non-empty extents, which a map needs. Without staged dQ the
// sums' map is not encoded (deterministic calls have no sums; the column
// consumers add their dQ themselves) and the kernel's slot for it takes Q's
// map, which it never reads; so do the bias's and dS's slots of tiles
// without them.
template <typename T, typename Tile>
Status RunWsPass(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  Status st = EnsureDynamicSmem<WsBwdKernel<T, Tile>>(WsBwdSmem<Tile>::kLaunchBytes, device);
  if (!st.ok()) return st;
  const AttentionShape& sh = p.shape;
  if (CeilDiv(sh.kv_len, Tile::kN) > INT_MAX || sh.kv_heads > 65535 || sh.batch > 65535) {
    return Status::Unimplemented("backward grid beyond the launch limits");
  }
  CUtensorMap q_map, do_map, k_map, v_map, dq_map, dk_map, dv_map;
  if (!(st = EncodeRowsMap(&q_map, p.q, p.dtype, sh, true, Tile::kM)).ok() ||
      !(st = EncodeRowsMap(&do_map, p.dout, p.dtype, sh, true, Tile::kM, sh.v_dim())).ok() ||
      !(st = EncodeRowsMap(&k_map, p.k, p.dtype, sh, false, Tile::kN)).ok() ||
      !(st = EncodeRowsMap(&v_map, p.v, p.dtype, sh, false, Tile::kN, sh.v_dim())).ok()) {
    return st;
  }
  // dK and dV: 64 keys (a key-split consumer's, or a column consumer's
  // whole tile) a box.
  if (!(st = EncodeRowsMap(&dk_map, p.dk, p.dtype, sh, false, 64)).ok() ||
      !(st = EncodeRowsMap(&dv_map, p.dv, p.dtype, sh, false, 64, sh.v_dim())).ok()) {
    return st;
  }
  if (!Tile::kStagedDq) {
    dq_map = q_map;
  } else if (!(st = EncodeRowsMap(&dq_map, p.dq_accum, DType::kFloat32, sh, true, Tile::kM)).ok()) {
    return st;
  }
  CUtensorMap bias_map = q_map, ds_map = q_map;
  if constexpr (Tile::kTakesDense) {
    if (!(st = EncodeBiasMap(&bias_map, p.dense.bias, sh, Tile::kM)).ok()) return st;
    if (p.ds_out.On() && !(st = EncodeBiasMap(&ds_map, p.ds_out, sh, Tile::kM)).ok()) return st;
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(sh.kv_len, Tile::kN)), static_cast<unsigned>(sh.kv_heads),
                  static_cast<unsigned>(sh.batch));
  WsBwdKernel<T, Tile><<<grid, Tile::kThreads, WsBwdSmem<Tile>::kLaunchBytes, stream>>>(
      p, q_map, do_map, k_map, v_map, dq_map, dk_map, dv_map, bias_map, ds_map);
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
