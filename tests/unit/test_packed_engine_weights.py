"""The embedded engine's packed weights (miles/engine/packed_weights.py) in process, on the tiny dense
and MoE models: covered weights stored as the format's parts exactly as encoded or sent, the forward
equal to a plain decoder holding the trainer's fake-quant values, updates checked by name and dtype,
and packed checkpoints loaded as they are or refused when they disagree with the engine."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from miles.engine.fp8_weights import build_decoder, checkpoint_layout
from miles.engine.model import Batch, Decoder, ModelSpec, load_weights
from miles.engine.packed_weights import PackedDecoder
from miles.quant.formats import Format, Scheme

PROMPT = [12, 40, 7, 99, 5, 230, 61, 18]
SCHEMES = [Scheme(Format("int4", 32)), Scheme(Format("mxfp8")), Scheme(Format("nvfp4"))]
IDS = [s.name for s in SCHEMES]


@pytest.fixture(scope="module")
def dense(tiny_model):
    return ModelSpec.from_dir(tiny_model), load_weights(tiny_model)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from miles.models.tiny import init_tiny

    path = init_tiny(tmp_path_factory.mktemp("models") / "moe", arch="qwen3_moe", seed=1)
    return ModelSpec.from_dir(path), load_weights(path)


def _prefill(tokens: list[int]) -> Batch:
    ar = torch.arange(len(tokens))
    return Batch(
        input_ids=torch.tensor(tokens),
        positions=ar,
        write_slots=ar + 1,
        query_index=ar[None],
        query_pos=ar[None],
        context_slots=(ar + 1)[None],
        last_index=torch.tensor([len(tokens) - 1]),
    )


def _logits(decoder: Decoder, tokens: list[int] = PROMPT) -> torch.Tensor:
    return decoder.forward(_prefill(tokens), decoder.new_kv_pool(len(tokens) + 1))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _fake(scheme: Scheme, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: scheme.fmt.fake_quant(w) if scheme.covers(n) else w for n, w in weights.items()}


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_stores_the_encoded_parts_and_computes_the_fake_quant_values(dense, scheme):
    spec, weights = dense
    dec = PackedDecoder(spec, weights, "cpu", torch.float32, scheme)
    covered = [n for n in weights if scheme.covers(n)]
    assert len(covered) == 7 * spec.num_layers
    for name in covered:
        for part, want in scheme.encode(name, weights[name]):
            got = dec.params[part]
            assert got.dtype == want.dtype and torch.equal(_bytes(got), _bytes(want)), part
        assert torch.equal(dec.get(name), scheme.fmt.fake_quant(weights[name]))
    assert torch.equal(dec.get("model.embed_tokens.weight"), weights["model.embed_tokens.weight"])
    reference = Decoder(spec, _fake(scheme, weights), "cpu", torch.float32)
    got = _logits(dec)
    assert (got - _logits(reference)).abs().max() <= 1e-5
    assert (got - _logits(Decoder(spec, weights, "cpu", torch.float32))).abs().max() > 1e-4


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_moe_experts_only(moe_model, scheme):
    spec, weights = moe_model
    experts = Scheme(scheme.fmt, "experts")
    dec = PackedDecoder(spec, weights, "cpu", torch.float32, experts)
    expert = "model.layers.1.mlp.experts.0.gate_proj.weight"
    for part, want in experts.encode(expert, weights[expert]):
        assert dec.params[part].dtype == want.dtype and torch.equal(_bytes(dec.params[part]), _bytes(want))
    assert torch.equal(
        dec.params["model.layers.1.self_attn.q_proj.weight"],
        weights["model.layers.1.self_attn.q_proj.weight"],
    )
    reference = Decoder(spec, _fake(experts, weights), "cpu", torch.float32)
    assert (_logits(dec) - _logits(reference)).abs().max() <= 1e-5


def test_a_dense_model_with_experts_only_is_refused(dense):
    spec, weights = dense
    with pytest.raises(ValueError, match="quant_modules=linear"):
        PackedDecoder(spec, weights, "cpu", torch.float32, Scheme(Format("int4", 32), "experts"))


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_updates_store_sent_parts_or_encode_plain_weights(dense, scheme):
    spec, weights = dense
    dec = PackedDecoder(spec, weights, "cpu", torch.float32, scheme)
    name = "model.layers.1.mlp.down_proj.weight"
    new = weights[name] * 1.5 + 0.01
    parts = dict(scheme.encode(name, new))
    dec.load(parts)
    for part, t in parts.items():
        assert torch.equal(_bytes(dec.params[part]), _bytes(t))
    assert torch.equal(dec.get(name), scheme.fmt.fake_quant(new))
    # a plain weight is encoded on receipt: the same bytes
    dec.load({name: weights[name]})
    for part, t in scheme.encode(name, weights[name]):
        assert torch.equal(_bytes(dec.params[part]), _bytes(t))
    reference = Decoder(spec, _fake(scheme, weights), "cpu", torch.float32)
    assert (_logits(dec) - _logits(reference)).abs().max() <= 1e-5
    # an incomplete or mistyped set of parts is refused by name
    lone = scheme.part_names(name)[-1]
    with pytest.raises(ValueError, match="did not come"):
        dec.load({lone: parts[lone]})
    bad = dict(parts)
    key = scheme.part_names(name)[1]
    bad[key] = bad[key].to(torch.float16)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        dec.load(bad)


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_packed_checkpoint_loads_as_it_is(tiny_model, tmp_path, dense, scheme):
    spec, weights = dense
    out = tmp_path / "packed"
    shutil.copytree(tiny_model, out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    tensors = {}
    for name, w in weights.items():
        tensors.update(scheme.encode(name, w) if scheme.covers(name) else {name: w})
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = scheme.quantization_config()
    (out / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_layout(out) == scheme.name
    dec = build_decoder(spec, out, "cpu", torch.float32, scheme.name, 1024, scheme)
    for n, t in tensors.items():
        assert torch.equal(_bytes(dec.params[n]), _bytes(t)), n
    with pytest.raises(ValueError, match="set it to " + scheme.name):
        build_decoder(spec, out, "cpu", torch.float32, "none", 1024)
    if scheme.name == "int4":
        with pytest.raises(ValueError, match="group 128"):
            build_decoder(spec, out, "cpu", torch.float32, "int4", 1024, Scheme(Format("int4", 128)))
