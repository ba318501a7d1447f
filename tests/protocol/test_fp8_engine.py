"""FP8 engines (`--quantization fp8_block | fp8_row`) as real processes on the tiny model (CPU, fp32):

- the engine's prompt log-probs equal those of the trainer's fake-quant forward (transformers' model
  in fp32 with every contract-covered weight replaced by `fake_quant(w, layout)`) within 1e-4, and
  differ from the unquantised model's: on CPU the engine multiplies the dequantised FP8 weights in
  fp32, the same values, so only summation order separates the two;
- an FP8 checkpoint written with the contract loads as it is (/weights_checker checksums equal the
  bytes written), and one started without `--quantization` exits naming the key;
- weight updates: the pair is stored as sent (over /update_weights_from_tensor and over the
  distributed route, where float8 travels as uint8), a float weight is quantised on receipt with
  the contract, /get_weights_by_name answers dequantised values, a bad scale is a 400 naming it;
- /weights_checker answers SGLang's reply shape, and 400 for the actions it does not serve.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import save_file

from miles.engine.model import load_weights
from miles.engine.process import start_engine
from miles.processes import free_port
from miles.quant.fp8 import (
    dequantize_weight,
    fake_quant,
    is_quantized_name,
    quantize_weight,
    scale_name,
)
from miles.weights.checksum import checksum
from miles.weights.group import broadcast_from_trainer, destroy_update_group, init_update_group
from miles.weights.tensor import serialize

PROMPT = [12, 40, 7, 99, 5, 230, 61, 18, 77, 150]
Q0 = "model.layers.0.self_attn.q_proj.weight"
GATE1 = "model.layers.1.mlp.gate_proj.weight"
TOL = 1e-4


def _post(engine, route: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(engine.url + route, json=body, timeout=timeout)


def _ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _checksums(engine) -> dict[str, str]:
    return _ok(_post(engine, "/weights_checker", {"action": "checksum"}))["ranks"][0]["checksums"]


def _prompt_logprobs(engine) -> list[float]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}}
    meta = _ok(_post(engine, "/generate", {**body, "return_logprob": True, "logprob_start_len": 0}))[
        "meta_info"
    ]
    return [row[0] for row in meta["input_token_logprobs"][1:]]


def _hf_logprobs(tiny_model, layout: str | None) -> list[float]:
    """The trainer side: transformers' fp32 forward, covered weights fake-quantised when `layout`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if layout is not None and is_quantized_name(name):
                p.copy_(fake_quant(p, layout))
        logp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    return [logp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model, tmp_path_factory):
    """The tiny model as an FP8 block checkpoint in the SGLang/DeepSeek layout, written with the contract;
    returns (directory, the tensors written)."""
    out = tmp_path_factory.mktemp("fp8-checkpoint") / "tiny-fp8"
    shutil.copytree(tiny_model, out)
    written = {}
    for name, w in load_weights(tiny_model).items():
        if is_quantized_name(name):
            written[name], written[scale_name(name)] = quantize_weight(w, "fp8_block")
        else:
            written[name] = w
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(written, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return out, written


def _engine(model, tmp_path_factory, layout: str):
    log = tmp_path_factory.mktemp(f"protocol-{layout}") / "engine.log"
    return start_engine(
        model, device="cpu", dtype="float32", log_path=log, extra_args=["--quantization", layout]
    )


@pytest.fixture(scope="module")
def block_engine(fp8_checkpoint, tmp_path_factory):
    """Serves the FP8 checkpoint as it is; read only."""
    proc = _engine(fp8_checkpoint[0], tmp_path_factory, "fp8_block")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def row_engine(tiny_model, tmp_path_factory):
    """The fp32 checkpoint quantised row-wise at load; read only."""
    proc = _engine(tiny_model, tmp_path_factory, "fp8_row")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def update_engine(tiny_model, tmp_path_factory):
    """The fp32 checkpoint quantised in blocks at load; the update tests write into it."""
    proc = _engine(tiny_model, tmp_path_factory, "fp8_block")
    yield proc
    proc.stop()


@pytest.mark.parametrize("layout", ["fp8_block", "fp8_row"])
def test_fp8_logprobs_match_the_fake_quant_forward(request, tiny_model, layout):
    engine = request.getfixturevalue("block_engine" if layout == "fp8_block" else "row_engine")
    got = _prompt_logprobs(engine)
    assert got == pytest.approx(_hf_logprobs(tiny_model, layout), abs=TOL)
    plain = _hf_logprobs(tiny_model, None)
    assert max(abs(a - b) for a, b in zip(got, plain, strict=True)) > 10 * TOL  # really quantised


def test_fp8_checkpoint_loads_as_it_is(block_engine, fp8_checkpoint):
    _, written = fp8_checkpoint
    assert _checksums(block_engine) == {name: checksum(t) for name, t in written.items()}


def test_fp8_checkpoint_without_quantization_exits_naming_the_key(fp8_checkpoint, tmp_path):
    with pytest.raises(
        RuntimeError, match=r"engine.quantization=none \(--quantization\): set it to fp8_block"
    ):
        start_engine(fp8_checkpoint[0], device="cpu", log_path=tmp_path / "engine.log")


def test_weights_checker_reply_shape_and_unsupported_actions(block_engine):
    reply = _ok(httpx.get(block_engine.url + "/weights_checker", timeout=60))  # no body: checksum
    assert set(reply) == {"success", "message", "ranks", "per_engine_checksum"} and reply["success"] is True
    (rank,) = reply["ranks"]
    assert rank["parallelism_info"] == {
        "role": "target",
        **dict.fromkeys(("tp_rank", "dp_rank", "pp_rank", "rank"), 0),
        **dict.fromkeys(("tp_size", "dp_size", "pp_size", "size"), 1),
    }
    overall = hashlib.sha256()
    for name in sorted(rank["checksums"]):
        overall.update(name.encode() + rank["checksums"][name].encode())
    assert rank["per_gpu_checksum"] == overall.hexdigest()
    assert reply["per_engine_checksum"] == hashlib.sha256(overall.hexdigest().encode()).hexdigest()
    skipped = _checksums_skipping(block_engine, ["mlp."])
    assert skipped and not any("mlp." in n for n in skipped)
    for action in ("snapshot", "compare", "reset_tensors"):
        resp = _post(block_engine, "/weights_checker", {"action": action})
        assert resp.status_code == 400 and resp.json() == {
            "success": False,
            "message": f"Unsupported action={action!r}: the embedded engine serves action='checksum' only",
        }


def _checksums_skipping(engine, skip: list[str]) -> dict[str, str]:
    body = {"action": "checksum", "skip_tensor_list": skip}
    return _ok(_post(engine, "/weights_checker", body))["ranks"][0]["checksums"]


def _send(engine, named: dict[str, torch.Tensor]) -> httpx.Response:
    body = {"serialized_named_tensors": [serialize(list(named.items()))]}
    return _post(engine, "/update_weights_from_tensor", body)


def _weight(engine, name: str) -> torch.Tensor:
    return torch.tensor(_ok(_post(engine, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20})))


