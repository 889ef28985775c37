// The segment tables of a call with segment ids (params.h, SegmentField), on
// the GPU: the same fields jaxflash/segments.py computes with XLA, which is
// the definition the tests hold this to.
//
// XLA runs that definition as a chain of small latency-bound kernels: for
// B 2 x S 8k on an H200, a sort (76 us), binary searches (90 us) and running
// minima/maxima (48 us), about 228 us a call beside a 0.36 ms forward. Here
// two kernels:
//   SpanKernel (grid: chunks of kThreads positions x batch x 2 sides) sorts
//     the other side's ids with their positions as values in one block (a
//     stable radix sort over the bits the ids' range needs: one pass for a
//     few documents; equal ids keep their positions in order, so the pairs end
//     up in (id, position) order), then gives each position of its chunk its
//     span: two lower bounds in the sorted pairs say how many positions of the
//     other side with its id lie in its window span, and the first and last;
//   EnvelopeKernel (grid: batch x 2 sides) runs the three scans along each
//     table: running maxima of the span ends, and from the end running minima
//     of the span begins and of the next run's start.
// Every block of a (batch, side) sorts the same ids again: the sort is cheaper
// than a round trip through memory and a third launch, and the chunks' blocks
// spread the searches over the machine (one block a side left 128 of 132 SMs
// idle: 96 us at B 2 x S 8k).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/block/block_radix_sort.cuh>

#include "common/launch_util.cuh"
#include "common/mask.h"
#include "jaxflash/launch.h"
#include "jaxflash/params.h"

namespace jaxflash {
namespace {

// Whether (id, pos) sorts before (other_id, other_pos).
__device__ __forceinline__ bool Before(int32_t id, int32_t pos, int32_t other_id, int32_t other_pos) {
  return id < other_id || (id == other_id && pos < other_pos);
}

// How many of the n sorted pairs (ids[r], pos[r]) sort before (id, p).
__device__ __forceinline__ int LowerBound(const int32_t* ids, const int32_t* pos, int n, int32_t id, int32_t p) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (Before(ids[mid], pos[mid], id, p)) lo = mid + 1; else hi = mid;
  }
  return lo;
}

struct Max {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};
struct Min {
  __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};

// The scan of the values of the threads before this one, in thread order
// (`identity` for thread 0). `warp_totals` is kWarps (the block's warps, at
// most 32) ints of shared memory.
template <int kWarps, typename Op>
__device__ int BlockExclusiveScan(int x, int identity, int* warp_totals, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x = op(x, y);
  }
  if (lane == 31) warp_totals[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int t = lane < kWarps ? warp_totals[lane] : identity;
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, t, d);
      if (lane >= d) t = op(t, y);
    }
    if (lane < kWarps) warp_totals[lane] = t;
  }
  __syncthreads();
  int before = __shfl_up_sync(0xffffffffu, x, 1);
  if (lane == 0) before = identity;
  if (warp > 0) before = op(before, warp_totals[warp - 1]);
  __syncthreads();  // every thread has read warp_totals before the next scan writes them
  return before;
}

// The other side's (id, position) pairs of one batch element, sorted by id
// then position into shared memory (sorted_ids, sorted_pos: kThreads * kItems
// each, the sort's own storage before).
template <int kThreads, int kItems>
__device__ void SortOtherSide(const int32_t* other, int other_len, unsigned char* smem, int32_t* sorted_ids,
                              int32_t* sorted_pos) {
  using Sort = cub::BlockRadixSort<uint32_t, kThreads, kItems, int32_t>;
  __shared__ int lowest, highest;
  if (threadIdx.x == 0) {
    lowest = INT32_MAX;
    highest = INT32_MIN;
  }
  __syncthreads();
  // Thread t holds positions [t * kItems, (t + 1) * kItems) (CUB's blocked
  // arrangement).
  int32_t id[kItems];
  int lo = INT32_MAX, hi = INT32_MIN;
  for (int k = 0; k < kItems; ++k) {
    const int j = threadIdx.x * kItems + k;
    id[k] = j < other_len ? other[j] : INT32_MIN;
    if (j < other_len) {
      lo = min(lo, id[k]);
      hi = max(hi, id[k]);
    }
  }
  atomicMin(&lowest, lo);
  atomicMax(&highest, hi);
  __syncthreads();
  const int32_t base = lowest;
  // Keys id - lowest, unsigned, need only the bits of the ids' range; padding
  // takes the largest key and, coming last, sorts after every real one.
  const uint32_t range = other_len > 0 ? uint32_t(highest) - uint32_t(base) : 0;
  const int bits = range == 0 ? 0 : 32 - __clz(range);
  uint32_t key[kItems];
  int32_t value[kItems];
  for (int k = 0; k < kItems; ++k) {
    const int j = threadIdx.x * kItems + k;
    key[k] = j < other_len ? uint32_t(id[k]) - uint32_t(base) : range;
    value[k] = j;
  }
  if (bits > 0) Sort(*reinterpret_cast<typename Sort::TempStorage*>(smem)).Sort(key, value, 0, bits);
  __syncthreads();  // the sort's storage becomes the sorted pairs
  for (int k = 0; k < kItems; ++k) {
    sorted_ids[threadIdx.x * kItems + k] = int32_t(key[k] + uint32_t(base));
    sorted_pos[threadIdx.x * kItems + k] = value[k];
  }
  __syncthreads();
}

