// The Hopper forward's tile candidates, its tile table and its launcher.
//
// Two kernel families compete per head-dim bucket: the warp-specialised TMA
// kernel (fwd_ws_kernel.cuh: WsFwdTile<kD, keys per tile, stages, consumer
// warpgroups, ping-pong>) and the cp.async kernel (fwd_kernel.cuh:
// FwdTile<kD, warpgroups, keys per tile, CTAs per SM>), which every thread
// both loads and computes in. `python -m jaxflash.tune` times every candidate; the
// table holds the winners.
#pragma once

#include "common/launch_util.cuh"
#include "sm90/fwd_kernel.cuh"
#include "sm90/fwd_ws_kernel.cuh"
#include "sm80/launch_sm80.h"
#include "sm90/launch_sm90.h"

namespace jaxflash {
namespace sm90 {

// Register pressure bounds the consumers' tiles: O (kD / 2 floats), S (kN / 2)
// and packed P (kN / 4) per thread must fit in the 232 registers a consumer
// gets with two consumer warpgroups (160 with three); shared memory holds Q and
// kStages stages of K and V within 227 KiB.
// kDv: the value's head dim where a bucket pair has tiles of its own (MLA).
template <int kD, int kDv = kD>
struct FwdCandidates;
// The tile of calls with a dense bias (the last candidate of D 64 and 128;
// LaunchForward sends it the 16-bit biases it stages, the sm80 kernels the
// other dense calls), a staged bias tile a stage beside K and V: at D 64
// 64-key tiles, 4 stages and O apart (160 KiB); at D 128 128-key tiles (the
// plain pick's: the bias in raw units left the registers room for them, 0
// spills), 2 stages and O in Q's buffer (224 KiB). At B 2, S 4k, 16 heads,
// bias [1, N, T, S] on an H200 the D 128 64-key tile (3 stages, 176 KiB) ran
// 0.65 ms, this one with the raw units 0.56 (cuDNN 0.96; fifty-sixth session).
template <int kD>
using DenseFwdTile = WsFwdTile<kD, kD == 64 ? 64 : 128, kD == 64 ? 4 : 2, 2, false, kD == 64, kD, true>;
// kSmallGrid: the candidate (0-based) for grids too small to fill the GPU
// (SmallGrid), or -1 where none was measured to win there.
template <>
struct FwdCandidates<64> {
  using type = TileList<WsFwdTile<64, 128, 4>, WsFwdTile<64, 128, 4, 2, false>, WsFwdTile<64, 64, 6, 3>,
                        FwdTile<64, 1, 128, 3>, WsFwdTile<64, 128, 4, 2, false, true>,
                        WsFwdTile<64, 128, 4, 3, false, true>, WsFwdTile<64, 64, 6, 4, false, true>,
                        DenseFwdTile<64>>;
  static constexpr int kSmallGrid = 3;  // the cp.async kernel's 64-row tiles
};
template <>
struct FwdCandidates<128> {
  using type = TileList<WsFwdTile<128, 128, 2, 2, false>, FwdTile<128, 2, 128>,
                        WsFwdTile<128, 128, 2, 2, false, true>, WsFwdTile<128, 64, 4, 2, false, true>,
                        DenseFwdTile<128>>;
  static constexpr int kSmallGrid = -1;
};
// D 192 (q/k of MLA-style models, and any head dim in (128, 192]): beside
// O's 96 floats a thread, 96- and 112-key tiles build without spills with the
// epilogue's staging row unhoisted (hoisted, 96 keys spilled 80 bytes); Q
// (48 KiB) and two stages fill 192 and 216 KiB. The pick (FwdTilePick's
// default, the first): 112 keys, forced-tile call times on an H200 (fifty-third
// session) 3579 us at S 16k (B 1, H 10) against 3772 for the 80-key tile that
// led before and 4165 for 64 x 3; causal 1705 against 1954 and 2122; at B 2,
// S 4k, H 16 causal 96 keys led (406 us, 112 keys 412, 80 keys 451). The 80-
// and 64-key tiles left the list.
template <>
struct FwdCandidates<192> {
  using type = TileList<WsFwdTile<192, 112, 2, 2, false>, WsFwdTile<192, 96, 2, 2, false>>;
  static constexpr int kSmallGrid = -1;
};
// q/k 192 with v (and O) of up to 128 columns, MLA's widths: P·V and the
// epilogue at 128. 128-key tiles build without spills with the staging row
// unhoisted (hoisted, they spilled 168 bytes); the narrower V leaves room for
// a third stage of 80 keys (198 KiB). The pick, the first: 128 keys, 344 us a
// call at B 2, S 4k, H 16 causal against 371 for 80 x 3, 370 for 112 x 2 and
// 378 for 80 x 2 (H200, fifty-third session); the last two left the list.
template <>
struct FwdCandidates<192, 128> {
  using type = TileList<WsFwdTile<192, 128, 2, 2, false, false, 128>, WsFwdTile<192, 80, 3, 2, false, false, 128>>;
  static constexpr int kSmallGrid = -1;
};
template <>
struct FwdCandidates<256> {
  using type = TileList<WsFwdTile<256, 64, 2, 2, false>, FwdTile<256, 2, 64>, WsFwdTile<256, 80, 2, 2, false>>;
  static constexpr int kSmallGrid = -1;
};

// The tile table: index into FwdCandidates<kD>, measured on an H100 with
// tools/tune_tiles.py (2026-11-23, docs/performance.md): the warp-specialised
// kernel without ping-pong turns won or tied at every head dim. Three ping-pong
// shapes measured then (<64, 176, 4>, <128, 128, 2>, <256, 64, 2>) left the
// lists when the exact recomputation of non-finite entries
// (common/exact_rows.cuh) and the loaded diagonal offsets made them spill;
// none was the pick. The last candidate at D 64 and 128 stages O in a buffer
// of its own (kSeparateO: the next Q loads under the last P·V and the
// epilogue); it won both buckets' geometric means over S 1k, 2k, 16k, causal
// and not (2026-11-23, ninth session in docs/performance.md). At D 64 three
// consumer warpgroups (192 rows a tile, 160 registers each) then beat two by
// 7-19% non-causal and up to 13% causal (twelfth session): with two, the
// exponent unit sat at 48% and issue at 44%, latency rather than a pipe
// limiting; a third warpgroup hides more of it. At D 256, 80-key tiles
// (Q and two stages fill 225 KiB) beat 64-key ones by 4-7% at S 1k-16k, causal
// S 1k tied (same session). Four consumers of 64-key tiles (256 rows, 112
// registers each: more warps to hide the consumers' latency) are faster
// kernel to kernel than the picks before them at causal S 1k (8%, over two
// consumers, which had kept causal up to 1k rows: 192-row tiles pad 1024 rows
// by 12%) and 2k (3%) and non-causal S 1k (5%), 6% slower non-causal at
// S >= 2k (twenty-first session; its tune-sweep rates vary run to run). Since
// each consumer walks only the key tiles its rows see (kOwnKeyTiles) it also
// wins causal S 4k (4%) and 8k (2%), and loses 16k (2%) (twenty-second
// session).
inline int FwdTilePick(int head_dim_bucket, bool causal, int64_t q_len) {
  switch (head_dim_bucket) {
    case 64: return q_len <= (causal ? 8192 : 1024) ? 6 : 5;
    case 128: return 2;
    case 256: return 2;
    default: return 0;
  }
}

// Whether the table's pick would leave the GPU half idle: at most half as
// many work tiles as SMs. The call then lasts one CTA's walk over its keys,
// and the bucket's small-grid candidate (more CTAs, fewer rows each) finishes
// first. At D 64 on an H100 (twenty-fourth session) the cp.async kernel's
// 64-row tiles ran the latency shape (B 1, H 8, S 512: 16 work tiles of the
// pick) in 10.2 µs against the pick's 18.9 (cuDNN's kernel 9.5); with 32 and
// 64 work tiles they were 1.4-1.8x faster, with 88 tied; with 128 the pick
// was 27% faster non-causal (2% slower causal).
template <int kD, int kDv = kD>
bool SmallGrid(const FwdParams& p, const CudaDevice& device, int pick) {
  if constexpr (FwdCandidates<kD, kDv>::kSmallGrid < 0) {
    return false;
  } else {
    const int64_t work_tiles =
        p.shape.batch * p.shape.q_heads * CeilDiv(p.shape.q_len, FwdCandidates<kD, kDv>::type::Rows(pick));
    return 2 * work_tiles <= device.sm_count;
  }
}

// A call with segment ids, a soft-cap, ALiBi slopes or a dense term runs the
// pick if that tile takes them (TileTakes), else the first warp-specialised
// candidate that does, else the first that does (PickTaking); with none, the
// sm80 kernels, which take everything.
template <typename T, int kD, int kDv>
Status LaunchForward(const FwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  using Candidates = typename FwdCandidates<kD, kDv>::type;
  int pick = FwdTilePick(kD, p.mask.window_right >= 0, p.shape.q_len), requested = p.tile;
  // A cached preference (`python -m jaxflash.tune`) was measured without a cap
  // or segment ids, on grids that fill the GPU: it yields to those; a forced
  // tile does not.
  bool yield = p.softcap > 0.f || p.mask.q_segments != nullptr || p.alibi != nullptr || p.dense.On();
  if (SmallGrid<kD, kDv>(p, device, pick)) {
    pick = FwdCandidates<kD, kDv>::kSmallGrid;
    yield = true;
  }
  if (yield && (requested & FwdParams::kTilePreferred)) requested = 0;
  pick = Candidates::PickTaking(pick, p);
  // The dense tile reads a 16-bit bias the producer stages beside K and no
  // mask (fwd_ws_kernel.cuh); the sm80 kernels take the other dense calls.
  const bool dense_elsewhere = p.dense.On() && !(tc::DenseTile::Stages(p) && !p.dense.mask.On());
  if ((pick < 0 || dense_elsewhere) && requested % FwdParams::kTileSm80 == 0) {
    if constexpr (kDv != kD) {
      return Status::Unimplemented("no sm90 forward tile of this value head dim takes the call");
    } else {
      FwdParams any_tile = p;
      any_tile.tile = 0;
      return sm80::LaunchForward<T, kD>(any_tile, device, stream);
    }
  }
  return Candidates::With(requested, pick, [&](auto tile) {
    using Tile = decltype(tile);
    if (!TileTakes<Tile>(p)) {
      return Status::Unimplemented("this forced sm90 forward tile takes no logit soft-cap, ALiBi or segment ids");
    }
    if constexpr (Tile::kWarpSpecialised) {
      return LaunchWsForward<T, Tile>(p, device, stream);
    } else {
      return LaunchForwardGrid<FwdKernel<T, Tile>>(p, Tile::kM, Tile::kThreads, Tile::kSmemBytes, device, stream,
                                                   "attention forward (sm90)");
    }
  });
}

}  // namespace sm90
}  // namespace jaxflash
