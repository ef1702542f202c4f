// Shared by moe_decode_layer.cu (the kernel and its launch, compiled by nvcc without torch's headers) and
// moe_decode_layer_binding.cpp (the torch-facing checks and the Python binding): limits, arguments, smem size.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace moe_decode_layer {

constexpr int kConsumerWarps = 8;
constexpr int kProducerWarps = 4;                    // weight copies: one warp (bulk copies) or all four (cp.async)
constexpr int kThreads = (kConsumerWarps + kProducerWarps) * 32;
constexpr int kTileRows = 16;                        // weight rows per unit of work (one mma M)
constexpr int kMaxSlots = 4;                         // local active experts of the token (top-k <= 4)
constexpr int kMaxExperts = 128;
constexpr int kVecPerLane = 12;                      // router row: hidden <= 12 * 32 * 8 = 3072
constexpr int kMaxStages = 6;
constexpr int kMaxKBlocks = 24;                      // intermediate (padded) <= 24 * 128 = 3072

struct Args {
    const __nv_bfloat16* x;         // [hidden], the token (normed)
    const __nv_bfloat16* router_w;  // [E, hidden]
    const __nv_bfloat16* router_b;  // [E]
    const uint8_t* w13;             // [E_local, 2 * inter, hp] e4m3
    const float* s13;               // [E_local, ceil(2 * inter / 128), hp / 128]
    const float* b13;               // [E_local, 2 * inter]
    const uint8_t* w2;              // [E_local, hidden, ip] e4m3
    const float* s2;                // [E_local, ceil(hidden / 128), ip / 128]
    const float* b2;                // [E_local, hidden]
    __nv_bfloat16* out;             // [hidden]: this rank's MoE output
    int* ids;                       // [top_k]
    float* weights;                 // [top_k]
    float* logits;                  // [E] scratch
    float* act;                     // [kMaxSlots, inter] scratch: SwiGLU outputs
    unsigned* amax;                 // [kMaxSlots, ip / 128] scratch: their per-128 amax (float bits)
    float* ybuf;                    // [kMaxSlots, hidden] scratch: down rows + bias
    unsigned* barrier;              // [2]: arrivals, generation (arrivals zero between calls)
    int hidden, inter, hp, ip, num_experts, top_k, first_expert, num_local;
    float alpha, limit;
    int stages, max_units;          // ring stages; units of work per CTA at most (smem for their scales)
    long long* trace;               // null, or [grid, kTracePoints] %globaltimer stamps per CTA (bench probe)
    int producer;                   // 0: a bulk copy per weight row (one warp issues them); 2: 16-byte cp.async by
                                    // the four producer warps; 1 (probe, copy_only): one bulk copy per 16-row tile
    int copy_only;                  // probe: 1 streams the weights only (no math; the output is garbage)
};

// Trace points: entry, after the PDL wait, after B1, after routing, first tile landed, gate_up done, after B2,
// activation quantized, down done, after B3, combine done, (producer) last copy issued
constexpr int kTracePoints = 12;

// Bytes of dynamic shared memory for these shapes.
size_t smem_bytes(int hp, int ip, int stages, int max_units);
// Largest units per CTA for a grid: kMaxSlots experts' gate_up and down row tiles spread over `grid` CTAs.
int max_units(int hidden, int inter, int grid);
// The grid (one CTA per SM, all resident: the kernel's grid barriers need them all) and the launch.
cudaError_t prepare(int device, int smem, int* grid);
cudaError_t launch(const Args& args, int grid, size_t smem, cudaStream_t stream, bool pdl);

}  // namespace moe_decode_layer
