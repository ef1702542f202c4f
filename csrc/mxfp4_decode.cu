// Decode-sized grouped GEMM reading the checkpoints' MXFP4 expert weights with mma.sync (Hopper, sm_90a).
//
// out[e * rows_per_group + t, n] = sum_k A[row(t), k] * W[e][n, k] for the active experts' first counts[e] rows,
// W[e][n, k] = E2M1(code) * 2^(scale[e, n, k / 32] - 127). Weights are the mma's A operand (16 output channels
// x 16 K), tokens its B operand (16 K x 8 tokens; T = 1 leaves 7 columns zero). kernels/moe/mxfp4_cuda.py
// re-packs the checkpoint once so that each lane of a warp loads, per 64 K of a 16-row tile, one 16-byte
// vector: four 32-bit words, one per m16n8k16 mma, each the 8 codes of that lane's A fragment. No shared
// memory and no shuffles on the weight path: a word becomes the lane's four f16x2 A registers in 11 integer
// ops (the bit positions are the pack's, `unpack` below is the whole decoder).
//
// The fp16 trick: an E2M1 magnitude code (e1 e0 m) at fp16 bits 11..9 with bits 14..12 zero reads as its
// value x 2^-14 (e = 0 lands on the fp16 subnormals), the sign at bit 15. The MXFP4 group scale (per row,
// per 32 K) is applied in fp32 after the two mmas of its group: partial * 2^(s - 127), exact (a power of
// two), and 2^14 once at the end.
//
// Parallelism: a block is tiles_per_block row tiles (16 output channels each) of one active expert times
// k_splits K ranges, one warp per (tile, range); the expert's token rows sit in shared memory (converted
// from bf16 once per block); each warp streams its contiguous run of weight vectors, and the K ranges meet
// in shared memory at the end. Three ways to keep the weight bytes in flight, one kernel each: "ring"
// (DEPTH 16-byte loads in registers: the fastest at T <= 4 and at T = 16 on the H200), "async" (DEPTH slots
// in shared memory filled by cp.async: twice the bytes in flight, within 5% of ring) and "bulk" (the copy engine
// brings a warp's whole run; its shared memory caps the blocks per SM: slower). kernels/moe/NOTES.md,
// "MXFP4 decode GEMM in CUDA C++". Launched with programmatic stream serialization when asked:
// griddepcontrol.wait comes first (the routing comes from the previous kernel), so only the launch
// latency overlaps.

#include <cuda_fp16.h>

#include "mxfp4_decode.cuh"

