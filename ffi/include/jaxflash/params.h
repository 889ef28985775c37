// The boundary between the FFI handlers and the kernels.
//
// Handlers decode XLA buffers and attributes, check them, and fill these plain
// structs; kernels (C++ on the CPU, CUDA on the GPU) read nothing else. This
// header must stay free of XLA and CUDA headers so that nvcc and the host
// compiler can both include it.
//
// Layouts (row-major, dense, as XLA hands them to a custom call):
//   q, dq           [batch, q_len, q_heads, head_dim]
//   o, do           [batch, q_len, q_heads, v_head_dim]
//   k, dk           [batch, kv_len, kv_heads, head_dim]
//   v, dv           [batch, kv_len, kv_heads, v_head_dim]
//                   (v_head_dim: the value's head dim, head_dim unless an MLA-style
//                   call sets it; only the CPU kernels take it different)
//   lse, dlse       [batch, q_heads, q_len]   float32, natural-log units
//                                             (kEmptyRowLse for a row that sees no key)
//   q_lengths,
//   kv_lengths      [batch]                   int32, clamped to [0, q_len] / [0, kv_len]
//   diag_offsets    [batch]                   int32, clamped to [-2^30, 2^30]
//                   (each of the three null when not given: the whole
//                   sequences, offsets 0)
//   o_partial       [batch, num_splits, q_len, q_heads, v_head_dim]  float32 (split-KV forward)
//   lse_partial     [batch, num_splits, q_len, q_heads]            float32, log2 units
//   k, v when paged [num_pages, page_size, kv_heads, head_dim or v_head_dim]  (see PagedKv)
#pragma once

#include <cstdint>

// Lets the small helpers below (and the mask policy) run in kernels too.
#if defined(__CUDACC__)
#define JAXFLASH_HD __host__ __device__ __forceinline__
#else
#define JAXFLASH_HD inline
#endif

