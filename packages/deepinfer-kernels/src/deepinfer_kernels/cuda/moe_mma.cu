// FP4 MoE decode GEMMs on mma.sync (m16n8k16, bf16 in, fp32 sums), compiled at run time by NVRTC
// (`moe.py` holds the contract and picks the constants below).
//
// Why this shape: at decode an expert sees a handful of tokens, so the GEMM streams FP4 weights
// once and the cost is the instructions spent per weight byte. Each thread takes 16 packed bytes
// (32 values = exactly one UE8M0 scale group) of a weight row into registers (straight from
// global memory, `run`, or from the stages the TMA fills, `run_tma`), expands them to bf16 there
// and feeds them to mma.sync as the A fragment: no CTA barrier in the K loop. The mma's K order
// is free as long as A and B agree, so thread (g, t) of a warp takes K group `4i + t` for both
// its weight rows and its tokens' activations: pair p (0..15) of its 32 values feeds mma p/2 as
// the (2t, 2t+1) or (2t+8, 2t+9) slot, and the activations' 32 bf16 are read in the same natural
// order (4 x 16 bytes).
//
// Constants (-D): K_DIM (reduction length), N_DIM (weight rows per expert), MATS (1: W2; 2: W1
// and W3 fused with SwiGLU), RT (16-row A tiles per matrix per warp), TOKG (8-token groups per
// routing tile), SPLIT (warps of a CTA, each a contiguous share of K; summed in warp order),
// MIN_BLOCKS (CTAs per SM the register allocation must allow), DEPTH (K steps loaded ahead),
// TMA (1: the weights come through shared memory as tensor-map boxes, `run_tma`; DEPTH is
// then its stages per warp).

#include "common.cuh"

#define NA (MATS * RT)          // A tiles (16 weight rows each) per warp
#define KB (K_DIM / 2)          // packed bytes per weight row
#define KG (K_DIM / 32)         // scale groups per weight row
#define ROWS_PER_CTA (16 * RT)  // weight rows of each matrix per CTA

static __device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                                u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One K step's operands of one warp: for each A tile and row half (rows g, g + 8) 16 packed
// bytes and their scale byte; for each token group 32 bf16 activations (16 pairs).
struct Step {
  u32 w[NA][2][4];
  u32 s[NA][2];
  u32 x[TOKG][16];
};

// One A tile's K step: w (rows g, g + 8: 16 packed bytes each), their scale bytes s, the token
// groups' activations x -> acc[q] += the 8 mmas' products, word by word.
static __device__ __forceinline__ void compute_tile(const u32 (&w)[2][4], const u32 (&s)[2],
                                                    const u32 (&x)[TOKG][16],
                                                    float (&acc)[TOKG][4]) {
  const u32 sp0 = scale_pair(s[0]);
  const u32 sp1 = scale_pair(s[1]);
#pragma unroll
  for (int wd = 0; wd < 4; ++wd) {  // word wd: pairs 4wd..4wd+3, mmas 2wd and 2wd+1
    u32 lo[4], hi[4];
    expand8(w[0][wd], sp0, lo);
    expand8(w[1][wd], sp1, hi);
#pragma unroll
    for (int q = 0; q < TOKG; ++q) {
      mma16816(acc[q], lo[0], hi[0], lo[1], hi[1], x[q][4 * wd], x[q][4 * wd + 1]);
      mma16816(acc[q], lo[2], hi[2], lo[3], hi[3], x[q][4 * wd + 2], x[q][4 * wd + 3]);
    }
  }
}

static __device__ __forceinline__ void compute_step(const Step& st, float (&acc)[NA][TOKG][4]) {
#pragma unroll
  for (int a = 0; a < NA; ++a) compute_tile(st.w[a], st.s[a], st.x, acc[a]);
}

