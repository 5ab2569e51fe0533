// TinyFlash: attention of a few query rows against the paged f16 KV cache, split over the key range
// (flash-decoding) and GQA-aware: a block serves every query head of one KV head, so each K and V row is read
// once per group, not once per query head.
//
// Grid (n_split, n_head_kv, rows), ATT_WARPS warps a block. Each block takes an equal share of its row's keys (a
// multiple of 32; lengths are read from device memory, so a captured decode step serves any length), runs an online
// softmax over tiles of 32 keys per warp, and merges its warps. Head sizes 64 and 128 multiply on tensor cores
// (warp_keys_mma: a tile's K and V rows all requested at once, one memory round trip a tile); other head sizes on
// CUDA cores (warp_keys_fma). The launcher sizes n_split to the blocks the GPU holds at once. With n_split > 1 each
// block writes its partial (max, sum, unnormalized output); the last block of a (row, KV head) to finish, found
// with an atomic ticket, merges the partials and resets the ticket for the next launch. Rows are queries (decode:
// one per sequence; prefill: one per prompt token), each with its own position, page table and sliding window.
//
// The decode form (attention_step_*) also does what rope_kv.cu does for a prompt: each block ropes its own query
// heads from the raw projections, and the block whose share holds the new position writes that token's K and V
// to the cache before reading it, so a decode layer's attention is one launch (the output projection quantizes
// the result itself, gemv.cu).
//
// Numerics as the CPU's decode path: q rounded to f16 (the cache's dot format), score = (q . k) * scale, f32
// softmax and accumulation (on tensor cores too: f16 x f16 products are exact in f32, and the probabilities go in
// as two f16 parts).
//
// The parameter struct and the per-warp key loops it calls: attention_keys.cu (compiled before this file).

