// The whole MoE layer of one decode token in one persistent kernel (Hopper, sm_90a): router GEMV -> top-k softmax
// -> gate_up GEMV + bias + clamped SwiGLU -> FP8 activation -> down GEMV + bias -> weighted sum over the k experts.
//
// Why: at batch 1 the split path (CUDA front, gate_up decode GEMM, SwiGLU + quantization, down decode GEMM, combine)
// streams its 102 MB (120b, four FP8 experts) at ~3.2 TB/s inside its GEMMs but ~2.3 TB/s over the layer: each of
// the five launches pays a ramp (first loads) and a tail, and no weight byte is in flight between them
// (kernels/moe/NOTES.md). Here one CTA per SM stays resident for the whole layer; a producer warp streams weight
// tiles into a shared-memory ring with bulk copies (the copy engine, no registers held) from the moment the routing
// is known, through the gate_up -> down hand-off, while eight consumer warps multiply. Stages meet through grid
// barriers (all CTAs resident): after the logits (B1), after the SwiGLU activations (B2: the down weights keep
// streaming meanwhile), after the down rows (B3, then each CTA combines a slice of the output).
//
// Work: a unit is 16 weight rows of one active expert over the whole K (one mma M tile): gate_up units first, then
// down units, dealt round-robin to the CTAs. Each row is one bulk copy of its real K bytes (the zero K padding is not
// read) into a ring slot whose row stride is 64 mod 128 bytes, so the mma loads below hit 32 distinct banks.
// Tensor cores: mma.sync m16n8k32 e4m3 with weights as A and the token as B (all 8 columns the token; column 0
// read), K permuted inside each 64-deep chunk so a lane loads 16 contiguous bytes of rows g and g + 8.
//
// Numerics are the split path's: logits, routing and the token's FP8 row are the CUDA front's instructions in its
// order (csrc/decode_front.cu), so expert ids and weights are its bit for bit; per 128-deep block an fp32 mma
// partial times the weight and token scales; the sum rounded to bf16 then the bias (as the split-K path rounds its
// partial sums); SwiGLU with Triton's ex2-based exp and an IEEE division; the activation quantized per 128 channels
// (max(amax, 1e-4) / 448, IEEE divisions, satfinite); the combine sums the k pairs in routing order in fp32. The
// products' summation order is not the Triton GEMM's, so outputs match it to fp32 rounding, not bit for bit. No
// atomics feed a value except the amax (a max: exact), so replays are bitwise repeatable.
#include <cuda_fp8.h>

#include "moe_decode_layer.cuh"