// A warp's K stream (see `ring_loop`): w[m] and s[m] at the thread's current K group in row g of
// matrix m's first A tile (the other rows are compile-time offsets from it), x[q] at its group
// in the activations of token 8q + g (has_x[q] false: no such token, zeros); each step is 4
// groups (the quad's 4 threads take one each); `mine` counts the warp's groups from the
// thread's first.
struct Stream {
  typedef ::Step Step;
  const u8* w[MATS];
  const u8* s[MATS];
  const u8* x[TOKG];
  bool has_x[TOKG];
  int mine;
  float (&acc)[NA][TOKG][4];

  __device__ __forceinline__ Stream(float (&acc_)[NA][TOKG][4]) : acc(acc_) {}

  __device__ __forceinline__ bool valid(int step) const { return 4 * step < mine; }

  __device__ __forceinline__ void advance() {
#pragma unroll
    for (int m = 0; m < MATS; ++m) {
      w[m] += 64;
      s[m] += 4;
    }
#pragma unroll
    for (int q = 0; q < TOKG; ++q) x[q] += 256;
  }

  __device__ __forceinline__ void load(Step& st, bool ok) const {
#pragma unroll
    for (int a = 0; a < NA; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * (a % RT) + 8 * h;  // rows below the cursor's row
        if (ok) {
          ldg_stream(st.w[a][h], w[a / RT] + row * KB);
          st.s[a][h] = ldg_u8(s[a / RT] + row * KG);
        } else {
          st.w[a][h][0] = st.w[a][h][1] = st.w[a][h][2] = st.w[a][h][3] = 0u;
          st.s[a][h] = 0u;
        }
      }
    }
#pragma unroll
    for (int q = 0; q < TOKG; ++q) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        u32 r[4] = {0u, 0u, 0u, 0u};
        if (ok && has_x[q]) ldg_shared(r, x[q] + v * 16);
#pragma unroll
        for (int j = 0; j < 4; ++j) st.x[q][4 * v + j] = r[j];
      }
    }
  }

  __device__ __forceinline__ void compute(const Step& st) { compute_step(st, acc); }
};

// Where a CTA's warp stands: its routing tile and lane roles (t: the K group), its share of
// the K groups, the CTA's first weight row and the thread's global weight row.
struct Place : TilePlace {
  int g_begin, g_end;
  int row0;
  u64 row;
};

static __device__ __forceinline__ Place place(const int* tiles) {
  Place p;
  static_cast<TilePlace&>(p) = tile_place(tiles, 8 * TOKG);
  p.g_begin = p.warp * KG / SPLIT;
  p.g_end = (p.warp + 1) * KG / SPLIT;
  p.row0 = blockIdx.x * ROWS_PER_CTA;
  p.row = (u64)p.expert * N_DIM + p.row0 + p.g;
  return p;
}

// The stream's weight and scale pointers for matrix m (w, s: its [E, N, K/2] and [E, N, K/32]).
static __device__ __forceinline__ void aim(Stream& st, int m, const Place& p, const u8* w,
                                           const u8* s) {
  st.w[m] = w + p.row * KB + (p.g_begin + p.t) * 16;
  st.s[m] = s + p.row * KG + p.g_begin + p.t;
  st.mine = p.g_end - p.g_begin - p.t;  // groups t, t + 4, ... below this are the thread's
}

// The stream's activation pointers: token column n (8q + g) reads row row_of(n) of x [rows,
// K_DIM] bf16 (n past the tile's rows: none, zeros).
template <typename RowOf>
static __device__ __forceinline__ void aim_x(Stream& st, const Place& p, const u8* x,
                                             RowOf row_of) {
#pragma unroll
  for (int q = 0; q < TOKG; ++q) {
    const int n = 8 * q + p.g;
    st.has_x[q] = n < p.count;
    const u64 row = st.has_x[q] ? row_of(n) : 0;
    st.x[q] = x + (row * K_DIM + (p.g_begin + p.t) * 32) * 2;
  }
}

// The warp's K loop (its groups [g_begin, g_end)) and the CTA's warp-order sum into warp 0.
static __device__ __forceinline__ void run(Stream& st, const Place& p) {
  ring_loop<DEPTH>(st, (p.g_end - p.g_begin + 3) / 4);
  __shared__ float part[SPLIT > 1 ? SPLIT - 1 : 1][NA * TOKG * 4 * 32];
  reduce_warps<NA, TOKG, SPLIT>(st.acc, p.warp, p.lane, [&](int w) { return part[w - 1]; });
}