namespace mxfp4_decode {

constexpr uint32_t kMag = 0x0E000E00u;   // fp16x2 bits 11..9 of both halves
constexpr uint32_t kSign = 0x80008000u;  // fp16x2 sign bits
constexpr uint32_t kCode = kMag | kSign;

// One word of 8 codes -> the lane's A registers a[i] (i: row +8 if i odd, K +8 if i >= 2; low half the even
// K). Source bits (output half 0 / half 1, mags e1 e0 m high to low, then sign):
//   a0: 11..9 / 27..25, 15 / 31 (in place)      a1: rotate left 13: 30..28 / 14..12, 2 / 18
//   a2: mags << 3: 8..6 / 24..22, sign << 15: 0 / 16
//   a3: mags << 6: 5..3 / 21..19, sign << 14: 1 / 17
// (kernels/moe/mxfp4_cuda.py SOURCE_BITS; no rotate/shift layout gives all four registers one shift each).
__device__ __forceinline__ void unpack(uint32_t w, uint32_t (&a)[4]) {
    a[0] = w & kCode;
    a[1] = __funnelshift_l(w, w, 13) & kCode;
    a[2] = ((w << 3) & kMag) | ((w << 15) & kSign);
    a[3] = ((w << 6) & kMag) | ((w << 14) & kSign);
}

// 2^(byte - 127) as fp32 for byte i of a scale word (byte 0 -> 0.0, as no real group has scale 0).
template <int I>
__device__ __forceinline__ float scale_of(uint32_t s) {
    if constexpr (I < 3) {
        return __uint_as_float((s << (23 - 8 * I)) & 0x7F800000u);
    } else {
        return __uint_as_float((s >> 1) & 0x7F800000u);
    }
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          const float (&c)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// Weights are read once per call: keep them out of L1.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}



__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t v) {
    float lo = __uint_as_float(v << 16), hi = __uint_as_float(v & 0xFFFF0000u);
    lo = fminf(fmaxf(lo, -65504.f), 65504.f);
    hi = fminf(fmaxf(hi, -65504.f), 65504.f);
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// ---- shared by both kernels ---------------------------------------------------------------------------
// A block: tiles_per_block row tiles (16 output channels) of one active expert x k_splits K ranges, one
// warp per (tile, range). The expert's token rows go to shared memory once (bf16 -> fp16, clamped, K
// pairs (2t, 2t+1) and (2t+8, 2t+9) side by side so a lane's B fragment is one 8-byte load).
// NT: 8-token column tiles (1: T <= 8, 2: T <= 16).

struct Work {
    int expert, count, warp, lane, g, t, tile_local, part, tile, c_begin, n_chunks;
    long long row0, first;  // first: index of the warp's first chunk in words / 32 and scales / 8
};

// Routing of this block (after the PDL wait: the plan comes from the previous kernel); false: nothing to do.
// In the SASS, ptxas issues active[slot] only after the branch on num_active (two round trips), and counts /
// a_row_map / A follow one after another; taking all of it in one round trip measured no faster in the decode
// step (kernels/moe/NOTES.md, "The routing in the GEMM's first round trip").
__device__ __forceinline__ bool block_work(const Args& args, Work& w) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    const int slot = blockIdx.y;
    const int num_active = __ldcg(args.num_active);
    const int expert = __ldcg(args.active + slot);
    if (slot >= num_active) return false;
    w.expert = expert;
    w.row0 = (long long)expert * args.rows_per_group;
    w.warp = threadIdx.x >> 5;
    w.lane = threadIdx.x & 31;
    w.g = w.lane >> 2;
    w.t = w.lane & 3;
    w.tile_local = w.warp % args.tiles_per_block;
    w.part = w.warp / args.tiles_per_block;
    w.tile = blockIdx.x * args.tiles_per_block + w.tile_local;
    const int per_part = (args.chunks + args.k_splits - 1) / args.k_splits;
    w.c_begin = w.part * per_part;
    w.n_chunks = w.tile < args.row_tiles ? max(0, min(per_part, args.chunks - w.c_begin)) : 0;
    w.first = ((long long)expert * args.row_tiles + w.tile) * args.chunks + w.c_begin;
    return true;
}

// Activations -> shared memory: rows [0, count) from A in 16-byte pieces (8 K), four pieces per thread in
// flight; rows [count, max_tokens] zero (the zero row serves the lanes of tokens past count).
__device__ __forceinline__ void stage_activations(const Args& args, uint32_t* xs, int row_words, int count,
                                                  long long row0) {
    const int pairs = args.chunks * 32, pieces = args.chunks * 8, n_pieces = count * pieces;
    for (int base = threadIdx.x; base < n_pieces; base += 4 * blockDim.x) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = base + u * blockDim.x;
            v[u] = make_uint4(0, 0, 0, 0);
            if (i < n_pieces) {
                const int tok = i / pieces, piece = i - tok * pieces;
                if (piece * 8 < args.k) {
                    const long long arow = args.a_row_map ? (long long)args.a_row_map[row0 + tok] : row0 + tok;
                    v[u] = __ldg(reinterpret_cast<const uint4*>(args.a + arow * args.stride_a + piece * 8));
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = base + u * blockDim.x;
            if (i < n_pieces) {
                const int tok = i / pieces, piece = i - tok * pieces;
                // K pairs 4 piece .. 4 piece + 3: within their 16-K block, pair q (0..7) sits at word
                // 2 (q % 4) + q / 4, so lane t finds pairs t and t + 4 side by side.
                uint32_t* dst = xs + tok * row_words + (piece >> 1) * 8 + (piece & 1);
                dst[0] = bf16x2_to_f16x2(v[u].x);
                dst[2] = bf16x2_to_f16x2(v[u].y);
                dst[4] = bf16x2_to_f16x2(v[u].z);
                dst[6] = bf16x2_to_f16x2(v[u].w);
            }
        }
    }
    for (int i = threadIdx.x; i < (args.max_tokens + 1 - count) * pairs; i += blockDim.x) {
        const int r = i / pairs;
        xs[(count + r) * row_words + (i - r * pairs)] = 0u;
    }
}

// One 64-deep chunk of one lane: 4 words -> 4 (x NT) mmas, two fp32 group partials scaled into acc.
template <int NT>
__device__ __forceinline__ void chunk_mma(const uint4& wv, uint32_t sw, const uint2* const (&xrow)[NT], int c,
                                          float (&acc)[NT][4]) {
    const uint32_t w4[4] = {wv.x, wv.y, wv.z, wv.w};
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int grp = 0; grp < 2; ++grp) {
        float p[NT][4];
#pragma unroll
        for (int mm = 0; mm < 2; ++mm) {
            const int m = grp * 2 + mm;
            uint32_t af[4];
            unpack(w4[m], af);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint2 bv = xrow[nt][(4 * c + m) * 4];  // 16-K block 4c + m: 8 words
                if (mm == 0) {
                    mma_16816(p[nt], af, bv.x, bv.y, zero);
                } else {
                    mma_16816(p[nt], af, bv.x, bv.y, p[nt]);
                }
            }
        }
        const float s_lo = grp == 0 ? scale_of<0>(sw) : scale_of<2>(sw);  // row g
        const float s_hi = grp == 0 ? scale_of<1>(sw) : scale_of<3>(sw);  // row g + 8
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            acc[nt][0] = fmaf(p[nt][0], s_lo, acc[nt][0]);
            acc[nt][1] = fmaf(p[nt][1], s_lo, acc[nt][1]);
            acc[nt][2] = fmaf(p[nt][2], s_hi, acc[nt][2]);
            acc[nt][3] = fmaf(p[nt][3], s_hi, acc[nt][3]);
        }
    }
}

