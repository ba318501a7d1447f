"""Packed low-precision weights in the embedded engine (`engine.quantization: int4 | mxfp8 | nvfp4`).

The weights a run's Scheme covers (miles/quant/formats.py: MoE experts, or every linear layer) are
stored as the format's parts exactly as they arrive — `X.weight_packed` / `X.weight_scale` /
`X.weight_shape` for int4 (compressed-tensors' pack-quantized W4A16), the E4M3 or E2M1 elements and
their block scales for mxfp8 / nvfp4 — and the engine never re-quantises what it is sent:
- a bf16/fp32 checkpoint or weight update is quantised once on receipt with the format's `encode`
  (what a trainer that does not follow the contract gets);
- a packed checkpoint (config.json `quantization_config`: compressed-tensors pack-quantized, or
  Miles' own for mxfp8 / nvfp4) or a packed update is stored as it is (dtypes checked).
`params` holds those parts by name, so /weights_checker's checksums are the bytes the trainer sent.

How the forward multiplies them:
- every covered weight has a model-dtype copy dequantised from the stored parts whenever they change
  (load, update, onload; in place, so captured CUDA graphs stay valid), which the forward multiplies:
  on the CPU it holds exactly the trainer's fake-quant weights. It costs 2 bytes a covered parameter
  beside the packed ones (as the FP8 engine's decode copy). MoE experts (no grouped int4 kernel
  here) and mxfp8 / nvfp4 (emulated: no GPU but Blackwell computes in them) always compute this way.
- int4, dense linear layers on CUDA, GEMMs of at most `int4_max_rows` rows (small-batch decode): a
  real W4A16 GEMM, PyTorch's `_weight_int4pack_mm` (tinygemm), over the same 4-bit codes and bf16
  scales repacked into its tile layout. On one H200 it ran at 1.6-1.9x of bf16 for one row of the 7B
  projections and 0.34x at 32 rows (bench/RESULTS.md), hence the small default; 0 turns it off.
Fused q/k/v and gate/up are one GEMM each (the formats quantise rows independently, so rows stack
exactly; nvfp4's per-tensor scales stay with each member's rows).
Embeddings, the LM head, norms, biases and MoE routers stay in the model dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from miles.engine import moe
from miles.engine.model import Decoder, ModelSpec
from miles.quant.formats import Scheme

DEFAULT_INT4_MAX_ROWS = 4
"""int4 on CUDA: GEMMs of at most this many rows run tinygemm, larger ones multiply the bf16 copy
(tinygemm is a small-batch kernel; the crossover on one H200 is in bench/RESULTS.md)."""


class PackedDecoder(Decoder):
    """A Decoder whose covered weights are stored in a packed format (module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        device: str,
        dtype: torch.dtype,
        scheme: Scheme,
        int4_max_rows: int = DEFAULT_INT4_MAX_ROWS,
    ):
        self.scheme = scheme
        self.int4_max_rows = int4_max_rows
        self._compute: dict[str, torch.Tensor] = {}
        """Compute key (a covered HF name, a fused q/k/v or gate/up name, or an expert stack) -> its
        dequantised model-dtype weight."""
        self._int4: dict[str, torch.Tensor] = {}
        """int4 GEMM compute key -> its tinygemm tile layout."""
        self._scales: dict[str, torch.Tensor] = {}
        """int4 GEMM compute key -> tinygemm's [in/g, out, 2] scales-and-zeros."""
        self._members: dict[str, list[str]] = {}
        """Compute key -> the covered HF weights whose rows it stacks (one for an unfused weight)."""
        super().__init__(spec, weights, device, dtype)
        if not self._members:
            raise ValueError(
                f"engine.quantization={scheme.name} with quant_modules={scheme.modules} covers no weight of "
                f"this {spec.arch} model; set engine.quant_modules=linear (a dense model has no experts)"
            )

    # ---- names and storage -------------------------------------------------------------------------

    def _covered(self) -> list[str]:
        return [n for n in super().expected_names() if self.scheme.covers(n)]

    def expected_names(self) -> list[str]:
        out: list[str] = []
        for n in super().expected_names():
            out += self.scheme.part_names(n) if self.scheme.covers(n) else [n]
        return out

    def _fused_groups(self) -> dict[str, list[str]]:
        groups = super()._fused_groups()
        members: dict[str, list[str]] = {}
        for fused, names in list(groups.items()):
            if any(self.scheme.covers(n) for n in names):  # covered members are stored unfused
                del groups[fused]
                if ".experts." in fused:  # expert stacks are always multiplied stacked
                    members[fused] = names
        for i in range(self.spec.num_layers if self.fused else 0):  # the fused (CUDA) forward's GEMMs
            p = f"model.layers.{i}."
            for sub, fused, parts in (("self_attn", "qkv", "qkv"), ("mlp", "gate_up", ("gate", "up"))):
                names = [f"{p}{sub}.{x}_proj.weight" for x in parts]
                if all(self.scheme.covers(n) for n in names):
                    members[f"{p}{sub}.{fused}_proj.weight"] = names
        grouped = {n for names in members.values() for n in names}
        members.update({n: [n] for n in self._covered() if n not in grouped})
        self._members = members
        return groups

    def _allocate(self, weights: dict[str, torch.Tensor]) -> None:
        part_dtypes = self.scheme.fmt.part_dtypes(self.dtype)
        self._dtypes = {
            f"{n.removesuffix('.weight')}.{suffix}": dt
            for n in self._covered()
            for suffix, dt in part_dtypes.items()
        }
        super()._allocate(weights)

    # ---- receiving weights -------------------------------------------------------------------------

    def prepare(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` with every covered `X.weight` as the format's parts: parts as they came (checked),
        a float weight encoded here. ValueError naming a bad or incomplete weight."""
        if self.spec.moe is not None:
            weights = moe.per_expert(weights, self.spec.moe)
        fmt, home = self.scheme.fmt, (self.device if self.resident else torch.device("cpu"))
        out: dict[str, torch.Tensor] = {}
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in weights.items():
            base = self.scheme.base_of(name)
            if base is not None:  # a part (for mxfp8 / nvfp4 `X.weight` itself may be one)
                parts.setdefault(base, {})[name[len(base) - len("weight") :]] = t
            elif self.scheme.covers(name):
                out.update(self._encode(name, t, home))
            else:
                out[name] = t
        for base, got in parts.items():
            if set(got) == {"weight"} and self._plain(got["weight"]):
                out.update(self._encode(base, got["weight"], home))
                continue
            fmt.check_parts(base.removesuffix(".weight"), got, self.dtype)
            out.update({f"{base.removesuffix('weight')}{suffix}": t for suffix, t in got.items()})
        return out

    def _encode(self, name: str, t: torch.Tensor, home: torch.device) -> dict[str, torch.Tensor]:
        if not self._plain(t) or t.dim() != 2:
            raise ValueError(
                f"{name}: send a covered weight as a 2-D float tensor (encoded here) or as its "
                f"{self.scheme.name} parts ({', '.join(self.scheme.part_names(name))}); got {t.dtype} {list(t.shape)}"
            )
        return dict(self.scheme.encode(name, t.to(home, self.dtype)))

    def _plain(self, t: torch.Tensor) -> bool:
        """Whether a tensor sent under a covered `X.weight` is an unquantised weight to encode here
        (mxfp8 stores float8 elements and nvfp4 uint8 codes under the same name)."""
        return t.dtype in (torch.float32, torch.float16, torch.bfloat16)

    def load(self, weights: dict[str, torch.Tensor], strict: bool = False) -> None:
        prepared = self.prepare(weights)
        super().load(prepared, strict)
        changed = {self.scheme.base_of(n) for n in prepared} - {None}
        self._refresh([k for k, names in self._members.items() if changed.intersection(names)])

    def offload(self) -> None:
        self._compute, self._int4, self._scales = {}, {}, {}
        super().offload()

    def onload(self) -> None:
        super().onload()
        self._refresh()

    # ---- compute copies ----------------------------------------------------------------------------

    def _parts(self, name: str) -> dict[str, torch.Tensor]:
        stem = name.removesuffix(".weight")
        return {s: self.params[f"{stem}.{s}"] for s in self.scheme.fmt.suffixes}

    def _uses_int4_gemm(self, key: str) -> bool:
        return (
            self.scheme.name == "int4"
            and self.int4_max_rows > 0
            and self.device.type == "cuda"
            and self.dtype == torch.bfloat16
            and ".experts." not in key
            and int4_gemm_shapes_ok(
                self.params[self.scheme.part_names(self._members[key][0])[0]], self.scheme.fmt.group_size
            )
        )

    def _refresh(self, keys: Iterable[str] | None = None) -> None:
        """Rebuild the compute tensors of `keys` (None: all) from the stored parts, in place where one
        exists (captured CUDA graphs keep reading the same memory). Nothing while offloaded."""
        if not self.resident:
            return
        for key in self._members if keys is None else keys:
            names = self._members[key]
            w = torch.cat([self.scheme.fmt.decode(self._parts(n), self.dtype) for n in names])
            self._assign(self._compute, key, w)
            if self._uses_int4_gemm(key):
                stems = [self._parts(n) for n in names]
                packed = torch.cat([p["weight_packed"] for p in stems])
                scale = torch.cat([p["weight_scale"] for p in stems])
                tiles, sz = int4_gemm_pack(packed, scale, self.scheme.fmt.group_size)
                self._assign(self._int4, key, tiles)
                self._assign(self._scales, key, sz)

    @staticmethod
    def _assign(table: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
        old = table.get(key)
        if old is not None and old.shape == value.shape and old.dtype == value.dtype:
            old.copy_(value)
        else:
            table[key] = value

    # ---- forward -----------------------------------------------------------------------------------

    def _has_fused(self, name: str) -> bool:
        return name in self._compute or super()._has_fused(name)

    def _stacked(self, name: str) -> torch.Tensor:
        w = self._compute.get(name)
        return super()._stacked(name) if w is None else w

    def widen(self, key: str, rows: int) -> None:
        """None: this engine's GEMMs are not over the stored tensors alone, so the LoRA bank keeps its A apart."""
        return None

    def _linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = self._compute.get(name)
        if w is None:
            return super()._linear(x, name, bias)
        tiles = self._int4.get(name)
        rows = x.numel() // x.shape[-1]
        if tiles is None or rows > self.int4_max_rows:
            return F.linear(x, w, bias)
        sz = self._scales[name]
        y = torch.ops.aten._weight_int4pack_mm(
            x.reshape(rows, x.shape[-1]), tiles, self.scheme.fmt.group_size, sz
        )
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    def get(self, name: str) -> torch.Tensor:
        if self.scheme.covers(name):  # the value it stands for (mxfp8 / nvfp4 store elements under the name)
            return self.scheme.fmt.decode(self._parts(name), self.dtype)
        return super().get(name)


# ---- tinygemm's int4 layout --------------------------------------------------------------------------


def _inner_k_tiles(k: int) -> int | None:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    return None


def int4_gemm_shapes_ok(packed: torch.Tensor, group_size: int) -> bool:
    """Whether tinygemm takes a weight: out a multiple of 8, in a multiple of 32 (in = 8 x words)."""
    out, k = packed.shape[0], packed.shape[1] * 8
    return out % 8 == 0 and _inner_k_tiles(k) is not None and k % group_size == 0


def int4_gemm_pack(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tinygemm weight, scales-and-zeros) from the contract's words [out, in/8] and scales [out, in/g].

    tinygemm reads unsigned codes u and computes (u - 8) * scale + zero: the contract's codes are
    stored as q + 8 already, so zero = 0 and the scales are the contract's (bf16). Its byte layout
    holds the first of two values in the high nibble, the contract's words the low one: swapped here."""
    data = packed.contiguous().view(torch.uint8)  # [out, in / 2], value 2b in the low nibble
    swapped = ((data & 0xF) << 4) | (data >> 4)
    k = packed.shape[1] * 8
    w = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), _inner_k_tiles(k))
    s = scale.to(torch.bfloat16)
    sz = torch.stack((s, torch.zeros_like(s)), dim=-1).transpose(0, 1).contiguous()  # [in/g, out, 2]
    return w, sz
