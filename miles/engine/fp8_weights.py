"""FP8 linear layers of the embedded engine (`engine.quantization: fp8_block | fp8_row`).

The weights the FP8 contract covers (miles.quant.fp8.is_quantized_name: a layer's q/k/v/o and dense
gate/up/down projections) are stored as the contract's pair, `X.weight` (float8_e4m3fn) and
`X.weight_scale_inv` (fp32; [ceil(out/128), ceil(in/128)] blocks or [out, 1] rows), and multiplied
with `fp8_linear`: on CUDA a real FP8 GEMM once a GEMM has at least `min_tokens` rows (prefill, large
batches). Below that (decode) a CUDA engine multiplies a model-dtype copy of the weight, dequantised
from the stored pair whenever the pair changes (load, update, onload): dequantising on every decode
step reads and writes the weight twice more and ran at 0.4x of bf16 on an H200 (bench/RESULTS.md).
The copy costs 2 bytes per covered parameter; `min_tokens: 1` runs every GEMM in FP8 and keeps none.
On CPU the weight is dequantised and multiplied in the model dtype.
Embeddings, lm_head, norms, biases, MoE routers and experts stay in the model dtype; an FP8 tensor
outside the contract (the experts of DeepSeek's FP8 checkpoints) is dequantised with its scale at load.

Where the bytes come from, the engine never re-quantises what it is sent:
- a bf16/fp32 checkpoint is quantised once at load with the contract's `quantize_weight`;
- an FP8 checkpoint in the SGLang/DeepSeek layout (config.json `quantization_config` with
  `quant_method: fp8`, `weight_block_size: [128, 128]` for blocks, absent for rows) loads as it is;
- a weight update carries either the pair (stored exactly as sent) or a plain `X.weight` in any float
  dtype (quantised on receipt with the contract: what a trainer that does not use it gets).

Fused storage (the CUDA forward's one GEMM for q/k/v and one for gate/up, miles/engine/model.py):
with fp8_row the members' rows stack and so do their row scales (a fused scale is the [q; k; v]
scales), which is exact. With fp8_block a group is fused only when every member's rows are a
multiple of 128, so each 128-row block of the fused weight belongs to one member and the stacked
block scales describe it exactly; otherwise the members stay separate tensors and the fused forward
runs one `fp8_linear` per member and concatenates the outputs (the scale rows would straddle two
members). An engine with `quantization: none` builds the plain Decoder and pays nothing for this.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from miles.engine.deepseek_v4 import V4Decoder
from miles.engine.model import Decoder, ModelSpec, load_weights
from miles.models.families.deepseek_v4 import hf_names
from miles.quant.formats import FORMATS, Format, Scheme, scheme_from_config
from miles.quant.fp8 import (
    BLOCK,
    FP8_DTYPE,
    LAYOUTS,
    dequantize_weight,
    fp8_linear,
    is_quantized_name,
    quantize_weight,
    scale_name,
    scale_shape,
)

QUANTIZATIONS = ("none", *LAYOUTS, *FORMATS)
DEFAULT_FP8_MIN_TOKENS = 1024
"""GEMM rows from which the FP8 GEMM runs. Measured on one H200 with plain PyTorch (the linears of
0.5-1.5B models): at <= 256 rows (decode) FP8 linears ran at 0.56-0.75x of bf16, activation
quantisation included; from 1k rows (prefill) row-wise FP8 gained 1.2-1.5x. 1024 is the smallest size
measured to gain; the break-even between 256 and 1024 is unmeasured. Whole-engine figures, where FP8
did not gain at 0.5B, are in bench/RESULTS.md."""
SCALE_SUFFIX = "_scale_inv"


def checkpoint_layout(model_dir: str | Path) -> str | None:
    """The quantisation of a checkpoint from its config.json `quantization_config`: its FP8 layout,
    a packed format's name (miles/quant/formats.py: int4, mxfp8, nvfp4), or None for a plain one (or
    a directory of tensors without config.json, as a disk weight update may be).

    ValueError, naming the key, for a quantisation this engine cannot load."""
    qc = _quantization_config(model_dir)
    if not qc:
        return None
    if qc.get("quant_method") != "fp8":
        return scheme_from_config(qc).name  # type: ignore[union-attr]
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{model_dir}: quantization_config.fmt {qc['fmt']!r} is not supported (only 'e4m3')")
    block = qc.get("weight_block_size")
    if block is None:
        return "fp8_row"
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(
            f"{model_dir}: quantization_config.weight_block_size is {block}; the engine's fp8_block layout "
            f"is [{BLOCK}, {BLOCK}] blocks"
        )
    return "fp8_block"


def _quantization_config(model_dir: str | Path) -> dict | None:
    from miles.engine.admission import require_regular

    path = Path(model_dir) / "config.json"
    if not (path.exists() or path.is_symlink()):
        return None
    return json.loads(require_regular(path, "config").read_text()).get("quantization_config")


def load_checkpoint(
    model_dir: str | Path, quantization: str, scheme: Scheme | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of an HF directory, after checking its quantisation against `engine.quantization`
    (and, for a packed checkpoint, the engine's Scheme: group size and covered modules)."""
    layout = checkpoint_layout(model_dir)
    if layout is not None and layout != quantization:
        raise ValueError(
            f"{model_dir} is a quantised checkpoint ({layout}: config.json quantization_config) but the engine "
            f"runs engine.quantization={quantization} (--quantization): set it to {layout}"
        )
    if layout in FORMATS and scheme is not None:
        have = scheme_from_config(_quantization_config(model_dir))
        if have != scheme:
            raise ValueError(
                f"{model_dir} holds {have.name} weights of group {have.fmt.block} over {have.modules} modules, "
                f"the engine serves group {scheme.fmt.block} over {scheme.modules} (--int4-group-size, "
                "--quant-modules): make them agree"
            )
    return load_weights(model_dir)


