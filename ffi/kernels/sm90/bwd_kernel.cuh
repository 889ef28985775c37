// FlashAttention backward for Hopper (sm_90a): warpgroup MMA (wgmma), after
// the delta pre-pass (common/bwd_blocks.cuh), in the sm80 backward's two
// kernels (no atomics, deterministic by construction; sm80/bwd_kernel.cuh):
//
//   DkDvKernel   one CTA per (key tile, kv head, batch[, column split]); each
//                warpgroup owns 64 keys and walks the query tiles of every
//                head of the GQA group that sees them:
//                  Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ        (both operands in shared memory)
//                  dV += Pᵀ·dO, dK += dSᵀ·Q      (Pᵀ, dSᵀ from registers)
//   DqKernel     one CTA per (query tile, head, batch); each warpgroup owns
//                64 query rows and walks the key tiles they see:
//                  S = Q·Kᵀ, dP = dO·Vᵀ, dQ += dS·K
//
// The fused backward (one pass, dQ added into float32 sums) is the
// warp-specialised kernel of bwd_ws_kernel.cuh; deterministic calls (and
// D 256) run its pass without dQ and then the warp-specialised dQ pass of
// bwd_ws_dq.cuh; forced tiles run the two kernels here.
//
// The next query (or key) tile streams into the second of two shared-memory
// stages while the current one is used. Inside a warpgroup the products are
// ordered so the element-wise work overlaps the tensor cores: Pᵀ (P) is
// computed while dPᵀ (dP) runs, and dSᵀ while dV += Pᵀ·dO runs.
#pragma once

#include <cuda_runtime.h>

#include "common/bwd_blocks.cuh"
#include "common/fwd_blocks.cuh"
#include "common/grid_order.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "jaxflash/params.h"
#include "sm80/launch_sm80.h"
#include "sm90/bwd_steps.cuh"
#include "sm90/bwd_ws_dq.cuh"
#include "sm90/bwd_ws_kernel.cuh"
#include "sm90/launch_sm90.h"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

