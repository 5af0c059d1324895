// Swap-AB FP8 decode GEMM on wgmma (sm_90a) for V4.1's block-scaled format, decode sizes (any M
// in token tiles of up to 64; `ops/linear.py` sends it at most `CUDA_DECODE_MAX_M` tokens):
// out[M, N] = sum_k (x[m, k] * sx[m, k / 32]) * (w[n, k] * sw[n / 32, k / 32]), x [M, K] and
// w [N, K] e4m3, sx fp32 powers of two, sw UE8M0 bytes (or fp32 with SB_F32), fp32 sums; out
// bf16 (or fp32 with OUT_F32).
//
// At decode sizes the GEMM streams the weight, so the weight is the wgmma's A operand: a CTA
// owns ROWS weight rows (CONSUMERS warpgroups of 64) and one K chunk; its TOKENS (8..64) token
// rows are the B operand (rows past M feed only sums that are not stored). One producer thread
// feeds a ring of STAGES 128-deep K stages (weight box, token box, the tokens' 4 scales per
// stage); per k32 slice each consumer warpgroup runs one `wgmma.m64nTOKENSk32` into a fresh
// partial and promotes it:
// acc += part * (sw * sx), one FFMA per accumulator and slice. With PIPELINED (where a second partial fits the
// registers) the next slice's wgmma of the stage is issued before a slice is promoted, so the
// promotion's FFMAs, which grow with TOKENS, overlap the tensor core instead of following it.
//
// With TOKENS_AS_A (64-token tiles) the operands trade places: the token tile is A and each
// warpgroup's 64 weight rows are B (`wgmma.m64n64k32`, the same dot products: both are K-major
// 128-byte-swizzled boxes). A thread's 32 sums are then 2 tokens x 16 rows of 2 row blocks, so
// a slice needs 4 scale products instead of 16, and a stage's scales come in 4 vector loads
// instead of 68 scalar ones: the loop's issue, the bound at 64 tokens, shrinks by a third.
//
// K is cut into SPLIT chunks (`decode_gemm.k_split`, from (N, K) only), one CTA each, the
// SPLIT CTAs of a weight tile one cluster: each leaves its chunk's sums in its shared memory,
// and the cluster adds them in chunk order through distributed shared memory (chunk 0 + chunk 1
// + ...), each CTA for its share of the tile's columns, and writes
// the output: one kernel, no fp32 partials in global memory. Nothing depends on M but the token
// tile's width, and a wgmma column does not depend on the wgmma's N: batch-invariant.
//
// A programmatic dependent launch (decode_gemm.py) overlaps the prologue and the first STAGES
// weight boxes (which the kernel before does not write) with that kernel's end; the tokens are
// read after `griddepcontrol.wait`. Compile-time constants: CONSUMERS (1, 2), TOKENS (8, 16, 32,
// 64), STAGES, SPLIT (1, 2, 4, 8), MIN_BLOCKS (CTAs per SM the registers are cut for),
// CONSUMER_REGS (setmaxnreg), PIPELINED (0, 1), TOKENS_AS_A (0, 1), SCALE_VEC (1, 2, 4, rows as
// A only: the slices whose scales one shared load brings; each slice's token scales are one load
// per token otherwise, and from 32 tokens those loads are a large share of the consumers'
// issue), SB_F32, OUT_F32.

#include "common.cuh"
#include "wgmma_fp8.cuh"

#define BLOCK_K 128  // bytes per row and stage: one 128-byte swizzle row
#define SLICES 4     // k32 slices per stage, each with its own scales
#define ROWS (64 * CONSUMERS)
#define THREADS (128 * (CONSUMERS + 1))
#define WN (TOKENS_AS_A ? 64 : TOKENS)  // the wgmma's N (A is 64 rows either way)
#define NJ (WN / 8)                      // n8 column groups of a wgmma's accumulators
#define RB (ROWS / 32)   // 32-row blocks of sw per CTA
#define W_BYTES (ROWS * BLOCK_K)
#define X_BYTES (TOKENS * BLOCK_K < 1024 ? 1024 : TOKENS * BLOCK_K)  // 1024-aligned stage parts
#define SX_BYTES 1024  // TOKENS x 4 floats, padded
#define STAGE_BYTES (W_BYTES + X_BYTES + SX_BYTES)
#define PART_STRIDE (ROWS + 4)  // floats per token of the chunk's sums (conflict-free stores)
#define PRODUCER_REGS 24

