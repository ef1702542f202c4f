// The torch side of mxfp4_decode.cu: shape and dtype checks, tensors -> Args, the shared memory a launch needs, the
// launch on torch's current stream, and the Python binding. Compiled by the host compiler alone, so nvcc never parses
// torch's headers (csrc/README.md).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "mxfp4_decode.cuh"

namespace mxfp4_decode {

constexpr int kMaxSmem = 227 * 1024;  // the H100/H200 opt-in limit per block

void gemm(torch::Tensor a, torch::Tensor words, torch::Tensor scales, torch::Tensor out, torch::Tensor counts,
          torch::Tensor active, torch::Tensor num_active, c10::optional<torch::Tensor> a_row_map,
          int64_t rows_per_group, int64_t n, int64_t k, int64_t max_tokens, int64_t tiles_per_block,
          int64_t k_splits, int64_t depth, int64_t kind, int64_t chunks_per_piece, bool pdl) {
    TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kBFloat16 && a.dim() == 2 && a.stride(1) == 1 &&
                    a.size(1) == k && k % 32 == 0,
                "A must be a CUDA bf16 [rows, K] tensor (K a multiple of 32) with unit stride along K");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 && a.stride(0) % 8 == 0,
                "A rows must be 16-byte aligned");
    TORCH_CHECK(words.scalar_type() == at::kInt && words.dim() == 5 && words.size(3) == 32 && words.size(4) == 4 &&
                    words.is_contiguous(),
                "words must be int32 [E, RT, C, 32, 4] (mxfp4_cuda.pack_mma_words)");
    const int64_t e = words.size(0), rt = words.size(1), ch = words.size(2);
    TORCH_CHECK(scales.scalar_type() == at::kInt && scales.is_contiguous() && scales.dim() == 4 &&
                    scales.size(0) == e && scales.size(1) == rt && scales.size(2) == ch && scales.size(3) == 8,
                "scales must be int32 [E, RT, C, 8]");
    TORCH_CHECK(rt * 16 >= n && (rt - 1) * 16 < n && ch * 64 >= k && (ch - 1) * 64 < k, "packed shape mismatch");
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.stride(1) == 1 && out.size(1) == n &&
                    out.size(0) >= e * rows_per_group,
                "out must be bf16 [E * rows_per_group, N]");
    TORCH_CHECK(counts.scalar_type() == at::kInt && active.scalar_type() == at::kInt &&
                    num_active.scalar_type() == at::kInt && counts.numel() >= e,
                "counts, active and num_active must be int32");
    TORCH_CHECK(max_tokens >= 1 && max_tokens <= 16 && max_tokens <= rows_per_group, "1..16 tokens per expert");
    TORCH_CHECK(tiles_per_block >= 1 && k_splits >= 1 && tiles_per_block * k_splits <= 32,
                "tiles_per_block x k_splits must be at most 32 warps");
    const int nt = max_tokens <= 8 ? 1 : 2;
    const bool bulk = kind == 1;
    TORCH_CHECK(!bulk || chunks_per_piece > 0, "the bulk kernel needs chunks_per_piece > 0");
    TORCH_CHECK(have_kernel(nt, static_cast<int>(depth), static_cast<int>(kind)), "no kernel built for kind ", kind,
                ", DEPTH ", depth);
    const int64_t per_part = (ch + k_splits - 1) / k_splits;
    TORCH_CHECK(!bulk || (per_part + chunks_per_piece - 1) / chunks_per_piece <= kMaxPieces,
                "bulk kernel: at most ", kMaxPieces, " pieces per warp");
    if (a_row_map.has_value()) TORCH_CHECK(a_row_map->scalar_type() == at::kInt, "a_row_map must be int32");

    Args args;
    args.a = reinterpret_cast<const __nv_bfloat16*>(a.data_ptr<at::BFloat16>());
    args.words = reinterpret_cast<const uint4*>(words.data_ptr<int>());
    args.scales = reinterpret_cast<const uint32_t*>(scales.data_ptr<int>());
    args.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>());
    args.counts = counts.data_ptr<int>();
    args.active = active.data_ptr<int>();
    args.num_active = num_active.data_ptr<int>();
    args.a_row_map = a_row_map.has_value() ? a_row_map->data_ptr<int>() : nullptr;
    args.stride_a = a.stride(0);
    args.stride_out = out.stride(0);
    args.rows_per_group = static_cast<int>(rows_per_group);
    args.n = static_cast<int>(n);
    args.k = static_cast<int>(k);
    args.row_tiles = static_cast<int>(rt);
    args.chunks = static_cast<int>(ch);
    args.max_tokens = static_cast<int>(max_tokens);
    args.tiles_per_block = static_cast<int>(tiles_per_block);
    args.k_splits = static_cast<int>(k_splits);
    args.chunks_per_piece = static_cast<int>(chunks_per_piece);

    const int64_t warps = tiles_per_block * k_splits;
    size_t smem = (static_cast<size_t>(max_tokens + 1) * x_row_words(args.chunks) +
                   static_cast<size_t>(k_splits - 1) * tiles_per_block * nt * 4 * 32) * 4;
    if (bulk) smem += static_cast<size_t>(warps) * (per_part * (512 + 32) + kMaxPieces * 8);
    if (kind == 2) smem += static_cast<size_t>(warps) * depth * 512;
    const c10::cuda::CUDAGuard guard(a.device());
    TORCH_CHECK(smem <= static_cast<size_t>(kMaxSmem), "shared memory of ", smem, " bytes: too many tokens or warps");
    static bool raised[64][2][3][2] = {};  // once per device and kernel, before any graph capture uses it
    TORCH_CHECK(a.device().index() < 64, "device index");
    bool& done = raised[a.device().index()][nt - 1][kind][depth == 8];
    if (!done) {
        C10_CUDA_CHECK(allow_smem(nt, static_cast<int>(depth), static_cast<int>(kind), kMaxSmem));
        done = true;
    }
    const dim3 grid(static_cast<unsigned>((rt + tiles_per_block - 1) / tiles_per_block),
                    static_cast<unsigned>(active.numel()), 1);
    C10_CUDA_CHECK(launch(args, nt, static_cast<int>(depth), static_cast<int>(kind), grid,
                          dim3(static_cast<unsigned>(32 * warps), 1, 1), smem,
                          c10::cuda::getCurrentCUDAStream(a.device().index()), pdl));
}

}  // namespace mxfp4_decode

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("mxfp4_mma_decode", &mxfp4_decode::gemm, "MXFP4 grouped decode GEMM (mma.sync, sm_90a)");
}
