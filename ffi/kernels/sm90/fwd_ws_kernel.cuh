// FlashAttention forward for Hopper (sm_90a), warp-specialised.
//
// A CTA is one producer warpgroup and kConsumers consumer warpgroups of 64
// query rows each, and lives for the whole launch (one per SM), walking work
// tiles in the TileScheduler's order (tile_scheduler.cuh). The roles:
//
//   producer   one warp issues every copy through the TMA: the Q tile of a work
//              tile once, then K and V tiles of kN keys into rings of kStages
//              shared-memory stages; it hands most of its registers to the
//              consumers (setmaxnreg).
//   consumers  wait on a stage's "full" barrier, compute S = Q·Kᵀ and O += P·V
//              with wgmma, run the online softmax, and release the stage on
//              its "empty" barrier. Within a warpgroup the softmax of tile n
//              overlaps P·V of tile n - 1 on the tensor cores; between
//              warpgroups, "ping-pong" turns (named barriers) make them issue
//              their products in alternation, so one warpgroup's softmax runs
//              while the other's products occupy the tensor cores.
//   epilogue   each consumer stages its normalised O rows in its (now unused)
//              rows of the Q buffer and one thread stores them with the TMA;
//              the producer loads the next Q only after those stores have read
//              the buffer. With kSeparateO (where shared memory has room) O has
//              a buffer of its own: the consumers free Q after their last
//              Q·Kᵀ, so the next Q loads during the last P·V and the epilogue,
//              and a store is only waited for by the next epilogue. At D 128
//              Q has two buffers as well (kQBuffers): the producer loads the
//              next tile's Q, and goes on to its first K/V tiles, while this
//              tile still runs, where with one it waited for the release.
//              LSE goes straight to global memory. Entries of O
//              that show a NaN are recomputed exactly by their lane into the
//              staged tile (tc::FinishRows, common/exact_rows.cuh).
//
// Masking, the online softmax and the P packing are the other forwards' code
// (common/fwd_blocks.cuh, common/softmax.cuh).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <type_traits>

