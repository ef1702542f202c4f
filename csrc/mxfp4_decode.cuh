// Shared by mxfp4_decode.cu (the kernels and their launch, compiled by nvcc without torch's headers) and
// mxfp4_decode_binding.cpp (the torch-facing checks, the shared-memory size and the Python binding).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace mxfp4_decode {

struct Args {
    const __nv_bfloat16* a;   // [rows or tokens, K] bf16
    const uint4* words;       // [E, RT, C, 32] (16 bytes per lane per 64-deep chunk)
    const uint32_t* scales;   // [E, RT, C, 8]: bytes (row g, 2c), (g + 8, 2c), (g, 2c + 1), (g + 8, 2c + 1)
    __nv_bfloat16* out;       // [E * rows_per_group, N]
    const int* counts;        // [E]
    const int* active;        // [slots]: expert ids, the first *num_active valid
    const int* num_active;    // [1]
    const int* a_row_map;     // [E * rows_per_group] -> row of A, or null (A in the masked layout)
    long long stride_a, stride_out;
    int rows_per_group, n, k, row_tiles, chunks;
    int max_tokens;           // rows of the activation tile in shared memory (+1 zero row)
    int tiles_per_block, k_splits;
    int chunks_per_piece;     // bulk kernel: chunks per copy (and mbarrier)
};

// Words of one activation row in shared memory: chunks x 32, then padding so that the four rows a
// half-warp's 8-byte loads touch fall on different banks.
__host__ __device__ __forceinline__ int x_row_words(int chunks) {
    const int w = chunks * 32;
    return w + ((8 - w) & 31);
}

// The bulk kernel's mbarriers per warp (one per piece of its run).
constexpr int kMaxPieces = 16;

// Whether a kernel is built for NT token tiles (1: T <= 8, 2: T <= 16), ring / async DEPTH and kind (0 ring, 1 bulk,
// 2 async).
bool have_kernel(int nt, int depth, int kind);

// Raises the kernel's dynamic shared memory limit to max_smem (once per device and kernel, before any graph capture).
cudaError_t allow_smem(int nt, int depth, int kind, int max_smem);

// Launches the kernel on `stream` (programmatic stream serialization when pdl).
cudaError_t launch(const Args& args, int nt, int depth, int kind, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, bool pdl);

}  // namespace mxfp4_decode
