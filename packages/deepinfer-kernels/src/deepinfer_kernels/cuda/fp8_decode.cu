// Dense FP8 GEMM at decode sizes on mma.sync m16n8k32 e4m3 (fp32 sums), compiled at run time by
// NVRTC (`fp8_decode.py` holds the contract and picks the constants below).
//
// y[m, n] = sum_k (x[m, k] sx[m, k/32]) (w[n, k] sw[n/32, k/32]). The weights are the A operand
// (16 rows per mma), the M <= 8 TOKG tokens the B operand (8 per mma). Each mma covers one
// 32-deep K group, so its partial sum has one weight scale per row pair and one activation scale
// per token: acc += part * (sw * sx) (the per-32 promotion). Thread (g, t) of a warp loads 8
// bytes of K group G at [32G + 8t, 32G + 8t + 8) for its weight rows g, g + 8 and its token g:
// bytes 0..3 are mma slots 4t..4t+3 and bytes 4..7 slots 4t+16..4t+19 for A and B alike (the
// mma's K order is free as long as both operands agree). Weights go straight from HBM into
// registers (a ring of DEPTH steps in flight), with no shared memory and no barrier in the loop.
//
// The grid splits K over KS CTAs per row block so that a weight matrix fills every SM in one
// wave; the KS partials are summed in a fixed order by whichever CTA of the row block finishes
// last (a counter per row block, reset by that CTA), so the result does not depend on timing.
//
// Constants (-D): K_DIM, N_DIM (weight rows), TOKG (8-token groups: M <= 8 TOKG), RT (16-row
// tiles per warp), WARPS (warps per CTA, each a contiguous share of the CTA's K range, summed in
// warp order), KS (CTAs along K), MIN_BLOCKS, DEPTH (K steps loaded ahead), OUT_F32 (1: fp32
// out, 0: bf16).

#include "common.cuh"

#define KG (K_DIM / 32)         // K groups
#define ROWS_PER_CTA (16 * RT)  // weight rows per CTA

static __device__ __forceinline__ void mma16832(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                                u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};"
      : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.f));
}

// One K group's operands of one warp: per A tile and row half (rows g, g + 8) 8 weight bytes, per
// A tile its UE8M0 scale byte, per token group 8 activation bytes (token 8q + g) and the fp32
// scales of the two tokens whose sums the thread holds (8q + 2t, 8q + 2t + 1).
struct Step {
  u32 w[RT][2][2];
  u32 sw[RT];
  u32 x[TOKG][2];
  float sx[TOKG][2];
};

// A warp's K stream (see `ring_loop`): pointers at the thread's bytes of the current K group.
struct Stream {
  typedef ::Step Step;
  const u8* w;    // weight row g of the first tile
  const u8* sw;   // that tile's scale row (ROWS_PER_CTA rows = RT / 2 scale rows)
  const u8* x;    // token 8q + g's row: x + q * 8 * K_DIM
  const float* sx;  // token 8q + 2t's scales: sx + q * 8 * KG (+ KG: the next token)
  int groups;     // the warp's K groups
  int m;          // tokens
  int g, t;
  float (&acc)[RT][TOKG][4];

  __device__ __forceinline__ Stream(float (&acc_)[RT][TOKG][4]) : acc(acc_) {}

  __device__ __forceinline__ bool valid(int step) const { return step < groups; }

  __device__ __forceinline__ void advance() {
    w += 32;
    sw += 1;
    x += 32;
    sx += 1;
  }

  __device__ __forceinline__ void load(Step& st, bool ok) const {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        st.w[r][h][0] = st.w[r][h][1] = 0u;
        if (ok) ldg_stream(st.w[r][h], w + (16 * r + 8 * h) * K_DIM);
      }
      // tile r's rows share the scale row (row0 + 16 r) / 32
      st.sw[r] = ok ? ldg_u8(sw + ((16 * r) / 32) * KG) : 0u;
    }
#pragma unroll
    for (int q = 0; q < TOKG; ++q) {
      st.x[q][0] = st.x[q][1] = 0u;
      if (ok && 8 * q + g < m) ldg_shared(st.x[q], x + q * 8 * K_DIM);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const bool tok = ok && 8 * q + 2 * t + c < m;
        st.sx[q][c] = tok ? ldg_f32(sx + (q * 8 + c) * KG) : 0.f;
      }
    }
  }

  __device__ __forceinline__ void compute(const Step& st) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const float wscale = __uint_as_float(st.sw[r] << 23);  // 2**(u - 127), u >= 1
