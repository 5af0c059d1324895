// FP4 MoE GEMMs on wgmma: every output is the same chain of wgmma.m64nNk16 (bf16 in, fp32 sums)
// over all of K in natural order that the Triton tier's prefill tiles compute, so a routed row's
// bits do not depend on the batch, decode or prefill: batch-invariant mode's decode kernels, and
// with routing tiles of 64-128 tokens the prefill kernels.
// Compiled at run time by NVRTC; `moe.py` holds the contract and picks the constants.
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
// With K_PERMUTED (auto mode's prefill: not the prefill tiles' sums) no exchange either: thread t
// feeds its own group t's 32 values in natural order to its fragment slots, so the wgmmas run K
// permuted within each 128-value step (k16 step s, slot 8 hi + 2t + e <- value 32t + 4s + 2hi + e),
// and the caller permutes the activations' columns the same way (`moe.k_permutation`).
// The routing tile's activations reach shared memory in wgmma's K-major layout by cp.async:
// all of K before the first step (X_STAGES = 0: a decode tile of 8-16 tokens), or a ring of
// X_STAGES K steps that the whole CTA refills X_STAGES - 2 steps ahead (prefill tiles). With
// X_TMA one thread fills the ring by the tensor-memory accelerator instead, from the routed
// rows laid out in tile order (boxes of 32 rows x 64 values, 128-byte swizzle): no copy
// instructions in the other threads' K loop.
//
// Constants (-D): K_DIM (reduction length), N_DIM (weight rows per expert), GATED (1: W1 and W3
// fused with SwiGLU, MATS = 2; 0: W2, MATS sets of 64 WG rows per CTA), TOKG (8-token groups per
// routing tile: wgmma N = 8 TOKG), WG (warpgroups per CTA, sharing the activations), MIN_BLOCKS
// (CTAs per SM the register allocation must allow), DEPTH (K steps of weights loaded ahead),
// TAIL_DEPTH (the same for the tail variants, see `run`), X_STAGES (above), FRAGMENT_WEIGHTS (1:
// the weights' bytes are in fragment order, above), K_PERMUTED (1: the permuted K order, above),
// PINNED_LOADS (1: plain loads of weights and scales, which ptxas keeps ahead of the step's
// barrier; 0: non-coherent ones, which it may sink next to their use), X_TMA (above).

#include "common.cuh"

#define NB (8 * TOKG)  // tokens per routing tile (the wgmma's N)
#define KB (K_DIM / 2)  // packed bytes per weight row
#define KG (K_DIM / 32)  // scale groups per weight row
#define THREADS (128 * WG)
// W1/W3 on 4 warpgroups: W1 on warpgroups 0-1 and W3 on 2-3, so that a thread holds one
// matrix's sums (MATS = 1) and 4 warpgroups fit an SM's registers; the epilogue pairs them
#define SPLIT_GATE (GATED && WG == 4)
// Weight rows of one matrix (W1/W3) or one row set (W2) per CTA; W2 has MATS row sets
#define W_SET_ROWS (GATED ? 64 * (SPLIT_GATE ? 2 : WG) : 64 * WG)
#define ROWS_PER_CTA (GATED ? W_SET_ROWS : W_SET_ROWS * MATS)
#define STEPS (KG / 4)  // K steps of 128 values
#define X_STEP_BYTES (NB * 256)  // one K step of the tile's activations
#if X_STAGES
#define X_AHEAD (X_STAGES - 2)  // steps copied ahead: the stage of step j - 2 is free at step j
#define X_BYTES (X_STAGES * X_STEP_BYTES)
#else
#define X_BYTES (STEPS * X_STEP_BYTES)  // all of K
#endif
// With SPLIT_GATE the activations' memory then takes W3's sums to warpgroups 0-1, [8 warps][TOKG]
// [4][32 lanes] floats: the dynamic shared memory is the larger of the two (short K: the sums)
#define W3_SUM_BYTES (SPLIT_GATE ? 8 * TOKG * 4 * 32 * 4 : 0)
#define X_REGION_BYTES (X_BYTES > W3_SUM_BYTES ? X_BYTES : W3_SUM_BYTES)
#if X_TMA
#define X_ALIGN 1024  // the 128-byte swizzle's pattern repeats every 1024 bytes: stages start on it
static_assert(X_STAGES >= 3 && TOKG >= 4, "X_TMA: a ring of 32-row boxes");
#else
#define X_ALIGN 0
#endif
// With W_TMA the weights' packed bytes of each K step come through the ring too (after the
// activations' region): per stage one box of a row set's 64-byte rows per weight matrix (W1/W3:
// W1's, then W3's; W2: its row sets), each thread reading its rows from there.
#define W_SETS (GATED ? 2 : MATS)  // boxes per K step
#if W_TMA
static_assert(X_TMA, "W_TMA: the weights come with the activations' boxes");
#define W_STEP_BYTES (W_SETS * W_SET_ROWS * 64)
#else
#define W_STEP_BYTES 0
#endif
#define DYN_BYTES (X_REGION_BYTES + X_STAGES * W_STEP_BYTES + X_ALIGN)