#include "common/fwd_blocks.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "common/softmax.cuh"
#include "jaxflash/params.h"
#include "sm90/barrier.cuh"
#include "sm90/tensor_map.h"
#include "sm90/tile_scheduler.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace jaxflash {
namespace sm90 {

// The mbarriers of a warp-specialised forward's shared memory (WsFwdSmem):
// per Q buffer full, then empty, the ragged-tail V copy, per stage K full, K
// empty, V full, V empty, then the two work slots' full and empty (a dynamic
// walk's claimed positions, 4 bytes each after them, then its ranked row
// blocks).
constexpr int WsFwdBarriers(int q_buffers, int stages) { return 1 + 2 * q_buffers + 4 * stages + 4; }

// kDv_: the value's (and the output's) head dim, where it is narrower than
// the query/key one (MLA-style calls at their own widths). kDense_: a tile for
// calls with a 16-bit dense bias it stages (dense_tile.cuh), which the others
// leave to the sm80 kernels.
template <int kD_, int kN_, int kStages_, int kConsumers_ = 2, bool kPingPong_ = true, bool kSeparateO_ = false,
          int kDv_ = kD_, bool kDense_ = false>
struct WsFwdTile {
  static constexpr bool kWarpSpecialised = true;
  // A dense tile adds a bias the producer stages beside each K tile
  // (BiasTile below; AddStagedBias) and takes no mask: LaunchForward sends it
  // only biases DenseTile::Stages allows, the sm80 kernels every other dense
  // call. It takes no soft-cap, segment ids or ALiBi beside them either (such
  // calls run the sm80 kernels): with ALiBi's raw units its loop held a
  // division's slow-path call among wgmma in flight, which serialised every
  // wgmma of the kernel (ptxas C7510), as did a branch to entry-by-entry bias
  // reads.
  static constexpr bool kTakesDense = kDense_;
  static constexpr int kD = kD_;
  static constexpr int kDv = kDv_;
  static_assert(kDv <= kD && kDv % 64 == 0, "O fits Q's buffer, in whole 64-column blocks");
  static constexpr int kN = kN_;  // keys per K/V tile
  static constexpr int kStages = kStages_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr bool kPingPong = kPingPong_;
  static constexpr bool kSeparateO = kSeparateO_;  // O staged in its own buffer, not Q's
  // Two Q buffers (the next tile's Q loads beside this one's) where O has its
  // own: measured 1-3% faster at D 128, but 2-3% slower at D 64, S 1k causal
  // (docs/performance.md, nineteenth session), so D 64 keeps one.
  static constexpr int kQBuffers = kSeparateO && kD >= 128 ? 2 : 1;
  static constexpr int kM = 64 * kConsumers;
  // Each consumer walks the key tiles its own rows see, not the work tile's.
  // Causal, a work tile of four warpgroups and 64-key tiles has four diagonal
  // key tiles: the first warpgroup sees one of them (the other three would be
  // masked steps of zeros), the last all four, and each the ones before its
  // diagonal whole (13% faster at D 64, S 1k; twenty-second session in
  // docs/performance.md). Where a key tile is as wide as the work tile is
  // tall, the warpgroups' ranges differ only under offsets and windows, and
  // the per-warpgroup bounds cost D 128 causal S 1k 2%: those walk the work
  // tile's.
  static constexpr bool kOwnKeyTiles = kM > kN;
  // Whether the tile applies a logit soft-cap (score_mod.cuh): at D 128 and
  // 256, and at D 64 with two consumers. Capped D 64 calls run those: the
  // pick's three and four consumers with O apart spilled with the cap's code
  // (196-240 bytes; 156-752 with ALiBi beside it and the staging row
  // unhoisted), and three of 64-key tiles, which took it, ran the capped
  // forward 5% slower than two (H200, thirty-ninth session in
  // docs/performance-log.md). D 256's tiles take it where their epilogue's
  // staging row is unhoisted (kUnhoistedRow, kCappedUnhoistedRow below):
  // hoisted, its addresses spilled 28-212 bytes beside the cap.
  static constexpr bool kTakesSoftCap = !kTakesDense && (kD >= 128 || (kD == 64 && kConsumers == 2));
  // kDynamicWalkOn = false turns the dynamic walk (kDynamicWalk, below) off
  // for every tile, for A/B runs: segment calls then take the static walk.
  static constexpr bool kDynamicWalkOn = true;
  // Whether it takes segment ids (mask.h's tables): the 128-key D 128 tile
  // with O in its own buffer, and D 64's with three consumers of 128 keys,
  // spilled the consumers' registers with them (24-56 bytes), so such calls
  // run another candidate. The 128-key D 128 tile with O in Q's buffer takes
  // them in its dynamic walk's kernel only, where three changes made room
  // (OpenWork's chunked-only Get, the epilogue's staging row Unhoisted, the
  // scheduler made in each role); its static kernel, which spilled 108-168
  // bytes with them, leaves them out (WsWalk::kSegments), so without the
  // dynamic walk it takes none. kSegmentsOnlyPlain: the 128-key D 128 tile
  // with O apart (the unpacked calls' pick) takes them in calls without
  // ScoreMods (launch_util.cuh) only, whose dynamic walk's kernel carries no
  // modifier's code and builds without spills (with every modifier's code it
  // spilled 328 bytes); kPlainSegmentsOn switches that on: the packed
  // forward 7-18% faster (sixty-second session in docs/performance-log.md;
  // its GPU tests, the tile-claiming one among them, passed the sixty-third).
  static constexpr bool kPlainSegmentsOn = true;
  static constexpr bool kSegmentsOnlyPlain =
      kPlainSegmentsOn && kDynamicWalkOn && !kTakesDense && kN == 128 && kD == 128 && kSeparateO_ && kConsumers == 2;
  static constexpr bool kTakesSegments =
      kSegmentsOnlyPlain ||
      (!kTakesDense && !(kN == 128 && ((kD == 128 && (kSeparateO_ || !kDynamicWalkOn)) || kConsumers == 3)));
  // Whether it takes ALiBi slopes (one FFMA a score, in raw units before the
  // scale-folded exponent): not on D 256's 80-key tile (148 bytes of spills
  // with the staging row unhoisted; its 64-key tile takes them), nor at D 64
  // with three or four consumers and O apart, whose consumers it spilled
  // (28-264 bytes).
  static constexpr bool kTakesAlibi =
      !kTakesDense && !((kD == 256 && kN > 64) || (kD == 64 && kConsumers >= 3 && kSeparateO_));
  // Whether segment ids run a kernel of the dynamic walk (WsWalk): where it
  // builds without spills (with three or four consumers, D 64's O apart and
  // D 256 it spilled 4-144 bytes).
  static constexpr bool kDynamicWalk =
      kDynamicWalkOn && kTakesSegments && kConsumers == 2 && kD <= 128 && !(kD == 64 && kSeparateO);
  // Whether calls with ScoreMods (launch_util.cuh: a soft-cap, ALiBi slopes,
  // a scale that is not positive) run kernels of their own (FwdScores), so
  // each kernel holds one kind of softmax a loop: with every variant in one
  // kernel (17464 SASS instructions, the plain one 6384), the D 128 causal
  // forward at S 1k spent 10.9% of its warps' stall samples waiting for
  // instructions to be fetched (FlashAttention-3's 1.6%), and ran 5% slower
  // (H200, sixty-first session in docs/performance-log.md).
  static constexpr bool kModsKernel = kTakesSoftCap || kTakesAlibi;
  // Whether the static walk's epilogue takes its staging row Unhoisted, as
  // the dynamic walk's does: hoisted, the compiler computes the row's kD / 8
  // pair addresses at the consumer's start and holds them across the walk,
  // which D 256's registers (128 of O a thread) hold only without a cap or
  // ALiBi. kUnhoistedRow: in every kernel of the tile (D 256's 64-key tile,
  // and D 192's tiles past 80 keys, whose 96 spilled 80 bytes hoisted);
  // kCappedUnhoistedRow: in the capped kernel only, so the others stay as
  // they were (D 256's 80-key pick: in one kernel with the row unhoisted, its
  // uncapped forward ran 0.4% slower at S 4k, 1.0% causal; H200,
  // forty-seventh session in docs/performance-log.md).
  static constexpr bool kUnhoistedRow = (kD == 256 && kN == 64) || (kD == 192 && kN > 80);
  static constexpr bool kCappedUnhoistedRow = kTakesSoftCap && kD == 256 && !kUnhoistedRow;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kNT = kN / 8;
  static constexpr int kDT = kD / 8;
  static constexpr int kDvT = kDv / 8;
  using QTile = SwizzledTile<kM, kD>;
  using KTile = SwizzledTile<kN, kD>;
  using VTile = SwizzledTile<kN, kDv>;
  using OTile = SwizzledTile<kM, kDv>;  // O's staging: its own buffer, or Q's
  // A dense tile's 16-bit bias, staged by the producer beside each K tile
  // (its rows of the work tile x the tile's keys; LaunchForward sends the
  // tile only biases whose layout allows a TMA box: DenseTile::Stages).
  // (64 columns where the tile takes no dense term: a swizzled tile is whole
  // 64-column blocks, and only dense tiles use it; the producer loads one box
  // a block.)
  using BiasTile = SwizzledTile<kM, kTakesDense ? kN : 64>;
  static constexpr size_t kBiasStageBytes = kTakesDense ? size_t(BiasTile::kBytes) : 0;
  static_assert(!kTakesDense || kN % 64 == 0, "a staged bias tile is whole 128-byte column blocks of 64 keys");
  // Registers per thread once the producer has handed its surplus over: 232
  // with two consumers, 160 with three, 112 with four (room for 64-key tiles
  // only).
  static constexpr int kProducerRegs = kConsumers == 2 ? 40 : 32;
  static constexpr int kConsumerRegs = ConsumerRegisters(kConsumers + 1, kProducerRegs);
  static constexpr int kBarriers = WsFwdBarriers(kQBuffers, kStages);
  // +1024: the dynamic shared-memory base is aligned up to a swizzle atom.
  static constexpr size_t kSmemFixedBytes = size_t(QTile::kBytes) * kQBuffers +
                                            (kSeparateO ? size_t(OTile::kBytes) : 0) +
                                            kStages * (size_t(KTile::kBytes + VTile::kBytes) + kBiasStageBytes) +
                                            8 * kBarriers + 8 + 1024;
  // (Batch element, row block)s whose order the dynamic walk ranks heaviest
  // first (TileScheduler::Ranked), two 16-bit entries each: up to 2048, as
  // many as the room left holds.
  static constexpr size_t kSmemRoom = kSm90SmemPerCta - kSmemFixedBytes;
  static constexpr int kRankedBlocks = !kDynamicWalk ? 0 : kSmemRoom >= 4 * 2048 ? 2048 : int(kSmemRoom / 4);
  static constexpr size_t kSmemBytes = kSmemFixedBytes + 4 * size_t(kRankedBlocks);
  static_assert(kSmemBytes <= kSm90SmemPerCta, "shared memory of one CTA");
  static_assert(kN == 64 || kN == 80 || kN == 96 || kN == 112 || kN == 128 || kN == 176,
                "score tiles use the compiled wgmma widths");
  static_assert(kM <= 256 && kN <= 256, "a TMA box has at most 256 rows");
  // Named barriers: the consumers' turns, then one per consumer's epilogue.
  static constexpr int kTurnBarrier = 1;
  static constexpr int kEpilogueBarrier = kTurnBarrier + kConsumers;
  static_assert(kEpilogueBarrier + kConsumers <= 16, "16 named barriers");
};

// Where the buffers and barriers of a WsFwdTile sit in shared memory. O's
// staging buffer is Q's own (its only one) unless the tile has a separate one;
// a dense tile's bias stages follow V's.
template <typename Tile>
struct WsFwdSmem {
  uint32_t q, k, v, bias, o, bars;

