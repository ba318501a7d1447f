"""`miles export RUN_DIR [--step N] OUT`: a run's checkpoint as a Hugging Face model directory.

OUT receives model.safetensors (in plan.model.dtype), config.json, generation_config.json and the
tokenizer of plan.model.path, so that `AutoModelForCausalLM.from_pretrained(OUT)` gives the logits of
the trainer's weights at that step. One process, on the CPU, no process group and no GPU:

- FSDP (`checkpoints/step_N/state/`, torch.distributed.checkpoint): the model entries are read into
  a model of the run's architecture, whatever number of ranks wrote them (DCP stores global offsets).
  The optimiser state beside them is not read.
- Megatron (`checkpoints/step_N/megatron/model_tpT_ppP.pt`, `model_tpT_ppP_epE.pt` with expert
  parallelism): the tensor-parallel slices of each pipeline stage are joined
  (miles/train/megatron/convert.py), each stage's layers renumbered from the layer counts of the
  stages before it, and the names mapped to the HF ones. With expert parallelism the dense weights
  come from the ep0 files and each expert-parallel rank's experts are renumbered from its local
  numbers to the global ones. Needs no megatron package: the files hold plain tensors.

`--quantized` writes the weights in the run's engine format instead (engine.quantization: int4 as
compressed-tensors' pack-quantized, mxfp8 / nvfp4 as Miles' packed layout, fp8_block / fp8_row as
SGLang's FP8 checkpoint), each covered weight quantised once by the contract the run trained with, and
config.json's `quantization_config` saying so: the directory the embedded engine (or, for int4 and FP8,
an SGLang server) loads as it is, whose values are the trainer's fake-quant forward's.

A LoRA run (train.lora, FSDP) exports its adapter in PEFT's format (`adapter_config.json` +
`adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, OUT)` loads), or with `--merge`
the base model with the adapter merged into its weights, as a plain Hugging Face directory. A run of
several adapters (train.lora.adapters) writes OUT/<adapter>/ for each, or with `--adapter NAME` that
one at OUT (which `--merge` needs).

The checkpoint is verified against its `.complete` record first (without --step: the newest one
that verifies). Every parameter of the model must come from the checkpoint: a missing or unexpected
name is an error that lists them.
"""

from __future__ import annotations

import argparse
import logging
import re
import warnings
from pathlib import Path
from typing import Any

from miles.config import ConfigError
from miles.models import save_modes

log = logging.getLogger(__name__)

_MEGATRON_FILE = re.compile(r"^model_tp(\d+)_pp(\d+)(?:_ep(\d+))?\.pt$")
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _cmd_export(args: argparse.Namespace) -> int:
    out = export_run(
        args.run_dir,
        args.out,
        step=args.step,
        quantized=args.quantized,
        merge=args.merge,
        adapter=args.adapter,
    )
    print(f"wrote {out}")
    return 0


def add_export_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (safetensors, config, tokenizer)",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out", metavar="OUT", help="directory to write (created; it must be empty if it exists)")
    p.add_argument(
        "--step", type=int, help="checkpoint step (default: the newest complete one that verifies)"
    )
    p.add_argument(
        "--quantized",
        action="store_true",
        help="write the weights in the run's engine.quantization format (int4, mxfp8, nvfp4, fp8_*)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: the base model with the adapter merged (else the adapter)",
    )
    p.add_argument("--adapter", help="runs of several LoRA adapters: the one to write (default: each)")
    p.set_defaults(func=_cmd_export)