#if TMA
// The K loop fed by the tensor-memory accelerator (the default): the same products in the same
// order per sum as `run` (same K split, each K step's four A tiles in turn), but the weights reach
// shared memory as 2-D boxes (each matrix's ROWS_PER_CTA rows x one 64-byte K step of the
// warp's share) that one lane asks for DEPTH steps ahead, so the bytes in flight cost no
// registers; each token's slice of the step (4 groups of bf16) comes with them by a bulk copy,
// and the CTA's scale rows once. Dynamic shared memory, in this order: scales
// [MATS][ROWS_PER_CTA][KG] (128-byte padded); per warp DEPTH stages of STAGE_SMEM weight bytes
// ([MATS * ROWS_PER_CTA rows][64 B]: rows g and g + 1 fall in different bank halves) then x_cap
// token slices of XSTEP bytes. Keeping only the steps in flight, not the warp's whole K share of
// the tokens, lets 4 W1/W3 CTAs share an SM at 2-4 tokens.
#define STAGE_SMEM (MATS * ROWS_PER_CTA * 64)
#define XSTEP (4 * 64)  // a token's 4 groups of a K step, bf16
#define SCALE_SMEM ((MATS * ROWS_PER_CTA * KG + 127) / 128 * 128)

static __device__ __forceinline__ void lds128(u32 (&r)[4], const u8* p) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