static_assert(GATED ? MATS == (SPLIT_GATE ? 1 : 2) : (MATS == 1 || MATS == 2),
              "W1/W3: MATS 2 (1 on 4 warpgroups); W2: 1 or 2 row sets");
static_assert(WG == 1 || WG == 2 || WG == 4, "WG: 1, 2 or 4 warpgroups");
static_assert(!(FRAGMENT_WEIGHTS && K_PERMUTED), "fragment order or permuted K, not both");
#define DIRECT_WORDS (FRAGMENT_WEIGHTS || K_PERMUTED)  // each loaded word feeds the thread's slots
#if K_PERMUTED  // the scale bytes a thread loads per row and K step (see `Step`)
#define SCALE_TYPE "u8"
#else
#define SCALE_TYPE "u32"
#endif
#if PINNED_LOADS  // the weight and scale loads (see PINNED_LOADS above)
#define LOAD_WEIGHTS ldg_stream_pinned
#define LOAD_SCALE "ld.global." SCALE_TYPE
#else
#define LOAD_WEIGHTS ldg_stream
#define LOAD_SCALE "ld.global.nc." SCALE_TYPE
#endif
static_assert(X_STAGES == 0 || X_STAGES >= 3, "a ring needs 3 stages or more");
static_assert(TOKG == 1 || TOKG == 2 || TOKG == 4 || TOKG == 8 || TOKG == 16 || TOKG == 20,
              "TOKG: 1, 2, 4, 8, 16 or 20");

