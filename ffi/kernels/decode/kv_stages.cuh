// How the decode kernel's K/V tiles reach shared memory: a ring of kStages
// stages, each one key tile (K rows, then V rows), filled a few tiles ahead of
// the one being computed. Two loaders with one interface:
//
//   CpAsyncKvStages (sm80 and later): every thread copies 16-byte chunks with
//     cp.async into rows padded against ldmatrix bank conflicts; a stage has
//     landed when the thread's copy group has (the kernel then meets the CTA).
//   TmaKvStages (sm_90a): a few threads have the tensor-memory accelerator
//     copy whole boxes into 128-byte-swizzled tiles (sm90/wgmma.cuh); a stage
//     has landed when its mbarrier has counted the bytes. Streaming a decode
//     step's K/V on an H100, TMA boxes read 3.00-3.07 TB/s where 16-byte
//     cp.async copies read 2.84-2.91 (docs/performance.md, fifteenth
//     session): the decode kernel is bound by that rate.
//
// What the kernel calls:
//   Init()                  before the first copy (the CTA meets inside)
//   Prefetch(key0)          reads the page-table entries of the next Issue (paged)
//   Issue(stage, key0)      starts copying keys [key0, key0 + kN) into a stage
//   Commit()                closes one loop step's copies
//   Wait(stage, it, key0)   until tile `it` (keys from key0) has landed in `stage`
//   KeyFrag / ValueFrag     ldmatrix addresses of a stage's K (B operand of
//                           Q·Kᵀ) and V (transposed B operand of P·V) fragments
// Keys at or past the batch element's length are zero (V) or masked (K) in
// both: a NaN stored there meets no product.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "common/mma.cuh"
#include "jaxflash/params.h"
#include "sm90/barrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace decode {

// The TMA loader's tensor maps (encoded on the host per call; the cp.async
// loader gets them zeroed and ignores them).
struct KvMaps {
  CUtensorMap k, v;
};

// The K/V rows one thread copies for a tile: one 16-byte column chunk of
// kRows consecutive rows. Consecutive, so that a page of kRows keys or more
// (power-of-two sizes, every usual page) holds all of a thread's rows: one
// table entry and one address computation per tile, then a row stride per
// row, as for a dense cache (PageEntries::OnePage).
template <typename Tile>
struct KvCopySlots {
  static constexpr int kChunksPerRow = Tile::kD / 8;
  static constexpr int kSlots = tc::ChunkSlots(kChunksPerRow);
  static constexpr int kRows = Tile::kN * kSlots / Tile::kThreads;
  static_assert(Tile::kThreads % kSlots == 0 && Tile::kN % kRows == 0, "threads must cover whole rows");
  __device__ static bool Idle(int tid) { return kSlots != kChunksPerRow && tid % kSlots >= kChunksPerRow; }
  __device__ static int First(int tid) { return tid / kSlots * kRows; }
  __device__ static int Col(int tid) { return (tid % kSlots) * 8; }
};

// Page-table entries of a thread's rows of one tile (paged K/V only). They
// are read a tile before that tile's copies are issued: a lookup is a load
// whose round trip the copies would otherwise wait for, every tile. When one
// page holds all of a thread's rows (OnePage, the same for every thread) only
// entry[0] is read; otherwise one entry per row.
template <typename Tile>
struct PageEntries {
  using Slots = KvCopySlots<Tile>;
  int32_t entry[Slots::kRows];

  // Tiles start at multiples of kN and a thread's rows at multiples of kRows,
  // so a power-of-two page of at least kRows keys never cuts them.
  __device__ static bool OnePage(const FwdParams& p) {
    return p.paged.page_shift >= 0 && p.paged.page_size >= Slots::kRows;
  }
  __device__ __forceinline__ void Read(const FwdParams& p, int batch, int key0, int kv_valid, int tid) {
    if (p.paged.table == nullptr || Slots::Idle(tid)) return;
    const int first = key0 + Slots::First(tid);
    const int n = OnePage(p) ? 1 : Slots::kRows;
#pragma unroll
    for (int it = 0; it < Slots::kRows; ++it) {
      if (it < n) entry[it] = first + it < kv_valid ? p.paged.Entry(batch, first + it) : 0;
    }
  }
};