def test_pair_update_is_stored_as_sent(update_engine):
    before = _checksums(update_engine)
    sent = {}
    for name, seed in ((Q0, 1), (GATE1, 2)):
        w = torch.randn(_weight(update_engine, name).shape, generator=torch.Generator().manual_seed(seed))
        sent[name], sent[scale_name(name)] = quantize_weight(w * 0.05, "fp8_block")
    assert _ok(_send(update_engine, sent))["success"] is True
    after = _checksums(update_engine)
    assert {n: after[n] for n in sent} == {n: checksum(t) for n, t in sent.items()}
    assert {n: h for n, h in after.items() if n not in sent} == {
        n: h for n, h in before.items() if n not in sent
    }
    want = dequantize_weight(sent[Q0], sent[scale_name(Q0)], "fp8_block", torch.float32)
    assert torch.equal(_weight(update_engine, Q0), want)  # read back dequantised, as SGLang


def test_float_update_is_quantised_on_receipt(update_engine):
    w = torch.randn(_weight(update_engine, GATE1).shape, generator=torch.Generator().manual_seed(3)) * 0.05
    assert _ok(_send(update_engine, {GATE1: w}))["success"] is True
    q, s = quantize_weight(w, "fp8_block")
    after = _checksums(update_engine)
    assert (after[GATE1], after[scale_name(GATE1)]) == (checksum(q), checksum(s))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda s: s.bfloat16(), "weight_scale_inv must be float32, got bfloat16"),
        (lambda s: torch.cat((s, s)), "must have shape [1, 1], got [2, 1]"),
    ],
    ids=["dtype", "shape"],
)
def test_bad_scale_is_refused_naming_it(update_engine, bad, message):
    q, s = quantize_weight(torch.randn(_weight(update_engine, Q0).shape) * 0.05, "fp8_block")
    before = _checksums(update_engine)
    resp = _send(update_engine, {Q0: q, scale_name(Q0): bad(s)})
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert scale_name(Q0) in resp.json()["message"] and message in resp.json()["message"]
    assert _checksums(update_engine) == before


