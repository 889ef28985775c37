// Decode forward: short queries against long K/V (a KV-cache step, chunked
// prefill, speculative decoding) for sm80 and later, Hopper included. The
// work is bound by K/V bandwidth, so mma.sync keeps up and one kernel family
// serves both architectures.
//
// One CTA takes kM packed rows (the query heads of one GQA group times the
// query rows, common/decode.h) of one (batch, K/V head), and one split of the
// key tiles those rows visit (split-KV). Every K/V tile is therefore read once
// per K/V head and split, by 16-byte cp.async copies, kStages tiles deep, so
// several tiles are in flight while one is computed. The warps cut each tile
// into kWarpsN key slices (and the rows into kWarpsM groups of 16); every warp
// keeps its own online-softmax state over its slices, and the epilogue
// combines the warps of a row group through shared memory. With one split it
// writes O and LSE; with several it writes the split's normalised output and
// base-2 LSE to the partial buffers, and merge.cu combines them. The row
// rules of params.h and common/decode.h hold in both: emptiness comes from
// the mask, and a row whose stored output shows a NaN although its LSE does
// not (a masked pair's 0 * NaN in P·V) is recomputed pair by pair
// (common/exact_rows.cuh) after the store.
//
// K/V rows are addressed through PagedKv::Row, so the same kernel reads a
// dense cache or a paged one; keys past the batch element's length are
// zero-filled and never read. V may have a head dim of its own (MLA): the
// tile's kD is the wider of the two, each side's columns past its own dim
// land as zeros in shared memory (nothing padded in global memory, which
// the decode step's bandwidth would pay for), and O is stored at v's width.
#pragma once

#include <cuda_runtime.h>

#include "common/decode.h"
#include "common/exact_rows.cuh"
#include "common/fwd_blocks.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "common/mma.cuh"
#include "common/softmax.cuh"
#include "decode/kv_stages.cuh"
#include "decode/launch_decode.h"
#include "sm90/tensor_map.h"
#include "jaxflash/params.h"

