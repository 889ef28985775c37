// The dense bias's gradient (params.h, BwdParams::dbias) on the tensor cores:
// dB = dS = P ∘ (dP - delta) summed over the bias's broadcast axes, a pass of
// its own after the delta pre-pass, run only when the bias is differentiated.
//
// Each CTA owns a tile of dB, kM rows x kN keys of one of the bias's own
// (batch, head) pairs, and walks everything that sums into it: the call's
// batch elements and heads where the bias broadcasts over them, and every
// row tile (key tile) where it broadcasts over rows (keys). The sums stay in
// the registers of the score tile's layout, so broadcast rows or keys are
// reduced once, at the end, and every dB element is written by one CTA, in a
// fixed order: deterministic, no atomics, no scratch. Per visited tile it
// recomputes S = Q·Kᵀ and dP = dO·Vᵀ (two of the backward's products) as the
// dQ kernel does (bwd_kernel.cuh's ScoreProducts), with the same
// element-wise steps (bwd_blocks.cuh). On Hopper the same kernel runs on
// BiasGradTileSm90 (sm90/bias_grad.cu): its operands in the 128-byte swizzled
// layout and the two products as wgmma, whose accumulator fragments are the
// mma.sync layout the element-wise steps read.
#pragma once

#include <cuda_runtime.h>

#include "common/bwd_blocks.cuh"
#include "common/dense_tile.cuh"
#include "common/fwd_blocks.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "common/mma.cuh"
#include "jaxflash/params.h"
#include "sm80/bwd_kernel.cuh"
#include "sm80/launch_sm80.h"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm80 {

template <int kD_>
struct BiasGradTile {
  static constexpr bool kSwizzled = false;  // rows padded to kStride, products by mma.sync
  static constexpr int kD = kD_;
  static constexpr int kWarps = 4;
  static constexpr int kM = 16 * kWarps;       // query rows, 16 per warp
  static constexpr int kN = kD > 128 ? 32 : 64;  // keys
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMinBlocks = 1;
  static constexpr int kStride = kD + 8;  // see FwdTile
  static constexpr size_t kQBytes = size_t(kM) * kStride * 2, kKBytes = size_t(kN) * kStride * 2;
  static constexpr size_t kSmemBytes =
      2 * (kQBytes + kKBytes) + tc::DenseTile::StageBytes<kM, kN>() + kN * sizeof(float);
};

// Hopper's (D <= 128): one warpgroup on 64 rows x 64 keys, Q, dO, K and V in
// the swizzled layout wgmma reads (1024-byte aligned: +1024), two CTAs an SM.
template <int kD_>
struct BiasGradTileSm90 {
  static_assert(kD_ <= 128, "at D 256 the 64-key tile spilled (the sm80 tile runs there)");
  static constexpr bool kSwizzled = true;
  static constexpr int kD = kD_;
  static constexpr int kWarps = 4;
  static constexpr int kM = 64, kN = 64;
  static constexpr int kThreads = 128;
  static constexpr int kMinBlocks = 2;
  static constexpr int kStride = kD;
  using QTile = sm90::SwizzledTile<kM, kD>;
  using KTile = sm90::SwizzledTile<kN, kD>;
  static constexpr size_t kQBytes = QTile::kBytes, kKBytes = KTile::kBytes;
  static constexpr size_t kSmemBytes =
      2 * (kQBytes + kKBytes) + tc::DenseTile::StageBytes<kM, kN>() + kN * sizeof(float) + 1024;
};

// The bias's extent on each axis: the call's, or 1 where it broadcasts.
struct BiasExtent {
  int batch, heads, rows, keys;
  __host__ __device__ static BiasExtent Of(const BwdParams& p) {
    const DenseTerm& b = p.dense.bias;
    const AttentionShape& sh = p.shape;
    return {b.batch_stride ? int(sh.batch) : 1, b.head_stride ? int(sh.q_heads) : 1,
            b.row_stride ? int(sh.q_len) : 1, b.key_stride ? int(sh.kv_len) : 1};
  }
};