def export_run(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    quantized: bool = False,
    merge: bool = False,
    adapter: str | None = None,
) -> Path:
    """Write the HF directory of the checkpoint of `step` (None: the newest that verifies) to `out`;
    `quantized`: in the run's engine format (module docstring)."""
    from miles.config.resolve import read_plan
    from miles.train.checkpoint import CheckpointError, choose, step_dir

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "plan.yaml").is_file():
        raise ConfigError(
            f"{run_dir} has no plan.yaml: is it a run directory (made by `miles train`/`submit`)?"
        )
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty: name a new directory for the export")
    plan = read_plan(run_dir / "plan.yaml")
    lora = plan.train.lora
    _check_lora_flags(run_dir, lora, merge, adapter)
    contract = _export_contract(run_dir, plan) if quantized else None
    choice = choose(run_dir, step)
    for note in choice.notes:
        log.warning("%s", note)
    try:
        step = choice.check()
    except CheckpointError as e:
        raise ConfigError(f"miles export: {e}") from e
    model = _load_checkpoint(step_dir(run_dir, step), plan)
    if lora is not None and not merge:
        return _write_adapters(model, lora.names, adapter, plan.model.path, plan.model.dtype, out, step)
    if lora is not None:
        model.set_adapter(adapter or lora.names[0])
        model = model.merge_and_unload()
    _write(model, plan.model.path, plan.model.dtype, out, step)
    if contract is not None:
        _write_quantized(model, out, contract)
    return out


def _check_lora_flags(run_dir: Path, lora: Any, merge: bool, adapter: str | None) -> None:
    """--merge / --adapter only for LoRA runs, naming one of their adapters where it must."""
    if (merge or adapter) and lora is None:
        raise ConfigError(
            f"miles export --merge/--adapter: {run_dir} did not train a LoRA adapter (train.lora); drop them"
        )
    if adapter is not None and adapter not in lora.names:
        raise ConfigError(f"miles export --adapter {adapter}: {run_dir} trained {', '.join(lora.names)}")
    if merge and adapter is None and len(lora.names) > 1:
        raise ConfigError(f"miles export --merge: name one of {', '.join(lora.names)} with --adapter")


def _export_contract(run_dir: Path, plan: Any) -> Any:
    """--quantized: the run's engine weight contract (a ConfigError for a bf16 engine)."""
    from miles.quant.formats import engine_contract

    contract = engine_contract(plan)
    if contract is None:
        raise ConfigError(
            f"miles export --quantized: {run_dir}'s engine.quantization is none; export without --quantized"
        )
    return contract


def _load_checkpoint(src: Path, plan: Any) -> Any:
    """The HF model (PEFT-wrapped for a LoRA run) with the weights of checkpoint directory `src`,
    whichever backend wrote it."""
    lora = plan.train.lora
    model = _empty_model(plan.model.path)
    if (src / "megatron").is_dir():
        state = megatron_state(src / "megatron", model.config)
        adapters = {k: state.pop(k) for k in [k for k in state if ".lora_" in k]}
        _load_strict(model, _stack_experts(state, model.state_dict()), src)
        if lora is not None:  # the base as loaded, then the adapter under PEFT's saved names
            from peft import set_peft_model_state_dict

            from miles.lora.adapters import wrap

            model = wrap(model, lora)
            set_peft_model_state_dict(model, adapters, adapter_name=lora.names[0])
    elif (src / "state").is_dir():
        if lora is not None:
            from miles.lora.adapters import wrap

            model = wrap(model, lora)
        _load_strict(model, _stack_experts(fsdp_state(src / "state", model), model.state_dict()), src)
    else:
        raise ConfigError(f"{src} holds neither state/ (FSDP) nor megatron/ (Megatron) checkpoint files")
    return model


def _empty_model(model_path: str) -> Any:
    """The run's architecture (from plan.model.path's config) with fp32 weights to be overwritten."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_path)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def fsdp_state(state_dir: Path, model: Any) -> dict[str, Any]:
    """The model entries of an FSDP (DCP) checkpoint, as full CPU tensors keyed by HF names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    saved = {
        k.removeprefix("model.")
        for k in FileSystemReader(str(state_dir)).read_metadata().state_dict_metadata
        if k.startswith("model.")
    }
    extra = sorted(saved - set(model.state_dict()))
    if extra:
        raise ConfigError(
            f"{state_dir}: parameters the model of plan.model.path lacks: {', '.join(extra[:8])}"
        )
    holder = {"model": {k: v.detach().clone() for k, v in model.state_dict().items() if k in saved}}
    with warnings.catch_warnings():  # "loading in a single process" is exactly the intent here
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(holder, checkpoint_id=str(state_dir), no_dist=True)
    return holder["model"]


