"""`python -m miles.engine --model DIR ...`: serve one embedded engine over SGLang's HTTP API.

With --port 0 the OS picks the port. Once the server accepts requests, `{"url": ..., "pid": ...}`
is written atomically (temporary file + rename) to --url-file, which launchers and the Slurm
rendezvous read.

SIGTERM (or SIGINT) always stops the engine, also when its engine thread is dead or stuck: the
engine thread is told to stop (requests in flight end with an abort), open connections get
`SHUTDOWN_GRACE_S` to finish, then the process ends by the signal itself (killed by SIGTERM, or
SIGINT).
Should the shutdown itself not finish within `SHUTDOWN_DEADLINE_S` (a stuck engine thread or a
handler blocked on it), the process exits at once with status 1, after logging why. Only daemon
threads are started here, so none keeps the process alive.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import torch
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from miles.cluster.environment import set_intra_op_threads
from miles.engine import mtp, speculative, streaming
from miles.engine.app import build_app
from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS, QUANTIZATIONS, build_decoder
from miles.engine.model import ModelSpec
from miles.engine.packed_weights import DEFAULT_INT4_MAX_ROWS
from miles.engine.scheduler import Scheduler
from miles.engine.server import EngineState, model_path_of
from miles.engine.tokenizer import load_codec
from miles.engine.updates import DEFAULT_TIMEOUT_S as DEFAULT_WEIGHT_UPDATE_TIMEOUT_S
from miles.engine.validation import DEFAULT_MAX_REQUEST_BYTES
from miles.models.families.base import Unsupported
from miles.quant.formats import FORMATS, Format, Scheme
from miles.serving import ApiKeys, CancelOnDisconnect, RequireApiKey, add_key_arguments, check_bind

log = logging.getLogger("miles.engine")
SHUTDOWN_GRACE_S = 5.0
SHUTDOWN_DEADLINE_S = 15.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _add_health_args(p: argparse.ArgumentParser) -> None:
    """Limits and liveness: body size, stuck detection, the health generation, fault injection."""
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies are answered 413 without being parsed",
    )
    p.add_argument(
        "--scheduler-stuck-timeout-s",
        type=float,
        default=60.0,
        help="/health answers 503 when work waits and the engine thread finished no step for this long",
    )
    p.add_argument(
        "--health-generate-timeout-s",
        type=float,
        default=20.0,
        help="/health_generate answers 503 when its one-token generation takes longer (SGLang: 20)",
    )
    p.add_argument(
        "--weight-update-timeout-s",
        type=float,
        default=DEFAULT_WEIGHT_UPDATE_TIMEOUT_S,
        help="bound on each wait of a weight update (update-group rendezvous, each broadcast, the HTTP call)",
    )
    add_key_arguments(p)
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="tests only: add POST /debug/inject_fault (step_error, step_hang, scheduler_death)",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, where it is served, and its batching and CUDA-graph limits."""
    p.add_argument("--model", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: let the OS choose")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: float32 on CPU, bfloat16 on GPU"
    )
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=65536, help="KV-cache capacity in tokens")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="new tokens per prefill forward")
    p.add_argument("--disable-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    p.add_argument(
        "--cuda-graph-max-bs", type=int, default=None, help="largest captured decode batch (default: all)"
    )
    p.add_argument(
        "--cuda-graph-max-context",
        type=int,
        default=4096,
        help="longest (padded) context with a captured decode graph; longer contexts decode eagerly",
    )
    p.add_argument("--url-file", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="MoE: record each token's top-k experts so /generate can return routed_experts",
    )
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant forward and log-probs (miles/quant/invariant.py): a token's log-prob has "
        "the same bits whatever the batch, chunk or cached prefix, and equals the FSDP trainer's under "
        "train.true_on_policy",
    )
    p.add_argument(
        "--rl-on-policy-target",
        choices=["fsdp"],
        default=None,
        help="the trainer whose log-probs to match bit for bit; implies --enable-deterministic-inference",
    )


