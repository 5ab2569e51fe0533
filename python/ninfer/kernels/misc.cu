// Row gathers and element-wise work: token embeddings, weight dequantization to f16 for the prefill GEMM, the
// gated activation of a prefill batch.

template <int T>
__device__ __forceinline__ void dequant_unit(const u8* row, long long unit, float* v) {
    if (T == T_F32 || T == T_F16 || T == T_BF16) {
#pragma unroll
        for (int e = 0; e < 32; ++e) v[e] = float_value(T, row, unit * 32 + e);
        return;
    }
    Unit u;
    unpack<T>(row + (unit / UNITS_PER_BLOCK(T)) * GPU_BLOCK_BYTES(T), (int)(unit % UNITS_PER_BLOCK(T)), u);
#pragma unroll
    for (int e = 0; e < 32; ++e) v[e] = unit_value(u, e);
}

__device__ __forceinline__ void dequant_unit_any(int type, const u8* row, long long unit, float* v) {
    if (type >= T_GSQ) {
        const int bits = gsq_bits(type), slots = gsq_slots(type);
        const u8* b = row + (unit >> 2) * gsq_record_bytes(bits, slots);
        if (bits == 4) gsq_dequant_unit<4>(b, (int)(unit >> 2), (int)(unit & 3), slots, v);
        else gsq_dequant_unit<3>(b, (int)(unit >> 2), (int)(unit & 3), slots, v);
        return;
    }
    switch (type) {
#define DQ_CASE(T) \
    case T: dequant_unit<T>(row, unit, v); return;
        FOR_EACH_TYPE(DQ_CASE)
#undef DQ_CASE
    }
#pragma unroll
    for (int e = 0; e < 32; ++e) v[e] = __int_as_float(0x7fc00000);
}

// out[t, :] = embd_scale * row tokens[t] of the table. One thread per 32-element unit; grid (units/128, rows).
// pos_out (may be null): the decode step's position copied in from pos_in (mapped host memory) by the first thread,
// so a step's graph starts with one kernel instead of a kernel and a copy node (a copy node also ends the chain of
// programmatic launches: the first q/k/v launch then started the ordinary way).
extern "C" __global__ void embed(int type, const u8* table, long long row_bytes, const int* tokens, int n,
                                 float embd_scale, float* out, const int* pos_in, int* pos_out) {
    const long long unit = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (pos_out && unit == 0 && t == 0) *pos_out = *pos_in;
    if (unit >= n / 32) return;
    float v[32];
    dequant_unit_any(type, table + (long long)tokens[t] * row_bytes, unit, v);
    float* o = out + (long long)t * n + unit * 32;
#pragma unroll
    for (int e = 0; e < 32; ++e) o[e] = embd_scale != 1.0f ? v[e] * embd_scale : v[e];
}

// out (f16, [rows, cols]) = the weights dequantized: one thread per unit.
extern "C" __global__ void dequant_f16(int type, const u8* w, long long row_bytes, int rows, int cols, u16* out) {
    const long long units_per_row = cols / 32;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * units_per_row) return;
    const long long r = idx / units_per_row, unit = idx % units_per_row;
    float v[32];
    if (type == T_Q6_K_PLANAR) {  // (the streamed head's rows: their fields by runs of the row, common.cuh)
        const u8* row = w + r * row_bytes;
        const int nb = cols >> 8, b = (int)(unit >> 3);
        Unit u;
        unpack_q6_k_at(row + 128 * b, row + 128 * nb + 64 * b, row + 192 * nb + 16 * b, row + 208 * nb + 2 * b,
                       (int)(unit & 7), u);
#pragma unroll
        for (int e = 0; e < 32; ++e) v[e] = unit_value(u, e);
    } else {
        dequant_unit_any(type, w + r * row_bytes, unit, v);
    }
    u32* o = (u32*)(out + r * cols + unit * 32);
#pragma unroll
    for (int e = 0; e < 16; ++e) o[e] = (u32)f2h(v[2 * e]) | ((u32)f2h(v[2 * e + 1]) << 16);
}

// gu: [rows, 2 * n] with gate in the first half of a row and up in the second; out[r, i] = glu(gate, up).
extern "C" __global__ void glu_rows(const float* gu, int n, int rows, int act, float* out) {
    grid_dep_launch();
    grid_dep_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * n) return;
    const long long r = i / n, c = i % n;
    out[i] = glu(gu[r * 2 * n + c], gu[r * 2 * n + n + c], act);
}

// x += y (f32), n elements.
extern "C" __global__ void add_inplace(float* x, const float* y, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// Gather rows: out[i, :] = x[rows[i], :] (the logit rows of a prefill batch before the output head).
extern "C" __global__ void gather_rows(const float* x, const int* rows, int n, float* out) {
    const int i = blockIdx.y;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n; c += gridDim.x * blockDim.x)
        out[(long long)i * n + c] = x[(long long)rows[i] * n + c];
}

// Keep the GPU busy for `cycles` clock ticks: the profiler queues a step's launches behind it, so the CUDA events
// between them time the kernels rather than the host's launch gaps.
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