namespace jaxflash {

// The LSE of a row that sees no key: the lowest finite float, a stand-in for
// log(0) = -inf that acts like it in any merge (exp underflows to 0) but is
// not an inf, which jax.debug_infs would report.
constexpr float kEmptyRowLse = -3.40282346638528859812e+38f;

// Head dims the kernels take: the CUDA kernels up to 256 (their tile shapes,
// and the SIMT kernels' fixed slices per lane), the CPU kernels up to 512
// (their per-thread scratch tiles). The handlers accept the wider.
constexpr int64_t kMaxCudaHeadDim = 256;
constexpr int64_t kMaxCpuHeadDim = 512;

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

// Which keys a query row may see. Row i of batch element b (i < q_len_b)
// attends key j iff
//   j < kv_len_b
//   and (window_left  < 0 or j >= i + offset_b - window_left)
//   and (window_right < 0 or j <= i + offset_b + window_right)
// where offset_b = (bottom_right ? kv_len_b - q_len_b : 0) + diag_offsets[b]
// (q_len_b, kv_len_b are the per-batch lengths). Causal attention is
// window_right = 0. Rows with no visible key produce O = 0 and LSE = kEmptyRowLse.
//
// diag_offsets places a block of a larger attention problem: the block of
// query rows starting at global row i0 and keys starting at global key j0 has
// its diagonal at i0 - j0 (plus the global bottom-right offset), which is how
// ring attention hands each (query shard, key shard) pair to these kernels.
//
// Non-finite inputs follow IEEE arithmetic over the pairs the mask admits and
// nothing else: a NaN or Inf in q_i, or in k_j / v_j of a key row i sees,
// reaches row i's output (and the gradients through it) as in a dense
// softmax, while a key row i cannot see never reaches it, not even as
// 0 * NaN. Keys past kv_len_b and rows past q_len_b are never read.
//
// Segment ids (packed sequences) add one more condition: q_id_b[i] == kv_id_b[j].
// The kernels never read the ids as given: the Python layer (jaxflash/segments.py)
// turns them, once per call on the device, into a table of kSegmentFields int32
// per query row and one per key (SegmentField), which say which keys a row
// sees (and which rows a key is seen by) with the window and lengths applied.
struct MaskParams {
  int64_t window_left = -1;   // < 0: unbounded
  int64_t window_right = -1;  // < 0: unbounded
  bool bottom_right = false;
  const int32_t* diag_offsets = nullptr;  // [batch], in the memory the kernel reads; null: all 0
  const int32_t* q_segments = nullptr;    // [batch, q_len, kSegmentFields]; null: no segment ids
  const int32_t* kv_segments = nullptr;   // [batch, kv_len, kSegmentFields]; set with q_segments
};

// The fields of one row of a segment table, for query row i (the "other side"
// is the keys) or key j (the other side is the query rows), as
// jaxflash/segments.py computes them:
//   kSegId       the segment id
//   kSegBegin,   the first and one past the last position of the other side it
//   kSegEnd      sees (window, lengths and ids applied); none: [other side's length, 0)
//   kSegGapFree  1 when every position in [begin, end) is seen (ids equal
//                throughout), so the interval alone is exact; 0: compare ids
//   kSegEnvBegin min of kSegBegin over this and every later position, and
//   kSegEnvEnd   max of kSegEnd over this and every earlier one: non-decreasing
//                bounds, so a block of positions [a0, a1) visits the other side's
//                [EnvBegin(a0), EnvEnd(a1 - 1)) whatever order the ids come in
//   kSegRunEnd   one past the last position of the run of equal ids holding this one
enum SegmentField : int {
  kSegId = 0,
  kSegBegin = 1,
  kSegEnd = 2,
  kSegGapFree = 3,
  kSegEnvBegin = 4,
  kSegEnvEnd = 5,
  kSegRunEnd = 6,
  kSegmentFields = 8,  // (one pad field: a row is 32 bytes)
};

// The segment tables of one call, built on the GPU (ffi/kernels/segments/
// segment_tables.cu) exactly as jaxflash/segments.py builds them anywhere: the
// ids are [batch, q_len] and [batch, kv_len] int32; `mask` gives the window,
// alignment and diagonal offsets (its segment pointers are unused); the tables
// are [batch, len, kSegmentFields]. Each side's table needs the other side's
// (id, position) pairs sorted, which one block does in registers and shared
// memory: neither side may hold more than kMaxSortedSegmentIds positions
// (longer calls build their tables with XLA).
struct SegmentTableParams {
  int64_t batch = 0;
  int64_t q_len = 0;
  int64_t kv_len = 0;
  const int32_t* q_ids = nullptr;
  const int32_t* kv_ids = nullptr;
  const int32_t* q_lengths = nullptr;   // [batch]; null: q_len
  const int32_t* kv_lengths = nullptr;  // [batch]; null: kv_len
  MaskParams mask;
  int32_t* q_table = nullptr;
  int32_t* kv_table = nullptr;
};
constexpr int64_t kMaxSortedSegmentIds = 8192;

struct AttentionShape {
  int64_t batch = 0;
  int64_t q_len = 0;
  int64_t kv_len = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;    // of q and k
  int64_t v_head_dim = 0;  // of v, o and their gradients; 0: head_dim

  JAXFLASH_HD int64_t group_size() const { return q_heads / kv_heads; }
  JAXFLASH_HD int64_t v_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
  // Element strides of the dense layouts above: q and k, then o and v.
  JAXFLASH_HD int64_t q_row_stride() const { return q_heads * head_dim; }
  JAXFLASH_HD int64_t q_batch_stride() const { return q_len * q_heads * head_dim; }
  JAXFLASH_HD int64_t kv_row_stride() const { return kv_heads * head_dim; }
  JAXFLASH_HD int64_t kv_batch_stride() const { return kv_len * kv_heads * head_dim; }
  JAXFLASH_HD int64_t o_row_stride() const { return q_heads * v_dim(); }
  JAXFLASH_HD int64_t o_batch_stride() const { return q_len * o_row_stride(); }
  JAXFLASH_HD int64_t v_row_stride() const { return kv_heads * v_dim(); }
  JAXFLASH_HD int64_t v_batch_stride() const { return kv_len * v_row_stride(); }
};

// Where key j of batch element b lives in k and v, in rows of kv_row_stride
// elements. Dense K/V (table == nullptr): row b * kv_len + j. Paged K/V: row
// j % page_size of physical page table[b * max_pages + j / page_size]; an
// entry outside [0, num_pages) is clamped into it, so a bad table can give a
// wrong answer but never an out-of-bounds read. A paged call has
// shape.kv_len = max_pages * page_size (the longest sequence the table holds).
struct PagedKv {
  const int32_t* table = nullptr;  // [batch, max_pages]
  int64_t page_size = 0;
  int64_t max_pages = 0;
  int64_t num_pages = 0;
  // log2(page_size) when it is a power of two (every usual size), else -1: a
  // shift and a mask per row instead of a division, which a GPU spells out
  // in some twenty instructions and the decode kernel runs for every K/V row.
  int page_shift = -1;

