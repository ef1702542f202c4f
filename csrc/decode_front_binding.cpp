// The torch side of decode_front.cu: shape and dtype checks, tensors -> Args, the launch on torch's current stream,
// and the Python binding. Compiled by the host compiler alone, so nvcc never parses torch's headers: the build
// went 73 s -> 30 s on the H200 node (csrc/README.md).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "decode_front.cuh"

namespace decode_front {

void front(torch::Tensor x, torch::Tensor w, torch::Tensor bias, torch::Tensor ids, torch::Tensor weights,
           torch::Tensor counts, torch::Tensor active, torch::Tensor row_of_pair, torch::Tensor token_of_row,
           torch::Tensor a, torch::Tensor sf, int64_t sf_k_stride, int64_t first_expert, int64_t num_local,
           bool pdl) {
    const int hidden = static_cast<int>(x.size(-1)), num_experts = static_cast<int>(w.size(0));
    const int top_k = static_cast<int>(ids.numel()), kp = static_cast<int>(a.size(-1));
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.numel() == hidden && x.is_contiguous(),
                "x: one contiguous bf16 row on the GPU");
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(1) == hidden, "router weight [E, hidden] bf16");
    TORCH_CHECK(bias.scalar_type() == at::kBFloat16 && bias.numel() == num_experts, "router bias [E] bf16");
    TORCH_CHECK(hidden % 8 == 0 && hidden <= kVecPerLane * 32 * 8 && num_experts <= kMaxExperts && top_k <= kMaxTopK
                    && top_k <= num_experts && kp % 128 == 0 && hidden <= kp && kp <= kCluster * kWarps * 128,
                "decode_front: shapes out of this kernel's range");
    TORCH_CHECK(ids.scalar_type() == at::kInt && weights.scalar_type() == at::kFloat && counts.scalar_type() == at::kInt
                    && active.scalar_type() == at::kInt && row_of_pair.scalar_type() == at::kInt
                    && token_of_row.scalar_type() == at::kInt && sf.scalar_type() == at::kFloat
                    && a.element_size() == 1 && a.is_contiguous(),
                "decode_front: output dtypes");
    Args args{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(w.data_ptr()),
              reinterpret_cast<const __nv_bfloat16*>(bias.data_ptr()), ids.data_ptr<int>(), weights.data_ptr<float>(),
              counts.data_ptr<int>(), active.data_ptr<int>(), row_of_pair.data_ptr<int>(), token_of_row.data_ptr<int>(),
              reinterpret_cast<uint8_t*>(a.data_ptr()), sf.data_ptr<float>(), sf_k_stride,
              hidden, kp, num_experts, top_k, static_cast<int>(first_expert), static_cast<int>(num_local)};
    C10_CUDA_CHECK(launch(args, c10::cuda::getCurrentCUDAStream(), pdl));
}

}  // namespace decode_front

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("front", &decode_front::front, "MoE decode front of one token in one 8-CTA cluster (sm_90a)");
}
