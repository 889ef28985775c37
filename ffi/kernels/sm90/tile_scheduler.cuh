// Persistent tile scheduler: a grid of about one CTA per SM walks the work
// tiles (a block of query rows of one (batch, head)) in a fixed order, CTA i
// taking tiles i, i + gridDim.x, ... Producer and consumer warpgroups of a CTA
// walk the same sequence, so they need not share it through memory.
//
// The order serves two ends. Causal (and other diagonal-banded) masks give
// the blocks further down the sequence more keys: those tiles come first
// (heaviest first), so the short ones fill in at the end. Tiles that read the
// same K/V run side by side: the query heads of one GQA group are adjacent,
// and without a diagonal mask all row blocks of one head are adjacent, so
// their K/V tiles are fetched from HBM once and found in L2 by the others.
#pragma once

#include "jaxflash/params.h"

namespace jaxflash {
namespace sm90 {

struct WorkTile {
  int m_block;
  int head;
  int batch;
};

struct TileScheduler {
  int m_blocks;
  int heads;  // query heads; the heads of one GQA group are consecutive
  int total;
  bool heavy_first;

  __host__ __device__ static TileScheduler For(const AttentionShape& sh, const MaskParams& mask, int rows) {
    TileScheduler s;
    s.m_blocks = static_cast<int>((sh.q_len + rows - 1) / rows);
    s.heads = static_cast<int>(sh.q_heads);
    s.total = s.m_blocks * s.heads * static_cast<int>(sh.batch);
    s.heavy_first = mask.window_right >= 0;
    return s;
  }

  __device__ __forceinline__ WorkTile Get(int index) const {
    WorkTile w;
    if (heavy_first) {  // row block outermost, last block first
      const int per_block = heads * (total / (m_blocks * heads));
      w.m_block = m_blocks - 1 - index / per_block;
      const int bh = index % per_block;
      w.head = bh % heads;
      w.batch = bh / heads;
    } else {  // (batch, head) outermost, its row blocks together
      w.m_block = index % m_blocks;
      const int bh = index / m_blocks;
      w.head = bh % heads;
      w.batch = bh / heads;
    }
    return w;
  }
};

}  // namespace sm90
}  // namespace jaxflash
