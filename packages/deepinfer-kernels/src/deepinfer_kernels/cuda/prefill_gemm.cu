// FP8 block-scaled GEMM on wgmma (sm_90a) for V4.1's format: out[M, N] = sum_k (a[m, k] *
// sa[m, k / 32]) * (b[n, k] * sb[n / 32, k / 32]), a [M, K] and b [N, K] e4m3, sa fp32 powers of
// two, sb UE8M0 bytes (or fp32 with SB_F32), fp32 sums; out bf16 (or fp32 with OUT_F32).
//
// The scales change every 32 along K, so each k32 slice is one `wgmma.m64nNk32` (e4m3 in, fp32
// out, scale-d 0: a fresh partial) and the CUDA cores promote it: acc += partial * sa[m] * sb[n /
// 32], one FFMA per accumulator and slice (DeepGEMM's scheme at 4x its frequency). A CTA computes
// a 128 x BLOCK_N tile: one producer warpgroup, of which one thread issues the TMA boxes of each
// 128-deep K stage (a's 128 rows and b's BLOCK_N rows, 128 bytes each, 128-byte swizzle; sa's 128
// x 4 floats) into a ring of STAGES stages, and two consumer warpgroups of 64 rows each, which
// keep one slice's wgmma in flight while they promote the one before (two partial buffers).
// sb for the tile's columns and all of K goes to shared memory once per CTA, as floats (by the
// consumers, while the first stages load). The finished tile is staged in the ring's shared
// memory (PERSISTENT, whose ring holds the next tile: its own) and leaves by TMA stores.
//
// The sums of a row depend on K only (fixed tiles): batch-invariant, also where SPLIT_TAIL cuts
// the last partial wave's tiles into pieces of K_SPLIT's chunks (cut otherwise, they depend on
// M). With K_SPLIT, K runs in chunks of `chunk_steps` stages, each summed from zero and the chunk
// sums added in order (the decode kernel's split, for batch-invariant mode: the same sums as
// that kernel's); the running total of the chunks waits in shared memory. Compile-time
// constants: BLOCK_N (64 or 128), STAGES (2..8), GROUP_M (m tiles per raster group: CTAs in
// launch order walk GROUP_M tiles down before the next column, so the weights a wave reads stay
// in L2), K_SPLIT, PERSISTENT (`TILE_LOOP`), SPLIT_TAIL (`tail_sum`), SB_F32, OUT_F32.

#include "common.cuh"
#include "wgmma_fp8.cuh"

#define BLOCK_M 128
#define BLOCK_K 128  // values (bytes) per row and stage: one 128-byte swizzle row
#define SLICES 4     // k32 slices per stage, each with its own scales
#define CONSUMERS 2  // warpgroups of 64 rows
#define THREADS (128 * (CONSUMERS + 1))
#define NB8 (BLOCK_N / 8)   // n8 column groups of a wgmma's accumulators
#define NCB (BLOCK_N / 32)  // 32-column blocks of sb
#define A_BYTES (BLOCK_M * BLOCK_K)
#define B_BYTES (BLOCK_N * BLOCK_K)
#define SA_BYTES (BLOCK_M * 16)  // 4 floats per row
#define STAGE_BYTES (A_BYTES + B_BYTES + SA_BYTES)
#define SB_STRIDE ((NCB + 3) / 4 * 4)  // floats per slice in the sb table (16-byte rows)
#define OUT_BYTES (OUT_F32 ? 4 : 2)
#define OUT_BOX_COLS (128 / OUT_BYTES)  // columns per output box: 128 bytes, the swizzle's row
#define OUT_BOXES (BLOCK_N / OUT_BOX_COLS)
#define OUT_HALF_BYTES (OUT_BOXES * 64 * 128)  // a consumer warpgroup's 64 rows of the tile
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232

static_assert(BLOCK_N == 64 || BLOCK_N == 128, "BLOCK_N: 64 or 128");
static_assert(STAGES >= 2 && STAGES <= 8, "STAGES: 2..8");
static_assert(STAGE_BYTES % 1024 == 0, "stages start on 1024 bytes (the swizzle's period)");
static_assert(!(SPLIT_TAIL && PERSISTENT), "SPLIT_TAIL: one tile per CTA");
static_assert(2 * OUT_HALF_BYTES <= STAGES * STAGE_BYTES, "the tile is staged in the ring");

