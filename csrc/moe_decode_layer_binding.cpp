// The torch side of moe_decode_layer.cu: shape and dtype checks, tensors -> Args, the launch on torch's current
// stream, and the Python binding (host compiler only: nvcc never parses torch's headers, csrc/README.md).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "moe_decode_layer.cuh"

namespace moe_decode_layer {

namespace {

// The kernel's dynamic shared memory attribute only grows (a smaller call must not shrink it under a larger one).
size_t smem_attribute_set = 0;

bool aligned16(const torch::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The grid per device, the kernel's shared-memory attribute raised when a launch needs more: cudaFuncSetAttribute
// only then, not per launch. (The attribute is the function's, for every device of the process.)
int grid_for(int device, size_t smem) {
    static std::mutex mu;
    static std::map<int, int> grids;
    std::lock_guard<std::mutex> lock(mu);
    auto it = grids.find(device);
    if (it != grids.end() && smem <= smem_attribute_set) return it->second;
    int grid = 0;
    const size_t want = std::max(smem, smem_attribute_set);
    C10_CUDA_CHECK(prepare(device, static_cast<int>(want), &grid));
    smem_attribute_set = want;
    grids[device] = grid;
    return grid;
}

}  // namespace

// The largest ring (stages) that fits the device's shared memory for these shapes, or `stages` if > 0.
int64_t plan_stages(int64_t device, int64_t hidden, int64_t inter, int64_t hp, int64_t ip, int64_t stages) {
    int sms = 0, optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, static_cast<int>(device)));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, static_cast<int>(device)));
    const int mu = max_units(static_cast<int>(hidden), static_cast<int>(inter), sms);
    if (stages > 0) return smem_bytes(hp, ip, static_cast<int>(stages), mu) <= static_cast<size_t>(optin) ? stages : 0;
    for (int s = kMaxStages; s >= 2; --s)
        if (smem_bytes(hp, ip, s, mu) <= static_cast<size_t>(optin)) return s;
    return 0;
}

