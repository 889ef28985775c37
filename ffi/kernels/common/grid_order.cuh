// The order in which the CTAs of a grid-shaped (not persistent) kernel take
// their tiles. The grid is (tiles, y, z): a tile is a block of query rows or
// of keys, and y and z name the (head, batch[, split]) it belongs to, a
// "group" of tiles below. The hardware starts CTAs in the order of their
// linear index, x fastest, as SMs free up.
//
// Without a diagonal mask every tile has the same work and the grid's own
// order stands: a group's tiles run side by side and share its K/V (or Q and
// dO) through L2. With one (causal, windows), tiles differ: row block m sees
// about m + 1 key tiles, key tile n about tiles - n row blocks. Taken a group
// at a time, the heavy tile of the last groups starts when most of the work is
// done and runs on alone: a tail of 6-12% of the kernel at one CTA per SM in
// a list-scheduling model of the §6 grid (tools/grid_order_model.py); on an
// H100 the order below made the causal warp-specialised backward 2-5% faster
// (docs/performance.md, sixteenth session). So the groups go in chunks of about
// kChunkCtas CTAs, and within a chunk the heaviest tile of every group comes
// first, then the next heaviest: each chunk spans a few waves, its light
// tiles fill in behind the next chunk's heavy ones, and only the last chunk's
// few light tiles are left at the end. A chunk holds few enough groups that
// the tiles running at once still share their group's data through L2.
#pragma once

#include "jaxflash/params.h"

namespace jaxflash {
namespace tc {

struct GridTile {
  int tile;  // the row or key block, 0-based in the sequence
  int y, z;  // the group, as the grid's y and z name it
};

// Which heavy end a kernel's tiles have under a diagonal mask.
enum class HeavyTiles {
  kLast,   // row blocks: later rows see more keys
  kFirst,  // key blocks: earlier keys are seen by more rows
};

// About two waves of one-CTA-per-SM kernels on an H100. Measured there (the
// warp-specialised backward, causal, sixteenth session): at S 8k, 256, 512
// and 1024 within 1.3% of each other; at S 2k 0.815 ms against 0.837 (512)
// and 0.957 (1024: 16 key tiles a group, so its chunks span 64 groups, whose
// Q and dO no longer share L2).
inline constexpr int kChunkCtas = 256;

// Params: FwdParams or BwdParams (the mask and the dense terms).
template <HeavyTiles kHeavy, typename Params>
__device__ __forceinline__ GridTile OrderedGridTile(const Params& p) {
  const MaskParams& mask = p.mask;
  if (mask.window_right < 0) {
    // A dense bias or mask shared by the batch (z, when z is the batch): the
    // batch elements of a tile go side by side, x and y outer, so the bias
    // bytes one reads from HBM the others find in L2. In the grid's own order
    // the batch elements of a tile start a whole batch element apart, and
    // every one read its own copy of the bias (a [1, N, T, S] bias of 512 MiB
    // at B 2, S 4k, 16 heads).
    if (gridDim.z > 1 && gridDim.z == unsigned(p.shape.batch) && p.dense.SharedByBatch()) {
      const unsigned at = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), rest = at / gridDim.z;
      return {int(rest % gridDim.x), int(rest / gridDim.x), int(at % gridDim.z)};
    }
    return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  }
  // Unsigned: y and z are below 2^16 each, so groups fit 32 bits.
  const unsigned tiles = gridDim.x, heads = gridDim.y, groups = heads * gridDim.z;
  const unsigned chunk = (kChunkCtas + tiles - 1) / tiles;  // groups per chunk
  // The grid's group g = y + heads * z lies in chunk g / chunk; its CTAs are
  // positions (g % chunk) * tiles + x of the chunk (< chunk * tiles < 2^31),
  // which go to the chunk's groups in turn, rank by rank.
  const unsigned g = blockIdx.y + heads * blockIdx.z;
  const unsigned first = g / chunk * chunk;
  const unsigned in_chunk = groups - first < chunk ? groups - first : chunk;  // the last chunk may be short
  const unsigned at = (g - first) * tiles + blockIdx.x;
  const unsigned rank = at / in_chunk;  // 0: the heaviest tiles
  const unsigned group = first + at % in_chunk;
  return {int(kHeavy == HeavyTiles::kFirst ? rank : tiles - 1 - rank), int(group % heads), int(group / heads)};
}

}  // namespace tc
}  // namespace jaxflash
