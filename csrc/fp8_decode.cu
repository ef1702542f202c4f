// Decode-sized grouped GEMM over the FP8 (e4m3, 128x128 block-scaled) experts with mma.sync (Hopper, sm_90a).
//
// out[e * rows_per_group + t, n] = sum_k A[row(t), k] * W[e][n, k] for the active experts' first counts[e]
// (<= 8) rows: the masked-layout GEMM kernels/moe/triton_grouped_gemm.py `grouped_gemm_decode` computes, read
// from the same tensors (no re-pack: the prefill's DeepGEMM reads these weights too). A is e4m3 with one fp32
// scale per row and 128 K (Fp8Rows); W e4m3 [E, N, Kp] with one fp32 scale per 128 x 128 block.
//
// Weights are the mma's A operand (16 output channels x 32 K, `mma.sync.m16n8k32.row.col.f32.e4m3.e4m3.f32`),
// tokens its B operand (32 K x 8 tokens). No conversion and no shared memory on the weight path: per 128 K
// of a 16-row tile each lane loads 16 bytes at K 16c and 16 bytes at K 64 + 16c of its rows g and g + 8
// (g = lane / 4, c = lane % 4; each load instruction of the warp covers whole 64-byte halves of 8 rows), and
// the four mmas of the block take these words as their A fragments. That assigns K to the mma's logical
// K positions in a different order than the memory's, which a dot product does not see as long as the
// B fragment (the token's bytes, from shared memory) follows the same order: lane (g, c) holds, for the
// mma's logical K 4c..4c+3 and 16+4c..16+4c+3, the physical K of its own words 2j and 2j + 1.
// Each 128-deep block's four mmas start from zero and the block's product is scaled in fp32 (weight block
// scale x the token's scale) and added to the sum, the promotion DeepGEMM does after each 128 K.
//
// Parallelism: a block serves one active expert (grid.y = its slot) and stages that expert's <= 8 token rows
// (and their scales) in shared memory; its warps stream items (16-row tile, K split) of that expert,
// warp w of the expert's warps taking items w, w + W, ...; one register ring of DEPTH 128-deep blocks per
// warp runs across item boundaries, so a warp's loads stay in flight from its first block to its last.
// K splits > 1 write fp32 partial sums [splits, rows, N] (the consumers add them, as for the Triton
// kernel); one split writes bf16 [rows, N]. Launched with programmatic stream serialization when asked:
// griddepcontrol.wait comes first (the routing comes from the previous kernel).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace fp8_decode {

constexpr int kWarps = 8;        // warps per block
constexpr int kMaxTokens = 8;    // one 8-token mma column tile
constexpr int kBlock = 128;      // K (and N) extent of one scale block
constexpr int kMaxKBlocks = 32;  // Kp <= 4096
constexpr int kRowPad = 64;      // shared-memory row stride = Kp + 64: rows g and g + 1 on different banks

struct Args {
    const uint8_t* a;      // [rows or tokens, Kp] e4m3
    const float* sfa;      // Fp8Rows.scale_storage [groups, KB, rows_aligned]
    const uint8_t* w;      // [E, N, Kp] e4m3
    const float* sfw;      // [E, N / 128, KB]
    float* out_f32;        // [splits, rows, N] (splits > 1)
    __nv_bfloat16* out_bf16;  // [rows, N] (splits == 1)
    const int* counts;     // [E]
    const int* active;     // [slots]: expert ids, the first *num_active valid
    const int* num_active; // [1]
    const int* a_row_map;  // [E * rows_per_group] -> row of A, or null (A in the masked layout)
    long long stride_a, stride_we, stride_wn, stride_out, stride_split;
    long long sfa_group_stride, sfa_k_stride, sfw_group_stride, sfw_n_stride;
    int rows_per_group, n, kb, row_tiles, splits, max_tokens, blocks_per_slot;
};

