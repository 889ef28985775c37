// FlashAttention-2 backward for sm80 and later.
//
//   1. DeltaKernel   delta = rowsum(dO * O) - dLSE into the workspace (one warp
//                    per row); also zeroes the row's fp32 dQ accumulator.
//   2. DkDvKernel    one CTA per (key tile, kv head, batch); walks every query
//                    tile of every query head of the GQA group that sees its
//                    keys, so dK and dV are summed over the group in registers
//                    (no per-head copies). Unless the call asks for a
//                    deterministic backward it also adds each step's dQ = dS·K
//                    into the fp32 accumulator with atomics (5 tile products
//                    per step, as FlashAttention-2).
//   3a. DqConvert    dQ = scale * accumulator, in the input dtype.
//   3b. DqKernel     (deterministic) one CTA per (query tile, head, batch)
//                    that recomputes S and dP for its rows (7 products instead
//                    of 5, but no atomics: bit-identical run to run).
//
// DkDvKernel splits each pair of warps by role over the same 16·kMT keys:
// warp 0 of a pair computes Sᵀ = K·Qᵀ, turns it into Pᵀ and accumulates
// dV += Pᵀ·dO; warp 1 computes dPᵀ = V·dOᵀ, takes Pᵀ from its partner through
// shared memory, forms dSᵀ = Pᵀ∘(dPᵀ - delta) and accumulates dK += dSᵀ·Q.
// Each warp thus holds one accumulator (dV or dK) for two m16 key tiles, so
// every shared-memory fragment feeds two mma instead of one; holding both for
// 16 keys (the usual split) costs twice the fragment loads per product.
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

// Index of (batch, head, row) in the [B, N, T] row statistics (lse, delta).
__device__ __forceinline__ int64_t StatIndex(const AttentionShape& sh, int64_t b, int64_t h, int64_t t) {
  return (b * sh.q_heads + h) * sh.q_len + t;
}

// ------------------------------------------------------------ 1. delta
template <typename T>
__global__ void __launch_bounds__(256) DeltaKernel(const BwdParams p, float* dq_accum) {
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
  if (dq_accum != nullptr) {
    float4* dst = reinterpret_cast<float4*>(dq_accum + row * sh.head_dim);
    for (int c = lane; c < sh.head_dim / 4; c += 32) dst[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    const int64_t h = row % sh.q_heads;
    const int64_t t = (row / sh.q_heads) % sh.q_len;
    const int64_t b = row / (sh.q_heads * sh.q_len);
    const int64_t idx = StatIndex(sh, b, h, t);
    p.delta[idx] = acc - (p.dlse ? p.dlse[idx] : 0.f);
  }
}

// ------------------------------------------------------------ 2. dK, dV (and dQ atomics)
template <int kD_, int kMT_, int kPairs_, int kM_>
struct DkDvTile {
  static constexpr int kD = kD_;
  static constexpr int kMT = kMT_;        // m16 key tiles per warp
  static constexpr int kPairs = kPairs_;  // warp pairs; each pair owns 16 * kMT keys
  static constexpr int kWarps = 2 * kPairs;
  static constexpr int kN = 16 * kMT * kPairs;  // keys per CTA
  static constexpr int kM = kM_;                // query rows per step
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kCtasPerSm = kWarps <= 4 ? 2 : 1;
  static constexpr int kStride = kD + 8;   // see FwdTile
  static constexpr int kDsStride = kM + 8;  // dSᵀ rows (keys) of kM queries, padded like kStride
  // The dQ step splits the kM x kD tile by columns over kDqWarps warps (the
  // most that leave each a multiple of 16 columns); the others skip it.
  static constexpr int kDqWarps = [] {
    int w = kWarps;
    while ((kD / 16) % w != 0) --w;
    return w;
  }();
  static constexpr int kDqCols = kD / kDqWarps;
  template <typename T>
  static constexpr size_t SmemBytes() {
    return size_t(2 * kN + 4 * kM) * kStride * sizeof(T)  // K, V, 2 x (Q, dO)
           + 4 * kM * sizeof(float)                       // 2 x (lse, delta)
           + size_t(kN) * kM * sizeof(float)              // Pᵀ handed from warp 0 to warp 1 of a pair
           + size_t(kN) * kDsStride * sizeof(T);          // dSᵀ for the dQ step
  }
  static_assert(kD % 16 == 0 && kM % 16 == 0, "tiles are built from 16x16 mma steps");
  static_assert(kDqCols % 16 == 0, "each warp takes whole n16 column pairs of dQ");
};

// Synchronises the two warps of pair `pair` (named barriers 1.., 64 threads;
// barrier 0 is __syncthreads).
__device__ __forceinline__ void PairBarrier(int pair) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(pair + 1) : "memory");
}