  void SetPageSize(int64_t size) {
    page_size = size;
    page_shift = -1;
    for (int s = 0; s < 31; ++s) {
      if ((int64_t(1) << s) == size) page_shift = s;
    }
  }

  JAXFLASH_HD int64_t Row(int64_t batch_index, int64_t kv_len, int key) const {
    if (table == nullptr) return batch_index * kv_len + key;
    return PagedRow(key, Entry(batch_index, key));
  }
  // Row() of a paged call in two steps, so that a kernel can read the table
  // entry early (it is a memory load) and do the arithmetic when it needs the row.
  JAXFLASH_HD int32_t Entry(int64_t batch_index, int key) const {
    return table[batch_index * max_pages + Split(key).slot];
  }
  JAXFLASH_HD int64_t PagedRow(int key, int32_t entry) const {
    const int64_t page = entry < 0 ? 0 : (entry >= num_pages ? num_pages - 1 : entry);
    return page * page_size + Split(key).within;
  }

 private:
  struct SlotWithin {
    int slot, within;
  };
  // 32-bit arithmetic: keys and page sizes are below 2^30 (the handlers check).
  JAXFLASH_HD SlotWithin Split(int key) const {
    if (page_shift >= 0) return {key >> page_shift, key & ((1 << page_shift) - 1)};
    const int slot = key / static_cast<int>(page_size);
    return {slot, key - slot * static_cast<int>(page_size)};
  }
};

// A logit soft-cap c > 0 replaces every score u = scale * q·k by
// c * tanh(u / c) before masking (Gemma-style capping; the backward multiplies
// the score gradient by 1 - tanh^2). 0: scores as they are. An infinite u
// becomes +-c, a NaN stays NaN.
//
// ALiBi slopes ([batch, q_heads] float32, null: none) add -slope * |i +
// offset_b - j| to the score of row i and key j after the soft-cap and before
// masking (offset_b as in MaskParams: the row's diagonal). The slopes are
// constants: no gradient is computed for them (common/alibi.h).
// A dense bias or mask (jax.nn's `bias` and `mask` arguments), row-major
// [Bb, Nb, Tb, Sb] where every axis is the call's size (batch, q_heads, q_len,
// kv_len) or 1: a broadcast axis has stride 0, so it is never expanded in
// memory. Null data: none. The mask is one byte a pair (nonzero: attend) and
// joins the mask rule above (a hidden pair is excluded exactly like one outside
// the window; a row it leaves without keys is empty); the bias, in its own float
// dtype, is added to the score after the soft-cap and ALiBi. The CPU kernels
// read them (the CUDA kernels do not yet: their targets take neither).
struct DenseTerm {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;  // the bias's (the mask's bytes ignore it)
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0, key_stride = 0;  // in elements

  JAXFLASH_HD bool On() const { return data != nullptr; }
  // Element offset of (batch b, query head, query row, key 0).
  JAXFLASH_HD int64_t RowOffset(int64_t b, int64_t head, int64_t row) const {
    return b * batch_stride + head * head_stride + row * row_stride;
  }
  // The term's own batch element and head of the call's (0 on a broadcast
  // axis): its coordinates in a tensor map of its own extent (sm90 EncodeBiasMap).
  JAXFLASH_HD int OwnBatch(int b) const { return batch_stride != 0 ? b : 0; }
  JAXFLASH_HD int OwnHead(int head) const { return head_stride != 0 ? head : 0; }
  // The call's (batch, head) items that read each entry (more than one on a
  // broadcast axis).
  JAXFLASH_HD int64_t Sharers(const AttentionShape& sh) const {
    return (batch_stride == 0 ? sh.batch : 1) * (head_stride == 0 ? sh.q_heads : 1);
  }
};
struct DenseParams {
  DenseTerm bias, mask;
  JAXFLASH_HD bool On() const { return bias.On() || mask.On(); }
  // Every term present is broadcast over the batch: the batch elements of one
  // (head, tile) read the same bytes of it, so the tile orders run them side
  // by side and all but the first read it from L2 (grid_order.cuh).
  JAXFLASH_HD bool SharedByBatch() const {
    return On() && (!bias.On() || bias.batch_stride == 0) && (!mask.On() || mask.batch_stride == 0);
  }
};

struct FwdParams {
  AttentionShape shape;
  DType dtype = DType::kFloat32;
  MaskParams mask;
  float scale = 1.0f;    // multiplies q·k before the softmax
  float softcap = 0.0f;  // > 0: the logit soft-cap (above)
  const float* alibi = nullptr;  // ALiBi slopes [batch, q_heads] (above); null: none
  // Tile choice: 0 = the tile table, k in [1, 63] = candidate k (tuning and
  // tests; a candidate the build lacks is an error); adding kTileSm80 runs the
  // sm80 kernels even on a GPU with a newer path (so the Ampere path is
  // testable on Hopper); adding kTilePreferred makes k a preference (the
  // per-device tile cache, jaxflash/tile_cache.py): a candidate the build
  // lacks falls back to the table.
  int tile = 0;
  static constexpr int kTileSm80 = 64;
  static constexpr int kTilePreferred = 128;

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* q_lengths = nullptr;
  const int32_t* kv_lengths = nullptr;

