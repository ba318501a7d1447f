"""The SGLang server command of rollout nodes, checked flag by flag against the SGLang the containers pin.

The pin is read from the profile's image recipe (containers/Dockerfile.cuda: `ARG SGLANG_VERSION=`;
containers/Dockerfile.rocm: the version in its `lmsysorg/sglang:vX` base image). That version's
`sglang/srt/server_args.py` comes from its wheel (`pip download --no-deps`, once, into pytest's cache
directory, or .cache/ of the repo when the cache plug-in is off) and is read with `ast`, never
imported: the flags are those `ServerArgs.add_cli_args` registers with `parser.add_argument("--...")`
plus, from SGLang 0.5.17 on, one per `A[T, "help" | Arg(...)]` field of the ServerArgs dataclass
(`--field-name`, `Arg(cli_name=..., aliases=[...])`, none for `no_cli=True`); a flag whose type is bool
(or whose action is store_true) takes no value.

Golden files, one per recipe x profile, pin the rendered command (tests/golden/sglang/); regenerate
them after an intended change with `.venv/bin/python tests/unit/test_sglang_command.py` and review the
diff.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "sglang"
SERVER_ARGS = "sglang/srt/server_args.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
OPTIONAL_ROUTES = {"/begin_weight_update", "/end_weight_update"}
"""Routes the rollout client calls that older SGLang lacks; their callers treat a 404 as "not needed"
(miles.weights.transport); SGLang 0.5.17 has no weight-update session routes, 0.5.23 has."""


# ---- the pinned version and its flags ----


def pinned_version(dockerfile: Path) -> str:
    """SGLang version an image recipe installs."""
    text = dockerfile.read_text()
    m = re.search(r"^ARG SGLANG_VERSION=(\S+)", text, re.M) or re.search(
        r"^ARG BASE=lmsysorg/sglang:v([0-9][0-9.]*[0-9])", text, re.M
    )
    assert m, f"{dockerfile}: no `ARG SGLANG_VERSION=` and no lmsysorg/sglang:vX base image"
    return m.group(1)


def _switch(type_node: ast.expr) -> bool:
    """True when an annotation is bool or Optional[bool] (argparse store_true)."""
    src = ast.unparse(type_node).replace(" ", "")
    return src in ("bool", "Optional[bool]", "bool|None", "Union[bool,None]")


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _const(node: ast.expr | None):
    return node.value if isinstance(node, ast.Constant) else None


MANY = "many"
"""A flag taking one or more values (argparse nargs "*" / "+")."""


def _arity(call: ast.Call, switch: bool) -> bool | str:
    """True: a switch; False: one value; MANY: a list of values."""
    return MANY if _const(_kw(call, "nargs")) in ("*", "+") else switch


def _explicit_flags(func: ast.FunctionDef) -> dict[str, bool | str]:
    """`parser.add_argument("--x", ...)` calls in add_cli_args: flag -> True (no value), False (one
    value) or MANY."""
    flags: dict[str, bool | str] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [a.value for a in node.args if isinstance(_const(a), str) and a.value.startswith("--")]
            switch = _const(_kw(node, "action")) in ("store_true", "store_false")
            flags.update(dict.fromkeys(names, _arity(node, switch)))
    return flags


def _field_flags(cls: ast.ClassDef) -> dict[str, bool | str]:
    """Flags derived from `A[T, "help" | Arg(...)]` dataclass fields (SGLang >= 0.5.17)."""
    flags: dict[str, bool | str] = {}
    for node in cls.body:
        ann = getattr(node, "annotation", None)
        if not (isinstance(node, ast.AnnAssign) and isinstance(ann, ast.Subscript)):
            continue
        if ast.unparse(ann.value) not in ("A", "Annotated") or not isinstance(ann.slice, ast.Tuple):
            continue
        type_node, *meta = ann.slice.elts
        arg = next(
            (
                m
                for m in meta
                if isinstance(_const(m), str) or (isinstance(m, ast.Call) and ast.unparse(m.func) == "Arg")
            ),
            None,
        )
        if arg is None or (isinstance(arg, ast.Call) and _const(_kw(arg, "no_cli")) is True):
            continue
        name = "--" + node.target.id.replace("_", "-")
        aliases: list[str] = []
        switch = _switch(type_node)
        if isinstance(arg, ast.Call):
            name = _const(_kw(arg, "cli_name")) or name
            aliases_node = _kw(arg, "aliases")
            if isinstance(aliases_node, ast.List):
                aliases = [_const(a) for a in aliases_node.elts if isinstance(_const(a), str)]
            action = _kw(arg, "action")
            if action is not None:
                switch = _const(action) in ("store_true", "store_false")
            switch = _arity(arg, switch)
        flags.update(dict.fromkeys([name, *aliases], switch))
    return flags


def server_flags(source: str) -> dict[str, bool | str]:
    """Every flag `ServerArgs.add_cli_args` registers in this server_args.py: flag -> takes no value."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    flags = _explicit_flags(func)
    if "add_cli_args_from_dataclass" in ast.unparse(func):
        flags.update(_field_flags(cls))
    return flags


