// Host-side helpers shared by the kernel launchers.
#pragma once

#include <type_traits>

#include <cuda_runtime.h>

#include <atomic>
#include <cfloat>
#include <cstdint>
#include <string>

#include "common/mma.cuh"
#include "jaxflash/launch.h"
#include "jaxflash/params.h"

namespace jaxflash {

// The most dynamic shared memory one CTA may opt in to on sm_90 (the
// warp-specialised kernels' tiles are sized against it).
constexpr size_t kSm90SmemPerCta = 227 * 1024;

// Raises kernel Kernel's dynamic shared-memory limit to `bytes` where it is
// below that, per (instantiation, device): the attribute is per device, and
// setting it on every launch would cost a driver call each time. A kernel may
// launch with two sizes (the sm80 kernels' staged dense bias needs more), so
// the size opted in is kept, not a flag: a larger launch after a smaller one
// raises it again. Keyed on the kernel itself (a template argument), not on
// its type: every instantiation of a kernel template has the same
// function-pointer type. A race between threads only repeats an idempotent
// call or sets a larger limit first.
template <auto Kernel>
Status EnsureDynamicSmem(size_t bytes, const CudaDevice& device) {
  constexpr int kDevices = 64;
  static std::atomic<size_t> opted[kDevices];
  std::atomic<size_t>* mine = device.ordinal < kDevices ? &opted[device.ordinal] : nullptr;
  if (mine != nullptr) {
    const size_t before = mine->load(std::memory_order_acquire);
    if (bytes <= before) return Status::Ok();
  }
  if (bytes > device.max_smem_per_block) {
    return Status::Unimplemented("kernel needs " + std::to_string(bytes) +
                                 " bytes of shared memory; the device allows " +
                                 std::to_string(device.max_smem_per_block));
  }
  if (bytes > 48 * 1024) {
    cudaError_t err =
        cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (err != cudaSuccess) {
      return Status::Internal(std::string("cudaFuncSetAttribute failed: ") + cudaGetErrorString(err));
    }
  }
  if (mine != nullptr) {
    size_t seen = mine->load(std::memory_order_acquire);
    while (seen < bytes && !mine->compare_exchange_weak(seen, bytes, std::memory_order_acq_rel)) {
    }
  }
  return Status::Ok();
}

// Turns the error state left by the last launch into a Status.
inline Status CheckLaunch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return Status::Internal(std::string(what) + " launch failed: " + cudaGetErrorString(err));
  }
  return Status::Ok();
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Launches a forward kernel over its grid (query blocks of `rows` x heads x
// batch) with `threads` threads and `smem` bytes of dynamic shared memory,
// opting in to that much shared memory once per device.
template <auto Kernel>
Status LaunchForwardGrid(const FwdParams& p, int rows, int threads, size_t smem, const CudaDevice& device,
                         cudaStream_t stream, const char* what) {
  Status st = EnsureDynamicSmem<Kernel>(smem, device);
  if (!st.ok()) return st;
  if (p.shape.q_len == 0 || p.shape.batch == 0 || p.shape.q_heads == 0) return Status::Ok();
  const dim3 grid(static_cast<unsigned>(CeilDiv(p.shape.q_len, rows)), static_cast<unsigned>(p.shape.q_heads),
                  static_cast<unsigned>(p.shape.batch));
  Kernel<<<grid, threads, smem, stream>>>(p);
  return CheckLaunch(what);
}

// Whether a tile serves a call's extras. A logit soft-cap and ALiBi slopes
// (score_mod.cuh) and segment ids (mask.h) cost registers some tiles do not
// have; those say so (kTakesSoftCap, kTakesAlibi, kTakesSegments: measured by
// building with spills as errors) and their launchers route such calls to a
// tile that takes them.
// Tile::kTakesDense where a tile family says it (the sm80 kernels, which
// read a dense bias and mask: dense_tile.cuh), else false.
template <typename Tile, typename = void>
struct DenseTakingTile : std::false_type {};
template <typename Tile>
struct DenseTakingTile<Tile, std::void_t<decltype(Tile::kTakesDense)>>
    : std::integral_constant<bool, Tile::kTakesDense> {};

// Whether a call modifies its scores beyond the scale folded into the
// exponent: a soft-cap, ALiBi slopes, or a scale whose log2-unit product is
// not a positive normal float. The Hopper forward runs such calls in kernels
// of their own (fwd_ws_kernel.cuh's FwdScores), so the plain calls' kernel
// holds none of their code.
template <typename Params>
bool ScoreMods(const Params& p) {
  return p.softcap > 0.f || p.alibi != nullptr || !(p.scale * tc::kLog2e >= FLT_MIN);
}

// Tile::kSegmentsOnlyPlain where a tile family says it (a tile that takes
// segment ids only in calls without ScoreMods), else false.
template <typename Tile, typename = void>
struct SegmentsOnlyPlainTile : std::false_type {};
template <typename Tile>
struct SegmentsOnlyPlainTile<Tile, std::void_t<decltype(Tile::kSegmentsOnlyPlain)>>
    : std::integral_constant<bool, Tile::kSegmentsOnlyPlain> {};

template <typename Tile, typename Params>
bool TileTakes(const Params& p) {
  return (p.softcap == 0.f || Tile::kTakesSoftCap) && (p.mask.q_segments == nullptr || Tile::kTakesSegments) &&
         (p.mask.q_segments == nullptr || !SegmentsOnlyPlainTile<Tile>::value || !ScoreMods(p)) &&
         (p.alibi == nullptr || Tile::kTakesAlibi) && (!p.dense.On() || DenseTakingTile<Tile>::value);
}

// Tile::kWarpSpecialised where a tile family says it, else false.
template <typename Tile, typename = void>
struct WarpSpecialisedTile : std::false_type {};
template <typename Tile>
struct WarpSpecialisedTile<Tile, std::void_t<decltype(Tile::kWarpSpecialised)>>
    : std::integral_constant<bool, Tile::kWarpSpecialised> {};

// A list of tile shapes a launcher may run: the candidates its tile table
// picks from and the tuner sweeps (python -m jaxflash.tune).
template <typename... Tiles>
struct TileList {
  static constexpr int kSize = sizeof...(Tiles);

  // Whether candidate `index` (0-based) takes call p (TileTakes).
  template <typename Params>
  static bool Takes(int index, const Params& p) {
    bool takes = false;
    int i = 0;
    (void)((i++ == index ? (takes = TileTakes<Tiles>(p), true) : false) || ...);
    return takes;
  }
  // `pick` if that candidate takes call p, else the first warp-specialised one
  // that does, else the first that does (-1: none).
  template <typename Params>
  static int PickTaking(int pick, const Params& p) {
    if (Takes(pick, p)) return pick;
    int first = -1, first_ws = -1;
    for (int i = 0; i < kSize; ++i) {
      if (!Takes(i, p)) continue;
      if (first < 0) first = i;
      if (first_ws < 0 && WarpSpecialised(i)) first_ws = i;
    }
    return first_ws >= 0 ? first_ws : first;
  }
  static bool WarpSpecialised(int index) {
    bool ws = false;
    int i = 0;
    (void)((i++ == index ? (ws = WarpSpecialisedTile<Tiles>::value, true) : false) || ...);
    return ws;
  }

  // Calls launch(Tile{}) for the candidate `tile` names (FwdParams::tile with
  // the family bit cleared: k > 0 is 1-based, from the tuner and the tests,
  // or a preference from the tile cache) or else the table's pick (0-based):
  // the one place a runtime tile index becomes a compiled kernel.
  template <typename Launch>
  static Status With(int tile, int table_pick, Launch&& launch) {
    const int forced = tile % FwdParams::kTileSm80;
    int index = forced > 0 ? forced - 1 : table_pick;
    // A cached preference measured on another build may name a shape this one
    // lacks: the table then decides, where a forced index is an error.
    if ((tile & FwdParams::kTilePreferred) && index >= kSize) index = table_pick;
    if (index < 0 || index >= kSize) {
      return Status::Unimplemented("tile candidate " + std::to_string(index + 1) + " does not exist (" +
                                   std::to_string(kSize) + " compiled)");
    }
    Status st = Status::Ok();
    int i = 0;
    (void)((i++ == index ? (st = launch(Tiles{}), true) : false) || ...);
    return st;
  }

  // Query rows a work tile of candidate `index` (0-based) covers.
  static int Rows(int index) {
    int rows = 0, i = 0;
    (void)((i++ == index ? (rows = Tiles::kM, true) : false) || ...);
    return rows;
  }
};

}  // namespace jaxflash