#if K_SPLIT
// The end of a K chunk but the last: total = acc (the first chunk) or total + acc, then acc = 0.
// mine: this consumer thread's column of the total (element e at mine + 1024 e: conflict-free).
static __device__ __forceinline__ void fold(float (&acc)[NB8][4], u32 mine, bool first) {
#pragma unroll
  for (int j = 0; j < NB8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const u32 at = mine + (4 * j + c) * 1024;
      const float t = first ? acc[j][c] : lds32(at) + acc[j][c];
      sts32(at, t);
      acc[j][c] = 0.f;
    }
}
#endif

// acc += part * (sa of the row half) * (sb of the 32-column block): p[h][cb] holds the products.
static __device__ __forceinline__ void promote(float (&acc)[NB8][4], const float (&part)[NB8][4],
                                               const float (&p)[2][NCB]) {
#pragma unroll
  for (int j = 0; j < NB8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = fmaf(part[j][c], p[c >> 1][j / 4], acc[j][c]);
}

// The products sa[row half] * sb[column block] of slice q (sa: the stage's two rows' 4 slices).
static __device__ __forceinline__ void slice_scales(float (&p)[2][NCB], const float4 (&sa)[2],
                                                    u32 sb_table, int q, int j) {
  float sb[NCB];
#pragma unroll
  for (int cb = 0; cb < NCB; cb += 4) {
    const float4 v = lds128(sb_table + (q * SB_STRIDE + cb) * 4);
    sb[cb] = v.x;
    if (cb + 1 < NCB) sb[cb + 1] = v.y;
    if (cb + 2 < NCB) sb[cb + 2] = v.z;
    if (cb + 3 < NCB) sb[cb + 3] = v.w;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float s = j == 0 ? sa[h].x : j == 1 ? sa[h].y : j == 2 ? sa[h].z : sa[h].w;
#pragma unroll
    for (int cb = 0; cb < NCB; ++cb) p[h][cb] = s * sb[cb];
  }
}

// This consumer thread's sums (out dtype) into its warpgroup's staged rows at `half`: boxes of 64
// rows x 128 bytes, 8 KiB apart, the 16-byte chunk c of row r at chunk c ^ (r % 8) (the TMA's
// 128-byte swizzle; a warp's 8 rows then hit distinct banks). The thread's rows are 16 warp +
// lane / 4 (+ 8), so r % 8 = lane / 4.
static __device__ __forceinline__ void stage_out(const float (&acc)[NB8][4], u32 half, int warp,
                                                 int lane) {
  const u32 swz = lane >> 2;
#pragma unroll
  for (int j = 0; j < NB8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 row = half + (16 * warp + (lane >> 2) + 8 * h) * 128;
#if OUT_F32  // 8 bytes at byte 32 j + 8 (lane % 4) of the tile's row: 4 boxes of 32 columns
      const u32 chunk = 2 * (j & 3) + ((lane & 3) >> 1);
      const u32 at = row + (j >> 2) * 8192 + ((chunk ^ swz) << 4) + 8 * (lane & 1);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(acc[j][2 * h]),
                   "f"(acc[j][2 * h + 1]));
#else  // 4 bytes at byte 16 j + 4 (lane % 4): boxes of 64 columns
      const u32 at = row + (j >> 3) * 8192 + (((j & 7) ^ swz) << 4) + 4 * (lane & 3);
      u32 v;
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(acc[j][2 * h + 1]), "f"(acc[j][2 * h]));
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(v));
#endif
    }
}

// The origin (m0, n0) of output tile `id`: GROUP_M m tiles down, then the next column of tiles.
static __device__ __forceinline__ void tile_origin(int id, int tiles_m, int tiles_n, int& m0,
                                                   int& n0) {
  const int per_group = GROUP_M * tiles_n;
  const int first_m = id / per_group * GROUP_M;
  const int group_m = min(tiles_m - first_m, GROUP_M);
  const int in_group = id % per_group;
  m0 = (first_m + in_group % group_m) * BLOCK_M;
  n0 = in_group / group_m * BLOCK_N;
}

// The sb table of the tile at column n0: [K / 32][SB_STRIDE] floats, columns past N as 0; thread
// `me` of `count` fills every count-th entry.
static __device__ __forceinline__ void fill_sb_table(u32 sb_table, const void* sb_ptr, int n0,
                                                     int n_cols, int k_groups, int me, int count) {
  const int sb_rows = (n_cols + 31) / 32;
  for (int i = me; i < k_groups * NCB; i += count) {
    const int q = i / NCB, cb = i % NCB, row = n0 / 32 + cb;
    float v = 0.f;
    if (row < sb_rows) {
#if SB_F32
      v = static_cast<const float*>(sb_ptr)[(u64)row * k_groups + q];
#else
      v = e8m0(static_cast<const u8*>(sb_ptr)[(u64)row * k_groups + q]);
#endif
    }
    sts32(sb_table + (q * SB_STRIDE + cb) * 4, v);
  }
}