namespace jaxflash {
namespace decode {

__host__ __device__ constexpr int ClampInt(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

template <int kD_, int kWarpsM_, int kN_ = 64>
struct DecodeTile {
  static constexpr int kD = kD_;
  static constexpr int kWarps = 4;
  static constexpr int kWarpsM = kWarpsM_;          // warps along the packed rows, 16 rows each
  static constexpr int kWarpsN = kWarps / kWarpsM;  // warps along the keys of a tile
  static constexpr int kM = 16 * kWarpsM;           // packed rows per CTA
  static constexpr int kN = kN_;                    // keys per K/V tile (the split unit)
  static constexpr int kNw = kN / kWarpsN;          // keys of a tile per warp
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStride = kD + 8;  // +16 bytes: conflict-free ldmatrix (mma.cuh)
  static constexpr int kNT = kNw / 8;     // n8 tiles of scores per warp
  static constexpr int kDT = kD / 8;      // n8 tiles of output per warp
  static constexpr int kStageElems = 2 * kN * kStride;  // K then V, 2-byte elements
  // As many stages as fit beside Q in 112 KiB (2 to 4): two CTAs per H100 SM
  // at head dims up to 128 with either tile (the 64-row one at 3 stages took
  // 119 KiB, one CTA per SM, and ran a long decode step in 1.8 waves where
  // the split heuristic counted on one), and two to four tiles in flight per CTA.
  static constexpr int kQBytes = kM * kStride * 2;
  static constexpr int kStages = ClampInt((112 * 1024 - kQBytes) / (kStageElems * 2), 2, 4);
  static constexpr size_t kTileBytes = size_t(kQBytes) + size_t(kStages) * kStageElems * 2;
  // Epilogue scratch, over the (then unused) tiles: each warp's 16 output rows
  // (padded by 4 floats against bank conflicts) and per-row (max, sum).
  static constexpr int kOStride = kD + 4;
  // Then each row's LSE and exact-recomputation flag.
  static constexpr size_t kCombineBytes = (size_t(kWarps) * 16 * (kOStride + 2) + 2 * kM) * sizeof(float);
  static constexpr size_t kSmemBytes = kTileBytes > kCombineBytes ? kTileBytes : kCombineBytes;
  static_assert(kD % 16 == 0 && kNw % 16 == 0, "tiles are built from 16x16 mma steps");
  // Every candidate must launch on sm80 too (A100: 163 KiB per block).
  static_assert(kSmemBytes <= 163 * 1024, "decode tile exceeds the sm80 shared-memory limit");
  // CTAs per H100 SM by shared memory (228 KiB, less 1 KiB the system keeps
  // per CTA). The split heuristic counts two, one for the two tiles whose
  // two stages leave no room for a second (jaxflash/_splits.py,
  // _ONE_DECODE_CTA_PER_SM); this keeps the two in step.
  static constexpr int kCtasPerH100Sm = int(228 * 1024 / (kSmemBytes + 1024));
  static constexpr bool kOneCtaPerSm = (kD == 192 && kM == 64) || (kD == 256 && kM == 16);
  static_assert(kOneCtaPerSm ? kCtasPerH100Sm == 1 : kCtasPerH100Sm >= 2,
                "jaxflash/_splits.py's _ONE_DECODE_CTA_PER_SM lists exactly the one-CTA decode tiles");
};

// Two shapes per head-dim bucket: 16-row CTAs (a decode step of up to 16
// packed rows: GQA groups up to 16, or q_len x group <= 16), whose four warps
// split every tile's keys, and 64-row CTAs for longer queries, whose warps
// split the rows (32-key tiles at head_dim 256, so that Q and two stages fit
// in an A100's shared memory). The launcher picks by packed rows; the tile
// attribute can force either (tests).
template <int kD>
using DecodeCandidates = TileList<DecodeTile<kD, 1>, DecodeTile<kD, 4, kD == 256 ? 32 : 64>>;

inline int DecodeTilePick(int packed_rows) { return packed_rows <= 16 ? 0 : 1; }

// Q rows [r0, r0 + kM) of the packed rows into sQ; rows past the packed total
// and columns past head_dim are zero-filled.
template <typename Tile, typename T>
__device__ __forceinline__ void LoadPackedQ(T* sQ, const FwdParams& p, const PackedRows& rows, int batch,
                                            int kv_head, int r0, int tid) {
  constexpr int kChunks = Tile::kD / 8;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  const T* q = static_cast<const T*>(p.q);
  for (int idx = tid; idx < Tile::kM * kChunks; idx += Tile::kThreads) {
    const int row = idx / kChunks, col = (idx % kChunks) * 8;
    const bool ok = r0 + row < rows.total && col < head_dim;
    const int64_t offset = ok ? rows.Offset(p.shape, batch, kv_head, r0 + row) + col : 0;
    tc::CpAsync16(tc::SmemAddr(sQ + row * Tile::kStride + col), q + offset, ok);
  }
}

// Packed row r of (batch, kv_head) with the keys of [k0, k1) it sees, its K/V
// rows addressed through PagedKv::Row: the row type tc::ExactOutputOf takes.
template <typename T>
struct ExactPackedRow {
  int begin, end, dim, vdim, batch, row;  // dim: q and k's; vdim: v and o's
  const FwdParams& p;
  const MaskPolicy& pol;
  const T *k, *v;

  __device__ __forceinline__ ExactPackedRow(const FwdParams& p_, const MaskPolicy& pol, const PackedRows& rows,
                                            int batch_, int kv_head, int r, int k0, int k1)
      : begin(MaxInt(pol.KeyBegin(rows.QueryRow(r)), k0)),
        end(MinInt(pol.KeyEnd(rows.QueryRow(r)), k1)),
        dim(static_cast<int>(p_.shape.head_dim)),
        vdim(static_cast<int>(p_.shape.v_dim())),
        batch(batch_),
        row(rows.QueryRow(r)),
        p(p_),
        pol(pol),
        k(static_cast<const T*>(p_.k) + int64_t(kv_head) * p_.shape.head_dim),
        v(static_cast<const T*>(p_.v) + int64_t(kv_head) * p_.shape.v_dim()),
        alibi(Alibi::Of(p_.alibi, batch_, rows.Head(kv_head, r), p_.shape.q_heads)),
        diagonal(Alibi::Diagonal(pol, row)) {}
  // Key j's row among the cache's (dense or paged).
  __device__ __forceinline__ int64_t RowOf(int j) const { return p.paged.Row(batch, p.shape.kv_len, j); }
  __device__ __forceinline__ const T* Key(int j) const { return k + RowOf(j) * p.shape.kv_row_stride(); }
  __device__ __forceinline__ const T* Value(int j) const { return v + RowOf(j) * p.shape.v_row_stride(); }
  __device__ __forceinline__ bool Sees(int j) const { return pol.SameSegment(row, j); }
  __device__ __forceinline__ float Bias(int j) const { return alibi.Bias(diagonal, static_cast<float>(j)); }
  Alibi alibi;  // the row's head's slope (common/alibi.h)
  float diagonal;
};

// Shared memory of a decode CTA with loader Kv: the K/V stages (aligned as
// the loader needs), Q, then the loader's barriers; the epilogue's scratch
// reuses the stages (and Q).
template <typename Tile, typename Kv>
struct DecodeSmem {
  static constexpr size_t kStagesBytes = size_t(Tile::kStages) * Kv::kStageBytes;
  static constexpr size_t kBarrierBytes = Kv::kTma ? 8 * Tile::kStages : 0;
  static constexpr size_t kUsed = kStagesBytes + Tile::kQBytes + kBarrierBytes;
  static constexpr size_t kBytes = (Kv::kAlign > 16 ? Kv::kAlign : 0) + kUsed;
  static_assert(Tile::kCombineBytes <= kStagesBytes + Tile::kQBytes, "the epilogue's scratch stays off the barriers");
  // The stage counts (and the CTAs per SM the split heuristic counts on) are
  // those of the padded cp.async layout, the larger one.
  static_assert(kBytes <= Tile::kSmemBytes, "the TMA layout fits where the cp.async one does");
  __device__ static unsigned char* Base(unsigned char* raw) {
    return raw + (Kv::kAlign - tc::SmemAddr(raw) % Kv::kAlign) % Kv::kAlign;
  }
};

#if defined(JAXFLASH_SM90A)
constexpr bool kTmaCode = true;  // this pass compiles sm_90a code: the TMA loader's body is real
#else
constexpr bool kTmaCode = false;
#endif

template <typename T, typename Tile, typename Kv>
__device__ __forceinline__ void DecodeCta(const FwdParams& p, const KvMaps& maps);

// The TMA loader's kernels are empty outside the sm_90a binary; the launcher
// picks them only on a GPU that loads it.
template <typename T, typename Tile, typename Kv>
__global__ void __launch_bounds__(Tile::kThreads, 2)
    DecodeKernel(const FwdParams p, const __grid_constant__ KvMaps maps) {
  if constexpr (!Kv::kTma || kTmaCode) DecodeCta<T, Tile, Kv>(p, maps);
}

template <typename T, typename Tile, typename Kv>
__device__ __forceinline__ void DecodeCta(const FwdParams& p, const KvMaps& maps) {
  constexpr int kD = Tile::kD, kM = Tile::kM, kN = Tile::kN, kNw = Tile::kNw;
  constexpr int kNT = Tile::kNT, kDT = Tile::kDT, kStride = Tile::kStride;
  constexpr int kStages = Tile::kStages;
  constexpr int kWarpsN = Tile::kWarpsN, kThreads = Tile::kThreads, kOStride = Tile::kOStride;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = DecodeSmem<Tile, Kv>::Base(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem + DecodeSmem<Tile, Kv>::kStagesBytes);

  const AttentionShape& sh = p.shape;
  const PackedRows rows = PackedRows::For(sh);
  const int q_tiles = (rows.total + kM - 1) / kM;
  const int tile = blockIdx.x % q_tiles;  // query tiles vary fastest: CTAs that read
  const int split = blockIdx.x / q_tiles;  // the same K/V run side by side (L2 reuse)
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const MaskPolicy pol = MaskPolicy::For(p.mask, static_cast<int>(sh.q_len), static_cast<int>(sh.kv_len),
                                         p.q_lengths, p.kv_lengths, batch);
  const int r0 = tile * kM;
  // The real query rows among this CTA's packed rows: [q0, q_end).
  const int q0 = rows.QueryRow(r0);
  const int q_end = MinInt(rows.QueryRow(MinInt(r0 + kM, rows.total) - 1) + 1, pol.q_valid);
  const tc::KeyTiles visited = tc::KeyTileRange<kN>(pol, q0, q_end);
  const Span span = SplitSpan(visited.begin, visited.end, split, p.num_splits);
  const int n_tiles = span.end - span.begin;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int warp_row0 = wm * 16;  // the warp's rows within the CTA

  float o[1][kDT][4];
  tc::Zero(o[0]);
  tc::OnlineSoftmax<1> softmax;
  softmax.Init();

  // The K/V stages; a paged loader reads the entries of the next tile to be
  // issued one tile early.
  Kv kv(smem, p, maps, batch, kv_head, pol.kv_valid, tid);
  const auto key_of = [&](int i) { return (span.begin + i) * kN; };
  if (n_tiles > 0) {
    kv.Init();
    // Q joins the first stage's copy group; the prologue fills kStages - 1
    // stages (committing empty groups past the span keeps the count uniform).
    LoadPackedQ<Tile>(sQ, p, rows, batch, kv_head, r0, tid);
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < n_tiles) {
        kv.Prefetch(key_of(st));
        kv.Issue(st, key_of(st));
      }
      kv.Commit();
    }
    if (kStages - 1 < n_tiles) kv.Prefetch(key_of(kStages - 1));
  }

