// Shared by every kernel file (python/ninfer/backends/kernels.py prepends it): fixed-width types, f16/bf16
// conversion without cuda_fp16.h (so NVRTC needs no include path), warp reductions, and ggml's exp.
//
// Numerics follow the CPU backend (rust/core/src/cpu), which follows llama.cpp: the same activation
// quantization (so integer dot products see the same codes), double-accumulated RMSNorm sums, ggml_v_expf for
// SiLU and softmax. Only the order of float sums differs, which keeps GPU and CPU ops within NMSE 1e-6.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {  // round to nearest even, as the CPU's f16 conversion
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float f16_round(float f) { return h2f(f2h(f)); }

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ u16 f2bf(float f) {  // round to nearest even; NaN stays NaN (ggml's rule)
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffff) > 0x7f800000) return (u16)((u >> 16) | 64);
    return (u16)((u + (0x7fff + ((u >> 16) & 1))) >> 16);
}

__device__ __forceinline__ float bf16_round(float f) { return bf2f(f2bf(f)); }

// Programmatic dependent launch (sm_90): the decode step's kernels are launched so that each may start while the
// previous one is still finishing (backends/cuda_ops.py, `dependent_launches`). A kernel does what does not read the
// previous kernels' results first (descriptors, L2 prefetches of weights and of earlier tokens' KV), then
// grid_dep_wait(), which returns once every earlier kernel of the stream has finished and its writes are visible;
// it must come before any read or write of activations. grid_dep_launch() lets the next kernel's blocks start as
// this one's retire. Launched the ordinary way, both are no-ops.
__device__ __forceinline__ void grid_dep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dep_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// *p += v for a residual add with one writer an element: red.global.add.f32 (a reduction performed at L2, nothing
// returned) rounds as the load-add-store does (one addition of the same two numbers; subnormals flushed, which a
// residual never is), and the writing warp does not wait for the old value's round trip.
__device__ __forceinline__ void red_add(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

// Ask L2 for the 128-byte line holding p (a hint: the thread does not wait).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Ask L2 for [p, p + bytes), widened to 16-byte boundaries, without waiting: one bulk request on sm_90 (the copy
// engine walks the range), 128-byte line hints from this thread otherwise. The range must lie in one allocation.
__device__ __forceinline__ void prefetch_l2_range(const void* p, u32 bytes) {
    const u64 a = (u64)p, a0 = a & ~15ull, a1 = (a + bytes + 15) & ~15ull;
#if __CUDA_ARCH__ >= 900
    if (a1 > a0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a0), "r"((u32)(a1 - a0)) : "memory");
#else
    for (u64 q = a0 & ~127ull; q < a1; q += 128) prefetch_l2((const void*)q);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Round to nearest, ties to even (the CPU's nearest_int for |v| < 2^22).
__device__ __forceinline__ int nearest_int(float v) { return __float2int_rn(v); }

// exp(x) as ggml_v_expf computes it (rust/core/src/cpu/ops.rs ggml_expf): the same fused multiply-adds, so the
// same bits.
__device__ __forceinline__ float ggml_expf(float x) {
    const float r = __uint_as_float(0x4b400000u);
    float z = fmaf(x, __uint_as_float(0x3fb8aa3bu), r);
    float n = z - r;
    float b = fmaf(-n, __uint_as_float(0x35bfbe8eu), fmaf(-n, __uint_as_float(0x3f317200u), x));
    u32 e = __float_as_uint(z) << 23;
    float k = __uint_as_float(e + __float_as_uint(1.0f));
    float u = b * b;
    float j = fmaf(fmaf(fmaf(__uint_as_float(0x3c072010u), b, __uint_as_float(0x3d2b9f17u)), u,
                        fmaf(__uint_as_float(0x3e2aaf33u), b, __uint_as_float(0x3efffedbu))),
                   u, __uint_as_float(0x3f7ffff6u) * b);
    if (fabsf(n) <= 126.0f) return fmaf(j, k, k);
    u32 g = n <= 0.0f ? 0x82000000u : 0u;
    float s1 = __uint_as_float(g + 0x7f000000u);
    float s2 = __uint_as_float(e - g);
    if (fabsf(n) > 192.0f) return s1 * s1;
    return fmaf(s2, j, s2) * s1;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + ggml_expf(-x)); }

// GELU (tanh form) as ggml's f16 table: input and result rounded to f16, clamped outside +-10 by the caller.
__device__ __forceinline__ float gelu_f16(float x) {
    const float SQRT_2_OVER_PI = 0.7978846f;
    float h = f16_round(x);
    return f16_round(0.5f * h * (1.0f + tanhf(SQRT_2_OVER_PI * h * fmaf(0.044715f * h, h, 1.0f))));
}

// The gated activation of the feed-forward block: act 0 = SiLU (llama, qwen2), 1 = GELU (gemma).
__device__ __forceinline__ float glu(float g, float u, int act) {
    if (act == 0) return silu(g) * u;
    if (g <= -10.0f) return 0.0f;
    if (g >= 10.0f) return g * u;
    return gelu_f16(g) * u;
}

// Activation kinds: how a weight type wants its input vector (the CPU's act_type).
#define ACT_F32 0
#define ACT_F16 1
#define ACT_BF16 2
#define ACT_Q8_0 3
#define ACT_Q8_1 4
#define ACT_Q8_K 5
#define ACT_GSQ8 6  // GSQ-RCO's int8 activations (gsq::ActQ8): a scale per 128, rounding half away from zero
// ACT_GSQ8 for the lane-pair kernel (gemv_gsq8_pairs): the same codes, but record g's 128 at byte 144 g and its
// eight sub-blocks' sums as int16 in the 16 bytes after them, so the pairs of a quarter-warp, on consecutive
// records, read eight different 16-byte bank groups with their sub-blocks in order, and a half record's sums are
// one 8-byte load. Scales as ACT_GSQ8 (no float sums: the pair kernel reads the int16 ones). Only the quantizers
// write it.
#define ACT_GSQ8_PAIRS 7

// Where element i's code sits in an ACT_GSQ8_PAIRS activation (also the bytes of i codes, i a multiple of 128).
__device__ __forceinline__ int gsq8_pairs_at(int i) { return i + 16 * (i >> 7); }
// ACT_Q8_K for the streamed Q6_K head (gemv_stream_q6k.cu): the same codes, scales and sums, but the last two
// 64-byte quarters of every 256 codes swapped, so that the 16-byte loads of a Q6_K slice's codes by the eight lanes of
// a super-block (bytes 128n + 32t + 16h, and + 64) cover all 32 banks, where in the plain order n = 0 and n = 1 fall
// on the same 16. Only the quantizers write it.
#define ACT_Q8_K_SKEW 8

// Where element i's code sits in an ACT_Q8_K_SKEW activation.
__device__ __forceinline__ int q8k_skew_at(int i) { return i ^ ((i >> 1) & 64); }

// GGML type ids.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_BF16 30
// A Q6_K output head re-laid by row for the streamed head (gemv_stream_q6k.cu; backends/layouts.py q6k_planar), a
// GPU type id outside GGML's range: a row's ql bytes of all its super-blocks, then their qh, their scales and their
// d's, the row padded to 16 bytes (4,208 for 5,120 columns, where the padded blocks take 4,480). Only that kernel and
// dequant_f16 read it.
#define T_Q6_K_PLANAR 240
// GSQ-RCO matrices (docs/gsq-rco.md, format version 2) get GPU type ids of their own, outside GGML's range:
// T_GSQ + 32 * (code bits - 3) + residual slots per record (backends/layouts.py gsq_type).
#define T_GSQ 256