def test_distributed_update_receives_float8_as_uint8(update_engine):
    shape = list(_weight(update_engine, Q0).shape)
    q, s = quantize_weight(torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 0.05, "fp8_block")
    port, name = free_port(), "fp8-group"
    join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(
            _post,
            update_engine,
            "/init_weights_update_group",
            {**join, "group_name": name, "backend": "gloo"},
        )
        group = init_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=60)
        try:
            assert joining.result().json()["success"] is True
            body = {
                "names": [Q0, scale_name(Q0)],
                "dtypes": ["float8_e4m3fn", "float32"],
                "shapes": [shape, list(s.shape)],
                "group_name": name,
            }
            update = pool.submit(_post, update_engine, "/update_weights_from_distributed", body)
            broadcast_from_trainer(q.view(torch.uint8), group)  # gloo has no float8
            broadcast_from_trainer(s, group)
            assert update.result().json()["success"] is True
        finally:
            destroy_update_group(group)
    _ok(_post(update_engine, "/destroy_weights_update_group", {"group_name": name}))
    after = _checksums(update_engine)
    assert (after[Q0], after[scale_name(Q0)]) == (checksum(q), checksum(s))


@pytest.mark.parametrize("layout", ["fp8_block", "fp8_row"])
def test_an_update_refreshes_the_decode_copies_of_what_it_touched(tmp_path, layout):
    """A weight update re-dequantises the decode copies (CUDA engines) of the stored FP8 tensors that
    hold what it sent, fused or not, whether the weight or its scale came: those and no others."""
    from miles.engine.fp8_weights import Fp8Decoder
    from miles.engine.model import ModelSpec
    from miles.models.tiny import init_tiny

    sizes = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=8)
    model = init_tiny(tmp_path / "m", arch="qwen2", num_key_value_heads=2, **sizes)  # k/v rows not x128
    dec = Fp8Decoder(ModelSpec.from_dir(model), load_weights(model), "cpu", torch.float32, layout, 1024)
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    gate_up = {mlp + "gate_up_proj.weight"}
    assert dec.fp8_storage_of([mlp + "up_proj.weight"]) == gate_up
    assert dec.fp8_storage_of([mlp + "gate_proj.weight_scale_inv"]) == gate_up
    qkv = {attn + "qkv_proj.weight"} if layout == "fp8_row" else {attn + "k_proj.weight"}  # block: unfused
    assert dec.fp8_storage_of([attn + "k_proj.weight"]) == qkv
    assert (
        dec.fp8_storage_of(["model.norm.weight", "model.embed_tokens.weight", attn + "q_proj.bias"]) == set()
    )
    every = dec.fp8_storage_of(dec.storage)
    assert every == {k for k, t in dec.storage.items() if t.dtype == torch.float8_e4m3fn}
    per_layer = 4 if layout == "fp8_row" else 6  # qkv (row) or q, k, v (block); o; gate_up; down
    assert len(every) == 2 * per_layer