// Sum over the K ranges (in `red`), then 2^14 (the codes' 2^-14) and bf16 out.
template <int NT>
__device__ __forceinline__ void finish(const Args& args, const Work& w, float* red, float (&acc)[NT][4]) {
    if (args.k_splits > 1) {
        if (w.part > 0) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    red[(((w.part - 1) * args.tiles_per_block + w.tile_local) * NT * 4 + nt * 4 + j) * 32 + w.lane] =
                        acc[nt][j];
        }
        __syncthreads();
        if (w.part > 0) return;
        for (int s = 1; s < args.k_splits; ++s)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    acc[nt][j] +=
                        red[(((s - 1) * args.tiles_per_block + w.tile_local) * NT * 4 + nt * 4 + j) * 32 + w.lane];
    }
    if (w.tile >= args.row_tiles) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int row = w.tile * 16 + w.g + 8 * (j >> 1);
            const int tok = nt * 8 + 2 * w.t + (j & 1);
            if (tok < w.count && row < args.n)
                args.out[(w.row0 + tok) * args.stride_out + row] = __float2bfloat16(acc[nt][j] * 16384.f);
        }
    }
}

template <int NT>
__device__ __forceinline__ void token_rows(const Args& args, const Work& w, const uint32_t* xs, int row_words,
                                           const uint2* (&xrow)[NT]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int tok = nt * 8 + w.g;
        xrow[nt] = reinterpret_cast<const uint2*>(xs + (tok < w.count ? tok : args.max_tokens) * row_words) + w.t;
    }
}

// ---- ring: DEPTH 16-byte loads in flight per warp, in registers ---------------------------------------
// Shared memory: activation rows, then the K-split partials.
// Register caps: <1, 4> at 56, so that 3 blocks of 12 warps fit an SM (ptxas chose 64, which leaves 2; the
// H200 measured both within 0.1 us, 2026-12-01); the others at what ptxas chose before the cap.
template <int NT, int DEPTH>
__global__ void __maxnreg__(NT == 1 ? (DEPTH == 4 ? 56 : 80) : (DEPTH == 4 ? 64 : 96))
mxfp4_mma_decode_kernel(const Args args) {
    Work w;
    if (!block_work(args, w)) return;
    extern __shared__ uint32_t smem[];
    const int row_words = x_row_words(args.chunks);
    uint32_t* xs = smem;

    // The weight loads first: they do not wait for the activations.
    const uint4* wp = args.words + w.first * 32 + w.lane;
    const uint32_t* sp = args.scales + w.first * 8 + w.g;
    uint4 wbuf[DEPTH];
    uint32_t sbuf[DEPTH];
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) {
        if (j < w.n_chunks) {
            wbuf[j] = load_stream(wp + j * 32);
            sbuf[j] = __ldg(sp + j * 8);
        }
    }
    w.count = min(min(__ldcg(args.counts + w.expert), args.max_tokens), NT * 8);
    stage_activations(args, xs, row_words, max(w.count, 0), w.row0);
    __syncthreads();
    const uint2* xrow[NT];
    token_rows<NT>(args, w, xs, row_words, xrow);

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
    for (int i = 0; i < w.n_chunks; i += DEPTH) {
        const uint4* wnext = wp + (long long)(i + DEPTH) * 32;  // this batch's refills: constant offsets
        const uint32_t* snext = sp + (long long)(i + DEPTH) * 8;
#pragma unroll
        for (int j = 0; j < DEPTH; ++j) {
            if (i + j < w.n_chunks) {
                // Consume the slot, then refill it: the refill lands in the slot's own registers. (Refilling
                // first from a copy made nvcc load into spare registers and move them into the slot after the
                // chunk's math, and that move waited for the load: one load in flight per warp, not DEPTH;
                // Nsight Compute, H200 2026-12-02, kernels/moe/NOTES.md.)
                chunk_mma<NT>(wbuf[j], sbuf[j], xrow, w.c_begin + i + j, acc);
                if (i + j + DEPTH < w.n_chunks) {
                    wbuf[j] = load_stream(wnext + j * 32);
                    sbuf[j] = __ldg(snext + j * 8);
                }
            }
        }
    }
    finish<NT>(args, w, reinterpret_cast<float*>(xs + (args.max_tokens + 1) * row_words), acc);
}

