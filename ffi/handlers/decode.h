// Buffer and attribute decoding shared by the CPU and CUDA handlers.
//
// The Python layer validates every argument at trace time with messages aimed
// at users; these checks run again on what XLA actually hands the handler, so
// a malformed call returns an ffi::Error instead of reaching a kernel.
//
// Leading dimensions beyond the documented rank are folded into the batch:
// that is how a vmapped call (vmap_method="broadcast_all") arrives.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "jaxflash/launch.h"
#include "jaxflash/params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxflash::handlers {

namespace ffi = xla::ffi;

// Shape limits the kernels rely on (int32 row/column indices).
constexpr int64_t kMaxSequence = int64_t{1} << 30;
constexpr int64_t kMaxHeadDim = kMaxCpuHeadDim;  // the widest any kernel takes (params.h)

#define JAXFLASH_RETURN_IF_ERROR(expr)     \
  do {                                     \
    if (auto _e = (expr); _e.failure()) {  \
      return _e;                           \
    }                                      \
  } while (0)

inline ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jaxflash: " + what);
}

inline ffi::Error ToFfiError(const Status& s) {
  switch (s.code()) {
    case Status::Code::kOk: return ffi::Error::Success();
    case Status::Code::kInvalidArgument: return ffi::Error::InvalidArgument("jaxflash: " + s.message());
    case Status::Code::kUnimplemented:
      return ffi::Error(ffi::ErrorCode::kUnimplemented, "jaxflash: " + s.message());
    case Status::Code::kInternal: return ffi::Error::Internal("jaxflash: " + s.message());
  }
  return ffi::Error::Internal("jaxflash: unknown status");
}

inline std::string ShapeString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Product of the leading `dims.size() - trailing` dimensions.
inline int64_t LeadingProduct(ffi::AnyBuffer::Dimensions dims, size_t trailing) {
  int64_t n = 1;
  for (size_t i = 0; i + trailing < dims.size(); ++i) n *= dims[i];
  return n;
}

inline bool DecodeDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kFloat32; return true;
    case ffi::DataType::F16: *out = DType::kFloat16; return true;
    case ffi::DataType::BF16: *out = DType::kBFloat16; return true;
    default: return false;
  }
}

// Checks `buf` is [lead..., trailing...] with the given trailing dims and a
// leading product equal to `batch`.
inline ffi::Error ExpectShape(const char* name, ffi::AnyBuffer::Dimensions dims,
                              std::initializer_list<int64_t> trailing, int64_t batch) {
  const size_t n = trailing.size();
  bool ok = dims.size() >= n && LeadingProduct(dims, n) == batch;
  size_t i = dims.size() >= n ? dims.size() - n : 0;
  for (int64_t want : trailing) {
    if (!ok) break;
    ok = dims[i++] == want;
  }
  if (ok) return ffi::Error::Success();
  std::string want = "[batch";
  for (int64_t w : trailing) want += ", " + std::to_string(w);
  return Invalid(std::string(name) + " has shape " + ShapeString(dims) + ", expected " + want +
                 "] with batch " + std::to_string(batch));
}

// The rules every forward and backward shape must meet, once decoded.
inline ffi::Error CheckProblem(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               const AttentionShape& shape, DType* dtype) {
  if (!DecodeDType(q.element_type(), dtype)) {
    return Invalid("query dtype must be float32, float16 or bfloat16");
  }
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type()) {
    return Invalid("query, key and value must share one dtype");
  }
  if (shape.head_dim < 1 || shape.head_dim > kMaxHeadDim || shape.v_dim() < 1 || shape.v_dim() > kMaxHeadDim) {
    return Invalid("head dims must be in [1, " + std::to_string(kMaxHeadDim) + "], got " +
                   std::to_string(shape.head_dim) + " (query, key) and " + std::to_string(shape.v_dim()) +
                   " (value)");
  }
  if (shape.kv_heads < 1 || shape.q_heads % shape.kv_heads != 0) {
    return Invalid("query heads (" + std::to_string(shape.q_heads) +
                   ") must be a positive multiple of key/value heads (" +
                   std::to_string(shape.kv_heads) + ")");
  }
  if (shape.q_len >= kMaxSequence || shape.kv_len >= kMaxSequence) {
    return Invalid("sequence lengths must be below 2^30");
  }
  return ffi::Error::Success();
}

// Fills shape and dtype from q, k, v and checks every rule the kernels assume.
inline ffi::Error DecodeProblem(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                AttentionShape* shape, DType* dtype) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() < 4 || kd.size() != qd.size()) {
    return Invalid("query must be [batch, q_len, heads, head_dim] and key the same rank, got " +
                   ShapeString(qd) + " and " + ShapeString(kd));
  }
  const size_t r = qd.size();
  shape->batch = LeadingProduct(qd, 3);
  shape->q_len = qd[r - 3];
  shape->q_heads = qd[r - 2];
  shape->head_dim = qd[r - 1];
  shape->kv_len = kd[r - 3];
  shape->kv_heads = kd[r - 2];
  if (auto e = ExpectShape("key", kd, {shape->kv_len, shape->kv_heads, shape->head_dim},
                           shape->batch);
      e.failure()) {
    return e;
  }
  shape->v_head_dim = v.dimensions().size() == r ? v.dimensions()[r - 1] : 0;
  if (auto e = ExpectShape("value", v.dimensions(),
                           {shape->kv_len, shape->kv_heads, shape->v_dim()}, shape->batch);
      e.failure()) {
    return e;
  }
  return CheckProblem(q, k, v, *shape, dtype);
}

