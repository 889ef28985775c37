// How fast one decode CTA can stream K/V into shared memory, by copy mechanism.
//
// The decode kernel's access pattern with nothing computed: a K/V cache
// [B, S, H, D] (bf16, D 128) read by one CTA per (batch, head, split) in
// 64-key tiles, K then V, into a ring of shared-memory stages; the CTA meets
// once per tile, as the kernel does. Splits are emulated by viewing the cache
// as [B * splits, S / splits, H, D] (same bytes, same strides in a CTA). The
// copies compared: 16-byte cp.async by every thread into padded rows, TMA
// tensor boxes (64 or 16 keys x 256 bytes) waited on through an mbarrier, and
// one 256-byte bulk copy per row; a grid-stride ld.global read gives the
// card's plain read rate. Prints µs and TB/s of K+V bytes (median of 20).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o kv_stream benchmarks/kv_stream.cu && ./kv_stream
//
// Results and what they decided: docs/performance-log.md, fifteenth session.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e = (x);                                                               \
    if (e != cudaSuccess) {                                                            \
      std::printf("CUDA error %s at line %d\n", cudaGetErrorString(e), __LINE__);      \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

constexpr int kD = 128, kN = 64, kPadded = kD + 8;  // keys per tile; padded row (elements)

struct Shape {
  int B, S, H;
};

__device__ __forceinline__ uint32_t Smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Touches one element of each landed tile so the copies are consumed.
__device__ __forceinline__ float Touch(const uint16_t* k, const uint16_t* v, int row_elems, int tid) {
  return float(k[(tid % kN) * row_elems + tid % kD]) + float(v[(tid % kN) * row_elems + tid % kD]);
}

template <int kStages>
__global__ void __launch_bounds__(128, 1) CpAsyncStream(const uint16_t* k, const uint16_t* v, Shape sh, float* out) {
  extern __shared__ __align__(16) uint16_t sm[];
  const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, tiles = sh.S / kN;
  const int64_t rs = int64_t(sh.H) * kD;
  const uint16_t* gk = k + (int64_t(b) * sh.S * sh.H + h) * kD;
  const uint16_t* gv = v + (int64_t(b) * sh.S * sh.H + h) * kD;
  constexpr int kRows = kN * 16 / 128;  // 16 chunks a row: 8 consecutive rows per thread
  const int col = (tid % 16) * 8, row0 = tid / 16 * kRows;
  auto load = [&](int t, int st) {
    uint16_t* sk = sm + st * 2 * kN * kPadded + row0 * kPadded + col;
    const int64_t off = int64_t(t * kN + row0) * rs + col;
    for (int i = 0; i < kRows; ++i) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(Smem(sk + i * kPadded)), "l"(gk + off + i * rs));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(Smem(sk + (kN + i) * kPadded)),
                   "l"(gv + off + i * rs));
    }
  };
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load(s, s);
    asm volatile("cp.async.commit_group;\n");
  }
  float acc = 0;
  for (int t = 0; t < tiles; ++t) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    __syncthreads();
    if (t + kStages - 1 < tiles) load(t + kStages - 1, (t + kStages - 1) % kStages);
    asm volatile("cp.async.commit_group;\n");
    const uint16_t* st = sm + (t % kStages) * 2 * kN * kPadded;
    acc += Touch(st, st + kN * kPadded, kPadded, tid);
  }
  if (acc == 12345.f) out[0] = acc;  // never true; keeps the reads
}

__device__ __forceinline__ void ArriveExpect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void WaitPhase(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra wait;\n}\n" ::"r"(
          bar),
      "r"(parity)
      : "memory");
}

enum class Copy { kBulkRows, kTmaTile, kTma16Rows };