  __device__ __forceinline__ static WsFwdSmem At(uint32_t base) {
    WsFwdSmem s;
    s.q = base;
    s.k = s.q + Tile::kQBuffers * Tile::QTile::kBytes;
    s.v = s.k + Tile::kStages * Tile::KTile::kBytes;
    s.bias = s.v + Tile::kStages * Tile::VTile::kBytes;
    const uint32_t after_bias = s.bias + Tile::kStages * Tile::kBiasStageBytes;
    s.o = Tile::kSeparateO ? after_bias : s.q;
    s.bars = Tile::kSeparateO ? after_bias + Tile::OTile::kBytes : after_bias;
    return s;
  }
  __device__ __forceinline__ uint32_t K(int stage) const { return k + stage * Tile::KTile::kBytes; }
  __device__ __forceinline__ uint32_t V(int stage) const { return v + stage * Tile::VTile::kBytes; }
  __device__ __forceinline__ uint32_t Bias(int stage) const { return bias + stage * Tile::kBiasStageBytes; }
  __device__ __forceinline__ uint32_t Q(int b) const { return q + b * Tile::QTile::kBytes; }
  __device__ __forceinline__ uint32_t QFull(int b) const { return bars + 8 * b; }
  __device__ __forceinline__ uint32_t QEmpty(int b) const { return QFull(Tile::kQBuffers + b); }
  __device__ __forceinline__ uint32_t Tail() const { return QFull(2 * Tile::kQBuffers); }
  __device__ __forceinline__ uint32_t KFull(int s) const { return Tail() + 8 + 8 * s; }
  __device__ __forceinline__ uint32_t KEmpty(int s) const { return KFull(Tile::kStages + s); }
  __device__ __forceinline__ uint32_t VFull(int s) const { return KFull(2 * Tile::kStages + s); }
  __device__ __forceinline__ uint32_t VEmpty(int s) const { return KFull(3 * Tile::kStages + s); }
  __device__ __forceinline__ uint32_t WorkFull(int s) const { return KFull(4 * Tile::kStages + s); }
  __device__ __forceinline__ uint32_t WorkEmpty(int s) const { return WorkFull(2 + s); }
  __device__ __forceinline__ uint32_t WorkSlot(int s) const { return WorkFull(4) + 4 * s; }
  // The dynamic walk's row blocks: their work, then their ranked order.
  __device__ __forceinline__ uint32_t BlockWorks() const { return WorkSlot(2); }
  __device__ __forceinline__ uint32_t BlockOrder() const { return BlockWorks() + 2 * Tile::kRankedBlocks; }

  __device__ __forceinline__ void InitBarriers() const {
    constexpr int kConsumerWarps = 4 * Tile::kConsumers;
    for (int b = 0; b < Tile::kQBuffers; ++b) {
      MBarrier::Init(QFull(b), 1);
      // Q is free after every consumer's epilogue (one arrival each), or with
      // a separate O after every consumer warp's last Q·Kᵀ (one arrival a warp).
      MBarrier::Init(QEmpty(b), Tile::kSeparateO ? kConsumerWarps : Tile::kConsumers);
    }
    MBarrier::Init(Tail(), 1);
    for (int s = 0; s < Tile::kStages; ++s) {
      MBarrier::Init(KFull(s), 1);  // the producer's arrival, plus the copied bytes
      MBarrier::Init(VFull(s), 1);
      MBarrier::Init(KEmpty(s), kConsumerWarps);  // every consumer warp is done reading
      MBarrier::Init(VEmpty(s), kConsumerWarps);
    }
    for (int s = 0; s < 2; ++s) {
      MBarrier::Init(WorkFull(s), 1);                       // the producer's lane 0 published a position
      MBarrier::Init(WorkEmpty(s), 128 * Tile::kConsumers);  // every consumer thread has read it
    }
    MBarrier::FenceInit();
  }
};

// What producer and consumers both derive from a work tile.
struct WsWork {
  WorkTile tile;
  MaskPolicy pol;
  int r0, r_end;
  tc::KeyTiles keys;

  template <int kM, int kN, bool kSegments>
  __device__ __forceinline__ static WsWork At(const FwdParams& p, const WorkTile& tile) {
    WsWork w;
    w.tile = tile;
    const AttentionShape& sh = p.shape;
    w.pol = MaskPolicy::For<kSegments>(p.mask, static_cast<int>(sh.q_len), static_cast<int>(sh.kv_len), p.q_lengths,
                            p.kv_lengths, w.tile.batch);
    w.r0 = w.tile.m_block * kM;
    w.r_end = MinInt(w.r0 + kM, w.pol.q_valid);
    w.keys = tc::KeyTileRange<kN>(w.pol, w.r0, w.r_end);
    return w;
  }
  __device__ __forceinline__ bool Empty() const { return keys.begin >= keys.end; }
};

// The work tile at a position of the walk (-1: the walk is over).
template <typename Tile>
__device__ __forceinline__ bool OpenWork(const FwdParams& p, const TileScheduler& sched, int at, WsWork* w) {
  if (at < 0) return false;
  WorkTile tile;
  // A position handed out holds a tile. The dynamic walk runs the chunked
  // order only, so the static orders' fields are not held into the roles.
  sched.Get</*kChunked=*/true>(at, &tile);
  *w = WsWork::At<Tile::kM, Tile::kN, Tile::kTakesSegments>(p, tile);
  return true;
}

// The CTA's walk over its work tiles, as the producer and the consumers each
// keep it. A static walk takes every gridDim.x-th position
// (TileScheduler::Next) on both sides without talk. A dynamic one (segment
// ids; TileScheduler's chunked order) is a kernel of its own: the
// producer's lane 0 claims the positions (WorkClaims) and publishes them in a
// ring of two shared-memory slots, where every consumer thread reads them.
// (Its consumers' code beside the static walk's spilled at D 64 and 256;
// with the slot read alone still at D 64's three and four consumers, so only
// the tiles of WsFwdTile::kDynamicWalk build it.)
//
// The producer publishes position k + 1 as it starts tile k, before any of
// tile k's copies. A consumer reads k + 1 near the end of tile k, before it
// has released all of tile k's stages (its last V, and the key tiles past
// its own rows' that it passes over): had k + 1 waited for the producer to
// issue tile k's copies, which wait for those releases, both would wait
// forever (the first version did, found in review: a tile whose other
// consumer sees kStages key tiles more, or whose rows see none). Publishing
// a tile ahead waits only for the consumers to have read k - 1, which they do
// by the end of tile k - 2, whose copies are all issued by then
// (tools/walk_protocol_model.py models both versions).
template <typename Tile, bool kDynamic>
struct WsWalk {
  // Whether this walk's kernel meets segment ids: a tile that has a dynamic
  // walk runs id calls there only, so its static kernel leaves them out.
  static constexpr bool kSegments = Tile::kTakesSegments && (kDynamic || !Tile::kDynamicWalk);
  int index;            // static: the position last taken; dynamic: the producer's position published last
  uint32_t passed = 0;  // dynamic: positions published or read so far (the slot and its parity)

