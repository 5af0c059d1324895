// What the hand-written decode kernels share: integer types, the global loads they use, bf16
// rounding, the warp-order sum of a CTA's K split and the register-ring K loop.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

// Weights are read once: the streaming loads do not keep them in L1. Activations are read by
// many CTAs: those loads may.
static __device__ __forceinline__ void ldg_stream(u32 (&r)[4], const u8* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}

static __device__ __forceinline__ void ldg_shared(u32 (&r)[4], const u8* p) {
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}

static __device__ __forceinline__ u32 ldg_u8(const u8* p) {
  u16 v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

static __device__ __forceinline__ u16 bf16_bits(float v) {
  u16 b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
  return b;
}

static __device__ __forceinline__ float bf16_round(float v) {
  return __uint_as_float(((u32)bf16_bits(v)) << 16);
}

// Sum the W warps' partials acc[A][Q][4] (one lane's fragment each) in warp order into warp 0's.
template <int A, int Q, int W>
static __device__ __forceinline__ void reduce_warps(float (&acc)[A][Q][4], int warp, int lane) {
  if constexpr (W > 1) {
    __shared__ float part[W - 1][A * Q * 4][32];
    if (warp > 0) {
#pragma unroll
      for (int a = 0; a < A; ++a)
#pragma unroll
        for (int q = 0; q < Q; ++q)
#pragma unroll
          for (int c = 0; c < 4; ++c) part[warp - 1][(a * Q + q) * 4 + c][lane] = acc[a][q][c];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int w = 0; w < W - 1; ++w)
#pragma unroll
        for (int a = 0; a < A; ++a)
#pragma unroll
          for (int q = 0; q < Q; ++q)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][q][c] += part[w][(a * Q + q) * 4 + c][lane];
    }
  }
}

// A warp's K loop over `steps` steps with a ring of AHEAD + 1 register sets (`S::Step`), so the
// loads of the next AHEAD steps are in flight while a step computes; the ring is unrolled, so
// every slot is a compile-time register choice. `s` provides load(Step&, bool valid) at its
// cursor, advance() (to the next step), valid(j) (step j holds data for this thread) and
// compute(const Step&).
template <int AHEAD, typename S>
static __device__ __forceinline__ void ring_loop(S& s, int steps) {
  typename S::Step ring[AHEAD + 1];
  s.load(ring[0], s.valid(0));  // the cursor stays on the last step loaded
#pragma unroll
  for (int d = 1; d < AHEAD; ++d) {
    s.advance();
    s.load(ring[d], s.valid(d));
  }
  for (int i = 0; i < steps; i += AHEAD + 1) {
#pragma unroll
    for (int j = 0; j <= AHEAD; ++j) {
      if (j == 0 || i + j < steps) {  // (j = 0: the loop condition)
        s.advance();
        s.load(ring[(j + AHEAD) % (AHEAD + 1)], s.valid(i + j + AHEAD));
        s.compute(ring[j]);
      }
    }
  }
}