// kBulkRows: warp 0 issues a 256-byte bulk copy per row into padded rows;
// kTmaTile: thread 0 issues one 64-key box of K and one of V; kTma16Rows:
// lanes 0..7 each issue a 16-key box.
template <int kStages, Copy kCopy, int kCtasPerSm>
__global__ void __launch_bounds__(128, kCtasPerSm)
    AsyncStream(const uint16_t* k, const uint16_t* v, Shape sh, float* out, const __grid_constant__ CUtensorMap mk,
                const __grid_constant__ CUtensorMap mv) {
  extern __shared__ __align__(128) uint16_t tiles_smem[];  // TMA boxes land 128-byte aligned
  uint16_t* sm = tiles_smem;
  constexpr int kRow = kCopy == Copy::kBulkRows ? kPadded : kD;
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + kStages * 2 * kN * kRow);
  const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, tiles = sh.S / kN;
  const int64_t rs = int64_t(sh.H) * kD;
  const uint16_t* gk = k + (int64_t(b) * sh.S * sh.H + h) * kD;
  const uint16_t* gv = v + (int64_t(b) * sh.S * sh.H + h) * kD;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(Smem(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n");
  }
  __syncthreads();
  auto box = [&](uint32_t dst, const CUtensorMap& map, uint32_t bar, int key) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
        "%6}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(&map)), "r"(bar), "r"(0), "r"(h), "r"(key), "r"(b)
        : "memory");
  };
  auto load = [&](int t, int st) {
    const uint32_t bar = Smem(&full[st]);
    uint16_t* sk = sm + st * 2 * kN * kRow;
    uint16_t* sv = sk + kN * kRow;
    if (tid >= 32) return;
    if (tid == 0) ArriveExpect(bar, 2 * kN * kD * 2);
    __syncwarp();
    if (kCopy == Copy::kBulkRows) {
      for (int r = tid; r < kN; r += 32) {
        const int64_t off = int64_t(t * kN + r) * rs;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                         Smem(sk + r * kRow)),
                     "l"(gk + off), "r"(kD * 2), "r"(bar)
                     : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                         Smem(sv + r * kRow)),
                     "l"(gv + off), "r"(kD * 2), "r"(bar)
                     : "memory");
      }
    } else if (kCopy == Copy::kTmaTile) {
      if (tid == 0) {
        box(Smem(sk), mk, bar, t * kN);
        box(Smem(sv), mv, bar, t * kN);
      }
    } else if (tid < 8) {
      box(Smem((tid < 4 ? sk : sv) + (tid % 4) * 16 * kD), tid < 4 ? mk : mv, bar, t * kN + (tid % 4) * 16);
    }
  };
  for (int s = 0; s < kStages - 1; ++s)
    if (s < tiles) load(s, s);
  float acc = 0;
  for (int t = 0; t < tiles; ++t) {
    WaitPhase(Smem(&full[t % kStages]), (t / kStages) & 1);
    __syncthreads();  // everyone is done with the stage about to be refilled
    if (t + kStages - 1 < tiles) load(t + kStages - 1, (t + kStages - 1) % kStages);
    const uint16_t* st = sm + (t % kStages) * 2 * kN * kRow;
    acc += Touch(st, st + kN * kRow, kRow, tid);
  }
  if (acc == 12345.f) out[0] = acc;
}

__global__ void PlainRead(const uint4* p, int64_t n, float* out) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint4 x;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "l"(p + i));
    acc ^= x.x ^ x.y ^ x.z ^ x.w;
  }
  if (acc == 0x12345) out[0] = acc;
}

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                              const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// Boxes of `rows` keys x D columns of one (batch, head) of a [B, S, H, D] cache.
CUtensorMap Map(EncodeFn encode, void* base, Shape sh, int rows) {
  CUtensorMap map;
  const cuuint64_t dims[4] = {kD, cuuint64_t(sh.H), cuuint64_t(sh.S), cuuint64_t(sh.B)};
  const cuuint64_t strides[3] = {kD * 2, cuuint64_t(sh.H) * kD * 2, cuuint64_t(sh.S) * sh.H * kD * 2};
  const cuuint32_t box[4] = {kD, 1, cuuint32_t(rows), 1}, unit[4] = {1, 1, 1, 1};
  if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, base, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)) {
    std::printf("cuTensorMapEncodeTiled failed\n");
    std::exit(1);
  }
  return map;
}