def megatron_state(mg_dir: Path, hf_cfg: Any) -> dict[str, Any]:
    """HF-named full tensors from the per-(TP, PP[, EP]) model files of a Megatron checkpoint."""
    import torch

    from miles.train.megatron import convert

    files, tp, pp, ep = _megatron_files(mg_dir)
    full: dict[str, torch.Tensor] = {}
    offset = 0
    shapes = None
    for stage in range(pp):
        stage_layers = 0
        for e in range(ep):
            shards = [
                torch.load(files[(t, stage, e)], map_location="cpu", weights_only=True) for t in range(tp)
            ]
            names = [k for k in shards[0] if not k.endswith("_extra_state")]
            if shapes is None:
                te = any(k.endswith("layer_norm_weight") for k in names)
                shapes = convert.Shapes.from_hf(hf_cfg, te_names=te)
                local = _local_experts(shapes.num_experts, ep, mg_dir)
            if e > 0:  # the dense weights are ep0's
                names = [k for k in names if convert.expert_of(k) is not None]
            for name in names:
                full[convert.to_global(convert.ep_to_global(name, e, local), offset)] = convert.tp_unshard(
                    name, [s[name] for s in shards], shapes
                )
            if e == 0:
                stage_layers = len({int(m.group(1)) for k in names if (m := _LOCAL_LAYER.match(k))})
        offset += stage_layers
    if shapes.tied:
        full.pop("output_layer.weight", None)  # the last stage's copy of the tied embedding
    from miles.train.megatron.lora import peft_name

    adapters = {}  # LoRA (miles/train/megatron/lora.py): PEFT's saved names
    for name in [k for k in full if ".lora_" in k]:
        module, _, leaf = name.rpartition(".")
        adapters[peft_name(module, leaf, 0)] = full.pop(name)
    from miles.train.megatron import architectures

    try:
        return {**architectures.of(hf_cfg).to_hf(full, hf_cfg, shapes.te_names), **adapters}
    except KeyError as e:
        raise ConfigError(f"{mg_dir}: {e.args[0]}; is plan.model.path the model this run trained?") from e


def _megatron_files(mg_dir: Path) -> tuple[dict[tuple[int, int, int], Path], int, int, int]:
    """The model files by (TP, PP, EP) rank (EP 0 without the `_epE` suffix) and the three sizes;
    an error naming every file the layout lacks."""
    files: dict[tuple[int, int, int], Path] = {}
    suffixed = set()
    for p in mg_dir.iterdir():
        if m := _MEGATRON_FILE.match(p.name):
            suffixed.add(m.group(3) is not None)
            files[(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))] = p
    if not files:
        raise ConfigError(f"{mg_dir} holds no model_tp<T>_pp<P>.pt or model_tp<T>_pp<P>_ep<E>.pt files")
    if len(suffixed) > 1:
        raise ConfigError(
            f"{mg_dir} mixes model files with and without the expert-parallel `_ep<E>` suffix: "
            "they come from different runs; keep one checkpoint per step directory"
        )
    tp, pp, ep = (1 + max(k[i] for k in files) for i in range(3))
    tag = "_ep{}" if suffixed == {True} else ""
    missing = [
        f"model_tp{t}_pp{p}{tag.format(e)}.pt"
        for t in range(tp)
        for p in range(pp)
        for e in range(ep)
        if (t, p, e) not in files
    ]
    if missing:
        layout = f"TP={tp}, PP={pp}" + (f", EP={ep}" if tag else "")
        raise ConfigError(f"{mg_dir} lacks {', '.join(missing)} (a checkpoint of {layout})")
    return files, tp, pp, ep


def _local_experts(num_experts: int, ep: int, mg_dir: Path) -> int:
    """Experts per expert-parallel rank; an error when the files' EP does not split the model's."""
    if ep > 1 and (not num_experts or num_experts % ep):
        raise ConfigError(
            f"{mg_dir} holds {ep} expert-parallel slices, which do not split the {num_experts} routed "
            "experts of plan.model.path: is it the model this run trained?"
        )
    return num_experts // ep if ep > 1 else 0