// ---- async: the ring's weights in shared memory (cp.async), so the loads in flight hold no registers ----
// Per warp DEPTH slots of 512 bytes; a lane copies (and later reads) only its own 16 bytes of each slot, so
// its own cp.async.wait_group is the only synchronization. Iteration c waits for chunk c, refills the slot
// chunk c - 1 used (its words were unpacked in iteration c - 1, so they have been read), then computes:
// DEPTH - 2 .. DEPTH - 1 chunks in flight. Scales stay a register ring. Shared memory: activation rows,
// K-split partials, then warps x DEPTH x 512 bytes.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
}

template <int NT, int DEPTH>
__global__ void __maxnreg__(NT == 1 ? 56 : 72) mxfp4_mma_decode_async_kernel(const Args args) {
    static_assert(DEPTH >= 2, "two slots at least");
    Work w;
    if (!block_work(args, w)) return;
    extern __shared__ __align__(16) uint32_t smem[];
    const int row_words = x_row_words(args.chunks);
    uint32_t* xs = smem;
    float* red = reinterpret_cast<float*>(xs + (args.max_tokens + 1) * row_words);
    uint4* ring = reinterpret_cast<uint4*>(red + (args.k_splits - 1) * args.tiles_per_block * NT * 128) +
                  w.warp * DEPTH * 32 + w.lane;
    const uint32_t ring0 = smem_addr(ring);
    const uint4* wp = args.words + w.first * 32 + w.lane;
    const uint32_t* sp = args.scales + w.first * 8 + w.g;
    uint32_t sbuf[DEPTH];
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) {
        if (j < w.n_chunks) {
            cp_async16(ring0 + j * 512, wp + j * 32);
            sbuf[j] = __ldg(sp + j * 8);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    w.count = max(min(min(__ldcg(args.counts + w.expert), args.max_tokens), NT * 8), 0);
    stage_activations(args, xs, row_words, w.count, w.row0);
    __syncthreads();
    const uint2* xrow[NT];
    token_rows<NT>(args, w, xs, row_words, xrow);

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
    for (int i = 0; i < w.n_chunks; i += DEPTH) {
#pragma unroll
        for (int j = 0; j < DEPTH; ++j) {
            const int c = i + j;
            if (c < w.n_chunks) {
                asm volatile("cp.async.wait_group %0;\n" :: "n"(DEPTH - 2) : "memory");
                const uint4 wv = ring[j * 32];
                const uint32_t sw = sbuf[j];
                const int prev = (j + DEPTH - 1) % DEPTH;  // the slot of chunk c - 1 (a constant once unrolled)
                if (c >= 1 && c - 1 + DEPTH < w.n_chunks) {
                    cp_async16(ring0 + prev * 512, wp + (long long)(c - 1 + DEPTH) * 32);
                    sbuf[prev] = __ldg(sp + (long long)(c - 1 + DEPTH) * 8);
                }
                asm volatile("cp.async.commit_group;\n" ::: "memory");
                chunk_mma<NT>(wv, sw, xrow, w.c_begin + c, acc);
            }
        }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    finish<NT>(args, w, red, acc);
}

// ---- bulk: each warp's whole run of weights and scales in flight at once --------------------------------
// One lane issues cp.async.bulk copies (the copy engine, no registers held) of the warp's chunks into its
// own shared-memory buffer, in pieces of chunks_per_piece, each completing on its own mbarrier; the warp
// computes a piece as soon as it lands. Shared memory: activation rows, K-split partials, then per warp
// per_part x 512 bytes of words, per_part x 32 bytes of scales, kMaxPieces mbarriers.

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void wait_parity0(uint32_t bar) {
    uint32_t done = 0;
    for (long long spin = 0; !done; ++spin) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar) : "memory");
        if (spin > (1ll << 22)) __trap();  // a copy that never lands: fail loudly instead of hanging
    }
}

