"""What a decoder is and what one forward takes: `ModelSpec` (the shape, from an HF config.json),
`Batch` (packed new tokens and where each request's keys live in the KV pool) and `load_weights`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from miles.engine import moe
from miles.engine.mla import MlaSpec
from miles.engine.v4_spec import V4Spec
from miles.models.families import Family, get_family


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder, read from an HF config.json."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    moe: moe.MoeSpec | None = None
    """The mixture-of-experts shape (Qwen3-MoE, DeepSeek-V3), None for dense models."""
    mla: MlaSpec | None = None
    """The latent attention's shape (DeepSeek-V3: miles/engine/mla.py), None for grouped-query attention.
    With it, `num_kv_heads` is 1 (one latent per token) and `head_dim` the RoPE part's."""
    rope_scaling: dict | None = None
    """The rope's YaRN parameters (DeepSeek-V3: `rope_type: yarn`, miles/engine/rope.py), None for default."""
    mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint holds after its decoder layers
    (`num_nextn_predict_layers`, named model.layers.N.* from N = num_layers; DeepSeek-V3, or a tiny
    model's head from `miles model init-tiny --mtp`): the decoder drops them at load, as transformers
    does; `--speculative-algorithm NEXTN` drafts with the first (miles/engine/mtp.py)."""
    v4: V4Spec | None = None
    """DeepSeek-V4's hybrid attention and hyper-connections (miles/engine/deepseek_v4.py), else None."""

    @property
    def family(self) -> Family:
        """The model family (miles/models/families/): what the decoder's layers hold."""
        return get_family(self.arch)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        arch = (cfg.get("architectures") or ["?"])[0]
        family = get_family(arch)
        family.refuse_unless("engine")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        v4 = V4Spec.from_config(cfg) if family.attention == "deepseek_v4" else None  # its ropes: its own
        kind = rope.get("rope_type", rope.get("type", "default"))
        served = ("default", None, "yarn") if family.attention == "mla" else ("default", None)  # V3: YaRN too
        if v4 is None and kind not in served:
            raise ValueError(f"rope type {kind!r} is not supported (default RoPE, and YaRN for DeepSeek-V3)")
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        mla = MlaSpec.from_config(cfg) if family.attention == "mla" else None
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=1 if mla or v4 else cfg.get("num_key_value_heads") or heads,
            head_dim=mla.qk_rope_head_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            moe=moe.MoeSpec.from_config(cfg, cfg["num_hidden_layers"]) if family.moe else None,
            mla=mla,
            rope_scaling=dict(rope) if kind == "yarn" and v4 is None else None,
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0) if v4 is None else 0,
            v4=v4,
        )


@dataclass
class Batch:
    """One forward's inputs: packed new tokens plus where each request's keys live in the pool."""

    input_ids: torch.Tensor  # [T] new tokens of all requests, packed
    positions: torch.Tensor  # [T] absolute positions of those tokens
    write_slots: torch.Tensor  # [T] pool slots the new tokens' K/V go to
    query_index: torch.Tensor  # [B, Qmax] index into the packed tokens (padding points at 0)
    query_pos: torch.Tensor  # [B, Qmax] positions of the queries (padding: -1, sees nothing but key 0)
    context_slots: torch.Tensor  # [B, Lmax] pool slots of each request's context (padding: slot 0)
    last_index: torch.Tensor  # [B] index of each request's last new token in the packed tokens
    kv_rows: torch.Tensor | None = None  # CPU decode: [B] ascending RowKV row of each request, else None
    lora_slots: torch.Tensor | None = None  # [T] LoRA slot of each new token (-1: base); None: all base
    input_embeds: torch.Tensor | None = None  # [T, hidden] in place of the tokens' embeddings (MTP draft)

    @classmethod
    def decode(
        cls,
        input_ids,
        positions,
        rows,
        table: torch.Tensor,
        context_len: int,
        lora_rows: torch.Tensor | None = None,
    ) -> Batch:
        """One new token per request; `table[row, p]` is the slot of a request's token at position p;
        `lora_rows[row]` the LoRA slot of its adapter (miles/engine/lora.py).

        Built on the device from tensors alone (no host values), so it can run inside a CUDA graph.
        """
        index = torch.arange(input_ids.shape[0], device=input_ids.device)
        return cls(
            input_ids=input_ids,
            positions=positions,
            write_slots=table[rows, positions],
            query_index=index[:, None],
            query_pos=positions[:, None],
            context_slots=table[rows, :context_len],
            last_index=index,
            lora_slots=None if lora_rows is None else lora_rows[rows],
        )


def load_weights(model_dir: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of the HF safetensors files in a directory, by HF name (only those whose name starts
    with `prefix`, the others left unread)."""
    from miles.engine.admission import require_regular

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for f in files:  # before any is opened: a FIFO would block the reader with the GIL held
        require_regular(f, "weights file")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        if not prefix:
            weights.update(load_file(str(f)))
            continue
        with safe_open(str(f), framework="pt") as st:
            weights.update({n: st.get_tensor(n) for n in st.keys() if n.startswith(prefix)})
    return weights


def token_slots(b: Batch) -> torch.Tensor:
    """The LoRA slot of each new token of `b` (-1, the base model, when the batch names none)."""
    if b.lora_slots is not None:
        return b.lora_slots
    return torch.full_like(b.input_ids, -1)
