// FlashAttention-2 backward for sm80 and later (mma.sync), after the delta
// pre-pass (common/bwd_blocks.cuh), in two kernels:
//
//   DkDvKernel   one CTA per (key tile, kv head, batch[, d half]); walks
//                every query tile of every query head of the GQA group
//                that sees its keys, so dK and dV are summed over the
//                group in registers (no per-head copies, no atomics).
//   DqKernel     one CTA per (query tile, head, batch); walks the key
//                tiles its rows see, like the forward.
//
// Splitting dQ into its own kernel recomputes S = QKᵀ and dP = dO·Vᵀ (7 GEMMs
// instead of 5), but needs no fp32 accumulator in memory and no atomics, so
// the backward is deterministic (bit-identical run to run) by construction.
//
// Both main kernels give each warp 16 rows of the *output* they accumulate
// (keys for dK/dV, queries for dQ), so every product is register-local: the
// score tile a warp computes is exactly the A operand of its next GEMM.
// For dK/dV that means computing Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ directly.
#pragma once

#include <cuda_runtime.h>

#include "common/bwd_blocks.cuh"
#include "common/fwd_blocks.cuh"
#include "common/grid_order.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "common/mma.cuh"
#include "jaxflash/params.h"
#include "sm80/launch_sm80.h"

namespace jaxflash {
namespace sm80 {

// ------------------------------------------------------------ the score products
// The backward's two score products for this warp's 16 rows of the A
// operands (from `row0`) against kCols rows of the B operands, all in shared
// memory (row stride kStride): S = A_s B_sᵀ and dP = A_dp B_dpᵀ. The dQ and dB
// kernels pass (Q, dO; K, V), the dK/dV kernel (K, V; Q, dO) for Sᵀ and dPᵀ.
template <typename T, int kD, int kCols, int kStride>
__device__ __forceinline__ void ScoreProducts(float (&s)[kCols / 8][4], float (&dp)[kCols / 8][4], const T* a_s,
                                              const T* a_dp, const T* b_s, const T* b_dp, int row0, int lane) {
  tc::Zero(s);
  tc::Zero(dp);
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t as[4], adp[4];
    tc::Ldmatrix4(as, tc::AFragAddr(a_s, kStride, row0, kk * 16, lane));
    tc::Ldmatrix4(adp, tc::AFragAddr(a_dp, kStride, row0, kk * 16, lane));
#pragma unroll
    for (int np = 0; np < kCols / 16; ++np) {
      uint32_t b[4];
      tc::Ldmatrix4(b, tc::BFragAddrNK(b_s, kStride, np * 16, kk * 16, lane));
      tc::Mma<T>(s[2 * np], as, b[0], b[1]);
      tc::Mma<T>(s[2 * np + 1], as, b[2], b[3]);
      tc::Ldmatrix4(b, tc::BFragAddrNK(b_dp, kStride, np * 16, kk * 16, lane));
      tc::Mma<T>(dp[2 * np], adp, b[0], b[1]);
      tc::Mma<T>(dp[2 * np + 1], adp, b[2], b[3]);
    }
  }
}

// ------------------------------------------------------------ dK, dV
template <int kD_, int kSplits_, int kWarps_, int kM_>
struct DkDvTile {
  static constexpr int kD = kD_;
  static constexpr int kSplits = kSplits_;    // CTAs sharing a key tile, each owning kD / kSplits columns
  static constexpr int kDOut = kD / kSplits;  // dK/dV columns accumulated per CTA
  static constexpr int kWarps = kWarps_;
  static constexpr int kN = 16 * kWarps;  // keys per CTA, 16 per warp
  static constexpr int kM = kM_;          // query rows per step
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStride = kD + 8;  // see FwdTile
  static constexpr bool kTakesDense = true;  // dense_tile.cuh
  template <typename T>
  static constexpr size_t SmemBytes() {
    return size_t(2 * kN + 4 * kM) * kStride * sizeof(T) + 4 * kM * sizeof(float);
  }
  // With a staged dense bias, a tile of it per query-tile buffer.
  static constexpr size_t kBiasStage = tc::DenseTile::StageBytes<kM, kN>();
  template <typename T>
  static constexpr size_t DenseSmemBytes() {
    return SmemBytes<T>() + 2 * kBiasStage;
  }
  static_assert(kDOut % 16 == 0 && kM % 16 == 0, "tiles are built from 16x16 mma steps");
};

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1) DkDvKernel(const BwdParams p) {
  constexpr int kD = Tile::kD, kDOut = Tile::kDOut, kN = Tile::kN, kM = Tile::kM;
  constexpr int kStride = Tile::kStride, kThreads = Tile::kThreads;
  constexpr int kQT = kM / 8;       // n8 tiles of Sᵀ per warp (queries)
  constexpr int kDT = kDOut / 8;    // n8 tiles of dK/dV per warp

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kN * kStride;
  T* sQ = sV + kN * kStride;    // [2][kM][kStride]
  T* sdO = sQ + 2 * kM * kStride;  // [2][kM][kStride]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * kM * kStride);  // [2][kM]
  float* sDelta = sLse + 2 * kM;                                    // [2][kM]
  unsigned char* sBias = reinterpret_cast<unsigned char*>(sDelta + 2 * kM);  // [2][kBiasStage], when staged

  const AttentionShape& sh = p.shape;
  const tc::GridTile at = tc::OrderedGridTile<tc::HeavyTiles::kFirst>(p);
  const int n_block = at.tile;
  const int kv_head = at.y;
  const int batch = at.z / Tile::kSplits;
  const int d_base = (at.z % Tile::kSplits) * kDOut;
  const int group = static_cast<int>(sh.group_size());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int head_dim = static_cast<int>(sh.head_dim);
  const int q_len = static_cast<int>(sh.q_len);
  const int64_t q_row_stride = sh.q_row_stride(), kv_row_stride = sh.kv_row_stride();

  const MaskPolicy pol = MaskPolicy::For(p.mask, q_len, static_cast<int>(sh.kv_len), p.q_lengths,
                                         p.kv_lengths, batch);
  const int c0 = n_block * kN;
  const tc::QueryTiles q_tiles = tc::QueryTileRange<kM, kN>(pol, c0);
  const int n_iters = group * q_tiles.count;

  const int64_t kv_off = batch * sh.kv_batch_stride() + c0 * kv_row_stride + kv_head * sh.head_dim;
  const T* gK = static_cast<const T*>(p.k) + kv_off;
  const T* gV = static_cast<const T*>(p.v) + kv_off;

  const bool stages = tc::DenseTile::Stages(p);
  // Stages query tile `it` (head, row block) into buffer it & 1, with its
  // tile of a staged dense bias.
  auto load_q_tile = [&](int it) {
    const int head = kv_head * group + it / q_tiles.count;
    const int r0 = (q_tiles.begin + it % q_tiles.count) * kM;
    const int buf = it & 1;
    const int64_t q_off = tc::FwdBlock<T>::QOffset(sh, batch, head, r0);
    // Rows past q_valid (padding) are zero-filled, like keys past kv_valid:
    // a NaN there must not meet a masked pair's zero weight.
    tc::LoadTile<kM, kD, kThreads>(sQ + buf * kM * kStride, kStride, static_cast<const T*>(p.q) + q_off,
                                   q_row_stride, pol.q_valid - r0, head_dim, tid);
    tc::LoadTile<kM, kD, kThreads>(sdO + buf * kM * kStride, kStride, static_cast<const T*>(p.dout) + q_off,
                                   q_row_stride, pol.q_valid - r0, head_dim, tid);
    const int64_t row_off = (int64_t(batch) * sh.q_heads + head) * sh.q_len + r0;
    for (int i = tid; i < kM; i += kThreads) {
      const bool ok = r0 + i < q_len;
      tc::CpAsync4(tc::SmemAddr(sLse + buf * kM + i), p.lse + (ok ? row_off + i : 0), ok);
      tc::CpAsync4(tc::SmemAddr(sDelta + buf * kM + i), p.delta + (ok ? row_off + i : 0), ok);
    }
    if (stages) {
      tc::DenseTile::Of<Tile::kTakesDense>(p, batch, head).template Stage<kM, kN, kThreads>(
          sBias + buf * Tile::kBiasStage, r0, c0, tid);
    }
  };

  float dk[kDT][4], dv[kDT][4];
  tc::Zero(dk);
  tc::Zero(dv);

  if (n_iters > 0) {
    // Keys past kv_valid are zero-filled (and masked below).
    tc::LoadTile<kN, kD, kThreads>(sK, kStride, gK, kv_row_stride, pol.kv_valid - c0, head_dim, tid);
    tc::LoadTile<kN, kD, kThreads>(sV, kStride, gV, kv_row_stride, pol.kv_valid - c0, head_dim, tid);
    load_q_tile(0);
  }
  tc::CpAsyncCommit();

  const float scale_log2 = p.scale * tc::kLog2e;
  const int key_w = warp * 16;  // this warp's keys within the tile

  for (int it = 0; it < n_iters; ++it) {
    if (it + 1 < n_iters) load_q_tile(it + 1);
    tc::CpAsyncCommit();
    tc::CpAsyncWait<1>();
    const int r0 = (q_tiles.begin + it % q_tiles.count) * kM;
    const int head = kv_head * group + it / q_tiles.count;
    // Tile `it` visible to all. With a dense mask this barrier is its vote
    // (dense_tile.cuh): a tile it hides is skipped (no one reads its buffer,
    // so the next load may refill it without the barrier at the end).
    const tc::DenseTile::View view =
        tc::DenseTile::TileBarrier<Tile::kTakesDense>(p, batch, head, r0, r0 + kM, c0, c0 + kN, tid, kThreads);
    if (view == tc::DenseTile::kHidden) continue;

    const int buf = it & 1;
    const T* q = sQ + buf * kM * kStride;
    const T* d_o = sdO + buf * kM * kStride;

    // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (16 keys x kM queries per warp)
    float s[kQT][4], dp[kQT][4];
    ScoreProducts<T, kD, kM, kStride>(s, dp, sK, sV, q, d_o, key_w, lane);

    // ---- Pᵀ and dSᵀ; a tile only partly visible is masked per element.
    const bool full = pol.TileIsFull(r0, r0 + kM, c0, c0 + kN);
    const tc::AlibiBias alibi = tc::AlibiBias::Of(p, pol, batch, head);
    tc::DenseTile dense = tc::DenseTile::Of<Tile::kTakesDense>(p, batch, head, view);
    if (stages) dense = dense.Staged(sBias + buf * Tile::kBiasStage, kN, r0, c0);
    tc::KeyMajorProbs(s, pol, full, r0, c0 + key_w, sLse + buf * kM, lane, scale_log2, tc::SoftCap::Of(p), alibi,
                      tc::NoKeptTanh{}, dense.On() ? &dense : nullptr);
    tc::KeyMajorDs(s, dp, sDelta + buf * kM, lane, sLse + buf * kM, tc::SoftCap::Of(p), alibi, {r0, c0 + key_w});

    // ---- dV += Pᵀ dO and dK += dSᵀ Q over this CTA's output columns
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) {
      uint32_t ap[4], ads[4];
      tc::PackAFragment<T>(s, kk, ap);
      tc::PackAFragment<T>(dp, kk, ads);
#pragma unroll
      for (int dq = 0; dq < kDOut / 16; ++dq) {
        uint32_t b[4];
        tc::Ldmatrix4Trans(b, tc::BFragAddrKN(d_o, kStride, kk * 16, d_base + dq * 16, lane));
        tc::Mma<T>(dv[2 * dq], ap, b[0], b[1]);
        tc::Mma<T>(dv[2 * dq + 1], ap, b[2], b[3]);
        tc::Ldmatrix4Trans(b, tc::BFragAddrKN(q, kStride, kk * 16, d_base + dq * 16, lane));
        tc::Mma<T>(dk[2 * dq], ads, b[0], b[1]);
        tc::Mma<T>(dk[2 * dq + 1], ads, b[2], b[3]);
      }
    }
    __syncthreads();  // everyone is done with buffer `buf` before it is refilled
  }
  tc::CpAsyncWait<0>();

  tc::StoreKeyGrads<T>(dk, dv, p, batch, kv_head, c0 + key_w, d_base, lane);
}

