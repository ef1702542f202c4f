// The FP8 experts of a decode-sized MoE layer in one launch (Hopper, sm_90a): gate_up GEMM, bias, clamped
// SwiGLU, the activation's FP8 quantization and the down GEMM, for steps of at most 8 tokens.
//
// After the fused decode front (router, top-k, masked plan, the token rows of x in FP8), the FP8 path ran
// three dependent launches per layer: the gate_up decode GEMM, SwiGLU + quantization, the down decode GEMM.
// Each pays a fixed ~5 us at batch 1 (launch, routing loads, ramp and tail: kernels/moe/NOTES.md) against
// ~24 us of weight bytes at the copy ceiling. Here one cluster of 4 CTAs owns one 128-channel block of the
// SwiGLU activation of one active expert:
//   1. each CTA computes 32 channels' gate and up rows (64 weight rows x all of K) for the expert's tokens,
//   2. adds the bias, applies the clamped SwiGLU, and the four CTAs exchange their per-token amax through
//      distributed shared memory, so the block is quantized to FP8 with one scale per token per 128 channels,
//      exactly as the separate SwiGLU kernel quantizes it,
//   3. each CTA multiplies that 128-deep block with a quarter of the down weights' rows (the weights' columns
//      of this block) and writes the fp32 product scaled by both block scales: the partial sum of this K block.
// No CTA waits on another cluster: the combine that follows sums the Kp/128 partials of each pair in a fixed
// order, rounds to bf16 and adds the bias (kernels/moe/epilogues_triton.combine, reading row p for pair p through
// the `pair_rows` this kernel writes), so results do not depend on scheduling.
//
// Tensor cores: mma.sync m16n8k32 on e4m3 (weights as A, 16 rows x 32 K; tokens as B, 32 K x 8 tokens), fp32
// accumulation, one fp32 partial per 128-deep K block scaled by the weight block's scale times the token's
// scale (DeepGEMM's promotion interval). K is permuted inside each 64-deep chunk so that every lane loads 16
// contiguous bytes of a weight row (and of a token row) per two mmas: lane (g, t) holds bytes [16t, 16t + 16)
// of rows g and g + 8; bytes 8m .. 8m + 3 of them feed mma m's K 4t .. 4t + 3 and bytes 8m + 4 .. 8m + 7 its
// K 4t + 16 .. 4t + 19 (PTX ISA m16n8k32 fragments); the token side uses the same map, so the sum is unchanged.
// Weights stream through a ring of kStages shared-memory slots per warp (cp.async, whole 128-byte lines), one warp
// after the other through its gate_up blocks and then its down tiles, so the down weights are already arriving
// while the cluster meets for the SwiGLU step.
// Twin: kernels/moe/fp8_decode_experts.py `decode_partials_reference`.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace fp8_decode_experts {

namespace cg = cooperative_groups;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kCluster = 4;                   // CTAs per 128-channel activation block
constexpr int kChannels = 128 / kCluster;     // SwiGLU channels per CTA
constexpr int kRows13 = 2 * kChannels;        // gate_up weight rows per CTA (gate and up interleaved)
constexpr int kTiles13 = kRows13 / 16;        // 16-row mma tiles of them
constexpr int kHalves = kWarps / kTiles13;    // K ranges per tile (one warp each)
constexpr int kMaxTokens = 8;                 // one 8-column mma tile of tokens
constexpr int kSlot = 16 * 128;               // bytes per slot
constexpr int kHRow = 192;                    // bytes per token row of the FP8 activation block (bank offset)
static_assert(kThreads == kChannels * kMaxTokens, "the SwiGLU step maps one thread to (token, channel)");

