"""Packed formats on CUDA: the embedded engine's int4 GEMM (tinygemm) and dequantised paths against a
plain decoder holding the fake-quant values, CUDA-graph decode equal to eager decode, MoE experts, and
the Megatron trainer's fake-quant forward equal to a Hugging Face model holding the engine's values
(fp32), its export equal to the format's parts. Skipped without CUDA (Megatron: without megatron-core)."""

from __future__ import annotations

import copy
import importlib.util

import httpx
import pytest
import torch

from miles.engine.model import Batch, Decoder, ModelSpec, load_weights
from miles.engine.packed_weights import PackedDecoder
from miles.quant.formats import Format, Scheme

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SIZES = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=8)
INT4 = Scheme(Format("int4", 128))
INT4_GEMM_TOL = 5e-2
"""Max |log-prob| difference of tinygemm against bf16 F.linear over the same dequantised weights: both
accumulate in fp32 over bf16 inputs, in different orders, through two layers."""
PROMPT = list(range(5, 5 + 200, 3))  # 67 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(
        init_tiny(tmp_path_factory.mktemp("packed") / "m", arch="qwen2", num_key_value_heads=2, **SIZES)
    )


def _logprobs(dec: Decoder, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    ar = torch.arange(n)
    b = Batch(
        input_ids=torch.tensor(tokens), positions=ar, write_slots=ar + 1,
        query_index=ar[None], query_pos=ar[None], context_slots=(ar + 1)[None], last_index=ar,
    )  # fmt: skip
    b = Batch(**{k: v.cuda() for k, v in vars(b).items() if v is not None})
    return torch.log_softmax(dec.forward(b, dec.new_kv_pool(n + 1)), dim=-1)


def _reference(path: str, scheme: Scheme) -> torch.Tensor:
    weights = load_weights(path)
    fake = {
        n: scheme.fmt.fake_quant(w.cuda().bfloat16()) if scheme.covers(n) else w for n, w in weights.items()
    }
    return _logprobs(Decoder(ModelSpec.from_dir(path), fake, "cuda", torch.bfloat16), PROMPT)


def _packed(path: str, scheme: Scheme, max_rows: int) -> PackedDecoder:
    return PackedDecoder(
        ModelSpec.from_dir(path), load_weights(path), "cuda", torch.bfloat16, scheme, max_rows
    )


def test_int4_gemm_and_dequantised_path_against_the_fake_quant_values(model):
    ref = _reference(model, INT4)
    dequantised = _packed(model, INT4, 0)
    assert dequantised._int4 == {}
    err_dq = float((_logprobs(dequantised, PROMPT) - ref).abs().max())
    gemm = _packed(model, INT4, 1 << 30)
    assert set(gemm._int4) == {
        f"model.layers.{i}.{x}"
        for i in range(2)
        for x in (
            "self_attn.qkv_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_up_proj.weight",
            "mlp.down_proj.weight",
        )
    }
    err_gemm = float((_logprobs(gemm, PROMPT) - ref).abs().max())
    print(
        f"int4 on CUDA vs fake-quant bf16 max |log-prob diff|: dequantised {err_dq:.2e}, tinygemm {err_gemm:.2e}"
    )
    assert err_dq <= 1e-3 and err_gemm <= INT4_GEMM_TOL
    # an update of the packed parts lands in the GEMM's tile layout in place (captured graphs stay valid)
    name = "model.layers.1.mlp.down_proj.weight"
    key = name
    before = gemm._int4[key].data_ptr()
    new = (
        torch.randn(SIZES["hidden_size"], SIZES["intermediate_size"], device="cuda", dtype=torch.bfloat16)
        * 0.05
    )
    gemm.load(dict(INT4.encode(name, new)))
    assert gemm._int4[key].data_ptr() == before
    x = torch.randn(3, SIZES["intermediate_size"], device="cuda", dtype=torch.bfloat16)
    got = gemm._linear(x, key)
    want = torch.nn.functional.linear(x, INT4.fmt.fake_quant(new))
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())
    gemm.offload()
    gemm.onload()
    assert float((gemm._linear(x, key) - got).abs().max()) == 0.0


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_graph_decode_equals_eager_decode(model, fmt, tmp_path):
    from miles.engine.process import start_engine

    outputs = []
    for flags in ([], ["--disable-cuda-graph"]):
        args = ["--quantization", fmt, "--quant-modules", "linear", "--int4-group-size", "128", *flags]
        with start_engine(
            model, device="cuda", log_path=tmp_path / f"e{len(flags)}.log", extra_args=args
        ) as e:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
            resp = httpx.post(e.url + "/generate", json=body, timeout=300)
            assert resp.status_code == 200, resp.text
            outputs.append(resp.json()["output_ids"])
    assert outputs[0] == outputs[1]


