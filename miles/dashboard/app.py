"""`miles dashboard RUN_DIR ...`: a read-only web view of one run or several side by side.

One static page (static/index.html + app.js, charts drawn with the vendored uPlot, MIT licence in
static/uPlot.LICENSE; nothing is loaded from a CDN) polls these JSON endpoints:

    GET /api/runs                     the runs shown and the chart panels
    GET /api/runs/{id}/metrics?version=V   metrics.jsonl records (none when V is still current)
    GET /api/runs/{id}/state          step, weight version, buffer, engines, trainer ranks, Slurm job
    GET /api/runs/{id}/samples        records of the newest evaluation of each dataset
    GET /api/runs/{id}/file?path=P    one file of the run directory (logs, plots), as text or bytes

Only GET exists: the dashboard never writes. The static routes serve the files of static/ by name
alone, and `file` refuses any path that resolves outside its run directory (403). It binds to
127.0.0.1 unless told otherwise; serving on another address is the caller's explicit choice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse

from miles.dashboard.runs import PANELS, OutsideRunDir, RunView, inside, run_views
from miles.serving import ApiKeys, RequireApiKey, check_bind

STATIC = Path(__file__).resolve().parent / "static"
_MEDIA = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".png": "image/png"}


def expand_run_dirs(paths: list[str]) -> list[Path]:
    """Run directories named by `paths`: a run directory itself; a sweep record
    (<runs_root>/sweeps/<tag>.json) as its points' run directories; any other directory as the run
    directories directly under it (those holding plan.yaml or metrics.jsonl)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file() and p.suffix == ".json":
            out += [Path(pt["run_dir"]) for pt in json.loads(p.read_text()).get("points", [])]
        elif p.is_dir() and not _is_run_dir(p):
            found = sorted(d for d in p.iterdir() if d.is_dir() and _is_run_dir(d))
            if not found:
                raise ValueError(f"{p} holds no run directory (no plan.yaml or metrics.jsonl in it or below)")
            out += found
        else:
            out.append(p)
    return out


def _is_run_dir(p: Path) -> bool:
    return (p / "plan.yaml").is_file() or (p / "metrics.jsonl").is_file()


def create_app(run_dirs: list[str | Path]) -> FastAPI:
    """The dashboard over `run_dirs` (ValueError naming a path that is not a directory)."""
    views = run_views(list(run_dirs))
    static_files = {p.name: p for p in STATIC.iterdir() if p.is_file()}
    app = FastAPI(title="miles dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    def view(run_id: str) -> RunView:
        if run_id not in views:
            raise HTTPException(404, f"no run {run_id!r}; runs shown: {', '.join(views)}")
        return views[run_id]

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{name}")
    def static(name: str) -> FileResponse:
        if name not in static_files:  # by name only: no path of the request reaches the filesystem
            raise HTTPException(404, f"no static file {name!r}")
        path = static_files[name]
        return FileResponse(path, media_type=_MEDIA.get(path.suffix, "text/plain"))

    @app.get("/api/runs")
    def runs() -> dict[str, Any]:
        return {"runs": [v.describe() for v in views.values()], "panels": PANELS}

    @app.get("/api/runs/{run_id}/metrics")
    def metrics(run_id: str, version: str | None = None) -> dict[str, Any]:
        return view(run_id).metrics(version)

    @app.get("/api/runs/{run_id}/state")
    def state(run_id: str) -> dict[str, Any]:
        return view(run_id).state()

    @app.get("/api/runs/{run_id}/samples")
    def samples(run_id: str) -> dict[str, Any]:
        return view(run_id).samples()

    @app.get("/api/runs/{run_id}/file")
    def run_file(run_id: str, path: str = Query(...)) -> FileResponse:
        v = view(run_id)
        try:
            target = inside(v.path, path)
        except OutsideRunDir as e:
            raise HTTPException(403, str(e)) from None
        if not target.is_file():
            raise HTTPException(404, f"{path} is not a file of run {run_id}")
        return FileResponse(target, media_type=_MEDIA.get(target.suffix, "text/plain"))

    return app


def serve(
    paths: list[str],
    host: str = "127.0.0.1",
    port: int = 0,
    keys: ApiKeys | None = None,
    allow_unauthenticated: bool = False,
) -> int:
    """Serve the dashboard until interrupted (port 0: one the OS picks, printed). With `keys.api`
    every page needs the key (open `/?key=KEY` once in a browser; miles.serving.RequireApiKey)."""
    import socket

    import uvicorn

    keys = keys or ApiKeys()
    check_bind("miles dashboard", host, keys, allow_unauthenticated)
    app = RequireApiKey(create_app(expand_run_dirs(paths)), keys, browser=True)
    # IPPROTO_TCP named so that asyncio turns Nagle off on accepted connections (no ~40 ms replies)
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections wait in the backlog from now on, before uvicorn starts accepting
    bound = sock.getsockname()[1]
    login = "?key=<the key in your --api-key-file>" if keys.api else ""
    print(f"miles dashboard: http://{host}:{bound}/{login}  (Ctrl-C to stop)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0