struct Args {
    const uint8_t* xq;        // [T, kp1] e4m3 token rows (the decode front's A)
    const float* xs;          // their scales: token t, block kb at xs[kb * xs_k_stride + t]
    const uint8_t* w13;       // [E, n13, kp1] e4m3
    const float* s13;         // [E, ceil(n13 / 128), kp1 / 128]
    const float* b13;         // [E, n13] fp32
    const uint8_t* w2;        // [E, d, kp2] e4m3
    const float* s2;          // [E, ceil(d / 128), kp2 / 128]
    float* y;                 // [kp2 / 128, T * top_k, d] fp32: partial sums of each pair's down product
    const int* counts;        // [E_local]
    const int* active;        // [slots]: the active experts, the first *num_active valid
    const int* num_active;    // [1]
    const int* token_of_row;  // [E_local * T]: token of masked-layout row e * T + rank
    const int* ids;           // [T, top_k] global expert ids
    const int* row_of_pair;   // [T * top_k]: the masked plan's rows (-1: another rank's expert)
    int* pair_rows;           // [T * top_k] out: the pair's own index where row_of_pair >= 0, else -1 (combine's rows)
    long long xs_k_stride;
    int t, top_k, first_expert, n13, inter, d, kp1, kp2;
    float alpha, limit;
};

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 128-deep block of a 16-row tile: the lane's 16 bytes of rows g and g + 8 in both 64-deep chunks.
struct Block {
    uint4 lo0, hi0, lo1, hi1;
};

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A ring slot holds one block: 16 rows x 128 bytes, row r's 16-byte chunk c at chunk c ^ 4 (r odd): the two rows
// of a quarter-warp's 16-byte reads then fall on disjoint banks. The warp copies whole 128-byte lines (4 rows
// per instruction); rows at or past rows_ok are zero-filled.
__device__ __forceinline__ void issue_block(uint32_t slot, const uint8_t* base, long long row_stride, int rows_ok,
                                            int lane) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = (lane >> 3) + 4 * i, c = lane & 7;
        const bool ok = r < rows_ok;
        cp_async16(slot + r * 128 + ((c ^ ((r & 1) << 2)) << 4), ok ? base + r * row_stride + c * 16 : base, ok);
    }
}

__device__ __forceinline__ void read_block(Block& b, const uint8_t* slot, int g, int t) {
    const int x = (g & 1) << 2;  // rows g and g + 8 share the parity
    b.lo0 = *reinterpret_cast<const uint4*>(slot + g * 128 + ((t ^ x) << 4));
    b.hi0 = *reinterpret_cast<const uint4*>(slot + (g + 8) * 128 + ((t ^ x) << 4));
    b.lo1 = *reinterpret_cast<const uint4*>(slot + g * 128 + (((4 + t) ^ x) << 4));
    b.hi1 = *reinterpret_cast<const uint4*>(slot + (g + 8) * 128 + (((4 + t) ^ x) << 4));
}