// LOAD 0: the read-only path, no L1 allocation; 1: the plain path, no L1 allocation; 2: 1 and the L2 fetching
// the whole 256-byte segment (the next K block of the same rows, which this warp reads next).
template <int LOAD>
__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
    uint4 v;
    if constexpr (LOAD == 0) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if constexpr (LOAD == 1) {
        asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else {
        asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    }
    return v;
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 128-deep block of one 16-row tile: the lane's 64 weight bytes and its weight-block scale.
struct Slot {
    uint4 lo0, hi0, lo8, hi8;  // row g: K 16c.., 64+16c..; row g + 8: the same
    float ws;
};

// Where a warp is in its stream of (item, K block): item = tile * splits + split.
struct Cursor {
    int item, tile, split, kb, kb_end;
    __device__ __forceinline__ bool set(const Args& args, int it, int items) {
        item = it;
        if (it >= items) return false;
        tile = it / args.splits;
        split = it - tile * args.splits;
        const int per = (args.kb + args.splits - 1) / args.splits;
        kb = split * per;
        kb_end = min(kb + per, args.kb);
        return kb < kb_end;
    }
};

// Units (K blocks) of the warp's items it0, it0 + stride, ...
__device__ __forceinline__ int warp_units(const Args& args, int it0, int stride, int items) {
    const int per = (args.kb + args.splits - 1) / args.splits;
    int units = 0;
    for (int it = it0; it < items; it += stride) {
        const int split = it % args.splits;
        units += max(0, min(per, args.kb - split * per));
    }
    return units;
}

template <int DEPTH, int LOAD>
__global__ void __launch_bounds__(kWarps * 32, 2) fp8_mma_decode_kernel(const Args args) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    const int slot = blockIdx.y;
    const int num_active = __ldcg(args.num_active);
    const int expert = __ldcg(args.active + slot);
    if (slot >= num_active) return;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int items = args.row_tiles * args.splits;
    const int stride = args.blocks_per_slot * kWarps;
    const int it0 = blockIdx.x * kWarps + warp;
    const long long row0 = (long long)expert * args.rows_per_group;
    const uint8_t* w_e = args.w + expert * args.stride_we + (long long)g * args.stride_wn + 16 * c;
    const float* sfw_e = args.sfw + expert * args.sfw_group_stride;

    // The first DEPTH blocks' weights go out before anything else: they need only the expert id.
    Cursor issue;
    bool more = issue.set(args, it0, items);
    Slot ring[DEPTH];
    auto fill = [&](Slot& s) {
        const int tile = issue.tile;
        const uint8_t* p = w_e + (long long)tile * 16 * args.stride_wn + issue.kb * kBlock;
        s.lo0 = load_stream<LOAD>(p);
        s.hi0 = load_stream<LOAD>(p + 64);
        s.lo8 = load_stream<LOAD>(p + 8 * args.stride_wn);
        s.hi8 = load_stream<LOAD>(p + 8 * args.stride_wn + 64);
        s.ws = __ldg(sfw_e + (tile >> 3) * args.sfw_n_stride + issue.kb);
        if (++issue.kb == issue.kb_end) more = issue.set(args, issue.item + stride, items);
    };
#pragma unroll
    for (int j = 0; j < DEPTH; ++j)
        if (more) fill(ring[j]);

    // The expert's token rows and scales -> shared memory (rows past count are never read).
    extern __shared__ __align__(16) uint8_t smem[];
    const int row_bytes = args.kb * kBlock + kRowPad;
    float* s_scale = reinterpret_cast<float*>(smem + kMaxTokens * row_bytes);  // [KB][8]
    __shared__ int s_row[kMaxTokens];
    const int count = min(__ldcg(args.counts + expert), args.max_tokens);
    if (threadIdx.x < kMaxTokens)
        s_row[threadIdx.x] = threadIdx.x < count ? (args.a_row_map ? __ldcg(args.a_row_map + row0 + threadIdx.x)
                                                                   : (int)(row0 + threadIdx.x))
                                                 : 0;
    __syncthreads();
    const int pieces = args.kb * (kBlock / 16);
    for (int i = threadIdx.x; i < count * pieces; i += blockDim.x) {
        const int t = i / pieces, p = i - t * pieces;
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(args.a + s_row[t] * args.stride_a) + p);
        *reinterpret_cast<uint4*>(smem + t * row_bytes + p * 16) = v;
    }
    for (int i = threadIdx.x; i < args.kb * kMaxTokens; i += blockDim.x) {
        const int kb = i / kMaxTokens, t = i - kb * kMaxTokens;
        float s = 0.f;
        if (t < count) {
            const float* base = args.a_row_map ? args.sfa + s_row[t]
                                               : args.sfa + expert * args.sfa_group_stride + t;
            s = __ldcg(base + kb * args.sfa_k_stride);
        }
        s_scale[i] = s;
    }
    __syncthreads();

    const int n_units = warp_units(args, it0, stride, items);
    const uint8_t* xrow = smem + g * row_bytes + 16 * c;  // token g's bytes at K 16c (+64)
    const bool has_token = g < count;
    Cursor use;
    use.set(args, it0, items);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};

    for (int i = 0; i < n_units; i += DEPTH) {
#pragma unroll
        for (int j = 0; j < DEPTH; ++j) {
            if (i + j < n_units) {
                const Slot& s = ring[j];
                uint4 xl = make_uint4(0, 0, 0, 0), xh = make_uint4(0, 0, 0, 0);
                if (has_token) {
                    xl = *reinterpret_cast<const uint4*>(xrow + use.kb * kBlock);
                    xh = *reinterpret_cast<const uint4*>(xrow + use.kb * kBlock + 64);
                }
                const float2 ts = *reinterpret_cast<const float2*>(s_scale + use.kb * kMaxTokens + 2 * c);
                float p[4] = {0.f, 0.f, 0.f, 0.f};
                mma_e4m3(p, s.lo0.x, s.lo8.x, s.lo0.y, s.lo8.y, xl.x, xl.y);
                mma_e4m3(p, s.lo0.z, s.lo8.z, s.lo0.w, s.lo8.w, xl.z, xl.w);
                mma_e4m3(p, s.hi0.x, s.hi8.x, s.hi0.y, s.hi8.y, xh.x, xh.y);
                mma_e4m3(p, s.hi0.z, s.hi8.z, s.hi0.w, s.hi8.w, xh.z, xh.w);
                const float s0 = s.ws * ts.x, s1 = s.ws * ts.y;
                acc[0] = fmaf(p[0], s0, acc[0]);
                acc[1] = fmaf(p[1], s1, acc[1]);
                acc[2] = fmaf(p[2], s0, acc[2]);
                acc[3] = fmaf(p[3], s1, acc[3]);
                if (more) fill(ring[j]);  // the slot is consumed: refill it in place
                if (++use.kb == use.kb_end) {
                    // Item done: rows tile * 16 + g (+ 8), tokens 2c, 2c + 1.
                    const int tile = use.tile, split = use.split;
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int tok = 2 * c + (r & 1);
                        const int col = tile * 16 + g + 8 * (r >> 1);
                        if (tok < count) {
                            const long long o = (row0 + tok) * args.stride_out + col;
                            if (args.splits > 1) {
                                args.out_f32[split * args.stride_split + o] = acc[r];
                            } else {
                                args.out_bf16[o] = __float2bfloat16(acc[r]);
                            }
                        }
                        acc[r] = 0.f;
                    }
                    use.set(args, use.item + stride, items);
                }
            }
        }
    }
}

}  // namespace fp8_decode