inline ffi::Error CheckRowStats(const char* name, ffi::AnyBuffer buf, const AttentionShape& s) {
  if (buf.element_type() != ffi::DataType::F32) return Invalid(std::string(name) + " must be float32");
  return ExpectShape(name, buf.dimensions(), {s.q_heads, s.q_len}, s.batch);
}

// Sequence lengths and diagonal offsets: one int32 per batch element, or an
// empty array for none (every row and key real, offsets 0). The Python side
// passes an empty one when the caller gave none, so that no kernel runs to
// fill a [batch] array before every call.
inline ffi::Error CheckLengths(const char* name, ffi::AnyBuffer buf, const AttentionShape& s) {
  if (buf.element_type() != ffi::DataType::S32) return Invalid(std::string(name) + " must be int32");
  if (buf.element_count() == 0) return ffi::Error::Success();
  return ExpectShape(name, buf.dimensions(), {}, s.batch);
}
// The kernels' pointer to a CheckLengths buffer: null for none.
inline const int32_t* PerBatch(ffi::AnyBuffer buf) {
  return buf.element_count() == 0 ? nullptr : static_cast<const int32_t*>(buf.untyped_data());
}

// The operands newer target versions add: the segment tables of v3
// (params.h, SegmentField: int32 [batch, q_len, kSegmentFields] and [batch,
// kv_len, kSegmentFields], both or neither; empty arrays: no segment ids) and
// the ALiBi slopes of v4 (float32 [batch, q_heads]; empty: none), the dense
// bias and mask of v5 (params.h, DenseTerm; empty: none). Null: a target
// version without them.
struct ExtraOperands {
  const ffi::AnyBuffer* q = nullptr;
  const ffi::AnyBuffer* kv = nullptr;
  const ffi::AnyBuffer* alibi = nullptr;
  const ffi::AnyBuffer* bias = nullptr;
  const ffi::AnyBuffer* mask = nullptr;
};
// One dense term: rank 4, each axis the call's size or 1, row-major strides (0 on
// a broadcast axis).
inline ffi::Error DecodeDenseTerm(const char* name, const ffi::AnyBuffer* buf, const AttentionShape& s,
                                  bool is_mask, DenseTerm* out) {
  if (buf == nullptr) return ffi::Error::Success();
  const auto dims = buf->dimensions();
  if (buf->element_count() == 0) {  // [0, 0, 0, 0]: a call without the term (any other empty shape is checked below)
    bool none = dims.size() == 4;
    for (size_t i = 0; none && i < dims.size(); ++i) none = dims[i] == 0;
    if (none) return ffi::Error::Success();
  }
  const ffi::DataType t = buf->element_type();
  if (is_mask) {
    if (t != ffi::DataType::PRED) return Invalid("the dense mask must be boolean");
  } else if (t == ffi::DataType::F32 || t == ffi::DataType::F16 || t == ffi::DataType::BF16) {
    out->dtype = t == ffi::DataType::F32 ? DType::kFloat32 : t == ffi::DataType::F16 ? DType::kFloat16
                                                                                      : DType::kBFloat16;
  } else {
    return Invalid("the dense bias must be float32, float16 or bfloat16");
  }
  const int64_t full[4] = {s.batch, s.q_heads, s.q_len, s.kv_len};
  bool ok = dims.size() == 4;
  for (size_t i = 0; ok && i < 4; ++i) ok = dims[i] == 1 || dims[i] == full[i];
  if (!ok) {
    return Invalid(std::string(name) + " has shape " + ShapeString(dims) + "; expected each axis of [" +
                   std::to_string(s.batch) + ", " + std::to_string(s.q_heads) + ", " + std::to_string(s.q_len) +
                   ", " + std::to_string(s.kv_len) + "] or 1");
  }
  out->key_stride = dims[3] == 1 ? 0 : 1;
  out->row_stride = dims[2] == 1 ? 0 : dims[3];
  out->head_stride = dims[1] == 1 ? 0 : dims[2] * dims[3];
  out->batch_stride = dims[0] == 1 ? 0 : dims[1] * dims[2] * dims[3];
  out->data = buf->untyped_data();
  return ffi::Error::Success();
}
inline ffi::Error DecodeDense(ExtraOperands t, const AttentionShape& s, int num_splits, DenseParams* out) {
  JAXFLASH_RETURN_IF_ERROR(DecodeDenseTerm("the dense bias", t.bias, s, false, &out->bias));
  JAXFLASH_RETURN_IF_ERROR(DecodeDenseTerm("the dense mask", t.mask, s, true, &out->mask));
  if (out->On() && num_splits > 1) return Invalid("split-KV (num_splits > 1) does not take a dense bias or mask");
  return ffi::Error::Success();
}
inline ffi::Error DecodeAlibi(ExtraOperands t, const AttentionShape& s, const float** out) {
  if (t.alibi == nullptr || t.alibi->element_count() == 0) return ffi::Error::Success();
  if (t.alibi->element_type() != ffi::DataType::F32) return Invalid("alibi slopes must be float32");
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("alibi slopes", t.alibi->dimensions(), {s.q_heads}, s.batch));
  *out = static_cast<const float*>(t.alibi->untyped_data());
  return ffi::Error::Success();
}
inline ffi::Error DecodeSegments(ExtraOperands t, const AttentionShape& s, int num_splits, MaskParams* mask) {
  if (t.q == nullptr || t.kv == nullptr) return ffi::Error::Success();
  if (t.q->element_type() != ffi::DataType::S32 || t.kv->element_type() != ffi::DataType::S32) {
    return Invalid("segment tables must be int32");
  }
  if (t.q->element_count() == 0 && t.kv->element_count() == 0) return ffi::Error::Success();
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("query segment table", t.q->dimensions(), {s.q_len, kSegmentFields}, s.batch));
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("key segment table", t.kv->dimensions(), {s.kv_len, kSegmentFields}, s.batch));
  if (num_splits > 1) return Invalid("split-KV (num_splits > 1) does not take segment ids");
  mask->q_segments = static_cast<const int32_t*>(t.q->untyped_data());
  mask->kv_segments = static_cast<const int32_t*>(t.kv->untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error CheckLike(const char* name, ffi::AnyBuffer buf, ffi::AnyBuffer like) {
  if (buf.element_type() != like.element_type()) {
    return Invalid(std::string(name) + " dtype differs from its primal");
  }
  const auto a = buf.dimensions();
  const auto b = like.dimensions();
  bool same = a.size() == b.size();
  for (size_t i = 0; same && i < a.size(); ++i) same = a[i] == b[i];
  if (!same) return Invalid(std::string(name) + " has shape " + ShapeString(a) + ", expected " + ShapeString(b));
  return ffi::Error::Success();
}

// An output-shaped buffer (o, its cotangent): q's dtype and shape, but the
// value's head dim.
inline ffi::Error CheckOutput(const char* name, ffi::AnyBuffer buf, ffi::AnyBuffer q, const AttentionShape& s) {
  if (buf.element_type() != q.element_type()) return Invalid(std::string(name) + " dtype differs from the query's");
  return ExpectShape(name, buf.dimensions(), {s.q_len, s.q_heads, s.v_dim()}, s.batch);
}

// Window sides past any sequence bound nothing; they are capped at 2^29 (as
// the Python API's attention.MAX_WINDOW), where MaskPolicy's 32-bit position
// arithmetic stays exact (a window of 2^32 was once read there as 0).
constexpr int64_t kMaxWindow = int64_t(1) << 29;
// The logit soft-cap (params.h): 0 for none, else finite and positive.
inline ffi::Error DecodeSoftcap(float softcap, float* out) {
  if (!std::isfinite(softcap) || softcap < 0) return Invalid("softcap must be finite and >= 0 (0: none)");
  *out = softcap;
  return ffi::Error::Success();
}

inline ffi::Error DecodeMask(float scale, int64_t window_left, int64_t window_right,
                             bool bottom_right, MaskParams* mask) {
  if (!std::isfinite(scale)) return Invalid("scale must be finite");
  mask->window_left = window_left < 0 ? -1 : std::min(window_left, kMaxWindow);
  mask->window_right = window_right < 0 ? -1 : std::min(window_right, kMaxWindow);
  mask->bottom_right = bottom_right;
  return ffi::Error::Success();
}

// tile: see FwdParams::tile (python -m jaxflash.tune, the tile cache, the tile tests).
inline ffi::Error DecodeTile(int64_t tile, int* out) {
  if (tile < 0 || tile >= 2 * FwdParams::kTilePreferred) {
    return Invalid("tile must be in [0, " + std::to_string(2 * FwdParams::kTilePreferred - 1) + "], got " +
                   std::to_string(tile));
  }
  *out = static_cast<int>(tile);
  return ffi::Error::Success();
}

// The outputs of a forward call: o and lse, and the split-KV partials, which
// the caller sizes for num_splits (FwdParams::num_splits; unused, and
// normally empty, with one split).
struct ForwardOutputs {
  ffi::Result<ffi::AnyBuffer> o, lse, o_partial, lse_partial;
};

constexpr int64_t kMaxSplits = 1024;

inline ffi::Error DecodeOutputs(ForwardOutputs out, ffi::AnyBuffer q, int64_t num_splits,
                                FwdParams* p) {
  const AttentionShape& s = p->shape;
  JAXFLASH_RETURN_IF_ERROR(CheckOutput("output", *out.o, q, s));
  JAXFLASH_RETURN_IF_ERROR(CheckRowStats("lse", *out.lse, s));
  if (num_splits < 1 || num_splits > kMaxSplits) {
    return Invalid("num_splits must be in [1, " + std::to_string(kMaxSplits) + "], got " +
                   std::to_string(num_splits));
  }
  p->num_splits = static_cast<int>(num_splits);
  p->o = out.o->untyped_data();
  p->lse = static_cast<float*>(out.lse->untyped_data());
  if (num_splits == 1) return ffi::Error::Success();
  if (out.o_partial->element_type() != ffi::DataType::F32 ||
      out.lse_partial->element_type() != ffi::DataType::F32) {
    return Invalid("the split-KV partials must be float32");
  }
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("o_partial", out.o_partial->dimensions(),
                                       {num_splits, s.q_len, s.q_heads, s.v_dim()}, s.batch));
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("lse_partial", out.lse_partial->dimensions(),
                                       {num_splits, s.q_len, s.q_heads}, s.batch));
  p->o_partial = static_cast<float*>(out.o_partial->untyped_data());
  p->lse_partial = static_cast<float*>(out.lse_partial->untyped_data());
  return ffi::Error::Success();
}

