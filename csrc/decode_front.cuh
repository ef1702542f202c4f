// Shared by decode_front.cu (the kernel and its launch, compiled by nvcc without torch's headers) and
// decode_front_binding.cpp (the torch-facing checks and the Python binding): the kernel's limits and arguments.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace decode_front {

constexpr int kCluster = 8;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxExperts = 128;
constexpr int kExpertsPerWarp = kMaxExperts / (kCluster * kWarps);  // 2
constexpr int kVecPerLane = 12;  // 16-byte vectors of a router row per lane: hidden <= 12 * 32 * 8 = 3072
constexpr int kMaxTopK = 8;
constexpr int kValsPerLane = kMaxExperts / 32;  // the routing warp's logits per lane

struct Args {
    const __nv_bfloat16* x;     // [hidden], the one token
    const __nv_bfloat16* w;     // [num_experts, hidden]
    const __nv_bfloat16* bias;  // [num_experts]
    int* ids;                   // [top_k]
    float* weights;             // [top_k]
    int* counts;                // [num_local + 1]: pairs per local expert, then the number of active experts
    int* active;                // the active local experts, ascending
    int* row_of_pair;           // [top_k]: e_local (m_cap = 1), or -1 for another rank's expert
    int* token_of_row;          // [num_local]
    uint8_t* a;                 // [kp] e4m3 codes of the token (zeros past hidden)
    float* sf;                  // the scale of channel block kb at sf[kb * sf_k_stride]
    int64_t sf_k_stride;
    int hidden, kp, num_experts, top_k, first_expert, num_local;
};

// Launches the kernel as one cluster of kCluster CTAs on `stream`, with programmatic stream serialization when pdl.
cudaError_t launch(const Args& args, cudaStream_t stream, bool pdl);

}  // namespace decode_front
