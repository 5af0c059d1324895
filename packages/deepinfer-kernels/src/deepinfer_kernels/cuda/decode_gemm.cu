// Swap-AB FP8 decode GEMM on wgmma (sm_90a) for V4.1's block-scaled format, M <= 64 tokens:
// out[M, N] = sum_k (x[m, k] * sx[m, k / 32]) * (w[n, k] * sw[n / 32, k / 32]), x [M, K] and
// w [N, K] e4m3, sx fp32 powers of two, sw UE8M0 bytes (or fp32 with SB_F32), fp32 sums; out
// bf16 (or fp32 with OUT_F32).
//
// At decode sizes the GEMM streams the weight, so the weight is the wgmma's A operand: a CTA
// owns ROWS weight rows (CONSUMERS warpgroups of 64) and one K chunk; its TOKENS (8..64) token
// rows are the B operand (zero past M, from the TMA). One producer thread feeds a ring of STAGES
// 128-deep K stages (weight box, token box, the tokens' 4 scales per stage); per k32 slice each
// consumer warpgroup runs one `wgmma.m64nTOKENSk32` into a fresh partial and promotes it:
// acc += part * (sw * sx), one FFMA per accumulator and slice (the TileLang decode kernel's
// arithmetic, tilelang/decode_gemm.py).
//
// K is cut into SPLIT chunks (the TileLang kernel's split, from (N, K) only), one CTA each, the
// SPLIT CTAs of a weight tile one cluster: each leaves its chunk's sums in its shared memory,
// and the cluster adds them in chunk order through distributed shared memory (chunk 0 + chunk 1
// + ...: the TileLang kernel's order), each CTA for its share of the tile's columns, and writes
// the output: one kernel, no fp32 partials in global memory. Nothing depends on M but the token
// tile's width, and a wgmma column does not depend on the wgmma's N: batch-invariant.
//
// With SHARE > 1 the SHARE weight tiles of a cluster's second dimension share each stage's token
// tile: each CTA loads TOKENS / SHARE of its rows and the TMA multicasts them to all SHARE CTAs
// (the same K chunk), so the SMs take in the token bytes once per SHARE weight tiles; a stage is
// refilled only when the consumers of all SHARE CTAs have released it (each consumer warp
// arrives on every sharer's empty barrier).
//
// A programmatic dependent launch (decode_gemm.py) overlaps the prologue and the first STAGES
// weight boxes (which the kernel before does not write) with that kernel's end; the tokens are
// read after `griddepcontrol.wait`. Compile-time constants: CONSUMERS (1, 2), TOKENS (8, 16, 32,
// 64), STAGES, SPLIT (1, 2, 4, 8), SHARE (1, 2, 4; SPLIT x SHARE <= 8), MIN_BLOCKS (CTAs per SM
// the registers are cut for), CONSUMER_REGS (setmaxnreg), SB_F32, OUT_F32.

#include "common.cuh"
#include "wgmma_fp8.cuh"

#define BLOCK_K 128  // bytes per row and stage: one 128-byte swizzle row
#define SLICES 4     // k32 slices per stage, each with its own scales
#define ROWS (64 * CONSUMERS)
#define THREADS (128 * (CONSUMERS + 1))
#define TB (TOKENS / 8)  // n8 column groups of a wgmma's accumulators
#define RB (ROWS / 32)   // 32-row blocks of sw per CTA
#define W_BYTES (ROWS * BLOCK_K)
#define X_BYTES (TOKENS * BLOCK_K < 1024 ? 1024 : TOKENS * BLOCK_K)  // 1024-aligned stage parts
#define SX_BYTES 1024  // TOKENS x 4 floats, padded
#define STAGE_BYTES (W_BYTES + X_BYTES + SX_BYTES)
#define STAGE_TX (W_BYTES + TOKENS * BLOCK_K + TOKENS * 16)  // bytes the three boxes bring
#define PART_STRIDE (ROWS + 4)  // floats per token of the chunk's sums (conflict-free stores)
#define PRODUCER_REGS (SHARE > 1 ? 40 : 24)  // the multicast's mask and offsets need more

static_assert(CONSUMERS == 1 || CONSUMERS == 2, "CONSUMERS: 1 or 2");
static_assert(TOKENS == 8 || TOKENS == 16 || TOKENS == 32 || TOKENS == 64, "TOKENS: 8..64");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4 || SPLIT == 8, "SPLIT: 1, 2, 4 or 8");
static_assert(STAGES >= 2 && STAGES <= 12, "STAGES: 2..12");
static_assert(TOKENS * PART_STRIDE * 4 <= STAGES * STAGE_BYTES, "the sums fit in the ring");
static_assert(ROWS % SPLIT == 0, "every CTA of a cluster writes whole columns");
static_assert((SHARE == 1 || SHARE == 2 || SHARE == 4) && SPLIT * SHARE <= 8, "SHARE: 1, 2, 4");