// Everything both platforms decode for the forward call.
inline ffi::Error DecodeForward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                                ffi::AnyBuffer diag_offsets, ExtraOperands extras, ForwardOutputs out, float scale,
                                int64_t window_left, int64_t window_right, bool bottom_right, int64_t tile,
                                int64_t num_splits, FwdParams* p) {
  JAXFLASH_RETURN_IF_ERROR(DecodeProblem(q, k, v, &p->shape, &p->dtype));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("query_seq_lengths", q_lengths, p->shape));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("key_value_seq_lengths", kv_lengths, p->shape));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("diagonal_offsets", diag_offsets, p->shape));
  JAXFLASH_RETURN_IF_ERROR(DecodeOutputs(out, q, num_splits, p));
  JAXFLASH_RETURN_IF_ERROR(DecodeMask(scale, window_left, window_right, bottom_right, &p->mask));
  JAXFLASH_RETURN_IF_ERROR(DecodeTile(tile, &p->tile));
  JAXFLASH_RETURN_IF_ERROR(DecodeSegments(extras, p->shape, p->num_splits, &p->mask));
  JAXFLASH_RETURN_IF_ERROR(DecodeAlibi(extras, p->shape, &p->alibi));
  JAXFLASH_RETURN_IF_ERROR(DecodeDense(extras, p->shape, p->num_splits, &p->dense));
  p->mask.diag_offsets = PerBatch(diag_offsets);
  p->scale = scale;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->q_lengths = PerBatch(q_lengths);
  p->kv_lengths = PerBatch(kv_lengths);
  return ffi::Error::Success();
}