// Entry `at` of dB, in its dtype (BwdParams::dbias_dtype).
__device__ __forceinline__ void StoreBiasGrad(const BwdParams& p, int64_t at, float x) {
  switch (p.dbias_dtype) {
    case DType::kFloat16: static_cast<__half*>(p.dbias)[at] = tc::ElemTraits<__half>::FromFloat(x); break;
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(p.dbias)[at] = tc::ElemTraits<__nv_bfloat16>::FromFloat(x);
      break;
    default: static_cast<float*>(p.dbias)[at] = x;
  }
}

// S = Q·Kᵀ and dP = dO·Vᵀ of this warp's 16 rows from the operands in
// shared memory: by mma.sync from padded rows, or (kSwizzled) by wgmma.
template <typename T, typename Tile>
__device__ __forceinline__ void BiasGradProducts(float (&s)[Tile::kN / 8][4], float (&dp)[Tile::kN / 8][4],
                                                 const T* sQ, const T* sdO, const T* sK, const T* sV, int row_w,
                                                 int lane) {
  if constexpr (Tile::kSwizzled) {
#if defined(JAXFLASH_SM90A)
    using QTile = typename Tile::QTile;
    using KTile = typename Tile::KTile;
    sm90::WgmmaFence();
    sm90::ProductSS<T, QTile, KTile, Tile::kD, Tile::kN>(s, tc::SmemAddr(sQ), tc::SmemAddr(sK));
    sm90::ProductSS<T, QTile, KTile, Tile::kD, Tile::kN>(dp, tc::SmemAddr(sdO), tc::SmemAddr(sV));
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceAccumulator(s);
    sm90::FenceAccumulator(dp);
#endif
  } else {
    ScoreProducts<T, Tile::kD, Tile::kN, Tile::kStride>(s, dp, sQ, sdO, sK, sV, row_w, lane);
  }
}

