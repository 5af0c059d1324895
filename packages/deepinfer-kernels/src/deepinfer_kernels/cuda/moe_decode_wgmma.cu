// FP4 MoE decode GEMMs for batch-invariant mode: every output is the same chain of
// wgmma.m64nNk16 (bf16 in, fp32 sums) over all of K in natural order that the Triton tier's
// prefill tiles compute, so a routed row's bits do not depend on the batch, decode or prefill.
// Compiled at run time by NVRTC; `moe_decode.py` holds the contract and picks the constants.
//
// How: a CTA is WG warpgroups on 64 WG weight rows of each matrix (warp w: rows 16w..16w+15,
// lane (g, t): rows g and g + 8, the mma A-fragment layout), over all of K. The A operand comes from
// registers: each K step the 4 threads of a quad load 64 packed bytes of their row (four 32-value
// scale groups, 16 bytes each) and pass them byte-transposed through a per-warp shared scratch,
// from which each thread reads bytes t, 4+t, 8+t, 12+t of every group (its natural fragment
// slots (2t, 2t+1) and (2t+8, 2t+9) of the group's two k16 steps) as one word and expands them
// exactly to bf16. With FRAGMENT_WEIGHTS the weights were stored in that order beforehand
// (`quant.fp4_fragment_order`: chunk t of each 64-byte step holds bytes t, 4+t, 8+t, 12+t of
// the step's 4 groups), so each thread's 16-byte load is its fragment bytes: no exchange.
// The routing tile's activations sit in shared memory in wgmma's K-major layout, loaded once.
//
// Constants (-D): K_DIM (reduction length), N_DIM (weight rows per expert), MATS (1: W2; 2: W1
// and W3 fused with SwiGLU), TOKG (8-token groups per routing tile: wgmma N = 8 TOKG), WG
// (warpgroups per CTA, sharing the activations), MIN_BLOCKS (CTAs per SM the register allocation
// must allow), DEPTH (K steps loaded ahead), FRAGMENT_WEIGHTS (1: the weights' bytes are in
// fragment order, above).

#include "common.cuh"

#define NB (8 * TOKG)  // tokens per routing tile (the wgmma's N)
#define KB (K_DIM / 2)  // packed bytes per weight row
#define KG (K_DIM / 32)  // scale groups per weight row
#define THREADS (128 * WG)
#define ROWS_PER_CTA (64 * WG)
#define X_BYTES (K_DIM * NB * 2)  // the tile's activations in shared memory

// wgmma's matrix descriptor of the activations' first k16 step (at shared address x_smem):
// K-major, no swizzle, core matrices of 8 tokens x 8 values (128 bytes) laid out [K / 8][NB][8]:
// the next 8 values (the leading dimension) are NB * 16 bytes on, the next 8 tokens (the stride
// dimension) 128.
static __device__ __forceinline__ u64 x_desc(u32 x_smem) {
  return (u64)((x_smem & 0x3FFFFu) >> 4) | ((u64)((NB * 16) >> 4) << 16) |
         ((u64)(128 >> 4) << 32);
}

// The descriptor of k16 step j + dj from that of step j (the start address field, in 16-byte
// units, stays below 2**14: shared memory is under 256 KiB).
static __device__ __forceinline__ u64 x_desc_add(u64 desc, int dj) { return desc + dj * 2 * NB; }

