// Persistent tile scheduler: a grid of about one CTA per SM walks the work
// tiles (a block of query rows of one (batch, head)) in a fixed order, CTA c
// taking positions c, c + ctas, ... of the walk. Producer and consumer
// warpgroups of a CTA walk the same sequence, so they need not share it
// through memory.
//
// The order serves two ends: every CTA gets the same amount of work, and
// tiles that read the same K/V run side by side, so K/V come from HBM once
// and from L2 for the others. The query heads of one GQA group are adjacent.
//
//   no diagonal   every row block of a (batch, head) has the same keys: its
//                 row blocks are adjacent, the heads follow one another.
//   diagonal      (causal, windows) row block m sees about m + 1 key tiles.
//                 Blocks are paired, m with m_blocks - 1 - m, whose key
//                 tiles add up to the same count for every pair: a CTA runs
//                 the heavy block of a pair in one round of the walk and its
//                 light block in the next, so every CTA's work is the same,
//                 and the ctas pairs of a round are consecutive pairs of a
//                 few (batch, head)s, whose K/V fit in L2. (Ordering all
//                 heavy blocks first instead balanced the work but ran one
//                 block of every (batch, head) at a time: at S 1k and 2k
//                 causal each tile read its K/V from HBM, and the forward
//                 moved 2.2-2.6 TB/s, HBM-bound; ninth session.)
//                 Where that balance fails, the heaviest row blocks simply
//                 come first, the light ones filling in at the end: an odd
//                 count of row blocks (the middle one, a pair alone, has half
//                 the work, and the same CTAs would get it every round), or
//                 pairs that fill their rounds less than 90% (fewer pairs
//                 than CTAs, a last round mostly empty: small problems, whose
//                 tiles mostly run at once anyway).
//   dense term    a bias or mask broadcast over the batch (no diagonal):
//   shared by     the batch elements of a (head, row block) are adjacent,
//   the batch     so they read its bias rows at once and all but one from
//                 L2; with the (batch, head)s outermost they ran a batch
//                 element apart and each read its own copy from HBM.
//   segment ids   a row block's work is its place in its document, which no
//                 fixed assignment can know: packed rows of random documents
//                 (bench_packed.py's) left the paired walk's busiest CTA with
//                 1.40x the mean work (a model of the forward's key tiles,
//                 docs/performance-log.md, forty-third session). So the CTAs
//                 claim their tiles as they free up (WorkClaims), in chunks
//                 of heads whose K/V fit in L2 together, each chunk's row
//                 blocks last first with its heads inner: list scheduling,
//                 1.03x the mean in the same model (tools/grid_order_model.py
//                 --packed). Where a tile builds it (WsFwdTile::kDynamicWalk,
//                 fwd_ws_kernel.cuh).
//                 Each chunk's row blocks go heaviest first (Ranked): a CTA
//                 claims its next tile as it starts the one before (the
//                 walk's protocol, WsWalk), so it commits a tile ahead, and
//                 with the blocks last first, whose work rises and falls
//                 with each document, the last claims left the busiest SM
//                 1.12x the mean active cycles, the idlest 0.92x (ncu, H200,
//                 fiftieth session; the model with the claim a tile ahead:
//                 1.06-1.12x); ranked, the model gives 1.01-1.04x. The rank
//                 is per batch element (all heads of a row share its
//                 documents), made by every CTA at its start in shared
//                 memory (RankRowBlocks) where the blocks are few enough.
#pragma once

#include <atomic>

#include "jaxflash/params.h"

namespace jaxflash {
namespace sm90 {

struct WorkTile {
  int m_block;
  int head;
  int batch;
};

// The claim counters of dynamic walks: a launch takes a slot (the host picks
// them in turn, so launches running side by side on other streams use other
// counters unless 64 launches apart: a captured graph keeps the slot it was
// captured with), its CTAs claim positions from the slot's counter, and the
// last CTA to finish sets the slot back to zero for the next launch (a
// graph's replays included). Each translation unit has its own counters (an
// unnamed namespace: the kernels of one head-dim bucket share them).
namespace {
constexpr int kWorkClaimSlots = 64;
__device__ int g_work_claims[2 * kWorkClaimSlots];  // per slot: positions claimed, CTAs done

struct WorkClaims {
  int slot;  // (the counters' address is built at each use: the producer's registers are few)