// The paged forward: q [batch, q_len, q_heads, head_dim], key/value pages
// [num_pages, page_size, kv_heads, head_dim], page_table [batch, max_pages]
// int32, kv_lengths [batch] int32; bottom-right alignment (query row i at
// position kv_lengths[b] - q_len + i). The kernels read K/V through PagedKv
// (params.h), over a logical length of max_pages * page_size.
inline ffi::Error DecodePagedForward(ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                     ffi::AnyBuffer page_table, ffi::AnyBuffer kv_lengths,
                                     ExtraOperands extras, ForwardOutputs out, float scale, int64_t window_left,
                                     int64_t window_right, int64_t tile, int64_t num_splits,
                                     FwdParams* p) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2) {
    return Invalid("paged attention takes query [batch, q_len, heads, head_dim], pages [num_pages, "
                   "page_size, kv_heads, head_dim] and page_table [batch, max_pages], got " +
                   ShapeString(qd) + ", " + ShapeString(kd) + " and " + ShapeString(td));
  }
  AttentionShape& sh = p->shape;
  sh.batch = qd[0];
  sh.q_len = qd[1];
  sh.q_heads = qd[2];
  sh.head_dim = qd[3];
  sh.kv_heads = kd[2];
  p->paged.num_pages = kd[0];
  p->paged.SetPageSize(kd[1]);
  p->paged.max_pages = td[1];
  if (kd[3] != sh.head_dim || td[0] != sh.batch) {
    return Invalid("key_pages " + ShapeString(kd) + " and page_table " + ShapeString(td) +
                   " do not match query " + ShapeString(qd));
  }
  const auto vd = v_pages.dimensions();
  if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2]) {
    return Invalid("value_pages " + ShapeString(vd) + " must hold the pages, rows and heads of key_pages " +
                   ShapeString(kd));
  }
  sh.v_head_dim = vd[3];
  if (page_table.element_type() != ffi::DataType::S32) return Invalid("page_table must be int32");
  if (p->paged.num_pages < 1 || p->paged.page_size < 1 || p->paged.max_pages < 1 ||
      p->paged.max_pages * p->paged.page_size >= kMaxSequence) {
    return Invalid("paged attention needs at least one page and max_pages * page_size below 2^30");
  }
  sh.kv_len = p->paged.max_pages * p->paged.page_size;
  JAXFLASH_RETURN_IF_ERROR(CheckProblem(q, k_pages, v_pages, sh, &p->dtype));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("kv_lengths", kv_lengths, sh));
  JAXFLASH_RETURN_IF_ERROR(DecodeOutputs(out, q, num_splits, p));
  JAXFLASH_RETURN_IF_ERROR(DecodeMask(scale, window_left, window_right, /*bottom_right=*/true, &p->mask));
  JAXFLASH_RETURN_IF_ERROR(DecodeTile(tile, &p->tile));
  // Segment tables (v3) index keys by their logical position in the table's sequence.
  JAXFLASH_RETURN_IF_ERROR(DecodeSegments(extras, sh, p->num_splits, &p->mask));
  JAXFLASH_RETURN_IF_ERROR(DecodeAlibi(extras, sh, &p->alibi));  // v4
  p->scale = scale;
  p->q = q.untyped_data();
  p->k = k_pages.untyped_data();
  p->v = v_pages.untyped_data();
  p->q_lengths = nullptr;  // every query row is real
  p->kv_lengths = PerBatch(kv_lengths);
  p->paged.table = static_cast<const int32_t*>(page_table.untyped_data());
  return ffi::Error::Success();
}