#if SPLIT_TAIL
// Sums to a slot of the workspace: NB8 float4s per consumer thread, 256 apart (coalesced).
static __device__ __forceinline__ void spill(const float (&acc)[NB8][4], float4* slot) {
#pragma unroll
  for (int j = 0; j < NB8; ++j)
    __stcg(slot + j * 256, make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}

// The tiles of the last partial wave, cut along K (the CTAs past the `dp_tiles` whole tiles):
// `split` pieces of `per` chunks each (K_SPLIT's chunks; without it each piece is one chunk).
// The tile's sums wait in `ws` ([tail tile][chunk][NB8][256 threads] float4s): piece 0 sums its
// chunks as an uncut tile does (`fold`) and leaves that prefix in the slot of its last chunk;
// the other pieces leave each chunk's sums apart (`spill` between chunks, then here). The last
// piece of a tile to arrive (`arrivals`, zeroed by the caller) adds prefix + chunk + chunk ... in
// chunk order (the same bits whichever arrives last, and with K_SPLIT those of the uncut tile:
// batch-invariant) into acc and goes on to store the tile. Returns whether this CTA stores it.
// me: the consumer thread, 0..255.
static __device__ __forceinline__ bool tail_sum(float (&acc)[NB8][4], float4* ws, int* arrivals,
                                                int tail_tile, int piece, int split, int per,
                                                int me) {
  __shared__ int last;
  const int chunks = split * per, mine = piece * per + per - 1;  // the slot acc goes to
  float4* slots = ws + (u64)tail_tile * chunks * NB8 * 256 + me;
  spill(acc, slots + mine * NB8 * 256);
  __threadfence();  // the sums are out before the arrival is counted
  asm volatile("bar.sync 1, 256;" ::: "memory");
  if (me == 0) last = atomicAdd(arrivals + tail_tile, 1) == split - 1;
  asm volatile("bar.sync 1, 256;" ::: "memory");
  if (!last) return false;
  __threadfence();  // and the other pieces' sums are read after their arrivals
  // a slot's NB8 loads all in flight before its sums are added (one L2 round trip per slot)
  float4 t[NB8];
#pragma unroll
  for (int j = 0; j < NB8; ++j)
    t[j] = mine == per - 1 ? make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3])
                           : __ldcg(slots + ((per - 1) * NB8 + j) * 256);
  for (int i = per; i < chunks; ++i) {
    float4 v[NB8];
#pragma unroll
    for (int j = 0; j < NB8; ++j)
      v[j] = i == mine ? make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3])
                       : __ldcg(slots + (i * NB8 + j) * 256);
#pragma unroll
    for (int j = 0; j < NB8; ++j)
      t[j] = make_float4(t[j].x + v[j].x, t[j].y + v[j].y, t[j].z + v[j].z, t[j].w + v[j].w);
  }
#pragma unroll
  for (int j = 0; j < NB8; ++j)
    acc[j][0] = t[j].x, acc[j][1] = t[j].y, acc[j][2] = t[j].z, acc[j][3] = t[j].w;
  return true;
}
#endif

#if PERSISTENT
// A CTA takes tiles blockIdx.x, + gridDim.x, ... (the ring's stages and phases run on across
// them, so the producer loads the next tile while the consumers store this one); the consumer
// warpgroups refill the sb table between their barriers (named barrier 1, 256 threads).
#define TILE_LOOP for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x)
#else
#define TILE_LOOP for (int once = 1; once; once = 0)
#endif