  const float scale_log2 = p.scale * tc::kLog2e;
  const auto query_row = [rows](int r) { return rows.QueryRow(r); };
  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it % kStages;
    kv.Wait(stage, it, key_of(it));
    __syncthreads();  // tile `it` visible to all; everyone is done with tile it - 1's stage
    const int ahead = it + kStages - 1;
    if (ahead < n_tiles) {
      kv.Issue(ahead % kStages, key_of(ahead));
      if (ahead + 1 < n_tiles) kv.Prefetch(key_of(ahead + 1));
    }
    kv.Commit();
    const int key_slice = wn * kNw;          // the warp's keys within the tile
    const int c0 = (span.begin + it) * kN + key_slice;

    // ---- S = Q Kᵀ over the warp's keys
    float s[1][kNT][4];
    tc::Zero(s[0]);
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a[4];
      tc::Ldmatrix4(a, tc::AFragAddr(sQ, kStride, warp_row0, kk * 16, lane));
#pragma unroll
      for (int np = 0; np < kNw / 16; ++np) {
        uint32_t b[4];
        tc::Ldmatrix4(b, kv.KeyFrag(stage, key_slice + np * 16, kk * 16, lane));
        tc::Mma<T>(s[0][2 * np], a, b[0], b[1]);
        tc::Mma<T>(s[0][2 * np + 1], a, b[2], b[3]);
      }
    }