// ------------------------------------------------------------ dK, dV
template <int kD_, int kWarpGroups_, int kM_, int kSplits_ = 1, int kCtasPerSm_ = 1>
struct DkDvTile {
  static constexpr int kD = kD_;
  static constexpr int kWarpGroups = kWarpGroups_;
  static constexpr int kN = 64 * kWarpGroups;  // keys per CTA
  static constexpr int kM = kM_;               // query rows per step
  static constexpr int kSplits = kSplits_;     // CTAs per key tile, each owning kD / kSplits columns of dK, dV
  static constexpr int kCtasPerSm = kCtasPerSm_;  // as FwdTile::kCtasPerSm
  static constexpr int kDOut = kD / kSplits;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kStages = 2;
  using KVTile = SwizzledTile<kN, kD>;
  using QTile = SwizzledTile<kM, kD>;
  // K, V, then per stage Q, dO and the tile's LSE and delta (kM floats each),
  // each stage rounded up to keep the next one's tiles 1024-byte aligned;
  // +1024: the dynamic shared-memory base is aligned up to a swizzle atom.
  static constexpr size_t kStatsOffset = 2 * size_t(QTile::kBytes);
  static constexpr size_t kStageBytes = (kStatsOffset + 2 * kM * sizeof(float) + 1023) / 1024 * 1024;
  static constexpr size_t kSmemBytes = 2 * size_t(KVTile::kBytes) + kStages * kStageBytes + 1024;
  static_assert(kM == 32 || kM == 64 || kM == 128, "Sᵀ tiles use the compiled wgmma widths");
  static_assert(kDOut % 64 == 0, "dK/dV columns come in whole 64-column blocks");
  // 128 queries a step at D = 64 use all 255 registers; the soft-cap's slope
  // (score_mod.cuh) would spill them. These candidates run only when a tile is
  // forced (LaunchBackward); forced with a cap, they refuse the call.
  static constexpr bool kTakesSoftCap = !(kD == 64 && kM == 128);
  static constexpr bool kTakesSegments = kTakesSoftCap;  // their tables spilled the same tiles (20 bytes)
  static constexpr bool kTakesAlibi = kTakesSoftCap && !(kD == 256 && kWarpGroups == 1);  // (that one spilled 8 bytes)
};

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kCtasPerSm) DkDvKernel(const BwdParams p) {
#if defined(JAXFLASH_SM90A)
  constexpr int kD = Tile::kD, kN = Tile::kN, kM = Tile::kM, kDOut = Tile::kDOut;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kQT = kM / 8, kDT = kDOut / 8;
  using KVTile = typename Tile::KVTile;
  using QTile = typename Tile::QTile;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem = (tc::SmemAddr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = smem;
  const uint32_t sV = sK + KVTile::kBytes;
  // Stage `it % 2`: Q, dO, LSE, delta of the query tile `it` steps into the walk.
  auto stage = [&](unsigned it) {
    return sV + KVTile::kBytes + uint32_t((it % Tile::kStages) * Tile::kStageBytes);
  };
  // The same stage's LSE values (then kM delta values) as a pointer.
  auto stats = [&](unsigned it) {
    return reinterpret_cast<const float*>(smem_raw + (stage(it) - tc::SmemAddr(smem_raw)) + Tile::kStatsOffset);
  };

  const AttentionShape& sh = p.shape;
  const tc::GridTile at = tc::OrderedGridTile<tc::HeavyTiles::kFirst>(p);
  const int kv_head = at.y;
  const int batch = at.z / Tile::kSplits;
  const int d_base = (at.z % Tile::kSplits) * kDOut;
  const int group = static_cast<int>(sh.group_size());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warpgroup = tid >> 7;
  const int head_dim = static_cast<int>(sh.head_dim);
  const int q_len = static_cast<int>(sh.q_len);
  const int64_t q_row_stride = sh.q_row_stride(), kv_row_stride = sh.kv_row_stride();

  const MaskPolicy pol = MaskPolicy::For<Tile::kTakesSegments>(p.mask, q_len, static_cast<int>(sh.kv_len),
                                                               p.q_lengths, p.kv_lengths, batch);
  const int c0 = at.tile * kN;
  const tc::QueryTiles q_tiles = tc::QueryTileRange<kM, kN>(pol, c0);
  const int n_iters = group * q_tiles.count;
  auto tile_row0 = [&](int it) { return (q_tiles.begin + it % q_tiles.count) * kM; };

  // Copies query tile `it` (Q, dO, LSE, delta of its head and rows) into its stage.
  auto load_q_tile = [&](int it) {
    const int head = kv_head * group + it / q_tiles.count;
    const int r0 = tile_row0(it);
    const uint32_t st = stage(it);
    const int64_t q_off = tc::FwdBlock<T>::QOffset(sh, batch, head, r0);
    // Rows past q_valid (padding) read as zeros, so a NaN there meets no key.
    LoadSwizzledTile<kM, kD, kThreads>(st, static_cast<const T*>(p.q) + q_off, q_row_stride, pol.q_valid - r0,
                                       head_dim, tid);
    LoadSwizzledTile<kM, kD, kThreads>(st + QTile::kBytes, static_cast<const T*>(p.dout) + q_off, q_row_stride,
                                       pol.q_valid - r0, head_dim, tid);
    const int64_t row_off = (int64_t(batch) * sh.q_heads + head) * sh.q_len + r0;
    const uint32_t stats = st + Tile::kStatsOffset;
    for (int i = tid; i < kM; i += kThreads) {
      const bool ok = r0 + i < q_len;  // rows past q_len read as zeros and are masked
      tc::CpAsync4(stats + 4 * i, p.lse + (ok ? row_off + i : 0), ok);
      tc::CpAsync4(stats + 4 * (kM + i), p.delta + (ok ? row_off + i : 0), ok);
    }
  };

  float dk[kDT][4], dv[kDT][4];
  tc::Zero(dk);
  tc::Zero(dv);

  if (n_iters > 0) {
    // Keys past kv_valid are zero-filled (and masked).
    const int64_t kv_off = batch * sh.kv_batch_stride() + c0 * kv_row_stride + kv_head * sh.head_dim;
    LoadSwizzledTile<kN, kD, kThreads>(sK, static_cast<const T*>(p.k) + kv_off, kv_row_stride, pol.kv_valid - c0,
                                       head_dim, tid);
    LoadSwizzledTile<kN, kD, kThreads>(sV, static_cast<const T*>(p.v) + kv_off, kv_row_stride, pol.kv_valid - c0,
                                       head_dim, tid);
    load_q_tile(0);
    tc::CpAsyncCommit();
  }

  const float scale_log2 = p.scale * tc::kLog2e;
  const int key_w = warp * 16;  // this warp's first key within the CTA's tile
  // This warpgroup's 64 keys of K and V, as A operands.
  const uint32_t sK_rows = sK + warpgroup * 64 * 128;
  const uint32_t sV_rows = sV + warpgroup * 64 * 128;

  for (int it = 0; it < n_iters; ++it) {
    tc::CpAsyncWait<0>();
    FenceSharedForAsyncProxy();  // this thread's copies, visible to wgmma
    __syncthreads();             // tile `it` landed; iteration it - 1 is done everywhere
    if (it + 1 < n_iters) load_q_tile(it + 1);
    tc::CpAsyncCommit();

    const uint32_t sQ = stage(it), sdO = sQ + QTile::kBytes;
    const float* lse = stats(it);
    const float* delta = lse + kM;
    const int r0 = tile_row0(it);

    // ---- Sᵀ, dPᵀ (64 keys x kM queries per warpgroup); Pᵀ while dPᵀ runs;
    // then dV += Pᵀ dO is issued
    float s[kQT][4], dp[kQT][4];
    const tc::AlibiBias alibi =
        tc::AlibiBias::Of<Tile::kTakesAlibi>(p, pol, batch, kv_head * group + it / q_tiles.count);
    KeyMajorScores<T, KVTile, QTile, kD, kM>(
        s, dp, sK_rows, sV_rows, sQ, sdO, pol, r0, c0 + key_w,
        [&] { return pol.TileIsFull<true>(r0, r0 + kM, c0, c0 + kN); }, lse, lane, scale_log2,
        tc::SoftCap::Of<Tile::kTakesSoftCap>(p), alibi);
    uint32_t pa[kM / 16][4];
    tc::PackAFragments<T>(s, pa);
    WgmmaFence();
    ProductRS<T, QTile, kM, kDOut>(dv, pa, sdO, d_base);
    WgmmaCommit();

    // ---- dSᵀ while dV runs; then dK += dSᵀ Q
    WgmmaWait<1>();
    FenceAccumulator(dp);
    tc::KeyMajorDs(s, dp, delta, lane, lse, tc::SoftCap::Of<Tile::kTakesSoftCap>(p), alibi, {r0, c0 + key_w});
    uint32_t da[kM / 16][4];
    tc::PackAFragments<T>(dp, da);
    WgmmaFence();
    ProductRS<T, QTile, kM, kDOut>(dk, da, sQ, d_base);
    WgmmaCommit();
    // The stage is refilled after the next barrier, and pa / da are live
    // until the products that read them are done.
    WgmmaWait<0>();
    FenceAccumulator(dv);
    FenceAccumulator(dk);
  }

  tc::StoreKeyGrads<T>(dk, dv, p, batch, kv_head, c0 + key_w, d_base, lane);
#endif  // JAXFLASH_SM90A
}

// ------------------------------------------------------------ dQ
template <int kD_, int kWarpGroups_, int kN_, int kCtasPerSm_ = 1>
struct DqTile {
  static constexpr int kD = kD_;
  static constexpr int kWarpGroups = kWarpGroups_;
  static constexpr int kM = 64 * kWarpGroups;  // query rows per CTA
  static constexpr int kN = kN_;               // keys per step
  static constexpr int kCtasPerSm = kCtasPerSm_;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kStages = 2;
  static constexpr bool kTakesSoftCap = true;
  static constexpr bool kTakesSegments = true;
  static constexpr bool kTakesAlibi = true;
  using QTile = SwizzledTile<kM, kD>;
  using KVTile = SwizzledTile<kN, kD>;
  // Q, dO, then two stages of K and V; +1024 for the alignment of the base.
  static constexpr size_t kSmemBytes = 2 * size_t(QTile::kBytes) + 2 * kStages * size_t(KVTile::kBytes) + 1024;
  static_assert(kN == 32 || kN == 64 || kN == 128, "score tiles use the compiled wgmma widths");
};

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kCtasPerSm) DqKernel(const BwdParams p) {
#if defined(JAXFLASH_SM90A)
  constexpr int kD = Tile::kD, kM = Tile::kM, kN = Tile::kN;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kNT = kN / 8, kDT = kD / 8;
  using QTile = typename Tile::QTile;
  using KVTile = typename Tile::KVTile;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem = (tc::SmemAddr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sQ = smem;
  const uint32_t sdO = sQ + QTile::kBytes;
  const uint32_t sK0 = sdO + QTile::kBytes;
  const uint32_t sV0 = sK0 + Tile::kStages * KVTile::kBytes;
  // Stage of K or V (base sK0 / sV0) holding the tile `it` steps into the walk.
  auto stage = [](uint32_t base, unsigned it) { return base + (it % Tile::kStages) * KVTile::kBytes; };

  const tc::FwdBlock<T> blk = tc::FwdBlock<T>::template OfGrid<kM, kN>(p);
  const MaskPolicy& pol = blk.pol;
  const tc::KeyTiles tiles = blk.tiles;
  const int r0 = blk.r0;
  const int tid = threadIdx.x, lane = tid & 31, warpgroup = tid >> 7;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  const int warp_row0 = (tid >> 5) * 16;  // this warp's rows within the CTA (the wgmma layout)

  auto load_kv = [&](unsigned it, int nb) {
    const int c0 = nb * kN;
    const int64_t off = int64_t(c0) * blk.kv_row_stride;
    LoadSwizzledTile<kN, kD, kThreads>(stage(sK0, it), blk.k + off, blk.kv_row_stride, pol.kv_valid - c0, head_dim,
                                       tid);
    LoadSwizzledTile<kN, kD, kThreads>(stage(sV0, it), blk.v + off, blk.kv_row_stride, pol.kv_valid - c0, head_dim,
                                       tid);
  };

  tc::RowStats rows;
  rows.Load(p, pol, blk.batch, blk.head, r0 + warp_row0, lane);

  float dq[kDT][4];
  tc::Zero(dq);

  if (tiles.begin < tiles.end) {
    const T* gdO = static_cast<const T*>(p.dout) + tc::FwdBlock<T>::QOffset(p.shape, blk.batch, blk.head, r0);
    LoadSwizzledTile<kM, kD, kThreads>(sQ, blk.q, blk.q_row_stride, blk.r_end - r0, head_dim, tid);
    LoadSwizzledTile<kM, kD, kThreads>(sdO, gdO, blk.q_row_stride, blk.r_end - r0, head_dim, tid);
    load_kv(0, tiles.begin);
    tc::CpAsyncCommit();
  }
  const float scale_log2 = p.scale * tc::kLog2e;
  // This warpgroup's 64 rows of Q and dO, as A operands.
  const uint32_t sQ_rows = sQ + warpgroup * 64 * 128;
  const uint32_t sdO_rows = sdO + warpgroup * 64 * 128;

  for (int nb = tiles.begin; nb < tiles.end; ++nb) {
    const unsigned it = nb - tiles.begin;
    tc::CpAsyncWait<0>();
    FenceSharedForAsyncProxy();
    __syncthreads();  // K_n, V_n landed; iteration n - 1 is done everywhere
    if (nb + 1 < tiles.end) load_kv(it + 1, nb + 1);
    tc::CpAsyncCommit();
    const uint32_t sK = stage(sK0, it), sV = stage(sV0, it);
    const int c0 = nb * kN;

    // ---- S = Q Kᵀ, then dP = dO Vᵀ
    float s[kNT][4], dp[kNT][4];
    WgmmaFence();
    ProductSS<T, QTile, KVTile, kD, kN>(s, sQ_rows, sK);
    WgmmaCommit();
    ProductSS<T, QTile, KVTile, kD, kN>(dp, sdO_rows, sV);
    WgmmaCommit();

    // ---- P while dP runs; then dS = P ∘ (dP - delta) and dQ += dS K
    WgmmaWait<1>();
    FenceAccumulator(s);
    const bool full = pol.TileIsFull(r0, r0 + kM, c0, c0 + kN);
    const tc::AlibiBias alibi = tc::AlibiBias::Of(p, pol, blk.batch, blk.head);
    tc::QueryMajorProbs(s, rows, pol, full, r0 + warp_row0, c0, lane, scale_log2, tc::SoftCap::Of(p), alibi);
    WgmmaWait<0>();
    FenceAccumulator(dp);
    tc::QueryMajorDs(s, dp, rows, tc::SoftCap::Of(p), alibi, {r0 + warp_row0, c0}, lane);
    uint32_t da[kN / 16][4];
    tc::PackAFragments<T>(dp, da);
    WgmmaFence();
    ProductRS<T, KVTile, kN, kD>(dq, da, sK, 0);
    WgmmaCommit();
    WgmmaWait<0>();  // the stage of K is refilled after the next barrier
    FenceAccumulator(dq);
  }

  tc::StoreQueryGrad<T>(dq, p, pol, blk.batch, blk.head, r0 + warp_row0, lane);
#endif  // JAXFLASH_SM90A
}

// ------------------------------------------------------------ tile table
// A backward tile is a pair: DkDvTile<kD, warpgroups, query rows per step,
// column splits, CTAs per SM> and DqTile<kD, warpgroups, keys per step, CTAs
// per SM>. Registers per thread: dK + dV hold kD / kSplits floats, Sᵀ + dPᵀ
// another kM (dQ: kD / 2, S + dP another kN), plus a quarter of that packed.
// At kD = 256 the dK/dV columns are split over two CTAs and the score tiles
// are 32 wide, so K and V of 128 keys and two stages of Q and dO fit.
template <typename DkDv_, typename Dq_>
struct BwdTile {
  using DkDv = DkDv_;
  static constexpr bool kTakesSoftCap = DkDv_::kTakesSoftCap && Dq_::kTakesSoftCap;
  static constexpr bool kTakesSegments = DkDv_::kTakesSegments && Dq_::kTakesSegments;
  static constexpr bool kTakesAlibi = DkDv_::kTakesAlibi && Dq_::kTakesAlibi;
  using Dq = Dq_;
};
template <int kD>
struct BwdCandidates;
template <>
struct BwdCandidates<64> {
  using type = TileList<BwdTile<DkDvTile<64, 2, 128>, DqTile<64, 2, 128>>,
                        BwdTile<DkDvTile<64, 1, 128, 1, 2>, DqTile<64, 1, 128, 2>>,
                        BwdTile<DkDvTile<64, 1, 64, 1, 2>, DqTile<64, 1, 64, 3>>,
                        BwdTile<DkDvTile<64, 2, 64>, DqTile<64, 2, 64>>>;
};
template <>
struct BwdCandidates<128> {
  using type = TileList<BwdTile<DkDvTile<128, 2, 64>, DqTile<128, 2, 64>>,
                        BwdTile<DkDvTile<128, 1, 64, 1, 2>, DqTile<128, 1, 64, 2>>,
                        BwdTile<DkDvTile<128, 1, 64, 1, 2>, DqTile<128, 2, 64>>>;
};
template <>
struct BwdCandidates<256> {
  using type = TileList<BwdTile<DkDvTile<256, 2, 32, 2>, DqTile<256, 2, 32>>,
                        BwdTile<DkDvTile<256, 1, 64, 2>, DqTile<256, 1, 64>>>;
};
// D 192 runs the warp-specialised passes for every call but a forced tile or
// an empty query (q_len == 0); those take D 256's two kernels, the columns
// past 192 zeros.
template <>
struct BwdCandidates<192> : BwdCandidates<256> {};

// The tile table: index into BwdCandidates<kD>, measured on an H100 with
// tools/tune_tiles.py --direction bwd (2026-11-21, docs/performance.md): the
// one-warpgroup CTAs win at D = 64 (+7%) and 128 (+2-4%), causal or not. A
// list is never longer than the forward's for its bucket, so the tile tests
// (which force one index on both) reach every backward candidate. Unforced,
// the two kernels run only where the warp-specialised passes cannot
// (q_len == 0: dK = dV = 0; a soft-cap with ALiBi at D 128).
inline int BwdTilePick(int head_dim_bucket, bool /*causal*/) {
  return head_dim_bucket == 64 ? 2 : head_dim_bucket == 128 ? 1 : 0;
}

template <typename T, typename Tile>
Status LaunchBackwardTile(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  using DkDv = typename Tile::DkDv;
  using Dq = typename Tile::Dq;
  if (!TileTakes<Tile>(p)) {
    return Status::Unimplemented("this forced sm90 backward tile takes no logit soft-cap, ALiBi or segment ids");
  }
  return tc::LaunchBackwardKernels<T, DkDvKernel<T, DkDv>, DqKernel<T, Dq>>(
      p, {DkDv::kN, DkDv::kSplits, DkDv::kThreads, DkDv::kSmemBytes}, {Dq::kM, 1, Dq::kThreads, Dq::kSmemBytes},
      device, stream);
}

// The fused backward's tile per bucket: the warp-specialised kernel
// (bwd_ws_kernel.cuh), a TMA producer and consumer warpgroups sharing a
// step's dS. At D = 64 and 128 each consumer owns 64 keys: at D = 64 three
// (192 keys a CTA) compute a step's dQ in turn, 12% less kernel time than two
// on an H100 (twelfth session in docs/performance.md); at D = 128 dK and dV
// leave room for two. At D = 192 and 256 dK and dV of 64 keys would fill a
// warpgroup's registers, so two consumers share 64 keys and split the columns
// (bwd_ws_columns.cuh).
// `capped` is the fused tile for calls with a logit soft-cap, which `type`
// has no registers for: at D = 64 two consumers (240 registers each) take it,
// at D = 128 the tile without the early dV; at D = 256 it is `type`, which
// takes it (its consumers hold 64 x 32 score tiles), as at D = 192.
// One pass recomputes each score's tanh and exponent once; the two passes
// without dQ sums each do, and at D = 64 those special-function ops, not the
// tensor cores, bound the backward.
template <int kD, int kDv = kD>  // kDv: the value's head dim where a pair has tiles (MLA)
struct FusedBwdTile;
template <>
struct FusedBwdTile<64> {
  using type = WsBwdTile<64, 3>;
  using capped = WsBwdTile<64, 2>;
  // Calls with a bias it stages (TakesDenseBackward): three consumers, a
  // 64 x 192 bias box a stage, both dQ buffers (208 KiB).
  using dense = WsBwdTile<64, 3, 64, 2, true, false, true>;
};
template <>
struct FusedBwdTile<128> {
  using type = WsBwdTile<128>;
  // Capped calls: the same tile without the early dV (kForCap), whose
  // 240-register peak left no room for the cap (24 bytes of spills).
  using capped = WsBwdTile<128, 2, 64, 2, true, true>;
  // Calls with a bias it stages (TakesDenseBackward).
  using dense = WsBwdTile<128, 2, 64, 2, true, false, true>;
};
template <>
struct FusedBwdTile<192> {
  using type = WsBwdColumnTile<192>;
  using capped = type;
};
// q/k 192 with v 128 (MLA): dV's two blocks one a consumer, so with dQ 5 / 3
// blocks (4 / 4 would leave a consumer no dV), without 3 / 2.
template <>
struct FusedBwdTile<192, 128> {
  using type = WsBwdColumnTile<192, 2, true, 128>;
  using capped = type;
};
template <>
struct FusedBwdTile<256> {
  using type = WsBwdColumnTile<256>;
  using capped = type;
};

// The warp-specialised dQ pass's tile per bucket (bwd_ws_dq.cuh): 128 query
// rows a CTA, and as many keys a step as fit. At D = 256 Q and dO take 128 KiB
// and three stages of 32 keys the rest; at D = 128 three stages of 64 (128
// would not fit); at D = 64 128 keys, 9.5% faster than 64, whose 64 x 64
// steps were as much waiting as products (docs/performance.md,
// twenty-seventh session). At D = 192 three stages of 48 keys (205 KiB); the
// MLA pair's narrower dO and V leave room for 64 (201 KiB). Both NOT yet
// measured against the 32-key steps they replace.
template <int kD, int kDv = kD>
struct DqPassTile;
template <>
struct DqPassTile<64> {
  using type = WsDqTile<64, 128>;
};
template <>
struct DqPassTile<128> {
  using type = WsDqTile<128, 64>;
};
template <>
struct DqPassTile<192> {
  using type = WsDqTile<192, 48>;
};
template <>
struct DqPassTile<192, 128> {
  using type = WsDqTile<192, 64, 3, 2, 128>;
};
template <>
struct DqPassTile<256> {
  using type = WsDqTile<256, 32>;
};

// The backward without dQ sums (deterministic calls, the fused pass switched
// off, and D = 256, where two passes are the default): the fused tile's pass
// without dQ (bit-reproducible: each CTA owns its keys and sums the GQA
// group's heads in a fixed order), then the dQ pass. A forced tile, and
// q_len == 0 (no map to encode; dK = dV = 0), take the two kernels.
template <typename T, typename KeyTile, typename DqTile>
Status LaunchWsKeyGradsThenDq(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  Status st = EnsureDynamicSmem<WsDqKernel<T, DqTile>>(DqTile::kSmemBytes, device);
  if (!st.ok()) return st;
  return tc::RunBackwardPasses<T>(
      p, stream, [&] { return RunWsPass<T, KeyTile>(p, device, stream); },
      [&] { return RunWsDqPass<T, DqTile>(p, stream); });
}

// The dense tile's backward (TakesDenseBackward), with dB out where asked:
// zeroed first where the walk leaves pairs out (a mask rule, lengths) or two
// (batch, head)s add into each entry.
template <typename T, int kD>
Status LaunchDenseBackward(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  const AttentionShape& sh = p.shape;
  const MaskParams& m = p.mask;
  const bool every_pair = m.window_left < 0 && m.window_right < 0 && m.diag_offsets == nullptr &&
                          p.q_lengths == nullptr && p.kv_lengths == nullptr;
  const int64_t sharers = p.ds_out.Sharers(sh);
  if (p.ds_out.On() && sharers > 2) {  // (the 16-bit adds would round more than a float32 sum)
    return Status::InvalidArgument("dB out of the backward is for biases of at most two (batch, head)s an entry");
  }
  if (p.ds_out.On() && (!every_pair || sharers > 1)) {
    const size_t bytes = size_t(sh.batch) * sh.q_heads * sh.q_len * sh.kv_len / sharers * sizeof(T);
    const cudaError_t err = cudaMemsetAsync(const_cast<void*>(p.ds_out.data), 0, bytes, stream);
    if (err != cudaSuccess) return Status::Internal(std::string("cudaMemsetAsync (dB): ") + cudaGetErrorString(err));
  }
  return LaunchWsBackward<T, typename FusedBwdTile<kD>::dense>(p, device, stream);
}

template <typename T, int kD, int kDv>
Status LaunchBackward(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  using Fused = typename FusedBwdTile<kD, kDv>::type;
  if (p.dense.On()) {  // the dispatch sends only calls TakesDenseBackward allows
    if constexpr ((kD == 64 || kD == 128) && kDv == kD) return LaunchDenseBackward<T, kD>(p, device, stream);
    return Status::Internal("a dense call reached an sm90 backward without a dense tile");
  }
  // A logit soft-cap or segment ids run the first of the passes below whose
  // tiles take them (TileTakes: a cap at D 64 the fused pass of two
  // consumers, at D 128 the fused kForCap pass, at D 256 the column tile's
  // passes as every call there, else the dK/dV pass and the dQ pass); the
  // others have no registers to spare for them. With no sm90 tile that does,
  // the sm80 kernels run.
  using KeyGrads = typename Fused::WithoutDq;
  using DqPass = typename DqPassTile<kD, kDv>::type;
  using FusedCapped = typename FusedBwdTile<kD, kDv>::capped;
  if (tc::UseFusedBackward(p)) {
    if (TileTakes<Fused>(p)) return LaunchWsBackward<T, Fused>(p, device, stream);
    if (p.softcap > 0.f && TileTakes<FusedCapped>(p)) return LaunchWsBackward<T, FusedCapped>(p, device, stream);
  }
  // (A forced tile names a two-kernel candidate; a pair of head dims has none,
  // and its forward took the call, so its passes take it too.)
  if (TileTakes<KeyGrads>(p) && TileTakes<DqPass>(p) && (kDv != kD || !tc::TileForced(p)) && p.shape.q_len > 0) {
    return LaunchWsKeyGradsThenDq<T, KeyGrads, DqPass>(p, device, stream);
  }
  if constexpr (kDv != kD) {  // (the two kernels and the sm80 ones take one head dim)
    return Status::Unimplemented("no sm90 backward of this value head dim takes the call");
  } else {
    // A cached preference was measured on the warp-specialised passes, without extras.
    const bool extras = p.softcap > 0.f || p.mask.q_segments != nullptr || p.alibi != nullptr;
    const int requested = extras && (p.tile & FwdParams::kTilePreferred) ? 0 : p.tile;
    using Candidates = typename BwdCandidates<kD>::type;
    const int pick = Candidates::PickTaking(BwdTilePick(kD, p.mask.window_right >= 0), p);
    if (pick < 0 && requested % FwdParams::kTileSm80 == 0) {
      BwdParams any_tile = p;
      any_tile.tile = 0;
      return sm80::LaunchBackward<T, kD>(any_tile, device, stream);
    }
    return Candidates::With(requested, pick,
                            [&](auto tile) { return LaunchBackwardTile<T, decltype(tile)>(p, device, stream); });
  }
}

}  // namespace sm90
}  // namespace jaxflash
