// CPU FFI handlers: decode, check, run the CPU kernels on XLA's intra-op
// thread pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "decode.h"
#include "handlers.h"

namespace jaxflash::handlers {
namespace {

// Spreads work items over XLA's CPU thread pool. The calling thread works too,
// and waits only for items, not for tasks: a task the pool starts late finds
// no item left and returns, so a busy pool can delay but never deadlock a call.
class PoolRunner final : public ParallelRunner {
 public:
  explicit PoolRunner(ffi::ThreadPool* pool) : pool_(pool) {}

  void For(int64_t n, const std::function<void(int64_t)>& fn, int64_t threads) const override {
    if (n <= 0) return;
    const int64_t helpers = std::min<int64_t>({n, pool_->num_threads(), threads}) - 1;
    if (helpers <= 0) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    auto state = std::make_shared<State>(n, fn);
    for (int64_t t = 0; t < helpers; ++t) pool_->Schedule([state] { state->Drain(); });
    state->Drain();
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done.load() == state->n; });
  }

 private:
  struct State {
    State(int64_t count, const std::function<void(int64_t)>& f) : n(count), fn(f) {}
    void Drain() {
      int64_t finished = 0;
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
        fn(i);
        ++finished;
      }
      if (finished > 0 && done.fetch_add(finished) + finished == n) {
        { std::lock_guard<std::mutex> lock(mu); }
        cv.notify_all();
      }
    }
    const int64_t n;
    // Only called while items remain, i.e. while the handler is still waiting.
    std::function<void(int64_t)> fn;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  ffi::ThreadPool* pool_;
};

ffi::Error CpuForward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
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
  return ToFfiError(CpuAttentionForward(p, PoolRunner(&pool)));
}

ffi::Error CpuPagedForward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
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
  return ToFfiError(CpuAttentionForward(p, PoolRunner(&pool)));
}

ffi::Error CpuBackward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                       ffi::AnyBuffer dlse, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                       ffi::AnyBuffer diag_offsets, ExtraOperands extras, ffi::Result<ffi::AnyBuffer> dq,
                       ffi::Result<ffi::AnyBuffer> dk,
                       ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> delta,
                       ffi::Result<ffi::AnyBuffer> dq_accum, float scale, int64_t window_left,
                       int64_t window_right, bool bottom_right, bool deterministic, int64_t tile, float softcap,
                       ffi::Result<ffi::AnyBuffer>* dbias = nullptr) {
  BwdParams p;
  JAXFLASH_RETURN_IF_ERROR(DecodeBackward({q, k, v, o, lse, dout, dlse, q_lengths, kv_lengths,
                                           diag_offsets, extras},
                                          dq, dk, dv, delta, dq_accum, scale, window_left, window_right,
                                          bottom_right, deterministic, tile, &p));
  JAXFLASH_RETURN_IF_ERROR(DecodeSoftcap(softcap, &p.softcap));
  if (dbias != nullptr) JAXFLASH_RETURN_IF_ERROR(DecodeStagedBiasGradient(*dbias, q, *extras.bias, &p));
  return ToFfiError(CpuAttentionBackward(p, PoolRunner(&pool)));
}

template <int kVersion>
ffi::Error CpuBiasGradientHandler(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
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
  return ToFfiError(CpuBiasGradient(p, PoolRunner(&pool)));
}

// The target versions (decode.h): v5 passes the segment tables, the ALiBi
// slopes and the dense bias and mask, v4 the tables and the slopes, v3 the
// tables only, v2 neither, v1 not the soft-cap attribute either.
using Buf = ffi::AnyBuffer;
constexpr auto CpuForwardV5 = [](ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf ql, Buf kvl, Buf diag, Buf q_seg,
                                 Buf kv_seg, Buf alibi, Buf bias, Buf mask, auto... rest) {
  return CpuForward(pool, q, k, v, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg, &alibi, &bias, &mask}, rest...);
};
constexpr auto CpuBackwardV5 = [](ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout, Buf dlse, Buf ql,
                                  Buf kvl, Buf diag, Buf q_seg, Buf kv_seg, Buf alibi, Buf bias, Buf mask,
                                  auto... rest) {
  return CpuBackward(pool, q, k, v, o, lse, dout, dlse, ql, kvl, diag,
                     ExtraOperands{&q_seg, &kv_seg, &alibi, &bias, &mask}, rest...);
};
// The v5 backward with dB out (BwdParams::ds_out; backward.cc says which biases).
constexpr auto CpuBackwardDb = WithScoreGradResult(
    [](ffi::ThreadPool pool, ffi::Result<Buf>* dbias, auto... rest) { return CpuBackward(pool, rest..., dbias); });
