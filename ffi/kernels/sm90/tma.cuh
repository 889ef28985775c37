// The tensor-memory accelerator (TMA) from the device side: bulk tensor copies
// between global memory and shared memory, described by a tensor map the host
// encoded (tensor_map.h) and passed as a __grid_constant__ kernel parameter.
//
// A load completes on an mbarrier (the bytes count towards its phase, see
// barrier.cuh); a store or a bulk reduction is tracked in bulk groups of the
// issuing thread.
// Coordinates are element indices, innermost dimension first; a box that
// reaches past the tensor's extent is zero-filled on load and clipped on store.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace jaxflash {
namespace sm90 {

__device__ __forceinline__ uint64_t MapAddress(const CUtensorMap& map) { return reinterpret_cast<uint64_t>(&map); }

// Fetches the map into the TMA unit's cache ahead of the first copy.
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(MapAddress(map)) : "memory");
}

__device__ __forceinline__ void TmaLoad4d(uint32_t smem, const CUtensorMap& map, uint32_t bar, int c0, int c1,
                                          int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem),
      "l"(MapAddress(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void TmaStore4d(const CUtensorMap& map, uint32_t smem, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   MapAddress(map)),
               "r"(smem), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
// Adds a box of float32 values at `smem` element-wise into the tensor (a
// bulk reduction done by the copy engine, atomic per element, clipped at the
// tensor's extent, tracked in the issuing thread's bulk groups like a store).
__device__ __forceinline__ void TmaReduceAdd4d(const CUtensorMap& map, uint32_t smem, int c0, int c1, int c2,
                                               int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          MapAddress(map)),
      "r"(smem), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void TmaStoreCommit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until the shared memory of all but the newest kPending store groups has
// been read (so it may be overwritten)...
template <int kPending>
__device__ __forceinline__ void TmaStoreWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// ... or until those stores are complete in global memory.
template <int kPending>
__device__ __forceinline__ void TmaStoreWait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace sm90
}  // namespace jaxflash
