"""The FP8 quantisation contract (miles/quant/fp8.py) on CPU.

The vectorised torch reference is checked byte for byte against a second implementation written
here: a Python loop over blocks (or rows, or 1 x group slices) doing the contract's steps in numpy
fp32 (IEEE), and a cast to float8_e4m3fn by nearest-value lookup in the table of all 256 codes (ties
to the even code), so neither torch's blocking nor its cast is trusted. Shapes: 1x1, partial blocks
(127x129, 300x1000), whole blocks (128x128), a Qwen2-0.5B MLP weight (896x4864); fp32, bf16 and fp16
inputs; scales of random magnitude per block; all-zero blocks; values at and far over 448.
Then the scale layouts, the dequantisation error, fake quant (value and straight-through gradient),
activations per token and per group (and their independence from the batch), fp8_linear's CPU
scaled-mm and dequantise paths against an fp32 reference, the checksum, the covered HF names of real
Qwen2 / Qwen3 / Qwen3-MoE models, and a compile of the Triton kernels to an sm_90 cubin.

The Triton kernels also run on CPU under Triton's interpreter, in a child process (TRITON_INTERPRET
is read when a kernel is decorated and would leak into other kernels): their fp32 scales must equal
the reference's bit for bit and every byte must land where the reference puts it (same sign bit).
The interpreter's own float8 cast is not the GPU's (it truncates, and maps e.g. -124.4 to -64), so
byte equality is left to tests/gpu/test_fp8_gpu.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from miles.quant import fp8
from miles.weights.checksum import checksum

SHAPES = [(1, 1), (127, 129), (128, 128), (300, 1000), (896, 4864)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _codes() -> tuple[np.ndarray, np.ndarray]:
    """(values, bytes) of the finite non-negative e4m3fn codes, ascending (0x00 .. 0x7E)."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    return codes.view(fp8.FP8_DTYPE).float().numpy(), codes.numpy()


def _cast_e4m3(v: np.ndarray) -> np.ndarray:
    """fp32 values in [-448, 448] to e4m3fn bytes, round to nearest, ties to the even code."""
    values, codes = _codes()
    mag = np.abs(v)
    hi = np.clip(np.searchsorted(values, mag, side="left"), 0, len(values) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, codes[hi], codes[lo]).astype(np.uint8)
    return out | np.where(np.signbit(v), 0x80, 0).astype(np.uint8)