    const bool full = pol.TileIsFull(q0, q_end, c0, c0 + kNw);
    tc::ScaleAndMask(s, pol, full, r0, warp_row0, c0, lane, scale_log2, query_row, tc::SoftCap::Of(p),
                     tc::PackedAlibi::Of(p, pol, rows, batch, kv_head, r0 + warp_row0, lane));
    softmax.Update(s, o);

    // ---- O += P V, P straight from the score registers
#pragma unroll
    for (int kk = 0; kk < kNw / 16; ++kk) {
      uint32_t a[4];
      tc::PackAFragment<T>(s[0], kk, a);
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        uint32_t b[4];
        tc::Ldmatrix4Trans(b, kv.ValueFrag(stage, key_slice + kk * 16, dp * 16, lane));
        tc::Mma<T>(o[0][2 * dp], a, b[0], b[1]);
        tc::Mma<T>(o[0][2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

  // ---- Epilogue. Combine the warps that share a row group: per row, the
  // overall max M and sum L of their states, then each warp's output rescaled
  // by 2^(m_warp - M) / L into shared memory (over the tiles, now unused).
  tc::CpAsyncWait<0>();
  __syncthreads();
  float* sO = reinterpret_cast<float*>(smem);             // [kWarps][16][kOStride]
  float* sStats = sO + Tile::kWarps * 16 * kOStride;      // [kWarps][16] x (max, sum)
  float* sLse = sStats + Tile::kWarps * 16 * 2;             // [kM] the row's LSE (natural log)
  int* sRedo = reinterpret_cast<int*>(sLse + kM);           // [kM] recompute the row exactly
  // The split's keys: a row that sees none of them gets O = 0 (and
  // kEmptyRowLse), whatever its accumulator holds.
  const int k0 = span.begin * kN, k1 = span.end * kN;
  const auto seen = [&](int r) { return r < rows.total && pol.HasKeysIn(rows.QueryRow(r), k0, k1); };
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float l = tc::QuadSum(softmax.l[half]);
    if (t == 0) {
      sStats[(warp * 16 + g + 8 * half) * 2] = softmax.m[half];
      sStats[(warp * 16 + g + 8 * half) * 2 + 1] = l;
    }
  }
  __syncthreads();
  const int v_dim = static_cast<int>(sh.v_dim());  // O's columns (a tile's past v_dim are zeros)
  const bool partial = p.num_splits > 1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = g + 8 * half;  // within the warp's 16
    const float* stats = sStats + (wm * kWarpsN * 16 + row) * 2;
    float m_all = -INFINITY;
#pragma unroll
    for (int j = 0; j < kWarpsN; ++j) m_all = tc::MaxNaN(m_all, stats[j * 32]);
    // m_all = -inf: no warp saw a finite visible score (an empty row or split,
    // or scores all -inf). As in a dense softmax the latter gets 0 / 0 = NaN;
    // a split keeps its accumulator (l_all taken as 1) and LSE -inf for the
    // merge. A NaN m_all makes the row NaN.
    float l_all = 0.f, weight = 1.f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int j = 0; j < kWarpsN; ++j) l_all += stats[j * 32 + 1] * tc::Exp2(stats[j * 32] - m_all);
      weight = tc::Exp2(softmax.m[half] - m_all);
    }
    if (partial && l_all == 0.f) l_all = 1.f;
    const float factor = weight / l_all;
    float* dst = sO + (warp * 16 + row) * kOStride + 2 * t;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      dst[dt * 8] = o[0][dt][2 * half] * factor;
      dst[dt * 8 + 1] = o[0][dt][2 * half + 1] * factor;
    }
    const int r = r0 + warp_row0 + row;
    if (wn == 0 && t == 0 && r < rows.total) {
      const float lse2 = m_all + __log2f(l_all);
      const bool keys = seen(r);
      sLse[warp_row0 + row] = lse2 * 0.6931471805599453f;  // natural log
      sRedo[warp_row0 + row] = 0;
      if (partial) {
        p.lse_partial[rows.PartialRow(sh, p.num_splits, batch, split, kv_head, r)] = keys ? lse2 : kEmptyRowLse;
      } else {
        p.lse[rows.LseIndex(sh, batch, kv_head, r)] = keys ? lse2 * 0.6931471805599453f : kEmptyRowLse;
      }
    }
  }
  __syncthreads();

  // Sum each row over its warps and store it, 8 columns per thread: O in the
  // input dtype, or the split's float32 partial. Rows that see no key of the
  // split (padding queries among them) are stored as zeros; a NaN in a row
  // whose LSE is not NaN (nor, unsplit, -inf: then the row is 0 / 0) flags it.
  constexpr int kChunks = kD / 8;
  const auto out_of = [&](int r) -> int64_t {
    return partial ? rows.PartialRow(sh, p.num_splits, batch, split, kv_head, r) * v_dim
                   : rows.OutOffset(sh, batch, kv_head, r);
  };
  const auto store = [&](int r, int col, const float* x, int n) {
    if (partial) {
      for (int e = 0; e < n; ++e) p.o_partial[out_of(r) + col + e] = x[e];
    } else {
      T* dst = static_cast<T*>(p.o) + out_of(r) + col;
      for (int e = 0; e < n; ++e) dst[e] = tc::ElemTraits<T>::FromFloat(x[e]);
    }
  };
  for (int idx = tid; idx < kM * kChunks; idx += kThreads) {
    const int row = idx / kChunks, col = (idx % kChunks) * 8;
    const int r = r0 + row;
    if (r >= rows.total || col >= v_dim) continue;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (seen(r)) {
      const float* src = sO + ((row / 16) * kWarpsN * 16 + row % 16) * kOStride + col;
      bool nan = false;
#pragma unroll
      for (int j = 0; j < kWarpsN; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += src[j * 16 * kOStride + e];
#pragma unroll
      for (int e = 0; e < 8; ++e) nan |= isnan(acc[e]);
      const float lse = sLse[row];
      if (nan && !isnan(lse) && (partial || lse != -INFINITY)) sRedo[row] = 1;
    }
    if (partial) {
      float4* dst = reinterpret_cast<float4*>(p.o_partial + out_of(r) + col);
      dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
      uint4 packed;
      packed.x = tc::ElemTraits<T>::Pack(acc[0], acc[1]);
      packed.y = tc::ElemTraits<T>::Pack(acc[2], acc[3]);
      packed.z = tc::ElemTraits<T>::Pack(acc[4], acc[5]);
      packed.w = tc::ElemTraits<T>::Pack(acc[6], acc[7]);
      *reinterpret_cast<uint4*>(static_cast<T*>(p.o) + out_of(r) + col) = packed;
    }
  }
  __syncthreads();
  // Flagged rows (only ever with a non-finite input), one warp per row.
  for (int row = warp; row < kM; row += Tile::kWarps) {
    if (r0 + row >= rows.total || !sRedo[row]) continue;
    const int r = r0 + row;
    const ExactPackedRow<T> exact(p, pol, rows, batch, kv_head, r, k0, k1);
    const T* q_row = static_cast<const T*>(p.q) + rows.Offset(sh, batch, kv_head, r);
    tc::ExactOutputOf<T>(exact, q_row, p.scale, p.softcap, sLse[row], lane, [&](int d, float x) { store(r, d, &x, 1); });
  }
}

