// FlashAttention-2 backward for sm80 and later, in three kernels:
//
//   1. DeltaKernel   delta = rowsum(dO * O) - dLSE             (one warp per row)
//   2. DkDvKernel    one CTA per (key tile, kv head, batch[, d half]); walks
//                    every query tile of every query head of the GQA group
//                    that sees its keys, so dK and dV are summed over the
//                    group in registers (no per-head copies, no atomics).
//   3. DqKernel      one CTA per (query tile, head, batch); walks the key
//                    tiles its rows see, like the forward.
//
// delta needs no workspace: each row's float is parked in the first 4 bytes of
// that row's own dQ slot (a row of dQ holds head_dim >= 8 elements of 2
// bytes). DkDvKernel reads it from there; DqKernel reads its rows' values
// before it overwrites the same rows with the real dQ, and no other kernel
// writes dQ. So the handler allocates nothing for the backward.
//
// Splitting dQ into its own kernel recomputes S = QKᵀ and dP = dO·Vᵀ (7 GEMMs
// instead of 5), but needs no fp32 accumulator in memory and no atomics, so
// the backward is deterministic (bit-identical run to run) by construction.
//
// Both main kernels give each warp 16 rows of the *output* they accumulate
// (keys for dK/dV, queries for dQ), so every product is register-local: the
// score tile a warp computes is exactly the A operand of its next GEMM.
// For dK/dV that means computing Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ directly.
//
// Gradient algebra (natural-log LSE L, scale c):
//   P = exp(c·S - L),  dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP - delta),
//   dK = c·dSᵀ·Q,  dQ = c·dS·K.
#pragma once

#include <cuda_runtime.h>

#include "common/launch_util.cuh"
#include "common/mask.h"
#include "common/mma.cuh"
#include "jaxflash/params.h"
#include "sm80/launch_sm80.h"