// maps[m], s[m]: matrix m's packed weights (a map of its [E * N, K/2] bytes, box 64 B x
// ROWS_PER_CTA rows) and [E, N, K/32] scales; x: the activation rows [rows, K_DIM] bf16, token
// column n (< p.count <= x_cap) at row row_of(n).
template <typename RowOf>
static __device__ __forceinline__ void run_tma(float (&acc)[NA][TOKG][4], const Place& p,
                                               const TensorMap* const (&maps)[MATS],
                                               const u8* const (&s)[MATS], const u8* x,
                                               RowOf row_of, int x_cap) {
  extern __shared__ __align__(128) u8 smem[];
  __shared__ __align__(8) u64 stage_bar[SPLIT][DEPTH];
  __shared__ __align__(8) u64 scale_bar;
  const int stage_bytes = STAGE_SMEM + x_cap * XSTEP;
  const u8* scales = smem;
  u8* ring = smem + SCALE_SMEM + p.warp * DEPTH * stage_bytes;
  u64* full = stage_bar[p.warp];
  const int groups = p.g_end - p.g_begin;
  const int steps = (groups + 3) / 4;
  if (p.lane == 0) {
    for (int d = 0; d < DEPTH; ++d) mbar_init(&full[d]);
    if (p.warp == 0) mbar_init(&scale_bar);
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  // step i: the weight boxes into stage i % DEPTH (their bytes past the share, or past the row:
  // unused), counting the tokens' slices that `issue_x` adds
  auto xbytes = [&](int i) { return (groups - 4 * i < 4 ? groups - 4 * i : 4) * 64; };
  auto issue_w = [&](int i) {
    u64* bar = &full[i % DEPTH];
    __syncwarp();  // the stage's previous readers are done
    if (p.lane == 0) {
      mbar_expect(bar, STAGE_SMEM + p.count * xbytes(i));
#pragma unroll
      for (int m = 0; m < MATS; ++m)
        tma_box(smem_u32(ring + (i % DEPTH) * stage_bytes + m * ROWS_PER_CTA * 64), maps[m],
                (p.g_begin + 4 * i) * 16, p.expert * N_DIM + p.row0, bar);
    }
    __syncwarp();  // the expectation first
  };
  const u8* xrow = x;  // lane n < count: its token's row at the warp's first group
  auto issue_x = [&](int i) {
    if (p.lane < p.count)
      bulk_copy(ring + (i % DEPTH) * stage_bytes + STAGE_SMEM + p.lane * XSTEP, xrow + i * XSTEP,
                xbytes(i), &full[i % DEPTH]);
  };
  for (int i = 0; i < DEPTH && i < steps; ++i) issue_w(i);
  if (threadIdx.x == 0) {
    mbar_expect(&scale_bar, MATS * ROWS_PER_CTA * KG);
#pragma unroll
    for (int m = 0; m < MATS; ++m)
      bulk_copy(smem + m * ROWS_PER_CTA * KG, s[m] + ((u64)p.expert * N_DIM + p.row0) * KG,
                ROWS_PER_CTA * KG, &scale_bar);
  }
  // W2 runs as a programmatic dependent of W1/W3 (moe.py): everything above (barriers,
  // the first weight stages, the scales) overlaps W1/W3's last CTAs; the activations (h) are
  // W1/W3's output. For W1/W3 (a plain launch) the wait returns at once.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (p.lane < p.count) xrow = x + ((u64)row_of(p.lane) * K_DIM + p.g_begin * 32) * 2;
  for (int i = 0; i < DEPTH && i < steps; ++i) issue_x(i);
  mbar_wait(&scale_bar, 0);
  for (int i = 0; i < steps; ++i) {
    mbar_wait(&full[i % DEPTH], (i / DEPTH) & 1);
    const u8* stage = ring + (i % DEPTH) * stage_bytes;
    const int grp = 4 * i + p.t;  // the thread's group in the warp's share
    const bool ok = grp < groups;
    u32 xv[TOKG][16];
#pragma unroll
    for (int q = 0; q < TOKG; ++q) {
      const int n = 8 * q + p.g;
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        u32 r[4] = {0u, 0u, 0u, 0u};
        if (ok && n < p.count) lds128(r, stage + STAGE_SMEM + n * XSTEP + p.t * 64 + v * 16);
#pragma unroll
        for (int e = 0; e < 4; ++e) xv[q][4 * v + e] = r[e];
      }
    }
    u32 wv[NA][2][4], sv[NA][2];
#pragma unroll
    for (int a = 0; a < NA; ++a) {
      const int row = 16 * a + p.g;  // stage row (matrix a / RT's rows follow the previous's)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (ok) {
          lds128(wv[a][h], stage + (row + 8 * h) * 64 + p.t * 16);
          sv[a][h] = scales[(row + 8 * h) * KG + p.g_begin + grp];
        } else {
          wv[a][h][0] = wv[a][h][1] = wv[a][h][2] = wv[a][h][3] = 0u;
          sv[a][h] = 0u;
        }
      }
    }
#pragma unroll
    for (int a = 0; a < NA; ++a) compute_tile(wv[a], sv[a], xv, acc[a]);
    if (i + DEPTH < steps) {
      issue_w(i + DEPTH);
      issue_x(i + DEPTH);
    }
  }
  // the warp-order sum through each warp's own stages, idle now (no static buffer)
  reduce_warps<NA, TOKG, SPLIT>(acc, p.warp, p.lane, [&](int w) {
    return reinterpret_cast<float*>(smem + SCALE_SMEM + w * DEPTH * stage_bytes);
  });
}
#endif

#if MATS == 2