  __device__ __forceinline__ WsWalk()
      : index(static_cast<int>(blockIdx.x) - (kDynamic ? 0 : static_cast<int>(gridDim.x))) {}

  __device__ __forceinline__ bool ProducerNext(const FwdParams& p, const TileScheduler& sched,
                                               const WorkClaims& claims, const WsFwdSmem<Tile>& sm, int lane,
                                               WsWork* w) {
    if constexpr (!kDynamic) {
      return StaticNext(p, sched, w);
    } else {
      int at = -1;
      if (lane == 0) {
        if (passed == 0) Publish(sm, claims, index = index < sched.positions ? Ranked(sched, sm, index) : -1);
        at = index;
        if (at >= 0) {
          const int next = static_cast<int>(gridDim.x) + claims.Claim();
          Publish(sm, claims, index = next < sched.positions ? Ranked(sched, sm, next) : -1);
        }
      }
      return OpenWork<Tile>(p, sched, __shfl_sync(0xffffffffu, at, 0), w);
    }
  }

  // A consumer's next position, read (dynamic) before the tile's last
  // products are issued: no wait loop may sit among wgmma in flight.
  __device__ __forceinline__ int ConsumerTake(const WsFwdSmem<Tile>& sm) {
    if constexpr (!kDynamic) return 0;
    MBarrier::Wait(sm.WorkFull(passed & 1), (passed >> 1) & 1);
    const int at = static_cast<int>(LoadShared32(sm.WorkSlot(passed & 1)));
    // Every consumer thread arrives (a lane-0 branch here cost registers).
    MBarrier::Arrive(sm.WorkEmpty(passed & 1));
    ++passed;
    return at;
  }
  // ... and its work tile, from what ConsumerTake read.
  __device__ __forceinline__ bool ConsumerNext(const FwdParams& p, const TileScheduler& sched, int taken,
                                               WsWork* w) {
    if constexpr (!kDynamic) return StaticNext(p, sched, w);
    return OpenWork<Tile>(p, sched, taken, w);
  }

 private:
  // A claimed position as published: the same (batch, head), its row block
  // the one ranked heaviest where the chunked order put the claimed one.
  __device__ __forceinline__ static int Ranked(const TileScheduler& sched, const WsFwdSmem<Tile>& sm, int at) {
    return sched.Ranked(Tile::kRankedBlocks) ? sched.RankedPosition(at, sm.BlockOrder()) : at;
  }
  // The producer's lane 0: position `at` (-1: the walk's end, after the CTA's
  // last claim) into the next slot once the consumers have read its last.
  __device__ __forceinline__ void Publish(const WsFwdSmem<Tile>& sm, const WorkClaims& claims, int at) {
    MBarrier::Wait(sm.WorkEmpty(passed & 1), ((passed >> 1) & 1) ^ 1);
    StoreShared32(sm.WorkSlot(passed & 1), static_cast<uint32_t>(at));
    MBarrier::Arrive(sm.WorkFull(passed & 1));
    ++passed;
    if (at < 0) claims.Finish();
  }
  __device__ __forceinline__ bool StaticNext(const FwdParams& p, const TileScheduler& sched, WsWork* w) {
    WorkTile tile;
    if (!sched.Next(&index, &tile)) return false;
    *w = WsWork::At<Tile::kM, Tile::kN, kSegments>(p, tile);
    return true;
  }
};

// ------------------------------------------------------------------ producer
// One warp; lane 0 issues the copies. Keys at or past the batch element's
// kv_valid but inside the tensor (padding of a ragged batch) are zeroed in the
// V stage before the consumers see it: masked scores give P = 0 there, and
// 0 · (NaN in padding) would be NaN. (Past the tensor the TMA fills zeros.)
template <typename Tile, bool kDynamic>
__device__ __forceinline__ void WsFwdProducer(const FwdParams& p, const WsFwdSmem<Tile>& sm,
                                              const TileScheduler& sched, const WorkClaims& claims,
                                              const CUtensorMap& q_map, const CUtensorMap& k_map,
                                              const CUtensorMap& v_map, const CUtensorMap& bias_map) {
  constexpr int kN = Tile::kN, kBlocks = Tile::kD / 64, kVBlocks = Tile::kDv / 64;
  using QTile = typename Tile::QTile;
  using KTile = typename Tile::KTile;
  using VTile = typename Tile::VTile;
  const int lane = threadIdx.x & 31;
  const int group = static_cast<int>(p.shape.group_size());
  const int kv_len = static_cast<int>(p.shape.kv_len);
  if (lane == 0) {
    PrefetchTensorMap(q_map);
    PrefetchTensorMap(k_map);
    PrefetchTensorMap(v_map);
  }
  RingPosition<Tile::kStages> ring;
  RingPosition<Tile::kQBuffers> q_ring;
  uint32_t tail_parity = 0;
  WsWalk<Tile, kDynamic> walk;
  WsWork w;
  while (walk.ProducerNext(p, sched, claims, sm, lane, &w)) {
    if (w.Empty()) continue;
    const int head = w.tile.head, batch = w.tile.batch, kv_head = head / group;
    if (lane == 0) {
      const int qb = q_ring.stage;
      MBarrier::Wait(sm.QEmpty(qb), q_ring.parity ^ 1);  // the buffer's last tile is done with it
      MBarrier::ArriveExpectBytes(sm.QFull(qb), QTile::kBytes);
      for (int b = 0; b < kBlocks; ++b) {
        TmaLoad4d(sm.Q(qb) + b * QTile::kBlockBytes, q_map, sm.QFull(qb), 64 * b, head, w.r0, batch);
      }
    }
    q_ring.Advance();
    for (int nb = w.keys.begin; nb < w.keys.end; ++nb) {
      const int c0 = nb * kN;
      const int s = ring.stage;
      const bool ragged_tail = w.pol.kv_valid < kv_len && c0 + kN > w.pol.kv_valid;
      if (lane == 0) {
        MBarrier::Wait(sm.KEmpty(s), ring.parity ^ 1);
        // A staged bias tile joins K's barrier (the consumers read it with the scores).
        const bool bias = Tile::kTakesDense && tc::DenseTile::Stages(p);
        MBarrier::ArriveExpectBytes(sm.KFull(s), KTile::kBytes + (bias ? uint32_t(Tile::kBiasStageBytes) : 0u));
        for (int b = 0; b < kBlocks; ++b) {
          TmaLoad4d(sm.K(s) + b * KTile::kBlockBytes, k_map, sm.KFull(s), 64 * b, kv_head, c0, batch);
        }
        if (bias) {
          const DenseTerm& t = p.dense.bias;
          for (int b = 0; b < Tile::BiasTile::kBlocks; ++b) {
            TmaLoad4d(sm.Bias(s) + b * Tile::BiasTile::kBlockBytes, bias_map, sm.KFull(s), c0 + 64 * b, w.r0,
                      t.OwnHead(head), t.OwnBatch(batch));
          }
        }
        MBarrier::Wait(sm.VEmpty(s), ring.parity ^ 1);
        const uint32_t bar = ragged_tail ? sm.Tail() : sm.VFull(s);
        MBarrier::ArriveExpectBytes(bar, VTile::kBytes);
        for (int b = 0; b < kVBlocks; ++b) {
          TmaLoad4d(sm.V(s) + b * VTile::kBlockBytes, v_map, bar, 64 * b, kv_head, c0, batch);
        }
      }
      if (ragged_tail) {
        __syncwarp();
        MBarrier::Wait(sm.Tail(), tail_parity);
        tail_parity ^= 1;
        ZeroTileRows<VTile>(sm.V(s), w.pol.kv_valid - c0, lane);
        FenceSharedForAsyncProxy();
        __syncwarp();
        if (lane == 0) MBarrier::Arrive(sm.VFull(s));
      }
      ring.Advance();
    }
  }
}

// ------------------------------------------------------------------ consumer
// Adds a staged bias tile (Tile::BiasTile, 16-bit, swizzled as the TMA wrote
// it), times `units`, to a warp's scores (one FFMA a score): the warp's rows
// from `warp_row0` of the work tile, a lane's pair of keys of each n8 tile one
// 32-bit word.
template <typename Tile, int kNT>
__device__ __forceinline__ void AddStagedBias(float (&s)[kNT][4], uint32_t tile, int warp_row0, int lane, bool fp16,
                                              float units) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warp_row0 + g + half * 8;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const float2 x = tc::DenseTile::Pair(LoadShared32(tile + PairOffset<typename Tile::BiasTile>(row, nt, t)), fp16);
      s[nt][2 * half] = fmaf(x.x, units, s[nt][2 * half]);
      s[nt][2 * half + 1] = fmaf(x.y, units, s[nt][2 * half + 1]);
    }
  }
}