namespace moe_decode_layer {

struct Layout {
    int row_stride;
    size_t bars, xq, xs, aq, as, red, uscale, ubias, route, ring, total;
};

__host__ __device__ inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

__host__ __device__ inline Layout layout_of(int hp, int ip, int stages, int max_units) {
    Layout l;
    const int kmax = hp > ip ? hp : ip;  // multiples of 128: the stride is 64 mod 128
    l.row_stride = kmax + 64;
    size_t o = 0;
    l.bars = o;
    o += 2 * kMaxStages * 8;
    l.xq = o;
    o = round_up(o + hp, 16);
    l.xs = o;
    o = round_up(o + (hp / 128) * 4, 16);
    l.aq = o;
    o = round_up(o + static_cast<size_t>(kMaxSlots) * ip, 16);
    l.as = o;
    o = round_up(o + static_cast<size_t>(kMaxSlots) * (ip / 128) * 4, 16);
    l.red = o;
    o = round_up(o + 2 * kConsumerWarps * kTileRows * 4, 16);
    l.uscale = o;
    o = round_up(o + static_cast<size_t>(max_units) * (kmax / 128) * 4, 16);
    l.ubias = o;
    o = round_up(o + static_cast<size_t>(max_units) * kTileRows * 4, 16);
    l.route = o;
    o = round_up(o + 32 * 4, 128);
    l.ring = o;
    o += static_cast<size_t>(stages) * kTileRows * l.row_stride;
    l.total = o;
    return l;
}

// route[]: [0] active local experts n, [1 + s] the local expert of slot s, [8 + j] the slot of pair j (-1: another
// rank's expert), [16 + j] pair j's weight (float bits)
constexpr int kRouteSlots = 1, kRoutePairSlot = 8, kRouteWeight = 16;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ float ex2_approx(float v) {
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    for (long long spin = 0;; ++spin) {
        uint32_t done;
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        if (done) return;
        if (spin > (1ll << 26)) __trap();  // a copy that never lands: fail loudly instead of hanging
    }
}

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// The consumer warps' barrier (the producer warp takes no part once it streams).
__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;\n" :: "n"(kConsumerWarps * 32) : "memory");
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One thread of each CTA, after the CTA's own barrier: arrive, wait for every CTA, and order memory both ways
// (the fences are cumulative: the CTA's writes seen by this thread before the barrier reach the other CTAs).
__device__ void grid_barrier(unsigned* state, unsigned ctas) {
    volatile unsigned* generation = state + 1;
    const unsigned mine = *generation;
    __threadfence();
    if (atomicAdd(state, 1u) == ctas - 1) {
        atomicExch(state, 0u);
        __threadfence();
        atomicAdd(state + 1, 1u);
    } else {
        for (long long spin = 0; *generation == mine; ++spin)
            if (spin > (1ll << 30)) __trap();  // a CTA that never arrives (not all resident): fail, do not hang
    }
    __threadfence();
}

__device__ __forceinline__ uint32_t quant4(const float (&v)[4], float scale) {
    const __nv_fp8x2_storage_t q01 = __nv_cvt_float2_to_fp8x2(
        make_float2(__fdiv_rn(v[0], scale), __fdiv_rn(v[1], scale)), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t q23 = __nv_cvt_float2_to_fp8x2(
        make_float2(__fdiv_rn(v[2], scale), __fdiv_rn(v[3], scale)), __NV_SATFINITE, __NV_E4M3);
    return static_cast<uint32_t>(q01) | (static_cast<uint32_t>(q23) << 16);
}

__device__ __forceinline__ float warp_max(float m) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    return m;
}

__device__ __forceinline__ void stamp(const Args& args, int point) {
    if (args.trace == nullptr) return;
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    args.trace[blockIdx.x * kTracePoints + point] = t;
}

struct Unit {
    bool gate_up;
    int slot, tile;
};

// Unit i of this CTA: u = cta + i * grid over [gate_up units (n_act * g1), down units (n_act * g2)], tile-major.
__device__ __forceinline__ Unit unit_of(int i, int cta, int grid, int n_act, int n1) {
    const int u = cta + i * grid;
    Unit w;
    w.gate_up = u < n1;
    const int v = w.gate_up ? u : u - n1;
    w.tile = v / n_act;
    w.slot = v - w.tile * n_act;
    return w;
}

__global__ void __launch_bounds__(kThreads, 1) moe_layer_kernel(const Args args) {
    extern __shared__ __align__(128) unsigned char smem[];
    const Layout L = layout_of(args.hp, args.ip, args.stages, args.max_units);
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L.bars);  // full[0, S), empty[kMaxStages, +S)
    uint8_t* xq = smem + L.xq;
    float* xs = reinterpret_cast<float*>(smem + L.xs);
    uint8_t* aq = smem + L.aq;
    float* as = reinterpret_cast<float*>(smem + L.as);
    float* red = reinterpret_cast<float*>(smem + L.red);
    float* uscale = reinterpret_cast<float*>(smem + L.uscale);
    float* ubias = reinterpret_cast<float*>(smem + L.ubias);
    int* route = reinterpret_cast<int*>(smem + L.route);
    uint8_t* ring = smem + L.ring;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grid = gridDim.x, cta = blockIdx.x;
    const int hidden = args.hidden, inter = args.inter, stages = args.stages;
    const int nkb_x = args.hp / 128, nkb_a = args.ip / 128, nkb_w = (args.hp > args.ip ? args.hp : args.ip) / 128;