// h = quant_dequant_fp8(swiglu(x W1^T, x W3^T) * weight) per 32 columns, as bf16: the W2 input.
// Grid: (N_DIM / ROWS_PER_CTA, routing tiles); block SPLIT warps.
extern "C" __global__ void __launch_bounds__(SPLIT * 32, MIN_BLOCKS)
moe_w13(
#if TMA
        const __grid_constant__ TensorMap map1, const __grid_constant__ TensorMap map3,
#endif
        const u8* __restrict__ xa,  // [T, K_DIM] bf16: FP8 activations expanded exactly
        const u8* __restrict__ w1, const u8* __restrict__ s1,  // [E, N, K/2], [E, N, K/32]
        const u8* __restrict__ w3, const u8* __restrict__ s3,
        const int* __restrict__ sorted_token,     // [P]
        const float* __restrict__ sorted_weight,  // [P]
        const int* __restrict__ tiles,            // [tiles, 3]: expert or -1, first row, end
        u16* __restrict__ h,                      // [P, N_DIM] bf16
        float limit, float amax_floor
#if TMA
        , int x_cap  // token rows the shared memory holds (>= every tile's count)
#endif
) {
  const Place p = place(tiles);
#if TMA
  // W2 (a programmatic dependent launch) may start its prologue now; it waits for this grid's
  // end before it reads h
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  if (p.expert < 0) return;
  const int g = p.g, t = p.t;
  float acc[NA][TOKG][4] = {};
  auto token = [&](int n) { return (u64)sorted_token[p.first + n]; };
#if TMA
  run_tma(acc, p, {&map1, &map3}, {s1, s3}, xa, token, x_cap);
#else
  Stream st(acc);
  aim(st, 0, p, w1, s1);
  aim(st, 1, p, w3, s3);
  aim_x(st, p, xa, token);
  run(st, p);
#endif
  if (p.warp != 0) return;

  // element c of acc[a][q]: weight row row0 + 16 r + g + 8 (c >> 1), token 8 q + 2 t + (c & 1)
#pragma unroll
  for (int q = 0; q < TOKG; ++q) {
#pragma unroll
    for (int c1 = 0; c1 < 2; ++c1) {
      const int n = 8 * q + 2 * t + c1;
      const float rw = n < p.count ? sorted_weight[p.first + n] : 0.f;
#pragma unroll
      for (int grp = 0; grp < RT / 2; ++grp) {  // 32 weight rows = one FP8 group of h
        float v[4];
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = 2 * grp + (j >> 1), c = 2 * (j & 1) + c1;
          v[j] = swiglu_weighted(acc[r][q][c], acc[RT + r][q][c], rw, limit);
          amax = fmaxf(amax, fabsf(v[j]));
        }
        // the group's other rows sit in the lanes with the same t
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 8));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 16));
        const Fp8Scale sc = fp8_scale(fmaxf(amax, amax_floor));
        if (n < p.count) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int row = p.row0 + 16 * (2 * grp + (j >> 1)) + g + 8 * (j & 1);
            h[(u64)(p.first + n) * N_DIM + row] = fp8_round_trip(v[j], sc);
          }
        }
      }
    }
  }
}

#else

// y = h W2^T per routed row, rounded to bf16. Grid: (N_DIM / ROWS_PER_CTA, routing tiles).
extern "C" __global__ void __launch_bounds__(SPLIT * 32, MIN_BLOCKS)
moe_w2(
#if TMA
       const __grid_constant__ TensorMap map2,
#endif
       const u8* __restrict__ h,                                // [P, K_DIM] bf16
       const u8* __restrict__ w2, const u8* __restrict__ s2,    // [E, N, K/2], [E, N, K/32]
       const int* __restrict__ tiles,                           // [tiles, 3]
       u16* __restrict__ y                                      // [P, N_DIM] bf16
#if TMA
       , int x_cap
#endif
) {
  const Place p = place(tiles);
  if (p.expert < 0) return;
  const int g = p.g, t = p.t;
  float acc[NA][TOKG][4] = {};
  auto routed_row = [&](int n) { return (u64)(p.first + n); };
#if TMA
  run_tma(acc, p, {&map2}, {s2}, h, routed_row, x_cap);
#else
  Stream st(acc);
  aim(st, 0, p, w2, s2);
  aim_x(st, p, h, routed_row);
  run(st, p);
#endif
  if (p.warp != 0) return;
#pragma unroll
  for (int a = 0; a < NA; ++a)
#pragma unroll
    for (int q = 0; q < TOKG; ++q)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = 8 * q + 2 * t + (c & 1);
        if (n < p.count) {
          const int row = p.row0 + 16 * a + g + 8 * (c >> 1);
          y[(u64)(p.first + n) * N_DIM + row] = bf16_bits(acc[a][q][c]);
        }
      }
}

#endif