def _slow_tile(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """The contract's steps for one tile in numpy fp32: (bytes, s)."""
    amax = np.float32(np.abs(x).max())
    s = np.float32(max(amax, np.float32(1e-10))) / np.float32(448.0)
    inv = np.float32(1.0) / s
    return _cast_e4m3(np.clip(x * inv, np.float32(-448.0), np.float32(448.0))), s


def slow_quantize(w: torch.Tensor, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Tiles of rows x cols one at a time: (bytes [R, C], scales [ceil(R/rows), ceil(C/cols)])."""
    x = w.float().numpy()
    n_rows, n_cols = x.shape
    out = np.zeros(x.shape, np.uint8)
    scales = np.zeros((-(-n_rows // rows), -(-n_cols // cols)), np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            sl = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            out[sl], scales[i, j] = _slow_tile(x[sl])
    return out, scales


def _weight(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian weight with a random magnitude per 64x64 patch (1e-6 .. 1e3), zero and huge patches."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    ph, pw = -(-shape[0] // 64), -(-shape[1] // 64)
    mag = 10.0 ** torch.empty(ph, pw).uniform_(-6, 3, generator=gen)
    w = w * mag.repeat_interleave(64, 0).repeat_interleave(64, 1)[: shape[0], : shape[1]]
    if shape[0] > 128 and shape[1] > 128:
        w[:128, 128:256] = 0.0  # an all-zero block
        w[-1, -1] = 448.0 * 100  # far over the FP8 range (and within fp16)
        w[0, 0] = 448.0
    return w.to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_bytes_equal_a_loop_over_blocks(shape, dtype) -> None:
    w = _weight(shape, dtype, seed=shape[0] + shape[1])
    q, s = fp8.quantize_weight(w, "fp8_block")
    want_q, want_s = slow_quantize(w, fp8.BLOCK, fp8.BLOCK)
    assert q.dtype == fp8.FP8_DTYPE and s.dtype == torch.float32
    assert tuple(s.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    np.testing.assert_array_equal(s.numpy(), want_s)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want_q)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_bytes_equal_a_loop_over_rows(shape, dtype) -> None:
    w = _weight(shape, dtype, seed=7 * shape[0] + shape[1])
    q, s = fp8.quantize_weight(w, "fp8_row")
    want_q, want_s = slow_quantize(w, 1, shape[1])
    assert tuple(s.shape) == (shape[0], 1)
    np.testing.assert_array_equal(s.numpy(), want_s)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want_q)


def test_zero_blocks_and_range_edges() -> None:
    w = torch.zeros(256, 256)
    w[128:, 128:] = torch.randn(128, 128) * 1e6
    w[130, 140] = 1e9
    q, s = fp8.quantize_weight(w, "fp8_block")
    assert (q[:128].view(torch.uint8) == 0).all() and (q[:, :128].view(torch.uint8) == 0).all()
    floor = torch.tensor(1e-10, dtype=torch.float32) / torch.tensor(448.0)
    assert s[0, 0] == floor and s[0, 1] == floor and s[1, 0] == floor
    assert s[1, 1] == torch.tensor(1e9, dtype=torch.float32) / torch.tensor(448.0)
    assert q.float()[130, 140] == 448.0 and q.float().abs().max() == 448.0
    assert torch.isfinite(fp8.dequantize_weight(q, s, "fp8_block", torch.float32)).all()
    q_neg, _ = fp8.quantize_weight(-w, "fp8_block")
    assert q_neg.float()[130, 140] == -448.0


@pytest.mark.parametrize("layout", fp8.LAYOUTS)
@pytest.mark.parametrize("shape", [(127, 129), (896, 4864)])
def test_dequantisation_error_of_gaussian_weights(layout, shape) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.02
    back = fp8.dequantize_weight(*fp8.quantize_weight(w, layout), layout, torch.float32)
    rel = float((back - w).norm() / w.norm())
    assert rel < 3.5e-2, f"{layout} {shape}: relative Frobenius error {rel:.3e}"
    assert fp8.dequantize_weight(*fp8.quantize_weight(w, layout), layout).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(256, 384), (127, 129)])
def test_dequantisation_is_q_times_the_expanded_scale(shape) -> None:
    q, s = fp8.quantize_weight(torch.randn(shape), "fp8_block")
    expanded = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(fp8.dequantize_weight(q, s, "fp8_block", dtype), (q.float() * expanded).to(dtype))


@pytest.mark.parametrize("layout", fp8.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_value_and_straight_through_gradient(layout, dtype) -> None:
    w = (torch.randn(300, 200) * 0.05).to(dtype).requires_grad_(True)
    out = fp8.fake_quant(w, layout)
    want = fp8.dequantize_weight(*fp8.quantize_weight(w.detach(), layout), layout, dtype)
    assert out.dtype == dtype
    assert torch.equal(
        out.detach().view(torch.int16 if dtype != torch.float32 else torch.int32),
        want.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
    g = torch.randn(300, 200).to(dtype)
    out.backward(g)
    assert torch.equal(w.grad, g)


@pytest.mark.parametrize("group", [None, 128, 100])
def test_activation_quantisation_per_token_and_per_group(group) -> None:
    x = (torch.randn(3, 5, 300) * torch.logspace(-3, 2, 5)[None, :, None]).to(torch.bfloat16)
    q, s = fp8.quantize_activation(x, group)
    n_groups = 1 if group is None else -(-300 // group)
    assert q.shape == x.shape and tuple(s.shape) == (3, 5, n_groups)
    want_q, want_s = slow_quantize(x.reshape(15, 300), 1, 300 if group is None else group)
    np.testing.assert_array_equal(q.reshape(15, 300).view(torch.uint8).numpy(), want_q)
    np.testing.assert_array_equal(s.reshape(15, n_groups).numpy(), want_s)
    # a token's bytes do not depend on the other tokens of the batch
    q1, s1 = fp8.quantize_activation(x[:1, :1], group)
    assert torch.equal(q1.view(torch.uint8)[0, 0], q.view(torch.uint8)[0, 0])
    assert torch.equal(s1[0, 0], s[0, 0])


def test_per_token_activations_match_row_weights() -> None:
    x = torch.randn(64, 896)
    qa, sa = fp8.quantize_activation(x)
    qw, sw = fp8.quantize_weight(x, "fp8_row")
    assert torch.equal(qa.view(torch.uint8), qw.view(torch.uint8)) and torch.equal(sa, sw)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("layout", fp8.LAYOUTS)
def test_fp8_linear_paths_agree_with_an_fp32_reference(layout) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 48, 896, generator=gen).to(torch.bfloat16)
    w, bias = torch.randn(640, 896, generator=gen) * 0.03, torch.randn(640, generator=gen).to(torch.bfloat16)
    q, s = fp8.quantize_weight(w, layout)
    w_dq = fp8.dequantize_weight(q, s, layout, torch.float32)
    ref = x.float() @ w_dq.T + bias.float()
    decode = fp8.fp8_linear(x, q, s, layout, bias, min_tokens=10**9)
    assert decode.dtype == torch.bfloat16 and decode.shape == (2, 48, 640)
    assert _rel(decode, ref) < 5e-3  # bf16 GEMM and bf16 output rounding
    prefill = fp8.fp8_linear(x, q, s, layout, bias, min_tokens=1)
    assert prefill.dtype == torch.bfloat16 and prefill.shape == (2, 48, 640)
    if layout == "fp8_row":  # the CPU scaled-mm path, on per-token FP8 activations
        qa, sa = fp8.quantize_activation(x)
        ref_fp8 = (qa.float() * sa) @ w_dq.T + bias.float()
        assert _rel(prefill, ref_fp8) < 5e-3
        assert 1e-3 < _rel(prefill, ref) < 5e-2  # the activation quantisation error is visible
    else:  # no blockwise GEMM on CPU: the dequantise path
        assert torch.equal(prefill, decode)


def test_fp8_linear_rejects_mismatched_shapes() -> None:
    q, s = fp8.quantize_weight(torch.randn(64, 128), "fp8_row")
    with pytest.raises(ValueError, match="features"):
        fp8.fp8_linear(torch.randn(4, 96), q, s, "fp8_row", min_tokens=1)
    with pytest.raises(ValueError, match=r"\[64, 1\]"):
        fp8.dequantize_weight(q, s.view(1, 64), "fp8_row")
    with pytest.raises(ValueError, match="fp8_block"):
        fp8.dequantize_weight(q, s, "fp8_block")
    with pytest.raises(ValueError, match="known layouts"):
        fp8.quantize_weight(torch.randn(4, 4), "fp8_tensor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_weight(torch.randn(4), "fp8_row")


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12, dtype=torch.float32).view(3, 4),
        torch.randn(5, 7).to(torch.bfloat16).t(),  # not contiguous: C order of the values
        fp8.quantize_weight(torch.randn(33, 17), "fp8_block")[0],
    ],
)
def test_checksum_is_sha256_of_the_raw_bytes(t) -> None:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    digest = hashlib.sha256(raw).digest()[:8]
    assert checksum(t) == f"{int.from_bytes(digest, 'big'):016x}"
    assert len(checksum(t)) == 16


def _names(config) -> list[tuple[str, int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    return [(n, p.dim()) for n, p in model.named_parameters()]


def _tiny_configs() -> dict[str, object]:
    from miles.models.tiny import model_config  # qwen3_moe: 4 experts, layer 0 dense (mlp_only_layers)

    return {
        arch: model_config(arch, vocab_size=128, eos_id=1, pad_id=0)
        for arch in ("qwen2", "qwen3", "qwen3_moe")
    }


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_quantized_names_of_real_models(arch) -> None:
    names = _names(_tiny_configs()[arch])
    covered = {n for n, _ in names if fp8.is_quantized_name(n)}
    attn = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"}
    dense_layers = [0] if arch == "qwen3_moe" else [0, 1]
    mlp = {f"model.layers.{i}.mlp.{p}_proj.weight" for i in dense_layers for p in ("gate", "up", "down")}
    assert covered == attn | mlp
    assert all(dim == 2 for n, dim in names if n in covered)
    if arch == "qwen3_moe":
        assert "model.layers.1.mlp.gate.weight" in dict(names)  # the router stays bf16
    for name in covered:
        assert fp8.scale_name(name) == name + "_scale_inv"


@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.experts.7.gate_proj.weight",
        "model.layers.3.mlp.experts.gate_up_proj",
        "model.layers.3.mlp.shared_expert.up_proj.weight",
        "model.layers.3.mlp.shared_expert_gate.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "layers.0.self_attn.q_proj.weight",
    ],
)
def test_names_outside_the_contract(name) -> None:
    assert not fp8.is_quantized_name(name)


def test_scale_name_needs_a_weight() -> None:
    with pytest.raises(ValueError, match="weight"):
        fp8.scale_name("model.layers.0.self_attn.q_proj.bias")


def test_kernels_compile_for_hopper(tmp_path, monkeypatch) -> None:
    """Triton's compiler to an sm_90 cubin, so a construct only the compiler rejects fails here; the
    PTX must use IEEE division (div.rn.f32, no approximate reciprocal) and a round-to-nearest FP8 cast."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from miles.quant.triton_fp8 import _row_kernel, _tile_kernel

    def build(fn, x_type: str, consts: dict, warps: int):
        types = dict(x_ptr=f"*{x_type}", q_ptr="*fp8e4nv", scale_ptr="*fp32")
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in types}
        src = compiler.ASTSource(fn, sig, consts, attrs)
        options = {"num_warps": warps, "enable_fp_fusion": False}
        return compiler.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

    for x_type in ("bf16", "fp32"):
        for fn, consts, warps in (
            (_tile_kernel, dict(ROWS=128, COLS=128), 8),
            (_tile_kernel, dict(ROWS=1, COLS=128), 4),
            (_row_kernel, dict(CHUNK=1024), 4),
        ):
            kernel = build(fn, x_type, consts, warps)
            ptx = kernel.asm["ptx"]
            assert kernel.asm["cubin"], "no cubin"
            assert ptx.count("div.rn.f32") == 2 and "div.full" not in ptx and "rcp.approx" not in ptx
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


@pytest.mark.parametrize(
    ("name", "formats"),
    [
        ("h100", {"e4m3fn", "e5m2"}),
        ("h200", {"e4m3fn", "e5m2"}),
        ("b200", {"e4m3fn", "e5m2", "mxfp8", "nvfp4"}),
        ("gb300", {"e4m3fn", "e5m2", "mxfp8", "nvfp4"}),
        ("mi355x", {"e4m3fn", "e5m2", "mxfp8"}),  # CDNA4: OCP FP8, not MI300's fnuz
    ],
)
def test_profiles_name_their_fp8_formats(name, formats) -> None:
    from miles.config.profile import check_fp8_formats, load_profile

    profile = load_profile(name)
    assert set(profile.fp8_formats or []) == formats
    check_fp8_formats(profile, {"engine.quantization": "fp8_block", "train.quantization": "torchao_float8"})


def test_a_format_the_profile_lacks_is_refused_naming_the_key() -> None:
    from miles.config.base import ConfigError
    from miles.config.profile import check_fp8_formats, load_profile

    mi300 = load_profile("mi355x").model_copy(
        update={"name": "mi300x", "fp8_formats": ["e4m3fnuz", "e5m2fnuz"]}
    )
    with pytest.raises(ConfigError, match=r"engine\.quantization=fp8_row .* e4m3fn\b.* fp8_formats"):
        check_fp8_formats(mi300, {"engine.quantization": "fp8_row", "train.quantization": "none"})
    with pytest.raises(ConfigError, match=r"train\.quantization=torchao_float8"):
        check_fp8_formats(mi300, {"engine.quantization": "none", "train.quantization": "torchao_float8"})
    check_fp8_formats(mi300, {"engine.quantization": "none", "train.quantization": "fake_quant"})
    unstated = load_profile("local")  # a profile that states nothing is not checked
    assert unstated.fp8_formats is None
    check_fp8_formats(unstated, {"engine.quantization": "fp8_block"})


def test_blackwell_formats_native_on_gb300_and_emulated_by_the_embedded_engine_elsewhere() -> None:
    from miles.config.base import ConfigError
    from miles.config.profile import check_fp8_formats, load_profile

    for fmt in ("mxfp8", "nvfp4"):
        values = {"engine.quantization": fmt, "train.quantization": "fake_quant"}
        check_fp8_formats(load_profile("gb300"), values)  # SGLang computes in them there
        with pytest.raises(ConfigError, match=rf"engine\.quantization={fmt} computes in {fmt}.*'h200'"):
            check_fp8_formats(load_profile("h200"), values)
        check_fp8_formats(load_profile("h200"), values, emulate=True)  # the embedded engine dequantises


def test_unknown_fp8_format_in_a_profile_is_an_error(tmp_path) -> None:
    from miles.config.base import ConfigError
    from miles.config.profile import load_profile

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        open(fp8.__file__.replace("miles/quant/fp8.py", "profiles/h200.yaml")).read() + "fp8_formats: [fp8]\n"
    )
    with pytest.raises(ConfigError, match="fp8_formats"):
        load_profile(str(bad))


