// Declarations of the decode launchers, for the dispatch switch. Their
// definitions live in decode_kernel.cuh and merge.cu and are instantiated per
// (dtype, head-dim bucket) in decode_d*.cu, so including this header never
// instantiates a kernel.
#pragma once

#include "common/decode.h"
#include "jaxflash/launch.h"
#include "jaxflash/params.h"

namespace jaxflash {
namespace decode {

// Packed rows (common/decode.h) up to which a call runs on the decode kernel
// even unsplit: short queries against long K/V, where the training forward
// would read K/V once per query head in CTAs of mostly padding rows. At 128
// rows a K/V tile still carries ~128 flop per byte, memory-bound work for
// mma.sync; jaxflash/_splits.py (DECODE_MAX_ROWS) mirrors it.
constexpr int kMaxPackedRows = 128;

// Whether the decode kernel takes this tensor-core call: always when it is
// split or paged (only the decode kernel splits or reads pages), and for
// short queries. ALiBi included: its rows mix the heads of a group, and each
// row takes its own head's slope (score_mod.cuh, PackedAlibi).
inline bool UseDecodeKernel(const FwdParams& p) {
  return p.num_splits > 1 || p.paged.table != nullptr || p.shape.q_len * p.shape.group_size() <= kMaxPackedRows;
}

// `tma`: the GPU runs this build's sm_90a code, so the decode kernel may copy
// K/V with the tensor-memory accelerator (decode/kv_stages.cuh).
template <typename T, int kD>
Status LaunchDecode(const FwdParams& p, const CudaDevice& device, cudaStream_t stream, bool tma);

// Combines p.num_splits partials (p.o_partial, p.lse_partial) into p.o, p.lse.
template <typename T>
Status LaunchMergeSplits(const FwdParams& p, cudaStream_t stream);

}  // namespace decode
}  // namespace jaxflash
