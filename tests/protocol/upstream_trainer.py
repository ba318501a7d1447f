"""An upstream-style trainer, for the weight-update protocol tests: a separate process that pushes
new weights into an engine exactly as SGLang's test helpers and upstream Miles do, with nothing
from this project imported.

It plays one weight sync of upstream Miles' broadcast path, over plain HTTP and torch.distributed:
pause_generation, flush_cache, begin_weight_update, init_weights_update_group (while the trainer
joins through torch's `tcp://` rendezvous as rank 0: a store whose host waits for every rank, a
prefix store named after the group, a fresh process group beside the default one),
update_weights_from_distributed per bucket while rank 0 broadcasts the bucket, update_weight_version,
end_weight_update, continue_generation, and the group destroyed on both sides. The first bucket is
sent tensor by tensor (upstream Miles), the second as one flattened uint8 tensor
(SGLang's `load_format: "flattened_bucket"`).

The new weights are the model's safetensors plus 0.05 * N(0, 1) noise from `--seed`, drawn name by
name in sorted order (new_weights() below; the test computes the same). Exit status 0 when every
call succeeded; the engine's answers are printed as JSON lines.

    python upstream_trainer.py --url URL --model DIR --seed 1 --version v1 [--group-name G]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

TIMEOUT = timedelta(seconds=60)


def new_weights(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """The weights this trainer pushes: the checkpoint's, each plus seeded noise."""
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(f))
    gen = torch.Generator().manual_seed(seed)
    return {k: weights[k] + 0.05 * torch.randn(weights[k].shape, generator=gen) for k in sorted(weights)}


def post(url: str, route: str, body: dict) -> dict:
    """POST JSON as `requests.post(url, json=...)` + `raise_for_status()` would; returns the answer."""
    req = urllib.request.Request(
        url + route, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{route} answered HTTP {e.code}: {e.read().decode()}") from None
    print(json.dumps({"route": route, "reply": json.loads(text) if text.strip() else None}), flush=True)
    return json.loads(text) if text.strip() else {}


def in_background(url: str, route: str, body: dict) -> threading.Thread:
    """The engine call runs while this process takes part in the collective (Ray `.remote()` upstream)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            post(url, route, body)
        except BaseException as e:  # reported by join() below
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.errors = errors  # type: ignore[attr-defined]
    t.start()
    return t


def join(t: threading.Thread) -> None:
    t.join()
    if t.errors:  # type: ignore[attr-defined]
        raise SystemExit(f"engine call failed: {t.errors[0]}")  # type: ignore[attr-defined]


def join_group(address: str, port: int, world_size: int, group_name: str) -> dist.ProcessGroup:
    """Rank 0 of a process group beside the default one, through torch's tcp:// rendezvous."""
    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", 0, world_size, timeout=TIMEOUT))
    store.set_timeout(TIMEOUT)
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], "gloo", store, group_name=group_name, timeout=TIMEOUT
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def push_bucket(url: str, group: dist.ProcessGroup, group_name: str, bucket: dict, **extra) -> None:
    flattened = extra.get("load_format") == "flattened_bucket"
    body = {
        "names": list(bucket),
        "dtypes": [str(t.dtype).replace("torch.", "") for t in bucket.values()],
        "shapes": [list(t.shape) for t in bucket.values()],
        "group_name": group_name,
        "flush_cache": False,
        "selector": "all",
        **extra,
    }
    call = in_background(url, "/update_weights_from_distributed", body)
    if flattened:
        tensors = [torch.cat([t.contiguous().flatten().view(torch.uint8) for t in bucket.values()])]
    else:
        tensors = [t.contiguous() for t in bucket.values()]
    handles = [dist.broadcast(t, 0, group=group, async_op=True) for t in tensors]
    for h in handles:
        h.wait()
    join(call)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--version", required=True)
    p.add_argument("--group-name", default="miles-pp_0")
    args = p.parse_args()
    url = args.url.rstrip("/")
    weights = new_weights(args.model, args.seed)
    names = list(weights)
    buckets = [
        ({n: weights[n] for n in names[: len(names) // 2]}, {}),
        ({n: weights[n] for n in names[len(names) // 2 :]}, {"load_format": "flattened_bucket"}),
    ]

    post(url, "/pause_generation", {"mode": "in_place"})
    post(url, "/begin_weight_update", {"selector": "all"})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": args.group_name,
        "backend": "gloo",
    }
    call = in_background(url, "/init_weights_update_group", init)
    group = join_group("127.0.0.1", port, 2, args.group_name)
    join(call)
    for i, (bucket, extra) in enumerate(buckets):
        version = {"weight_version": args.version} if i == len(buckets) - 1 else {}
        push_bucket(url, group, args.group_name, bucket, **extra, **version)
    post(url, "/update_weight_version", {"new_version": args.version, "abort_all_requests": False})
    post(url, "/end_weight_update", {})
    post(url, "/continue_generation", {})
    post(url, "/destroy_weights_update_group", {"group_name": args.group_name})
    dist.destroy_process_group(group)
    print(json.dumps({"done": True, "tensors": len(names)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
