"""How much of a GPU's free memory the K/V pools may take: what is left must hold a step's activations.

`gpu_memory_fraction` of the memory free after loading the weights leaves the rest for activations,
workspaces and the decode graphs' pool. On gpt-oss-120b on one H200 that rest is small (~17 GB free
next to 117 GB of FP8 experts: 10% is ~1.7 GB), while one step's activations grow with the engine's
limits: a prefill chunk of `max_num_batched_tokens` tokens through the MoE (four expert rows per
token), and up to `max_num_seqs` rows of fp32 logits over a 201k vocabulary with the sampler's copies.
`activation_bytes` estimates that peak from the shapes (bytes per token and per sampled row, times a
margin); `kv_budget_bytes` never gives the pools more than the fraction allows, and gives them less when
the estimate needs it. Nothing here measures the GPU: the numbers are the tensors the forward holds
at once (model/gpt_oss.py, kernels/moe/fp8_experts.py), counted on the host.

Against the GPU: the 120b engine run at 512 requests with 8k chunks (bench/e2e, 4 GB kept free next to the
K/V pool; bench/results/e2e_h200_fp8kv_120b_lookahead.json) peaked at 137.35 of 139.80 GB allocated,
~3.5 GB of the 4 used by the steps; the estimate for those limits is 5.8 GB. The 10% a fraction of 0.9
leaves there (~1.7 GB) would not have held it.
"""

from __future__ import annotations

from kernels.moe.fp8_quant import padded
from model.config import GptOssConfig

MARGIN = 1.5  # allocator rounding and fragmentation, transient copies the count below leaves out
FIXED_BYTES = 1 << 30  # workspaces: cuBLAS, FlashInfer (128 MiB), DeepGEMM, NCCL / symmetric memory buffers
SAMPLER_COPIES = 4  # fp32 logits, their softmax, the sampler's scaled / masked copies


def prefill_bytes_per_token(c: GptOssConfig, tp_size: int = 1, act_bytes: int = 2) -> int:
    """Activation bytes one token of a prefill forward holds at the MoE's peak (the largest stage)."""
    d, inter, k = c.hidden_size, c.intermediate_size, c.num_experts_per_tok
    heads = (c.num_attention_heads + 2 * c.num_key_value_heads) // tp_size * c.head_dim
    residual = 6 * d * act_bytes  # residual stream, norm output, MoE output, the next norm's in / out
    attention = 2 * heads * act_bytes + c.num_attention_heads // tp_size * c.head_dim * act_bytes
    # k expert rows: FP8 A (hidden, padded), gate_up output (bf16), FP8 A2, down output (bf16)
    moe = k * (padded(d) + 2 * inter * act_bytes + padded(inter) + d * act_bytes)
    return residual + max(attention, moe)


def activation_bytes(c: GptOssConfig, max_num_batched_tokens: int, max_num_seqs: int, tp_size: int = 1,
                     num_local_experts: int | None = None) -> int:
    """Peak bytes beside weights and K/V pools for steps within the engine's limits (an estimate)."""
    per_token = prefill_bytes_per_token(c, tp_size)
    experts = num_local_experts if num_local_experts is not None else c.num_local_experts
    padding_rows = experts * 128  # the contiguous layout pads every expert's segment to 128 rows
    moe_padding = padding_rows * (padded(c.hidden_size) + 2 * c.intermediate_size * 2 + padded(c.intermediate_size))
    logits = max_num_seqs * (c.vocab_size // tp_size * 2 + c.vocab_size * 4 * SAMPLER_COPIES)
    return int(MARGIN * (max_num_batched_tokens * per_token + moe_padding + logits)) + FIXED_BYTES


def kv_budget_bytes(free_bytes: int, fraction: float, activations: int) -> int:
    """The K/V pools' bytes: `fraction` of what is free, but never eating into the activations' estimate."""
    return max(0, min(int(free_bytes * fraction), free_bytes - activations))


def linear_bytes(n: int, k: int, fp8: bool, act_bytes: int = 2) -> int:
    """An [n, k] projection's weight: act_bytes per value, or (fp8: kernels/layers/fp8_linear.Fp8Linear) one byte
    per value with K padded to 128-blocks and one fp32 scale per 128 x 128 block."""
    if not fp8:
        return n * k * act_bytes
    return n * padded(k) + 4 * (-(-n // 128)) * (padded(k) // 128)


def weight_bytes_estimate(c: GptOssConfig, tp_size: int = 1, ep_size: int = 1, mxfp4_copy: bool = False,
                          act_bytes: int = 2, dense_dtype: str = "auto", lm_head_dtype: str = "auto") -> dict[str, int]:
    """One rank's weights before loading them: FP8 experts (K padded to 128-blocks, one fp32 scale per 128x128
    block, fp32 biases), the packed MXFP4 copy `mxfp4_decode_max_tokens` keeps (rows to 16, K to 64; half a byte
    per weight and 4 bytes of scales per 16 x 64 tile: kernels/moe/mxfp4_cuda.pack_mma_words), the dense rest
    (QKV / O and the unembedding in FP8 blocks where dense_dtype / lm_head_dtype is "fp8_e4m3")."""
    d, i, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    experts = c.num_local_experts // ep_size
    shapes = ((2 * i, d), (d, i))  # gate_up [2I, D], down [D, I]: (out, in)
    fp8 = sum(linear_bytes(n, k, True) + 4 * n for n, k in shapes)  # + the fp32 biases
    mx = sum((-(-n // 16) * 16) * (-(-k // 64) * 64) // 2 + (-(-n // 16)) * (-(-k // 64)) * 32 for n, k in shapes)
    heads = (c.num_attention_heads + 2 * c.num_key_value_heads) // tp_size * c.head_dim
    o_in = c.num_attention_heads // tp_size * c.head_dim
    dense_fp8 = dense_dtype == "fp8_e4m3"
    attention = (linear_bytes(heads, d, dense_fp8, act_bytes) + linear_bytes(d, o_in, dense_fp8, act_bytes)
                 + (heads + d) * act_bytes)  # + the biases
    vocab = c.vocab_size // tp_size
    embeddings = vocab * d * act_bytes + linear_bytes(vocab, d, lm_head_dtype == "fp8_e4m3", act_bytes)
    dense = layers * (attention + c.num_local_experts * (d + 1) * act_bytes) + embeddings
    return {"fp8_experts": layers * experts * fp8, "mxfp4_copy": layers * experts * mx if mxfp4_copy else 0,
            "dense": dense}
