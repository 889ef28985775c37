// Synchronisation between the warpgroups of a warp-specialised Hopper kernel:
// shared-memory mbarriers (a producer's copies land -> consumers may read; the
// consumers are done -> the producer may overwrite), the ring position that
// walks a set of them, and named barriers (a subset of the CTA's warps).
//
// An mbarrier completes a phase when its expected arrivals have arrived and,
// for copies issued by the tensor-memory accelerator (TMA), the expected bytes
// have landed. Waiting names the parity of the phase to wait for; a freshly
// initialised barrier is in phase 0, so waiting for parity 1 returns at once:
// that is how a producer's first pass through an empty ring does not block.
#pragma once

#include <cstdint>

namespace jaxflash {
namespace sm90 {

struct MBarrier {
  __device__ __forceinline__ static void Init(uint32_t bar, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
  }
  // Makes the initialisations visible to the async proxy (TMA) and the other
  // threads; follow with a CTA barrier.
  __device__ __forceinline__ static void FenceInit() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __device__ __forceinline__ static void Arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
  }
  // One arrival, plus `bytes` the phase must also wait for (TMA completes them).
  __device__ __forceinline__ static void ArriveExpectBytes(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
  }
  __device__ __forceinline__ static void Wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nwait_again:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_again;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
  }
};

// Position in a ring of kStages buffers, each guarded by a "full" and an
// "empty" barrier: the stage to use next and the parity its barriers are in
// this time round. Producer and consumers each keep one and advance it once
// per buffer, in the same order, so they agree without talking.
template <int kStages>
struct RingPosition {
  int stage = 0;
  uint32_t parity = 0;
  __device__ __forceinline__ void Advance() {
    if (++stage == kStages) {
      stage = 0;
      parity ^= 1;
    }
  }
  // The position one step back, computed rather than kept in registers.
  __device__ __forceinline__ RingPosition Previous() const {
    RingPosition p;
    p.stage = stage == 0 ? kStages - 1 : stage - 1;
    p.parity = stage == 0 ? parity ^ 1 : parity;
    return p;
  }
};

// Named hardware barriers 1..15 (0 is __syncthreads): `threads` of the CTA's
// threads, in whole warps, meet at barrier `id`. Sync waits; Arrive counts
// towards the barrier without waiting.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Register budget moves between warpgroups (sm_90a): the producer gives up
// registers it does not need, the consumers take them for accumulators. The
// moves stay within what the CTA got at launch, its threads times the count
// per thread its launch bound allows (65536 / threads, down to a multiple of
// 8): a claim beyond what was given up waits forever. So the consumers' count
// follows from the producer's: the rest of the budget, shared out in
// multiples of 8.
constexpr int ConsumerRegisters(int warpgroups, int producer_regs) {
  return (warpgroups * (65536 / (128 * warpgroups) / 8 * 8) - producer_regs) / (warpgroups - 1) / 8 * 8;
}
template <int kRegs>
__device__ __forceinline__ void ReleaseRegisters() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void ClaimRegisters() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// The roles of a warp-specialised CTA: warpgroup 0 hands registers over and
// runs producer(warp index, 0..3); the others claim them and run
// consumer(consumer index, 0..). Work a role derives after the hand-over is
// not live across the producer's smaller budget.
template <int kProducerRegs, int kConsumerRegs, typename Producer, typename Consumer>
__device__ __forceinline__ void RunRoles(Producer&& producer, Consumer&& consumer) {
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    ReleaseRegisters<kProducerRegs>();
    producer(static_cast<int>(threadIdx.x / 32));
  } else {
    ClaimRegisters<kConsumerRegs>();
    consumer(warpgroup - 1);
  }
}

}  // namespace sm90
}  // namespace jaxflash
