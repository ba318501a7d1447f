"""LoRA adapters in the embedded engine, served unmerged as SGLang serves them.

An adapter (PEFT format: `adapter_config.json` with `r`, `lora_alpha`, `target_modules`, and tensors
`base_model.model.<module>.lora_A.weight` [r, in], module a layer's q/k/v/o or gate/up/down
projection or the LM head / `lora_B.weight` [out, r]) adds to each target
linear layer y = W x the low-rank term s * B (A x), s = lora_alpha / r. Up to `max_loras` adapters
live in slots of one bank; a forward multiplies every slot at once:

    h = x @ A_all^T                  A_all [S * R, in]: slot k's A in rows k R .. k R + r_k (zero beyond)
    h = h * M                        M [T, S * R]: s_k on the columns of token t's slot k, 0 elsewhere
    y = y + h @ B_all^T              B_all [out, S * R]: slot k's B in the same columns

so a batch mixing adapters (and the base model: no slot, M = 0) runs two GEMMs a layer, without
gathers or host synchronisation (a CUDA graph captures it), and each token gets exactly its own
adapter's term: the other slots' columns contribute exact zeros. A layer's q/k/v (and gate/up) share
one A GEMM and one B GEMM over a block-diagonal B. On CUDA, where the shapes allow, a group's A lives in
rows stacked under the layer's own weight (`Decoder.widen`), so the layer's GEMM yields x W^T and
x A^T in one launch, and one Triton kernel (miles/engine/triton_lora.py) masks, multiplies by B and
adds: the adapters cost one kernel a layer group over the base model. R is the bank's `max_rank`; an
adapter of lower rank pads with zeros. A token's slot comes from its request (`lora_path`), per
scheduler row (`rows`, a device tensor the decode graph reads in place) or per prefill token.

Loading an adapter under a name already loaded replaces its tensors in place in its slot ("upsert",
what a trainer pushing a new adapter version each step needs: SGLang would refuse the name, and
unloading first waits for the requests in flight). Unloading frees the slot; an adapter still used
by running requests is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from miles.engine.admission import check_adapter_numbers, check_finite
from miles.engine.lora_terms import LoraTerms, kernel_blocks

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+_proj)|lm_head)"
    r"\.lora_([AB])(?:\.default)?\.weight$"
)


STACK_ALIGN = 64
"""Rows of the block stacked under a weight for its A are a multiple of this (zeros beyond A)."""


class LoraError(ValueError):
    """A request or adapter the bank refuses; the message names what to change (an HTTP 400)."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_peft(cls, cfg: dict) -> AdapterConfig:
        """From a PEFT adapter_config.json (LoRA, no rsLoRA / DoRA)."""
        if cfg.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"adapter peft_type {cfg.get('peft_type')!r}: only LORA adapters are served")
        if cfg.get("use_dora") or cfg.get("use_rslora"):
            raise LoraError("DoRA and rsLoRA adapters are not served (use_dora / use_rslora must be false)")
        targets = cfg.get("target_modules") or []
        if isinstance(targets, str):
            # PEFT's all-linear leaves the output layer out
            targets = [t for t in TARGETS if t != "lm_head"] if targets == "all-linear" else [targets]
        bad = [t for t in targets if t not in TARGETS]
        if bad:
            raise LoraError(f"adapter target_modules {bad} are not served; targets: {', '.join(TARGETS)}")
        try:
            check_adapter_numbers(cfg)
        except ValueError as e:
            raise LoraError(str(e)) from None
        return cls(int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"])), tuple(targets))


def read_adapter(path: str | Path) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise LoraError(
            f"{path} is not a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)"
        )
    return AdapterConfig.from_peft(json.loads(cfg_file.read_text())), load_file(str(weights))


class LoraBank:
    """Adapter slots of one decoder (module docstring), split by job: the bank stores the adapters
    (slots, A and B, loads and unloads); `requests` binds running requests to slots; `terms`
    (miles/engine/lora_terms.py) computes the adapters' terms in the forward."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, int]],
        max_loras: int,
        max_rank: int,
        targets: tuple[str, ...],
        device: torch.device,
        dtype: torch.dtype,
        max_rows: int,
        home: Callable[[str, int], torch.Tensor | None] | None = None,
        kernels: bool | None = None,
    ):
        """`shapes`: HF module name (model.layers.N.self_attn.q_proj, ...) -> (out, in) of every linear
        layer an adapter may target; `max_rows`: scheduler rows (the per-row slot table's size);
        `home(key, rows)`: zero rows stacked under the weight of layer or group `key` to keep its A in
        (`Decoder.widen`), or None where it cannot; `kernels`: whether the Triton kernels compute the
        terms (None: on CUDA; tests run them on the CPU under Triton's interpreter)."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError("--max-loras-per-batch and --max-lora-rank must be >= 1")
        self.max_loras, self.max_rank, self.targets = max_loras, max_rank, targets
        self.device, self.dtype = device, dtype
        self.shapes = dict(shapes)
        self.modules = {m: s for m, s in shapes.items() if m.rsplit(".", 1)[-1] in targets}
        self.width = max_loras * max_rank
        """Columns of every slot's rank side by side (S R): the width of each member's block of A and B."""
        members_of = {f"{h}.{leaf}": ms for h, leaf, ms in _fused_members(self.modules)}
        run_kernels = device.type == "cuda" if kernels is None else kernels
        every = members_of | {m: [m] for m in self.modules}
        blocks = kernel_blocks(self.modules, every, max_rank, max_loras, device) if run_kernels else {}
        self._allocate(members_of, {k for k in blocks} if home is not None else set(), home)
        self.scale = torch.zeros(max_loras, device=device, dtype=torch.float32)
        self.slots: dict[str, int] = {}
        self.configs: dict[str, AdapterConfig] = {}
        self.sources: dict[str, str] = {}
        self.requests = LoraRequests(self, max_rows)
        self.terms = LoraTerms(self, blocks)

    def _allocate(
        self,
        members_of: dict[str, list[str]],
        stackable: set[str],
        home: Callable[[str, int], torch.Tensor | None] | None,
    ) -> None:
        """A and B of every targeted module: a group's (`members_of`: fused name -> members) in one A and
        one block-diagonal B; an A stacked under the layer's weight (`home`) where `stackable`."""
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        self.groups: dict[str, tuple[torch.Tensor, torch.Tensor, list[str]]] = {}
        """Fused name (a layer's qkv_proj / gate_up_proj) -> (A [n W, in], block-diagonal B [sum out, n W],
        the n members) over its targeted members, whose A / B above are views into them: the fused
        forward runs one pair of GEMMs for the group."""
        self.stacked: set[str] = set()
        """Groups and modules whose A is stacked under the layer's weight (`terms.split` finishes their GEMM)."""
        self._a: dict[str, torch.Tensor] = {}
        """Group or lone module -> its A, which `_views` splits into `A` and `groups`."""
        grouped = {m for ms in members_of.values() for m in ms}
        units = members_of | {m: [m] for m in self.modules if m not in grouped}  # each with its own A and B
        for key, members in units.items():
            outs = [self.modules[m][0] for m in members]
            rows, width_in = len(members) * self.width, self.modules[members[0]][1]
            a = home(key, rows) if home is not None and key in stackable else None
            if a is None:
                a = torch.zeros(rows, width_in, device=self.device, dtype=self.dtype)
            else:
                self.stacked.add(key)
            self._a[key] = a
            b = torch.zeros(sum(outs), rows, device=self.device, dtype=self.dtype)
            for k, m in enumerate(members):
                r0 = sum(outs[:k])
                self.B[m] = b[r0 : r0 + outs[k], k * self.width : (k + 1) * self.width]
            if key in members_of:
                self.groups[key] = (a, b, members)
        self._views()

    @classmethod
    def for_decoder(
        cls,
        decoder,
        max_loras: int,
        max_rank: int,
        targets: tuple[str, ...],
        max_rows: int,
        stack: int | None = STACK_ALIGN,
        kernels: bool | None = None,
    ) -> LoraBank:
        """The bank of `decoder` (miles/engine/model.py) over every projection an adapter may target
        (a sparse MoE layer's experts take none), its A stacked under the decoder's weights in a block
        of rows padded to a multiple of `stack` (cuBLAS runs the wider GEMM at its best with aligned
        widths); None keeps A in tensors of its own, a GEMM apart (the benchmark's anchor)."""
        spec = decoder.spec
        shapes = {"lm_head": (spec.vocab_size, spec.hidden_size)}
        for i in range(spec.num_layers):
            sparse = spec.moe is not None and i in spec.moe.sparse_layers
            for sub, names in (("self_attn", "qkvo"), ("mlp", () if sparse else ("gate", "up", "down"))):
                for x in names:
                    module = f"model.layers.{i}.{sub}.{x}_proj"
                    shapes[module] = tuple(decoder.get(module + ".weight").shape)

        def home(key: str, rows: int) -> torch.Tensor | None:
            block = decoder.widen(key + ".weight", -(-rows // stack) * stack)
            return None if block is None else block[:rows]

        return cls(
            shapes, max_loras, max_rank, targets, decoder.device, decoder.dtype, max_rows,
            home=home if stack else None, kernels=kernels,
        )  # fmt: skip

    def _views(self) -> None:
        """`A` of every module (a group member's: rows of its group's A) and `groups`, from `_a`."""
        width = self.width
        for key, a in self._a.items():
            if key in self.groups:
                _, b, members = self.groups[key]
                self.groups[key] = (a, b, members)
                for k, m in enumerate(members):
                    self.A[m] = a[k * width : (k + 1) * width]
            else:
                self.A[key] = a

    def rehome(self, rows_of: Callable[[str], torch.Tensor]) -> None:
        """Point the stacked A at the first rows of `rows_of(key)`, the block under the decoder's weight
        where its tensors moved (to the host and back with an offload: the values moved with them)."""
        for key in self.stacked:
            self._a[key] = rows_of(key)[: self._a[key].shape[0]]
        self._views()

    # ---- adapters ----------------------------------------------------------------------------------

    def load(self, name: str, config: AdapterConfig, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Store an adapter under `name`, replacing in place one already there (module docstring)."""
        if config.rank > self.max_rank:
            raise LoraError(
                f"adapter {name!r} has rank {config.rank}, above the server's --max-lora-rank {self.max_rank}"
            )
        outside = [t for t in config.targets if t not in self.targets]
        if outside:
            raise LoraError(
                f"adapter {name!r} targets {outside}, which the server was not started for "
                f"(--lora-target-modules {' '.join(self.targets)})"
            )
        try:
            check_finite(tensors, f"adapter {name!r}")
        except ValueError as e:
            raise LoraError(str(e)) from None
        pairs = self._pairs(name, tensors, config)
        slot = self.slots.get(name)
        if slot is None:
            free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
            if not free:
                raise LoraError(
                    f"all {self.max_loras} adapter slots are taken ({', '.join(self.slots)}): unload one "
                    "or start the server with a larger --max-loras-per-batch"
                )
            slot = free[0]
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for module in self.modules:  # the adapter's tensors; zeros where it has none or a lower rank
            a, b = pairs.get(module, (None, None))
            r = 0 if a is None else a.shape[0]
            if r:
                self.A[module][cols][:r].copy_(a)
                self.B[module][:, cols][:, :r].copy_(b)
            if r < self.max_rank:
                self.A[module][cols][r:].zero_()
                self.B[module][:, cols][:, r:].zero_()
        self.scale[slot] = config.scaling
        self.slots[name], self.configs[name], self.sources[name] = slot, config, source

    def _pairs(self, name: str, tensors: dict[str, torch.Tensor], config: AdapterConfig) -> dict:
        found: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = _TENSOR.match(key)
            if m is None:
                raise LoraError(
                    f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a served layer"
                )
            module, kind = m.group(1), m.group(3)
            if module not in self.modules:
                raise LoraError(f"adapter {name!r}: {module} is not a layer the server's adapters may target")
            found.setdefault(module, {})[kind] = t
        pairs = {}
        for module, ab in found.items():
            if set(ab) != {"A", "B"}:
                raise LoraError(
                    f"adapter {name!r}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing"
                )
            out, inp = self.modules[module]
            a, b = ab["A"], ab["B"]
            if a.shape != (config.rank, inp) or b.shape != (out, config.rank):
                raise LoraError(
                    f"adapter {name!r}: {module} lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
                    f"rank {config.rank} on a {out}x{inp} layer"
                )
            pairs[module] = (a, b)
        if not pairs:
            raise LoraError(f"adapter {name!r} holds no LoRA tensors")
        covered = {m.rsplit(".", 1)[-1] for m in pairs}
        if missing := sorted(set(config.targets) - covered):  # an incomplete set: refused, not zero-filled
            raise LoraError(
                f"adapter {name!r}: its config targets {missing}, but it holds no tensors for them"
            )
        return pairs

    def unload(self, name: str) -> None:
        if name not in self.slots:
            raise LoraError(
                f"no adapter named {name!r} is loaded (loaded: {', '.join(self.slots) or 'none'})"
            )
        if self.requests.in_use.get(name):
            raise LoraError(
                f"adapter {name!r} is used by {self.requests.in_use[name]} running requests; unload it after they "
                "finish, or load the new version under the same name (it is replaced in place)"
            )
        slot = self.slots.pop(name)
        del self.configs[name], self.sources[name]
        self.scale[slot] = 0.0

    def slot_of(self, name: str | None) -> int:
        """The slot of adapter `name` (-1 for None: the base model); LoraError naming an unknown one."""
        if name is None:
            return -1
        slot = self.slots.get(name)
        if slot is None:
            raise LoraError(
                f"lora_path {name!r} is not a loaded adapter (loaded: {', '.join(self.slots) or 'none'})"
            )
        return slot

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors of adapter `name` as stored (PEFT names, the bank's dtype): what checksums hash."""
        slot, rank = self.slots[name], self.configs[name].rank
        cols = slice(slot * self.max_rank, slot * self.max_rank + rank)
        out = {}
        for module in self.modules:
            a, b = self.A[module][cols], self.B[module][:, cols]
            if a.any() or b.any():
                out[f"base_model.model.{module}.lora_A.weight"] = a
                out[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        return out


class LoraRequests:
    """Which adapter each running request uses: per scheduler row (`rows`, a device tensor the decode
    graph reads in place) and per prefill token (`token_slots`); `in_use` counts the requests of each
    adapter, which `LoraBank.unload` consults (`LoraBank.requests`)."""

    def __init__(self, bank: LoraBank, max_rows: int) -> None:
        self.bank = bank
        self.rows = torch.full((max_rows + 1,), -1, dtype=torch.int64, device=bank.device)
        """Scheduler row -> slot of its request's adapter (-1: the base model); one spare row at the end."""
        self.in_use: dict[str, int] = {}

    def bind(self, row: int, name: str | None) -> None:
        """Scheduler row `row` runs adapter `name` (None: the base model) until `unbind`."""
        self.rows[row] = self.bank.slot_of(name)
        if name is not None:
            self.in_use[name] = self.in_use.get(name, 0) + 1

    @property
    def any_in_use(self) -> bool:
        """Whether a running request uses an adapter (else every token runs the base model)."""
        return any(n > 0 for n in self.in_use.values())

    def unbind(self, row: int, name: str | None) -> None:
        self.rows[row] = -1
        if name is not None:
            self.in_use[name] -= 1

    def token_slots(self, names: list[str | None], counts: list[int]) -> torch.Tensor:
        """The slot of each packed token of requests running `names`, with `counts` new tokens each."""
        slots = torch.tensor([self.bank.slot_of(n) for n in names], device=self.bank.device)
        return torch.repeat_interleave(slots, torch.tensor(counts, device=self.bank.device))


def _fused_members(modules: dict[str, tuple[int, int]]):
    """(layer prefix, fused leaf, targeted members in row order) of the fused q/k/v and gate/up layers
    with at least two targeted members (a single one stays its own)."""
    layers = sorted({m.rsplit(".", 1)[0] for m in modules if m.startswith("model.layers.")})
    for head in layers:
        for leaf, parts in (
            ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("gate_up_proj", ("gate_proj", "up_proj")),
        ):
            members = [f"{head}.{p}" for p in parts]
            if all(m in modules for m in members):
                yield head, leaf, members