constexpr auto CpuForwardV4 = [](ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf ql, Buf kvl, Buf diag, Buf q_seg,
                                 Buf kv_seg, Buf alibi, auto... rest) {
  return CpuForward(pool, q, k, v, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg, &alibi}, rest...);
};
constexpr auto CpuBackwardV4 = [](ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout, Buf dlse, Buf ql,
                                  Buf kvl, Buf diag, Buf q_seg, Buf kv_seg, Buf alibi, auto... rest) {
  return CpuBackward(pool, q, k, v, o, lse, dout, dlse, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg, &alibi},
                     rest...);
};
constexpr auto CpuForwardV3 = [](ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf ql, Buf kvl, Buf diag, Buf q_seg,
                                 Buf kv_seg, auto... rest) {
  return CpuForward(pool, q, k, v, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg}, rest...);
};
constexpr auto CpuForwardV2 = [](ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf ql, Buf kvl, Buf diag, auto... rest) {
  return CpuForward(pool, q, k, v, ql, kvl, diag, ExtraOperands{}, rest...);
};
constexpr auto CpuBackwardV3 = [](ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout, Buf dlse, Buf ql,
                                  Buf kvl, Buf diag, Buf q_seg, Buf kv_seg, auto... rest) {
  return CpuBackward(pool, q, k, v, o, lse, dout, dlse, ql, kvl, diag, ExtraOperands{&q_seg, &kv_seg}, rest...);
};
constexpr auto CpuBackwardV2 = [](ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout, Buf dlse, Buf ql,
                                  Buf kvl, Buf diag, auto... rest) {
  return CpuBackward(pool, q, k, v, o, lse, dout, dlse, ql, kvl, diag, ExtraOperands{}, rest...);
};
constexpr auto CpuForwardV1 = [](auto... args) { return CpuForwardV2(args..., 0.f); };
// The paged forward: v4 passes the segment tables and the ALiBi slopes after
// kv_lengths, v3 the tables, v2 neither.
constexpr auto CpuPagedForwardV4 = [](ffi::ThreadPool pool, Buf q, Buf kp, Buf vp, Buf table, Buf kvl, Buf q_seg,
                                      Buf kv_seg, Buf alibi, auto... rest) {
  return CpuPagedForward(pool, q, kp, vp, table, kvl, ExtraOperands{&q_seg, &kv_seg, &alibi}, rest...);
};
constexpr auto CpuPagedForwardV3 = [](ffi::ThreadPool pool, Buf q, Buf kp, Buf vp, Buf table, Buf kvl, Buf q_seg,
                                      Buf kv_seg, auto... rest) {
  return CpuPagedForward(pool, q, kp, vp, table, kvl, ExtraOperands{&q_seg, &kv_seg}, rest...);
};
constexpr auto CpuPagedForwardV2 = [](ffi::ThreadPool pool, Buf q, Buf kp, Buf vp, Buf table, Buf kvl, auto... rest) {
  return CpuPagedForward(pool, q, kp, vp, table, kvl, ExtraOperands{}, rest...);
};
constexpr auto CpuPagedForwardV1 = [](auto... args) { return CpuPagedForwardV2(args..., 0.f); };
constexpr auto CpuBackwardV1 = [](auto... args) { return CpuBackwardV2(args..., 0.f); };

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuBiasGradient, CpuBiasGradientHandler<1>,
                              BindBiasGradient(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuBiasGradientV2, CpuBiasGradientHandler<2>,
                              BindBiasGradient(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuForwardV5, CpuForwardV5,
                              BindForward<5>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuBackwardV5, CpuBackwardV5,
                              BindBackward<5>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuBackwardDb, CpuBackwardDb,
                              (BindBackward<5, true>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuForward, CpuForwardV4,
                              BindForward<4>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuForwardV3, CpuForwardV3,
                              BindForward<3>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuBackward, CpuBackwardV4,
                              BindBackward<4>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuBackwardV3, CpuBackwardV3,
                              BindBackward<3>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuForwardV2, CpuForwardV2,
                              BindForward<2>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuPagedForward, CpuPagedForwardV4,
                              BindPagedForward<4>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuPagedForwardV3, CpuPagedForwardV3,
                              BindPagedForward<3>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuPagedForwardV2, CpuPagedForwardV2,
                              BindPagedForward<2>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuBackwardV2, CpuBackwardV2,
                              BindBackward<2>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuForwardV1, CpuForwardV1,
                              BindForward<1>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuPagedForwardV1, CpuPagedForwardV1,
                              BindPagedForward<1>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCpuBackwardV1, CpuBackwardV1,
                              BindBackward<1>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace jaxflash::handlers