// acc += A (64 x 16, this thread's fragment a) * X^T (16 x NB, descriptor b).
static __device__ __forceinline__ void wgmma_step(float (&acc)[TOKG][4], const u32 (&a)[4],
                                                  u64 b) {
#if TOKG == 1
  asm volatile(
      "{.reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, "
      "p, 1, 1, 0;}"
      : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
#elif TOKG == 2
  asm volatile(
      "{.reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
      "{%8,%9,%10,%11}, %12, p, 1, 1, 0;}"
      : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]), "+f"(acc[1][0]),
        "+f"(acc[1][1]), "+f"(acc[1][2]), "+f"(acc[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
#else
#error "TOKG must be 1 or 2"
#endif
}

// One K step (4 scale groups, 128 values) of one thread: for each matrix and row half (rows g,
// g + 8) the 16 packed bytes of group t (the quad loads the row's 64 bytes, each byte once) and
// the 4 groups' scale bytes (one word, the same in the whole quad).
struct Step {
  u32 w[MATS][2][4];
  u32 s[MATS][2];
};

// Each warp's shared scratch for one step's packed bytes: [matrix][row half][g][4 groups][4
// words], group c's 16 bytes stored byte-transposed (word j holds byte j of each of its 4
// words: bytes j, 4+j, 8+j, 12+j, the fragment slots of thread t = j) in 16-byte slot
// c ^ ((g >> 1) & 3), so that a warp's reads of one group (word t of row g) hit 32 banks.
#define SCRATCH_BYTES (MATS * 2 * 8 * 64)

static __device__ __forceinline__ u32 scratch_at(u32 base, int m, int h, int g, int c) {
  return base + ((m * 2 + h) * 8 + g) * 64 + ((c ^ ((g >> 1) & 3)) << 4);
}

// The 4 x 4 byte transpose of w: word j of the result holds byte j of w[0..3], in order.
static __device__ __forceinline__ void transpose_bytes(const u32 (&w)[4], u32 (&o)[4]) {
  u32 a0, a1, a2, a3;
  asm("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(a0) : "r"(w[0]), "r"(w[1]));  // w0.b0 w1.b0 w0.b1 w1.b1
  asm("prmt.b32 %0, %1, %2, 0x7362;" : "=r"(a1) : "r"(w[0]), "r"(w[1]));  // w0.b2 w1.b2 w0.b3 w1.b3
  asm("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(a2) : "r"(w[2]), "r"(w[3]));
  asm("prmt.b32 %0, %1, %2, 0x7362;" : "=r"(a3) : "r"(w[2]), "r"(w[3]));
  asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(o[0]) : "r"(a0), "r"(a2));
  asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(o[1]) : "r"(a0), "r"(a2));
  asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(o[2]) : "r"(a1), "r"(a3));
  asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(o[3]) : "r"(a1), "r"(a3));
}

// `scale_pair` of byte c of a word of 4 UE8M0 scale bytes that each had 126 added (no carry
// for bytes up to 128, the range scale_pair is finite for): the byte into bits 8..15 and 24..31
// by one prmt, then one shift to bits 7..14 and 23..30.
static __device__ __forceinline__ u32 scale_pair_of(u32 sw126, int c) {
  u32 b;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(b) : "r"(sw126), "r"(0x0404 | (0x1010 * c)));
  return b >> 1;
}

// The thread's K stream (see `ring_loop`): w[m], s[m] at the current step of row g of matrix
// m (row g + 8 is a compile-time offset); the activations wait in shared memory until the first
// compute. acc[m][q]: matrix m's sums, token group q (element c: row g + 8 (c >> 1), token
// 8q + 2t + (c & 1)).
struct Stream {
  typedef ::Step Step;
  const u8* w[MATS];
  const u8* s[MATS];
  u64 desc;     // the activations' descriptor at the current step's first k16 step
  u32 scratch;  // this warp's scratch (shared address; unused with FRAGMENT_WEIGHTS)
  int g, t;
  int step = 0;
  float (&acc)[MATS][TOKG][4];

  __device__ __forceinline__ Stream(float (&acc_)[MATS][TOKG][4]) : acc(acc_) {}

  __device__ __forceinline__ bool valid(int j) const { return j < KG / 4; }

  __device__ __forceinline__ void advance() {
#pragma unroll
    for (int m = 0; m < MATS; ++m) {
      w[m] += 64;
      s[m] += 4;
    }
  }

  __device__ __forceinline__ void load(Step& st, bool ok) const {
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (ok) {
          ldg_stream(st.w[m][h], w[m] + 8 * h * KB);
          asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(st.s[m][h]) : "l"(s[m] + 8 * h * KG));
        } else {
          st.w[m][h][0] = st.w[m][h][1] = st.w[m][h][2] = st.w[m][h][3] = 0u;
          st.s[m][h] = 0u;
        }
      }
  }

  __device__ __forceinline__ void compute(const Step& st) {
    if (step == 0) {
      // the activations' cp.async copies, then visible to wgmma (the async proxy)
      asm volatile("cp.async.wait_all;\n fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
    }
#if !FRAGMENT_WEIGHTS
    __syncwarp();  // the last step's scratch reads are done
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        u32 tw[4];
        transpose_bytes(st.w[m][h], tw);
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(scratch_at(scratch, m, h, g, t)),
                     "r"(tw[0]), "r"(tw[1]), "r"(tw[2]), "r"(tw[3])
                     : "memory");
      }
    __syncwarp();