struct BackwardBuffers {
  ffi::AnyBuffer q, k, v, o, lse, dout, dlse, q_lengths, kv_lengths, diag_offsets;
  ExtraOperands extras;
};

// `delta` and `dq_accum` are outputs the caller never reads: the backward's
// workspaces, passed as results so no handler allocates at run time (XLA's
// scratch allocator is unavailable inside command buffers). delta is the
// O(T * H) row statistic; dq_accum is float32 laid out like q when the caller
// leaves room for the fused backward's dQ sums, or has a last dimension of 0.
// The operands and attributes of every backward-shaped target (the backward's,
// the bias gradient's), and its delta workspace.
inline ffi::Error DecodeBackwardInputs(const BackwardBuffers& in, ffi::Result<ffi::AnyBuffer> delta, float scale,
                                       int64_t window_left, int64_t window_right, bool bottom_right, BwdParams* p) {
  JAXFLASH_RETURN_IF_ERROR(DecodeProblem(in.q, in.k, in.v, &p->shape, &p->dtype));
  JAXFLASH_RETURN_IF_ERROR(CheckOutput("output", in.o, in.q, p->shape));
  JAXFLASH_RETURN_IF_ERROR(CheckOutput("output cotangent", in.dout, in.q, p->shape));
  JAXFLASH_RETURN_IF_ERROR(CheckRowStats("lse", in.lse, p->shape));
  JAXFLASH_RETURN_IF_ERROR(CheckRowStats("lse cotangent", in.dlse, p->shape));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("query_seq_lengths", in.q_lengths, p->shape));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("key_value_seq_lengths", in.kv_lengths, p->shape));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("diagonal_offsets", in.diag_offsets, p->shape));
  JAXFLASH_RETURN_IF_ERROR(CheckRowStats("delta", *delta, p->shape));
  JAXFLASH_RETURN_IF_ERROR(DecodeMask(scale, window_left, window_right, bottom_right, &p->mask));
  JAXFLASH_RETURN_IF_ERROR(DecodeSegments(in.extras, p->shape, 1, &p->mask));
  JAXFLASH_RETURN_IF_ERROR(DecodeAlibi(in.extras, p->shape, &p->alibi));
  JAXFLASH_RETURN_IF_ERROR(DecodeDense(in.extras, p->shape, 1, &p->dense));
  p->mask.diag_offsets = PerBatch(in.diag_offsets);
  p->scale = scale;
  p->q = in.q.untyped_data();
  p->k = in.k.untyped_data();
  p->v = in.v.untyped_data();
  p->o = in.o.untyped_data();
  p->lse = static_cast<const float*>(in.lse.untyped_data());
  p->dout = in.dout.untyped_data();
  p->dlse = static_cast<const float*>(in.dlse.untyped_data());
  p->q_lengths = PerBatch(in.q_lengths);
  p->kv_lengths = PerBatch(in.kv_lengths);
  p->delta = static_cast<float*>(delta->untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error DecodeBackward(const BackwardBuffers& in, ffi::Result<ffi::AnyBuffer> dq,
                                 ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                 ffi::Result<ffi::AnyBuffer> delta, ffi::Result<ffi::AnyBuffer> dq_accum,
                                 float scale, int64_t window_left, int64_t window_right, bool bottom_right,
                                 bool deterministic, int64_t tile, BwdParams* p) {
  JAXFLASH_RETURN_IF_ERROR(DecodeBackwardInputs(in, delta, scale, window_left, window_right, bottom_right, p));
  JAXFLASH_RETURN_IF_ERROR(CheckLike("dq", *dq, in.q));
  JAXFLASH_RETURN_IF_ERROR(CheckLike("dk", *dk, in.k));
  JAXFLASH_RETURN_IF_ERROR(CheckLike("dv", *dv, in.v));
  const bool sums = dq_accum->size_bytes() > 0;
  if (dq_accum->element_type() != ffi::DataType::F32) return Invalid("dq_accum must be float32");
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("dq_accum", dq_accum->dimensions(),
                                       {p->shape.q_len, p->shape.q_heads, sums ? p->shape.head_dim : 0},
                                       p->shape.batch));
  p->deterministic = deterministic;
  JAXFLASH_RETURN_IF_ERROR(DecodeTile(tile, &p->tile));
  p->dq = dq->untyped_data();
  p->dk = dk->untyped_data();
  p->dv = dv->untyped_data();
  p->dq_accum = sums ? static_cast<float*>(dq_accum->untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// A bias gradient has the bias's shape.
inline ffi::Error ExpectBiasShape(const ffi::AnyBuffer& dbias, const ffi::AnyBuffer& bias) {
  const auto want = bias.dimensions();
  const auto got = dbias.dimensions();
  bool same = got.size() == want.size();
  for (size_t i = 0; same && i < got.size(); ++i) same = got[i] == want[i];
  if (!same) {
    return Invalid("the bias gradient has shape " + ShapeString(got) + ", expected the bias's " + ShapeString(want));
  }
  return ffi::Error::Success();
}

// The dB result of the dense backward with dB (jaxflash_bwd_db_v1, CUDA): the
// bias's shape and dtype, which is the input's (BwdParams::ds_out in the
// bias's layout).
inline ffi::Error DecodeStagedBiasGradient(ffi::Result<ffi::AnyBuffer> dbias, const ffi::AnyBuffer& q,
                                           const ffi::AnyBuffer& bias, BwdParams* p) {
  if (!p->dense.bias.On()) return Invalid("the bias gradient needs a dense bias");
  if (dbias->element_type() != q.element_type() || bias.element_type() != q.element_type()) {
    return Invalid("dB out of the backward needs the bias and dB in the query's dtype");
  }
  JAXFLASH_RETURN_IF_ERROR(ExpectBiasShape(*dbias, bias));
  p->ds_out = p->dense.bias;
  p->ds_out.data = dbias->untyped_data();
  return ffi::Error::Success();
}

// The dS result of the older dense backward with dS (jaxflash_bwd_ds_v1, CUDA;
// kept so that exported programs load): [batch..., q_heads, q_len, kv_len] in
// the input dtype, which the caller sums over the bias's broadcast axes.
inline ffi::Error DecodeScoreGradient(ffi::Result<ffi::AnyBuffer> ds, const ffi::AnyBuffer& q, BwdParams* p) {
  if (ds->element_type() != q.element_type()) return Invalid("ds must have the query's dtype");
  const AttentionShape& sh = p->shape;
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("ds", ds->dimensions(), {sh.q_heads, sh.q_len, sh.kv_len}, sh.batch));
  DenseTerm& out = p->ds_out;
  out.data = ds->untyped_data();
  out.dtype = p->dtype;
  out.key_stride = 1;
  out.row_stride = sh.kv_len;
  out.head_stride = sh.q_len * sh.kv_len;
  out.batch_stride = sh.q_heads * out.head_stride;
  return ffi::Error::Success();
}

// The bias gradient's targets (jaxflash_bias_grad_v2 and v1): the backward
// v5's operands, results dB (the bias's shape; v2 in the bias's dtype, v1 in
// float32) and delta (workspace).
template <int kVersion>
inline ffi::Error DecodeBiasGradient(const BackwardBuffers& in, ffi::Result<ffi::AnyBuffer> dbias,
                                     ffi::Result<ffi::AnyBuffer> delta, float scale, int64_t window_left,
                                     int64_t window_right, bool bottom_right, BwdParams* p) {
  static_assert(kVersion == 1 || kVersion == 2, "bias gradient v1 or v2");
  JAXFLASH_RETURN_IF_ERROR(DecodeBackwardInputs(in, delta, scale, window_left, window_right, bottom_right, p));
  if (!p->dense.bias.On()) return Invalid("the bias gradient needs a dense bias");
  if (kVersion == 1 && dbias->element_type() != ffi::DataType::F32) {
    return Invalid("the bias gradient must be float32");
  }
  if (kVersion == 2 && dbias->element_type() != in.extras.bias->element_type()) {
    return Invalid("the bias gradient must have the bias's dtype");
  }
  JAXFLASH_RETURN_IF_ERROR(ExpectBiasShape(*dbias, *in.extras.bias));
  p->dbias = dbias->untyped_data();
  if (!DecodeDType(dbias->element_type(), &p->dbias_dtype)) return Invalid("the bias gradient's dtype is not float");
  return ffi::Error::Success();
}

// The argument lists of the FFI targets, shared by both platforms so the
// Python side calls one signature; each platform prepends its context.

// The segment-table target (jaxflash_segment_tables_v1): ids int32 [*batch,
// q_len] and [*batch, kv_len], lengths and diagonal offsets as the attention
// targets take them (empty: none), tables [*batch, len, kSegmentFields]. The
// launcher refuses sides longer than its sort holds (kMaxSortedSegmentIds).
inline ffi::Error DecodeSegmentTables(ffi::AnyBuffer q_ids, ffi::AnyBuffer kv_ids, ffi::AnyBuffer q_lengths,
                                      ffi::AnyBuffer kv_lengths, ffi::AnyBuffer diag_offsets,
                                      ffi::Result<ffi::AnyBuffer> q_table, ffi::Result<ffi::AnyBuffer> kv_table,
                                      int64_t window_left, int64_t window_right, bool bottom_right,
                                      SegmentTableParams* p) {
  for (const ffi::AnyBuffer* b : {&q_ids, &kv_ids}) {
    if (b->element_type() != ffi::DataType::S32) return Invalid("segment ids must be int32");
    if (b->dimensions().size() < 1) return Invalid("segment ids need a sequence axis");
  }
  const auto qd = q_ids.dimensions(), kd = kv_ids.dimensions();
  AttentionShape s;
  s.q_len = qd.back();
  s.kv_len = kd.back();
  s.batch = LeadingProduct(qd, 1);
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("key segment ids", kd, {s.kv_len}, s.batch));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("query_seq_lengths", q_lengths, s));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("key_value_seq_lengths", kv_lengths, s));
  JAXFLASH_RETURN_IF_ERROR(CheckLengths("diagonal_offsets", diag_offsets, s));
  if (q_table->element_type() != ffi::DataType::S32 || kv_table->element_type() != ffi::DataType::S32) {
    return Invalid("segment tables must be int32");
  }
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("query segment table", q_table->dimensions(), {s.q_len, kSegmentFields}, s.batch));
  JAXFLASH_RETURN_IF_ERROR(ExpectShape("key segment table", kv_table->dimensions(), {s.kv_len, kSegmentFields}, s.batch));
  JAXFLASH_RETURN_IF_ERROR(DecodeMask(1.f, window_left, window_right, bottom_right, &p->mask));
  p->batch = s.batch;
  p->q_len = s.q_len;
  p->kv_len = s.kv_len;
  p->q_ids = static_cast<const int32_t*>(q_ids.untyped_data());
  p->kv_ids = static_cast<const int32_t*>(kv_ids.untyped_data());
  p->q_lengths = PerBatch(q_lengths);
  p->kv_lengths = PerBatch(kv_lengths);
  p->mask.diag_offsets = PerBatch(diag_offsets);
  p->q_table = static_cast<int32_t*>(q_table->untyped_data());
  p->kv_table = static_cast<int32_t*>(kv_table->untyped_data());
  return ffi::Error::Success();
}