template <int HD, int NG, bool STEP>
__device__ void attend(const AttnParams& P) {
    const int n_head = P.n_head, n_head_kv = P.n_head_kv, page_size = P.page_size, window = P.window;
    const float scale = P.scale;
    const u16* k_pool = P.k_pool;
    const u16* v_pool = P.v_pool;
    float2* part_ml = P.part_ml;
    float* part_acc = P.part_acc;
    float* out = P.out;
    const int split = blockIdx.x, g = blockIdx.y, row = blockIdx.z, n_split = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int ng = NG;  // query heads per KV head: a template parameter, so loops over heads unroll exactly
    extern __shared__ float att_sm[];
    float* qs = att_sm;                                  // [ng][HD]
    float* pt = qs + MAX_GROUP * HD;                 // [warps][ng][32] probabilities of the tile
    float* wml = pt + ATT_WARPS * MAX_GROUP * 32;    // [warps][ng][2]
    float* wacc = wml + ATT_WARPS * MAX_GROUP * 2;   // [warps][ng][HD]
    __shared__ int last_block;

    const int* table = P.page_tables + (long long)P.row_seq[row] * P.table_stride;
    const int p = P.pos[row];
    const int kbeg = window > 0 ? max(0, p + 1 - window) : 0, kend = p + 1;
    // A share is a whole number of 32-key tiles, at least one per warp; splits past the keys (n_used and up) have
    // nothing to do, and with one split in use its block writes the output itself.
    const int per = max((((kend - kbeg) + n_split - 1) / n_split + 31) & ~31, 32 * ATT_WARPS);
    const int n_used = (kend - kbeg + per - 1) / per;
    if (split >= n_used) return;
    if (ng * n_split > ATT_WARPS * MAX_GROUP * HD / 2) {  // more splits than the merge holds: NaN, loudly
        grid_dep_wait();
        for (int i = tid; i < ng * HD; i += blockDim.x)
            out[((long long)row * n_head + g * ng) * HD + i] = __int_as_float(0x7fc00000);
        return;
    }
    const int s0 = kbeg + split * per, s1 = min(kend, s0 + per);
    // Before the previous kernel's results are needed (programmatic dependent launch, common.cuh): ask L2 for this
    // share's K and V rows, one contiguous range per page (the new token's row, written below, included).
    {
        const int pg0 = s0 / page_size, n_pg = (s1 - 1) / page_size - pg0 + 1;
        for (int i = tid; i < 2 * n_pg; i += blockDim.x) {
            const int pg = pg0 + (i >> 1), a = max(s0, pg * page_size), b = min(s1, (pg + 1) * page_size);
            const long long cell = kv_cell(table, a, page_size, n_head_kv, g);
            prefetch_l2_range(((i & 1) ? v_pool : k_pool) + cell * HD, (u32)((b - a) * HD * 2));
        }
    }
    // The rotation angles depend on the position alone: computed before the wait too
    // (rope_cs / rope_apply for the pairs this head size can have, HD / 64 a lane instead of 4, and the norms out of
    // line: the same values, fewer instructions in the step kernel and fewer of them before grid_dep_wait; measured
    // faster on the H200, docs/journal/gsq-rco-gpu.md).
    constexpr int RK = (HD + 63) / 64;
    RopeCS cs;
    if (STEP) cs = rope_cs<RK>(p, P.rope_dims, P.theta_scale, P.freq_scale, {P.ext_factor, P.corr_lo, P.corr_hi,
                                                                            P.mscale});
    // The page table is the host's, constant through a step: the cells of each warp's first tile of keys are looked
    // up before the wait too, so that the keys stage's first K and V loads wait on no table load (a shorter keys
    // stage, measured faster on the H200: docs/journal/gsq-rco-gpu.md).
    const u32 first_cell = s0 + 32 * warp < s1 ? tile_cell(table, s0 + 32 * warp, lane, s1, page_size, n_head_kv, g)
                                               : 0u;
    grid_dep_launch();
    // A one-split decode block (short contexts) runs its path after grid_dep_wait once before it: a dry pass on
    // whatever the q/k/v buffer and the cache hold then, nothing written to global memory, so that the real pass
    // finds that code in its SM's instruction cache. At short depth the stages after the wait are bound by the
    // code's cold fetch, not by memory (with the share's K/V rows in shared memory the keys stage took as long;
    // docs/journal/gsq-rco-gpu.md), and the engine leaves attention's SMs free during q/k/v (CudaEngine._room_grid), so the dry
    // pass runs under q/k/v. One copy of the code serves both passes: the loop stays rolled, since a second copy
    // would be fetched cold again. (Measured faster on the H200 than no dry pass: docs/journal/gsq-rco-gpu.md.)
    int pass = STEP && n_used == 1 ? 0 : 1;
    asm volatile("" : "+r"(pass));  // (opaque: the loop is not split into a dry and a real copy)
#pragma unroll 1
    for (;; ++pass) {
        const bool dry = pass == 0;  // (false in every pass that writes to global memory)
        if (!dry) grid_dep_wait();
        if (STEP) {
            // Rope this block's query heads from the raw projections (as rope_kv does), and, in the block whose
            // share holds position p, write the new token's K and V for this KV head.
            const float* src = P.qkv + (long long)row * P.qkv_stride;
            for (int h = warp; h < ng; h += ATT_WARPS) {
                float* v = qs + h * HD;
                const int head = g * ng + h;
                for (int i = lane; i < HD; i += WARP)
                    v[i] = src[head * HD + i] + (P.bias_q ? P.bias_q[head * HD + i] : 0.0f);
                __syncwarp();
                if (P.q_norm) head_rms_norm_outlined(v, P.q_norm, HD, P.eps);
                rope_apply<RK>(v, cs, P.rope_dims, P.neox);
                for (int i = lane; i < HD; i += WARP) v[i] = f16_round(P.q_scale != 1.0f ? v[i] * P.q_scale : v[i]);
                __syncwarp();
            }
            if (s0 <= p && p < s1) {
                const long long cell = kv_cell(table, p, page_size, n_head_kv, g);
                if (warp == ATT_WARPS - 1) {
                    float* v = wacc;  // scratch: the warps' merge area is not in use yet
                    const float* ks = src + n_head * HD + g * HD;
                    for (int i = lane; i < HD; i += WARP) v[i] = ks[i] + (P.bias_k ? P.bias_k[g * HD + i] : 0.0f);
                    __syncwarp();
                    if (P.k_norm) head_rms_norm_outlined(v, P.k_norm, HD, P.eps);
                    rope_apply<RK>(v, cs, P.rope_dims, P.neox);
                    if (!dry)
                        for (int i = lane; i < HD; i += WARP) P.k_pool[cell * HD + i] = f2h(v[i]);
                } else if (warp == ATT_WARPS - 2 && !dry) {
                    const float* vs = src + (n_head + n_head_kv) * HD + g * HD;
                    // Every load before any store: the compiler cannot tell the pool's stores from the q/k/v
                    // buffer's loads apart, so a loop of load-then-store made HD / 32 round trips to L2 one after
                    // another (this warp's, the longest of the stage), where one will do (a shorter RoPE stage,
                    // measured faster on the H200: docs/journal/gsq-rco-gpu.md).
                    float t[HD / WARP];
#pragma unroll
                    for (int k = 0; k < HD / WARP; ++k)
                        t[k] = vs[lane + WARP * k] + (P.bias_v ? P.bias_v[g * HD + lane + WARP * k] : 0.0f);
#pragma unroll
                    for (int k = 0; k < HD / WARP; ++k) P.v_pool[cell * HD + lane + WARP * k] = f2h(t[k]);
                }
            }
            __threadfence_block();
        } else {
            for (int i = tid; i < ng * HD; i += blockDim.x)
                qs[i] = f16_round(P.q[((long long)row * n_head + g * ng) * HD + i]);
        }
        __syncthreads();
        const WarpKeys W = {k_pool, v_pool, table, n_head_kv, g, page_size, s0, s1, scale, qs, pt, wml, wacc, warp,
                            lane, first_cell};
        if constexpr (HD % 64 == 0 && HD <= 128)
            warp_keys_mma<HD, NG>(W);
        else
            warp_keys_fma<HD, NG>(W);
        __syncthreads();
        // out quantized too (AttnParams.out_q): a warp a head quantizes the head's outputs as quant_act does (a head
        // is one 128-value group), so the output projection's launch copies them in instead of quantizing 5,120 values
        // in every block.
        const bool quant = HD == 128 && P.out_q;
        if (n_used == 1) {
            // One split: a warp a query head merges the key warps. Every lane reads the warps' (max, sum) of the head
            // (the same words: broadcast loads) and its HD / 32 output dims of each warp, all before any use, then
            // sums them in the warps' order, as the block-wide merge below does (the same values), writes them and
            // quantizes the head from its registers: no shuffles, no barrier. (Measured faster on the H200 than the
            // block-wide merge, a thread a value, then a barrier: docs/journal/gsq-rco-gpu.md.)
            constexpr int VPL = HD / 32;
            for (int h = warp; h < ng; h += ATT_WARPS) {
                float2 ml[ATT_WARPS];
                float a[ATT_WARPS][VPL];
#pragma unroll
                for (int w = 0; w < ATT_WARPS; ++w) {
                    ml[w] = *(const float2*)(wml + (w * MAX_GROUP + h) * 2);
                    const float* src = wacc + (w * MAX_GROUP + h) * HD + VPL * lane;  // (16-byte aligned)
#pragma unroll
                    for (int k = 0; k < VPL; ++k) a[w][k] = src[k];
                }
                float M = -INFINITY;
#pragma unroll
                for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, ml[w].x);
                float L = 0.0f, A[VPL];
#pragma unroll
                for (int k = 0; k < VPL; ++k) A[k] = 0.0f;
#pragma unroll
                for (int w = 0; w < ATT_WARPS; ++w) {
                    if (ml[w].x == -INFINITY) continue;
                    const float f = expf(ml[w].x - M);
                    L += ml[w].y * f;
#pragma unroll
                    for (int k = 0; k < VPL; ++k) A[k] += a[w][k] * f;
                }
                const long long oh = (long long)row * n_head + g * ng + h;
                float y[VPL];
#pragma unroll
                for (int k = 0; k < VPL; ++k) y[k] = L > 0.0f ? A[k] / L : 0.0f;
                if (dry) continue;
#pragma unroll
                for (int k = 0; k < VPL; ++k) out[oh * HD + VPL * lane + k] = y[k];
                if constexpr (VPL == 4)
                    if (quant) quantize_group<4>(ACT_GSQ8_PAIRS, (int)oh, y, P.out_q, P.out_d, 0, 0, 0);
            }
            if (dry) {
                __syncthreads();  // (the real pass writes the shared memory the dry one read)
                continue;
            }
            return;
        }
        // Several splits: this block's part (its warps merged) for the last block to finish, which merges the splits
        // and leaves each head's outputs in pt (free after the key loop) for this.
        const auto quantize_heads = [&](long long oh0) {
            for (int h = warp; h < ng; h += ATT_WARPS) {
                float y[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) y[k] = pt[h * HD + 4 * lane + k];
                quantize_group<4>(ACT_GSQ8_PAIRS, (int)(oh0 + h), y, P.out_q, P.out_d, 0, 0, 0);
            }
        };
        for (int i = tid; i < ng * HD; i += blockDim.x) {
            const int h = i / HD, d = i % HD;
            float M = -INFINITY;
            for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, wml[(w * MAX_GROUP + h) * 2]);
            float L = 0.0f, A = 0.0f;
            if (M != -INFINITY) {
                for (int w = 0; w < ATT_WARPS; ++w) {
                    float mw = wml[(w * MAX_GROUP + h) * 2];
                    if (mw == -INFINITY) continue;
                    float f = expf(mw - M);
                    L += wml[(w * MAX_GROUP + h) * 2 + 1] * f;
                    A += wacc[(w * MAX_GROUP + h) * HD + d] * f;
                }
            }
            const long long oh = (long long)row * n_head + g * ng + h;
            part_acc[(oh * n_split + split) * HD + d] = A;
            if (d == 0) part_ml[oh * n_split + split] = make_float2(M, L);
        }
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            int* ticket = P.tickets + row * n_head_kv + g;
            last_block = atomicAdd(ticket, 1) == n_used - 1;
            if (last_block) *ticket = 0;
        }
        __syncthreads();
        if (!last_block) return;
        __threadfence();
        // The last block merges the splits that held keys (the others are empty). Each split's weight
        // exp(m_s - M) per head goes to shared memory first (wacc is free again), so the per-dimension sums below are
        // independent loads that stay in flight together. (The launcher keeps ng * n_split <= ATT_WARPS * MAX_GROUP *
        // HD / 2, cuda_attention.attention_max_split.)
        float2* wf = (float2*)wacc;  // [ng][n_used]: (m, l), then (weight, l)
        for (int i = tid; i < ng * n_used; i += blockDim.x) {
            const int h = i / n_used, sp = i % n_used;
            wf[i] = __ldcg(part_ml + ((long long)row * n_head + g * ng + h) * n_split + sp);
        }
        __syncthreads();
        for (int h = warp; h < ng; h += ATT_WARPS) {  // a warp per head, its lanes over the splits
            float M = -INFINITY;
            for (int sp = lane; sp < n_used; sp += WARP) M = fmaxf(M, wf[h * n_used + sp].x);
            M = warp_max(M);
            float L = 0.0f;
            for (int sp = lane; sp < n_used; sp += WARP) {
                const float2 ml = wf[h * n_used + sp];
                const float f = ml.x == -INFINITY ? 0.0f : expf(ml.x - M);
                L += ml.y * f;
                wf[h * n_used + sp].x = f;
            }
            L = warp_sum(L);
            if (lane == 0) wml[h] = L;
        }
        __syncthreads();
        // Then every thread sums a float4 of one head's output over a share of the splits (C4 chunks of a head, S
        // threads a chunk): NG loads a split in flight per thread, where one thread per output dimension walking all
        // the splits was a chain of round trips (~30 us a layer at 32K keys). The S partial sums meet in shared
        // memory (qs and pt are free again: S * HD = 4 * blockDim floats).
        constexpr int C4 = HD / 4, S = 32 * ATT_WARPS / C4;
        const int c4 = tid % C4, s4 = tid / C4;
        float4 a4[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) a4[h] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const long long oh0 = (long long)row * n_head + g * ng;