template <typename F>
float MedianMs(F launch, int reps = 20) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  launch();
  launch();
  CHECK(cudaDeviceSynchronize());
  std::vector<float> ms(reps);
  for (float& m : ms) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaEventElapsedTime(&m, a, b));
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

int main() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  const EncodeFn encode = reinterpret_cast<EncodeFn>(fn);
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* out;
  CHECK(cudaMalloc(&out, sizeof(float)));
  // The three q_len 1 decode shapes of bench_decode.py (batch, kv_len, K/V heads).
  for (Shape sh : {Shape{64, 4096, 8}, Shape{8, 32768, 4}, Shape{1, 131072, 8}}) {
    const int64_t elems = int64_t(sh.B) * sh.S * sh.H * kD;
    const double bytes = 2.0 * elems * 2;
    uint16_t *k, *v;
    CHECK(cudaMalloc(&k, elems * 2));
    CHECK(cudaMalloc(&v, elems * 2));
    CHECK(cudaMemset(k, 0, elems * 2));
    CHECK(cudaMemset(v, 0, elems * 2));
    // As many splits as fill two CTAs per SM, when the (batch, head) pairs do not.
    const int splits = sh.B * sh.H >= sms * 3 / 2 ? 1 : 2 * sms / (sh.B * sh.H);
    const Shape cta{sh.B * splits, sh.S / splits, sh.H};
    const CUtensorMap mk = Map(encode, k, cta, kN), mv = Map(encode, v, cta, kN);
    const CUtensorMap mk16 = Map(encode, k, cta, 16), mv16 = Map(encode, v, cta, 16);
    const dim3 grid(1, cta.H, cta.B);
    std::printf("B %d, kv %d, %d heads: %d CTAs, %.0f MB of K+V\n", sh.B, sh.S, sh.H, cta.B * cta.H, bytes / 1e6);
    auto report = [&](const char* name, float ms) {
      std::printf("  %-36s %8.1f us  %5.2f TB/s\n", name, ms * 1e3, bytes / ms / 1e9);
    };
    report("ld.global grid-stride", MedianMs([&] {
             PlainRead<<<sms * 8, 512>>>(reinterpret_cast<const uint4*>(k), elems * 2 / 16, out);
             PlainRead<<<sms * 8, 512>>>(reinterpret_cast<const uint4*>(v), elems * 2 / 16, out);
           }));
    auto cp_async = [&](auto kernel, int stages, const char* name) {
      const size_t smem = size_t(stages) * 2 * kN * kPadded * 2;
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      report(name, MedianMs([&] { kernel<<<grid, 128, smem>>>(k, v, cta, out); }));
    };
    cp_async(CpAsyncStream<2>, 2, "cp.async, 2 stages");
    cp_async(CpAsyncStream<3>, 3, "cp.async, 3 stages");
    cp_async(CpAsyncStream<4>, 4, "cp.async, 4 stages");
    cp_async(CpAsyncStream<6>, 6, "cp.async, 6 stages");
    auto async = [&](auto kernel, int stages, bool padded, bool rows16, const char* name) {
      const size_t smem = size_t(stages) * 2 * kN * (padded ? kPadded : kD) * 2 + 8 * stages;
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      report(name, MedianMs([&] {
               kernel<<<grid, 128, smem>>>(k, v, cta, out, rows16 ? mk16 : mk, rows16 ? mv16 : mv);
             }));
    };
    async(AsyncStream<2, Copy::kTmaTile, 2>, 2, false, false, "TMA 64-key boxes, 2 stages");
    async(AsyncStream<3, Copy::kTmaTile, 2>, 3, false, false, "TMA 64-key boxes, 3 stages");
    async(AsyncStream<6, Copy::kTmaTile, 1>, 6, false, false, "TMA 64-key boxes, 6 stages, 1 CTA/SM");
    async(AsyncStream<3, Copy::kTma16Rows, 2>, 3, false, true, "TMA 16-key boxes, 3 stages");
    async(AsyncStream<3, Copy::kBulkRows, 2>, 3, true, false, "bulk copy per row, 3 stages");
    CHECK(cudaFree(k));
    CHECK(cudaFree(v));
  }
  return 0;
}