  // The slot of the next launch.
  static int NextSlot() {
    static std::atomic<unsigned> launches{0};
    return static_cast<int>(launches.fetch_add(1, std::memory_order_relaxed) % kWorkClaimSlots);
  }
  // The next of the positions past the CTAs' first ones, 0-based.
  __device__ __forceinline__ int Claim() const { return atomicAdd(g_work_claims + 2 * slot, 1); }
  // Called once per CTA, after its last claim (whose result it has used).
  __device__ __forceinline__ void Finish() const {
    __threadfence();
    if (atomicAdd(g_work_claims + 2 * slot + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(g_work_claims + 2 * slot, 0);
      atomicExch(g_work_claims + 2 * slot + 1, 0);
    }
  }
};
}  // namespace

struct TileScheduler {
  int m_blocks;
  int heads;      // query heads; the heads of one GQA group are consecutive
  int batches;
  int ctas;       // CTAs walking them
  int positions;  // the walk's length: a position may hold no tile (paired order)
  bool heavy_first;  // a diagonal mask: row blocks differ in work
  bool paired;
  bool batch_inner;  // a dense term shared by the batch: its batch elements side by side
  int chunk_heads;  // > 0: the segment ids' walk, (batch, head)s per chunk

  // Work tiles of a launch (the host sizes the grid by them).
  __host__ __device__ static int64_t Tiles(const AttentionShape& sh, int rows) {
    return (sh.q_len + rows - 1) / rows * sh.q_heads * sh.batch;
  }

  // (Query) heads whose K/V take about kChunkBytes of L2 together.
  static constexpr int64_t kChunkBytes = int64_t(32) << 20;
  __host__ __device__ static int ChunkHeads(const AttentionShape& sh, int dtype_bytes) {
    const int64_t per_kv_head = sh.kv_len * (sh.head_dim + sh.v_dim()) * dtype_bytes;
    const int64_t heads = kChunkBytes * sh.group_size() / (per_kv_head > 0 ? per_kv_head : 1);
    return static_cast<int>(heads < 1 ? 1 : heads < sh.q_heads * sh.batch ? heads : sh.q_heads * sh.batch);
  }

  // `dynamic`: the segment ids' walk, its positions claimed (WorkClaims).
  // `shared_by_batch`: DenseParams::SharedByBatch.
  __host__ __device__ static TileScheduler For(const AttentionShape& sh, const MaskParams& mask, int rows, int ctas,
                                               int dtype_bytes, bool dynamic, bool shared_by_batch = false) {
    TileScheduler s;
    s.m_blocks = static_cast<int>((sh.q_len + rows - 1) / rows);
    s.heads = static_cast<int>(sh.q_heads);
    s.batches = static_cast<int>(sh.batch);
    s.ctas = ctas;
    s.heavy_first = mask.window_right >= 0;
    s.batch_inner = shared_by_batch && !s.heavy_first && sh.batch > 1;
    s.chunk_heads = dynamic ? ChunkHeads(sh, dtype_bytes) : 0;
    if (s.chunk_heads > 0) {
      s.paired = false;
      s.positions = static_cast<int>(Tiles(sh, rows));
      return s;
    }
    const int units = s.Pairs() * s.heads * s.batches;
    const int rounds = (units + ctas - 1) / ctas;
    s.paired = s.heavy_first && s.m_blocks % 2 == 0 && units >= ctas &&
               10 * int64_t(units) >= 9 * int64_t(rounds) * ctas;
    // Two rounds of ctas positions per round of ctas pairs.
    s.positions = s.paired ? 2 * rounds * ctas : static_cast<int>(Tiles(sh, rows));
    return s;
  }

  // Whether the dynamic walk runs each chunk's row blocks heaviest first:
  // `capacity` (batch element, row block)s hold in shared memory, and the
  // ranking's comparisons (each block against its batch element's) stay few
  // enough to cost the kernel's start a few microseconds.
  static constexpr int64_t kRankComparisons = int64_t(1) << 18;
  __host__ __device__ bool Ranked(int capacity) const {
    const int64_t blocks = int64_t(batches) * m_blocks;
    return chunk_heads > 0 && blocks <= capacity && blocks * m_blocks <= kRankComparisons;
  }
  // The (batch, head)s of the chunk that starts with (batch, head) `first`.
  __host__ __device__ __forceinline__ int ChunkCount(int first) const {
    return heads * batches - first < chunk_heads ? heads * batches - first : chunk_heads;
  }
  // Position `index` of the chunked walk (row blocks last first) moved to
  // the position of the same (batch, head) whose row block is the one ranked
  // where index's stands: order[b * m_blocks + r] is batch element b's r-th
  // heaviest row block (shared memory, RankRowBlocks).
  __device__ __forceinline__ int RankedPosition(int index, uint32_t order) const {
    WorkTile claimed;
    Get</*kChunked=*/true>(index, &claimed);  // its row block walked (m_blocks - 1 - m_block)-th
    const int ranked = LoadShared16(order + 2 * (claimed.batch * m_blocks + m_blocks - 1 - claimed.m_block));
    return index + (claimed.m_block - ranked) * ChunkCount(index / (chunk_heads * m_blocks) * chunk_heads);
  }
  // 16-bit entries of the ranked order, at shared-memory addresses (the
  // kernels' own form).
  __device__ __forceinline__ static int LoadShared16(uint32_t addr) {
    int value;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
    return value;
  }
  __device__ __forceinline__ static void StoreShared16(uint32_t addr, int value) {
    asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(static_cast<uint16_t>(value)) : "memory");
  }