// Rows [0, kRows) of a Q-like (or K-like) tile into shared memory by cp.async,
// rows past rows_valid and columns past head_dim zero-filled.
template <typename Tile, int kRows, typename T>
__device__ __forceinline__ void BiasGradLoad(T* smem, const T* g, int64_t stride, int rows_valid, int head_dim,
                                             int tid) {
  if constexpr (Tile::kSwizzled) {
#if defined(JAXFLASH_SM90A)
    sm90::LoadSwizzledTile<kRows, Tile::kD, Tile::kThreads>(tc::SmemAddr(smem), g, stride, rows_valid, head_dim, tid);
#endif
  } else {
    tc::LoadTile<kRows, Tile::kD, Tile::kThreads>(smem, Tile::kStride, g, stride, rows_valid, head_dim, tid);
  }
}

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocks) BiasGradKernel(const BwdParams p) {
  constexpr int kM = Tile::kM, kN = Tile::kN, kThreads = Tile::kThreads;
  constexpr int kNT = kN / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // (The swizzled layout's blocks start 1024-byte aligned.)
  unsigned char* base = Tile::kSwizzled ? smem_raw + ((1024u - tc::SmemAddr(smem_raw) % 1024u) % 1024u) : smem_raw;
  T* sQ = reinterpret_cast<T*>(base);
  T* sdO = reinterpret_cast<T*>(base + Tile::kQBytes);
  T* sK = reinterpret_cast<T*>(base + 2 * Tile::kQBytes);
  T* sV = reinterpret_cast<T*>(base + 2 * Tile::kQBytes + Tile::kKBytes);
  unsigned char* sBias = base + 2 * (Tile::kQBytes + Tile::kKBytes);  // when staged
  float* sCols = reinterpret_cast<float*>(sBias + tc::DenseTile::StageBytes<kM, kN>());  // [kN]: column sums

  const AttentionShape& sh = p.shape;
  const BiasExtent ext = BiasExtent::Of(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(sh.head_dim);
  const int q_len = static_cast<int>(sh.q_len), kv_len = static_cast<int>(sh.kv_len);
  const bool all_rows = ext.rows == 1, all_keys = ext.keys == 1;
  // x: the dB tile (row tile major, key tile minor); y: the bias's (batch,
  // head) items, walked with the grid's stride where they pass its limit.
  const int key_tiles = all_keys ? 1 : (ext.keys + kN - 1) / kN;
  const int own_rt = blockIdx.x / key_tiles, own_kt = blockIdx.x % key_tiles;
  for (int64_t item = blockIdx.y; item < int64_t{ext.batch} * ext.heads; item += gridDim.y) {
    const int own_b = static_cast<int>(item / ext.heads), own_h = static_cast<int>(item % ext.heads);
    // What this CTA walks on each axis, [begin, end).
    const int b_begin = ext.batch == 1 ? 0 : own_b, b_end = ext.batch == 1 ? int(sh.batch) : own_b + 1;
    const int h_begin = ext.heads == 1 ? 0 : own_h, h_end = ext.heads == 1 ? int(sh.q_heads) : own_h + 1;
    const int rt_begin = all_rows ? 0 : own_rt, rt_end = all_rows ? (q_len + kM - 1) / kM : own_rt + 1;
    const int kt_begin = all_keys ? 0 : own_kt, kt_end = all_keys ? (kv_len + kN - 1) / kN : own_kt + 1;
    const int row_w = warp * 16;
    const float scale_log2 = p.scale * tc::kLog2e;
    const bool stages = tc::DenseTile::Stages(p);

    float acc[kNT][4];
    tc::Zero(acc);

    for (int b = b_begin; b < b_end; ++b)
      for (int h = h_begin; h < h_end; ++h)
        for (int rt = rt_begin; rt < rt_end; ++rt) {
          const tc::FwdBlock<T> blk = tc::FwdBlock<T>::template At<kM, kN>(p, rt, h, b);
          const MaskPolicy& pol = blk.pol;
          const int r0 = blk.r0;
          const int k_first = MaxInt(blk.tiles.begin, kt_begin), k_last = MinInt(blk.tiles.end, kt_end);
          if (k_first >= k_last) continue;  // (uniform over the CTA)
          __syncthreads();  // everyone is done with the last item's Q and dO
          const T* gdO = static_cast<const T*>(p.dout) + tc::FwdBlock<T>::QOffset(sh, b, h, r0);
          BiasGradLoad<Tile, kM>(sQ, blk.q, blk.q_row_stride, blk.r_end - r0, head_dim, tid);
          BiasGradLoad<Tile, kM>(sdO, gdO, blk.q_row_stride, blk.r_end - r0, head_dim, tid);
          tc::RowStats rows;
          rows.Load(p, pol, b, h, r0 + row_w, lane);

          for (int nb = k_first; nb < k_last; ++nb) {
            const int c0 = nb * kN;
            __syncthreads();  // everyone is done with the last K and V
            BiasGradLoad<Tile, kN>(sK, blk.k + int64_t(c0) * blk.kv_row_stride, blk.kv_row_stride, pol.kv_valid - c0,
                                   head_dim, tid);
            BiasGradLoad<Tile, kN>(sV, blk.v + int64_t(c0) * blk.kv_row_stride, blk.kv_row_stride, pol.kv_valid - c0,
                                   head_dim, tid);
            if (stages) tc::DenseTile::Of(p, b, h).Stage<kM, kN, kThreads>(sBias, r0, c0, tid);
            tc::CpAsyncCommit();
            tc::CpAsyncWait<0>();
#if defined(JAXFLASH_SM90A)
            if constexpr (Tile::kSwizzled) sm90::FenceSharedForAsyncProxy();  // the copies, visible to wgmma
#endif
            const tc::DenseTile::View view =
                tc::DenseTile::TileBarrier(p, b, h, r0, r0 + kM, c0, c0 + kN, tid, kThreads);
            if (view == tc::DenseTile::kHidden) continue;  // dS = 0 there

            float s[kNT][4], dp[kNT][4];
            BiasGradProducts<T, Tile>(s, dp, sQ, sdO, sK, sV, row_w, lane);

            const bool full = pol.TileIsFull(r0, r0 + kM, c0, c0 + kN);
            tc::DenseTile dense = tc::DenseTile::Of(p, b, h, view);
            if (stages) dense = dense.Staged(sBias, kN, r0, c0);
            tc::QueryMajorProbs(s, rows, pol, full, r0 + row_w, c0, lane, scale_log2, tc::SoftCap::Of(p),
                                tc::AlibiBias::Of(p, pol, b, h), &dense);
            tc::QueryMajorDs(s, dp, rows);  // (no soft-cap: the handlers refuse one beside a bias)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                float ds = dp[nt][i];
                // A hidden pair has P = 0 exactly; 0 * a non-finite dP (a value
                // the row cannot see) must not reach dB, which is 0 there.
                if (!isfinite(ds) && s[nt][i] == 0.f) {
                  const int row = r0 + row_w + g + (i >> 1) * 8, col = c0 + nt * 8 + 2 * t + (i & 1);
                  if (col >= kv_len || !pol.Visible(row, col) || !dense.Shows(row, col)) ds = 0.f;
                }
                acc[nt][i] += ds;
              }
          }
        }

    // Reduce the broadcast axes and write this CTA's dB tile (float32,
    // [ext.batch, ext.heads, ext.rows, ext.keys], contiguous).
    if (all_keys) {  // sum over the columns: the lane's, then its quad's
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int nt = 1; nt < kNT; ++nt) acc[0][i] += acc[nt][i];
      }
      acc[0][0] += acc[0][1];
      acc[0][2] += acc[0][3];
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        acc[0][i] += __shfl_xor_sync(0xffffffffu, acc[0][i], 1);
        acc[0][i] += __shfl_xor_sync(0xffffffffu, acc[0][i], 2);
      }
    }
    if (all_rows) {  // sum over the rows: the lane's two, the warp's eight quads, the warps
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float x = acc[nt][j] + acc[nt][2 + j];
          x += __shfl_xor_sync(0xffffffffu, x, 4);
          x += __shfl_xor_sync(0xffffffffu, x, 8);
          x += __shfl_xor_sync(0xffffffffu, x, 16);
          acc[nt][j] = x;
        }
      for (int i = tid; i < kN; i += kThreads) sCols[i] = 0.f;
      __syncthreads();
      for (int w = 0; w < Tile::kWarps; ++w) {  // warp by warp: a fixed order of sums
        if (warp == w && g == 0) {
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) sCols[nt * 8 + 2 * t + j] += acc[nt][j];
        }
        __syncthreads();
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) acc[nt][j] = sCols[nt * 8 + 2 * t + j];
    }

    const int64_t dst = int64_t(item) * ext.rows * ext.keys;  // dB's first entry of this item
    const int row_base = all_rows ? 0 : own_rt * kM + row_w;
    const int col_base = all_keys ? 0 : own_kt * kN;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_base + g + half * 8;
      if (all_rows ? (warp != 0 || g != 0 || half != 0) : row >= ext.rows) continue;
      if (all_keys) {
        if (t == 0) StoreBiasGrad(p, dst + row, acc[0][2 * half]);
        continue;
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = col_base + nt * 8 + 2 * t + j;
          if (col < ext.keys) StoreBiasGrad(p, dst + int64_t(row) * ext.keys + col, acc[nt][2 * half + j]);
        }
    }
    __syncthreads();  // (the next item reuses the column sums and the tiles)
  }
}