template <int NT>
__global__ void mxfp4_mma_decode_bulk_kernel(const Args args) {
    Work w;
    if (!block_work(args, w)) return;
    extern __shared__ __align__(16) uint32_t smem[];
    const int row_words = x_row_words(args.chunks);
    const int warps = blockDim.x >> 5;
    const int per_part = (args.chunks + args.k_splits - 1) / args.k_splits;
    uint32_t* xs = smem;
    float* red = reinterpret_cast<float*>(xs + (args.max_tokens + 1) * row_words);
    unsigned char* wsm = reinterpret_cast<unsigned char*>(red + (args.k_splits - 1) * args.tiles_per_block * NT * 128);
    unsigned char* ssm = wsm + (size_t)warps * per_part * 512;
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(ssm + (size_t)warps * per_part * 32);
    unsigned char* my_w = wsm + (size_t)w.warp * per_part * 512;
    unsigned char* my_s = ssm + (size_t)w.warp * per_part * 32;
    unsigned long long* my_bars = bars + w.warp * kMaxPieces;
    const int cpp = args.chunks_per_piece;
    const int n_pieces = (w.n_chunks + cpp - 1) / cpp;

    if (w.lane == 0 && w.n_chunks > 0) {
        for (int p = 0; p < n_pieces; ++p)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(smem_addr(my_bars + p)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        for (int p = 0; p < n_pieces; ++p) {
            const int c0 = p * cpp, nc = min(cpp, w.n_chunks - c0);
            const uint32_t bar = smem_addr(my_bars + p);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                         :: "r"(bar), "r"(nc * (512 + 32)) : "memory");
            bulk_copy(smem_addr(my_w + c0 * 512), args.words + (w.first + c0) * 32, nc * 512, bar);
            bulk_copy(smem_addr(my_s + c0 * 32), args.scales + (w.first + c0) * 8, nc * 32, bar);
        }
    }
    // An active expert always has tokens; with none the block would still wait for its copies (below).
    w.count = max(min(min(__ldcg(args.counts + w.expert), args.max_tokens), NT * 8), 0);
    stage_activations(args, xs, row_words, w.count, w.row0);
    __syncthreads();  // also orders the mbarrier inits before the other lanes' waits
    const uint2* xrow[NT];
    token_rows<NT>(args, w, xs, row_words, xrow);

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
    const uint4* wv = reinterpret_cast<const uint4*>(my_w) + w.lane;
    const uint32_t* sv = reinterpret_cast<const uint32_t*>(my_s) + w.g;
    for (int p = 0; p < n_pieces; ++p) {
        wait_parity0(smem_addr(my_bars + p));
        const int c_end = min((p + 1) * cpp, w.n_chunks);
#pragma unroll 2
        for (int c = p * cpp; c < c_end; ++c) chunk_mma<NT>(wv[c * 32], sv[c * 8], xrow, w.c_begin + c, acc);
    }
    finish<NT>(args, w, red, acc);
}

}  // namespace mxfp4_decode

namespace mxfp4_decode {

using Kernel = void (*)(const Args);

// The configurations built: NT (token tiles) x (ring DEPTH 4 / 8, async DEPTH 6 / 8, or bulk); the bench
// sweeps them. kind: 0 ring, 1 bulk, 2 async.
static Kernel select(int nt, int depth, int kind) {
    if (kind == 1) return nt == 1 ? mxfp4_mma_decode_bulk_kernel<1> : mxfp4_mma_decode_bulk_kernel<2>;
    if (kind == 2) {
        if (depth == 6) return nt == 1 ? mxfp4_mma_decode_async_kernel<1, 6> : mxfp4_mma_decode_async_kernel<2, 6>;
        if (depth == 8) return nt == 1 ? mxfp4_mma_decode_async_kernel<1, 8> : mxfp4_mma_decode_async_kernel<2, 8>;
        return nullptr;
    }
    if (kind != 0) return nullptr;
    if (nt == 1 && depth == 4) return mxfp4_mma_decode_kernel<1, 4>;
    if (nt == 1 && depth == 8) return mxfp4_mma_decode_kernel<1, 8>;
    if (nt == 2 && depth == 4) return mxfp4_mma_decode_kernel<2, 4>;
    if (nt == 2 && depth == 8) return mxfp4_mma_decode_kernel<2, 8>;
    return nullptr;
}

bool have_kernel(int nt, int depth, int kind) { return select(nt, depth, kind) != nullptr; }

cudaError_t allow_smem(int nt, int depth, int kind, int max_smem) {
    return cudaFuncSetAttribute(select(nt, depth, kind), cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
}

cudaError_t launch(const Args& args, int nt, int depth, int kind, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, select(nt, depth, kind), args);
}

}  // namespace mxfp4_decode