template <typename T, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kCtasPerSm) DkDvKernel(const BwdParams p, float* dq_accum) {
  constexpr int kD = Tile::kD, kN = Tile::kN, kM = Tile::kM, kMT = Tile::kMT;
  constexpr int kStride = Tile::kStride, kThreads = Tile::kThreads, kDsStride = Tile::kDsStride;
  constexpr int kQT = kM / 8;  // n8 tiles of queries per key m-tile
  constexpr int kDT = kD / 8;  // n8 tiles of the dK or dV accumulator
  using Elem = tc::ElemTraits<T>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kN * kStride;
  T* sQ = sV + kN * kStride;       // [2][kM][kStride]
  T* sdO = sQ + 2 * kM * kStride;  // [2][kM][kStride]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * kM * kStride);  // [2][kM]
  float* sDelta = sLse + 2 * kM;                                    // [2][kM]
  float* sP = sDelta + 2 * kM;                                      // [kPairs][kMT][kQT][32 lanes][4]
  T* sdS = reinterpret_cast<T*>(sP + kN * kM);                      // [kN][kDsStride], dSᵀ

  const AttentionShape& sh = p.shape;
  const Strides st(sh);
  const int n_block = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int group = static_cast<int>(sh.q_heads / sh.kv_heads);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pair = warp >> 1;
  const bool is_dk = warp & 1;  // role: 0 = Pᵀ and dV, 1 = dSᵀ and dK
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
    const int64_t v_off = StatIndex(sh, batch, head, r0);
    for (int i = tid; i < kM; i += kThreads) {
      const bool ok = r0 + i < q_len;
      tc::CpAsync4(tc::SmemAddr(sLse + buf * kM + i), ok ? p.lse + v_off + i : p.lse, ok);
      tc::CpAsync4(tc::SmemAddr(sDelta + buf * kM + i), ok ? p.delta + v_off + i : p.delta, ok);
    }
  };

  float acc[kMT][kDT][4];  // dV (role 0) or dK (role 1) of this warp's keys
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][dt][i] = 0.f;

  if (n_iters > 0) {
    // Keys past kv_valid are zero-filled (and masked below).
    tc::LoadTile<kN, kD, kThreads>(sK, kStride, gK, st.kv_row, pol.kv_valid - c0, head_dim, tid);
    tc::LoadTile<kN, kD, kThreads>(sV, kStride, gV, st.kv_row, pol.kv_valid - c0, head_dim, tid);
    load_q_tile(0);
  }
  tc::CpAsyncCommit();

  const float scale_log2 = p.scale * kLog2e;
  const int key_w = pair * 16 * kMT;  // this pair's keys within the tile
  float4* my_p = reinterpret_cast<float4*>(sP) + pair * kMT * kQT * 32 + lane;

  for (int it = 0; it < n_iters; ++it) {
    if (it + 1 < n_iters) load_q_tile(it + 1);
    tc::CpAsyncCommit();
    tc::CpAsyncWait<1>();
    __syncthreads();  // tile `it` visible to all; the previous step's readers are done

    const int buf = it & 1;
    const T* q = sQ + buf * kM * kStride;
    const T* d_o = sdO + buf * kM * kStride;
    const float* lse = sLse + buf * kM;
    const float* dlt = sDelta + buf * kM;
    const int head = kv_head * group + it / m_count;
    const int r0 = (m_begin + it % m_count) * kM;

    // ---- role 0: Sᵀ = K Qᵀ; role 1: dPᵀ = V dOᵀ (16 kMT keys x kM queries)
    float x[kMT][kQT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kQT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) x[mt][nt][i] = 0.f;
    {
      const T* a_src = is_dk ? sV : sK;
      const T* b_src = is_dk ? d_o : q;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          tc::Ldmatrix4(a[mt], tc::AFragAddr(a_src, kStride, key_w + mt * 16, kk * 16, lane));
        }
#pragma unroll
        for (int np = 0; np < kM / 16; ++np) {
          uint32_t b[4];
          tc::Ldmatrix4(b, tc::BFragAddrNK(b_src, kStride, np * 16, kk * 16, lane));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            tc::Mma<T>(x[mt][2 * np], a[mt], b[0], b[1]);
            tc::Mma<T>(x[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }

    if (!is_dk) {
      // ---- Pᵀ; a tile only partly visible is masked per element. Query rows
      // past q_valid are never "full" (TileIsFull needs r1 <= q_valid).
      const bool full = pol.TileIsFull(r0, r0 + kM, c0, c0 + kN);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kQT; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int qi = nt * 8 + 2 * t + (i & 1);  // query within the tile
            float pv = tc::Exp2(x[mt][nt][i] * scale_log2 - lse[qi] * kLog2e);
            if (!full) {
              const int key = c0 + key_w + mt * 16 + g + (i >> 1) * 8;
              if (!pol.Visible(r0 + qi, key)) pv = 0.f;
            }
            x[mt][nt][i] = pv;
          }
          my_p[(mt * kQT + nt) * 32] = make_float4(x[mt][nt][0], x[mt][nt][1], x[mt][nt][2], x[mt][nt][3]);
        }
      PairBarrier(pair);
    } else {
      // ---- dSᵀ = Pᵀ ∘ (dPᵀ - delta), with Pᵀ from the partner warp (same
      // fragment layout, so each lane reads back exactly its own positions).
      PairBarrier(pair);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kQT; ++nt) {
          const float4 pv = my_p[(mt * kQT + nt) * 32];
          const float pe[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int qi = nt * 8 + 2 * t + (i & 1);
            x[mt][nt][i] = pe[i] * (x[mt][nt][i] - dlt[qi]);
          }
          if (dq_accum != nullptr) {  // dSᵀ for the dQ step, [key][query]
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int key = key_w + mt * 16 + g + half * 8;
              *reinterpret_cast<uint32_t*>(sdS + key * kDsStride + nt * 8 + 2 * t) =
                  Elem::Pack(x[mt][nt][2 * half], x[mt][nt][2 * half + 1]);
            }
          }
        }
    }

    // ---- role 0: dV += Pᵀ dO; role 1: dK += dSᵀ Q
    {
      const T* b_src = is_dk ? q : d_o;
#pragma unroll
      for (int kk = 0; kk < kM / 16; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          a[mt][0] = Elem::Pack(x[mt][2 * kk][0], x[mt][2 * kk][1]);
          a[mt][1] = Elem::Pack(x[mt][2 * kk][2], x[mt][2 * kk][3]);
          a[mt][2] = Elem::Pack(x[mt][2 * kk + 1][0], x[mt][2 * kk + 1][1]);
          a[mt][3] = Elem::Pack(x[mt][2 * kk + 1][2], x[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
          uint32_t b[4];
          tc::Ldmatrix4Trans(b, tc::BFragAddrKN(b_src, kStride, kk * 16, dp * 16, lane));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            tc::Mma<T>(acc[mt][2 * dp], a[mt], b[0], b[1]);
            tc::Mma<T>(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }

    // ---- dQ[r0.., head] += dS K over this CTA's keys, added atomically;
    // each warp takes kDqCols columns of the kM x kD tile.
    // Every pair's dSᵀ is in shared memory for the dQ step; and, with or
    // without that step, no warp may start the next one (whose first act
    // refills buffer `buf`) while another still reads `buf`.
    __syncthreads();
    if (dq_accum != nullptr && warp < Tile::kDqWarps) {
      constexpr int kCols = Tile::kDqCols;
      const int col0 = warp * kCols;
      float dq[kM / 16][kCols / 8][4];
#pragma unroll
      for (int mt = 0; mt < kM / 16; ++mt)
#pragma unroll
        for (int nt = 0; nt < kCols / 8; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) dq[mt][nt][i] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t a[kM / 16][4];
#pragma unroll
        for (int mt = 0; mt < kM / 16; ++mt) {
          tc::Ldmatrix4Trans(a[mt], tc::AFragAddrKM(sdS, kDsStride, mt * 16, kk * 16, lane));
        }
#pragma unroll
        for (int np = 0; np < kCols / 16; ++np) {
          uint32_t b[4];
          tc::Ldmatrix4Trans(b, tc::BFragAddrKN(sK, kStride, kk * 16, col0 + np * 16, lane));
#pragma unroll
          for (int mt = 0; mt < kM / 16; ++mt) {
            tc::Mma<T>(dq[mt][2 * np], a[mt], b[0], b[1]);
            tc::Mma<T>(dq[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }
      float* dst = dq_accum + batch * st.q_batch + int64_t(r0) * st.q_row + head * sh.head_dim;
      const int rows_added = pol.q_valid - r0;  // dS is zero past q_valid
#pragma unroll
      for (int mt = 0; mt < kM / 16; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = mt * 16 + g + half * 8;
          if (row >= rows_added) continue;
#pragma unroll
          for (int nt = 0; nt < kCols / 8; ++nt) {
            const int col = col0 + nt * 8 + 2 * t;
            if (col < head_dim) {
              atomicAdd(dst + row * st.q_row + col, dq[mt][nt][2 * half]);
              atomicAdd(dst + row * st.q_row + col + 1, dq[mt][nt][2 * half + 1]);
            }
          }
        }
    }
  }
  tc::CpAsyncWait<0>();

  // ---- epilogue: keys < kv_len get their sums (zeros when no query sees them)
  T* gOut = static_cast<T*>(is_dk ? p.dk : p.dv) + batch * st.kv_batch + c0 * st.kv_row + kv_head * sh.head_dim;
  const float out_scale = is_dk ? p.scale : 1.f;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = key_w + mt * 16 + g + half * 8;
      if (c0 + key >= sh.kv_len) continue;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        const int col = dt * 8 + 2 * t;
        if (col < head_dim) {
          *reinterpret_cast<uint32_t*>(gOut + key * st.kv_row + col) =
              Elem::Pack(acc[mt][dt][2 * half] * out_scale, acc[mt][dt][2 * half + 1] * out_scale);
        }
      }
    }
}

// ------------------------------------------------------------ 3a. dQ from the accumulator
template <typename T>
__global__ void __launch_bounds__(256) DqConvertKernel(const BwdParams p, const float* dq_accum, int64_t n4) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  const float4 a = reinterpret_cast<const float4*>(dq_accum)[i];
  uint2 out;
  out.x = tc::ElemTraits<T>::Pack(a.x * p.scale, a.y * p.scale);
  out.y = tc::ElemTraits<T>::Pack(a.z * p.scale, a.w * p.scale);
  reinterpret_cast<uint2*>(p.dq)[i] = out;
}

// ------------------------------------------------------------ 3b. dQ, deterministic
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
    dlt[half] = ok ? p.delta[idx] : 0.f;
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
// DkDvTile<kD, m16 key tiles per warp, warp pairs, query rows per step>
// candidates per bucket (the first is the default); one accumulator of
// kMT * kD / 2 floats per lane bounds kMT. The deterministic dQ pass has one
// shape per bucket.
template <int kD>
struct BwdCandidates;
template <>
struct BwdCandidates<32> {
  using type = TileList<DkDvTile<32, 2, 2, 64>, DkDvTile<32, 2, 2, 32>>;
};
template <>
struct BwdCandidates<64> {
  using type = TileList<DkDvTile<64, 2, 2, 64>, DkDvTile<64, 2, 2, 32>, DkDvTile<64, 2, 4, 32>>;
};
template <>
struct BwdCandidates<96> {
  using type = TileList<DkDvTile<96, 2, 2, 32>, DkDvTile<96, 1, 4, 32>>;
};
template <>
struct BwdCandidates<128> {
  using type = TileList<DkDvTile<128, 2, 2, 32>, DkDvTile<128, 2, 4, 32>, DkDvTile<128, 1, 4, 32>>;
};
template <>
struct BwdCandidates<192> {
  using type = TileList<DkDvTile<192, 1, 4, 32>, DkDvTile<192, 1, 2, 32>>;
};
template <>
struct BwdCandidates<256> {
  using type = TileList<DkDvTile<256, 1, 4, 32>, DkDvTile<256, 1, 2, 32>>;
};

inline int BwdTilePick(int /*head_dim_bucket*/, bool /*causal*/) { return 0; }

template <int kD>
using DqTileFor = DqTile<kD, 4, (kD > 128 ? 32 : 64)>;

template <typename T, int kD>
Status LaunchBackward(const BwdParams& p, void* workspace, const CudaDevice& device, cudaStream_t stream) {
  const AttentionShape& sh = p.shape;
  float* dq_accum = p.deterministic ? nullptr
                                    : reinterpret_cast<float*>(static_cast<char*>(workspace) + DeltaBytesAligned(p));
  using Dq = DqTileFor<kD>;
  constexpr auto dq_kernel = DqKernel<T, Dq>;
  const size_t dq_smem = Dq::template SmemBytes<T>();
  if (p.deterministic) {
    Status st = EnsureDynamicSmem<dq_kernel>(dq_smem, device);
    if (!st.ok()) return st;
  }
  const bool causal = p.mask.window_right >= 0;
  return BwdCandidates<kD>::type::With(TileIndex(p.tile, BwdTilePick(kD, causal)), [&](auto tile) {
    using DkDv = decltype(tile);
    constexpr auto dkdv = DkDvKernel<T, DkDv>;
    const size_t dkdv_smem = DkDv::template SmemBytes<T>();
    Status st = EnsureDynamicSmem<dkdv>(dkdv_smem, device);
    if (!st.ok()) return st;
    if (sh.batch == 0 || sh.q_heads == 0) return Status::Ok();

    // q_len == 0 or kv_len == 0 leaves a grid empty; the other kernels still
    // write their zeros (dK = dV = 0 with no queries, dQ = 0 with no keys).
    const int64_t rows = sh.batch * sh.q_len * sh.q_heads;
    if (rows > 0) {
      DeltaKernel<T><<<static_cast<unsigned>(CeilDiv(rows, 8)), 256, 0, stream>>>(p, dq_accum);
      st = CheckLaunch("attention backward (delta)");
      if (!st.ok()) return st;
    }
    if (sh.kv_len > 0) {
      const dim3 grid_kv(static_cast<unsigned>(CeilDiv(sh.kv_len, DkDv::kN)), static_cast<unsigned>(sh.kv_heads),
                         static_cast<unsigned>(sh.batch));
      dkdv<<<grid_kv, DkDv::kThreads, dkdv_smem, stream>>>(p, dq_accum);
      st = CheckLaunch("attention backward (dK, dV)");
      if (!st.ok()) return st;
    }
    if (rows == 0) return Status::Ok();
    if (dq_accum != nullptr) {
      const int64_t n4 = rows * sh.head_dim / 4;
      DqConvertKernel<T><<<static_cast<unsigned>(CeilDiv(n4, 256)), 256, 0, stream>>>(p, dq_accum, n4);
      return CheckLaunch("attention backward (dQ convert)");
    }
    const dim3 grid_q(static_cast<unsigned>(CeilDiv(sh.q_len, Dq::kM)), static_cast<unsigned>(sh.q_heads),
                      static_cast<unsigned>(sh.batch));
    dq_kernel<<<grid_q, Dq::kThreads, dq_smem, stream>>>(p);
    return CheckLaunch("attention backward (dQ)");
  });
}

}  // namespace sm80
}  // namespace jaxflash