#pragma unroll
      for (int q = 0; q < TOKG; ++q) {
        float part[4];
        mma16832(part, st.w[r][0][0], st.w[r][1][0], st.w[r][0][1], st.w[r][1][1], st.x[q][0],
                 st.x[q][1]);
        const float s0 = wscale * st.sx[q][0], s1 = wscale * st.sx[q][1];
        acc[r][q][0] += part[0] * s0;
        acc[r][q][1] += part[1] * s1;
        acc[r][q][2] += part[2] * s0;
        acc[r][q][3] += part[3] * s1;
      }
    }
  }
};

static __device__ __forceinline__ void ld_cg(float& v, const float* p) {
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
}

// Grid (N_DIM / ROWS_PER_CTA, KS); block WARPS warps. part: [KS, 8 TOKG, N_DIM] fp32 and
// counters: [N_DIM / ROWS_PER_CTA] int32 zeros (KS > 1 only; the last CTA leaves them zero).
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
fp8_decode(const u8* __restrict__ x,       // [M, K] e4m3
           const float* __restrict__ sx,   // [M, K/32] fp32 powers of two
           const u8* __restrict__ w,       // [N, K] e4m3
           const u8* __restrict__ sw,      // [ceil(N/32), K/32] UE8M0
           void* __restrict__ y,           // [M, N] fp32 or bf16
           int m, float* __restrict__ part, int* __restrict__ counters) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * ROWS_PER_CTA;
  // this CTA's K groups, then this warp's share of them
  const int c_begin = blockIdx.y * KG / KS, c_end = (blockIdx.y + 1) * KG / KS;
  const int begin = c_begin + warp * (c_end - c_begin) / WARPS;
  const int end = c_begin + (warp + 1) * (c_end - c_begin) / WARPS;

  float acc[RT][TOKG][4] = {};
  Stream st(acc);
  st.w = w + (u64)(row0 + g) * K_DIM + begin * 32 + t * 8;
  st.sw = sw + (u64)(row0 / 32) * KG + begin;
  st.x = x + (u64)g * K_DIM + begin * 32 + t * 8;
  st.sx = sx + (u64)(2 * t) * KG + begin;
  st.groups = end - begin;
  st.m = m;
  st.g = g;
  st.t = t;
  ring_loop<DEPTH>(st, end - begin);
  reduce_warps<RT, TOKG, WARPS>(acc, warp, lane);
  if (warp != 0) return;

  // element c of acc[r][q]: row row0 + 16 r + g + 8 (c >> 1), token 8 q + 2 t + (c & 1)
#if KS > 1
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int q = 0; q < TOKG; ++q)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = row0 + 16 * r + g + 8 * (c >> 1), n = 8 * q + 2 * t + (c & 1);
        part[((u64)blockIdx.y * 8 * TOKG + n) * N_DIM + row] = acc[r][q][c];
      }
  __threadfence();  // the partials before the count
  __syncwarp();
  int arrived = 0;
  if (lane == 0) arrived = atomicAdd(&counters[blockIdx.x], 1);
  arrived = __shfl_sync(0xffffffffu, arrived, 0);
  if (arrived != KS - 1) return;
  __threadfence();  // the count before the others' partials
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int q = 0; q < TOKG; ++q)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = row0 + 16 * r + g + 8 * (c >> 1), n = 8 * q + 2 * t + (c & 1);
        float sum = 0.f;
        for (int s = 0; s < KS; ++s) {  // in split order, whichever CTA came last
          float v;
          ld_cg(v, part + ((u64)s * 8 * TOKG + n) * N_DIM + row);
          sum += v;
        }
        acc[r][q][c] = sum;
      }
  if (lane == 0) counters[blockIdx.x] = 0;
#endif
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int q = 0; q < TOKG; ++q)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = row0 + 16 * r + g + 8 * (c >> 1), n = 8 * q + 2 * t + (c & 1);
        if (n < m) {
#if OUT_F32
          ((float*)y)[(u64)n * N_DIM + row] = acc[r][q][c];
#else
          ((u16*)y)[(u64)n * N_DIM + row] = bf16_bits(acc[r][q][c]);
#endif
        }
      }
}