// p += the tile's 16 x 8 product over one 128-deep block (B: the token rows' matching 2 x 16 bytes).
__device__ __forceinline__ void block_mma(float (&p)[4], const Block& w, const uint4& x0, const uint4& x1) {
    mma_e4m3(p, w.lo0.x, w.hi0.x, w.lo0.y, w.hi0.y, x0.x, x0.y);
    mma_e4m3(p, w.lo0.z, w.hi0.z, w.lo0.w, w.hi0.w, x0.z, x0.w);
    mma_e4m3(p, w.lo1.x, w.hi1.x, w.lo1.y, w.hi1.y, x1.x, x1.y);
    mma_e4m3(p, w.lo1.z, w.hi1.z, w.lo1.w, w.hi1.w, x1.z, x1.w);
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// exp as Triton lowers tl.exp for fp32 (ex2.approx of x * log2 e), so the SwiGLU matches the separate kernel's.
__device__ __forceinline__ float exp_like_triton(float v) {
    float r;
    asm("ex2.approx.f32 %0, %1;\n" : "=f"(r) : "f"(__fmul_rn(v, 1.4426950408889634f)));
    return r;
}

template <int kStages>  // ring slots per warp (blocks of 16 rows x 128 bytes)
__global__ void __launch_bounds__(kThreads, 3) fused_experts_kernel(const Args args) {
    extern __shared__ __align__(128) uint8_t smem[];  // [warps][kStages][kSlot] rings, the token tile, its scales
    __shared__ float red[kHalves - 1][kTiles13][32][4];
    __shared__ float hpre[kRows13][kMaxTokens];
    __shared__ float amax_sh[kMaxTokens];
    __shared__ float scale_sh[kMaxTokens];
    __shared__ int pair_sh[kMaxTokens];
    __shared__ __align__(16) uint8_t htile[kMaxTokens][kHRow];

    // The routing comes from the previous kernel (the decode front): wait for it before reading anything.
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (blockIdx.x == 0 && blockIdx.y == 0) {  // before any CTA may leave: written even with no active expert
        for (int p = threadIdx.x; p < args.t * args.top_k; p += kThreads)
            args.pair_rows[p] = __ldcg(args.row_of_pair + p) >= 0 ? p : -1;
    }
    const int slot = blockIdx.y;  // the same for the whole cluster: its CTAs leave together
    if (slot >= __ldcg(args.num_active)) return;
    const int expert = __ldcg(args.active + slot);
    const int count = min(__ldcg(args.counts + expert), kMaxTokens);

    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    const int kb2 = blockIdx.x / kCluster;  // the activation block (the down GEMM's K block)
    const int c0 = kb2 * 128 + rank * kChannels;
    const int row0 = 2 * c0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int kb1 = args.kp1 / 128;

    // the warp's stream: gate_up blocks (16-row tile `tile`, its K range) then down tiles (every 8th of this CTA's
    // share of the 16-row output tiles, all at the activation block's 128 columns)
    const int tile = warp % kTiles13, half = warp / kTiles13;
    const int per_half = (kb1 + kHalves - 1) / kHalves;
    const int kb_begin = half * per_half;
    const int nb = max(0, min(kb1, kb_begin + per_half) - kb_begin);
    const int rt2 = (args.d + 15) / 16;
    const int t_first = rank * rt2 / kCluster, t_last = (rank + 1) * rt2 / kCluster;
    const int n_tiles = max(0, (t_last - t_first - warp + kWarps - 1) / kWarps);
    const int tile_row0 = row0 + tile * 16;
    const uint8_t* gu_base = args.w13 + ((long long)expert * args.n13 + tile_row0) * args.kp1 + (long long)kb_begin * 128;
    const int gu_rows_ok = args.n13 - tile_row0;
    const uint8_t* w2_expert = args.w2 + (long long)expert * args.d * args.kp2 + kb2 * 128;
    uint8_t* ring = smem + warp * (kStages * kSlot);
    const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
    auto issue = [&](int j) {  // item j of the stream into slot j % kStages (one commit group per item)
        if (j < nb) {
            issue_block(ring_s + (j % kStages) * kSlot, gu_base + j * 128, args.kp1, gu_rows_ok, lane);
        } else if (j < nb + n_tiles) {
            const int tile2 = t_first + warp + (j - nb) * kWarps;
            issue_block(ring_s + (j % kStages) * kSlot, w2_expert + (long long)tile2 * 16 * args.kp2, args.kp2,
                        args.d - tile2 * 16, lane);
        }
        cp_commit();
    };
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) issue(j);

    // the expert's token rows and their scales into shared memory; each column's pair
    const int x_row = args.kp1 + 64;  // 64-byte offset per row: a quarter-warp's rows fall on other banks
    uint8_t* xs_tile = smem + kWarps * kStages * kSlot;
    float* sx = reinterpret_cast<float*>(xs_tile + static_cast<size_t>(count) * x_row);  // [kb1][kMaxTokens]
    const int pieces = args.kp1 / 16;
    for (int i = threadIdx.x; i < count * pieces; i += kThreads) {
        const int j = i / pieces, piece = i - j * pieces;
        const int tok = __ldcg(args.token_of_row + expert * args.t + j);
        *reinterpret_cast<uint4*>(xs_tile + j * x_row + piece * 16) =
            __ldcg(reinterpret_cast<const uint4*>(args.xq + (long long)tok * args.kp1 + piece * 16));
    }
    for (int i = threadIdx.x; i < kb1 * kMaxTokens; i += kThreads) {
        const int kb = i / kMaxTokens, j = i - kb * kMaxTokens;
        sx[i] = j < count ? __ldcg(args.xs + kb * args.xs_k_stride + __ldcg(args.token_of_row + expert * args.t + j))
                          : 0.f;
    }
    if (threadIdx.x < kMaxTokens) {
        int pair = -1;
        if (static_cast<int>(threadIdx.x) < count) {
            const int tok = __ldcg(args.token_of_row + expert * args.t + threadIdx.x);
            for (int k = 0; k < args.top_k; ++k)
                if (__ldcg(args.ids + tok * args.top_k + k) == expert + args.first_expert) pair = tok * args.top_k + k;
        }
        pair_sh[threadIdx.x] = pair;
    }
    __syncthreads();

    const float* s13_row = args.s13 + ((long long)expert * ((args.n13 + 127) / 128) + row0 / 128) * kb1;
    const bool col_ok = g < count;  // B column g: the expert's token g
    const uint8_t* x_lane = xs_tile + g * x_row + 16 * t;
    const uint4 z = make_uint4(0, 0, 0, 0);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < nb; ++j) {
        cp_wait<kStages - 2>();  // item j has landed (this lane's copies) ...
        __syncwarp();            // ... and the other lanes' too; slot (j - 1) % kStages is read by all
        Block w;
        read_block(w, ring + (j % kStages) * kSlot, g, t);
        issue(j + kStages - 1);
        const int kb = kb_begin + j;
        const uint4 x0 = col_ok ? *reinterpret_cast<const uint4*>(x_lane + kb * 128) : z;
        const uint4 x1 = col_ok ? *reinterpret_cast<const uint4*>(x_lane + kb * 128 + 64) : z;
        float p[4] = {0.f, 0.f, 0.f, 0.f};
        block_mma(p, w, x0, x1);
        const float sw = __ldg(s13_row + kb);
        const float f0 = sw * sx[kb * kMaxTokens + 2 * t], f1 = sw * sx[kb * kMaxTokens + 2 * t + 1];
        acc[0] = fmaf(p[0], f0, acc[0]);
        acc[1] = fmaf(p[1], f1, acc[1]);
        acc[2] = fmaf(p[2], f0, acc[2]);
        acc[3] = fmaf(p[3], f1, acc[3]);
    }

    // the K ranges of each tile meet; bf16 rounding (as the unsplit GEMM's output) and the bias
    if (half > 0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) red[half - 1][tile][lane][j] = acc[j];
    }
    __syncthreads();
    if (half == 0) {
#pragma unroll
        for (int h = 1; h < kHalves; ++h)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j] += red[h - 1][tile][lane][j];
        const int r_lo = tile_row0 + g, r_hi = r_lo + 8;
        const float* bias = args.b13 + (long long)expert * args.n13;
        const float b_lo = r_lo < args.n13 ? __ldg(bias + r_lo) : 0.f, b_hi = r_hi < args.n13 ? __ldg(bias + r_hi) : 0.f;
        const int lr = tile * 16 + g;
        hpre[lr][2 * t] = round_bf16(acc[0]) + b_lo;
        hpre[lr][2 * t + 1] = round_bf16(acc[1]) + b_lo;
        hpre[lr + 8][2 * t] = round_bf16(acc[2]) + b_hi;
        hpre[lr + 8][2 * t + 1] = round_bf16(acc[3]) + b_hi;
    }
    __syncthreads();

    // SwiGLU: warp j = token column j, lane = channel; the block's amax per token across the cluster
    {
        const int j = warp, c = lane;
        float act = 0.f;
        if (j < count && c0 + c < args.inter) {
            const float gate = fminf(hpre[2 * c][j], args.limit);
            const float up = fminf(fmaxf(hpre[2 * c + 1][j], -args.limit), args.limit);
            const float sig = __fdiv_rn(gate, __fadd_rn(1.f, exp_like_triton(__fmul_rn(-args.alpha, gate))));
            act = __fmul_rn(sig, __fadd_rn(up, 1.f));
        }
        float amax = fabsf(act);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        if (lane == 0) amax_sh[j] = amax;
        cluster.sync();
        float block_amax = 0.f;
#pragma unroll
        for (int r = 0; r < kCluster; ++r) block_amax = fmaxf(block_amax, *cluster.map_shared_rank(&amax_sh[j], r));
        const float scale = __fdiv_rn(fmaxf(block_amax, 1e-4f), 448.f);
        const uint32_t code = __nv_cvt_float_to_fp8(__fdiv_rn(act, scale), __NV_SATFINITE, __NV_E4M3);
        // four channels per word, written into every CTA's copy of the block (its K order is the channel order)
        uint32_t word = code;
        word |= __shfl_down_sync(0xFFFFFFFFu, code, 1) << 8;
        word |= __shfl_down_sync(0xFFFFFFFFu, code, 2) << 16;
        word |= __shfl_down_sync(0xFFFFFFFFu, code, 3) << 24;
        if (j < count && (lane & 3) == 0) {
#pragma unroll
            for (int r = 0; r < kCluster; ++r)
                *cluster.map_shared_rank(reinterpret_cast<uint32_t*>(&htile[j][rank * kChannels + c]), r) = word;
        }
        if (lane == 0) scale_sh[j] = scale;
        cluster.sync();  // the block is complete everywhere; no CTA reads a peer's memory after this
    }

    const uint4 h0 = col_ok ? *reinterpret_cast<const uint4*>(&htile[g][16 * t]) : z;
    const uint4 h1 = col_ok ? *reinterpret_cast<const uint4*>(&htile[g][64 + 16 * t]) : z;
    const float sh0 = 2 * t < count ? scale_sh[2 * t] : 0.f, sh1 = 2 * t + 1 < count ? scale_sh[2 * t + 1] : 0.f;
    const int pair0 = pair_sh[2 * t], pair1 = pair_sh[2 * t + 1];
    const int np = args.t * args.top_k, kb2_count = args.kp2 / 128;
    float* y_block = args.y + (long long)kb2 * np * args.d;
    const float* s2_expert = args.s2 + (long long)expert * ((args.d + 127) / 128) * kb2_count + kb2;
    for (int j = nb; j < nb + n_tiles; ++j) {
        cp_wait<kStages - 2>();
        __syncwarp();
        Block w;
        read_block(w, ring + (j % kStages) * kSlot, g, t);
        issue(j + kStages - 1);
        const int tile2 = t_first + warp + (j - nb) * kWarps;
        float p[4] = {0.f, 0.f, 0.f, 0.f};
        block_mma(p, w, h0, h1);
        const float sw = __ldg(s2_expert + (tile2 * 16 / 128) * kb2_count);
        const int n_lo = tile2 * 16 + g, n_hi = n_lo + 8;
        if (pair0 >= 0) {
            const float f = sw * sh0;
            if (n_lo < args.d) y_block[(long long)pair0 * args.d + n_lo] = p[0] * f;
            if (n_hi < args.d) y_block[(long long)pair0 * args.d + n_hi] = p[2] * f;
        }
        if (pair1 >= 0) {
            const float f = sw * sh1;
            if (n_lo < args.d) y_block[(long long)pair1 * args.d + n_lo] = p[1] * f;
            if (n_hi < args.d) y_block[(long long)pair1 * args.d + n_hi] = p[3] * f;
        }
    }
    cp_wait<0>();  // nothing may still be landing in shared memory when the CTA leaves
}

}  // namespace fp8_decode_experts

