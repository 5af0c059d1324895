// What the FP8 wgmma GEMMs share (prefill_gemm.cu, decode_gemm.cu): the shared-memory descriptor of
// a 128-byte-swizzled K-major tile, one k32 slice of `wgmma.m64nNk32` on e4m3, shared-memory
// loads and the UE8M0 scale byte as a float.

// wgmma's matrix descriptor of a stage's rows at shared address p (1024-byte aligned): K-major,
// 128-byte swizzle, 8-row groups 1024 bytes apart; slice j starts 32 j bytes on (the hardware
// applies the swizzle to the address).
static __device__ __forceinline__ u64 desc_sw128(u32 p) {
  return (u64)((p & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

#define WG_ACC(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])

// d = A (64 rows, descriptor a) * B^T (N rows, descriptor b) for one k32 slice, e4m3 in, fp32
// out, a fresh partial (scale-d 0). d[j][c]: row lane / 4 (+ 8 for c >= 2) of the warp's 16,
// column 8 j + 2 (lane % 4) + (c & 1).
template <int N>
static __device__ __forceinline__ void wgmma_e4m3(float (&d)[N / 8][4], u64 a, u64 b) {
  static_assert(N == 8 || N == 16 || N == 32 || N == 64 || N == 128, "wgmma N: 8..128");
  if constexpr (N == 8) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, p, 1, 1;\n}\n"
        : WG_ACC(0)
        : "l"(a), "l"(b), "n"(0));
  } else if constexpr (N == 16) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7},"
        " %8, %9, p, 1, 1;\n}\n"
        : WG_ACC(0), WG_ACC(1)
        : "l"(a), "l"(b), "n"(0));
  } else if constexpr (N == 32) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1;\n}\n"
        : WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3)
        : "l"(a), "l"(b), "n"(0));
  } else if constexpr (N == 64) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
        "}, %32, %33, p, 1, 1;\n}\n"
        : WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7)
        : "l"(a), "l"(b), "n"(0));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
        "}, %64, %65, p, 1, 1;\n}\n"
        : WG_ACC(0), WG_ACC(1), WG_ACC(2), WG_ACC(3), WG_ACC(4), WG_ACC(5), WG_ACC(6), WG_ACC(7),
          WG_ACC(8), WG_ACC(9), WG_ACC(10), WG_ACC(11), WG_ACC(12), WG_ACC(13), WG_ACC(14),
          WG_ACC(15)
        : "l"(a), "l"(b), "n"(0));
  }
}

#undef WG_ACC

static __device__ __forceinline__ float4 lds128(u32 p) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(p));
  return v;
}

static __device__ __forceinline__ float lds32(u32 p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(p));
  return v;
}

static __device__ __forceinline__ void sts32(u32 p, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(p), "f"(v));
}

// A UE8M0 byte as the float it encodes (2**(u - 127); 0: 2**-127, 255: NaN).
static __device__ __forceinline__ float e8m0(u32 u) {
  return __uint_as_float(u == 0 ? 0x00400000u : u == 255 ? 0x7FC00000u : u << 23);
}
