"""Servers Miles did not start (`engine.urls`): checked at start, then published like started engines.

    each URL -> /model_info and /server_info answer (SGLang's names; the old /get_* ones as fallback)
             -> same model family as model.path (model_type, architectures of config.json)
             -> same shapes as model.path where the served directory is readable here (vocab_size, ...)
             -> same token ids for a probe text (/tokenize, where the server has it)
             -> serving other weights (another model_path, or a weight version an earlier run left)?
                load model.path into it (/update_weights_from_disk, version "default"), so that the
                first rollout samples from the weights the trainer starts from (skipped on --resume:
                the loop pushes the checkpoint's weights first)
    -> RUN_DIR/rendezvous/engines/engine-<i>.json with pid 0 and node "external"

Each failed check is a ConfigError naming engine.urls, the URL and what to change. The loop then
finds them in the rendezvous records and talks to them with the same SGLangClient as to started
engines; the launcher never restarts or stops them. Imports no torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.config import ConfigError, Plan
from miles.rollout.client import EngineError, SGLangClient

log = logging.getLogger("miles.launch")

EXTERNAL_NODE = "external"
"""The `node` of an external server's rendezvous record (its `pid` is 0: not a process of ours)."""
INITIAL_VERSION = "default"
"""SGLang's weight version of freshly loaded weights (the loop reads it as version 0)."""
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
INFO_TIMEOUT_S = 30.0
"""Bound on each answer to a check (a server that accepts connections but never answers fails it)."""
PROBE_TEXT = "Miles checks the tokenizer: The quick brown fox, 0123456789 (+-*/=) and <|im_end|>."


@dataclass
class ExternalEngine:
    """A server of engine.urls, as the launcher and its supervisor see it: a URL, no process."""

    url: str
    name: str
    pid: int = 0
    log_path: Path | None = None


def _fail(url: str, what: str) -> ConfigError:
    return ConfigError(f"engine.urls: {url} {what}")


def _config(model_dir: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def check_family(url: str, info: dict[str, Any], model_path: str) -> None:
    """The served model_type and architectures (from /model_info) against model.path's config.json."""
    ours = _config(model_path)
    for key in ("model_type", "architectures"):
        theirs, mine = info.get(key), ours.get(key)
        if theirs and mine and theirs != mine:
            raise _fail(
                url,
                f"serves a model with {key} {theirs!r}, model.path={model_path} has {mine!r}: "
                "start the server on model.path's model, or set model.path to the served one",
            )


def check_shapes(url: str, served_path: str, model_path: str) -> None:
    """Where the served model directory is readable here, its shapes against model.path's."""
    theirs, mine = _config(served_path), _config(model_path)
    for key in SHAPE_KEYS:
        if key in theirs and key in mine and theirs[key] != mine[key]:
            raise _fail(
                url,
                f"serves {served_path} with {key}={theirs[key]}, model.path={model_path} has "
                f"{key}={mine[key]}: the trainer's weights cannot be loaded into it",
            )


async def check_tokenizer(client: SGLangClient, model_path: str) -> None:
    """The server's token ids of PROBE_TEXT against model.path's tokenizer.json (skipped when either
    side has no tokenizer to ask)."""
    local = Path(model_path) / "tokenizer.json"
    if not local.exists():
        return
    from tokenizers import Tokenizer

    mine = Tokenizer.from_file(str(local)).encode(PROBE_TEXT, add_special_tokens=False).ids
    try:
        theirs = await client.tokenize(PROBE_TEXT)
    except (EngineError, KeyError, TypeError) as e:
        log.info("%s: tokenizer not compared (/tokenize: %s)", client.url, e)
        return
    if theirs != mine:
        raise _fail(
            client.url,
            f"tokenizes differently from model.path={model_path} (a probe text is {len(theirs)} tokens "
            f"there, {len(mine)} here): it serves another vocabulary; start it on model.path's model",
        )


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


async def load_initial_weights(client: SGLangClient, info: dict[str, Any], model_path: str) -> None:
    """Make the server serve model.path's weights at the initial version, unless it already does."""
    served, version = str(info.get("model_path", "")), str(info.get("weight_version", INITIAL_VERSION))
    if _same_dir(served, model_path) and version == INITIAL_VERSION:
        return
    print(
        f"miles: {client.url} serves {served} (weight version {version}); loading model.path={model_path}",
        file=sys.stderr,
    )
    try:
        await client.update_weights_from_disk(model_path, weight_version=INITIAL_VERSION)
    except EngineError as e:
        raise _fail(
            client.url,
            f"serves {served} (weight version {version}), not model.path={model_path}, and loading "
            f"model.path into it failed ({e}); start it on model.path, or make model.path readable there",
        ) from None


def check_deterministic(url: str, server: Any, plan: Plan) -> None:
    """train.true_on_policy: the server must run deterministic inference matched to this trainer."""
    if not plan.train.true_on_policy:
        return
    info = server if isinstance(server, dict) else {}
    if (
        not info.get("enable_deterministic_inference")
        or info.get("rl_on_policy_target") != plan.train.backend
    ):
        raise _fail(
            url,
            "runs without deterministic inference for this trainer (its /server_info: "
            f"enable_deterministic_inference={info.get('enable_deterministic_inference')}, rl_on_policy_target="
            f"{info.get('rl_on_policy_target')}), so train.true_on_policy cannot hold: restart it with "
            f"--enable-deterministic-inference --rl-on-policy-target {plan.train.backend}, or set "
            "train.true_on_policy=false",
        )


async def _check_one(url: str, plan: Plan, resume: bool) -> None:
    # questions are answered at once by a live server; loading weights may take minutes
    client = SGLangClient(url, timeout_s=INFO_TIMEOUT_S, retries=2)
    loader = SGLangClient(url, timeout_s=max(plan.engine.startup_timeout_s, INFO_TIMEOUT_S), retries=0)
    try:
        try:
            info = await client.get_model_info()
            server = await client.get_server_info()
        except EngineError as e:
            raise _fail(
                url,
                f"does not answer SGLang's /model_info and /server_info ({e}); start the server before "
                "`miles train`, or correct the URL",
            ) from None
        if not isinstance(info, dict):
            raise _fail(url, f"answers /model_info with {str(info)[:200]!r}, not SGLang's model info")
        check_deterministic(url, server, plan)
        model_path = plan.model.path
        check_family(url, info, model_path)
        served = str(info.get("model_path", ""))
        if served and not _same_dir(served, model_path):
            check_shapes(url, served, model_path)
        await check_tokenizer(client, model_path)
        if not resume:
            await load_initial_weights(loader, info, model_path)
    finally:
        await client.aclose()
        await loader.aclose()


def check_external_servers(plan: Plan, resume: bool) -> None:
    """Every check of the module docstring, for every URL of engine.urls (ConfigError on the first
    that fails)."""

    async def check_all() -> None:
        await asyncio.gather(*(_check_one(u.rstrip("/"), plan, resume) for u in plan.engine.urls))

    asyncio.run(check_all())


def publish_external(run_dir: Path, urls: list[str], incarnation: str) -> list[ExternalEngine]:
    """Publish each server as engine-<i> of this incarnation, as a started engine would be."""
    from miles.cluster.rendezvous import publish_engine

    engines = [ExternalEngine(u.rstrip("/"), f"engine-{i}") for i, u in enumerate(urls)]
    for e in engines:
        publish_engine(run_dir, e.name, e.url, e.pid, EXTERNAL_NODE, incarnation)
    return engines
