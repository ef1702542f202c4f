// Decode-sized dense projection y [T, N] = x [T, K] @ W [N, K]^T + b (bf16, fp32 sums), T <= 8, whose warps load
// their weights BEFORE griddepcontrol.wait (sm_90a).
//
// W is a constant of the model, not an output of the previous kernel, so under programmatic dependent launch
// its bytes may stream while the predecessor (attention before O, the norm before QKV) still runs; only x,
// the predecessor's output, waits. One warp per output row: lane l holds the 16-byte vectors l, l + 32, ...
// of the row in registers (NV of them: K = 2880 -> 12, 4096 -> 16), issued at the kernel's start; after the
// wait it reads x (the same few kB for every warp: L1/L2 hits), multiplies in fp32, reduces across the warp
// and adds the bias once (one rounding to bf16, as cuBLAS's bias epilogue). Twin: torch.nn.functional.linear.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace dense_gemv {

struct Args {
    const __nv_bfloat16* x;
    const uint4* w;  // [N, K / 8] 16-byte vectors, rows contiguous
    const __nv_bfloat16* bias;  // [N] or null
    __nv_bfloat16* y;
    long long stride_x, stride_w, stride_y;  // in elements (x, y) and 16-byte vectors (w)
    int n, k_vecs, t;
};

__device__ __forceinline__ uint4 load_weight(const uint4* p) {
    uint4 v;  // streamed once per step: no L1 allocation
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ void dot8(const uint4& w, const uint4& x, float& acc) {
    const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        acc = fmaf(__uint_as_float(wv[j] << 16), __uint_as_float(xv[j] << 16), acc);
        acc = fmaf(__uint_as_float(wv[j] & 0xFFFF0000u), __uint_as_float(xv[j] & 0xFFFF0000u), acc);
    }
}

template <int NV, int TMAX>
__global__ void __launch_bounds__(128) preload_gemv_kernel(const Args args) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
    const bool live = row < args.n;
    uint4 wreg[NV];
    const uint4* wrow = args.w + (long long)min(row, args.n - 1) * args.stride_w;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int v = i * 32 + lane;
        wreg[i] = v < args.k_vecs ? load_weight(wrow + v) : make_uint4(0, 0, 0, 0);
    }
    // The weights are in flight; x is the previous kernel's output.
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    float acc[TMAX];
#pragma unroll
    for (int t = 0; t < TMAX; ++t) {
        acc[t] = 0.f;
        if (t < args.t) {
            const uint4* xrow = reinterpret_cast<const uint4*>(args.x + t * args.stride_x);
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int v = i * 32 + lane;
                if (v < args.k_vecs) dot8(wreg[i], __ldg(xrow + v), acc[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TMAX; ++t) {
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) acc[t] += __shfl_xor_sync(0xFFFFFFFFu, acc[t], s);
    }
    if (live && lane < args.t && lane < TMAX) {
        float v = 0.f;
#pragma unroll
        for (int t = 0; t < TMAX; ++t)
            if (t == lane) v = acc[t];
        if (args.bias) v += __bfloat162float(args.bias[row]);
        args.y[lane * args.stride_y + row] = __float2bfloat16_rn(v);
    }
}

}  // namespace dense_gemv

#ifndef DENSE_GEMV_NO_TORCH
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

namespace dense_gemv {

using Kernel = void (*)(Args);

template <int NV>
Kernel select_t(int t) {
    if (t <= 1) return preload_gemv_kernel<NV, 1>;
    if (t <= 2) return preload_gemv_kernel<NV, 2>;
    if (t <= 4) return preload_gemv_kernel<NV, 4>;
    return preload_gemv_kernel<NV, 8>;
}

Kernel select(int nv, int t) {
    switch (nv) {
        case 4: return select_t<4>(t);
        case 8: return select_t<8>(t);
        case 12: return select_t<12>(t);
        case 16: return select_t<16>(t);
        default: return nullptr;
    }
}

void launch(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
            torch::Tensor& y, bool pdl) {
    TORCH_CHECK(x.is_cuda() && w.is_cuda() && y.is_cuda(), "CUDA tensors");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kBFloat16,
                "bf16 x, W and y");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && y.dim() == 2, "2-D x, W, y");
    const int64_t t = x.size(0), k = x.size(1), n = w.size(0);
    TORCH_CHECK(t >= 1 && t <= 8, "1..8 tokens");
    TORCH_CHECK(w.size(1) == k && y.size(0) == t && y.size(1) == n, "shapes");
    TORCH_CHECK(k % 8 == 0 && x.stride(1) == 1 && w.stride(1) == 1 && y.stride(1) == 1 && w.stride(0) % 8 == 0 &&
                    x.stride(0) % 8 == 0, "16-byte aligned rows");
    const int64_t k_vecs = k / 8;
    const int nv = static_cast<int>((k_vecs + 31) / 32 <= 4 ? 4 : (k_vecs + 31) / 32 <= 8 ? 8
                                    : (k_vecs + 31) / 32 <= 12 ? 12 : (k_vecs + 31) / 32 <= 16 ? 16 : 0);
    Kernel kernel = select(nv, static_cast<int>(t));
    TORCH_CHECK(kernel != nullptr, "K up to 4096");
    if (bias.has_value()) TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n, "bf16 bias [N]");
    Args args;
    args.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>());
    args.w = reinterpret_cast<const uint4*>(w.data_ptr<at::BFloat16>());
    args.bias = bias.has_value() ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr<at::BFloat16>()) : nullptr;
    args.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr<at::BFloat16>());
    args.stride_x = x.stride(0);
    args.stride_w = w.stride(0) / 8;
    args.stride_y = y.stride(0);
    args.n = static_cast<int>(n);
    args.k_vecs = static_cast<int>(k_vecs);
    args.t = static_cast<int>(t);
    const c10::cuda::CUDAGuard guard(x.device());
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>((n + 3) / 4), 1, 1);
    cfg.blockDim = dim3(128, 1, 1);
    cfg.stream = c10::cuda::getCurrentCUDAStream(x.device().index());
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args));
}

}  // namespace dense_gemv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("preload_gemv", &dense_gemv::launch, "decode GEMV with weights loaded before the PDL wait (sm_90a)");
}
#endif