#endif
    u32 sw[MATS][2];  // the step's 4 scale bytes per row, each + 126
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) sw[m][h] = st.s[m][h] + 0x7E7E7E7Eu;
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // group c: k16 steps 2c and 2c + 1
      u32 a[MATS][2][4];           // [matrix][k16 step][fragment]
#pragma unroll
      for (int m = 0; m < MATS; ++m) {
        u32 lo[4], hi[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#if FRAGMENT_WEIGHTS
          const u32 mine = st.w[m][h][c];  // bytes t, 4+t, 8+t, 12+t of group c
#else
          u32 mine;  // bytes t, 4+t, 8+t, 12+t of the group
          asm volatile("ld.shared.u32 %0, [%1];"
                       : "=r"(mine)
                       : "r"(scratch_at(scratch, m, h, g, c) + 4 * t));
#endif
          expand8(mine, scale_pair_of(sw[m][h], c), h == 0 ? lo : hi);
        }
        // bytes t, 4+t of the group's first 8: k16 step 2c (slots 2t.. and 2t+8..); then 2c+1
        a[m][0][0] = lo[0], a[m][0][1] = hi[0], a[m][0][2] = lo[1], a[m][0][3] = hi[1];
        a[m][1][0] = lo[2], a[m][1][1] = hi[2], a[m][1][2] = lo[3], a[m][1][3] = hi[3];
      }
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int m = 0; m < MATS; ++m)
          wgmma_step(acc[m], a[m][k], x_desc_add(desc, 2 * c + k));
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    }
    ++step;
    desc = x_desc_add(desc, 8);
  }
};

// The stream's per-warp byte-exchange scratch (none with FRAGMENT_WEIGHTS: nothing to exchange).
static __device__ __forceinline__ void give_scratch(Stream& st, int warp) {
#if !FRAGMENT_WEIGHTS
  __shared__ __align__(16) u8 scratch[4 * WG][SCRATCH_BYTES];
  st.scratch = (u32)__cvta_generic_to_shared(scratch[warp]);
#endif
}

// Where a CTA stands: its routing tile, the thread's lane roles and the CTA's first weight row.
struct Place : TilePlace {
  int row0;
};

static __device__ __forceinline__ Place place(const int* tiles) {
  Place p;
  static_cast<TilePlace&>(p) = tile_place(tiles, NB);
  p.row0 = blockIdx.x * ROWS_PER_CTA;
  return p;
}

// Start the copies of the tile's activations (token n: row row_of(n) of x [rows, K_DIM] bf16;
// n past the tile's rows: zeros) into shared memory, 16 bytes per cp.async, and aim the stream.
template <typename RowOf>
static __device__ __forceinline__ void start(Stream& st, const Place& p, u8* x_smem,
                                             const u8* x, RowOf row_of) {
  const u32 x_base = (u32)__cvta_generic_to_shared(x_smem);
  st.desc = x_desc(x_base);
  for (int i = threadIdx.x; i < (K_DIM / 8) * NB; i += THREADS) {
    const int n = i % NB, kb = i / NB;
    const bool has = n < p.count;
    const u8* src = x + ((has ? (u64)row_of(n) : 0ull) * K_DIM + kb * 8) * 2;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(x_base + i * 16),
                 "l"(src), "r"(has ? 16 : 0)
                 : "memory");
  }
  st.g = p.g;
  st.t = p.t;
}

// The stream's weight and scale pointers for matrix m (w, s: its [E, N, K/2] and [E, N, K/32]).
static __device__ __forceinline__ void aim(Stream& st, int m, const Place& p, const u8* w,
                                           const u8* s) {
  const u64 row = (u64)p.expert * N_DIM + p.row0 + 16 * p.warp + p.g;
  st.w[m] = w + row * KB + 16 * p.t;
  st.s[m] = s + row * KG;
}

