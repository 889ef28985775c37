// CUDA FFI handlers: decode, check, launch on XLA's stream. They never
// synchronise and never allocate (the backward's workspaces are its delta and
// dq_accum outputs), and every launch error comes back as an ffi::Error.
#include <cuda_runtime_api.h>

#include "decode.h"
#include "handlers.h"

namespace jaxflash::handlers {
namespace {

ffi::Error CudaForward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths, ffi::AnyBuffer diag_offsets,
                      ExtraOperands extras,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> o_partial, ffi::Result<ffi::AnyBuffer> lse_partial,
                       float scale, int64_t window_left, int64_t window_right, bool bottom_right,
                       int64_t tile, int64_t num_splits, float softcap) {
  FwdParams p;
  JAXFLASH_RETURN_IF_ERROR(DecodeForward(q, k, v, q_lengths, kv_lengths, diag_offsets, extras, {o, lse, o_partial, lse_partial},
                                         scale, window_left, window_right, bottom_right, tile,
                                         num_splits, &p));
  JAXFLASH_RETURN_IF_ERROR(DecodeSoftcap(softcap, &p.softcap));
  CudaDevice device;
  JAXFLASH_RETURN_IF_ERROR(ToFfiError(CudaCurrentDevice(&device)));
  return ToFfiError(CudaAttentionForward(p, device, stream));
}

ffi::Error CudaPagedForward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                            ffi::AnyBuffer v_pages, ffi::AnyBuffer page_table, ffi::AnyBuffer kv_lengths,
                            ExtraOperands extras,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                            ffi::Result<ffi::AnyBuffer> o_partial, ffi::Result<ffi::AnyBuffer> lse_partial,
                            float scale, int64_t window_left, int64_t window_right, int64_t tile,
                            int64_t num_splits, float softcap) {
  FwdParams p;
  JAXFLASH_RETURN_IF_ERROR(DecodePagedForward(q, k_pages, v_pages, page_table, kv_lengths, extras,
                                              {o, lse, o_partial, lse_partial}, scale, window_left,
                                              window_right, tile, num_splits, &p));
  JAXFLASH_RETURN_IF_ERROR(DecodeSoftcap(softcap, &p.softcap));
  CudaDevice device;
  JAXFLASH_RETURN_IF_ERROR(ToFfiError(CudaCurrentDevice(&device)));
  return ToFfiError(CudaAttentionForward(p, device, stream));
}

ffi::Error CudaBackward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::AnyBuffer q_lengths,
                        ffi::AnyBuffer kv_lengths, ffi::AnyBuffer diag_offsets, ExtraOperands extras,
                        ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> delta, ffi::Result<ffi::AnyBuffer> dq_accum,
                        float scale, int64_t window_left, int64_t window_right, bool bottom_right,
                        bool deterministic, int64_t tile, float softcap,
                        ffi::Result<ffi::AnyBuffer>* dbias = nullptr, ffi::Result<ffi::AnyBuffer>* ds = nullptr) {
  BwdParams p;
  JAXFLASH_RETURN_IF_ERROR(DecodeBackward({q, k, v, o, lse, dout, dlse, q_lengths, kv_lengths,
                                           diag_offsets, extras},
                                          dq, dk, dv, delta, dq_accum, scale, window_left, window_right,
                                          bottom_right, deterministic, tile, &p));
  JAXFLASH_RETURN_IF_ERROR(DecodeSoftcap(softcap, &p.softcap));
  if (dbias != nullptr) JAXFLASH_RETURN_IF_ERROR(DecodeStagedBiasGradient(*dbias, q, *extras.bias, &p));
  if (ds != nullptr) JAXFLASH_RETURN_IF_ERROR(DecodeScoreGradient(*ds, q, &p));
  CudaDevice device;
  JAXFLASH_RETURN_IF_ERROR(ToFfiError(CudaCurrentDevice(&device)));
  // The launchers' workspace must fit in the delta output (launch.h): XLA's
  // scratch allocator fails inside command buffers, so there is no fallback.
  const size_t bytes = CudaBackwardWorkspaceBytes(p, device);
  if (bytes > delta->size_bytes()) {
    return ffi::Error::Internal("jaxflash: backward launcher wants " + std::to_string(bytes) +
                                " bytes of workspace, more than the " +
                                std::to_string(delta->size_bytes()) + "-byte delta output");
  }
  return ToFfiError(CudaAttentionBackward(p, p.delta, device, stream));
}

