// The MoE decode front of one token in one 8-CTA cluster (Hopper, sm_90a): router GEMV + bias -> bf16 logits ->
// top-k (ties to the lower id) -> softmax over the k -> the masked plan (counts, active experts, row_of_pair,
// token_of_row at m_cap = 1) and the token's FP8 row of A (one scale per 128 channels) for the gate_up GEMM.
//
// Why: the Triton front (kernels/moe/decode_front_triton.py) spreads the router over 92 programs (120b) whose
// partial logits meet through global memory: a release fence and an atomic ticket, then the last program re-reads
// every partial and routes, several dependent global round trips after the PDL wait (7.3-7.7 us per 120b layer at
// batch 1, 10% of the step). Here each warp owns whole router rows (loaded before the wait: weights), so a logit is
// one warp's dot; the 64 warps of the cluster hand their logits to CTA 0 through distributed shared memory and one
// cluster barrier, and one warp of CTA 0 routes.
//
// Numerics: the products are exact (bf16 x bf16 in fp32) and summed in fp32 in this kernel's order (the Triton front
// sums 23 tensor-core partials: equal logits when every partial sum is exact, e.g. coarse-grid inputs; otherwise
// within fp32 rounding before the bf16 rounding both apply). The softmax (ex2.approx of x * log2(e), IEEE division)
// and the quantization (IEEE divisions, satfinite e4m3) are the Triton front's instructions.
#include <cooperative_groups.h>
#include <cuda_fp8.h>

#include "decode_front.cuh"

namespace cg = cooperative_groups;

namespace decode_front {

__device__ __forceinline__ float ex2_approx(float v) {
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

__global__ void __launch_bounds__(kThreads, 1) front_kernel(const Args args) {
    __shared__ float logits_sh[kMaxExperts];
    __shared__ float bias_sh[kMaxExperts];
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gwarp = rank * kWarps + warp;
    const int nvec = args.hidden / 8;

    // Before the PDL wait: this warp's router rows and (CTA 0) the bias: no kernel writes them.
    uint4 wv[kExpertsPerWarp][kVecPerLane];
#pragma unroll
    for (int j = 0; j < kExpertsPerWarp; ++j) {
        const int e = gwarp + j * kCluster * kWarps;
        const uint4* row = reinterpret_cast<const uint4*>(args.w + static_cast<int64_t>(e) * args.hidden);
#pragma unroll
        for (int v = 0; v < kVecPerLane; ++v) {
            const int idx = lane + v * 32;
            wv[j][v] = (e < args.num_experts && idx < nvec) ? __ldg(row + idx) : make_uint4(0, 0, 0, 0);
        }
    }
    if (rank == 0)
        for (int e = threadIdx.x; e < args.num_experts; e += kThreads) bias_sh[e] = __bfloat162float(args.bias[e]);
    cluster.sync();  // every CTA of the cluster running before any writes a peer's shared memory (still before the wait)
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    // 1. logits: one warp's dot per expert
    uint4 xv[kVecPerLane];
    const uint4* xrow = reinterpret_cast<const uint4*>(args.x);
#pragma unroll
    for (int v = 0; v < kVecPerLane; ++v) {
        const int idx = lane + v * 32;
        xv[v] = idx < nvec ? xrow[idx] : make_uint4(0, 0, 0, 0);
    }
    float acc[kExpertsPerWarp];
#pragma unroll
    for (int j = 0; j < kExpertsPerWarp; ++j) {
        acc[j] = 0.f;
#pragma unroll
        for (int v = 0; v < kVecPerLane; ++v) {
            const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv[v]);
            const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv[j][v]);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 xf = __bfloat1622float2(xp[q]), wf = __bfloat1622float2(wp[q]);
                acc[j] = fmaf(xf.x, wf.x, acc[j]);
                acc[j] = fmaf(xf.y, wf.y, acc[j]);
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
        const int e = gwarp + j * kCluster * kWarps;
        if (lane == 0 && e < args.num_experts) *cluster.map_shared_rank(&logits_sh[e], 0) = acc[j];
    }

    // 2. the token's FP8 row of A: channel block kb = rank + kCluster * warp, 4 channels per lane
    const int kb = rank + kCluster * warp;
    if (kb * 128 < args.kp) {
        const int c = kb * 128 + lane * 4;  // hidden % 8 == 0: a lane's 4 channels are all real or all padding
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (c < args.hidden) {
            const uint2 raw = *reinterpret_cast<const uint2*>(args.x + c);
            const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
            const float2 lo = __bfloat1622float2(p[0]), hi = __bfloat1622float2(p[1]);
            v[0] = lo.x; v[1] = lo.y; v[2] = hi.x; v[3] = hi.y;
        }
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.f);
        const __nv_fp8x2_storage_t q01 =
            __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(v[0], scale), __fdiv_rn(v[1], scale)), __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t q23 =
            __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(v[2], scale), __fdiv_rn(v[3], scale)), __NV_SATFINITE, __NV_E4M3);
        *reinterpret_cast<uint32_t*>(args.a + c) = static_cast<uint32_t>(q01) | (static_cast<uint32_t>(q23) << 16);
        if (lane == 0) args.sf[kb * args.sf_k_stride] = scale;
    }
    cluster.sync();  // every logit is in CTA 0's shared memory; no CTA touches a peer's memory after this
    if (rank != 0 || warp != 0) return;

    // 3. routing (one warp): bias, bf16 rounding, top-k with ties to the lower id, softmax over the k
    float val[kValsPerLane];
