// What the hand-written MoE kernels share: integer types, the global loads they use, bf16
// rounding, the exact FP4 expansion, TMA copies and their barriers, the SwiGLU and FP8 steps of
// the MoE epilogue, a CTA's routing tile, the warp-order sum of a CTA's K split and the
// register-ring K loop.

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

// A streaming load that ptxas keeps where the source puts it: plain `ld.global` does not pass the
// CTA's barriers, where it may move `ld.global.nc` next to the load's first use.
static __device__ __forceinline__ void ldg_stream_pinned(u32 (&r)[4], const u8* p) {
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
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

// 8 e2m1 nibbles (value k in bits 4k..4k+3) -> 4 bf16 pairs (values 2m, 2m+1 in pair m), each
// e2m1 * 2**(u - 127) exactly: the nibble's magnitude bits go to bf16 bits 8..6 and its sign to
// bit 15 (the e2m1 value times 2**-126, subnormal for magnitude 1), then one bf16x2 multiply by
// 2**(u - 1) (`sp`, both lanes). The values of triton/moe.py's FP4 mode 3, bit for bit.
template <int M>
static __device__ __forceinline__ u32 expand_pair(u32 even, u32 odd, u32 sp) {
  u32 u, o;
  // bytes M of `even` and `odd` into the low bytes of two 16-bit lanes; the sign-replicate
  // selectors (msb of a masked byte: 0) zero the high bytes
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(u) : "r"(even), "r"(odd), "n"(0xC480 + 0x1111 * M));
  const u32 t = (u * 0x1040u) & 0x81C081C0u;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(o) : "r"(t), "r"(sp));
  return o;
}

// 2**(u - 1) in both lanes of a bf16x2, for UE8M0 byte u: `expand8`'s scale operand. Finite for
// u <= 128 only (scales up to 2; quant.FP4_MAX_SCALE_BYTE, which the model loader checks): u = 129
// gives bf16 infinity, as in the Triton tier's FP4 modes.
static __device__ __forceinline__ u32 scale_pair(u32 u) { return ((u + 126u) << 7) * 0x10001u; }

static __device__ __forceinline__ void expand8(u32 w, u32 sp, u32 (&o)[4]) {
  const u32 even = w & 0x0F0F0F0Fu;
  const u32 odd = (w >> 4) & 0x0F0F0F0Fu;
  o[0] = expand_pair<0>(even, odd, sp);
  o[1] = expand_pair<1>(even, odd, sp);
  o[2] = expand_pair<2>(even, odd, sp);
  o[3] = expand_pair<3>(even, odd, sp);
}

// TMA copies and the barriers that count them.

// A CUtensorMap (cuTensorMapEncodeTiled), passed by value as a __grid_constant__ parameter.
struct __align__(64) TensorMap {
  u64 v[16];
};

static __device__ __forceinline__ u32 smem_u32(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void mbar_init(u64* bar) {
  asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_u32(bar)));
}

// A barrier whose phase completes after `count` arrivals (and the copies they expect).
static __device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

// One arrival (no copies expected).
static __device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// One arrival that also expects `bytes` of copies to land before the phase completes.
static __device__ __forceinline__ void mbar_expect(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes));
}

static __device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=: mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity));
}

// global -> shared, `bytes` (a multiple of 16, both addresses 16-byte aligned), counted on bar.
static __device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes,
                                                 u64* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// The box of `map` at (x bytes, y rows) -> shared address dst (128-byte aligned), counted on bar.
static __device__ __forceinline__ void tma_box(u32 dst, const TensorMap* map, int x, int y,
                                               u64* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
}

// shared -> global: the box of `map` at (x, y) from shared address src (1024-byte aligned with a
// swizzled map), out-of-bounds parts not written; in the calling thread's bulk group
// (`cp.async.bulk.commit_group`, then `cp.async.bulk.wait_group.read` before src is reused).
static __device__ __forceinline__ void tma_store(const TensorMap* map, int x, int y, u32 src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
               ::"l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(src)
               : "memory");
}