void layer(torch::Tensor x, torch::Tensor router_w, torch::Tensor router_b, torch::Tensor w13, torch::Tensor s13,
           torch::Tensor b13, torch::Tensor w2, torch::Tensor s2, torch::Tensor b2, torch::Tensor out,
           torch::Tensor ids, torch::Tensor weights, torch::Tensor logits, torch::Tensor act, torch::Tensor amax,
           torch::Tensor ybuf, torch::Tensor barrier, int64_t first_expert, double alpha, double limit,
           int64_t stages, bool pdl, torch::Tensor trace, int64_t producer, int64_t copy_only) {
    const int hidden = static_cast<int>(x.size(-1)), num_experts = static_cast<int>(router_w.size(0));
    const int num_local = static_cast<int>(w13.size(0)), inter = static_cast<int>(w13.size(1) / 2);
    const int hp = static_cast<int>(w13.size(2)), ip = static_cast<int>(w2.size(2));
    const int top_k = static_cast<int>(ids.numel());
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.numel() == hidden && x.is_contiguous() && aligned16(x),
                "x: one contiguous bf16 row on the GPU");
    TORCH_CHECK(router_w.scalar_type() == at::kBFloat16 && router_w.is_contiguous() && router_w.size(1) == hidden
                    && aligned16(router_w) && router_b.scalar_type() == at::kBFloat16 && router_b.numel() == num_experts,
                "router: weight [E, hidden] and bias [E], bf16");
    TORCH_CHECK(hidden % 64 == 0 && inter % 64 == 0 && hidden <= kVecPerLane * 32 * 8 && hp % 128 == 0 && ip % 128 == 0
                    && hidden <= hp && inter <= ip && ip <= kMaxKBlocks * 128 && num_experts <= kMaxExperts && 0 < top_k && top_k <= kMaxSlots
                    && top_k <= num_experts,
                "moe_decode_layer: shapes out of this kernel's range");
    TORCH_CHECK(w13.element_size() == 1 && w13.is_contiguous() && aligned16(w13) && w13.sizes() == at::IntArrayRef({num_local, 2 * inter, hp}),
                "w13: [E_local, 2I, Hp] fp8, contiguous");
    TORCH_CHECK(w2.element_size() == 1 && w2.is_contiguous() && aligned16(w2) && w2.sizes() == at::IntArrayRef({num_local, hidden, ip}),
                "w2: [E_local, D, Ip] fp8, contiguous");
    TORCH_CHECK(s13.scalar_type() == at::kFloat && s13.is_contiguous()
                    && s13.sizes() == at::IntArrayRef({num_local, (2 * inter + 127) / 128, hp / 128})
                    && s2.scalar_type() == at::kFloat && s2.is_contiguous()
                    && s2.sizes() == at::IntArrayRef({num_local, (hidden + 127) / 128, ip / 128}),
                "block scales: [E_local, ceil(N / 128), Kp / 128] fp32, contiguous");
    TORCH_CHECK(b13.scalar_type() == at::kFloat && b13.is_contiguous() && b13.numel() == num_local * 2 * inter
                    && b2.scalar_type() == at::kFloat && b2.is_contiguous() && b2.numel() == num_local * hidden,
                "biases: [E_local, 2I] and [E_local, D] fp32, contiguous");
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.numel() == hidden
                    && ids.scalar_type() == at::kInt && weights.scalar_type() == at::kFloat && weights.numel() == top_k
                    && logits.scalar_type() == at::kFloat && logits.numel() >= num_experts
                    && act.scalar_type() == at::kFloat && act.numel() >= kMaxSlots * inter && aligned16(act)
                    && amax.scalar_type() == at::kInt && amax.numel() >= kMaxSlots * (ip / 128)
                    && ybuf.scalar_type() == at::kFloat && ybuf.numel() >= kMaxSlots * hidden
                    && barrier.scalar_type() == at::kInt && barrier.numel() >= 2
                    && (trace.numel() == 0 || trace.scalar_type() == at::kLong),
                "moe_decode_layer: output or scratch buffers");
    const int device = x.get_device();
    const int64_t st = plan_stages(device, hidden, inter, hp, ip, stages);
    TORCH_CHECK(st >= 2, "moe_decode_layer: the ring does not fit this device's shared memory");
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const int mu = max_units(hidden, inter, sms);
    const size_t smem = smem_bytes(hp, ip, static_cast<int>(st), mu);
    const int grid = grid_for(device, smem);
    Args args{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(router_w.data_ptr()),
              reinterpret_cast<const __nv_bfloat16*>(router_b.data_ptr()), reinterpret_cast<const uint8_t*>(w13.data_ptr()),
              s13.data_ptr<float>(), b13.data_ptr<float>(), reinterpret_cast<const uint8_t*>(w2.data_ptr()),
              s2.data_ptr<float>(), b2.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
              ids.data_ptr<int>(), weights.data_ptr<float>(), logits.data_ptr<float>(), act.data_ptr<float>(),
              reinterpret_cast<unsigned*>(amax.data_ptr<int>()), ybuf.data_ptr<float>(),
              reinterpret_cast<unsigned*>(barrier.data_ptr<int>()), hidden, inter, hp, ip, num_experts, top_k,
              static_cast<int>(first_expert), num_local, static_cast<float>(alpha), static_cast<float>(limit),
              static_cast<int>(st), mu, nullptr, static_cast<int>(producer), static_cast<int>(copy_only)};
    TORCH_CHECK(producer == 0 || producer == 2 || (producer == 1 && copy_only == 1),
                "producer: 0 (bulk copy per row), 2 (cp.async), 1 (one copy per tile: copy_only probes only)");
    if (trace.numel() > 0) {
        TORCH_CHECK(trace.numel() >= static_cast<int64_t>(grid) * kTracePoints, "trace: [grid, kTracePoints] int64");
        args.trace = reinterpret_cast<long long*>(trace.data_ptr<int64_t>());
    }
    const c10::cuda::CUDAGuard guard(x.device());
    C10_CUDA_CHECK(launch(args, grid, smem, c10::cuda::getCurrentCUDAStream(), pdl));
}

}  // namespace moe_decode_layer

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("layer", &moe_decode_layer::layer, "the MoE layer of one decode token in one persistent kernel (sm_90a)");
    m.def("plan_stages", &moe_decode_layer::plan_stages, "ring stages that fit the device for these shapes (0: none)");
}