static __device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" :::
                   "memory");
}

#if SHARE > 1
// The box of `map` at (x bytes, y rows) -> shared address dst of every cluster CTA in `mask`,
// counted on each one's barrier at bar's offset.
static __device__ __forceinline__ void tma_box_multicast(u32 dst, const TensorMap* map, int x,
                                                         int y, u64* bar, u16 mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(smem_u32(bar)), "h"(mask)
      : "memory");
}

// One arrival on the barrier at bar's offset in cluster CTA `rank` (the warp's wgmmas have
// finished reading the stage: wait_group 0 came first).
static __device__ __forceinline__ void mbar_arrive_cluster(u64* bar, int rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(smem_u32(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
#endif

// The float at shared address p of cluster CTA `rank`.
static __device__ __forceinline__ float lds_cluster(u32 p, int rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(p), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// Dynamic shared memory: [STAGES][w ROWS x 128 | x TOKENS x 128 (>= 1 KiB) | sx TOKENS x 4
// floats (1 KiB)], then the sw table [chunk's K / 32][RB] floats; the chunk's sums [TOKENS]
// [PART_STRIDE] floats reuse the ring once it is drained. 1 KiB of slack aligns the ring.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) __cluster_dims__(SPLIT, SHARE, 1)
    decode_gemm(const __grid_constant__ TensorMap w_map, const __grid_constant__ TensorMap x_map,
                const __grid_constant__ TensorMap sx_map, const void* __restrict__ sw_ptr,
                void* __restrict__ out, int m_rows, int n_cols, int k_len) {
  extern __shared__ u8 smem_raw[];
  __shared__ __align__(8) u64 full[STAGES];
  __shared__ __align__(8) u64 empty[STAGES];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 sw_table = base + STAGES * STAGE_BYTES;
  // cluster dims (SPLIT, SHARE): x the K chunk, y the sharer (cluster CTA rank: x + SPLIT y)
  const int rank = blockIdx.x % SPLIT;  // the K chunk
  const int sharer = blockIdx.y % SHARE;
  const int n0 = (blockIdx.x / SPLIT * SHARE + sharer) * ROWS;
  const int t0 = blockIdx.y / SHARE * TOKENS;
  const int steps = k_len / BLOCK_K / SPLIT;  // stages of the chunk
  const int k_groups = k_len / 32;
  const int g0 = rank * steps * SLICES;  // the chunk's first k32 group

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s]);
      mbar_init(&empty[s], CONSUMERS * 4 * SHARE);  // lane 0 of every sharer's consumer warps
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // the chunk's sw for the tile's rows, as floats (rows past N: 0)
  for (int i = threadIdx.x; i < steps * SLICES * RB; i += THREADS) {
    const int q = i / RB, row = n0 / 32 + i % RB;
    float v = 0.f;
    if (row < (n_cols + 31) / 32) {
#if SB_F32
      v = static_cast<const float*>(sw_ptr)[(u64)row * k_groups + g0 + q];
#else
      v = e8m0(static_cast<const u8*>(sw_ptr)[(u64)row * k_groups + g0 + q]);
#endif
    }
    sts32(sw_table + i * 4, v);
  }
#if SHARE > 1
  cluster_sync();  // and every sharer's barriers are initialised before a token box lands
#else
  __syncthreads();
#endif

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
    if (threadIdx.x == 0) {
      const int k0 = rank * steps * BLOCK_K;
      const int first = steps < STAGES ? steps : STAGES;
      // the weight boxes of the first stages before the wait: the kernel before does not
      // write the weights
      for (int s = 0; s < first; ++s) {
        mbar_expect(&full[s], STAGE_TX);
        tma_box(base + s * STAGE_BYTES, &w_map, k0 + s * BLOCK_K, n0, &full[s]);
      }
      asm volatile("griddepcontrol.wait;" ::: "memory");
      for (int kt = 0; kt < steps; ++kt) {
        const int s = kt % STAGES;
        const u32 stage = base + s * STAGE_BYTES;
        if (kt >= first) {
          mbar_wait(&empty[s], (kt / STAGES - 1) & 1);
          mbar_expect(&full[s], STAGE_TX);
          tma_box(stage, &w_map, k0 + kt * BLOCK_K, n0, &full[s]);
        }
#if SHARE > 1
        constexpr int kRows = TOKENS / SHARE;  // this CTA's slice of the token tile
        // cluster ranks rank + SPLIT i: the CTAs of this K chunk
        constexpr u32 kSharers =
            SHARE == 2 ? 1u | 1u << SPLIT : 1u | 1u << SPLIT | 1u << 2 * SPLIT | 1u << 3 * SPLIT;
        tma_box_multicast(stage + W_BYTES + sharer * kRows * BLOCK_K, &x_map, k0 + kt * BLOCK_K,
                          t0 + sharer * kRows, &full[s], (u16)(kSharers << rank));
#else
        tma_box(stage + W_BYTES, &x_map, k0 + kt * BLOCK_K, t0, &full[s]);
#endif
        tma_box(stage + W_BYTES + X_BYTES, &sx_map, (k0 / BLOCK_K + kt) * 16, t0, &full[s]);
      }
      // every load is issued: the next kernel may start its prologue (it waits for this grid's
      // end before it reads what this one writes)
      asm volatile("griddepcontrol.launch_dependents;");
    }
    // the producer warpgroup stays for the cluster barriers (they count every thread)
    cluster_sync();
    cluster_sync();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
  const int c = wg - 1;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int row = 64 * c + 16 * warp + (lane >> 2);  // and row + 8: the same 32-row block
  const int rb = row / 32;
  const int tok = 2 * (lane & 3);  // tokens 8 j + tok + {0, 1}

  float acc[TB][4], part[TB][4];
#pragma unroll
  for (int j = 0; j < TB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

  for (int kt = 0; kt < steps; ++kt) {
    const int s = kt % STAGES;
    const u32 stage = base + s * STAGE_BYTES;
    mbar_wait(&full[s], (kt / STAGES) & 1);
    const u64 dw = desc_sw128(stage + c * 64 * BLOCK_K);
    const u64 dx = desc_sw128(stage + W_BYTES);
    const u32 sx = stage + W_BYTES + X_BYTES;
#pragma unroll
    for (int q = 0; q < SLICES; ++q) {
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
      wgmma_e4m3<TOKENS>(part, dw + 2 * q, dx + 2 * q);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      // the slice's scales while the wgmma runs: sw of the row block times each token's sx
      const float sw = lds32(sw_table + ((kt * SLICES + q) * RB + rb) * 4);
      float p[TB][2];
#pragma unroll
      for (int j = 0; j < TB; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) p[j][e] = sw * lds32(sx + ((8 * j + tok + e) * 4 + q) * 4);
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#if SHARE > 1
      if (q == SLICES - 1 && lane == 0)  // the stage is read: every sharer may refill it
        for (int i = 0; i < SHARE; ++i) mbar_arrive_cluster(&empty[s], rank + SPLIT * i);
#else
      if (q == SLICES - 1 && lane == 0) mbar_arrive(&empty[s]);  // the stage is read
#endif
#pragma unroll
      for (int j = 0; j < TB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = fmaf(part[j][e], p[j][e & 1], acc[j][e]);
    }
  }

  // the chunk's sums into the drained ring (both consumer warpgroups are past their last wgmma)
  asm volatile("bar.sync 1, %0;" ::"n"(128 * CONSUMERS) : "memory");
#pragma unroll
  for (int j = 0; j < TB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      sts32(base + ((8 * j + tok + (e & 1)) * PART_STRIDE + row + 8 * (e >> 1)) * 4, acc[j][e]);
  cluster_sync();

  // this CTA's share of the tile's columns: the chunks' sums in chunk order, then the output
  // (after the kernel before has ended: it may still read memory this one writes)
  asm volatile("griddepcontrol.wait;" ::: "memory");
  constexpr int kCols = ROWS / SPLIT;
  const int col0 = rank * kCols;
  const int t_valid = min(TOKENS, m_rows - t0);
  for (int i = threadIdx.x - 128; i < t_valid * kCols; i += 128 * CONSUMERS) {
    const int t = i / kCols, col = col0 + i % kCols, n = n0 + col;
    if (n >= n_cols) continue;
    const u32 at = base + (t * PART_STRIDE + col) * 4;
    const int chunk0 = SPLIT * sharer;  // the cluster rank of this tile's first chunk
    float v = SPLIT == 1 ? lds32(at) : lds_cluster(at, chunk0);
#pragma unroll
    for (int r = 1; r < SPLIT; ++r) v += lds_cluster(at, chunk0 + r);
    const u64 o = (u64)(t0 + t) * n_cols + n;
#if OUT_F32
    static_cast<float*>(out)[o] = v;
#else
    static_cast<u16*>(out)[o] = bf16_bits(v);
#endif
  }
  cluster_sync();  // the other CTAs have read this one's sums
}