def test_moe_int4_experts_on_cuda(tmp_path):
    from miles.models.tiny import init_tiny

    path = str(
        init_tiny(tmp_path / "moe", arch="qwen3_moe", seed=2, hidden_size=128, moe_intermediate_size=128)
    )
    scheme = Scheme(Format("int4", 128), "experts")
    err = float((_logprobs(_packed(path, scheme, 64), PROMPT) - _reference(path, scheme)).abs().max())
    assert err <= 1e-3


# ---- Megatron ---------------------------------------------------------------------------------------

needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)


def _megatron(path: str, root: str, quant: str, scheme: Scheme):
    from miles.config import Plan
    from miles.train.megatron.backend import MegatronBackend

    group = {"int4_group_size": scheme.fmt.group_size} if scheme.name == "int4" else {}  # others: fixed
    plan = Plan.model_validate({
        "model": {"path": path, "dtype": "float32"},
        "engine": {"quantization": scheme.name, "quant_modules": scheme.modules, **group},
        "train": {"backend": "megatron", "lr": 1e-3, "quantization": quant},
        "run": {"runs_root": root, "name": f"{scheme.name}-{scheme.modules}"},
    })  # fmt: skip
    b = MegatronBackend()
    b.setup(plan)
    return b


@needs_megatron
@pytest.mark.parametrize(
    ("arch", "scheme", "quant"),
    [
        ("qwen2", Scheme(Format("int4", 32), "linear"), "int4_qat"),
        ("qwen3_moe", Scheme(Format("int4", 32), "experts"), "int4_qat"),
        ("qwen2", Scheme(Format("mxfp8"), "linear"), "fake_quant"),
        ("qwen2", Scheme(Format("nvfp4"), "linear"), "fake_quant"),
    ],
    ids=["int4-dense", "int4-moe-experts", "mxfp8", "nvfp4"],
)
def test_megatron_fake_quant_forward_and_export(tmp_path, arch, scheme, quant):
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import init_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    path = str(init_tiny(tmp_path / "m", arch=arch, seed=3))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    b = _megatron(path, str(tmp_path / "runs"), quant, scheme)
    ref = copy.deepcopy(hf)
    from miles.train.fsdp.weights import checkpoint_names

    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 3:  # stacked experts: each expert's gate, up and down as its HF weights
                p.copy_(scheme.fmt.fake_quant_rows(p, pieces=2 if name.endswith("gate_up_proj") else 1))
            elif scheme.covers(name):
                p.copy_(scheme.fmt.fake_quant(p))
    ids = torch.randint(4, 380, (2, 33), device="cuda")
    pos = torch.arange(33, device="cuda").expand(2, 33)
    with torch.no_grad():
        ours = b.model.module(ids, pos, None).float()
        want = ref(ids).logits.float()
        plain = hf(ids).logits.float()
    err = ((ours - want).norm() / want.norm()).item()
    gap = ((plain - want).norm() / want.norm()).item()
    print(
        f"megatron {scheme.name}/{scheme.modules} vs HF holding the engine's values: {err:.2e}; plain: {gap:.2e}"
    )
    assert err < 1e-4 < gap
    exported = {n: t for bucket in b.export_weights(1 << 30) for n, t in bucket}
    hf_named = dict(pair for n, t in hf.state_dict().items() for pair in checkpoint_names(n, t))
    covered = [n for n in hf_named if scheme.covers(n)]
    assert covered
    for name in covered:
        for part, t in scheme.encode(name, hf_named[name]):
            assert torch.equal(
                exported[part].cpu().reshape(-1).view(torch.uint8), t.cpu().reshape(-1).view(torch.uint8)
            ), part