static_assert(CONSUMERS == 1 || CONSUMERS == 2, "CONSUMERS: 1 or 2");
static_assert(TOKENS == 8 || TOKENS == 16 || TOKENS == 32 || TOKENS == 64, "TOKENS: 8..64");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4 || SPLIT == 8, "SPLIT: 1, 2, 4 or 8");
static_assert(STAGES >= 2 && STAGES <= 12, "STAGES: 2..12");
static_assert(PIPELINED == 0 || PIPELINED == 1, "PIPELINED: 0 or 1");
static_assert(TOKENS_AS_A == 0 || TOKENS == 64, "TOKENS_AS_A: 64-token tiles only");
static_assert(SCALE_VEC == 1 || SCALE_VEC == 2 || SCALE_VEC == 4, "SCALE_VEC: 1, 2 or 4");
static_assert(TOKENS * PART_STRIDE * 4 <= STAGES * STAGE_BYTES, "the sums fit in the ring");
static_assert(ROWS % (4 * SPLIT) == 0, "every CTA of a cluster writes whole 4-column groups");

// Every thread of the cluster: this CTA's shared-memory stores are visible to the cluster's
// reads after it.
static __device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" :::
                   "memory");
}

// The kernel's last barrier: every CTA has read the others' shared memory (its loads' values are
// used before it arrives), so no CTA leaves while its sums are read. Relaxed: a release here
// would wait for the output's global stores to drain.
static __device__ __forceinline__ void cluster_sync_exit() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;" :::
                   "memory");
}

