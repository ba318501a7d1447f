"""The INT4 contract (miles/quant/int4.py): its properties, and the pack-quantized layout read and
written bit-exactly by the compressed-tensors package itself."""

from __future__ import annotations

import pytest
import torch

from miles.quant import int4


def _weights(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g) * 3
    w[3, :32] = 0.0  # an all-zero group
    w[5, 40] = 100.0  # an outlier
    return w.to(dtype)


@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_properties(group_size: int, dtype: torch.dtype) -> None:
    for seed in range(5):
        w = _weights(seed, dtype)
        q, scale = int4.quantize(w, group_size)
        wq = int4.fake_quant(w, group_size)
        # idempotent, on the values and on the codes
        assert torch.equal(int4.fake_quant(wq, group_size), wq)
        assert torch.equal(int4.quantize(wq, group_size)[0], q)
        # at most 15 levels per group, all within [-7, 7]
        groups = q.reshape(q.shape[0], -1, group_size)
        assert int(q.abs().max()) <= 7
        assert max(len(torch.unique(g)) for row in groups for g in row) <= 15
        # the error of each weight is at most half its group's step
        err = (w.float() - int4.dequantize(q, scale, group_size)).abs()
        bound = scale.repeat_interleave(group_size, dim=1) / 2
        assert bool((err <= bound * (1 + 1e-6)).all())
        # an all-zero group stays zero with a finite scale
        assert bool((wq[3, :32] == 0).all()) and torch.isfinite(scale).all()


def test_straight_through_gradient() -> None:
    w = _weights(0).requires_grad_(True)
    g = torch.randn_like(w)
    (int4.fake_quant(w, 32) * g).sum().backward()
    assert torch.equal(w.grad, g)


def test_pack_layout_and_roundtrip() -> None:
    q = torch.tensor([[-8, -1, 0, 1, 2, 3, 4, 7, 7, 7, 7, 7, 7, 7, 7, -8]], dtype=torch.int8)
    words = int4.pack(q)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    # value j of a word in bits 4j..4j+3 as q + 8: 0, 7, 8, 9, 10, 11, 12, 15 -> 0xFCBA9870
    assert int(words[0, 0]) & 0xFFFFFFFF == 0xFCBA9870
    assert torch.equal(int4.unpack(words, q.shape), q)
    with pytest.raises(ValueError, match="divisible by 8"):
        int4.pack(torch.zeros(2, 12, dtype=torch.int8))
    with pytest.raises(ValueError, match="does not divide"):
        int4.quantize(torch.zeros(4, 96), 128)


def test_compressed_tensors_reads_and_writes_the_same_bits() -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    for seed in range(3):
        q, _ = int4.quantize(_weights(seed), 32)
        ours = int4.pack(q)
        assert torch.equal(helpers.pack_to_int32(q, 4), ours)
        assert torch.equal(helpers.unpack_from_int32(ours, 4, q.shape), q)


def test_checkpoint_tensors_and_config() -> None:
    qmod = pytest.importorskip("compressed_tensors.quantization")
    w = _weights(1, torch.bfloat16)
    tensors = int4.compress("model.layers.0.mlp.down_proj.weight", w, 128)
    assert set(tensors) == {f"model.layers.0.mlp.down_proj.weight_{k}" for k in ("packed", "scale", "shape")}
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.bfloat16
    back = int4.decompress(tensors, "model.layers.0.mlp.down_proj", 128, torch.float32)
    q, scale = int4.quantize(w, 128)
    assert torch.allclose(back, int4.dequantize(q, scale.to(torch.bfloat16), 128), rtol=0, atol=0)
    packed = tensors["model.layers.0.mlp.down_proj.weight_packed"]
    assert packed.element_size() * packed.numel() * 4 == w.numel() * 2  # 4x fewer bytes than bf16
    cfg = qmod.QuantizationConfig.model_validate(int4.quantization_config(128))
    scheme = cfg.config_groups["group_0"]
    assert (
        cfg.format == "pack-quantized" and scheme.weights.num_bits == 4 and scheme.weights.group_size == 128
    )
    assert (
        scheme.weights.symmetric and scheme.weights.strategy == "group" and scheme.input_activations is None
    )
    with pytest.raises(ValueError, match="group_size must be one of"):
        int4.quantization_config(64)