static __device__ __forceinline__ void run(Stream& st) {
  ring_loop<DEPTH>(st, KG / 4);
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

#if MATS == 2

// h = quant_dequant_fp8(swiglu(x W1^T, x W3^T) * weight) per 32 columns, as bf16: the W2 input.
// Grid: (N_DIM / ROWS_PER_CTA, routing tiles); block THREADS; X_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
moe_w13(const u8* __restrict__ xa,  // [T, K_DIM] bf16: FP8 activations expanded exactly
        const u8* __restrict__ w1, const u8* __restrict__ s1,  // [E, N, K/2], [E, N, K/32]
        const u8* __restrict__ w3, const u8* __restrict__ s3,
        const int* __restrict__ sorted_token,     // [P]
        const float* __restrict__ sorted_weight,  // [P]
        const int* __restrict__ tiles,            // [tiles, 3]: expert or -1, first row, end
        u16* __restrict__ h,                      // [P, N_DIM] bf16
        float limit, float amax_floor) {
  extern __shared__ __align__(128) u8 x_tile[];
  __shared__ float half_amax[4 * WG][NB];  // each warp's amax per token over its 16 rows
  const Place p = place(tiles);
  if (p.expert < 0) return;
  float acc[MATS][TOKG][4] = {};
  Stream st(acc);
  give_scratch(st, p.warp);
  start(st, p, x_tile, xa, [&](int n) { return sorted_token[p.first + n]; });
  aim(st, 0, p, w1, s1);
  aim(st, 1, p, w3, s3);
  run(st);

  // An h group is 32 rows: this warp's 16 and its partner's (warp ^ 1).
  float v[TOKG][2][2];  // [q][c1][row half]
#pragma unroll
  for (int q = 0; q < TOKG; ++q)
#pragma unroll
    for (int c1 = 0; c1 < 2; ++c1) {
      const int n = 8 * q + 2 * p.t + c1;
      const float rw = n < p.count ? sorted_weight[p.first + n] : 0.f;
      float amax = 0.f;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        v[q][c1][r] = swiglu_weighted(acc[0][q][2 * r + c1], acc[1][q][2 * r + c1], rw, limit);
        amax = fmaxf(amax, fabsf(v[q][c1][r]));
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 8));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 16));
      if (p.g == 0) half_amax[p.warp][n] = amax;
    }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < TOKG; ++q)
#pragma unroll
    for (int c1 = 0; c1 < 2; ++c1) {
      const int n = 8 * q + 2 * p.t + c1;
      if (n >= p.count) continue;
      const float amax = fmaxf(half_amax[p.warp][n], half_amax[p.warp ^ 1][n]);
      const Fp8Scale sc = fp8_scale(fmaxf(amax, amax_floor));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = p.row0 + 16 * p.warp + p.g + 8 * r;
        h[(u64)(p.first + n) * N_DIM + row] = fp8_round_trip(v[q][c1][r], sc);
      }
    }
}

#else

// y = h W2^T per routed row, rounded to bf16. Grid: (N_DIM / ROWS_PER_CTA, routing tiles); block
// THREADS; X_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
moe_w2(const u8* __restrict__ h,                              // [P, K_DIM] bf16
       const u8* __restrict__ w2, const u8* __restrict__ s2,  // [E, N, K/2], [E, N, K/32]
       const int* __restrict__ tiles,                         // [tiles, 3]
       u16* __restrict__ y) {                                 // [P, N_DIM] bf16
  extern __shared__ __align__(128) u8 x_tile[];
  const Place p = place(tiles);
  if (p.expert < 0) return;
  float acc[MATS][TOKG][4] = {};
  Stream st(acc);
  give_scratch(st, p.warp);
  start(st, p, x_tile, h, [&](int n) { return p.first + n; });
  aim(st, 0, p, w2, s2);
  run(st);
#pragma unroll
  for (int q = 0; q < TOKG; ++q)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int n = 8 * q + 2 * p.t + (c & 1);
      if (n < p.count) {
        const int row = p.row0 + 16 * p.warp + p.g + 8 * (c >> 1);
        y[(u64)(p.first + n) * N_DIM + row] = bf16_bits(acc[0][q][c]);
      }
    }
}

#endif