  // Pairs of row blocks per (batch, head) (the walk pairs even counts only).
  __host__ __device__ int Pairs() const { return m_blocks / 2; }

  // The tile at a position of the walk; false where the position holds none.
  // kChunked: the walk is the dynamic one (chunk_heads > 0, as For makes it),
  // whose kernel then holds none of the static orders' fields.
  template <bool kChunked = false>
  __device__ __forceinline__ bool Get(int index, WorkTile* w) const {
    int bh;
    if (kChunked || chunk_heads > 0) {  // a chunk's row blocks last first, its (batch, head)s inner
      const int per_chunk = chunk_heads * m_blocks;
      const int first = index / per_chunk * chunk_heads, at = index % per_chunk;
      const int in_chunk = ChunkCount(first);
      w->m_block = m_blocks - 1 - at / in_chunk;
      bh = first + at % in_chunk;
    } else if (paired) {
      const int round = index / ctas;
      const int unit = (round / 2) * ctas + index % ctas;
      const int pairs = Pairs();
      bh = unit / pairs;
      if (bh >= heads * batches) return false;  // past the last pair, in the last round
      const int j = unit % pairs;
      w->m_block = round % 2 == 0 ? m_blocks - 1 - j : j;  // heavy, then light
    } else if (batch_inner) {  // (head, row block) outermost, its batch elements together
      w->batch = index % batches;
      const int rest = index / batches;
      w->m_block = rest % m_blocks;
      w->head = rest / m_blocks;
      return true;
    } else if (heavy_first) {  // row block outermost, the last block first
      const int per_block = heads * batches;
      w->m_block = m_blocks - 1 - index / per_block;
      bh = index % per_block;
    } else {  // (batch, head) outermost, its row blocks together
      w->m_block = index % m_blocks;
      bh = index / m_blocks;
    }
    w->head = bh % heads;
    w->batch = bh / heads;
    return true;
  }

  // Moves *index on to this CTA's next position that holds a tile (a CTA's
  // positions are blockIdx.x, + gridDim.x, ...; start from blockIdx.x -
  // gridDim.x) and reads it; false once past the walk. (The static walks.)
  __device__ __forceinline__ bool Next(int* index, WorkTile* w) const {
    for (*index += gridDim.x; *index < positions; *index += gridDim.x) {
      if (Get(*index, w)) return true;
    }
    return false;
  }
};

// The ranked order of a dynamic walk's row blocks (TileScheduler::Ranked),
// made by every thread of the CTA: work_of(batch, m_block) is a block's work
// (its key tiles), kept in `works`; order[b * m_blocks + r] is then batch
// element b's r-th heaviest block, ties the later block first (as the
// unranked walk). Both in shared memory.
template <typename WorkOf>
__device__ __forceinline__ void RankRowBlocks(const TileScheduler& s, uint32_t works, uint32_t order,
                                              WorkOf work_of) {
  const int blocks = s.batches * s.m_blocks;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) {
    const int work = work_of(i / s.m_blocks, i % s.m_blocks);
    TileScheduler::StoreShared16(works + 2 * i, work < 0xffff ? work : 0xffff);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) {
    const int first = i - i % s.m_blocks, work = TileScheduler::LoadShared16(works + 2 * i);
    int rank = 0;
    for (int j = first; j < first + s.m_blocks; ++j) {
      const int other = TileScheduler::LoadShared16(works + 2 * j);
      rank += other > work || (other == work && j > i);
    }
    TileScheduler::StoreShared16(order + 2 * (first + rank), i - first);
  }
  __syncthreads();
}

}  // namespace sm90
}  // namespace jaxflash