// Which table a block builds and what it reads.
struct Side {
  bool rows;  // the query rows' table (else the keys')
  int len, other_len;
  const int32_t* ids;
  const int32_t* other;
  int32_t* table;

  __device__ Side(const SegmentTableParams& p, int b, bool rows_side) : rows(rows_side) {
    len = static_cast<int>(rows ? p.q_len : p.kv_len);
    other_len = static_cast<int>(rows ? p.kv_len : p.q_len);
    ids = (rows ? p.q_ids : p.kv_ids) + int64_t(b) * len;
    other = (rows ? p.kv_ids : p.q_ids) + int64_t(b) * other_len;
    table = (rows ? p.q_table : p.kv_table) + int64_t(b) * len * kSegmentFields;
  }
};

// Fields id, begin, end, gap-free and the pad of one chunk of positions.
template <int kThreads, int kItems>
__global__ void __launch_bounds__(kThreads, 1) SpanKernel(const SegmentTableParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.y;
  const Side side(p, b, blockIdx.z == 0);
  int32_t* sorted_ids = reinterpret_cast<int32_t*>(smem);
  int32_t* sorted_pos = sorted_ids + kThreads * kItems;
  SortOtherSide<kThreads, kItems>(side.other, side.other_len, smem, sorted_ids, sorted_pos);

  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= side.len) return;
  const MaskPolicy mask = MaskPolicy::For<false>(p.mask, static_cast<int>(p.q_len), static_cast<int>(p.kv_len),
                                                 p.q_lengths, p.kv_lengths, b);
  int begin, end;  // the window's span of the other side (segments.py, _window_spans)
  if (side.rows) {
    begin = mask.WindowKeyBegin(i);
    end = i < mask.q_valid ? mask.WindowKeyEnd(i) : 0;
  } else {
    begin = mask.WindowRowBegin(i);
    end = mask.WindowRowEnd(i);
  }
  const int32_t id = side.ids[i];
  const int lo = LowerBound(sorted_ids, sorted_pos, side.other_len, id, begin);
  const int hi = LowerBound(sorted_ids, sorted_pos, side.other_len, id, end > begin ? end : begin);
  const int count = hi - lo;
  const bool seen = count > 0;
  // A position that sees nothing gets [other_len, 0) (mask.h, FullKeys).
  const int span_begin = seen ? sorted_pos[lo] : side.other_len;
  const int span_end = seen ? sorted_pos[hi - 1] + 1 : 0;
  int32_t* f = side.table + int64_t(i) * kSegmentFields;
  f[kSegId] = id;
  f[kSegBegin] = span_begin;
  f[kSegEnd] = span_end;
  f[kSegGapFree] = !seen || count == span_end - span_begin;
  f[kSegmentFields - 1] = 0;
}

constexpr int kScanThreads = 1024;
constexpr int kScanItems = kMaxSortedSegmentIds / kScanThreads;