template <typename Binding>
auto BindSegmentTables(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // query segment ids
      .template Arg<ffi::AnyBuffer>()                       // key segment ids
      .template Arg<ffi::AnyBuffer>()                       // query_seq_lengths
      .template Arg<ffi::AnyBuffer>()                       // key_value_seq_lengths
      .template Arg<ffi::AnyBuffer>()                       // diagonal_offsets
      .template Ret<ffi::AnyBuffer>()                       // query table
      .template Ret<ffi::AnyBuffer>()                       // key table
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<bool>("bottom_right");
}

// The results of both forward targets (ForwardOutputs).
template <typename Binding>
auto WithForwardResults(Binding binding) {
  return std::move(binding).template Ret<ffi::AnyBuffer>()  // o
      .template Ret<ffi::AnyBuffer>()            // lse
      .template Ret<ffi::AnyBuffer>()            // o_partial (split-KV workspace)
      .template Ret<ffi::AnyBuffer>();           // lse_partial
}

// The target versions (module.cc): v1; v2 = v1 + the `softcap` attribute;
// v3 = v2 + the two segment-table operands after diagonal_offsets; v4 = v3 +
// the ALiBi slopes operand after them (forward and backward; the paged forward
// has them after kv_lengths); v5 = v4 + the dense bias and mask operands after
// the slopes (forward and backward; CPU only). A binding cannot be moved,
// only built, so each step takes a function `make` that builds the one before.
template <int kVersion, typename Make>
auto WithSoftcap(Make make) {
  if constexpr (kVersion >= 2) {
    return make().template Attr<float>("softcap");
  } else {
    return make();
  }
}
template <int kVersion, typename Make>
auto WithSegments(Make make) {
  if constexpr (kVersion >= 5) {
    return make().template Arg<ffi::AnyBuffer>()  // query segment table
        .template Arg<ffi::AnyBuffer>()           // key segment table
        .template Arg<ffi::AnyBuffer>()           // ALiBi slopes
        .template Arg<ffi::AnyBuffer>()           // dense bias
        .template Arg<ffi::AnyBuffer>();          // dense mask
  } else if constexpr (kVersion >= 4) {
    return make().template Arg<ffi::AnyBuffer>()  // query segment table
        .template Arg<ffi::AnyBuffer>()           // key segment table
        .template Arg<ffi::AnyBuffer>();          // ALiBi slopes
  } else if constexpr (kVersion >= 3) {
    return make().template Arg<ffi::AnyBuffer>()  // query segment table
        .template Arg<ffi::AnyBuffer>();          // key segment table
  } else {
    return make();
  }
}