template <typename T, typename Tile>
Status LaunchBiasGradientTile(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  const BiasExtent ext = BiasExtent::Of(p);
  if (int64_t{ext.batch} * ext.heads * ext.rows * ext.keys == 0) return Status::Ok();
  const int64_t tiles =
      (ext.rows == 1 ? 1 : CeilDiv(ext.rows, Tile::kM)) * (ext.keys == 1 ? 1 : CeilDiv(ext.keys, Tile::kN));
  if (tiles > INT32_MAX) return Status::Unimplemented("the bias is too large for the bias-gradient kernel's grid");
  Status st = EnsureDynamicSmem<BiasGradKernel<T, Tile>>(Tile::kSmemBytes, device);
  if (!st.ok()) return st;
  // The delta pre-pass (nothing without queries), then dB; with no keys every
  // item is empty and the kernel writes its zeros.
  if (!(st = tc::LaunchDelta<T>(p, stream)).ok()) return st;
  const int64_t items = int64_t{ext.batch} * ext.heads;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(items < 65535 ? items : 65535));
  BiasGradKernel<T, Tile><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return CheckLaunch("attention bias gradient");
}

template <typename T, int kD>
Status LaunchBiasGradient(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  return LaunchBiasGradientTile<T, BiasGradTile<kD>>(p, device, stream);
}

}  // namespace sm80
}  // namespace jaxflash