// Dynamic shared memory: [STAGES][a 128 x 128 | b BLOCK_N x 128 | sa 128 x 4 floats], (K_SPLIT:
// the chunks' total, [NB8 * 4][256 consumer threads] floats), then the sb table [K / 32][SB_STRIDE]
// floats, (PERSISTENT: from the next 1024 bytes, the tile's staging, 128 x BLOCK_N floats); 1 KiB
// of slack to start the stages on 1024 bytes.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    fp8_gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
             const __grid_constant__ TensorMap sa_map, const __grid_constant__ TensorMap a_last,
             const __grid_constant__ TensorMap sa_last, const __grid_constant__ TensorMap out_map,
             const void* __restrict__ sb_ptr, int m_rows, int n_cols,
             int k_len, int chunk_steps, int last_box, float4* ws, int* arrivals, int dp_tiles,
             int split) {
  extern __shared__ u8 smem_raw[];
  __shared__ __align__(8) u64 full[STAGES];
  __shared__ __align__(8) u64 empty[STAGES];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 total = base + STAGES * STAGE_BYTES;  // K_SPLIT only
  const u32 sb_table = total + (K_SPLIT ? NB8 * 4 * 256 * 4 : 0);
#if PERSISTENT  // the tile's staging for the TMA stores, room for fp32 sums (1024-byte aligned)
  const u32 out_stage = (sb_table + k_len / 32 * SB_STRIDE * 4 + 1023u) & ~1023u;
#endif
  const int k_steps = k_len / BLOCK_K;
  const int k_groups = k_len / 32;

  const int tiles_m = (m_rows + BLOCK_M - 1) / BLOCK_M;
  const int tiles_n = (n_cols + BLOCK_N - 1) / BLOCK_N;
  int m0, n0;
  int k0 = 0, steps = k_steps;  // the first of the CTA's K stages of each tile, and how many
#if SPLIT_TAIL
  const int per = K_SPLIT ? k_steps / chunk_steps / split : 1;  // chunks per piece
  const int piece = blockIdx.x < dp_tiles ? -1 : (blockIdx.x - dp_tiles) % split;
  const int tile = blockIdx.x < dp_tiles ? blockIdx.x : dp_tiles + (blockIdx.x - dp_tiles) / split;
  if (piece >= 0) k0 = piece * k_steps / split, steps = (piece + 1) * k_steps / split - k0;
  tile_origin(tile, tiles_m, tiles_n, m0, n0);
#elif !PERSISTENT
  tile_origin(blockIdx.x, tiles_m, tiles_n, m0, n0);
#endif
#if !SPLIT_TAIL
  constexpr int piece = -1;  // whole tiles only
#endif

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s]);
      mbar_init(&empty[s], CONSUMERS * 4);  // lane 0 of every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
    if (threadIdx.x == 0) {
      int done = 0;  // stages loaded for the CTA's tiles before this one
      TILE_LOOP {
#if PERSISTENT
        tile_origin(tile, tiles_m, tiles_n, m0, n0);
#endif
        // a partial last row tile loads boxes of last_box rows (its rows rounded up to 8; a and
        // sa by the maps a_last / sa_last): the TMA's zero fill of rows past M is slow, and the
        // tile's rows past the box only feed sums that are not stored
        const bool cut = m0 + BLOCK_M > m_rows;
        const TensorMap* am = cut ? &a_last : &a_map;
        const TensorMap* sam = cut ? &sa_last : &sa_map;
        const u32 stage_tx = cut ? B_BYTES + last_box * (BLOCK_K + 16) : STAGE_BYTES;
        for (int i = 0; i < steps; ++i) {
          const int g = done + i, kt = k0 + i;  // the ring's count, the stage along K
          const int s = g % STAGES;
          if (g >= STAGES) mbar_wait(&empty[s], (g / STAGES - 1) & 1);
          const u32 stage = base + s * STAGE_BYTES;
          mbar_expect(&full[s], stage_tx);
          tma_box(stage, am, kt * BLOCK_K, m0, &full[s]);
          tma_box(stage + A_BYTES, &b_map, kt * BLOCK_K, n0, &full[s]);
          tma_box(stage + A_BYTES + B_BYTES, sam, kt * 16, m0, &full[s]);
        }
        done += steps;
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
  const int c = wg - 1;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int row = 64 * c + 16 * warp + (lane >> 2);  // and row + 8

  int done = 0;  // stages consumed for the CTA's tiles before this one
  TILE_LOOP {
#if PERSISTENT
    tile_origin(tile, tiles_m, tiles_n, m0, n0);
    // the other consumer warpgroup is past its last read of the table too, then it is refilled
    asm volatile("bar.sync 1, 256;" ::: "memory");
#endif
    // the consumers fill the sb table while the producer's first loads are in flight (filled
    // before the CTA's barrier, it delays them)
    fill_sb_table(sb_table, sb_ptr, n0, n_cols, k_groups, threadIdx.x - 128, 256);
    asm volatile("bar.sync 1, 256;" ::: "memory");
    float acc[NB8][4], part[2][NB8][4], p[2][NCB];
#pragma unroll
    for (int j = 0; j < NB8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

    // the sb table from the CTA's first stage on, so the loop runs as for a whole tile
    const u32 sb_first = sb_table + k0 * SLICES * SB_STRIDE * 4;
    // chunk by chunk (K_SPLIT), the fold between chunks outside the stages' loop: inside it, ptxas
    // scheduled that loop otherwise (631 instructions against 376 without the split)
    const int chunk = K_SPLIT ? chunk_steps : steps;
    for (int c0 = 0; c0 < steps; c0 += chunk) {
#if K_SPLIT
      if (c0 > 0) {
#if SPLIT_TAIL
        if (piece > 0) {  // a later piece keeps its chunks apart (`tail_sum`)
          const int slot = piece * per + c0 / chunk - 1;
          const u64 at = ((u64)(tile - dp_tiles) * split * per + slot) * NB8 * 256;
          spill(acc, ws + at + threadIdx.x - 128);
#pragma unroll
          for (int j = 0; j < NB8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
        } else
#endif
          fold(acc, total + (threadIdx.x - 128) * 4, c0 == chunk);
      }
#endif
      const int end = min(c0 + chunk, steps);
      for (int kt = c0; kt < end; ++kt) {
        const int g = done + kt;  // the ring's count
        const int s = g % STAGES;
        const u32 stage = base + s * STAGE_BYTES;
        mbar_wait(&full[s], (g / STAGES) & 1);
        const u64 da = desc_sw128(stage + c * 64 * BLOCK_K);
        const u64 db = desc_sw128(stage + A_BYTES);
        const float4 sa[2] = {lds128(stage + A_BYTES + B_BYTES + row * 16),
                              lds128(stage + A_BYTES + B_BYTES + (row + 8) * 16)};
#pragma unroll
        for (int j = 0; j < SLICES; ++j) {
          asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
          wgmma_e4m3<BLOCK_N>(part[j & 1], da + 2 * j, db + 2 * j);
          asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
          if (j > 0) {  // the slice before is done: promote it while this one runs
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            promote(acc, part[(j + 1) & 1], p);
          }
          slice_scales(p, sa, sb_first, kt * SLICES + j, j);
        }
        // the stage's last slice (a wait for all: ptxas serializes the wgmmas when a partial stays
        // in flight across the loop's back edge; two stages per loop body, which waits half as
        // often, was no faster), then the stage goes back to the producer
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        if (lane == 0) mbar_arrive(&empty[s]);
        promote(acc, part[(SLICES - 1) & 1], p);
      }
    }
#if K_SPLIT
    // the last chunk goes on the total of those before (not in a later piece of a cut tile)
    if (chunk_steps < steps && piece <= 0) {
      const u32 mine = total + (threadIdx.x - 128) * 4;
#pragma unroll
      for (int j = 0; j < NB8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] = lds32(mine + (4 * j + c) * 1024) + acc[j][c];
    }
#endif
#if SPLIT_TAIL
    if (piece >= 0 &&
        !tail_sum(acc, ws, arrivals, tile - dp_tiles, piece, split, per, threadIdx.x - 128))
      return;
#endif

    // the tile out through shared memory and the TMA (direct 4-byte stores of the wgmma layout
    // are slower): each warpgroup stages its 64 rows as
    // 128-byte-swizzled boxes and one of its threads stores them, out-of-bounds rows and columns
    // left out by the TMA. One tile per CTA: both consumer warpgroups are past their last wgmma,
    // so the drained ring holds the staging. PERSISTENT: the ring holds the next tile's stages,
    // so the staging has its own memory, which the last tile's stores have read by now (checked
    // by the thread that issued them)
#if PERSISTENT
    const u32 half = out_stage + c * OUT_HALF_BYTES;
    if ((threadIdx.x & 127) == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");
#else
    asm volatile("bar.sync 1, 256;" ::: "memory");
    const u32 half = base + c * OUT_HALF_BYTES;
#endif
    stage_out(acc, half, warp, lane);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");
    if ((threadIdx.x & 127) == 0 && m0 + 64 * c < m_rows) {
#pragma unroll
      for (int b = 0; b < OUT_BOXES; ++b)
        if (n0 + b * OUT_BOX_COLS < n_cols)
          tma_store(&out_map, (n0 + b * OUT_BOX_COLS) * OUT_BYTES, m0 + 64 * c, half + b * 8192);
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    done += steps;
  }
  // the staging's memory stays until the stores have read it
  if ((threadIdx.x & 127) == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
