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

// Inclusive scans across a warp's lanes: from lane 0 up (lane l combines
// lanes 0..l) and from lane 31 down (lanes l..31).
template <typename Op>
__device__ __forceinline__ int WarpScanUp(int x, int lane, Op op) {
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x = op(x, y);
  }
  return x;
}
template <typename Op>
__device__ __forceinline__ int WarpScanDown(int x, int lane, Op op) {
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_down_sync(0xffffffffu, x, d);
    if (lane + d < 32) x = op(x, y);
  }
  return x;
}
// The combination of x over the warp's lanes.
template <typename Op>
__device__ __forceinline__ int WarpReduce(int x, Op op) {
  for (int d = 16; d > 0; d >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, d));
  return x;
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
  // Fields 0-3 in one 16-byte store (the envelope kernel writes 4-7).
  static_assert(kSegId == 0 && kSegBegin == 1 && kSegEnd == 2 && kSegGapFree == 3, "fields 0-3");
  *reinterpret_cast<int4*>(side.table + int64_t(i) * kSegmentFields) =
      make_int4(id, span_begin, span_end, !seen || count == span_end - span_begin);
}

constexpr int kScanThreads = 1024;
constexpr int kScanWarps = kScanThreads / 32;
constexpr int kScanRounds = kMaxSortedSegmentIds / kScanThreads;
static_assert(kScanWarps == 32, "a warp's lanes join the warps' totals");

// Fields env-begin, env-end and run-end of one table, from its spans and ids.
// Warp w owns the kScanRounds * 32 positions from w * kScanRounds * 32; in
// round k its lanes hold 32 consecutive ones, so a round's load and store are
// each one contiguous kilobyte of the table. (A thread of 8 consecutive
// positions made every warp access touch 32 lines: 39 us at B 2 x S 8k on an
// H200, forty-ninth session.) A warp scans its rounds with shuffles, carrying
// the running values from round to round; shared memory joins the warps.
__global__ void __launch_bounds__(kScanThreads, 1) EnvelopeKernel(const SegmentTableParams p) {
  __shared__ int totals[3][kScanWarps];
  const Side side(p, blockIdx.x, blockIdx.y == 0);
  const int len = side.len, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first = warp * kScanRounds * 32 + lane;  // this lane's position in round 0

  // Fields id, begin, end of each round's position, and where the run after
  // it starts (i + 1 when the id changes there, else len); positions past the
  // table take each scan's identity.
  int4 head[kScanRounds];
  int starts[kScanRounds];
#pragma unroll
  for (int k = 0; k < kScanRounds; ++k) {
    const int i = first + 32 * k;
    head[k] = make_int4(0, side.other_len, 0, 0);
    starts[k] = len;
    if (i < len) {
      head[k] = *reinterpret_cast<const int4*>(side.table + int64_t(i) * kSegmentFields);
      if (i + 1 < len && side.ids[i + 1] != head[k].x) starts[k] = i + 1;
    }
  }
  // The running maximum of the span ends, first to last; from the last to the
  // first, the running minima of the span begins and of the starts.
  int env_end[kScanRounds], env_begin[kScanRounds], run_end[kScanRounds];
  int end_carry = 0, begin_carry = side.other_len, start_carry = len;
#pragma unroll
  for (int k = 0; k < kScanRounds; ++k) {
    env_end[k] = max(WarpScanUp(head[k].z, lane, Max{}), end_carry);
    end_carry = __shfl_sync(0xffffffffu, env_end[k], 31);
  }
#pragma unroll
  for (int k = kScanRounds - 1; k >= 0; --k) {
    env_begin[k] = min(WarpScanDown(head[k].y, lane, Min{}), begin_carry);
    run_end[k] = min(WarpScanDown(starts[k], lane, Min{}), start_carry);
    begin_carry = __shfl_sync(0xffffffffu, env_begin[k], 0);
    start_carry = __shfl_sync(0xffffffffu, run_end[k], 0);
  }
  if (lane == 0) {
    totals[0][warp] = end_carry;
    totals[1][warp] = begin_carry;
    totals[2][warp] = start_carry;
  }
  __syncthreads();
  // Lane l reads warp l's totals: the warps before this one raise its ends,
  // the ones after it lower its begins and starts.
  const int ends_before = WarpReduce(lane < warp ? totals[0][lane] : 0, Max{});
  const int begins_after = WarpReduce(lane > warp ? totals[1][lane] : side.other_len, Min{});
  const int starts_after = WarpReduce(lane > warp ? totals[2][lane] : len, Min{});
  // Fields 4-7 in one 16-byte store (the pad field zero).
  static_assert(kSegEnvBegin == 4 && kSegEnvEnd == 5 && kSegRunEnd == 6 && kSegmentFields == 8, "fields 4-7");
#pragma unroll
  for (int k = 0; k < kScanRounds; ++k) {
    const int i = first + 32 * k;
    if (i >= len) continue;
    *reinterpret_cast<int4*>(side.table + int64_t(i) * kSegmentFields + kSegEnvBegin) =
        make_int4(min(env_begin[k], begins_after), max(env_end[k], ends_before), min(run_end[k], starts_after), 0);
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