// Fields env-begin, env-end and run-end of one table, from its spans and ids.
// Each thread scans kScanItems consecutive positions in registers (their loads
// in flight together), then one block scan joins the threads: a first version
// that walked 1024 positions at a time, a block scan each, took 42 us at S 8k.
__global__ void __launch_bounds__(kScanThreads, 1) EnvelopeKernel(const SegmentTableParams p) {
  constexpr int kWarps = kScanThreads / 32;
  __shared__ int warp_totals[kWarps];
  const Side side(p, blockIdx.x, blockIdx.y == 0);
  const int len = side.len;
  const auto field = [&](int i, int f) -> int32_t& { return side.table[int64_t(i) * kSegmentFields + f]; };

  // Forward, thread t over the kScanItems positions from t * kScanItems: the
  // running maximum of the span ends.
  int run[kScanItems];
  int first = threadIdx.x * kScanItems;
  for (int k = 0; k < kScanItems; ++k) run[k] = first + k < len ? field(first + k, kSegEnd) : 0;
  for (int k = 1; k < kScanItems; ++k) run[k] = max(run[k], run[k - 1]);
  int before = BlockExclusiveScan<kWarps>(run[kScanItems - 1], 0, warp_totals, Max{});  // span ends are >= 0
  for (int k = 0; k < kScanItems; ++k) {
    if (first + k < len) field(first + k, kSegEnvEnd) = max(run[k], before);
  }

  // Backward: thread t over the t-th group of positions from the end, so that a
  // scan in thread order runs from the last position to the first. The running
  // minimum of the span begins, and of where the run after a position's starts
  // (the first j > i whose id differs from the one before it).
  int starts[kScanItems];
  first = len - (threadIdx.x + 1) * kScanItems;
  for (int k = kScanItems - 1; k >= 0; --k) {
    const int i = first + k;
    const bool real = i >= 0;
    run[k] = real ? field(i, kSegBegin) : side.other_len;
    starts[k] = real && i + 1 < len && side.ids[i + 1] != side.ids[i] ? i + 1 : len;
  }
  for (int k = kScanItems - 2; k >= 0; --k) {
    run[k] = min(run[k], run[k + 1]);
    starts[k] = min(starts[k], starts[k + 1]);
  }
  const int begin_after = BlockExclusiveScan<kWarps>(run[0], side.other_len, warp_totals, Min{});
  const int start_after = BlockExclusiveScan<kWarps>(starts[0], len, warp_totals, Min{});
  for (int k = 0; k < kScanItems; ++k) {
    const int i = first + k;
    if (i < 0) continue;
    field(i, kSegEnvBegin) = min(run[k], begin_after);
    field(i, kSegRunEnd) = min(starts[k], start_after);
  }
}

// Launches both kernels with the span kernel's instance `kThreads x kItems`
// (its sort must hold the call's longest side).
template <int kThreads, int kItems>
Status Launch(const SegmentTableParams& p, const CudaDevice& device, cudaStream_t stream) {
  using Sort = cub::BlockRadixSort<uint32_t, kThreads, kItems, int32_t>;
  const size_t pairs = 2 * sizeof(int32_t) * kThreads * kItems;
  const size_t smem = sizeof(typename Sort::TempStorage) > pairs ? sizeof(typename Sort::TempStorage) : pairs;
  Status st = EnsureDynamicSmem<SpanKernel<kThreads, kItems>>(smem, device);
  if (!st.ok()) return st;
  const int64_t longest = p.q_len > p.kv_len ? p.q_len : p.kv_len;
  const dim3 chunks(static_cast<unsigned>(CeilDiv(longest, kThreads)), static_cast<unsigned>(p.batch), 2);
  SpanKernel<kThreads, kItems><<<chunks, kThreads, smem, stream>>>(p);
  st = CheckLaunch("segment spans");
  if (!st.ok()) return st;
  EnvelopeKernel<<<dim3(static_cast<unsigned>(p.batch), 2), kScanThreads, 0, stream>>>(p);
  return CheckLaunch("segment envelopes");
}

}  // namespace

Status CudaSegmentTables(const SegmentTableParams& p, const CudaDevice& device, cudaStream_t stream) {
  const int64_t longest = p.q_len > p.kv_len ? p.q_len : p.kv_len;
  if (longest > kMaxSortedSegmentIds) {
    return Status::InvalidArgument("the segment-table kernel sorts at most " +
                                   std::to_string(kMaxSortedSegmentIds) + " ids a row, got " +
                                   std::to_string(longest));
  }
  if (p.batch == 0 || longest == 0) return Status::Ok();
  // 8 ids a thread fill 1024 threads' 64 registers (16 spilled 104 bytes, and
  // 512 threads of 32 ids as much): longer sides are XLA's (segments.py).
  if (longest <= 1024) return Launch<1024, 1>(p, device, stream);
  static_assert(1024 * 8 == kMaxSortedSegmentIds, "the largest instance sorts kMaxSortedSegmentIds ids");
  return Launch<1024, 8>(p, device, stream);
}

}  // namespace jaxflash