INTERPRETER_CASES = [("weight", (127, 129), "fp8_block"), ("weight", (300, 1000), "fp8_block"),
                     ("weight", (1, 1), "fp8_block"), ("weight", (127, 2100), "fp8_row"),
                     ("act", (3, 5, 300), None), ("act", (7, 300), 128), ("act", (7, 300), 100)]  # fmt: skip


def interpreter_cases() -> list[dict]:
    """Run under TRITON_INTERPRET=1: the kernels on CPU tensors against the torch reference."""
    from miles.quant import triton_fp8

    rows = []
    for i, (kind, shape, arg) in enumerate(INTERPRETER_CASES):
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 3).to(torch.bfloat16)
        if kind == "weight":
            got, want = triton_fp8.quantize_weight_triton(x, arg), fp8.quantize_weight_torch(x, arg)
        else:
            got, want = triton_fp8.quantize_activation_triton(x, arg), fp8.quantize_activation_torch(x, arg)
        signs = [(t.view(torch.uint8) & 0x80) for t in (got[0], want[0])]
        row = dict(case=i, q_shape=list(got[0].shape) == list(want[0].shape))
        row.update(s_shape=list(got[1].shape) == list(want[1].shape), scales=torch.equal(got[1], want[1]))
        row.update(signs=torch.equal(*signs), nonzero=int(want[0].float().ne(0).sum()))
        rows.append(row)
    return rows


def test_kernels_under_the_interpreter() -> None:
    proc = subprocess.run(
        [sys.executable, __file__],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(INTERPRETER_CASES)
    for row in rows:
        assert row["q_shape"] and row["s_shape"] and row["scales"] and row["signs"], row
        assert row["nonzero"] > 0, row


if __name__ == "__main__":
    for case in interpreter_cases():
        print(json.dumps(case))