// The mask rule's attributes, which every attention target takes after its
// results (the paged forward, without `bottom_right`, spells its own).
template <typename Binding>
auto WithMaskAttributes(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<float>("scale")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<bool>("bottom_right");
}

template <int kVersion, typename Binding>
auto BindForward(Binding binding) {
  return WithSoftcap<kVersion>([&] {
    return WithMaskAttributes(WithForwardResults(WithSegments<kVersion>([&] {
             return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
                 .template Arg<ffi::AnyBuffer>()                       // k
                 .template Arg<ffi::AnyBuffer>()                       // v
                 .template Arg<ffi::AnyBuffer>()                       // query_seq_lengths
                 .template Arg<ffi::AnyBuffer>()                       // key_value_seq_lengths
                 .template Arg<ffi::AnyBuffer>();                      // diagonal_offsets
           })))
        .template Attr<int64_t>("tile")
        .template Attr<int64_t>("num_splits");
  });
}

template <int kVersion, typename Binding>
auto BindPagedForward(Binding binding) {
  return WithSoftcap<kVersion>([&] { return WithForwardResults(WithSegments<kVersion>([&] {
                                return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
                                .template Arg<ffi::AnyBuffer>()                // key_pages
                                .template Arg<ffi::AnyBuffer>()                // value_pages
                                .template Arg<ffi::AnyBuffer>()                // page_table
                                .template Arg<ffi::AnyBuffer>();               // kv_lengths
                              }))
      .template Attr<float>("scale")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<int64_t>("tile")
      .template Attr<int64_t>("num_splits"); });
}