namespace jaxflash {
namespace sm80 {

constexpr float kLog2e = 1.4426950408889634f;

// Dense-layout strides (AttentionShape's helpers are host-only).
struct Strides {
  int64_t q_row, q_batch, kv_row, kv_batch;
  __device__ __forceinline__ explicit Strides(const AttentionShape& sh) {
    q_row = sh.q_heads * sh.head_dim;
    q_batch = sh.q_len * q_row;
    kv_row = sh.kv_heads * sh.head_dim;
    kv_batch = sh.kv_len * kv_row;
  }
};

// ------------------------------------------------------------ 1. delta
// Where row (batch, t, head)'s delta lives: the start of its dQ row.
template <typename T>
__device__ __forceinline__ float* DeltaSlot(const BwdParams& p, int64_t dq_row_offset) {
  return reinterpret_cast<float*>(static_cast<T*>(p.dq) + dq_row_offset);
}

template <typename T>
__global__ void __launch_bounds__(256) DeltaKernel(const BwdParams p) {
  const AttentionShape& sh = p.shape;
  const int64_t rows = sh.batch * sh.q_len * sh.q_heads;  // in [b][t][h] order, like O
  const int64_t row = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* o = static_cast<const T*>(p.o) + row * sh.head_dim;
  const T* d_o = static_cast<const T*>(p.dout) + row * sh.head_dim;
  float acc = 0.f;
  for (int c = lane * 8; c < sh.head_dim; c += 32 * 8) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc += tc::ElemTraits<T>::ToFloat(oe[i]) * tc::ElemTraits<T>::ToFloat(de[i]);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    const int64_t h = row % sh.q_heads;
    const int64_t t = (row / sh.q_heads) % sh.q_len;
    const int64_t b = row / (sh.q_heads * sh.q_len);
    const int64_t idx = (b * sh.q_heads + h) * sh.q_len + t;
    *DeltaSlot<T>(p, row * sh.head_dim) = acc - (p.dlse ? p.dlse[idx] : 0.f);
  }
}

// ------------------------------------------------------------ 2. dK, dV
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
  template <typename T>
  static constexpr size_t SmemBytes() {
    return size_t(2 * kN + 4 * kM) * kStride * sizeof(T) + 4 * kM * sizeof(float);
  }
  static_assert(kDOut % 16 == 0 && kM % 16 == 0, "tiles are built from 16x16 mma steps");
};

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1) DkDvKernel(const BwdParams p) {
  constexpr int kD = Tile::kD, kDOut = Tile::kDOut, kN = Tile::kN, kM = Tile::kM;
  constexpr int kStride = Tile::kStride, kThreads = Tile::kThreads;
  constexpr int kQT = kM / 8;       // n8 tiles of Sᵀ per warp (queries)
  constexpr int kDT = kDOut / 8;    // n8 tiles of dK/dV per warp
  using Elem = tc::ElemTraits<T>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kN * kStride;
  T* sQ = sV + kN * kStride;    // [2][kM][kStride]
  T* sdO = sQ + 2 * kM * kStride;  // [2][kM][kStride]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * kM * kStride);  // [2][kM]
  float* sDelta = sLse + 2 * kM;                                    // [2][kM]

  const AttentionShape& sh = p.shape;
  const Strides st(sh);
  const int n_block = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z / Tile::kSplits;
  const int d_base = (blockIdx.z % Tile::kSplits) * kDOut;
  const int group = static_cast<int>(sh.q_heads / sh.kv_heads);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(sh.head_dim);
  const int q_len = static_cast<int>(sh.q_len);

  const MaskPolicy pol = MaskPolicy::For(p.mask, q_len, static_cast<int>(sh.kv_len), p.q_lengths,
                                         p.kv_lengths, batch);
  const int c0 = n_block * kN;
  const int c_end = MinInt(c0 + kN, pol.kv_valid);
  int m_begin = 0, m_count = 0;  // query tiles per head
  if (c_end > c0) {
    const int row_begin = pol.RowBegin(c0);
    const int row_end = pol.RowEnd(c_end - 1);
    if (row_end > row_begin) {
      m_begin = row_begin / kM;
      m_count = (row_end + kM - 1) / kM - m_begin;
    }
  }
  const int n_iters = group * m_count;

  const T* gK = static_cast<const T*>(p.k) + batch * st.kv_batch + c0 * st.kv_row + kv_head * sh.head_dim;
  const T* gV = static_cast<const T*>(p.v) + batch * st.kv_batch + c0 * st.kv_row + kv_head * sh.head_dim;

  // Stages query tile `it` (head, row block) into buffer it & 1.
  auto load_q_tile = [&](int it) {
    const int head = kv_head * group + it / m_count;
    const int r0 = (m_begin + it % m_count) * kM;
    const int buf = it & 1;
    const int64_t q_off = batch * st.q_batch + r0 * st.q_row + head * sh.head_dim;
    tc::LoadTile<kM, kD, kThreads>(sQ + buf * kM * kStride, kStride, static_cast<const T*>(p.q) + q_off, st.q_row,
                                   q_len - r0, head_dim, tid);
    tc::LoadTile<kM, kD, kThreads>(sdO + buf * kM * kStride, kStride, static_cast<const T*>(p.dout) + q_off,
                                   st.q_row, q_len - r0, head_dim, tid);
    const int64_t v_off = (int64_t(batch) * sh.q_heads + head) * sh.q_len + r0;
    for (int i = tid; i < kM; i += kThreads) {
      const bool ok = r0 + i < q_len;
      tc::CpAsync4(tc::SmemAddr(sLse + buf * kM + i), ok ? p.lse + v_off + i : p.lse, ok);
      tc::CpAsync4(tc::SmemAddr(sDelta + buf * kM + i), DeltaSlot<T>(p, ok ? q_off + i * st.q_row : 0), ok);
    }
  };

  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[dt][i] = dv[dt][i] = 0.f;

  if (n_iters > 0) {
    // Keys past kv_valid are zero-filled (and masked below).
    tc::LoadTile<kN, kD, kThreads>(sK, kStride, gK, st.kv_row, pol.kv_valid - c0, head_dim, tid);
    tc::LoadTile<kN, kD, kThreads>(sV, kStride, gV, st.kv_row, pol.kv_valid - c0, head_dim, tid);
    load_q_tile(0);
  }
  tc::CpAsyncCommit();

  const float scale_log2 = p.scale * kLog2e;
  const int key_w = warp * 16;  // this warp's keys within the tile

  for (int it = 0; it < n_iters; ++it) {
    if (it + 1 < n_iters) load_q_tile(it + 1);
    tc::CpAsyncCommit();
    tc::CpAsyncWait<1>();
    __syncthreads();  // tile `it` visible to all

    const int buf = it & 1;
    const T* q = sQ + buf * kM * kStride;
    const T* d_o = sdO + buf * kM * kStride;
    const float* lse = sLse + buf * kM;
    const float* dlt = sDelta + buf * kM;
    const int r0 = (m_begin + it % m_count) * kM;

    // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (16 keys x kM queries per warp)
    float s[kQT][4], dp[kQT][4];
#pragma unroll
    for (int nt = 0; nt < kQT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = dp[nt][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t ak[4], av[4];
      tc::Ldmatrix4(ak, tc::AFragAddr(sK, kStride, key_w, kk * 16, lane));
      tc::Ldmatrix4(av, tc::AFragAddr(sV, kStride, key_w, kk * 16, lane));
#pragma unroll
      for (int np = 0; np < kM / 16; ++np) {
        uint32_t b[4];
        tc::Ldmatrix4(b, tc::BFragAddrNK(q, kStride, np * 16, kk * 16, lane));
        tc::Mma<T>(s[2 * np], ak, b[0], b[1]);
        tc::Mma<T>(s[2 * np + 1], ak, b[2], b[3]);
        tc::Ldmatrix4(b, tc::BFragAddrNK(d_o, kStride, np * 16, kk * 16, lane));
        tc::Mma<T>(dp[2 * np], av, b[0], b[1]);
        tc::Mma<T>(dp[2 * np + 1], av, b[2], b[3]);
      }
    }

    // ---- Pᵀ and dSᵀ; a tile only partly visible is masked per element.
    // Query rows past q_valid are never "full" (TileIsFull needs r1 <= q_valid).
    const bool full = pol.TileIsFull(r0, r0 + kM, c0, c0 + kN);
#pragma unroll
    for (int nt = 0; nt < kQT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int qi = nt * 8 + 2 * t + (i & 1);  // query within the tile
        float pv = tc::Exp2(s[nt][i] * scale_log2 - lse[qi] * kLog2e);
        if (!full) {
          const int key = c0 + key_w + g + (i >> 1) * 8;
          if (!pol.Visible(r0 + qi, key)) pv = 0.f;
        }
        s[nt][i] = pv;
        dp[nt][i] = pv * (dp[nt][i] - dlt[qi]);
      }

    // ---- dV += Pᵀ dO and dK += dSᵀ Q over this CTA's output columns
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) {
      uint32_t ap[4], ads[4];
      ap[0] = Elem::Pack(s[2 * kk][0], s[2 * kk][1]);
      ap[1] = Elem::Pack(s[2 * kk][2], s[2 * kk][3]);
      ap[2] = Elem::Pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      ap[3] = Elem::Pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      ads[0] = Elem::Pack(dp[2 * kk][0], dp[2 * kk][1]);
      ads[1] = Elem::Pack(dp[2 * kk][2], dp[2 * kk][3]);
      ads[2] = Elem::Pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      ads[3] = Elem::Pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
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

  // ---- epilogue: keys < kv_len get their sums (zeros when no query sees them)
  T* gdK = static_cast<T*>(p.dk) + batch * st.kv_batch + c0 * st.kv_row + kv_head * sh.head_dim + d_base;
  T* gdV = static_cast<T*>(p.dv) + batch * st.kv_batch + c0 * st.kv_row + kv_head * sh.head_dim + d_base;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key_w + g + half * 8;
    if (c0 + key >= sh.kv_len) continue;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int col = dt * 8 + 2 * t;
      if (d_base + col < head_dim) {
        *reinterpret_cast<uint32_t*>(gdK + key * st.kv_row + col) =
            Elem::Pack(dk[dt][2 * half] * p.scale, dk[dt][2 * half + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(gdV + key * st.kv_row + col) =
            Elem::Pack(dv[dt][2 * half], dv[dt][2 * half + 1]);
      }
    }
  }
}

// ------------------------------------------------------------ 3. dQ
template <int kD_, int kWarps_, int kN_>
struct DqTile {
  static constexpr int kD = kD_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kM = 16 * kWarps;  // query rows per CTA, 16 per warp
  static constexpr int kN = kN_;          // keys per step
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStride = kD + 8;
  template <typename T>
  static constexpr size_t SmemBytes() {
    return size_t(2 * kM + 4 * kN) * kStride * sizeof(T);
  }
  static_assert(kD % 16 == 0 && kN % 16 == 0, "tiles are built from 16x16 mma steps");
};

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1) DqKernel(const BwdParams p) {
  constexpr int kD = Tile::kD, kM = Tile::kM, kN = Tile::kN;
  constexpr int kStride = Tile::kStride, kThreads = Tile::kThreads;
  constexpr int kNT = kN / 8, kDT = kD / 8;
  using Elem = tc::ElemTraits<T>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kM * kStride;
  T* sK = sdO + kM * kStride;  // [2][kN][kStride]
  T* sV = sK + 2 * kN * kStride;  // [2][kN][kStride]

  const AttentionShape& sh = p.shape;
  const Strides st(sh);
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int kv_head = head / static_cast<int>(sh.q_heads / sh.kv_heads);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int head_dim = static_cast<int>(sh.head_dim);

  const MaskPolicy pol = MaskPolicy::For(p.mask, static_cast<int>(sh.q_len), static_cast<int>(sh.kv_len),
                                         p.q_lengths, p.kv_lengths, batch);
  const int r0 = m_block * kM;
  const int r_end = MinInt(r0 + kM, pol.q_valid);
  int n_begin = 0, n_end = 0;
  if (r_end > r0) {
    const int key_begin = pol.KeyBegin(r0);
    const int key_end = pol.KeyEnd(r_end - 1);
    if (key_end > key_begin) {
      n_begin = key_begin / kN;
      n_end = (key_end + kN - 1) / kN;
    }
  }

  const int64_t q_off = batch * st.q_batch + r0 * st.q_row + head * sh.head_dim;
  const T* gK = static_cast<const T*>(p.k) + batch * st.kv_batch + kv_head * sh.head_dim;
  const T* gV = static_cast<const T*>(p.v) + batch * st.kv_batch + kv_head * sh.head_dim;
  auto load_kv = [&](int nb) {
    const int buf = (nb - n_begin) & 1;
    const int c0 = nb * kN;
    tc::LoadTile<kN, kD, kThreads>(sK + buf * kN * kStride, kStride, gK + int64_t(c0) * st.kv_row, st.kv_row,
                                   pol.kv_valid - c0, head_dim, tid);
    tc::LoadTile<kN, kD, kThreads>(sV + buf * kN * kStride, kStride, gV + int64_t(c0) * st.kv_row, st.kv_row,
                                   pol.kv_valid - c0, head_dim, tid);
  };

  // Per-row softmax statistics of this lane's two rows.
  const int row_w = warp * 16;
  float lse_log2[2], dlt[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = r0 + row_w + g + half * 8;
    const int64_t idx = (int64_t(batch) * sh.q_heads + head) * sh.q_len + row;
    const bool ok = row < r_end;
    lse_log2[half] = ok ? p.lse[idx] * kLog2e : 0.f;
    dlt[half] = ok ? *DeltaSlot<T>(p, q_off + (row - r0) * st.q_row) : 0.f;
  }

  float dq[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int i = 0; i < 4; ++i) dq[dt][i] = 0.f;

  if (n_begin < n_end) {
    tc::LoadTile<kM, kD, kThreads>(sQ, kStride, static_cast<const T*>(p.q) + q_off, st.q_row, r_end - r0, head_dim,
                                   tid);
    tc::LoadTile<kM, kD, kThreads>(sdO, kStride, static_cast<const T*>(p.dout) + q_off, st.q_row, r_end - r0,
                                   head_dim, tid);
    load_kv(n_begin);
  }
  tc::CpAsyncCommit();

  const float scale_log2 = p.scale * kLog2e;
  for (int nb = n_begin; nb < n_end; ++nb) {
    if (nb + 1 < n_end) load_kv(nb + 1);
    tc::CpAsyncCommit();
    tc::CpAsyncWait<1>();
    __syncthreads();
    const int buf = (nb - n_begin) & 1;
    const T* k = sK + buf * kN * kStride;
    const T* v = sV + buf * kN * kStride;
    const int c0 = nb * kN;

    // ---- S = Q Kᵀ, dP = dO Vᵀ
    float s[kNT][4], dp[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = dp[nt][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t aq[4], ado[4];
      tc::Ldmatrix4(aq, tc::AFragAddr(sQ, kStride, row_w, kk * 16, lane));
      tc::Ldmatrix4(ado, tc::AFragAddr(sdO, kStride, row_w, kk * 16, lane));
#pragma unroll
      for (int np = 0; np < kN / 16; ++np) {
        uint32_t b[4];
        tc::Ldmatrix4(b, tc::BFragAddrNK(k, kStride, np * 16, kk * 16, lane));
        tc::Mma<T>(s[2 * np], aq, b[0], b[1]);
        tc::Mma<T>(s[2 * np + 1], aq, b[2], b[3]);
        tc::Ldmatrix4(b, tc::BFragAddrNK(v, kStride, np * 16, kk * 16, lane));
        tc::Mma<T>(dp[2 * np], ado, b[0], b[1]);
        tc::Mma<T>(dp[2 * np + 1], ado, b[2], b[3]);
      }
    }

    // ---- dS = P ∘ (dP - delta)
    const bool full = pol.TileIsFull(r0, r0 + kM, c0, c0 + kN);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i >> 1;
        float pv = tc::Exp2(s[nt][i] * scale_log2 - lse_log2[half]);
        if (!full) {
          const int row = r0 + row_w + g + half * 8;
          const int col = c0 + nt * 8 + 2 * t + (i & 1);
          if (!pol.Visible(row, col)) pv = 0.f;
        }
        dp[nt][i] = pv * (dp[nt][i] - dlt[half]);
      }

    // ---- dQ += dS K
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[4];
      a[0] = Elem::Pack(dp[2 * kk][0], dp[2 * kk][1]);
      a[1] = Elem::Pack(dp[2 * kk][2], dp[2 * kk][3]);
      a[2] = Elem::Pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      a[3] = Elem::Pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
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
  // Every lane has read its rows' delta (stored in these dQ rows) before any
  // lane overwrites them.
  __syncthreads();

  T* gdQ = static_cast<T*>(p.dq) + q_off;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_w + g + half * 8;
    if (r0 + row >= sh.q_len) continue;
    const bool real = r0 + row < pol.q_valid;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int col = dt * 8 + 2 * t;
      if (col < head_dim) {
        *reinterpret_cast<uint32_t*>(gdQ + row * st.q_row + col) =
            real ? Elem::Pack(dq[dt][2 * half] * p.scale, dq[dt][2 * half + 1] * p.scale) : 0u;
      }
    }
  }
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
Status LaunchBackward(const BwdParams& p, void* workspace, const CudaDevice& device, cudaStream_t stream) {
  using Tiles = BwdTilesFor<kD>;
  using DkDv = typename Tiles::DkDv;
  using Dq = typename Tiles::Dq;
  (void)workspace;  // BackwardWorkspaceBytes is 0: delta lives in dQ (see the top of this file)
  const AttentionShape& sh = p.shape;

  constexpr auto dkdv = DkDvKernel<T, DkDv>;
  constexpr auto dq = DqKernel<T, Dq>;
  const size_t dkdv_smem = DkDv::template SmemBytes<T>();
  const size_t dq_smem = Dq::template SmemBytes<T>();
  Status st = EnsureDynamicSmem<dkdv>(dkdv_smem, device);
  if (!st.ok()) return st;
  st = EnsureDynamicSmem<dq>(dq_smem, device);
  if (!st.ok()) return st;

  if (sh.batch == 0 || sh.q_heads == 0) return Status::Ok();

  // q_len == 0 or kv_len == 0 leaves a grid empty; the other kernel still
  // writes its zeros (dK = dV = 0 with no queries, dQ = 0 with no keys).
  const int64_t rows = sh.batch * sh.q_len * sh.q_heads;
  if (rows > 0) {
    DeltaKernel<T><<<static_cast<unsigned>(CeilDiv(rows, 8)), 256, 0, stream>>>(p);
    st = CheckLaunch("attention backward (delta)");
    if (!st.ok()) return st;
  }

  if (sh.kv_len > 0) {
    const dim3 grid_kv(static_cast<unsigned>(CeilDiv(sh.kv_len, DkDv::kN)), static_cast<unsigned>(sh.kv_heads),
                       static_cast<unsigned>(sh.batch * DkDv::kSplits));
    dkdv<<<grid_kv, DkDv::kThreads, dkdv_smem, stream>>>(p);
    st = CheckLaunch("attention backward (dK, dV)");
    if (!st.ok()) return st;
  }

  if (sh.q_len > 0) {
    const dim3 grid_q(static_cast<unsigned>(CeilDiv(sh.q_len, Dq::kM)), static_cast<unsigned>(sh.q_heads),
                      static_cast<unsigned>(sh.batch));
    dq<<<grid_q, Dq::kThreads, dq_smem, stream>>>(p);
    st = CheckLaunch("attention backward (dQ)");
  }
  return st;
}

}  // namespace sm80
}  // namespace jaxflash