// The scores a forward kernel of a tile with kModsKernel computes (each walk
// has a kernel of each; LaunchWsForward picks by ScoreMods): plain (the scale
// folded into the exponent), capped (a soft-cap, with ALiBi inside it where
// given), other (ALiBi slopes without a cap, or a scale that is not
// positive). A tile without kModsKernel has one kernel a walk, kPlain, which
// takes a scale that is not positive too.
enum class FwdScores { kPlain, kCapped, kOther };

template <typename T, typename Tile, bool kDynamic, FwdScores kScores>
__device__ __forceinline__ void WsFwdConsumer(const FwdParams& p, const WsFwdSmem<Tile>& sm,
                                              const TileScheduler& sched, const CUtensorMap& o_map, int consumer) {
  // Marked uniform, what follows from it (this warpgroup's key tiles, the
  // loops' bounds) stays in uniform registers instead of taking the
  // consumers' (it spilled without).
  consumer = WarpUniform(consumer);
  constexpr int kN = Tile::kN, kD = Tile::kD, kDv = Tile::kDv;
  constexpr bool kOwnV = kDv != kD;  // v and O at a head dim of their own
  constexpr int kNT = Tile::kNT, kDvT = Tile::kDvT, kConsumers = Tile::kConsumers;
  using QTile = typename Tile::QTile;
  using KTile = typename Tile::KTile;
  using VTile = typename Tile::VTile;
  using OTile = typename Tile::OTile;
  const int tid = threadIdx.x - 128 * (consumer + 1);  // within the warpgroup
  const int lane = tid & 31;
  const int warp_row0 = consumer * 64 + (tid >> 5) * 16;  // this warp's rows in the CTA tile
  const float scale_log2 = p.scale * tc::kLog2e;
  const AttentionShape& sh = p.shape;
  // Which scores' code this kernel carries (FwdScores), and whether it takes
  // the epilogue's staging row Unhoisted.
  constexpr bool kCapped = kScores == FwdScores::kCapped;
  constexpr bool kOtherScale = kScores == FwdScores::kOther || !Tile::kModsKernel;
  constexpr bool kAlibiCode = Tile::kTakesAlibi && kScores == FwdScores::kOther;  // (a cap's ALiBi: CapAndMask)
  constexpr bool kUnhoistedRow = kDynamic || (kCapped && Tile::kCappedUnhoistedRow) || Tile::kUnhoistedRow;

  // Ping-pong: consumer c issues its products after waiting for turn c and
  // then passes the turn to c + 1; the last consumer hands the first turn out.
  auto await_turn = [&] {
    if constexpr (Tile::kPingPong) NamedBarrierSync(Tile::kTurnBarrier + consumer, 256);
  };
  auto pass_turn = [&] {
    if constexpr (Tile::kPingPong) NamedBarrierArrive(Tile::kTurnBarrier + (consumer + 1) % kConsumers, 256);
  };
  // A stage is free once every consumer warp has read it: one arrival a warp.
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) MBarrier::Arrive(bar);
  };
  if (consumer == kConsumers - 1) pass_turn();

  RingPosition<Tile::kStages> ring;
  RingPosition<Tile::kQBuffers> q_ring;
  // The next work tile is found while this one's last P·V runs: its setup
  // (the walk's divisions, the mask policy, the key tiles) would otherwise
  // leave the tensor cores idle at every tile boundary, where both consumers
  // arrive together.
  WsWalk<Tile, kDynamic> walk;
  WsWork next;
  bool more = walk.ConsumerNext(p, sched, walk.ConsumerTake(sm), &next);
  while (more) {
    const WsWork w = next;
    const int r0 = w.r0;
    float o[1][kDvT][4];
    tc::Zero(o[0]);
    tc::OnlineSoftmax<1> softmax;
    softmax.Init();
    float inv[2], lse[2];  // the row totals (OnlineSoftmax::Totals)

    if (w.Empty()) {
      more = walk.ConsumerNext(p, sched, walk.ConsumerTake(sm), &next);
      softmax.Totals(inv, lse);
    } else {
      const int qb = q_ring.stage;
      MBarrier::Wait(sm.QFull(qb), q_ring.parity);
      q_ring.Advance();
      const uint32_t sQ_rows = sm.Q(qb) + consumer * 64 * 128;  // this warpgroup's Q rows (A operand)
      // The key tiles this warpgroup walks, within the work tile's (which
      // the producer loads for every consumer), and the rows it masks by.
      // With kOwnKeyTiles those its own 64 rows see; tiles the mask hides
      // from all of them are passed over, and the range is empty for rows
      // past the batch element's queries.
      const int own_r0 = Tile::kOwnKeyTiles ? r0 + consumer * 64 : r0;
      const int own_end = Tile::kOwnKeyTiles ? MinInt(own_r0 + 64, w.r_end) : w.r_end;
      const tc::KeyTiles own = Tile::kOwnKeyTiles ? tc::KeyTileRange<kN>(w.pol, own_r0, own_end) : w.keys;
      const bool sees_keys = !Tile::kOwnKeyTiles || own.begin < own.end;
      // A stage the rows do not see is still waited for before its release:
      // arriving early would count towards the barrier's previous phase.
      // Under ping-pong the pass takes a turn, so every consumer takes as
      // many turns per work tile as the others.
      auto pass_over = [&] {
        MBarrier::Wait(sm.KFull(ring.stage), ring.parity);
        release(sm.KEmpty(ring.stage));
        MBarrier::Wait(sm.VFull(ring.stage), ring.parity);
        release(sm.VEmpty(ring.stage));
        await_turn();
        pass_turn();
        ring.Advance();
      };
      int nb = w.keys.begin;
      if (sees_keys) {
#pragma unroll 1
        for (; nb < own.begin; ++nb) pass_over();
        uint32_t pa[kN / 16][4];  // P of the previous key tile, the A operand of P·V
        float s[1][kNT][4];
        // Masks (if kMasked) and folds S_n into the softmax state (its
        // reference max lagging: OnlineSoftmax::Scores<true>); returns whether
        // the output must be rescaled, by alpha. A positive scale rides in
        // the exponent's FFMA (the usual case), and so does a cap's factor
        // (the scores become tanh: CapAndMask); any other scale is applied
        // first.
        // (Inlined by force, so the dense tile's longer step is never an
        // outlined call: a call among wgmma in flight has ptxas serialise
        // every wgmma of the kernel, C7510.)
        auto softmax_step = [&](int nb, auto masked, float (&alpha)[2]) __attribute__((always_inline)) {
          constexpr bool kMasked = decltype(masked)::value;
          const int c0 = nb * kN;
          if constexpr (Tile::kTakesDense) {
            if (p.dense.On()) {
              // The bias tile the producer staged with K (K's stage is
              // released after this read). With a positive scale, in raw
              // units (bias / scale: one FFMA a score) and the scale in the
              // exponent's FFMA, as for plain calls; else the scores are
              // scaled first and the bias added in log2 units.
              const bool fp16 = p.dense.bias.dtype == DType::kFloat16;
              if (scale_log2 > 0.f) {
                AddStagedBias<Tile>(s[0], sm.Bias(ring.stage), warp_row0, lane, fp16, __fdividef(1.f, p.scale));
                if constexpr (kMasked) tc::MaskScores(s, w.pol, r0, warp_row0, c0, lane);
                return softmax.Scores<true>(s, alpha, scale_log2);
              }
#pragma unroll
              for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[0][nt][i] *= scale_log2;
              AddStagedBias<Tile>(s[0], sm.Bias(ring.stage), warp_row0, lane, fp16, tc::kLog2e);
              tc::ScaleAndMask<false>(s, w.pol, !kMasked, r0, warp_row0, c0, lane, 1.f);
              return softmax.Scores<true>(s, alpha);
            }
          }
          if constexpr (kCapped) {
            // The cap is built from the parameters where each factor is used
            // (score_mod.cuh), so neither is held across the other's loop.
            // (Behind the test its calls always pass: without it the compiler
            // held the cap's factors across the loop and spilled 36-344
            // bytes; the plain softmax after it is never run.)
            if (p.softcap > 0.f) {
              tc::CapAndMask(s, w.pol, !kMasked, r0, warp_row0, c0, lane, tc::SoftCap::Of(p),
                             tc::AlibiBias::Of<Tile::kTakesAlibi>(p, w.pol, w.tile.batch, w.tile.head));
              return softmax.Scores<true>(s, alpha, tc::SoftCap::Of(p).cap2);
            }
          }
          if (!kOtherScale || scale_log2 > 0.f) {
            if constexpr (kAlibiCode) {  // the bias in raw units: the scale stays in the exponent
              const tc::AlibiBias alibi = tc::AlibiBias::Of(p, w.pol, w.tile.batch, w.tile.head);
              // Split where the registers allow (AddAlibiSplit: one FFMA a
              // score fewer on tiles off the diagonal); the dynamic walk's
              // D 64 kernel spilled 12 bytes with it.
              if constexpr (!kDynamic) {
                if (alibi.On()) {
                  float row_offset[2];
                  tc::AddAlibiSplit(s, alibi.InRawUnits(scale_log2), r0 + warp_row0, c0, lane, row_offset);
                  if constexpr (kMasked) tc::MaskScores(s, w.pol, r0, warp_row0, c0, lane);
                  return softmax.Scores<true>(s, alpha, scale_log2, row_offset);
                }
              }
              if (alibi.On()) tc::AddAlibi(s, alibi.InRawUnits(scale_log2), r0 + warp_row0, c0, lane);
            }
            if constexpr (kMasked) tc::MaskScores(s, w.pol, r0, warp_row0, c0, lane);
            return softmax.Scores<true>(s, alpha, scale_log2);
          }
          tc::ScaleAndMask(s, w.pol, !kMasked, r0, warp_row0, c0, lane, scale_log2, tc::SameRow{}, tc::SoftCap{},
                           tc::AlibiBias::Of<kAlibiCode>(p, w.pol, w.tile.batch, w.tile.head));
          return softmax.Scores<true>(s, alpha);
        };
        // Q's address is taken Unhoisted at each use, so the compiler rebuilds
        // its kD / 16 descriptors per product instead of holding them (two
        // registers each) across the loop.
        // Every product is issued right after its wgmma.fence, in one basic
        // block with no wait loop between: otherwise the compiler adds fences
        // of its own on a path it cannot prove uniform and serialises the
        // wgmma (ptxas C7520). So all waits come first.
        // The first key tile: S only.
        float alpha[2];
        MBarrier::Wait(sm.KFull(ring.stage), ring.parity);
        await_turn();
        WgmmaFence();
        ProductSS<T, QTile, KTile, kD, kN>(s[0], tc::Unhoisted(sQ_rows), sm.K(ring.stage));
        WgmmaCommit();
        pass_turn();
        WgmmaWait<0>();
        FenceAccumulator(s[0]);
        // (A dense tile's K stage holds its staged bias too: freed once read.)
        if constexpr (!Tile::kTakesDense) release(sm.KEmpty(ring.stage));
        // Tiles all of this warpgroup's rows see whole skip the mask (as in
        // the loops below), the first one too: it has no P·V to hide its
        // softmax under.
        const tc::KeyTiles full = tc::FullKeyTiles<kN>(w.pol, own_r0, own_end, own);
        if (Tile::kD <= 128 && full.begin == own.begin && full.end > full.begin) {
          softmax_step(nb, std::false_type{}, alpha);
        } else {
          softmax_step(nb, std::true_type{}, alpha);
        }
        if constexpr (Tile::kTakesDense) release(sm.KEmpty(ring.stage));
        tc::PackAFragments<T>(s[0], pa);
        ring.Advance();
        // Steady state: S_n = Q·K_nᵀ and O += P_{n-1}·V_{n-1}; the softmax of
        // S_n runs while P·V is still on the tensor cores.
        auto steady_step = [&](int nb, auto masked) {
          const RingPosition<Tile::kStages> prev = ring.Previous();
          MBarrier::Wait(sm.KFull(ring.stage), ring.parity);
          MBarrier::Wait(sm.VFull(prev.stage), prev.parity);
          await_turn();
          WgmmaFence();
          ProductSS<T, QTile, KTile, kD, kN>(s[0], tc::Unhoisted(sQ_rows), sm.K(ring.stage));
          WgmmaCommit();
          ProductRS<T, VTile, kN, kDv>(o[0], pa, sm.V(prev.stage), 0);
          WgmmaCommit();
          pass_turn();
          WgmmaWait<1>();  // S is done; P·V may still run
          FenceAccumulator(s[0]);
          if constexpr (!Tile::kTakesDense) release(sm.KEmpty(ring.stage));
          const bool moved = softmax_step(nb, masked, alpha);
          if constexpr (Tile::kTakesDense) release(sm.KEmpty(ring.stage));
          WgmmaWait<0>();
          FenceAccumulator(o[0]);
          release(sm.VEmpty(prev.stage));
          if (moved) softmax.Rescale(o, alpha);
          tc::PackAFragments<T>(s[0], pa);
          ring.Advance();
        };
        // Tiles every row sees whole skip the mask: three loops rather than a
        // branch per tile, which the compiler would turn into selects. At
        // kD = 256 the three copies' register demand spills, so every tile
        // is masked there: ~250 of the ~1000 instructions of an 80-key step,
        // issued while the products run (D 256 waits on its two-stage ring
        // rather than on issue: twenty-third session in docs/performance.md).
        ++nb;
        if constexpr (Tile::kD <= 128) {
          for (; nb < MinInt(full.begin, own.end); ++nb) steady_step(nb, std::true_type{});
          for (; nb < full.end; ++nb) steady_step(nb, std::false_type{});
        }
        for (; nb < own.end; ++nb) steady_step(nb, std::true_type{});
        // Every Q·Kᵀ of this warp is done (waited above): with a separate O
        // the producer may load the next Q now, under the last P·V.
        if constexpr (Tile::kSeparateO) release(sm.QEmpty(qb));
        // The last tile's P·V.
        // (The next position is read before the products are issued: no wait
        // loop may sit among wgmma in flight.)
        const RingPosition<Tile::kStages> prev = ring.Previous();
        MBarrier::Wait(sm.VFull(prev.stage), prev.parity);
        const int taken = walk.ConsumerTake(sm);
        await_turn();
        WgmmaFence();
        ProductRS<T, VTile, kN, kDv>(o[0], pa, sm.V(prev.stage), 0);
        WgmmaCommit();
        pass_turn();
        more = walk.ConsumerNext(p, sched, taken, &next);
        softmax.Totals(inv, lse);
        WgmmaWait<0>();
        FenceAccumulator(o[0]);
        release(sm.VEmpty(prev.stage));
      } else {
        // No row here sees a key (FinishRows zeroes them all): Q is not read,
        // and the turn of the last P·V is taken all the same.
        if constexpr (Tile::kSeparateO) release(sm.QEmpty(qb));
        await_turn();
        pass_turn();
        more = walk.ConsumerNext(p, sched, walk.ConsumerTake(sm), &next);
        softmax.Totals(inv, lse);
      }
#pragma unroll 1
      for (; nb < w.keys.end; ++nb) pass_over();
    }

    // ---- epilogue
    const int g = lane >> 2, t = lane & 3;
    softmax.Rescale(o, inv);
    const unsigned redo = tc::FinishRows(o, lse, w.pol, r0 + warp_row0, lane);
    float* gLse = p.lse + (int64_t(w.tile.batch) * sh.q_heads + w.tile.head) * sh.q_len;
    for (int half = 0; half < 2; ++half) {
      const int row = r0 + warp_row0 + g + half * 8;
      if (t == 0 && row < sh.q_len) gLse[row] = lse[half];
    }
    if (w.Empty()) {
      // No Q was loaded and the buffer may be in flight for the next tile:
      // write the zeros straight to global memory.
      // (O's own offsets only where v has its own head dim: the same values
      // otherwise, and registers the D 128 tiles have not.)
      T* gO = static_cast<T*>(p.o) + (kOwnV ? tc::FwdBlock<T>::OOffset(sh, w.tile.batch, w.tile.head, r0)
                                            : tc::FwdBlock<T>::QOffset(sh, w.tile.batch, w.tile.head, r0));
      const int64_t o_row_stride = kOwnV ? sh.o_row_stride() : sh.q_row_stride();
      const int o_dim = static_cast<int>(kOwnV ? sh.v_dim() : sh.head_dim);
      // (The thread index Unhoisted: this rare loop's column is not kept, or
      // spilled, across the key loop.)
      for (int i = tc::Unhoisted(tid); i < 64 * kDv / 8; i += 128) {
        const int row = consumer * 64 + i / (kDv / 8), col = (i % (kDv / 8)) * 8;
        if (r0 + row < sh.q_len && col < o_dim) {
          *reinterpret_cast<uint4*>(gO + int64_t(row) * o_row_stride + col) = make_uint4(0, 0, 0, 0);
        }
      }
      continue;
    }
    // Stage O in this warpgroup's rows of the O buffer (Q's, whose last Q·Kᵀ
    // is done, or its own once the previous tile's store has read it) in the
    // swizzled layout the O tensor map expects.
    if constexpr (Tile::kSeparateO) {
      if (tid == 0) TmaStoreWaitRead<0>();
      NamedBarrierSync(Tile::kEpilogueBarrier + consumer, 128);
    }
    for (int half = 0; half < 2; ++half) {
      // (Unhoisted in the dynamic walk and where kUnhoistedRow says, else the
      // compiler hoists the pairs' addresses to the consumer's start and
      // spills them across the walk; the other static walks keep them
      // hoisted, as WsFwdKernel says.)
      const int row = kUnhoistedRow ? tc::Unhoisted(warp_row0 + g + half * 8) : warp_row0 + g + half * 8;
#pragma unroll
      for (int dt = 0; dt < kDvT; ++dt) {
        const uint32_t value = tc::ElemTraits<T>::Pack(o[0][dt][2 * half], o[0][dt][2 * half + 1]);
        StoreShared32(sm.o + PairOffset<OTile>(row, dt, t), value);
      }
    }
    // Entries FinishRows flagged are recomputed into the staged tile, where
    // the accumulator is no longer live (in registers, D = 256 spills).
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      if (!(redo >> half & 1u)) continue;
      const int row = warp_row0 + g + half * 8;
      tc::ExactOutputLane<T, kDvT, WsWalk<Tile, kDynamic>::kSegments, Tile::kTakesDense, kOwnV>(
          p, w.tile.batch, w.tile.head, r0 + row, lse[half], t, [&](int dt, float2 x) {
            StoreShared32(sm.o + PairOffset<OTile>(row, dt, t), tc::ElemTraits<T>::Pack(x.x, x.y));
          });
    }
    __syncwarp();
    FenceSharedForAsyncProxy();
    NamedBarrierSync(Tile::kEpilogueBarrier + consumer, 128);
    if (tid == 0) {
      const int row0 = r0 + consumer * 64;
      if (row0 < sh.q_len) {
        for (int b = 0; b < kDv / 64; ++b) {
          TmaStore4d(o_map, sm.o + b * OTile::kBlockBytes + consumer * 64 * 128, 64 * b, w.tile.head, row0,
                     w.tile.batch);
        }
        TmaStoreCommit();
        if constexpr (!Tile::kSeparateO) TmaStoreWaitRead<0>();
      }
      if constexpr (!Tile::kSeparateO) MBarrier::Arrive(sm.QEmpty(0));
    }
  }
  if (consumer == 0) await_turn();  // the last consumer's final pass, so no turn is left pending
  if (tid == 0) TmaStoreWait<0>();
}