def check_command(argv: list[str], flags: dict[str, bool | str]) -> list[str]:
    """Problems of a `python -m sglang.launch_server ...` argv against a version's flags."""
    assert argv[1:3] == ["-m", "sglang.launch_server"], argv[:3]
    problems, args, i = [], argv[3:], 0
    while i < len(args):
        flag = args[i]
        if not flag.startswith("--"):
            problems.append(f"stray value {flag!r}")
        elif flag not in flags:
            problems.append(f"unknown flag {flag}")
        elif flags[flag] == MANY:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                problems.append(f"{flag} needs a value")
            while i + 1 < len(args) and not args[i + 1].startswith("--"):
                i += 1
        elif flags[flag]:
            pass  # a switch: the next token is the next flag
        elif i + 1 >= len(args) or args[i + 1].startswith("--"):
            problems.append(f"{flag} needs a value")
        else:
            i += 1
        i += 1
    return problems


def _cache_dir(config) -> Path:
    cache = getattr(config, "cache", None)
    return Path(cache.mkdir("sglang-server-args")) if cache else REPO / ".cache" / "sglang-server-args"


def fetch_source(version: str, member: str, cache_dir: Path) -> str:
    """One file (SERVER_ARGS or HTTP_SERVER) of SGLang `version`, from its wheel on PyPI; cached, and
    the test skips (saying why) only when the wheel cannot be downloaded."""
    cached = cache_dir / version / member
    if cached.exists():
        return cached.read_text()
    wheels = cache_dir / f"wheel-{version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"sglang=={version}"]
    proc = subprocess.run([*cmd, "-d", str(wheels), "-q"], capture_output=True, text=True, timeout=600)
    found = sorted(wheels.glob(f"sglang-{version}-*.whl")) if proc.returncode == 0 else []
    if not found:
        pytest.skip(f"could not download the sglang=={version} wheel from PyPI: {proc.stderr.strip()[-300:]}")
    with zipfile.ZipFile(found[0]) as zf:
        for name in (SERVER_ARGS, HTTP_SERVER):
            (cache_dir / version / name).parent.mkdir(parents=True, exist_ok=True)
            (cache_dir / version / name).write_bytes(zf.read(name))
    for w in found:
        w.unlink()
    wheels.rmdir()
    return cached.read_text()


def fetch_server_args(version: str, cache_dir: Path) -> str:
    """server_args.py of SGLang `version`."""
    return fetch_source(version, SERVER_ARGS, cache_dir)


# ---- rendering the commands of every recipe x profile ----


def pairs() -> list[tuple[str, str]]:
    from miles.config.profile import known_profiles

    recipes = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    return [(r, p) for r in recipes for p in known_profiles()]


def render(recipe: str, profile: str, overrides: tuple[str, ...] = ()) -> tuple[list[str] | None, str]:
    """(argv or None, golden text) of the first SGLang server of a rollout node for recipe x profile."""
    from miles.config import ConfigError
    from miles.launch.submit import load_plan
    from miles.rollout.sglang import sglang_port, sglang_server_command

    cwd = os.getcwd()
    os.chdir(REPO)  # relative paths in recipes resolve against the repo root
    try:
        plan, _ = load_plan(str(REPO / "recipes" / f"{recipe}.yaml"), profile, list(overrides))
        argv = sglang_server_command(plan, host="0.0.0.0", port=sglang_port(0, 0))
    except ConfigError as e:
        return None, f"ConfigError: {e}\n".replace(str(REPO), "<repo>")
    finally:
        os.chdir(cwd)
    lines, i = [" ".join(argv[:3])], 3
    while i < len(argv):
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        lines.append(" ".join(argv[i : i + 1 + takes_value]))
        i += 1 + takes_value
    return argv, " \\\n    ".join(lines).replace(str(REPO), "<repo>") + "\n"


def image_recipe(profile: str) -> Path:
    """Dockerfile of the profile's container (the CUDA one where the profile names none)."""
    from miles.config.profile import load_profile

    recipe = load_profile(profile).container.recipe or "containers/Dockerfile.cuda"
    return REPO / recipe


