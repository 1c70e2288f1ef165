// The tiles of DGC's CUDA selection passes (dgc_accumulate_select_ in csrc/cuda/dgc_kernel.cu,
// dgc_int4_select in csrc/cuda/dgc_int4.cu). Both run three launches whatever the number of tensors:
//   1. a mark kernel: per tile of kTileThreads × kTileItems positions, each thread decides for its position
//      of item j whether it is a candidate (the op's own test); mark_word stores the warp's ballot as one
//      32-bit word (words in ascending order are positions in ascending order) and store_tile_count the
//      tile's number of candidates;
//   2. an inclusive cumsum of the tile counts (tile_end; its last entry is the count);
//   3. a compact kernel, one thread per word: compact_start writes the padding past the last candidate
//      and returns the output slot of the thread's first candidate (the tile's start plus the popcount
//      prefix of the words before it), from where the op writes its candidates in order.
// The order of the candidates (ascending) and the layout of the outputs (capacity entries, padding with
// position N, value 0 and run past_run) are the CPU ops' (csrc/cpu/dgc_select.h), written here once.
#pragma once

#include <cstdint>

namespace zen_ext {
namespace dgc_select {

constexpr int kTileThreads = 256;  // mark kernel: threads per tile
constexpr int kTileItems = 8;      // positions per thread
constexpr int64_t kTileSize = int64_t(kTileThreads) * kTileItems;
constexpr int kTileWarps = kTileThreads / 32;
constexpr int kTileWords = int(kTileSize / 32);  // 64: the compact kernel's threads (two warps)

// First index whose end lies past x (ends ascending, ends[n-1] > x).
__device__ __forceinline__ int64_t first_past(const int64_t* __restrict__ ends, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (ends[mid] <= x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Mark kernel, item j: word j·kTileWarps + warp of the tile holds the warp's hits (it covers positions
// tile·kTileSize + 32·(j·kTileWarps + warp) + lane); count adds the thread's hit. Every thread calls it.
__device__ __forceinline__ void mark_word(bool hit, int64_t tile, int j, uint32_t* __restrict__ words, int& count) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned bits = __ballot_sync(0xffffffffu, hit);
  if (lane == 0) words[tile * kTileWords + j * kTileWarps + warp] = bits;
  count += hit ? 1 : 0;
}

// Mark kernel, end: the sum of the threads' counts into tile_count[tile]. Every thread calls it.
__device__ __forceinline__ void store_tile_count(int count, int64_t tile, int64_t* __restrict__ tile_count) {
  __shared__ int warp_count[kTileWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int d = 16; d > 0; d >>= 1) count += __shfl_down_sync(0xffffffffu, count, d);
  if (lane == 0) warp_count[warp] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int w = 0; w < kTileWarps; ++w) total += warp_count[w];
    tile_count[tile] = total;
  }
}

// Compact kernel (blockDim.x == kTileWords, one thread per word of tile blockIdx.x): writes the padding
// past the last candidate (position N, value 0, run past_run) up to capacity, spread over the grid (three
// fills before the pass were three more launches); sets bits to the thread's word and returns the output
// slot of its first candidate. Every thread calls it.
template <typename val_t>
__device__ __forceinline__ int64_t compact_start(const uint32_t* __restrict__ words,
                                                 const int64_t* __restrict__ tile_end,
                                                 const int64_t* __restrict__ tile_count, int64_t N, int64_t past_run,
                                                 int64_t capacity, int64_t* __restrict__ pos, val_t* __restrict__ val,
                                                 int64_t* __restrict__ run, uint32_t& bits) {
  __shared__ int half_total;
  const int64_t tile = blockIdx.x;
  const int w = threadIdx.x;
  for (int64_t q = tile_end[gridDim.x - 1] + tile * kTileWords + w; q < capacity;
       q += int64_t(gridDim.x) * kTileWords) {
    pos[q] = N;
    val[q] = val_t(0);
    run[q] = past_run;
  }
  bits = words[tile * kTileWords + w];
  const int c = __popc(bits);
  int x = c;  // inclusive prefix within the warp
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if ((w & 31) >= d) x += y;
  }
  if (w == 31) half_total = x;
  __syncthreads();
  return tile_end[tile] - tile_count[tile] + (x - c) + (w >= 32 ? half_total : 0);
}

}  // namespace dgc_select
}  // namespace zen_ext