// kScores: which calls it serves (FwdScores).
template <typename T, typename Tile, bool kDynamic, FwdScores kScores = FwdScores::kPlain>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    WsFwdKernel(const __grid_constant__ FwdParams p, const __grid_constant__ CUtensorMap q_map,
                const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                const __grid_constant__ CUtensorMap o_map, const __grid_constant__ CUtensorMap bias_map,
                int claim_slot) {
#if defined(JAXFLASH_SM90A)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const auto sm = WsFwdSmem<Tile>::At((tc::SmemAddr(smem_raw) + 1023u) & ~1023u);
  if (threadIdx.x == 0) sm.InitBarriers();
  __syncthreads();
  auto scheduler = [&] { return TileScheduler::For(p.shape, p.mask, Tile::kM, gridDim.x, sizeof(T), kDynamic,
                                                      Tile::kTakesDense && p.dense.SharedByBatch());
  };  // (the other tiles' producers have no register to spare for one more flag)
  const WorkClaims claims{claim_slot};
  if constexpr (kDynamic) {
    {
      const TileScheduler sched = scheduler();
      if (sched.Ranked(Tile::kRankedBlocks)) {
        RankRowBlocks(sched, sm.BlockWorks(), sm.BlockOrder(), [&](int batch, int m_block) {
          const WsWork w = WsWork::At<Tile::kM, Tile::kN, true>(p, WorkTile{m_block, 0, batch});
          return w.Empty() ? 0 : w.keys.end - w.keys.begin;
        });
      }
    }
    // Made in each role, after the registers are handed over: made before,
    // values it derives from the launch were carried into the producer's 40
    // registers through local memory. The static walk's kernels keep the
    // scheduler made before, and mostly the epilogue's staging row hoisted
    // (WsFwdTile::kUnhoistedRow): with both changes, the D 128 forward at
    // S 1k causal ran 1.1% slower (H200).
    RunRoles<Tile::kProducerRegs, Tile::kConsumerRegs>(
        [&](int warp) {
          if (warp == 0) WsFwdProducer<Tile, kDynamic>(p, sm, scheduler(), claims, q_map, k_map, v_map, bias_map);
        },
        [&](int consumer) { WsFwdConsumer<T, Tile, kDynamic, kScores>(p, sm, scheduler(), o_map, consumer); });
  } else {
    const TileScheduler sched = scheduler();
    RunRoles<Tile::kProducerRegs, Tile::kConsumerRegs>(
        [&](int warp) {
          if (warp == 0) WsFwdProducer<Tile, kDynamic>(p, sm, sched, claims, q_map, k_map, v_map, bias_map);
        },
        [&](int consumer) { WsFwdConsumer<T, Tile, kDynamic, kScores>(p, sm, sched, o_map, consumer); });
  }
#endif  // JAXFLASH_SM90A
}