    // 0. Before the PDL wait (nothing a predecessor writes): this warp's router row, the ring's barriers.
    if (threadIdx.x == 0) stamp(args, 0);
    const int my_e = cta + grid * warp;
    const bool router_warp = warp < kConsumerWarps && my_e < args.num_experts;
    const int nvec = hidden / 8;
    uint4 wv[kVecPerLane];
#pragma unroll
    for (int v = 0; v < kVecPerLane; ++v) {
        const int idx = lane + v * 32;
        wv[v] = router_warp && idx < nvec
                    ? __ldg(reinterpret_cast<const uint4*>(args.router_w + static_cast<size_t>(my_e) * hidden) + idx)
                    : make_uint4(0, 0, 0, 0);
    }
    // warp 0 routes after B1: the router bias now (lane + 32 i)
    float bias_v[kMaxExperts / 32];
#pragma unroll
    for (int i = 0; i < kMaxExperts / 32; ++i) {
        const int e = lane + 32 * i;
        bias_v[i] = warp == 0 && e < args.num_experts ? __bfloat162float(args.router_b[e]) : 0.f;
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbar_init(smem_u32(bars + s), args.producer == 2 ? kProducerWarps * 32 : 1);
            mbar_init(smem_u32(bars + kMaxStages + s), kConsumerWarps);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (threadIdx.x == 0) stamp(args, 1);

    // 1. Logits (one warp per expert, the CUDA front's order), the token's FP8 row, CTA 0 zeroes the amax.
    if (router_warp) {
        const uint4* xrow = reinterpret_cast<const uint4*>(args.x);
        float acc = 0.f;
#pragma unroll
        for (int v = 0; v < kVecPerLane; ++v) {
            const int idx = lane + v * 32;
            const uint4 xv = idx < nvec ? xrow[idx] : make_uint4(0, 0, 0, 0);
            const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
            const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv[v]);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 xf = __bfloat1622float2(xp[q]), wf = __bfloat1622float2(wp[q]);
                acc = fmaf(xf.x, wf.x, acc);
                acc = fmaf(xf.y, wf.y, acc);
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) args.logits[my_e] = acc;
    }
    if (warp < kConsumerWarps) {
        for (int kb = warp; kb < nkb_x; kb += kConsumerWarps) {
            const int c = kb * 128 + lane * 4;  // hidden % 64 == 0: a lane's 4 channels are all real or all padding
            float v[4] = {0.f, 0.f, 0.f, 0.f};
            if (c < hidden) {
                const uint2 raw = *reinterpret_cast<const uint2*>(args.x + c);
                const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
                const float2 lo = __bfloat1622float2(p[0]), hi = __bfloat1622float2(p[1]);
                v[0] = lo.x; v[1] = lo.y; v[2] = hi.x; v[3] = hi.y;
            }
            const float amax = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
            const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.f);
            *reinterpret_cast<uint32_t*>(xq + c) = quant4(v, scale);
            if (lane == 0) xs[kb] = scale;
        }
    }
    if (cta == 0)
        for (int i = threadIdx.x; i < kMaxSlots * nkb_a; i += kThreads) args.amax[i] = 0u;
    __syncthreads();
    if (threadIdx.x == 0) grid_barrier(args.barrier, grid);  // B1: every logit written
    __syncthreads();
    if (threadIdx.x == 0) stamp(args, 2);

    // 2. Routing in every CTA from the same logits (warp 0): bias, bf16 rounding, top-k with ties to the lower id,
    // softmax over the k (the CUDA front's instructions), this rank's slots in ascending expert order.
    if (warp == 0) {
        constexpr int kVals = kMaxExperts / 32;
        float val[kVals];
#pragma unroll
        for (int i = 0; i < kVals; ++i) {
            const int e = lane + 32 * i;
            val[i] = e < args.num_experts
                         ? __bfloat162float(__float2bfloat16_rn(__ldcg(args.logits + e) + bias_v[i]))
                         : -INFINITY;
        }
        int chosen[kMaxSlots];
        float picked[kMaxSlots];
#pragma unroll
        for (int j = 0; j < kMaxSlots; ++j) {
            if (j >= args.top_k) break;
            float bv = -INFINITY;
            int bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < kVals; ++i) {
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
            for (int i = 0; i < kVals; ++i)
                if (lane + 32 * i == bi) val[i] = -INFINITY;
        }
        if (lane == 0) {
            const float top = picked[0];
            float p[kMaxSlots];
            float sum = 0.f;
            for (int j = 0; j < args.top_k; ++j) {
                p[j] = ex2_approx((picked[j] - top) * 1.4426950408889634f);
                sum += p[j];
            }
            int locals[kMaxSlots];
            int n = 0;
            for (int j = 0; j < args.top_k; ++j) {
                const float wj = __fdiv_rn(p[j], sum);
                if (cta == 0) {
                    args.ids[j] = chosen[j];
                    args.weights[j] = wj;
                }
                route[kRouteWeight + j] = __float_as_int(wj);
                const int e_loc = chosen[j] - args.first_expert;
                if (e_loc >= 0 && e_loc < args.num_local) {
                    int at = n++;  // insertion: slots in ascending expert order
                    while (at > 0 && locals[at - 1] > e_loc) { locals[at] = locals[at - 1]; --at; }
                    locals[at] = e_loc;
                }
            }
            for (int s = 0; s < n; ++s) route[kRouteSlots + s] = locals[s];
            for (int j = 0; j < args.top_k; ++j) {
                const int e_loc = chosen[j] - args.first_expert;
                int slot = -1;
                for (int s = 0; s < n; ++s)
                    if (locals[s] == e_loc) slot = s;
                route[kRoutePairSlot + j] = slot;
            }
            route[0] = n;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) stamp(args, 3);
    const int n_act = route[0];
    if (n_act == 0) {  // none of this rank's experts: its contribution is zero (every CTA took the same branch)
        for (int d = cta * kThreads + threadIdx.x; d < hidden; d += grid * kThreads) args.out[d] = __float2bfloat16(0.f);
        return;
    }
    const int g1 = 2 * inter / kTileRows, g2 = hidden / kTileRows;
    const int n1 = n_act * g1, total = n1 + n_act * g2;
    const int my_units = cta < total ? (total - 1 - cta) / grid + 1 : 0;
    const int my_gate_up = cta < n1 ? (n1 - 1 - cta) / grid + 1 : 0;

    // 3. The producer warps: every unit's 16 rows into the ring as soon as a slot is free: one bulk copy per row
    // (one warp), or 16-byte cp.async by all four warps, each thread's completion an arrival on the slot's barrier.
    if (warp >= kConsumerWarps) {
        const int ptid = threadIdx.x - kConsumerWarps * 32;
        if (args.producer != 2 && ptid >= 32) return;
        for (int i = 0; i < my_units; ++i) {
            const int s = i % stages, round = i / stages;
            if (round > 0) mbar_wait(smem_u32(bars + kMaxStages + s), (round - 1) & 1);
            const Unit w = unit_of(i, cta, grid, n_act, n1);
            const int e = route[kRouteSlots + w.slot];
            const uint8_t* src;
            int bytes, row_bytes;
            if (w.gate_up) {
                src = args.w13 + (static_cast<size_t>(e) * 2 * inter + w.tile * kTileRows) * args.hp;
                bytes = hidden;
                row_bytes = args.hp;
            } else {
                src = args.w2 + (static_cast<size_t>(e) * hidden + w.tile * kTileRows) * args.ip;
                bytes = inter;
                row_bytes = args.ip;
            }
            const uint32_t full = smem_u32(bars + s);
            if (args.producer == 2) {
                const int per_row = bytes / 16;
                uint8_t* dst = ring + static_cast<size_t>(s) * kTileRows * L.row_stride;
                for (int q = ptid; q < kTileRows * per_row; q += kProducerWarps * 32) {
                    const int r = q / per_row, c = q - r * per_row;
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                                 :: "r"(smem_u32(dst + r * L.row_stride + c * 16)),
                                    "l"(src + static_cast<size_t>(r) * row_bytes + c * 16) : "memory");
                }
                asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(full) : "memory");
                continue;
            }
            if (args.producer == 1) {  // probe: the tile's rows as one copy, their K padding included
                if (lane == 0) {
                    mbar_expect_tx(full, kTileRows * row_bytes);
                    bulk_copy(smem_u32(ring + static_cast<size_t>(s) * kTileRows * L.row_stride), src,
                              kTileRows * row_bytes, full);
                }
                continue;
            }
            if (lane == 0) mbar_expect_tx(full, kTileRows * bytes);
            __syncwarp();
            if (lane < kTileRows)
                bulk_copy(smem_u32(ring + (static_cast<size_t>(s) * kTileRows + lane) * L.row_stride),
                          src + static_cast<size_t>(lane) * row_bytes, bytes, full);
        }
        if (ptid == 0) stamp(args, 11);
        return;
    }

    // 4. Consumers. First the scales and biases of this CTA's units (one round trip, while the first copies fly).
    const int per_unit = nkb_w + kTileRows;
    for (int idx = threadIdx.x; idx < my_units * per_unit; idx += kConsumerWarps * 32) {
        const int i = idx / per_unit, j = idx - i * per_unit;
        const Unit w = unit_of(i, cta, grid, n_act, n1);
        const int e = route[kRouteSlots + w.slot];
        if (j < nkb_w) {
            float v = 0.f;
            if (w.gate_up && j < nkb_x)
                v = args.s13[(static_cast<size_t>(e) * ((2 * inter + 127) / 128) + w.tile / 8) * nkb_x + j];
            else if (!w.gate_up && j < nkb_a)
                v = args.s2[(static_cast<size_t>(e) * ((hidden + 127) / 128) + w.tile / 8) * nkb_a + j];
            uscale[i * nkb_w + j] = v;
        } else {
            const int r = w.tile * kTileRows + (j - nkb_w);
            ubias[i * kTileRows + (j - nkb_w)] =
                w.gate_up ? args.b13[static_cast<size_t>(e) * 2 * inter + r] : args.b2[static_cast<size_t>(e) * hidden + r];
        }
    }
    consumers_sync();

    const int g = lane >> 2, t = lane & 3;
    auto run_unit = [&](int i) {
        const int s = i % stages;
        mbar_wait(smem_u32(bars + s), (i / stages) & 1);
        if (i == 0 && threadIdx.x == 0) stamp(args, 4);
        if (args.copy_only) {  // probe: the stream alone
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_u32(bars + kMaxStages + s));
            return;
        }
        const Unit w = unit_of(i, cta, grid, n_act, n1);
        const uint8_t* st = ring + static_cast<size_t>(s) * kTileRows * L.row_stride;
        const int k = w.gate_up ? hidden : inter;
        const uint8_t* bq = w.gate_up ? xq : aq + static_cast<size_t>(w.slot) * args.ip;
        const float* bs = w.gate_up ? xs : as + w.slot * nkb_a;
        const float* ws = uscale + i * nkb_w;
        float acc0 = 0.f, acc2 = 0.f;
        for (int kb = warp; kb * 128 < k; kb += kConsumerWarps) {
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            const int chunks = min(2, (k - kb * 128) / 64);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                if (c < chunks) {
                    const int off = kb * 128 + c * 64 + t * 16;
                    const uint4 lo = *reinterpret_cast<const uint4*>(st + g * L.row_stride + off);
                    const uint4 hi = *reinterpret_cast<const uint4*>(st + (g + 8) * L.row_stride + off);
                    const uint4 b = *reinterpret_cast<const uint4*>(bq + off);
                    mma_e4m3(d, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
                    mma_e4m3(d, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
                }
            }
            const float sc = ws[kb] * bs[kb];
            acc0 = fmaf(d[0], sc, acc0);
            acc2 = fmaf(d[2], sc, acc2);
        }
        float* rb = red + (i & 1) * kConsumerWarps * kTileRows;
        if (t == 0) {
            rb[warp * kTileRows + g] = acc0;
            rb[warp * kTileRows + g + 8] = acc2;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(bars + kMaxStages + s));  // this warp is done with the slot
        consumers_sync();
        if (warp != 0) return;
        // Epilogue (warp 0, lane r = row r of the tile): partials in warp order, bf16 rounding, bias.
        float h = 0.f;
        if (lane < kTileRows) {
#pragma unroll
            for (int q = 0; q < kConsumerWarps; ++q) h += rb[q * kTileRows + lane];
            h = __bfloat162float(__float2bfloat16_rn(h)) + ubias[i * kTileRows + lane];
        }
        if (w.gate_up) {  // rows (2c, 2c + 1) are (gate, up) of channel tile * 8 + c
            const float up_in = __shfl_xor_sync(0xffffffffu, h, 1);
            float a = 0.f;
            if (lane < kTileRows && !(lane & 1)) {
                const float gate = fminf(h, args.limit);
                const float up = fminf(fmaxf(up_in, -args.limit), args.limit);
                a = __fdiv_rn(gate, 1.f + ex2_approx(-args.alpha * gate * 1.4426950408889634f)) * (up + 1.f);
                args.act[static_cast<size_t>(w.slot) * inter + w.tile * 8 + lane / 2] = a;
            }
            const float m = warp_max(fabsf(a));
            if (lane == 0) atomicMax(args.amax + w.slot * nkb_a + (w.tile * 8) / 128, __float_as_uint(m));
        } else if (lane < kTileRows) {
            args.ybuf[static_cast<size_t>(w.slot) * hidden + w.tile * kTileRows + lane] = h;
        }
    };

    for (int i = 0; i < my_gate_up; ++i) run_unit(i);
    consumers_sync();
    if (threadIdx.x == 0) stamp(args, 5);
    if (threadIdx.x == 0) grid_barrier(args.barrier, grid);  // B2: every activation and its amax written
    consumers_sync();
    if (threadIdx.x == 0) stamp(args, 6);
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // all CTAs are resident by now
    // The activation of each slot to FP8 per 128 channels (every CTA: its down units may be any slot's). Every load
    // first, then the math: one round trip (a loop of load-then-store took one per block, ~5 us on the H200).
    {
        constexpr int kPer = kMaxSlots * kMaxKBlocks / kConsumerWarps;
        float4 f[kPer];
        unsigned am[kPer];
        const int blocks = n_act * nkb_a;
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
            const int blk = warp + j * kConsumerWarps;
            const int slot = blk / nkb_a, c = (blk - slot * nkb_a) * 128 + lane * 4;  // inter % 64 == 0
            f[j] = blk < blocks && c < inter
                       ? __ldcg(reinterpret_cast<const float4*>(args.act + static_cast<size_t>(slot) * inter + c))
                       : make_float4(0.f, 0.f, 0.f, 0.f);
            am[j] = blk < blocks ? __ldcg(args.amax + blk) : 0u;
        }
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
            const int blk = warp + j * kConsumerWarps;
            if (blk < blocks) {
                const int slot = blk / nkb_a, c = (blk - slot * nkb_a) * 128 + lane * 4;
                const float v[4] = {f[j].x, f[j].y, f[j].z, f[j].w};
                const float scale = __fdiv_rn(fmaxf(__uint_as_float(am[j]), 1e-4f), 448.f);
                *reinterpret_cast<uint32_t*>(aq + static_cast<size_t>(slot) * args.ip + c) = quant4(v, scale);
                if (lane == 0) as[blk] = scale;
            }
        }
    }
    consumers_sync();
    if (threadIdx.x == 0) stamp(args, 7);
    for (int i = my_gate_up; i < my_units; ++i) run_unit(i);
    consumers_sync();
    if (threadIdx.x == 0) stamp(args, 8);
    if (threadIdx.x == 0) grid_barrier(args.barrier, grid);  // B3: every down row written
    consumers_sync();
    if (threadIdx.x == 0) stamp(args, 9);

    // 5. Combine a slice of the output: the k pairs in routing order, fp32, then bf16.
    const int per_cta = (hidden + grid - 1) / grid;
    const int d = cta * per_cta + threadIdx.x;
    if (threadIdx.x < per_cta && d < hidden) {
        float acc = 0.f;
        for (int j = 0; j < args.top_k; ++j) {
            const int slot = route[kRoutePairSlot + j];
            if (slot >= 0)
                acc = fmaf(__int_as_float(route[kRouteWeight + j]), __ldcg(args.ybuf + static_cast<size_t>(slot) * hidden + d), acc);
        }
        args.out[d] = __float2bfloat16_rn(acc);
    }
    if (threadIdx.x == 0) stamp(args, 10);
}

size_t smem_bytes(int hp, int ip, int stages, int max_units) { return layout_of(hp, ip, stages, max_units).total; }

int max_units(int hidden, int inter, int grid) {
    const int total = kMaxSlots * (2 * inter / kTileRows + hidden / kTileRows);
    return (total + grid - 1) / grid;
}

cudaError_t prepare(int device, int smem, int* grid) {
    cudaError_t err = cudaFuncSetAttribute(moe_layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    int sms = 0, per_sm = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_layer_kernel, kThreads, smem);
    if (err != cudaSuccess) return err;
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    *grid = sms;  // one CTA per SM: all resident, as the grid barriers need
    return cudaSuccess;
}

cudaError_t launch(const Args& args, int grid, size_t smem, cudaStream_t stream, bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid, 1, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, moe_layer_kernel, args);
}

}  // namespace moe_decode_layer
