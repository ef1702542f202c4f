import torch

from model.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def test_dequantization_is_bit_exact_with_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    # every byte value for blocks and every exponent, on an awkward expert/row count
    blocks = torch.randint(0, 256, (3, 37, 5, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (3, 37, 5), generator=g, dtype=torch.uint8)
    scales[0, 0, :] = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]
        assert ours.dtype == theirs.dtype
        assert torch.equal(ours.transpose(1, 2).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_low_nibble_first_and_scale_bias():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x7A  # low nibble 0xA -> -1.0, high nibble 0x7 -> 6.0
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^(128-127) = 2
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out[0, 0].item() == -2.0 and out[0, 1].item() == 12.0 and out[0, 2:].abs().sum() == 0


def test_quantize_roundtrip_is_exact_on_representable_values():
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (4, 7, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (4, 7, 3), generator=g, dtype=torch.uint8)
    w = dequantize_mxfp4(blocks, scales, torch.float32)
    b2, s2 = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(b2, s2, torch.float32), w)