def _stack_experts(state: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """`state` with per-expert HF names (`mlp.experts.<e>.{gate,up,down}_proj.weight`, as the
    converter and the safetensors files name them) stacked into the tensors a transformers 5 model
    holds in memory: `mlp.experts.gate_up_proj` [E, 2I, H] ([gate; up] per expert) and
    `mlp.experts.down_proj` [E, H, I]. A layer lacking any expert is left for _load_strict to report."""
    import torch

    state = dict(state)
    for name, param in own.items():
        head, _, tail = name.rpartition(".experts.")
        if tail not in ("gate_up_proj", "down_proj") or name in state:
            continue
        parts = ("down",) if tail == "down_proj" else ("gate", "up")
        names = [[f"{head}.experts.{e}.{x}_proj.weight" for x in parts] for e in range(param.shape[0])]
        if all(n in state for row in names for n in row):
            state[name] = torch.stack([torch.cat([state.pop(n) for n in row]) for row in names])
    return state


def _load_strict(model: Any, state: dict[str, Any], src: Path) -> None:
    """Copy `state` into `model`; every parameter must be there (tied weights count once)."""
    import torch

    own = model.state_dict()
    tie = getattr(model.config, "tie_word_embeddings", False)
    tied = {k for k in own if k.endswith("lm_head.weight")} if tie else set()
    missing = sorted(k for k in own if k not in state and k not in tied)
    unexpected = sorted(k for k in state if k not in own)
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {src} does not match the model of plan.model.path: "
            f"missing {missing[:8] or 'none'}, unexpected {unexpected[:8] or 'none'}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ConfigError(
                f"{src}: {name} has shape {tuple(tensor.shape)}, the model {tuple(own[name].shape)}"
            )
    with torch.no_grad():
        model.load_state_dict(state, strict=False)
    if tied:
        model.tie_weights()


def _write_quantized(model: Any, out: Path, contract: Any) -> None:
    """Replace `out`'s safetensors by the contract's layout of the model's weights (one file) and mark
    config.json with its quantization_config."""
    import json

    from safetensors.torch import save_file

    from miles.quant.formats import Scheme
    from miles.quant.fp8 import quantization_config
    from miles.train.fsdp.weights import checkpoint_names
    from miles.train.quant import export_pairs

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    named = (
        pair
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
        for pair in checkpoint_names(name, t.detach())
    )
    tensors = {name: t.contiguous() for name, t in export_pairs(named, contract)}
    for f in [*out.glob("*.safetensors"), *out.glob("model.safetensors.index.json")]:
        f.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = (
        contract.quantization_config() if isinstance(contract, Scheme) else quantization_config(contract)
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    log.info("wrote the %s weights of %s", getattr(contract, "name", contract), out)


def _write_adapters(
    model: Any, names: list[str], adapter: str | None, model_path: str, dtype: str, out: Path, step: int
) -> Path:
    """PEFT adapter directories (adapter_config.json, adapter_model.safetensors): the run's one adapter
    or `adapter` at `out`, else each adapter at out/<name>."""
    import torch

    from miles.lora.adapters import write_adapter

    model = model.to(getattr(torch, _DTYPES[dtype]))
    if adapter is not None or len(names) == 1:
        names = [adapter or names[0]]
    for name in names:
        where = out if len(names) == 1 else out / name
        write_adapter(model, name, model_path, where)
        log.info("exported adapter %s of step %d to %s", name, step, where)
    return out


def _write(model: Any, model_path: str, dtype: str, out: Path, step: int) -> Path:
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    model = model.to(getattr(torch, _DTYPES[dtype]))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    try:
        GenerationConfig.from_pretrained(model_path).save_pretrained(out)
    except OSError:
        pass  # the base model ships no generation_config.json: transformers' defaults apply
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    save_modes(out)
    log.info("exported step %d to %s", step, out)
    return out
