// Host side of the TMA: encodes the tensor maps the Hopper kernels copy through.
//
// The encoder is a CUDA driver function; it is fetched from the driver at run
// time through the runtime's entry-point query, so the extension does not link
// against the driver library (it imports on machines without a GPU).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "jaxflash/launch.h"
#include "jaxflash/params.h"

namespace jaxflash {
namespace sm90 {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn TensorMapEncoder() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiledFn>(f) : nullptr;
  }();
  return fn;
}

// A map over a dense [batch, seq, heads, head_dim] tensor whose box is `rows`
// consecutive rows x 128 bytes of columns (64 16-bit or 32 float32 elements)
// of one (batch, head): one 128-byte-swizzled column block of SwizzledTile
// (wgmma.cuh), so a tile of D columns is D / 64 (float32: D / 32) copies.
// Columns past head_dim (or `cols`: v and o take the value's head dim) and
// rows past seq are zero-filled on load and clipped on store or reduction.
inline Status EncodeRowsMap(CUtensorMap* map, const void* base, DType dtype, const AttentionShape& sh,
                            bool query_side, int rows, int64_t cols = 0) {
  EncodeTiledFn encode = TensorMapEncoder();
  if (encode == nullptr) return Status::Internal("the CUDA driver has no cuTensorMapEncodeTiled");
  const int64_t kElem = dtype == DType::kFloat32 ? 4 : 2;
  const CUtensorMapDataType type = dtype == DType::kFloat32   ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : dtype == DType::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                              : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const int64_t seq = query_side ? sh.q_len : sh.kv_len;
  const int64_t heads = query_side ? sh.q_heads : sh.kv_heads;
  const int64_t dim = cols > 0 ? cols : sh.head_dim;
  const cuuint64_t dims[4] = {cuuint64_t(dim), cuuint64_t(heads), cuuint64_t(seq), cuuint64_t(sh.batch)};
  const cuuint64_t strides[3] = {cuuint64_t(dim * kElem), cuuint64_t(heads * dim * kElem),
                                 cuuint64_t(seq * heads * dim * kElem)};
  const cuuint32_t box[4] = {cuuint32_t(128 / kElem), 1, cuuint32_t(rows), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, type, 4, const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("cuTensorMapEncodeTiled failed (error " + std::to_string(int(r)) + ")");
  }
  return Status::Ok();
}

// A map over a 16-bit dense bias (params.h DenseTerm) as [batch, heads,
// q_len, kv_len] with its own strides, whose box is `rows` query rows x 64
// keys (128 bytes: one 128-byte-swizzled block of SwizzledTile) of one
// (batch, head). A broadcast batch or head axis (stride 0) is an axis of one
// element, read at coordinate 0. Only for a bias whose keys are contiguous
// and whose other strides are whole 16-byte units (DenseTile::Stages); rows
// and keys past the call are zero-filled.
inline Status EncodeBiasMap(CUtensorMap* map, const DenseTerm& bias, const AttentionShape& sh, int rows) {
  EncodeTiledFn encode = TensorMapEncoder();
  if (encode == nullptr) return Status::Internal("the CUDA driver has no cuTensorMapEncodeTiled");
  const CUtensorMapDataType type =
      bias.dtype == DType::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const int64_t q_len = sh.q_len > 0 ? sh.q_len : 1, kv_len = sh.kv_len > 0 ? sh.kv_len : 1;
  const int64_t row_bytes = bias.row_stride * 2;
  // A broadcast axis keeps a stride past the axes below it (never stepped along).
  const int64_t head_bytes = bias.head_stride != 0 ? bias.head_stride * 2 : row_bytes * q_len;
  const int64_t batch_bytes = bias.batch_stride != 0 ? bias.batch_stride * 2 : head_bytes * sh.q_heads;
  const cuuint64_t dims[4] = {cuuint64_t(kv_len), cuuint64_t(q_len),
                              cuuint64_t(bias.head_stride != 0 ? sh.q_heads : 1),
                              cuuint64_t(bias.batch_stride != 0 ? sh.batch : 1)};
  const cuuint64_t strides[3] = {cuuint64_t(row_bytes), cuuint64_t(head_bytes), cuuint64_t(batch_bytes)};
  const cuuint32_t box[4] = {64, cuuint32_t(rows), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, type, 4, const_cast<void*>(bias.data), dims, strides, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("cuTensorMapEncodeTiled (bias) failed (error " + std::to_string(int(r)) + ")");
  }
  return Status::Ok();
}

}  // namespace sm90
}  // namespace jaxflash