template <int kVersion>
ffi::Error CudaBiasGradientHandler(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                                   ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths, ffi::AnyBuffer diag_offsets,
                                   ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer alibi,
                                   ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> dbias,
                                   ffi::Result<ffi::AnyBuffer> delta, float scale, int64_t window_left,
                                   int64_t window_right, bool bottom_right, float softcap) {
  BwdParams p;
  JAXFLASH_RETURN_IF_ERROR(
      DecodeBiasGradient<kVersion>({q, k, v, o, lse, dout, dlse, q_lengths, kv_lengths, diag_offsets,
                                    ExtraOperands{&q_seg, &kv_seg, &alibi, &bias, &mask}},
                                   dbias, delta, scale, window_left, window_right, bottom_right, &p));
  JAXFLASH_RETURN_IF_ERROR(DecodeSoftcap(softcap, &p.softcap));
  CudaDevice device;
  JAXFLASH_RETURN_IF_ERROR(ToFfiError(CudaCurrentDevice(&device)));
  return ToFfiError(jaxflash::CudaBiasGradient(p, device, stream));
}

ffi::Error CudaSegmentTables(cudaStream_t stream, ffi::AnyBuffer q_ids, ffi::AnyBuffer kv_ids,
                             ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths, ffi::AnyBuffer diag_offsets,
                             ffi::Result<ffi::AnyBuffer> q_table, ffi::Result<ffi::AnyBuffer> kv_table,
                             int64_t window_left, int64_t window_right, bool bottom_right) {
  SegmentTableParams p;
  JAXFLASH_RETURN_IF_ERROR(DecodeSegmentTables(q_ids, kv_ids, q_lengths, kv_lengths, diag_offsets, q_table,
                                               kv_table, window_left, window_right, bottom_right, &p));
  CudaDevice device;
  JAXFLASH_RETURN_IF_ERROR(ToFfiError(CudaCurrentDevice(&device)));
  return ToFfiError(jaxflash::CudaSegmentTables(p, device, stream));
}

// The target versions (decode.h): v5 passes the segment tables, the ALiBi
// slopes and the dense bias and mask, v4 the tables and the slopes, v3 the
// tables only, v2 neither, v1 not the soft-cap attribute either.
using Buf = ffi::AnyBuffer;
constexpr auto CudaForwardV5 = [](cudaStream_t stream, Buf q, Buf k, Buf v, Buf ql, Buf kvl, Buf diag, Buf q_seg,
                                 Buf kv_seg, Buf alibi, Buf bias, Buf mask, auto... rest) {
  return CudaForward(stream, q, k, v, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg, &alibi, &bias, &mask}, rest...);
};
constexpr auto CudaBackwardV5 = [](cudaStream_t stream, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout, Buf dlse, Buf ql,
                                  Buf kvl, Buf diag, Buf q_seg, Buf kv_seg, Buf alibi, Buf bias, Buf mask,
                                  auto... rest) {
  return CudaBackward(stream, q, k, v, o, lse, dout, dlse, ql, kvl, diag,
                      ExtraOperands{&q_seg, &kv_seg, &alibi, &bias, &mask}, rest...);
};
// The v5 backward with dS out of the dense tile (BwdParams::ds_out): dB in the
// bias's layout, or the whole dS (kWholeDs: the older target's).
template <bool kWholeDs>
constexpr auto CudaBackwardDsOut =
    WithScoreGradResult([](cudaStream_t stream, ffi::Result<Buf>* out, auto... rest) {
      return CudaBackward(stream, rest..., kWholeDs ? nullptr : out, kWholeDs ? out : nullptr);
    });