#if X_TMA
// wgmma's matrix descriptor of a K step's first k16 step (at shared address x_smem, 1024-byte
// aligned): K-major, 128-byte swizzle, as the TMA boxes land: [2 halves of 64 values][NB tokens]
// [128 bytes], 8-token groups 1024 bytes apart (the stride dimension).
static __device__ __forceinline__ u64 x_desc(u32 x_smem) {
  return (u64)((x_smem & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
         (1ull << 62);
}

// The descriptor of k16 step dj of the K step: 32 bytes on per k16 step within a half (the
// hardware applies the swizzle to the address), the second half NB * 128 bytes on.
static __device__ __forceinline__ u64 x_desc_add(u64 desc, int dj) {
  return desc + (((dj >> 2) * NB * 128 + (dj & 3) * 32) >> 4);
}
#else
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
#endif

// acc += A (64 x 16, this thread's fragment a) * X^T (16 x 8 TG, descriptor b): the TG token
// groups of one variant's accumulators (a tile's wgmmas cover its tokens rounded up to a
// variant, see `run`).
#define ACC4(q) "+f"(acc[q][0]), "+f"(acc[q][1]), "+f"(acc[q][2]), "+f"(acc[q][3])
template <int TG>
static __device__ __forceinline__ void wgmma_step(float (&acc)[TG][4], const u32 (&a)[4], u64 b) {
  if constexpr (TG == 1) {
    asm volatile(
        "{.reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, %8, p, 1, 1, 0;}"
        : ACC4(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  } else if constexpr (TG == 2) {
    asm volatile(
        "{.reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7}, "
        "{%8,%9,%10,%11}, %12, p, 1, 1, 0;}"
        : ACC4(0), ACC4(1)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  } else if constexpr (TG == 4) {
    asm volatile(
        "{.reg .pred p;\n setp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16,%17,%18,%19}, %20, p, 1, 1, 0;}"
        : ACC4(0), ACC4(1), ACC4(2), ACC4(3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  } else if constexpr (TG == 8) {
    asm volatile(
        "{.reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%32,%33,%34,%35}, %36, p, 1, 1, 0;}"
        : ACC4(0), ACC4(1), ACC4(2), ACC4(3),
          ACC4(4), ACC4(5), ACC4(6), ACC4(7)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  } else if constexpr (TG == 12) {
    asm volatile(
        "{.reg .pred p;\n setp.ne.b32 p, %53, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, "
        "{%48,%49,%50,%51}, %52, p, 1, 1, 0;}"
        : ACC4(0), ACC4(1), ACC4(2), ACC4(3),
          ACC4(4), ACC4(5), ACC4(6), ACC4(7),
          ACC4(8), ACC4(9), ACC4(10), ACC4(11)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  } else if constexpr (TG == 16) {
    asm volatile(
        "{.reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64,%65,%66,%67}, %68, p, 1, 1, 0;}"
        : ACC4(0), ACC4(1), ACC4(2), ACC4(3),
          ACC4(4), ACC4(5), ACC4(6), ACC4(7),
          ACC4(8), ACC4(9), ACC4(10), ACC4(11),
          ACC4(12), ACC4(13), ACC4(14), ACC4(15)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  } else if constexpr (TG == 20) {
    asm volatile(
        "{.reg .pred p;\n setp.ne.b32 p, %85, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79}, "
        "{%80,%81,%82,%83}, %84, p, 1, 1, 0;}"
        : ACC4(0), ACC4(1), ACC4(2), ACC4(3),
          ACC4(4), ACC4(5), ACC4(6), ACC4(7),
          ACC4(8), ACC4(9), ACC4(10), ACC4(11),
          ACC4(12), ACC4(13), ACC4(14), ACC4(15),
          ACC4(16), ACC4(17), ACC4(18), ACC4(19)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  } else {
    static_assert(TG != TG, "TG must be 1, 2, 4, 8, 12, 16 or 20");
  }
}
#undef ACC4

// One K step (4 scale groups, 128 values) of one thread: for each matrix and row half (rows g,
// g + 8) the 16 packed bytes of group t (the quad loads the row's 64 bytes, each byte once) and
// the 4 groups' scale bytes (one word, the same in the whole quad; with K_PERMUTED the scale
// byte of the thread's own group t only, which spares a register for the byte's selector).
struct Step {
#if !W_TMA
  u32 w[MATS][2][4];
#endif
  u32 s[MATS][2];
};

#if !DIRECT_WORDS
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
#endif

// `scale_pair` of byte c of a word of 4 UE8M0 scale bytes that each had 126 added (no carry
// for bytes up to 128, the range scale_pair is finite for): the byte into bits 8..15 and 24..31
// by one prmt, then one shift to bits 7..14 and 23..30.
static __device__ __forceinline__ u32 scale_pair_of(u32 sw126, int c) {
  u32 b;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(b) : "r"(sw126), "r"(0x0404 | (0x1010 * c)));
  return b >> 1;
}

#if !X_TMA
#define X_COPIES ((16 * NB + THREADS - 1) / THREADS)  // 16-byte copies per thread and K step

// Token n's row of the activations as `copy_x_step` reads it: the row's address, with bit 0 set
// for no row (zeros; the address is then x's first row). Rows are 16-byte aligned.
static __device__ __forceinline__ u64 x_row_source(const u8* x, int row) {
  return row >= 0 ? (u64)(x + (u64)row * K_DIM * 2) : (u64)x | 1ull;
}

// Start the copies of K step j of the tile's activations into the stage at shared address
// `stage`, [16 chunks of 8 values][NB tokens][8 values] (wgmma's K-major core matrices): token n
// < cols from srcs[n] (`x_row_source`); the wgmmas read no more.
// This thread's copies first..end-1 of the step's X_COPIES (a ring step spreads them out).
// Lanes 8c..8c+7 copy chunk c of 8 tokens: each 8-lane phase of the shared-memory stores covers
// 128 bytes (no bank conflict), and each token's 64 bytes come from 4 lanes (whole sectors).
static __device__ __forceinline__ void copy_x_step(u32 stage, const u64* srcs, int cols, int j,
                                                   int first = 0, int end = X_COPIES) {
#pragma unroll
  for (int c = first; c < end; ++c) {
    const int i = threadIdx.x + c * THREADS;
    if (X_COPIES * THREADS > 16 * NB && i >= 16 * NB) break;
    const int octet = i >> 5;
    const int n = (i & 7) + 8 * (octet % (NB / 8));
    const int kb = ((i >> 3) & 3) + 4 * (octet / (NB / 8));
    if (n >= cols) continue;
    const u64 src = srcs[n];
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(stage + (kb * NB + n) * 16),
                 "l"((src & ~1ull) + j * 256 + kb * 16), "r"(src & 1 ? 0 : 16)
                 : "memory");
  }
}
#endif

// The shared address of K step j's stage.
static __device__ __forceinline__ u32 x_stage(u32 x_base, int j) {
#if X_STAGES
  j %= X_STAGES;
#endif
  return x_base + j * X_STEP_BYTES;
}

// The thread's K stream (see `ring_loop`): w[m], s[m] at the current step of row g of weight
// row set m (row g + 8 is a compile-time offset); the activations come through the stages (all
// of K or the ring, above), tokens 0..cols-1.
struct StreamState {
  const u8* w[MATS];
  const u8* s[MATS];
  const u64* srcs;  // the tile's token rows (shared memory; `x_row_source`)
  u32 x_base;       // the stages (shared address)
  u32 scratch;      // this warp's scratch (shared address; unused with DIRECT_WORDS)
  int cols;         // the tokens the wgmmas cover: 8 TG of the variant that runs
  int g, t;
  int step = 0;
#if X_TMA
  const TensorMap* xmap;  // the routed rows [rows, K_DIM] bf16, tile order
  int x_row;              // the tile's first row there
  u64* x_full;            // per stage: its boxes have landed
#if W_TMA
  const TensorMap* wmap[W_SETS];  // the weight matrices' rows [E N, K / 2] (W2: one map twice)
  int w_y[W_SETS];                // each row set's first row there
  int w_row[MATS];                // the thread's row g of set m in a stage's weights
#endif

  // (one thread) K step j's 2 x cols / 32 boxes into its stage (with W_TMA and its weight
  // boxes), counted on its barrier.
  __device__ __forceinline__ void issue_x(int j) const {
    const int s = j % X_STAGES;
    mbar_expect(&x_full[s], cols * 256 + W_STEP_BYTES);
    const u32 stage = x_stage(x_base, j);
    for (int b = 0; b < 2 * (cols / 32); ++b)
      tma_box(stage + (b & 1) * NB * 128 + (b >> 1) * 4096, xmap, j * 256 + (b & 1) * 128,
              x_row + 32 * (b >> 1), &x_full[s]);
#if W_TMA
#pragma unroll
    for (int m = 0; m < W_SETS; ++m)
      tma_box(w_stage(j) + m * W_SET_ROWS * 64, wmap[m], j * 64, w_y[m], &x_full[s]);
#endif
  }
#endif
#if W_TMA
  // The shared address of K step j's weight boxes (past the activations' region).
  __device__ __forceinline__ u32 w_stage(int j) const {
    return x_base + X_REGION_BYTES + (j % X_STAGES) * W_STEP_BYTES;
  }
#endif
};

// The K loop of the variant whose wgmmas cover TG 8-token groups. acc[m][q]: set m's sums,
// token group q (element c: row g + 8 (c >> 1), token 8q + 2t + (c & 1)); a variant's own, zeroed
// right before its loop: accumulators that other code defines between the wgmmas (one array
// shared by the variants, zeroed before the branch) make ptxas serialize them (C7515).
template <int TG>
struct Stream : StreamState {
  typedef ::Step Step;
  float acc[MATS][TG][4];

  __device__ __forceinline__ explicit Stream(const StreamState& st) : StreamState(st) {
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int q = 0; q < TG; ++q)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][q][c] = 0.f;
  }

  __device__ __forceinline__ bool valid(int j) const { return j < STEPS; }

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
#if !W_TMA
          LOAD_WEIGHTS(st.w[m][h], w[m] + 8 * h * KB);
#endif
          asm volatile(LOAD_SCALE " %0, [%1];" : "=r"(st.s[m][h]) : "l"(s[m] + 8 * h * KG));
        } else {
#if !W_TMA
          st.w[m][h][0] = st.w[m][h][1] = st.w[m][h][2] = st.w[m][h][3] = 0u;
#endif
          st.s[m][h] = 0u;
        }
      }
  }

  __device__ __forceinline__ void compute(const Step& st) {
#if X_TMA
    // this step's boxes have landed; past the barrier every warpgroup has waited for its wgmmas
    // of step - 2, so that stage takes step + X_AHEAD: its boxes go out here (one thread; not
    // between this step's wgmmas, where ptxas would serialize them: C7513)
    mbar_wait(&x_full[step % X_STAGES], (step / X_STAGES) & 1);
    __syncthreads();
    if (threadIdx.x == 0 && step + X_AHEAD < STEPS) issue_x(step + X_AHEAD);
#elif X_STAGES
    // this step's copies (X_AHEAD - 1 later groups may be in flight), visible to wgmma (the
    // async proxy) in every thread's; past the barrier every warpgroup has waited for its
    // wgmmas of step - 2, so that stage takes step + X_AHEAD: its copies go out a quarter per
    // scale group below, one cp.async group (empty past the end)
    asm volatile("cp.async.wait_group %0;\n fence.proxy.async.shared::cta;" ::"n"(X_AHEAD - 1)
                 : "memory");
    __syncthreads();
    const bool refill = step + X_AHEAD < STEPS;
    const u32 refill_stage = x_stage(x_base, step + X_AHEAD);
#else
    if (step == 0) {
      // all of K's copies, then visible to wgmma (the async proxy)
      asm volatile("cp.async.wait_all;\n fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
    }
#endif
    const u64 desc = x_desc(x_stage(x_base, step));
#if W_TMA
    u32 words[MATS][2][4];  // this step's packed bytes of rows g, g + 8 of each set, from its stage
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(words[m][h][0]), "=r"(words[m][h][1]), "=r"(words[m][h][2]),
                       "=r"(words[m][h][3])
                     : "r"(w_stage(step) + (w_row[m] + 8 * h) * 64 + 16 * t));
#else
    const u32(&words)[MATS][2][4] = st.w;
#endif
#if !DIRECT_WORDS
    __syncwarp();  // the last step's scratch reads are done
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        u32 tw[4];
        transpose_bytes(words[m][h], tw);
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
#if X_STAGES && !X_TMA
      if (refill)
        copy_x_step(refill_stage, srcs, cols, step + X_AHEAD, c * X_COPIES / 4,
                    (c + 1) * X_COPIES / 4);
      if (c == 3) asm volatile("cp.async.commit_group;" ::: "memory");
#endif
      u32 a[MATS][2][4];  // [matrix][k16 step][fragment]
#pragma unroll
      for (int m = 0; m < MATS; ++m) {
        u32 lo[4], hi[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#if DIRECT_WORDS
          const u32 mine = words[m][h][c];  // bytes t, 4+t, 8+t, 12+t of group c (K_PERMUTED:
                                           // bytes 4c..4c+3 of group t)
#else
          u32 mine;  // bytes t, 4+t, 8+t, 12+t of the group
          asm volatile("ld.shared.u32 %0, [%1];"
                       : "=r"(mine)
                       : "r"(scratch_at(scratch, m, h, g, c) + 4 * t));
#endif
          expand8(mine, scale_pair_of(sw[m][h], K_PERMUTED ? 0 : c), h == 0 ? lo : hi);
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
          wgmma_step<TG>(acc[m], a[m][k], x_desc_add(desc, 2 * c + k));
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(WGMMA_GROUPS - 1) : "memory");
    }
    ++step;
  }
};

// The stream's per-warp byte-exchange scratch (none with DIRECT_WORDS: nothing to exchange).
static __device__ __forceinline__ void give_scratch(StreamState& st, int warp) {
#if !DIRECT_WORDS
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

// Fill the tile's row table (token n: row row_of(n) of x, n < count; else none), pick the variant
// (from 64-token tiles: the tokens rounded up to 32, so a tail tile does not pay for a full
// one), start the copies of the first K steps (all of K, or the ring's first X_AHEAD, one
// cp.async group each) and aim the stream at them.
template <typename RowOf>
static __device__ __forceinline__ void start(StreamState& st, const Place& p, u8* x_smem,
                                             u64* srcs, const u8* x, RowOf row_of) {
  for (int n = threadIdx.x; n < NB; n += THREADS)
    srcs[n] = x_row_source(x, n < p.count ? row_of(n) : -1);
  __syncthreads();
  st.srcs = srcs;
  st.x_base = (u32)__cvta_generic_to_shared(x_smem);
  st.cols = TOKG >= 8 ? min(NB, (p.count + 31) / 32 * 32) : NB;
#if X_STAGES
#pragma unroll
  for (int j = 0; j < X_AHEAD; ++j) {
    if (j < STEPS) copy_x_step(x_stage(st.x_base, j), srcs, st.cols, j);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
#else
  for (int j = 0; j < STEPS; ++j) copy_x_step(x_stage(st.x_base, j), srcs, st.cols, j);
#endif
  st.g = p.g;
  st.t = p.t;
}

#if X_TMA
// `start` for the TMA ring: the tile's tokens are rows x_row.. of xmap; the stage barriers,
// then the first X_AHEAD steps' boxes.
static __device__ __forceinline__ void start_tma(StreamState& st, const Place& p, u8* x_smem,
                                                 const TensorMap* xmap, int x_row) {
  __shared__ __align__(8) u64 full[X_STAGES];
  if (threadIdx.x == 0) {
    for (int s = 0; s < X_STAGES; ++s) mbar_init(&full[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  st.x_full = full;
  st.xmap = xmap;
  st.x_row = x_row;
  st.x_base = (smem_u32(x_smem) + X_ALIGN - 1) & ~(u32)(X_ALIGN - 1);
  st.cols = min(NB, (p.count + 31) / 32 * 32);
  if (threadIdx.x == 0)
    for (int j = 0; j < X_AHEAD && j < STEPS; ++j) st.issue_x(j);
  st.g = p.g;
  st.t = p.t;
}
#endif

// The stream's weight and scale pointers for row set m (w, s: its [E, N, K/2] and [E, N, K/32]),
// whose warp's 16 rows start `warp_row` rows past the CTA's first, and `w_row` rows into a
// stage's weight boxes (W_TMA).
static __device__ __forceinline__ void aim(StreamState& st, int m, const Place& p, const u8* w,
                                           const u8* s, int warp_row, int w_row) {
  const u64 row = (u64)p.expert * N_DIM + p.row0 + warp_row + p.g;
  st.w[m] = w + row * KB + 16 * p.t;
  st.s[m] = s + row * KG + (K_PERMUTED ? p.t : 0);
#if W_TMA
  st.w_row[m] = w_row + p.g;
#endif
}

// acc[m][q]: the sums (as in `Stream`) of the variant that covers TG token groups; zeros past.
// A tail variant (at most half the tile) loads TAIL_DEPTH steps ahead: its steps are shorter.
template <int TG>
static __device__ __forceinline__ void run_variant(const StreamState& state,
                                                   float (&acc)[MATS][TOKG][4]) {
  static_assert(TG <= TOKG, "a variant covers at most the tile's tokens");
  Stream<TG> st(state);
  ring_loop<(2 * TG <= TOKG ? TAIL_DEPTH : DEPTH)>(st, STEPS);
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
  for (int m = 0; m < MATS; ++m)
#pragma unroll
    for (int q = 0; q < TOKG; ++q)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[m][q][c] = q < TG ? st.acc[m][q][c] : 0.f;
}

// The K loop of the variant that covers the tile's `cols` tokens (a uniform branch per CTA).
static __device__ __forceinline__ void run(const StreamState& st, float (&acc)[MATS][TOKG][4]) {
  if constexpr (TOKG < 8) {
    run_variant<TOKG>(st, acc);
  } else if (st.cols <= 32) {
    run_variant<4>(st, acc);
  } else if (TOKG == 8 || st.cols <= 64) {
    run_variant<8>(st, acc);
  } else if constexpr (TOKG >= 16) {
    if (st.cols <= 96)
      run_variant<12>(st, acc);
    else if (TOKG == 16 || st.cols <= 128)
      run_variant<16>(st, acc);
    else if constexpr (TOKG == 20)
      run_variant<20>(st, acc);
  }
}

#if GATED

// The column of h that W1/W3's output row `row` goes to: the row itself, or with K_PERMUTED the
// place W2's permuted K order reads it from (value 32t + 4s + 2hi + e of a 128-value step sits in
// slot 16s + 8hi + 2t + e), so that W2 reads h as it is.
static __device__ __forceinline__ int h_column(int row) {
#if K_PERMUTED
  const int v = row & 127;
  return row - v + 16 * ((v >> 2) & 7) + 8 * ((v >> 1) & 1) + 2 * (v >> 5) + (v & 1);
#else
  return row;
#endif
}

// h = quant_dequant_fp8(swiglu(x W1^T, x W3^T) * weight) per 32 columns, as bf16: the W2 input.
// Grid: (N_DIM / ROWS_PER_CTA, routing tiles); block THREADS; DYN_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
moe_w13(
#if X_TMA
        // the routed rows xa[sorted_token] [P, K_DIM] in tile order (xa, sorted_token unused)
        const __grid_constant__ TensorMap x_map,
#endif
#if W_TMA
        // w1's and w3's rows [E N, K / 2] (w1, w3 unused)
        const __grid_constant__ TensorMap w1_map, const __grid_constant__ TensorMap w3_map,
#endif
        const u8* __restrict__ xa,  // [T, K_DIM] bf16: FP8 activations expanded exactly
        const u8* __restrict__ w1, const u8* __restrict__ s1,  // [E, N, K/2], [E, N, K/32]
        const u8* __restrict__ w3, const u8* __restrict__ s3,
        const int* __restrict__ sorted_token,     // [P]
        const float* __restrict__ sorted_weight,  // [P]
        const int* __restrict__ tiles,            // [tiles, 3]: expert or -1, first row, end
        u16* __restrict__ h,                      // [P, N_DIM] bf16
        float limit, float amax_floor) {
  extern __shared__ __align__(128) u8 x_tile[];
#if !X_TMA
  __shared__ __align__(128) u64 srcs[NB];
#endif
  __shared__ float half_amax[4 * WG][NB];  // each warp's amax per token over its 16 rows
  const Place p = place(tiles);
  if (p.expert < 0) return;
  float acc[MATS][TOKG][4];
  StreamState st;
  give_scratch(st, p.warp);
#if W_TMA
  st.wmap[0] = &w1_map;
  st.wmap[1] = &w3_map;
  st.w_y[0] = st.w_y[1] = p.expert * N_DIM + p.row0;
#endif
#if X_TMA
  start_tma(st, p, x_tile, &x_map, p.first);
#else
  start(st, p, x_tile, srcs, xa, [&](int n) { return sorted_token[p.first + n]; });
#endif
#if SPLIT_GATE
  const bool up_half = p.warp >= 8;  // warpgroups 2-3: W3
  const int warp_row = 16 * (p.warp & 7);
  aim(st, 0, p, up_half ? w3 : w1, up_half ? s3 : s1, warp_row,
      (up_half ? W_SET_ROWS : 0) + warp_row);
  run(st, acc);
  // W3's sums to warpgroups 0-1 through the activations' memory (every wgmma is done past the
  // barrier)
  float* up = reinterpret_cast<float*>(x_tile);  // [warp - 8][q][c][lane]: W3_SUM_BYTES
  __syncthreads();
  if (up_half)
#pragma unroll
    for (int q = 0; q < TOKG; ++q)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        up[(((p.warp - 8) * TOKG + q) * 4 + c) * 32 + p.lane] = acc[0][q][c];
  __syncthreads();
  const auto up_at = [&](int q, int c) {
    return up_half ? 0.f : up[((p.warp * TOKG + q) * 4 + c) * 32 + p.lane];
  };
#else
  const bool up_half = false;
  const int warp_row = 16 * p.warp;
  aim(st, 0, p, w1, s1, warp_row, warp_row);
  aim(st, 1, p, w3, s3, warp_row, W_SET_ROWS + warp_row);
  run(st, acc);
  const auto up_at = [&](int q, int c) { return acc[1][q][c]; };
#endif

  // An h group is 32 rows: this warp's 16 and its partner's (warp ^ 1). (With SPLIT_GATE
  // warpgroups 2-3 go along for the barrier and store nothing.)
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
        v[q][c1][r] = swiglu_weighted(acc[0][q][2 * r + c1], up_at(q, 2 * r + c1), rw, limit);
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
      if (n >= p.count || up_half) continue;
      const float amax = fmaxf(half_amax[p.warp][n], half_amax[p.warp ^ 1][n]);
      const Fp8Scale sc = fp8_scale(fmaxf(amax, amax_floor));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = p.row0 + warp_row + p.g + 8 * r;
        h[(u64)(p.first + n) * N_DIM + h_column(row)] = fp8_round_trip(v[q][c1][r], sc);
      }
    }
}

#else

// y = h W2^T per routed row, rounded to bf16. Grid: (N_DIM / ROWS_PER_CTA, routing tiles); block
// THREADS; DYN_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
moe_w2(
#if X_TMA
       const __grid_constant__ TensorMap x_map,  // h's rows (h unused)
#endif
#if W_TMA
       const __grid_constant__ TensorMap w2_map,  // w2's rows [E N, K / 2] (w2 unused)
#endif
       const u8* __restrict__ h,                              // [P, K_DIM] bf16
       const u8* __restrict__ w2, const u8* __restrict__ s2,  // [E, N, K/2], [E, N, K/32]
       const int* __restrict__ tiles,                         // [tiles, 3]
       u16* __restrict__ y) {                                 // [P, N_DIM] bf16
  extern __shared__ __align__(128) u8 x_tile[];
#if !X_TMA
  __shared__ __align__(128) u64 srcs[NB];
#endif
  const Place p = place(tiles);
  if (p.expert < 0) return;
  float acc[MATS][TOKG][4];
  StreamState st;
  give_scratch(st, p.warp);
#if W_TMA
#pragma unroll
  for (int m = 0; m < MATS; ++m) {
    st.wmap[m] = &w2_map;
    st.w_y[m] = p.expert * N_DIM + p.row0 + m * W_SET_ROWS;
  }
#endif
#if X_TMA
  start_tma(st, p, x_tile, &x_map, p.first);
#else
  start(st, p, x_tile, srcs, h, [&](int n) { return p.first + n; });
#endif
#pragma unroll
  for (int m = 0; m < MATS; ++m) {
    const int warp_row = m * W_SET_ROWS + 16 * p.warp;
    aim(st, m, p, w2, s2, warp_row, warp_row);
  }
  run(st, acc);
#pragma unroll
  for (int m = 0; m < MATS; ++m)
#pragma unroll
    for (int q = 0; q < TOKG; ++q)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = 8 * q + 2 * p.t + (c & 1);
        if (n < p.count) {
          const int row = p.row0 + m * W_SET_ROWS + 16 * p.warp + p.g + 8 * (c >> 1);
          y[(u64)(p.first + n) * N_DIM + row] = bf16_bits(acc[m][q][c]);
        }
      }
}

#endif