// Keys [key0, key0 + kN) of one K/V head into a stage (K rows, then V rows).
// Each thread owns one 16-byte column chunk and walks its rows; their
// addresses are dense, or a page's rows from the entries read beforehand,
// shared by the K and V copies. Keys at or past kv_valid are zero-filled:
// their copies pass src-size 0 and read nothing, so their addresses are
// computed like the others' (no select per row).
template <typename Tile, typename T>
__device__ __forceinline__ void LoadKvTile(T* stage, const T* gK, const T* gV, const FwdParams& p, int batch,
                                           int key0, int kv_valid, int tid, const PageEntries<Tile>& pages) {
  using Slots = KvCopySlots<Tile>;
  if (Slots::Idle(tid)) return;
  const int col = Slots::Col(tid), row0 = Slots::First(tid), first = key0 + row0;
  // V may be narrower than K (MLA; the tile is the wider's): its columns past
  // v_dim, like K's past head_dim, are zero-filled.
  const bool k_col = col < static_cast<int>(p.shape.head_dim), v_col = col < static_cast<int>(p.shape.v_dim());
  const int64_t k_stride = p.shape.kv_row_stride(), v_stride = p.shape.v_row_stride();
  T* sK = stage + row0 * Tile::kStride + col;
  T* sV = sK + Tile::kN * Tile::kStride;
  const auto copy = [&](int it, int64_t kv_row) {
    const bool ok = first + it < kv_valid;
    tc::CpAsync16(tc::SmemAddr(sK + it * Tile::kStride), gK + kv_row * k_stride + col, ok && k_col);
    tc::CpAsync16(tc::SmemAddr(sV + it * Tile::kStride), gV + kv_row * v_stride + col, ok && v_col);
  };
  if (p.paged.table == nullptr || PageEntries<Tile>::OnePage(p)) {
    // The thread's rows are consecutive in memory: dense, or within one page.
    const int64_t kv_row0 = p.paged.table == nullptr ? batch * p.shape.kv_len + first
                                                     : p.paged.PagedRow(first, pages.entry[0]);
#pragma unroll
    for (int it = 0; it < Slots::kRows; ++it) copy(it, kv_row0 + it);
  } else {
#pragma unroll
    for (int it = 0; it < Slots::kRows; ++it) copy(it, p.paged.PagedRow(first + it, pages.entry[it]));
  }
}

// ---------------------------------------------------------------- cp.async
template <typename Tile, typename T>
struct CpAsyncKvStages {
  static constexpr bool kTma = false;
  static constexpr int kAlign = 16;
  static constexpr int kStageBytes = Tile::kStageElems * 2;

  T* stages;
  const T *gK, *gV;
  const FwdParams& p;
  int batch, kv_valid, tid;
  PageEntries<Tile> pages;

  __device__ __forceinline__ CpAsyncKvStages(unsigned char* base, const FwdParams& p_, const KvMaps&, int batch_,
                                             int kv_head, int kv_valid_, int tid_)
      : stages(reinterpret_cast<T*>(base)),
        gK(static_cast<const T*>(p_.k) + int64_t(kv_head) * p_.shape.head_dim),
        gV(static_cast<const T*>(p_.v) + int64_t(kv_head) * p_.shape.v_dim()),
        p(p_),
        batch(batch_),
        kv_valid(kv_valid_),
        tid(tid_) {}

  __device__ __forceinline__ void Init() {}
  __device__ __forceinline__ void Prefetch(int key0) { pages.Read(p, batch, key0, kv_valid, tid); }
  __device__ __forceinline__ void Issue(int stage, int key0) {
    LoadKvTile<Tile>(stages + stage * Tile::kStageElems, gK, gV, p, batch, key0, kv_valid, tid, pages);
  }
  __device__ __forceinline__ void Commit() { tc::CpAsyncCommit(); }
  // A group per loop step, kStages - 1 issued ahead: all but the newest
  // kStages - 2 have landed once tile `it`'s has.
  __device__ __forceinline__ void Wait(int, int, int) { tc::CpAsyncWait<Tile::kStages - 2>(); }

  __device__ __forceinline__ uint32_t KeyFrag(int stage, int n0, int c0, int lane) const {
    return tc::BFragAddrNK(stages + stage * Tile::kStageElems, Tile::kStride, n0, c0, lane);
  }
  __device__ __forceinline__ uint32_t ValueFrag(int stage, int k0, int n0, int lane) const {
    return tc::BFragAddrKN(stages + stage * Tile::kStageElems + Tile::kN * Tile::kStride, Tile::kStride, k0, n0,
                           lane);
  }
};

// ---------------------------------------------------------------- TMA
// Boxes of a dense cache [batch, kv_len, kv_heads, head_dim] are kN keys of
// one (batch, K/V head) by 64 columns; of a paged cache [num_pages,
// page_size, kv_heads, head_dim] min(kN, page_size) keys of one page, so a
// tile is kN / box_rows boxes (1 to 8: the host takes power-of-two pages of
// at least 8 keys, whose boxes start on whole 1024-byte swizzle atoms) per
// 64-column block of K and of V. A thread issues at most one copy of a tile,
// spread over the warps (lane l of warp w issues copy 4l + w: each warp's
// share of the serial TMA issue is a quarter), and reads its box's
// page-table entry a tile early. Rows past kv_len are the TMA's zero fill;
// rows of a tile's real keys past the batch element's length (a ragged
// cache, or a page's tail) are zeroed in V after they land, and read from
// page 0 when their page lies past the length.
template <typename Tile, typename T>
struct TmaKvStages {
  using Layout = sm90::SwizzledTile<Tile::kN, Tile::kD>;
  static constexpr bool kTma = true;
  static constexpr int kAlign = 1024;  // swizzle atoms
  static constexpr int kStageBytes = 2 * Layout::kBytes;