def _add_quantization_args(p: argparse.ArgumentParser) -> None:
    """Low-precision weights (FP8 layouts and packed formats)."""
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="FP8 linear layers (miles/engine/fp8_weights.py): 128x128 block or row-wise weight scales; "
        "int4 (W4A16), mxfp8, nvfp4: packed weights (miles/engine/packed_weights.py)",
    )
    p.add_argument(
        "--quant-modules",
        choices=["experts", "linear"],
        default="linear",
        help="int4 / mxfp8 / nvfp4: the weights they cover (MoE experts, or every linear layer)",
    )
    p.add_argument("--int4-group-size", type=int, choices=[32, 128], default=128)
    p.add_argument(
        "--int4-max-rows",
        type=int,
        default=DEFAULT_INT4_MAX_ROWS,
        help="int4 on CUDA: GEMMs of at most this many rows run the int4 kernel (0: never)",
    )
    p.add_argument(
        "--fp8-min-tokens",
        type=int,
        default=DEFAULT_FP8_MIN_TOKENS,
        help="GEMMs with fewer rows dequantise FP8 weights and run in the model dtype (decode)",
    )


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    """LoRA adapters served unmerged (SGLang's flags)."""
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (miles/engine/lora.py)")
    p.add_argument(
        "--lora-paths", nargs="*", default=[], metavar="NAME=PATH", help="PEFT adapters to load at start-up"
    )
    p.add_argument(
        "--max-loras-per-batch", type=int, default=8, help="adapter slots (adapters loaded at once)"
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="largest adapter rank (default: the start-up adapters', else 16)",
    )
    p.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        help="layers adapters may target (q_proj ... down_proj, or all; default: the start-up adapters', else all)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m miles.engine", description=__doc__)
    _add_model_args(p)
    _add_quantization_args(p)
    _add_lora_args(p)
    _add_health_args(p)
    streaming.add_args(p)
    speculative.add_args(p)
    args = p.parse_args(argv)
    if (why := speculative.problem(args)) is not None:
        p.error(why)
    if (
        args.max_request_bytes < 1
        or args.scheduler_stuck_timeout_s <= 0
        or args.health_generate_timeout_s <= 0
        or args.weight_update_timeout_s <= 0
        or args.fp8_min_tokens < 1
    ):
        p.error(
            "--max-request-bytes, --scheduler-stuck-timeout-s, --health-generate-timeout-s and "
            "--weight-update-timeout-s and --fp8-min-tokens must be > 0"
        )
    return args


def _start_lora(args: argparse.Namespace, decoder) -> list:
    """The decoder's LoRA bank (sized from the flags or the start-up adapters) and those adapters."""
    from miles.engine.lora import TARGETS, LoraBank, LoraError, read_adapter

    adapters = []
    for item in args.lora_paths:
        name, _, path = item.rpartition("=")
        name = name or Path(path).name
        try:
            config, tensors = read_adapter(path)
        except (LoraError, OSError) as e:
            raise SystemExit(f"--lora-paths {item}: {e}") from None
        adapters.append((name, config, tensors, path))
    rank = args.max_lora_rank or max((c.rank for _, c, _, _ in adapters), default=16)
    targets = (
        args.lora_target_modules or sorted({t for _, c, _, _ in adapters for t in c.targets}) or list(TARGETS)
    )
    targets = list(TARGETS) if targets == ["all"] else targets
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise SystemExit(
            f"--lora-target-modules {bad}: the engine's LoRA layers are {', '.join(TARGETS)} (or all)"
        )
    decoder.lora = LoraBank.for_decoder(
        decoder, args.max_loras_per_batch, rank, tuple(targets), args.max_running_requests
    )
    return adapters


def _sglang_quantization(value: str) -> str | None:
    """server_info's `quantization` as SGLang names the method (none: None)."""
    names = {"none": None, "int4": "compressed-tensors", "mxfp8": "mxfp8", "nvfp4": "modelopt_fp4"}
    return names.get(value, "fp8")