#ifndef FP8_DECODE_EXPERTS_NO_TORCH
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

namespace fp8_decode_experts {

using Kernel = void (*)(const Args);

Kernel select(int64_t stages) {
    TORCH_CHECK(stages >= 2 && stages <= 4, "2..4 ring stages");
    return stages == 2 ? fused_experts_kernel<2> : stages == 3 ? fused_experts_kernel<3> : fused_experts_kernel<4>;
}

size_t dynamic_smem(int64_t stages, int64_t t, int64_t kp1) {
    return static_cast<size_t>(kWarps) * stages * kSlot + static_cast<size_t>(t) * (kp1 + 64) +
           static_cast<size_t>(kp1 / 128) * kMaxTokens * 4;
}

void check_fp8(const torch::Tensor& w, const char* name) {
    TORCH_CHECK(w.is_cuda() && w.scalar_type() == at::kFloat8_e4m3fn && w.dim() == 3 && w.is_contiguous(), name,
                " must be a contiguous CUDA float8_e4m3fn [E, N, Kp] tensor");
}

void launch(torch::Tensor xq, torch::Tensor xs, int64_t xs_k_stride, torch::Tensor w13, torch::Tensor s13,
            torch::Tensor b13, torch::Tensor w2, torch::Tensor s2, torch::Tensor y, torch::Tensor counts,
            torch::Tensor active, torch::Tensor num_active, torch::Tensor token_of_row, torch::Tensor ids,
            torch::Tensor row_of_pair, torch::Tensor pair_rows, int64_t first_expert, double alpha, double limit, bool pdl,
            int64_t stages) {
    check_fp8(w13, "w13");
    check_fp8(w2, "w2");
    const int64_t e = w13.size(0), n13 = w13.size(1), kp1 = w13.size(2), d = w2.size(1), kp2 = w2.size(2);
    const int64_t t = ids.size(0), top_k = ids.size(1);
    TORCH_CHECK(kp1 % 128 == 0 && kp2 % 128 == 0 && n13 % 2 == 0 && n13 / 2 <= kp2 && kp2 < n13 / 2 + 128 &&
                    w2.size(0) == e,
                "w13 [E, 2I, Kp1] and w2 [E, D, Kp2] with Kp multiples of 128 and Kp2 = I padded");
    TORCH_CHECK(xq.is_cuda() && xq.scalar_type() == at::kFloat8_e4m3fn && xq.dim() == 2 && xq.size(0) == t &&
                    xq.size(1) == kp1 && xq.is_contiguous(),
                "xq must be the [T, Kp1] FP8 token rows");
    TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.is_contiguous() && xs.numel() >= (kp1 / 128 - 1) * xs_k_stride + t,
                "xs: fp32 token scales, block kb of token t at kb * xs_k_stride + t");
    TORCH_CHECK(s13.scalar_type() == at::kFloat && s13.is_contiguous() && s13.size(0) == e &&
                    s13.size(1) == (n13 + 127) / 128 && s13.size(2) == kp1 / 128,
                "s13 must be fp32 [E, ceil(2I/128), Kp1/128]");
    TORCH_CHECK(s2.scalar_type() == at::kFloat && s2.is_contiguous() && s2.size(0) == e &&
                    s2.size(1) == (d + 127) / 128 && s2.size(2) == kp2 / 128,
                "s2 must be fp32 [E, ceil(D/128), Kp2/128]");
    TORCH_CHECK(b13.scalar_type() == at::kFloat && b13.is_contiguous() && b13.size(0) == e && b13.size(1) == n13,
                "b13 must be fp32 [E, 2I]");
    TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 3 && y.size(0) == kp2 / 128 &&
                    y.size(1) == t * top_k && y.size(2) == d,
                "y must be fp32 [Kp2/128, T * top_k, D]");
    TORCH_CHECK(counts.scalar_type() == at::kInt && active.scalar_type() == at::kInt &&
                    num_active.scalar_type() == at::kInt && token_of_row.scalar_type() == at::kInt &&
                    ids.scalar_type() == at::kInt && ids.is_contiguous() && counts.numel() >= e &&
                    token_of_row.numel() >= e * t && row_of_pair.scalar_type() == at::kInt &&
                    pair_rows.scalar_type() == at::kInt && row_of_pair.numel() == t * top_k &&
                    pair_rows.numel() == t * top_k,
                "counts, active, num_active, token_of_row, ids, row_of_pair and pair_rows must be int32");
    TORCH_CHECK(t >= 1 && t <= kMaxTokens, "1..", kMaxTokens, " tokens");
    TORCH_CHECK(kp1 / 128 * kMaxTokens * 4 + t * (kp1 + 64) <= 64 * 1024, "K too large for the token tile");

    Args args;
    args.xq = reinterpret_cast<const uint8_t*>(xq.data_ptr());
    args.xs = xs.data_ptr<float>();
    args.w13 = reinterpret_cast<const uint8_t*>(w13.data_ptr());
    args.s13 = s13.data_ptr<float>();
    args.b13 = b13.data_ptr<float>();
    args.w2 = reinterpret_cast<const uint8_t*>(w2.data_ptr());
    args.s2 = s2.data_ptr<float>();
    args.y = y.data_ptr<float>();
    args.counts = counts.data_ptr<int>();
    args.active = active.data_ptr<int>();
    args.num_active = num_active.data_ptr<int>();
    args.token_of_row = token_of_row.data_ptr<int>();
    args.ids = ids.data_ptr<int>();
    args.row_of_pair = row_of_pair.data_ptr<int>();
    args.pair_rows = pair_rows.data_ptr<int>();
    args.xs_k_stride = xs_k_stride;
    args.t = static_cast<int>(t);
    args.top_k = static_cast<int>(top_k);
    args.first_expert = static_cast<int>(first_expert);
    args.n13 = static_cast<int>(n13);
    args.inter = static_cast<int>(n13 / 2);
    args.d = static_cast<int>(d);
    args.kp1 = static_cast<int>(kp1);
    args.kp2 = static_cast<int>(kp2);
    args.alpha = static_cast<float>(alpha);
    args.limit = static_cast<float>(limit);

    const c10::cuda::CUDAGuard guard(xq.device());
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(kp2 / 128 * kCluster), static_cast<unsigned>(active.numel()), 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    const Kernel kernel = select(stages);
    cfg.dynamicSmemBytes = dynamic_smem(stages, t, kp1);
    static bool raised[64][5] = {};  // once per device and kernel, before any graph capture uses it
    TORCH_CHECK(xq.device().index() < 64, "device index");
    if (!raised[xq.device().index()][stages]) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
        raised[xq.device().index()][stages] = true;
    }
    cfg.stream = c10::cuda::getCurrentCUDAStream(xq.device().index());
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 2 : 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args));
}

// (clusters that fit on the device at once, CTAs per SM) for this many stages and tokens (a probe for the bench)
std::vector<int64_t> occupancy(int64_t stages, int64_t t, int64_t kp1, int64_t grid_x, int64_t grid_y) {
    const Kernel kernel = select(stages);
    const size_t smem = dynamic_smem(stages, t, kp1);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y), 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0, blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem));
    return {clusters, blocks};
}

}  // namespace fp8_decode_experts

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("fused_experts", &fp8_decode_experts::launch, "FP8 decode experts in one launch (mma.sync e4m3, sm_90a)");
    m.def("occupancy", &fp8_decode_experts::occupancy, "(max active clusters, CTAs per SM) of a configuration");
}
#endif