constexpr auto CudaForwardV4 = [](cudaStream_t stream, Buf q, Buf k, Buf v, Buf ql, Buf kvl, Buf diag, Buf q_seg,
                                 Buf kv_seg, Buf alibi, auto... rest) {
  return CudaForward(stream, q, k, v, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg, &alibi}, rest...);
};
constexpr auto CudaBackwardV4 = [](cudaStream_t stream, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout, Buf dlse, Buf ql,
                                  Buf kvl, Buf diag, Buf q_seg, Buf kv_seg, Buf alibi, auto... rest) {
  return CudaBackward(stream, q, k, v, o, lse, dout, dlse, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg, &alibi},
                     rest...);
};
constexpr auto CudaForwardV3 = [](cudaStream_t stream, Buf q, Buf k, Buf v, Buf ql, Buf kvl, Buf diag, Buf q_seg,
                                 Buf kv_seg, auto... rest) {
  return CudaForward(stream, q, k, v, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg}, rest...);
};
constexpr auto CudaForwardV2 = [](cudaStream_t stream, Buf q, Buf k, Buf v, Buf ql, Buf kvl, Buf diag, auto... rest) {
  return CudaForward(stream, q, k, v, ql, kvl, diag, ExtraOperands{}, rest...);
};
constexpr auto CudaBackwardV3 = [](cudaStream_t stream, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout, Buf dlse, Buf ql,
                                  Buf kvl, Buf diag, Buf q_seg, Buf kv_seg, auto... rest) {
  return CudaBackward(stream, q, k, v, o, lse, dout, dlse, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg}, rest...);
};
constexpr auto CudaBackwardV2 = [](cudaStream_t stream, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout, Buf dlse, Buf ql,
                                  Buf kvl, Buf diag, auto... rest) {
  return CudaBackward(stream, q, k, v, o, lse, dout, dlse, ql, kvl, diag, ExtraOperands{}, rest...);
};
constexpr auto CudaForwardV1 = [](auto... args) { return CudaForwardV2(args..., 0.f); };
// The paged forward: v4 passes the segment tables and the ALiBi slopes after
// kv_lengths, v3 the tables, v2 neither.
constexpr auto CudaPagedForwardV4 = [](cudaStream_t stream, Buf q, Buf kp, Buf vp, Buf table, Buf kvl, Buf q_seg,
                                       Buf kv_seg, Buf alibi, auto... rest) {
  return CudaPagedForward(stream, q, kp, vp, table, kvl, ExtraOperands{&q_seg, &kv_seg, &alibi}, rest...);
};
constexpr auto CudaPagedForwardV3 = [](cudaStream_t stream, Buf q, Buf kp, Buf vp, Buf table, Buf kvl, Buf q_seg,
                                      Buf kv_seg, auto... rest) {
  return CudaPagedForward(stream, q, kp, vp, table, kvl, ExtraOperands{&q_seg, &kv_seg}, rest...);
};
constexpr auto CudaPagedForwardV2 = [](cudaStream_t stream, Buf q, Buf kp, Buf vp, Buf table, Buf kvl, auto... rest) {
  return CudaPagedForward(stream, q, kp, vp, table, kvl, ExtraOperands{}, rest...);
};
constexpr auto CudaPagedForwardV1 = [](auto... args) { return CudaPagedForwardV2(args..., 0.f); };
constexpr auto CudaBackwardV1 = [](auto... args) { return CudaBackwardV2(args..., 0.f); };

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaForwardV5, CudaForwardV5,
                              BindForward<5>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaBackwardV5, CudaBackwardV5,
                              BindBackward<5>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaBackwardDb, CudaBackwardDsOut<false>,
                              (BindBackward<5, true>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaBackwardDs, CudaBackwardDsOut<true>,
                              (BindBackward<5, true>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaBiasGradient, CudaBiasGradientHandler<1>,
                              BindBiasGradient(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaBiasGradientV2, CudaBiasGradientHandler<2>,
                              BindBiasGradient(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaForward, CudaForwardV4,
                              BindForward<4>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaForwardV3, CudaForwardV3,
                              BindForward<3>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaBackward, CudaBackwardV4,
                              BindBackward<4>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaBackwardV3, CudaBackwardV3,
                              BindBackward<3>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaForwardV2, CudaForwardV2,
                              BindForward<2>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaPagedForward, CudaPagedForwardV4,
                              BindPagedForward<4>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaPagedForwardV3, CudaPagedForwardV3,
                              BindPagedForward<3>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaPagedForwardV2, CudaPagedForwardV2,
                              BindPagedForward<2>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaBackwardV2, CudaBackwardV2,
                              BindBackward<2>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaForwardV1, CudaForwardV1,
                              BindForward<1>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaPagedForwardV1, CudaPagedForwardV1,
                              BindPagedForward<1>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaSegmentTables, CudaSegmentTables,
                              BindSegmentTables(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCudaBackwardV1, CudaBackwardV1,
                              BindBackward<1>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxflash::handlers