def _eos_ids(model_dir: Path, spec: ModelSpec, tokenizer) -> frozenset[int]:
    ids = set(spec.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _build_decoder(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple[ModelSpec, Any]:
    """The model's spec and decoder with the flags' quantisation and routing record."""
    model_dir = Path(args.model)
    try:  # a config.json that does not parse fails as it is, its error the log's last line
        spec = ModelSpec.from_dir(model_dir)
    except Unsupported as e:
        raise SystemExit(str(e)) from None
    try:
        if (spec.mla is not None or spec.v4 is not None) and (
            args.quantization not in ("none", "fp8_block", "fp8_row") or args.enable_lora
        ):
            raise ValueError(
                f"{spec.arch} ({'hybrid compressed' if spec.v4 else 'multi-head latent'} attention) is served "
                "in the model dtype or FP8 "
                "(--quantization fp8_block / fp8_row), without --enable-lora: drop the other flags"
            )
        scheme = None
        if args.quantization in FORMATS:
            scheme = Scheme(Format(args.quantization, args.int4_group_size), args.quant_modules)
        decoder = build_decoder(
            spec, model_dir, device, dtype, args.quantization, args.fp8_min_tokens, scheme, args.int4_max_rows
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.enable_return_routed_experts and spec.moe is None:
        raise SystemExit(
            f"--enable-return-routed-experts needs a mixture-of-experts model; {spec.arch} is dense"
        )
    decoder.record_routing = args.enable_return_routed_experts
    if deterministic(args):
        why = _not_invariant(args, spec)
        if why:
            raise SystemExit(f"--enable-deterministic-inference does not cover {why}")
        decoder.make_invariant()
    return spec, decoder


def _graph_safe_invariant(spec: ModelSpec) -> bool:
    """Whether the batch-invariant forward can be captured in CUDA graphs: dense, Triton kernels."""
    from miles.quant import invariant

    return spec.moe is None and invariant.GPU_KERNELS == "triton"


def deterministic(args: argparse.Namespace) -> bool:
    """Whether the batch-invariant forward is asked for (either flag)."""
    return args.enable_deterministic_inference or args.rl_on_policy_target is not None


def _not_invariant(args: argparse.Namespace, spec: ModelSpec) -> str | None:
    """What of this server stops the batch-invariant forward, or None."""
    moe = spec.moe is not None and (spec.moe.scoring != "softmax" or spec.moe.shared_intermediate > 0)
    if moe or spec.mla is not None or spec.v4 is not None or spec.rope_scaling:
        return f"{spec.arch} (grouped-query decoders with the default RoPE, dense or Qwen3-MoE, only)"
    if args.quantization != "none" or args.enable_lora or args.lora_paths or args.speculative_algorithm:
        return "--quantization, LoRA adapters or speculative decoding: drop them"
    return None


def _server_args(args: argparse.Namespace, scheduler: Scheduler, device: str, dtype: torch.dtype) -> dict:
    """/server_info's server_args, with SGLang's names."""
    lora = scheduler.decoder.lora
    return {
        "model_path": model_path_of(args.model),
        "tokenizer_path": model_path_of(args.model),
        "host": args.host,
        "port": args.port,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "max_running_requests": args.max_running_requests,
        "max_prefill_tokens": args.max_prefill_tokens,
        "random_seed": args.seed,
        "tp_size": 1,
        "dp_size": 1,
        "page_size": 1,
        "disable_cuda_graph": not scheduler.use_cuda_graph,
        "cuda_graph_max_bs": scheduler.graph_max_bs,
        "enable_return_routed_experts": args.enable_return_routed_experts,
        "enable_lora": args.enable_lora or bool(args.lora_paths),
        "max_loras_per_batch": args.max_loras_per_batch,
        "max_lora_rank": None if lora is None else lora.max_rank,
        "quantization": _sglang_quantization(args.quantization),
        "fp8_layout": args.quantization if args.quantization.startswith("fp8") else None,
        "enable_deterministic_inference": deterministic(args),
        "rl_on_policy_target": args.rl_on_policy_target,
        "speculative_algorithm": args.speculative_algorithm,
        "speculative_draft_model_path": args.speculative_draft_model_path,
        "speculative_num_steps": args.speculative_num_steps if args.speculative_algorithm else None,
    }


def build_state(args: argparse.Namespace) -> EngineState:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda given but CUDA is not available; use --device cpu")
    dtype = DTYPES[args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    torch.manual_seed(args.seed)
    model_dir = Path(args.model)
    spec, decoder = _build_decoder(args, device, dtype)
    adapters = _start_lora(args, decoder) if args.enable_lora or args.lora_paths else []
    scheduler = Scheduler(
        decoder,
        args.max_running_requests,
        args.max_total_tokens,
        args.max_prefill_tokens,
        # the invariant forward's Triton kernels are graph-safe, Qwen3-MoE's experts (host-side lists) not
        cuda_graph=not args.disable_cuda_graph
        and not (deterministic(args) and not _graph_safe_invariant(spec)),
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_max_context=args.cuda_graph_max_context,
        stuck_timeout_s=args.scheduler_stuck_timeout_s,
    )
    try:
        attach = mtp.attach if args.speculative_algorithm == "NEXTN" else speculative.attach
        attach(args, scheduler, device, dtype)
    except (ValueError, Unsupported) as e:
        what = args.speculative_draft_model_path or args.model
        raise SystemExit(f"--speculative-algorithm {args.speculative_algorithm} with {what}: {e}") from None
    for name, config, tensors, path in adapters:
        try:
            scheduler.holdings.load_lora(name, config, tensors, path)
        except ValueError as e:
            raise SystemExit(f"--lora-paths {name}={path}: {e}") from None
    tok = load_codec(model_dir)
    if tok is None:
        log.warning("no tokenizer.json in %s: only input_ids requests will work", model_dir)
    state = EngineState(
        scheduler,
        model_path_of(args.model),
        tok,
        _server_args(args, scheduler, device, dtype),
        _eos_ids(model_dir, spec, tok),
        args.seed,
        max_request_bytes=args.max_request_bytes,
        health_generate_timeout_s=args.health_generate_timeout_s,
        enable_fault_injection=args.enable_fault_injection,
        incremental_streaming_output=args.incremental_streaming_output,
    )
    state.updater.timeout_s = args.weight_update_timeout_s
    return state


def write_url_file(path: str, url: str) -> None:
    """Atomically publish the engine's URL and PID (readers never see a partial file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(tmp, target)


def _force_exit() -> None:
    log.error(
        "the engine did not shut down within %g s (stuck engine thread?); exiting now", SHUTDOWN_DEADLINE_S
    )
    logging.shutdown()
    os._exit(1)


def _begin_shutdown(state: EngineState) -> None:
    """On SIGTERM/SIGINT: stop the engine thread (requests in flight end, so their connections close)
    and arm the deadline (module docstring)."""
    log.info("shutting down")
    state.scheduler.stop()
    deadline = threading.Timer(SHUTDOWN_DEADLINE_S, _force_exit)
    deadline.daemon = True
    deadline.start()


async def _serve(
    server: uvicorn.Server, sock: socket.socket, url: str, url_file: str | None, state: EngineState
) -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        log.info("serving at %s", url)
        if url_file:
            write_url_file(url_file, url)
    # uvicorn's own signal handler only sets should_exit; acting on it here, not in the handler,
    # keeps locks out of signal context
    while not task.done() and not server.should_exit:
        await asyncio.sleep(0.1)
    if server.should_exit:
        _begin_shutdown(state)
    await task


class QuietHTTP2Probe(H11Protocol):
    """HTTP/1.1 as usual, but a connection that opens with the HTTP/2 preface is closed quietly:
    sglang-router probes each worker over gRPC as well when it registers it, which uvicorn would log
    as an invalid request (twice per worker) although nothing is wrong."""

    def data_received(self, data: bytes) -> None:
        if data.startswith(b"PRI * HTTP/2.0"):
            self.transport.close()
            return
        super().data_received(data)


def main(argv: list[str] | None = None) -> None:
    faulthandler.register(
        signal.SIGUSR1, all_threads=True
    )  # `kill -USR1 PID`: every thread's stack to the log
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        keys = ApiKeys.from_files(args.api_key_file, args.admin_api_key_file)
        check_bind("miles.engine", args.host, keys, args.allow_unauthenticated)
    except ValueError as e:
        raise SystemExit(f"miles.engine: {e}") from None
    log.info(set_intra_op_threads())
    state = build_state(args)
    engine_thread = threading.Thread(target=state.scheduler.run, name="engine", daemon=True)
    engine_thread.start()
    # IPPROTO_TCP named: asyncio turns Nagle off only on sockets whose protocol says TCP (accepted
    # connections inherit it); with protocol 0 every small reply waited ~40 ms for a delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    state.server_args["port"] = port
    config = uvicorn.Config(
        RequireApiKey(CancelOnDisconnect(build_app(state)), keys),
        http=QuietHTTP2Probe,
        log_level="warning",
        timeout_keep_alive=60,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = uvicorn.Server(config)
    try:
        asyncio.run(_serve(server, sock, f"http://{host}:{port}", args.url_file, state))
    finally:
        state.scheduler.stop()
        engine_thread.join(timeout=SHUTDOWN_GRACE_S)


if __name__ == "__main__":
    main()