def build_decoder(
    spec: ModelSpec,
    model_dir: str | Path,
    device: str,
    dtype: torch.dtype,
    quantization: str,
    min_tokens: int,
    scheme: Scheme | None = None,
    int4_max_rows: int | None = None,
) -> Decoder:
    """The engine's decoder for `engine.quantization`: the plain Decoder for none, Fp8Decoder for an FP8
    layout, PackedDecoder for a packed format (whose Scheme `scheme` gives; default: every linear
    layer, int4 in groups of 128)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"engine.quantization {quantization!r} is unknown; known: {', '.join(QUANTIZATIONS)}"
        )
    if quantization in FORMATS:
        from miles.engine.packed_weights import DEFAULT_INT4_MAX_ROWS, PackedDecoder

        scheme = scheme or Scheme(Format(quantization))
        weights = load_checkpoint(model_dir, quantization, scheme)
        rows = DEFAULT_INT4_MAX_ROWS if int4_max_rows is None else max(int4_max_rows, 0)
        return PackedDecoder(spec, weights, device, dtype, scheme, rows)
    weights = load_checkpoint(model_dir, quantization)
    if quantization == "none":
        return plain_decoder(spec, weights, device, dtype)
    if spec.v4 is not None:
        return Fp8V4Decoder(spec, weights, device, dtype, quantization, min_tokens)
    return Fp8Decoder(spec, weights, device, dtype, quantization, min_tokens)


def plain_decoder(
    spec: ModelSpec, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype
) -> Decoder:
    """The unquantised decoder of the model's family: DeepSeek-V4's own, else the common one."""
    if spec.v4 is not None:
        return V4Decoder(spec, weights, device, dtype)
    return Decoder(spec, weights, device, dtype)


def quantization_of(decoder: Decoder) -> str:
    """The decoder's `engine.quantization`: its FP8 layout, packed format, or none."""
    if isinstance(decoder, Fp8Decoder):
        return decoder.layout
    scheme = getattr(decoder, "scheme", None)
    return "none" if scheme is None else scheme.name


def check_scale(name: str, q: torch.Tensor, scale: torch.Tensor, layout: str) -> None:
    """ValueError naming the tensor when `scale` is not the fp32 scale_inv of an FP8 weight `q`."""
    sname = scale_name(name)
    if scale.dtype != torch.float32:
        raise ValueError(f"{sname} must be float32, got {str(scale.dtype).removeprefix('torch.')}")
    if q.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out, in], got shape {list(q.shape)}")
    out, inp = q.shape
    want = list(scale_shape(out, inp, layout))  # type: ignore[arg-type]
    if list(scale.shape) != want:
        raise ValueError(
            f"{sname} of a {out}x{inp} {layout} weight must have shape {want}, got {list(scale.shape)}"
        )