  uint32_t stages, bars;  // shared addresses: the stages, then (after Q) one "full" barrier per stage
  const FwdParams& p;
  const KvMaps& maps;
  int batch, kv_head, kv_valid, tid;
  int box_rows, boxes, copies;  // copies per tile: boxes x column blocks x {K, V}, at most 64
  int copy;                     // the copy this thread issues (when below `copies`)
  int32_t entry;  // paged: the page-table entry of this thread's box of the next Issue

  __device__ __forceinline__ TmaKvStages(unsigned char* base, const FwdParams& p_, const KvMaps& maps_, int batch_,
                                         int kv_head_, int kv_valid_, int tid_)
      : stages(tc::SmemAddr(base)),
        bars(stages + Tile::kStages * kStageBytes + Tile::kQBytes),
        p(p_),
        maps(maps_),
        batch(batch_),
        kv_head(kv_head_),
        kv_valid(kv_valid_),
        tid(tid_),
        box_rows(p_.paged.table != nullptr && p_.paged.page_size < Tile::kN ? int(p_.paged.page_size) : Tile::kN),
        boxes(Tile::kN / box_rows),
        copies(boxes * Layout::kBlocks * 2),
        copy(tid % 32 * Tile::kWarps + tid / 32) {}
  static_assert(Tile::kN / 8 * Layout::kBlocks * 2 <= Tile::kThreads, "one copy per thread at most");

  __device__ __forceinline__ void Init() {
    if (tid == 0) {
      for (int s = 0; s < Tile::kStages; ++s) sm90::MBarrier::Init(bars + 8 * s, 1);
      sm90::MBarrier::FenceInit();
      sm90::PrefetchTensorMap(maps.k);
      sm90::PrefetchTensorMap(maps.v);
    }
    __syncthreads();
  }
  // Only the load here: its value is first used a tile later, in Issue.
  __device__ __forceinline__ void Prefetch(int key0) {
    if (copy >= copies || p.paged.table == nullptr) return;
    const int key = key0 + (copy % boxes) * box_rows;
    entry = key < kv_valid ? p.paged.Entry(batch, key) : 0;  // keys past the length read page 0
  }
  __device__ __forceinline__ void Issue(int stage, int key0) {
    const uint32_t bar = bars + 8 * stage;
    // The expected bytes may arrive after some copies have landed: the phase
    // cannot complete before this, its one arrival.
    if (tid == 0) sm90::MBarrier::ArriveExpectBytes(bar, kStageBytes);
    if (copy >= copies) return;
    // The box's first key row and its batch element or page (PagedRow clamps
    // the entry; the row is split back into page and row within it).
    const int box = copy % boxes, block = copy / boxes / 2, value = copy / boxes % 2;
    const int key = key0 + box * box_rows;
    int row = key, outer = batch;
    if (p.paged.table != nullptr) {
      const int64_t r = p.paged.PagedRow(key, entry);
      outer = static_cast<int>(r >> p.paged.page_shift);
      row = static_cast<int>(r & (p.paged.page_size - 1));
    }
    const uint32_t dst =
        stages + stage * kStageBytes + value * Layout::kBytes + block * Layout::kBlockBytes + box * box_rows * 128;
    sm90::TmaLoad4d(dst, value ? maps.v : maps.k, bar, 64 * block, kv_head, row, outer);
  }
  // The kernel's own cp.async copies (Q, issued before the prologue) join
  // the first group: wait_group covers committed groups only.
  __device__ __forceinline__ void Commit() { tc::CpAsyncCommit(); }
  __device__ __forceinline__ void Wait(int stage, int it, int key0) {
    tc::CpAsyncWait<0>();  // Q, before the first tile
    sm90::MBarrier::Wait(bars + 8 * stage, (it / Tile::kStages) & 1);
    if (key0 + Tile::kN > kv_valid) {
      sm90::ZeroTileRows<Layout, Tile::kThreads>(stages + stage * kStageBytes + Layout::kBytes, kv_valid - key0, tid);
      sm90::FenceSharedForAsyncProxy();  // before a later copy refills the stage
    }
  }

  __device__ __forceinline__ uint32_t KeyFrag(int stage, int n0, int c0, int lane) const {
    const tc::FragCoord f = tc::BFragCoordNK(n0, c0, lane);
    return stages + stage * kStageBytes + Layout::ChunkOffset(f.row, f.col >> 3);
  }
  __device__ __forceinline__ uint32_t ValueFrag(int stage, int k0, int n0, int lane) const {
    const tc::FragCoord f = tc::BFragCoordKN(k0, n0, lane);
    return stages + stage * kStageBytes + Layout::kBytes + Layout::ChunkOffset(f.row, f.col >> 3);
  }
};

}  // namespace decode
}  // namespace jaxflash
