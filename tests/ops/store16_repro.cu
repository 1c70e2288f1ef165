// Reproducer of the miscompiled 2-byte store behind issue 20 (docs/gpu.md): a Half/BFloat16 converted
// from fp32 and written into a byte buffer with memcpy (variant 0) or a byte loop (variant 2) gets the
// saturated uint8 of the value as its low byte with nvcc 13.0 for sm_90 (SASS: F2I.U8.F16.TRUNC feeding
// the low STG.E.U8); one aligned 16-bit store (variant 1, what csrc/cuda/pull_kernel.cu does) is exact.
// Build and run on a GPU machine: nvcc -O3 -arch=sm_90 -o /tmp/store16 tests/ops/store16_repro.cu && /tmp/store16
// Recorded on an H200 (2026-11-26): variant 0 fp16 128/300 differ, bf16 214/300; variant 1: 0; variant 2 as 0.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <cstring>

struct H { uint16_t x; };  // like c10::Half
template <typename T> __device__ __forceinline__ void store(uint8_t* p, T v) { memcpy(p, &v, sizeof(T)); }

template <int V, bool BF>
__global__ void k(const float* acc, int n, uint8_t* out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = acc[i];
  H h;
  h.x = BF ? __bfloat16_as_ushort(__float2bfloat16(v)) : __half_as_ushort(__float2half(v));
  if (V == 0) store<H>(out + 2 * i, h);                                   // old: memcpy of the struct
  if (V == 1) *reinterpret_cast<uint16_t*>(out + 2 * i) = h.x;            // new: aligned u16
  if (V == 2) for (int b = 0; b < 2; ++b) out[2 * i + b] = reinterpret_cast<uint8_t*>(&h)[b];  // byte loop
}

template <int V, bool BF>
int run(const float* d_acc, int n, const uint16_t* want) {
  uint8_t* d_out; cudaMalloc(&d_out, 2 * n); cudaMemset(d_out, 0xAB, 2 * n);
  k<V, BF><<<(n + 255) / 256, 256>>>(d_acc, n, d_out);
  uint16_t* got = new uint16_t[n];
  cudaMemcpy(got, d_out, 2 * n, cudaMemcpyDeviceToHost);
  int bad = 0, first = -1;
  for (int i = 0; i < n; ++i) if (got[i] != want[i]) { ++bad; if (first < 0) first = i; }
  printf("variant %d %s: %d of %d differ", V, BF ? "bf16" : "fp16", bad, n);
  if (first >= 0) printf(" (first: value %d got 0x%04x want 0x%04x)", first, got[first], want[first]);
  printf("\n");
  cudaFree(d_out); delete[] got;
  return bad;
}

int main() {
  const int n = 300;
  float acc[n]; uint16_t wh[n], wb[n];
  for (int i = 0; i < n; ++i) { acc[i] = float(i % 7 - 3); __half hh = __float2half(acc[i]); wh[i] = *reinterpret_cast<uint16_t*>(&hh); uint32_t u; memcpy(&u, &acc[i], 4); wb[i] = uint16_t(u >> 16); }
  float* d; cudaMalloc(&d, 4 * n); cudaMemcpy(d, acc, 4 * n, cudaMemcpyHostToDevice);
  run<0, false>(d, n, wh); run<1, false>(d, n, wh); run<2, false>(d, n, wh);
  run<0, true>(d, n, wb); run<1, true>(d, n, wb); run<2, true>(d, n, wb);
  return 0;
}