#pragma unroll 2
        for (int sp = s4; sp < n_used; sp += S) {
#pragma unroll
            for (int h = 0; h < NG; ++h) {
                const float4 v = __ldcg((const float4*)(part_acc + ((oh0 + h) * n_split + sp) * HD) + c4);
                const float f = wf[h * n_used + sp].x;
                a4[h].x = fmaf(v.x, f, a4[h].x);
                a4[h].y = fmaf(v.y, f, a4[h].y);
                a4[h].z = fmaf(v.z, f, a4[h].z);
                a4[h].w = fmaf(v.w, f, a4[h].w);
            }
        }
        float4* red = (float4*)att_sm;  // [S][C4]
#pragma unroll
        for (int h = 0; h < NG; ++h) {
            red[s4 * C4 + c4] = a4[h];
            __syncthreads();
            if (tid < HD) {
                float A = 0.0f;
                for (int j = 0; j < S; ++j) A += att_sm[j * HD + tid];
                const float L = wml[h];
                out[(oh0 + h) * HD + tid] = L > 0.0f ? A / L : 0.0f;
                if (quant) pt[h * HD + tid] = L > 0.0f ? A / L : 0.0f;
            }
            __syncthreads();
        }
        if (quant) quantize_heads(oh0);
        return;  // (several splits: no dry pass)
    }
}

// One kernel per head size and group size (query heads per KV head), compiled on demand as a module of its own
// (backends/kernels.py defines ATT_HD and ATT_NG): attention_hd128_g6 and attention_step_hd128_g6 serve
// Qwen2.5-1.5B. Each is small: decode kernels run once per token, so their code is fetched cold on every SM each
// launch, and loops unrolled for every possible group size cost more in instruction fetch than they save.
// The parameters by value (__grid_constant__: read in place from the launch's parameter space, no copy), not
// through a pointer: the load of a struct from device memory was the first of the round trips before
// grid_dep_wait, which at short depths ends after the q/k/v launch has (kernels/attention.cu's trace).
#define ATTN_KERNEL(HD, NG)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attention_hd##HD##_g##NG(                     \
        const __grid_constant__ AttnParams P) {                                                                \
        attend<HD, NG, false>(P);                                                                              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attention_step_hd##HD##_g##NG(                \
        const __grid_constant__ AttnParams P) {                                                                \
        attend<HD, NG, true>(P);                                                                               \
    }
#define ATTN_KERNEL_OF(HD, NG) ATTN_KERNEL(HD, NG)

#ifdef ATT_HD
ATTN_KERNEL_OF(ATT_HD, ATT_NG)
#endif