// Whether the TMA loader takes a call of a tile whose head dim is whole
// 64-column blocks (on a GPU that runs sm_90a code): dense K/V, or pages of a
// power-of-two size of at least 8 keys, whose boxes start on whole swizzle
// atoms. Pages shorter than a key tile cost a TMA request each (up to 8 per tile
// instead of 1); 16-row tiles, which wait on memory, still gain, but 64-row
// ones, whose warps compute 4x as much per tile, lost to cp.async there (H100,
// page 16, q_len 16: 359 vs 334 us at B 8, 446 vs 427 at B 64; fifteenth session
// in docs/performance.md). Other pages and the 32 and 96 buckets keep cp.async.
template <typename Tile>
bool TmaLoaderTakes(const FwdParams& p) {
  if (p.paged.table == nullptr) return true;
  return p.paged.page_shift >= 3 && (p.paged.page_size >= Tile::kN || Tile::kM == 16);
}

// The K and V maps of the TMA loader: boxes of `rows` keys x 64 columns of
// one K/V head, over [batch, kv_len] rows or, paged, [num_pages, page_size];
// V's at its own head dim (a block past it is the TMA's zero fill).
inline Status EncodeKvMaps(KvMaps* maps, const FwdParams& p, int rows) {
  AttentionShape sh = p.shape;
  if (p.paged.table != nullptr) {
    sh.batch = p.paged.num_pages;
    sh.kv_len = p.paged.page_size;
    rows = p.paged.page_size < rows ? static_cast<int>(p.paged.page_size) : rows;
  }
  sh.kv_len = sh.kv_len > 0 ? sh.kv_len : 1;  // a map needs a non-empty extent; no key is read then
  sh.batch = sh.batch > 0 ? sh.batch : 1;
  Status st = sm90::EncodeRowsMap(&maps->k, p.k, p.dtype, sh, false, rows);
  return st.ok() ? sm90::EncodeRowsMap(&maps->v, p.v, p.dtype, sh, false, rows, sh.v_dim()) : st;
}

