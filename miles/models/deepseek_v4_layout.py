"""The tensor layout of a DeepSeek-V4 checkpoint, checked from file headers alone (nothing is loaded).

A DeepSeek-V4 checkpoint names its tensors in DeepSeek's spelling, which transformers loads and writes
(`DeepseekV4ForCausalLM`): per layer `attn_norm`, `ffn_norm`, the hyper-connections `hc_attn_*` /
`hc_ffn_*`, attention `attn.{wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b}` and `attn.attn_sink`, a
compressor `attn.compressor.{wkv, wgate, ape, norm}` on compressed layers, an indexer
`attn.indexer.{wq_b, weights_proj}` with its own compressor on compressed-sparse layers, and
`ffn.gate` (a token -> experts table `tid2eid` on hash layers, a correction `bias` on top-k layers),
`ffn.experts.E.{w1, w2, w3}` and `ffn.shared_experts.{w1, w2, w3}`; MTP layers (`mtp.*`) are extra.
Names may carry a `model.` prefix; the top-level ones come in either spelling (`embed` or
`embed_tokens`, `hc_head_fn` or `hc_head.hc_fn`).

FP8 weights (`float8_e4m3fn` in the file) carry their block scales beside them, `NAME.weight_scale_inv`
or `NAME.scale`, of shape ceil(rows / b) x ceil(cols / b) for the config's `weight_block_size` b
(128 by default); the compressor and indexer projections ship in BF16 without one.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

ARCH = "DeepseekV4ForCausalLM"
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
MAX_HEADER = 100 * 2**20
"""The largest safetensors header read (the format's own limit)."""
TOP_ALIASES = {
    "embed.weight": "embed_tokens.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}


class LayoutError(ValueError):
    """The checkpoint is not a DeepSeek-V4 one; the message names what differs."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Layout:
    """What a checked checkpoint holds."""

    layers: int
    experts: int
    tensors: int
    fp8: int
    """FP8 weights, each with its scale."""
    mtp: int
    """Tensors of MTP layers (`mtp.*`), not used by the model."""


def read_headers(src: Path) -> dict[str, Tensor]:
    """Every tensor's name, dtype and shape from the safetensors headers of `src` (8-byte length, JSON)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise LayoutError(f"{src} holds no *.safetensors files")
    out: dict[str, Tensor] = {}
    for f in files:
        if f.is_symlink() or not f.is_file():
            raise LayoutError(f"{f} is not a regular file: stage the checkpoint's own files, not links")
        with f.open("rb") as fh:
            head = fh.read(8)
            (size,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < size <= min(MAX_HEADER, f.stat().st_size - 8):
                raise LayoutError(f"{f} is not a safetensors file (header length {size})")
            try:
                header = json.loads(fh.read(size))
            except ValueError as e:
                raise LayoutError(f"{f}: its safetensors header is not JSON ({e})") from None
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = Tensor(name, meta["dtype"], tuple(meta["shape"]))
    return out


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    return TOP_ALIASES.get(name, name)


def expected_names(cfg: dict) -> set[str]:
    """The canonical tensor names of a DeepSeek-V4 model of config `cfg` (module docstring)."""
    names = {"embed_tokens.weight", "norm.weight", "head.weight", "hc_head.hc_fn", "hc_head.hc_base",
             "hc_head.hc_scale"}  # fmt: skip
    n = int(cfg["num_hidden_layers"])
    attn_types = cfg.get("layer_types") or []
    mlp_types = cfg.get("mlp_layer_types") or []
    if len(attn_types) != n or len(mlp_types) != n:
        raise LayoutError(
            f"config.json: layer_types and mlp_layer_types must list num_hidden_layers={n} layers"
        )
    compressor = ("wkv.weight", "wgate.weight", "ape", "norm.weight")
    for i in range(n):
        p = f"layers.{i}."
        names |= {p + x for x in ("attn_norm.weight", "ffn_norm.weight")}
        names |= {f"{p}hc_{s}_{x}" for s in ("attn", "ffn") for x in ("fn", "base", "scale")}
        attn = ("wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight", "norm.weight", "wo_a.weight",
                "wo_b.weight", "attn_sink")  # fmt: skip
        names |= {p + "attn." + x for x in attn}
        if attn_types[i] != "sliding_attention":
            names |= {p + "attn.compressor." + x for x in compressor}
        if attn_types[i] == "compressed_sparse_attention":
            names |= {p + "attn.indexer." + x for x in ("wq_b.weight", "weights_proj.weight")}
            names |= {p + "attn.indexer.compressor." + x for x in compressor}
        names |= {
            p + "ffn.gate.weight",
            p + ("ffn.gate.tid2eid" if mlp_types[i] == "hash_moe" else "ffn.gate.bias"),
        }
        names |= {
            f"{p}ffn.experts.{e}.w{k}.weight" for e in range(int(cfg["n_routed_experts"])) for k in (1, 2, 3)
        }
        names |= {f"{p}ffn.shared_experts.w{k}.weight" for k in (1, 2, 3)}
    return names


def _check_scales(tensors: dict[str, Tensor], block: int) -> int:
    """FP8 weights and their scales; LayoutError naming the first weight without a fitting scale."""
    fp8 = [t for t in tensors.values() if t.dtype.startswith("F8")]
    for t in fp8:
        stem = t.name.removesuffix(".weight")
        scale = next((tensors[stem + s] for s in SCALE_SUFFIXES if stem + s in tensors), None)
        if scale is None:
            raise LayoutError(
                f"FP8 weight {t.name} has no scale ({stem}.weight_scale_inv or {stem}.scale): the checkpoint "
                "must ship each FP8 weight's block scales"
            )
        want = tuple(math.ceil(d / block) for d in t.shape)
        if scale.shape != want:
            raise LayoutError(
                f"scale {scale.name} has shape {list(scale.shape)}, expected {list(want)} for {t.name} "
                f"{list(t.shape)} in {block}x{block} blocks"
            )
    return len(fp8)


def check(src: str | Path) -> Layout:
    """The layout of the DeepSeek-V4 checkpoint in directory `src`; LayoutError naming what differs."""
    src = Path(src)
    config = src / "config.json"
    if not config.is_file():
        raise LayoutError(f"{src} holds no config.json: pass the Hugging Face checkpoint directory")
    cfg = json.loads(config.read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch != ARCH or cfg.get("model_type") != "deepseek_v4":
        raise LayoutError(
            f"{src} is a {arch} checkpoint (model_type {cfg.get('model_type')!r}), not {ARCH} (deepseek_v4)"
        )
    tensors = read_headers(src)
    scales = {n for n in tensors if n.endswith(SCALE_SUFFIXES) and not n.endswith("hc_scale")}
    mtp = {n for n in tensors if n.removeprefix("model.").startswith("mtp.")}
    have = {_canonical(n) for n in tensors if n not in scales and n not in mtp}
    want = expected_names(cfg)
    if missing := sorted(want - have):
        raise LayoutError(f"{len(missing)} tensor(s) of a DeepSeek-V4 model are missing, e.g. {missing[:3]}")
    if extra := sorted(have - want):
        raise LayoutError(
            f"{len(extra)} tensor(s) are not of a DeepSeek-V4 model of this config, e.g. {extra[:3]}"
        )
    qcfg = cfg.get("quantization_config") or {}
    block = int((qcfg.get("weight_block_size") or [128])[0])
    fp8 = _check_scales(tensors, block)
    return Layout(int(cfg["num_hidden_layers"]), int(cfg["n_routed_experts"]), len(tensors), fp8, len(mtp))