// bf16(rw * silu(gate) * up) from the fp32 sums, each of gate and up rounded to bf16 first and
// clamped to V4.1's limit (limit <= 0: none): triton/moe.py's epilogue, instruction for instruction.
static __device__ __forceinline__ float swiglu_weighted(float gate_acc, float up_acc, float rw,
                                                        float limit) {
  float gt = bf16_round(gate_acc);
  float up = bf16_round(up_acc);
  if (limit > 0.f) {
    up = fminf(fmaxf(up, -limit), limit);
    gt = fminf(gt, limit);
  }
  // Triton's tl.exp (ex2.approx of x * log2(e)) and its fp32 division (div.full)
  float e;
  asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(-gt * 1.4426950408889634f));
  float silu;
  asm("div.full.f32 %0, %1, %2;" : "=f"(silu) : "f"(gt), "f"(1.f + e));
  return bf16_round(rw * (silu * up));
}

// A 32-value group's FP8 scale: the power of two 2**ceil(log2(amax / 448)), and its inverse.
struct Fp8Scale {
  float scale, inv;
};

static __device__ __forceinline__ Fp8Scale fp8_scale(float amax) {
  const u32 bits = __float_as_uint(amax * (1.f / 448.f));  // the exponent, rounded up, from bits
  const u32 expo = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u);
  return {__uint_as_float(expo << 23), __uint_as_float((254u - expo) << 23)};
}

// v quantised to e4m3 with the group's scale and expanded back, as bf16 bits.
static __device__ __forceinline__ u16 fp8_round_trip(float v, Fp8Scale sc) {
  const float qv = fminf(fmaxf(v * sc.inv, -448.f), 448.f);
  u16 q8;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(q8) : "f"(0.f), "f"(qv));
  u32 f16x2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(f16x2) : "h"(q8));
  float qf;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, lo;}" : "=f"(qf) : "r"(f16x2));
  return bf16_bits(qf * sc.scale);
}

// A CTA's routing tile, row blockIdx.y of `tiles` [tiles, 3] (expert or -1, first routed row,
// end; count: its rows, at most max_rows), and the thread's lane roles (g = lane / 4: A row and
// token column of the mma fragments; t = lane % 4).
struct TilePlace {
  int expert, first, count;
  int lane, warp, g, t;
};

static __device__ __forceinline__ TilePlace tile_place(const int* tiles, int max_rows) {
  TilePlace p;
  const int tile = blockIdx.y;
  p.expert = tiles[3 * tile];
  p.first = tiles[3 * tile + 1];
  const int left = tiles[3 * tile + 2] - p.first;
  p.count = left < max_rows ? left : max_rows;
  p.lane = threadIdx.x & 31;
  p.warp = threadIdx.x >> 5;
  p.g = p.lane >> 2;
  p.t = p.lane & 3;
  return p;
}

// Sum the W warps' partials acc[A][Q][4] (one lane's fragment each) in warp order into warp 0's,
// through shared memory: part_of(w) is warp w's buffer (w >= 1) of A * Q * 4 x 32 floats.
template <int A, int Q, int W, typename PartOf>
static __device__ __forceinline__ void reduce_warps(float (&acc)[A][Q][4], int warp, int lane,
                                                    PartOf part_of) {
  if constexpr (W > 1) {
    if (warp > 0) {
      float* part = part_of(warp);
#pragma unroll
      for (int a = 0; a < A; ++a)
#pragma unroll
        for (int q = 0; q < Q; ++q)
#pragma unroll
          for (int c = 0; c < 4; ++c) part[((a * Q + q) * 4 + c) * 32 + lane] = acc[a][q][c];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int w = 1; w < W; ++w) {
        const float* part = part_of(w);
#pragma unroll
        for (int a = 0; a < A; ++a)
#pragma unroll
          for (int q = 0; q < Q; ++q)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][q][c] += part[((a * Q + q) * 4 + c) * 32 + lane];
      }
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