#ifndef FP8_DECODE_KERNELS_ONLY
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

namespace fp8_decode {

using Kernel = void (*)(const Args);

template <int LOAD>
Kernel select_depth(int depth) {
    if (depth == 2) return fp8_mma_decode_kernel<2, LOAD>;
    if (depth == 3) return fp8_mma_decode_kernel<3, LOAD>;
    if (depth == 4) return fp8_mma_decode_kernel<4, LOAD>;
    return nullptr;
}

Kernel select(int depth, int load) {
    if (load == 0) return select_depth<0>(depth);
    if (load == 1) return select_depth<1>(depth);
    if (load == 2) return select_depth<2>(depth);
    return nullptr;
}

void launch(torch::Tensor a, torch::Tensor sfa, torch::Tensor w, torch::Tensor sfw, torch::Tensor out,
            torch::Tensor counts, torch::Tensor active, torch::Tensor num_active,
            c10::optional<torch::Tensor> a_row_map, int64_t rows_per_group, int64_t max_tokens,
            int64_t blocks_per_slot, int64_t depth, int64_t load, bool pdl) {
    const auto fp8 = at::kFloat8_e4m3fn;
    TORCH_CHECK(a.is_cuda() && a.scalar_type() == fp8 && a.dim() == 2 && a.stride(1) == 1,
                "A must be CUDA float8_e4m3fn [rows, Kp] with unit stride along K");
    TORCH_CHECK(w.scalar_type() == fp8 && w.dim() == 3 && w.stride(2) == 1, "W must be float8_e4m3fn [E, N, Kp]");
    const int64_t e = w.size(0), n = w.size(1), kp = w.size(2);
    TORCH_CHECK(a.size(1) == kp && kp % kBlock == 0 && kp / kBlock <= kMaxKBlocks,
                "A and W must share Kp, a multiple of 128 and at most ", kMaxKBlocks * kBlock);
    TORCH_CHECK(n % 16 == 0, "N must be a multiple of 16 (one mma row tile)");
    TORCH_CHECK(a.stride(0) % 16 == 0 && w.stride(1) % 16 == 0 && w.stride(0) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
                "A and W rows must be 16-byte aligned");
    TORCH_CHECK(sfa.scalar_type() == at::kFloat && sfa.dim() == 3 && sfa.stride(2) == 1 &&
                    sfa.size(1) == kp / kBlock,
                "A's scales must be fp32 [groups, Kp / 128, rows] (Fp8Rows.scale_storage)");
    TORCH_CHECK(sfw.scalar_type() == at::kFloat && sfw.dim() == 3 && sfw.size(0) == e &&
                    sfw.size(1) == (n + kBlock - 1) / kBlock && sfw.size(2) == kp / kBlock && sfw.stride(2) == 1,
                "W's scales must be fp32 [E, ceil(N / 128), Kp / 128]");
    const bool split_out = out.dim() == 3;
    const int64_t splits = split_out ? out.size(0) : 1;
    TORCH_CHECK(out.size(-1) == n && out.stride(-1) == 1 && out.size(-2) >= e * rows_per_group,
                "out must be [E * rows_per_group, N] or [splits, E * rows_per_group, N]");
    TORCH_CHECK(split_out ? out.scalar_type() == at::kFloat : out.scalar_type() == at::kBFloat16,
                "split-K partial sums are fp32, one split is bf16");
    TORCH_CHECK(splits >= 1 && splits <= kp / kBlock, "1 .. Kp / 128 K splits");
    TORCH_CHECK(counts.scalar_type() == at::kInt && active.scalar_type() == at::kInt &&
                    num_active.scalar_type() == at::kInt && counts.numel() >= e,
                "counts, active and num_active must be int32");
    TORCH_CHECK(max_tokens >= 1 && max_tokens <= kMaxTokens && max_tokens <= rows_per_group,
                "1..", kMaxTokens, " tokens per expert");
    if (a_row_map.has_value()) TORCH_CHECK(a_row_map->scalar_type() == at::kInt, "a_row_map must be int32");
    TORCH_CHECK(blocks_per_slot >= 1, "blocks_per_slot >= 1");
    Kernel kernel = select(static_cast<int>(depth), static_cast<int>(load));
    TORCH_CHECK(kernel != nullptr, "no kernel built for DEPTH ", depth, ", LOAD ", load);

    Args args;
    args.a = reinterpret_cast<const uint8_t*>(a.data_ptr());
    args.sfa = sfa.data_ptr<float>();
    args.w = reinterpret_cast<const uint8_t*>(w.data_ptr());
    args.sfw = sfw.data_ptr<float>();
    args.out_f32 = split_out ? out.data_ptr<float>() : nullptr;
    args.out_bf16 = split_out ? nullptr : reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>());
    args.counts = counts.data_ptr<int>();
    args.active = active.data_ptr<int>();
    args.num_active = num_active.data_ptr<int>();
    args.a_row_map = a_row_map.has_value() ? a_row_map->data_ptr<int>() : nullptr;
    args.stride_a = a.stride(0);
    args.stride_we = w.stride(0);
    args.stride_wn = w.stride(1);
    args.stride_out = out.stride(-2);
    args.stride_split = split_out ? out.stride(0) : 0;
    args.sfa_group_stride = sfa.stride(0);
    args.sfa_k_stride = sfa.stride(1);
    args.sfw_group_stride = sfw.stride(0);
    args.sfw_n_stride = sfw.stride(1);
    args.rows_per_group = static_cast<int>(rows_per_group);
    args.n = static_cast<int>(n);
    args.kb = static_cast<int>(kp / kBlock);
    args.row_tiles = static_cast<int>(n / 16);
    args.splits = static_cast<int>(splits);
    args.max_tokens = static_cast<int>(max_tokens);
    args.blocks_per_slot = static_cast<int>(blocks_per_slot);

    const size_t smem = static_cast<size_t>(kMaxTokens) * (kp + kRowPad) + (kp / kBlock) * kMaxTokens * 4;
    const c10::cuda::CUDAGuard guard(a.device());
    static bool raised[64][5][3] = {};  // once per device and kernel, before any graph capture uses it
    TORCH_CHECK(a.device().index() < 64, "device index");
    bool& done = raised[a.device().index()][depth][load];
    if (!done) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
        done = true;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(blocks_per_slot), static_cast<unsigned>(active.numel()), 1);
    cfg.blockDim = dim3(kWarps * 32, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c10::cuda::getCurrentCUDAStream(a.device().index());
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args));
}

}  // namespace fp8_decode

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("fp8_mma_decode", &fp8_decode::launch, "FP8 block-scaled grouped decode GEMM (mma.sync e4m3, sm_90a)");
}
#endif