// Issues one k32 slice's wgmma as its own group: d = the 64 weight rows at shared address w
// times the TOKENS rows at x, slice q of the stage's 128-byte rows.
template <int N>
static __device__ __forceinline__ void slice_wgmma(float (&d)[N / 8][4], u32 w, u32 x, int q) {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  wgmma_e4m3<N>(d, desc_sw128(w) + 2 * q, desc_sw128(x) + 2 * q);
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// V consecutive floats at shared address p (4V-byte aligned).
template <int V>
static __device__ __forceinline__ void lds_vec(float (&v)[V], u32 p) {
  if constexpr (V == 1) {
    v[0] = lds32(p);
  } else if constexpr (V == 2) {
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(v[0]), "=f"(v[1]) : "r"(p));
  } else {
    const float4 f = lds128(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  }
}

// The 4 floats at shared address p (16-byte aligned) of cluster CTA `rank`.
static __device__ __forceinline__ float4 lds128_cluster(u32 p, int rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(p), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// Dynamic shared memory: [STAGES][w ROWS x 128 | x TOKENS x 128 (>= 1 KiB) | sx TOKENS x 4
// floats (1 KiB)], then the sw table [stage][RB][slice] floats; the chunk's sums [TOKENS]
// [PART_STRIDE] floats reuse the ring once it is drained. 1 KiB of slack aligns the ring.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) __cluster_dims__(SPLIT, 1, 1)
    decode_gemm(const __grid_constant__ TensorMap w_map, const __grid_constant__ TensorMap x_map,
                const __grid_constant__ TensorMap sx_map,
                const __grid_constant__ TensorMap x_tail_map,
                const __grid_constant__ TensorMap sx_tail_map, const void* __restrict__ sw_ptr,
                void* __restrict__ out, int m_rows, int n_cols, int k_len, int tail_box) {
  extern __shared__ u8 smem_raw[];
  __shared__ __align__(8) u64 full[STAGES];
  __shared__ __align__(8) u64 empty[STAGES];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 sw_table = base + STAGES * STAGE_BYTES;
  const int rank = blockIdx.x % SPLIT;  // the K chunk (and the CTA's rank in its cluster)
  // the token tiles of a weight tile are neighbours in launch order: they run together and share
  // the tile's weight boxes in L2
  const int tiles_t = (m_rows + TOKENS - 1) / TOKENS;
  const int n0 = blockIdx.x / SPLIT / tiles_t * ROWS;
  const int t0 = blockIdx.x / SPLIT % tiles_t * TOKENS;
  const int steps = k_len / BLOCK_K / SPLIT;  // stages of the chunk
  const int k_groups = k_len / 32;
  const int g0 = rank * steps * SLICES;  // the chunk's first k32 group

  // the bytes a stage's three boxes bring. A partial last token tile loads tail_box rows (its
  // rows rounded up to 8) through the tail maps: rows past the tensor, which the TMA fills with
  // zeros, cost it time; the tile's rows past the box are never loaded and feed only sums that
  // are not stored
  const bool tail = t0 + TOKENS > m_rows;
  const TensorMap* xm = tail ? &x_tail_map : &x_map;
  const TensorMap* sxm = tail ? &sx_tail_map : &sx_map;
  const u32 stage_tx = W_BYTES + (tail ? tail_box : TOKENS) * (BLOCK_K + 16);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s]);
      mbar_init(&empty[s], CONSUMERS * 4);  // lane 0 of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // the chunk's sw for the tile's rows, as floats (rows past N: 0); a row block's 4 slices of a
  // stage side by side
  for (int i = threadIdx.x; i < steps * SLICES * RB; i += THREADS) {
    const int q = i / (RB * SLICES) * SLICES + i % SLICES, row = n0 / 32 + i / SLICES % RB;
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
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
    if (threadIdx.x == 0) {
      const int k0 = rank * steps * BLOCK_K;
      const int first = steps < STAGES ? steps : STAGES;
      // the weight boxes of the first stages before the wait: the kernel before does not
      // write the weights
      for (int s = 0; s < first; ++s) {
        mbar_expect(&full[s], stage_tx);
        tma_box(base + s * STAGE_BYTES, &w_map, k0 + s * BLOCK_K, n0, &full[s]);
      }
      asm volatile("griddepcontrol.wait;" ::: "memory");
      for (int kt = 0; kt < steps; ++kt) {
        const int s = kt % STAGES;
        const u32 stage = base + s * STAGE_BYTES;
        if (kt >= first) {
          mbar_wait(&empty[s], (kt / STAGES - 1) & 1);
          mbar_expect(&full[s], stage_tx);
          tma_box(stage, &w_map, k0 + kt * BLOCK_K, n0, &full[s]);
        }
        tma_box(stage + W_BYTES, xm, k0 + kt * BLOCK_K, t0, &full[s]);
        tma_box(stage + W_BYTES + X_BYTES, sxm, (k0 / BLOCK_K + kt) * 16, t0, &full[s]);
      }
      // every load is issued: the next kernel may start its prologue (it waits for this grid's
      // end before it reads what this one writes)
      asm volatile("griddepcontrol.launch_dependents;");
    }
    // the producer warpgroup stays for the cluster barriers (they count every thread)
    cluster_sync();
    cluster_sync_exit();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
  const int c = wg - 1;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  // The accumulator fragment: element [j][e] of a thread is A row 16 warp + lane / 4 + 8 (e / 2),
  // B row 8 j + 2 (lane % 4) + e % 2 of the warpgroup's tile.
  const int a_row = 16 * warp + (lane >> 2), b_row = 2 * (lane & 3);

  // With PIPELINED, slice q + 1's wgmma runs while slice q is promoted: slice q's partial is
  // part[q % 2]. Within a stage only: a group left in flight across the K loop's back edge makes
  // ptxas serialize every wgmma (C7514).
  float acc[NJ][4], part[PIPELINED + 1][NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  const u32 w_off = c * 64 * BLOCK_K;  // this warpgroup's 64 rows of a stage's weight box
  // the wgmma's operands in a stage: A the weight rows and B the tokens, or the reverse
  const u32 a_off = TOKENS_AS_A ? W_BYTES : w_off, b_off = TOKENS_AS_A ? w_off : W_BYTES;

  for (int kt = 0; kt < steps; ++kt) {
    const int s = kt % STAGES;
    const u32 stage = base + s * STAGE_BYTES;
    const u32 sx = stage + W_BYTES + X_BYTES;
    const u32 sw = sw_table + kt * RB * SLICES * 4;  // the stage's [RB][slice] weight scales
    mbar_wait(&full[s], (kt / STAGES) & 1);
    if (PIPELINED) slice_wgmma<WN>(part[0], stage + a_off, stage + b_off, 0);
#if TOKENS_AS_A
    // a thread's 2 tokens and its rows' 2 row blocks, a stage's 4 slices each
    float sxv[2][SLICES], swv[2][SLICES];
#else
    float swv[SCALE_VEC], sxv[NJ][2][SCALE_VEC];  // slices q - q % SCALE_VEC onwards
#endif
#pragma unroll
    for (int q = 0; q < SLICES; ++q) {
      const bool ahead = PIPELINED && q + 1 < SLICES;
      if (ahead)
        slice_wgmma<WN>(part[(q + 1) & 1], stage + a_off, stage + b_off, q + 1);
      else if (!PIPELINED)
        slice_wgmma<WN>(part[0], stage + a_off, stage + b_off, q);
      // slice q's scale products while the wgmmas run: p[x][y] multiplies element [j][e] with
      // x, y = e % 2, 0 (rows as A: one row block, each token's sx) or e / 2, j / 4 (tokens as A)
#if TOKENS_AS_A
      if (q == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          lds_vec(sxv[h], sx + (a_row + 8 * h) * 16);
          lds_vec(swv[h], sw + ((2 * c + h) * SLICES) * 4);
        }
      }
      float p[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int b = 0; b < 2; ++b) p[h][b] = swv[b][q] * sxv[h][q];
#else
      if (q % SCALE_VEC == 0) {
        lds_vec(swv, sw + ((64 * c + a_row) / 32 * SLICES + q) * 4);
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) lds_vec(sxv[j][e], sx + ((8 * j + b_row + e) * 4 + q) * 4);
      }
      float p[NJ][2];
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) p[j][e] = swv[q % SCALE_VEC] * sxv[j][e][q % SCALE_VEC];
#endif
      if (ahead)  // slice q is done, the next one may still run
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
      else
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      if (q == SLICES - 1 && lane == 0) mbar_arrive(&empty[s]);  // the stage is read
      const float(&d)[NJ][4] = part[PIPELINED ? q & 1 : 0];
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[j][e] = fmaf(d[j][e], TOKENS_AS_A ? p[e >> 1][j >> 2] : p[j][e & 1], acc[j][e]);
    }
  }

  // the chunk's sums into the drained ring (both consumer warpgroups are past their last wgmma)
  asm volatile("bar.sync 1, %0;" ::"n"(128 * CONSUMERS) : "memory");
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ra = a_row + 8 * (e >> 1), rb = 8 * j + b_row + (e & 1);
      const int t = TOKENS_AS_A ? ra : rb, n = 64 * c + (TOKENS_AS_A ? rb : ra);
      sts32(base + (t * PART_STRIDE + n) * 4, acc[j][e]);
    }
  cluster_sync();

  // this CTA's share of the tile's columns: the chunks' sums in chunk order, then the output
  // (after the kernel before has ended: it may still read memory this one writes)
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // 4 columns per thread and step (N is a multiple of 8: a group is all in or all past N)
  constexpr int kQuads = ROWS / SPLIT / 4;
  const int col0 = rank * kQuads * 4;
  const int t_valid = min(TOKENS, m_rows - t0);
  for (int i = threadIdx.x - 128; i < t_valid * kQuads; i += 128 * CONSUMERS) {
    const int t = i / kQuads, col = col0 + 4 * (i % kQuads), n = n0 + col;
    if (n >= n_cols) continue;
    const u32 at = base + (t * PART_STRIDE + col) * 4;
    float4 v = SPLIT == 1 ? lds128(at) : lds128_cluster(at, 0);
#pragma unroll
    for (int r = 1; r < SPLIT; ++r) {
      const float4 u = lds128_cluster(at, r);
      v.x += u.x, v.y += u.y, v.z += u.z, v.w += u.w;
    }
    const u64 o = (u64)(t0 + t) * n_cols + n;
#if OUT_F32
    *reinterpret_cast<float4*>(static_cast<float*>(out) + o) = v;
#else
    const uint2 b = {bf16_bits(v.x) | (u32)bf16_bits(v.y) << 16,
                     bf16_bits(v.z) | (u32)bf16_bits(v.w) << 16};
    *reinterpret_cast<uint2*>(static_cast<u16*>(out) + o) = b;
#endif
  }
  cluster_sync_exit();  // the other CTAs have read this one's sums
}