// ------------------------------------------------------------ dQ
template <int kD_, int kWarps_, int kN_>
struct DqTile {
  static constexpr int kD = kD_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kM = 16 * kWarps;  // query rows per CTA, 16 per warp
  static constexpr int kN = kN_;          // keys per step
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStride = kD + 8;
  static constexpr bool kTakesDense = true;  // dense_tile.cuh
  template <typename T>
  static constexpr size_t SmemBytes() {
    return size_t(2 * kM + 4 * kN) * kStride * sizeof(T);
  }
  // With a staged dense bias, a tile of it per K/V buffer.
  static constexpr size_t kBiasStage = tc::DenseTile::StageBytes<kM, kN>();
  template <typename T>
  static constexpr size_t DenseSmemBytes() {
    return SmemBytes<T>() + 2 * kBiasStage;
  }
  static_assert(kD % 16 == 0 && kN % 16 == 0, "tiles are built from 16x16 mma steps");
};

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1) DqKernel(const BwdParams p) {
  constexpr int kD = Tile::kD, kM = Tile::kM, kN = Tile::kN;
  constexpr int kStride = Tile::kStride, kThreads = Tile::kThreads;
  constexpr int kNT = kN / 8, kDT = kD / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kM * kStride;
  T* sK = sdO + kM * kStride;  // [2][kN][kStride]
  T* sV = sK + 2 * kN * kStride;  // [2][kN][kStride]
  unsigned char* sBias = reinterpret_cast<unsigned char*>(sV + 2 * kN * kStride);  // [2][kBiasStage], when staged

  const tc::FwdBlock<T> blk = tc::FwdBlock<T>::template OfGrid<kM, kN>(p);
  const MaskPolicy& pol = blk.pol;
  const int r0 = blk.r0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int head_dim = static_cast<int>(p.shape.head_dim);

  const bool stages = tc::DenseTile::Stages(p);
  auto load_kv = [&](int nb) {  // with its tile of a staged dense bias
    const int buf = (nb - blk.tiles.begin) & 1;
    const int c0 = nb * kN;
    tc::LoadTile<kN, kD, kThreads>(sK + buf * kN * kStride, kStride, blk.k + int64_t(c0) * blk.kv_row_stride,
                                   blk.kv_row_stride, pol.kv_valid - c0, head_dim, tid);
    tc::LoadTile<kN, kD, kThreads>(sV + buf * kN * kStride, kStride, blk.v + int64_t(c0) * blk.kv_row_stride,
                                   blk.kv_row_stride, pol.kv_valid - c0, head_dim, tid);
    if (stages) {
      tc::DenseTile::Of<Tile::kTakesDense>(p, blk.batch, blk.head).template Stage<kM, kN, kThreads>(
          sBias + buf * Tile::kBiasStage, blk.r0, c0, tid);
    }
  };

  const int row_w = warp * 16;
  tc::RowStats rows;
  rows.Load(p, pol, blk.batch, blk.head, r0 + row_w, lane);

  float dq[kDT][4];
  tc::Zero(dq);

  if (blk.tiles.begin < blk.tiles.end) {
    const T* gdO = static_cast<const T*>(p.dout) + tc::FwdBlock<T>::QOffset(p.shape, blk.batch, blk.head, r0);
    tc::LoadTile<kM, kD, kThreads>(sQ, kStride, blk.q, blk.q_row_stride, blk.r_end - r0, head_dim, tid);
    tc::LoadTile<kM, kD, kThreads>(sdO, kStride, gdO, blk.q_row_stride, blk.r_end - r0, head_dim, tid);
    load_kv(blk.tiles.begin);
  }
  tc::CpAsyncCommit();

  const float scale_log2 = p.scale * tc::kLog2e;
  for (int nb = blk.tiles.begin; nb < blk.tiles.end; ++nb) {
    if (nb + 1 < blk.tiles.end) load_kv(nb + 1);
    tc::CpAsyncCommit();
    tc::CpAsyncWait<1>();
    const int c0 = nb * kN;
    // As in DkDvKernel: with a dense mask the barrier is its vote.
    const tc::DenseTile::View view = tc::DenseTile::TileBarrier<Tile::kTakesDense>(
        p, blk.batch, blk.head, r0, r0 + kM, c0, c0 + kN, tid, kThreads);
    if (view == tc::DenseTile::kHidden) continue;
    const int buf = (nb - blk.tiles.begin) & 1;
    const T* k = sK + buf * kN * kStride;
    const T* v = sV + buf * kN * kStride;

    // ---- S = Q Kᵀ, dP = dO Vᵀ
    float s[kNT][4], dp[kNT][4];
    ScoreProducts<T, kD, kN, kStride>(s, dp, sQ, sdO, k, v, row_w, lane);

    // ---- dS = P ∘ (dP - delta)
    const bool full = pol.TileIsFull(r0, r0 + kM, c0, c0 + kN);
    const tc::AlibiBias alibi = tc::AlibiBias::Of(p, pol, blk.batch, blk.head);
    tc::DenseTile dense = tc::DenseTile::Of<Tile::kTakesDense>(p, blk.batch, blk.head, view);
    if (stages) dense = dense.Staged(sBias + buf * Tile::kBiasStage, kN, r0, c0);
    tc::QueryMajorProbs(s, rows, pol, full, r0 + row_w, c0, lane, scale_log2, tc::SoftCap::Of(p), alibi,
                        dense.On() ? &dense : nullptr);
    tc::QueryMajorDs(s, dp, rows, tc::SoftCap::Of(p), alibi, {r0 + row_w, c0}, lane);

    // ---- dQ += dS K
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[4];
      tc::PackAFragment<T>(dp, kk, a);
#pragma unroll
      for (int dd = 0; dd < kD / 16; ++dd) {
        uint32_t b[4];
        tc::Ldmatrix4Trans(b, tc::BFragAddrKN(k, kStride, kk * 16, dd * 16, lane));
        tc::Mma<T>(dq[2 * dd], a, b[0], b[1]);
        tc::Mma<T>(dq[2 * dd + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }
  tc::CpAsyncWait<0>();

  tc::StoreQueryGrad<T>(dq, p, pol, blk.batch, blk.head, r0 + row_w, lane);
}

// ------------------------------------------------------------ tile table
template <int kD>
struct BwdTilesFor {
  // dK/dV: 4 warps x 16 keys; heads above 128 split the output columns over
  // two CTAs so the dK + dV accumulators (kDOut floats per lane) still fit.
  using DkDv = DkDvTile<kD, (kD > 128 ? 2 : 1), 4, (kD >= 128 ? 32 : 64)>;
  using Dq = DqTile<kD, 4, (kD > 128 ? 32 : 64)>;
};

template <typename T, int kD>
Status LaunchBackward(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  using DkDv = typename BwdTilesFor<kD>::DkDv;
  using Dq = typename BwdTilesFor<kD>::Dq;
  const bool stages = tc::DenseTile::Stages(p);  // (a staged bias takes more shared memory)
  return tc::LaunchBackwardKernels<T, DkDvKernel<T, DkDv>, DqKernel<T, Dq>>(
      p, {DkDv::kN, DkDv::kSplits, DkDv::kThreads,
          stages ? DkDv::template DenseSmemBytes<T>() : DkDv::template SmemBytes<T>()},
      {Dq::kM, 1, Dq::kThreads, stages ? Dq::template DenseSmemBytes<T>() : Dq::template SmemBytes<T>()}, device,
      stream);
}

}  // namespace sm80
}  // namespace jaxflash