// The backward's operands, as its version `kVersion` takes them (shared by the
// bias gradient's target, which takes v5's). By reference: a binding can only
// be consumed (its chained methods take it as an rvalue), never moved.
template <int kVersion, typename Binding>
auto BindBackwardOperands(Binding&& binding) {
  return WithSegments<kVersion>([&] {
    return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
        .template Arg<ffi::AnyBuffer>()                       // k
        .template Arg<ffi::AnyBuffer>()                       // v
        .template Arg<ffi::AnyBuffer>()                       // o
        .template Arg<ffi::AnyBuffer>()                       // lse
        .template Arg<ffi::AnyBuffer>()                       // dout
        .template Arg<ffi::AnyBuffer>()                       // dlse
        .template Arg<ffi::AnyBuffer>()                       // query_seq_lengths
        .template Arg<ffi::AnyBuffer>()                       // key_value_seq_lengths
        .template Arg<ffi::AnyBuffer>();                      // diagonal_offsets
  });
}

// The backward's attributes, after its results.
template <typename Binding>
auto BindBackwardAttributes(Binding&& binding) {
  return WithMaskAttributes(std::forward<Binding>(binding))
      .template Attr<bool>("deterministic")
      .template Attr<int64_t>("tile");
}

// kWithDb: jaxflash_bwd_db_v1 (and the older _ds_v1), the v5 backward with a dB
// (dS) result after dq_accum.
template <int kVersion, bool kWithDb = false, typename Binding>
auto BindBackward(Binding binding) {
  return WithSoftcap<kVersion>([&] {
    auto results = [&] {
      return BindBackwardOperands<kVersion>(std::move(binding))
          .template Ret<ffi::AnyBuffer>()   // dq
          .template Ret<ffi::AnyBuffer>()   // dk
          .template Ret<ffi::AnyBuffer>()   // dv
          .template Ret<ffi::AnyBuffer>()   // delta (workspace)
          .template Ret<ffi::AnyBuffer>();  // dq_accum (workspace, may be empty)
    };
    if constexpr (kWithDb) {
      return BindBackwardAttributes(results().template Ret<ffi::AnyBuffer>());  // dbias (ds)
    } else {
      return BindBackwardAttributes(results());
    }
  });
}

// A platform's v5 backward bound with a dB (dS) result after dq_accum
// (BindBackward<5, true>): the operands unpacked as the v5 handlers do, then
// backward(ctx, &out, q, k, v, o, lse, dout, dlse, ql, kvl, diag, extras, dq,
// dk, dv, delta, dq_accum, attrs...).
template <typename Backward>
constexpr auto WithScoreGradResult(Backward backward) {
  using Buf = ffi::AnyBuffer;
  return [backward](auto ctx, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout, Buf dlse, Buf ql, Buf kvl, Buf diag,
                    Buf q_seg, Buf kv_seg, Buf alibi, Buf bias, Buf mask, ffi::Result<Buf> dq, ffi::Result<Buf> dk,
                    ffi::Result<Buf> dv, ffi::Result<Buf> delta, ffi::Result<Buf> dq_accum, ffi::Result<Buf> out,
                    auto... attrs) {
    return backward(ctx, &out, q, k, v, o, lse, dout, dlse, ql, kvl, diag,
                    ExtraOperands{&q_seg, &kv_seg, &alibi, &bias, &mask}, dq, dk, dv, delta, dq_accum, attrs...);
  };
}

// jaxflash_bias_grad_v2 and v1: the operands of the backward v5, results dB and delta,
// the backward's attributes but `deterministic` and `tile`.
template <typename Binding>
auto BindBiasGradient(Binding binding) {
  return WithMaskAttributes(BindBackwardOperands<5>(std::move(binding))
                                .template Ret<ffi::AnyBuffer>()   // dbias
                                .template Ret<ffi::AnyBuffer>())  // delta (workspace)
      .template Attr<float>("softcap");
}

}  // namespace jaxflash::handlers