template <typename T, typename Tile, bool kDynamic, FwdScores kScores = FwdScores::kPlain>
Status LaunchWsForwardWalk(const FwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  Status st = EnsureDynamicSmem<WsFwdKernel<T, Tile, kDynamic, kScores>>(Tile::kSmemBytes, device);
  if (!st.ok()) return st;
  const AttentionShape& sh = p.shape;
  if (sh.q_len == 0 || sh.batch == 0 || sh.q_heads == 0) return Status::Ok();
  const int64_t tiles = TileScheduler::Tiles(sh, Tile::kM);
  if (tiles > INT_MAX / 2 - device.sm_count) {  // the paired walk's positions stay ints
    return Status::Unimplemented("more than 2^30 work tiles");
  }
  AttentionShape maps_shape = sh;
  maps_shape.kv_len = sh.kv_len > 0 ? sh.kv_len : 1;  // a map needs a non-empty extent; no key is read then
  CUtensorMap q_map, k_map, v_map, o_map, bias_map{};  // the bias map: a dense tile's staged bias only
  if (!(st = EncodeRowsMap(&q_map, p.q, p.dtype, maps_shape, true, Tile::kM)).ok() ||
      !(st = EncodeRowsMap(&k_map, p.k, p.dtype, maps_shape, false, Tile::kN)).ok() ||
      !(st = EncodeRowsMap(&v_map, p.v, p.dtype, maps_shape, false, Tile::kN, sh.v_dim())).ok() ||
      !(st = EncodeRowsMap(&o_map, p.o, p.dtype, maps_shape, true, 64, sh.v_dim())).ok()) {
    return st;
  }
  if (Tile::kTakesDense && tc::DenseTile::Stages(p) && !(st = EncodeBiasMap(&bias_map, p.dense.bias, sh, Tile::kM)).ok()) {
    return st;
  }
  const int grid = tiles < device.sm_count ? static_cast<int>(tiles) : device.sm_count;
  WsFwdKernel<T, Tile, kDynamic, kScores><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(
      p, q_map, k_map, v_map, o_map, bias_map, kDynamic ? WorkClaims::NextSlot() : 0);
  return CheckLaunch("attention forward (sm90, warp-specialised)");
}