# ---- tests ----


def test_pins_are_read_from_the_image_recipes():
    assert re.fullmatch(r"\d+\.\d+\.\d+", pinned_version(REPO / "containers" / "Dockerfile.cuda"))
    assert re.fullmatch(r"\d+\.\d+\.\d+", pinned_version(REPO / "containers" / "Dockerfile.rocm"))


@pytest.mark.parametrize(("recipe", "profile"), pairs())
def test_rendered_command_matches_golden(recipe, profile):
    _, text = render(recipe, profile)
    path = GOLDEN / f"{recipe}__{profile}.txt"
    assert path.exists(), f"no golden file {path}; run `.venv/bin/python {Path(__file__).relative_to(REPO)}`"
    assert text == path.read_text(), f"{path} differs; regenerate it if the change is intended"


@pytest.mark.parametrize(("recipe", "profile"), pairs())
def test_every_rendered_flag_exists_in_the_pinned_sglang(recipe, profile, request):
    argv, _ = render(recipe, profile)
    if argv is None:
        pytest.skip(f"{recipe} does not resolve on {profile} (the golden file holds the error)")
    version = pinned_version(image_recipe(profile))
    flags = server_flags(fetch_server_args(version, _cache_dir(request.config)))
    assert not check_command(argv, flags), f"sglang=={version}: {check_command(argv, flags)}"


EVERY_OPTION = (
    "engine.kind=sglang",
    "engine.dp_size=2",
    "launch.sglang.context_length=4096",
    "launch.sglang.capture_routed_experts=true",
    "train.true_on_policy=true",
)
"""Overrides that make the command render each optional flag it knows."""


@pytest.mark.parametrize(
    "profile",
    [
        "h200",
        "mi355x",
    ],
)
def test_every_optional_flag_exists_in_the_pinned_sglang(profile, request):
    argv, text = render("default", profile, EVERY_OPTION)
    assert argv is not None, text
    assert {"--enable-dp-attention", "--context-length", "--enable-return-routed-experts"} <= set(argv)
    assert {"--enable-deterministic-inference", "--rl-on-policy-target"} <= set(argv)
    assert argv[argv.index("--rl-on-policy-target") + 1] == "fsdp"
    version = pinned_version(image_recipe(profile))
    flags = server_flags(fetch_server_args(version, _cache_dir(request.config)))
    assert not check_command(argv, flags), f"sglang=={version}: {check_command(argv, flags)}"


def test_every_route_the_client_calls_exists_in_the_pinned_sglang(request):
    """The rollout client (one code path for real SGLang and the embedded engine) calls only routes the
    pinned SGLang's http_server.py serves (or ones whose 404 its callers accept)."""
    client = (REPO / "miles" / "rollout" / "client.py").read_text()
    called = set(re.findall(r'(?:_post|_get|request\("[A-Z]+",)\s*\(?\s*"(/[a-z_/]+)"', client))
    assert {"/generate", "/model_info", "/update_weights_from_distributed"} <= called, called
    version = pinned_version(REPO / "containers" / "Dockerfile.cuda")
    server = fetch_source(version, HTTP_SERVER, _cache_dir(request.config))
    served = set(re.findall(r'@app\.(?:get|post|put|api_route)\(\s*"(/[^"]*)"', server))
    assert not called - served - OPTIONAL_ROUTES, f"sglang=={version} lacks {sorted(called - served)}"


def test_flag_parser_finds_known_flags_and_rejects_made_up_ones(request):
    """The parser is what the check stands on: known flags of the pin, their arity, and a misspelling."""
    version = pinned_version(REPO / "containers" / "Dockerfile.cuda")
    flags = server_flags(fetch_server_args(version, _cache_dir(request.config)))
    assert len(flags) > 200
    assert flags["--tp-size"] is False and flags["--tensor-parallel-size"] is False
    assert flags["--trust-remote-code"] is True and flags["--skip-server-warmup"] is True
    argv = ["python", "-m", "sglang.launch_server", "--tp-size", "2", "--trust-remote-code", "--tp-sise", "2"]
    assert check_command(argv, flags) == ["unknown flag --tp-sise", "stray value '2'"]
    assert check_command(argv[:4], flags) == ["--tp-size needs a value"]
    assert check_command([*argv[:3], "--trust-remote-code", "1"], flags) == ["stray value '1'"]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for old in GOLDEN.glob("*.txt"):
        old.unlink()
    for recipe, profile in pairs():
        out = GOLDEN / f"{recipe}__{profile}.txt"
        out.write_text(render(recipe, profile)[1])
        print(out.relative_to(REPO))