template <typename T, typename Tile, typename Kv>
Status LaunchDecodeKernel(const FwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  constexpr size_t kSmem = DecodeSmem<Tile, Kv>::kBytes;
  Status st = EnsureDynamicSmem<DecodeKernel<T, Tile, Kv>>(kSmem, device);
  if (!st.ok()) return st;
  const int64_t packed = p.shape.q_len * p.shape.group_size();
  if (packed == 0 || p.shape.batch == 0 || p.shape.kv_heads == 0) return Status::Ok();
  const int64_t ctas = CeilDiv(packed, Tile::kM) * p.num_splits;
  if (ctas >= (int64_t{1} << 31)) return Status::Unimplemented("decode kernel: too many query tiles x splits");
  KvMaps maps{};
  if (Kv::kTma && !(st = EncodeKvMaps(&maps, p, Tile::kN)).ok()) return st;
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(p.shape.kv_heads),
                  static_cast<unsigned>(p.shape.batch));
  DecodeKernel<T, Tile, Kv><<<grid, Tile::kThreads, kSmem, stream>>>(p, maps);
  return CheckLaunch("decode forward");
}

// Launches the decode forward (and, when split, the merge) for one (dtype,
// head-dim bucket); instantiated per bucket in decode_d*.cu. `tma` says the
// GPU runs the sm_90a code (dispatch.cu); TmaLoaderTakes then decides.
template <typename T, int kD>
Status LaunchDecode(const FwdParams& p, const CudaDevice& device, cudaStream_t stream, bool tma) {
  const int64_t packed = p.shape.q_len * p.shape.group_size();
  if (packed >= (int64_t{1} << 30)) {
    return Status::Unimplemented("decode kernel: q_len x (query heads per K/V head) must be below 2^30");
  }
  const int pick = DecodeTilePick(static_cast<int>(packed));
  // A forced index names a decode candidate (tests); a tile cache preference
  // was measured for the forward's candidates, so the decode table decides.
  const int tile = (p.tile & FwdParams::kTilePreferred) ? 0 : p.tile % FwdParams::kTileSm80;
  return DecodeCandidates<kD>::With(tile, pick, [&](auto tile) {
    using Tile = decltype(tile);
    const auto launch = [&]() -> Status {
      if constexpr (kD % 64 == 0) {  // the TMA loader's stages are whole 64-column swizzle blocks
        if (tma && TmaLoaderTakes<Tile>(p)) return LaunchDecodeKernel<T, Tile, TmaKvStages<Tile, T>>(p, device, stream);
      }
      return LaunchDecodeKernel<T, Tile, CpAsyncKvStages<Tile, T>>(p, device, stream);
    };
    const Status st = launch();
    // An empty call launched nothing; the merge has no rows then and returns.
    if (!st.ok() || p.num_splits == 1) return st;
    return LaunchMergeSplits<T>(p, stream);
  });
}

}  // namespace decode
}  // namespace jaxflash