// Encodes the four tensor maps and launches one CTA per SM (fewer when there
// are fewer work tiles): the dynamic walk's kernels for segment ids where the
// tile has them, and of a walk the kernel of the call's scores (FwdScores;
// the plain kernel folds the scale into the exponent unchecked).
template <typename T, typename Tile, bool kDynamic = false>
Status LaunchWsForward(const FwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  if constexpr (Tile::kDynamicWalk && !kDynamic) {
    if (p.mask.q_segments != nullptr) return LaunchWsForward<T, Tile, true>(p, device, stream);
  }
  if constexpr (Tile::kModsKernel) {
    if (ScoreMods(p)) {
      if constexpr (kDynamic && Tile::kSegmentsOnlyPlain) {
        return Status::Internal("segment ids with score modifiers sent to a tile that takes neither together");
      } else {
        if constexpr (Tile::kTakesSoftCap) {
          if (p.softcap > 0.f) return LaunchWsForwardWalk<T, Tile, kDynamic, FwdScores::kCapped>(p, device, stream);
        }
        return LaunchWsForwardWalk<T, Tile, kDynamic, FwdScores::kOther>(p, device, stream);
      }
    }
  }
  return LaunchWsForwardWalk<T, Tile, kDynamic>(p, device, stream);
}

}  // namespace sm90
}  // namespace jaxflash