#pragma unroll
    for (int i = 0; i < kValsPerLane; ++i) {
        const int e = lane + 32 * i;
        val[i] = e < args.num_experts ? __bfloat162float(__float2bfloat16_rn(logits_sh[e] + bias_sh[e])) : -INFINITY;
    }
    int chosen[kMaxTopK];
    float picked[kMaxTopK];
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
        if (j >= args.top_k) break;
        float bv = -INFINITY;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < kValsPerLane; ++i) {
            const int e = lane + 32 * i;
            if (val[i] > bv || (val[i] == bv && e < bi)) { bv = val[i]; bi = e; }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        chosen[j] = bi;
        picked[j] = bv;
#pragma unroll
        for (int i = 0; i < kValsPerLane; ++i)
            if (lane + 32 * i == bi) val[i] = -INFINITY;
    }
    const float top = picked[0];
    float p[kMaxTopK];
    float sum = 0.f;
    for (int j = 0; j < args.top_k; ++j) {
        p[j] = ex2_approx((picked[j] - top) * 1.4426950408889634f);
        sum += p[j];
    }
    for (int l = lane; l < args.num_local; l += 32) args.counts[l] = 0;
    __syncwarp();
    if (lane != 0) return;
    int locals[kMaxTopK];
    int n = 0;
    for (int j = 0; j < args.top_k; ++j) {
        args.ids[j] = chosen[j];
        args.weights[j] = __fdiv_rn(p[j], sum);
        const int e_loc = chosen[j] - args.first_expert;
        const bool local = e_loc >= 0 && e_loc < args.num_local;
        args.row_of_pair[j] = local ? e_loc : -1;
        if (local) {
            args.counts[e_loc] = 1;
            args.token_of_row[e_loc] = 0;
            int at = n++;  // insertion: active experts ascending
            while (at > 0 && locals[at - 1] > e_loc) { locals[at] = locals[at - 1]; --at; }
            locals[at] = e_loc;
        }
    }
    for (int i = 0; i < n; ++i) args.active[i] = locals[i];
    args.counts[args.num_local] = n;
}

cudaError_t launch(const Args& args, cudaStream_t stream, bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kCluster, 1, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, front_kernel, args);
}

}  // namespace decode_front