  void* o = nullptr;
  float* lse = nullptr;

  // Split-KV: the keys each query tile visits are cut into num_splits
  // contiguous ranges computed apart; their normalised partial outputs and
  // log2-unit LSEs go to o_partial / lse_partial (outputs of the call, sized
  // by the caller) and a merge pass combines them into o and lse. With
  // num_splits == 1 the partial buffers are not touched (and may be empty).
  int num_splits = 1;
  float* o_partial = nullptr;
  float* lse_partial = nullptr;

  PagedKv paged;  // dense K/V unless paged.table is set
  DenseParams dense;  // the dense bias and mask (above); none by default
};

struct BwdParams {
  AttentionShape shape;
  DType dtype = DType::kFloat32;
  MaskParams mask;
  float scale = 1.0f;
  float softcap = 0.0f;  // as FwdParams::softcap
  const float* alibi = nullptr;  // as FwdParams::alibi
  bool deterministic = false;  // bit-identical results run to run
  int tile = 0;                // as FwdParams::tile, for the backward kernels

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const float* lse = nullptr;
  const void* dout = nullptr;
  const float* dlse = nullptr;  // cotangent of the LSE output
  const int32_t* q_lengths = nullptr;
  const int32_t* kv_lengths = nullptr;

  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;

  // Workspace the caller passes as an output: delta = rowsum(dO * O) - dLSE,
  // one float per (batch, q_head, row), laid out like lse.
  float* delta = nullptr;
  // Optional workspace laid out like q, in float32: room for the fused
  // backward's dQ sums (one pass adds every key tile's dS·K into it, then dQ
  // is converted from it). Null when the caller gave none: the CUDA dispatch
  // then runs the two-kernel backward, as it does for deterministic calls; the
  // CPU kernels their three passes (with it, their one pass: deterministic too).
  float* dq_accum = nullptr;
  DenseParams dense;  // as FwdParams::dense
  // The bias gradient of the bias-gradient pass (CpuBiasGradient,
  // CudaBiasGradient; the backward kernels leave it): contiguous [Bb, Nb, Tb,
  // Sb], each axis the call's, or 1 where the bias's stride is 0 (broadcast),
  // summed in float32 and stored in dbias_dtype (jaxflash_bias_grad_v2: the
  // bias's own; v1: float32).
  void* dbias = nullptr;
  DType dbias_dtype = DType::kFloat32;
  // dS = P (dP - delta) out of the Hopper backward with a staged bias
  // (sm90/bwd_ws_kernel.cuh), in the input dtype, into the entries of the
  // layout its strides give (stride 0: a broadcast axis): each step's dS tile
  // is stored where an entry has one (batch, head) of the call, and added by
  // the copy engine where it has two (zeroed first: two 16-bit terms added once
  // round as their float32 sum does). In the bias's own layout that is dB
  // (jaxflash_bwd_db_v1); the whole [batch, q_heads, q_len, kv_len] dS is the
  // older jaxflash_bwd_ds_v1's, which its caller sums. Off: not emitted (the
  // separate bias-gradient pass computes dB).
  DenseTerm ds_out;
};

}  // namespace jaxflash