class Fp8Decoder(Decoder):
    """A Decoder whose contract-covered weights are stored as FP8 + scale_inv (module docstring).

    `params` holds the stored tensors (the FP8 bytes and the scales under their HF names); `get`
    answers the dequantised value of an FP8 weight, as SGLang's /get_weights_by_name does."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        device: str,
        dtype: torch.dtype,
        layout: str,
        min_tokens: int,
    ):
        if layout not in LAYOUTS:
            raise ValueError(
                f"engine.quantization {layout!r} is not an FP8 layout; known: {', '.join(LAYOUTS)}"
            )
        self.layout = layout
        self.min_tokens = min_tokens
        """GEMMs with fewer rows dequantise the weight instead of running an FP8 GEMM (engine.fp8_min_tokens)."""
        self._shadow: dict[str, torch.Tensor] = {}
        """Stored FP8 name -> its dequantised model-dtype copy (CUDA, min_tokens > 1; module docstring)."""
        self._rows: dict[str, int] = {}
        self._split: dict[str, list[str]] = {}
        """Fused weight name -> its FP8 members kept as separate tensors (fp8_block, rows not x128)."""
        super().__init__(spec, weights, device, dtype)

    def expected_names(self) -> list[str]:
        names = super().expected_names()
        return names + [scale_name(n) for n in names if is_quantized_name(n)]

    def _fused_groups(self) -> dict[str, list[str]]:
        groups = super()._fused_groups()
        for fused, members in list(groups.items()):
            if not all(is_quantized_name(m) for m in members):
                continue
            if self.layout == "fp8_block" and any(self._rows[m] % BLOCK for m in members):
                del groups[fused]
                self._split[fused] = members
            else:
                groups[scale_name(fused)] = [scale_name(m) for m in members]
        return groups

    def _allocate(self, weights: dict[str, torch.Tensor]) -> None:
        self._rows = {n: t.shape[0] for n, t in weights.items() if t.dim() > 0}
        self._split = {}
        dtypes: dict[str, torch.dtype] = {}
        for n in super().expected_names():
            if is_quantized_name(n):
                dtypes[n], dtypes[scale_name(n)] = FP8_DTYPE, torch.float32
        for fused, members in self._fused_groups().items():
            if members[0] in dtypes:
                dtypes[fused] = dtypes[members[0]]
        self._dtypes = dtypes
        self._split = {}  # filled again by the base class's own call of _fused_groups
        super()._allocate(weights)

    def load(self, weights: dict[str, torch.Tensor], strict: bool = False) -> None:
        """As Decoder.load, covered names taken as the FP8 pair or quantised on receipt (module docstring)."""
        prepared = self.prepare(weights)
        super().load(prepared, strict)
        self._refresh_shadow(self.fp8_storage_of(prepared))

    def offload(self) -> None:
        self._shadow = {}
        super().offload()

    def onload(self) -> None:
        super().onload()
        self._refresh_shadow()

    def fp8_storage_of(self, names: Iterable[str]) -> set[str]:
        """The stored FP8 tensors (storage keys: fused or plain weight names) that hold the HF tensors
        `names` (weights or their scales)."""
        home = {m: fused for fused, members in self._fused.items() for m, _ in members}
        keys = {home.get(n, n).removesuffix(SCALE_SUFFIX) for n in names}
        return {k for k in keys if k in self.storage and self.storage[k].dtype == FP8_DTYPE}

    def _refresh_shadow(self, keys: Iterable[str] | None = None) -> None:
        """Dequantise the stored FP8 weights `keys` (None: all) into their model-dtype copies, in place
        where one exists (the CUDA graphs captured over the copies stay valid). Nothing on CPU, off the
        device, or when every GEMM runs in FP8 (min_tokens 1)."""
        if self.device.type != "cuda" or not self.resident or self.min_tokens <= 1:
            self._shadow = {}
            return
        for name in self.fp8_storage_of(self.storage) if keys is None else keys:
            w = dequantize_weight(self.storage[name], self.storage[scale_name(name)], self.layout, self.dtype)
            if name in self._shadow:
                self._shadow[name].copy_(w)
            else:
                self._shadow[name] = w

    def prepare(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` with every covered `X.weight` as the contract's pair: an FP8 weight and its scale
        as they came (checked), a float weight quantised here. ValueError naming a bad or lone tensor."""
        out: dict[str, torch.Tensor] = {}
        for name, t in weights.items():
            base = name.removesuffix(SCALE_SUFFIX)
            if base != name and (is_quantized_name(base) or base in weights):
                if base not in weights:
                    raise ValueError(f"{name} came without {base}: send an FP8 weight and its scale together")
                continue  # taken with its weight
            if not is_quantized_name(name):
                out[name] = self._outside_contract(name, t, weights)
                continue
            sname = scale_name(name)
            if t.dtype == FP8_DTYPE:
                if sname not in weights:
                    raise ValueError(f"{name} is float8_e4m3fn but {sname} was not sent with it")
                check_scale(name, t, weights[sname], self.layout)
                out[name], out[sname] = t, weights[sname]
            elif t.is_floating_point():
                if sname in weights:
                    raise ValueError(
                        f"{sname} came with a {str(t.dtype).removeprefix('torch.')} {name}: a scale goes "
                        "with a float8_e4m3fn weight only (or send the plain weight alone to have it quantised)"
                    )
                if t.dim() != 2:
                    raise ValueError(f"{name} must be 2-D [out, in], got shape {list(t.shape)}")
                home = self.device if self.resident else torch.device("cpu")
                out[name], out[sname] = quantize_weight(t.to(home), self.layout)
            else:
                raise ValueError(f"{name}: {t.dtype} is neither float8_e4m3fn nor a float dtype")
        return out

    def _outside_contract(self, name: str, t: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """A tensor the contract does not cover, in the model dtype: an FP8 one (DeepSeek's checkpoints
        ship their experts in FP8 too) dequantised with the scale sent beside it."""
        if t.dtype != FP8_DTYPE:
            return t
        sname = scale_name(name)
        if sname not in weights:
            raise ValueError(f"{name} is float8_e4m3fn but {sname} was not sent with it")
        check_scale(name, t, weights[sname], self.layout)
        return dequantize_weight(t, weights[sname], self.layout, self.dtype)

    def _stored(self, name: str) -> torch.Tensor:
        return self.storage[name] if name in self._fused else self.params[name]

    def widen(self, key: str, rows: int) -> None:
        """None: this engine's GEMMs are not over the stored tensors alone, so the LoRA bank keeps its A apart."""
        return None

    def _linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        members = self._split.get(name)
        if members is not None:  # an unfused FP8 group: one GEMM per member, outputs side by side
            biases = [
                None if bias is None else self.params[m.removesuffix("weight") + "bias"] for m in members
            ]
            return torch.cat([self._linear(x, m, b) for m, b in zip(members, biases, strict=True)], dim=-1)
        w = self._stored(name)
        if w.dtype != FP8_DTYPE:
            return F.linear(x, w, bias)
        scale = self._stored(scale_name(name))
        shadow = self._shadow.get(name)
        if shadow is not None and x.numel() // x.shape[-1] < self.min_tokens:
            return F.linear(x, shadow, bias)
        if x.is_cuda:
            return fp8_linear(x, w, scale, self.layout, bias, min_tokens=self.min_tokens)
        # CPU: the dequantised values (what the trainer's fake-quant forward multiplies), never the
        # CPU reference FP8 kernel, which is slower than the model-dtype GEMM
        return F.linear(x, dequantize_weight(w, scale, self.layout, x.dtype), bias)

    def get(self, name: str) -> torch.Tensor:
        t = super().get(name)
        if t.dtype == FP8_DTYPE:
            return dequantize_weight(t, self.params[scale_name(name)], self.layout, self.dtype)
        return t


class Fp8V4Decoder(Fp8Decoder, V4Decoder):
    """DeepSeek-V4 (miles/engine/deepseek_v4.py) with the contract's projections stored as FP8 pairs:
    checkpoint names are renamed before the contract reads them."""

    def load(self, weights: dict[str, torch.Tensor], strict: bool = False) -> None:
        super().load(hf_names(weights), strict)
