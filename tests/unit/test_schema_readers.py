"""Every field of the schema is read somewhere: a recipe key that nothing reads is silently ignored.

Walks the Plan (recipe keys), the Profile (hardware profiles) and the Sample (rollout data) and looks
for each field name as an attribute read (`.name`, or `getattr(x, "name")`) in the package's code,
with string literals and comments taken out (an error message naming a key does not read it). Plan
keys must be read outside miles/config (validating a key is not using it); Sample fields outside
miles/sample.py. A name shared by two fields counts for both, so this catches fields whose name
appears nowhere in the code, not every unread one.
"""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from miles.config import Plan
from miles.config.profile import Profile
from miles.sample import Sample

PACKAGE = Path(__file__).resolve().parents[2] / "miles"

# Fields read by nothing outside the schema, each on purpose.
ALLOWED_UNREAD = {
    # refused above 1 by miles/config/layout.py for both backends until context parallelism is built
    "plan:train.context_parallel",
    # a hardware fact of a profile, shown by `miles profiles show`; nothing is derived from it yet
    "profile:host_mem_gb",
}


def _sections(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, field name) of every leaf field, through nested sections (also inside dict/list)."""
    for name, field in model.model_fields.items():
        nested = [a for a in (field.annotation, *typing.get_args(field.annotation)) if _is_model(a)]
        if nested:
            yield from _sections(nested[0], f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", name


def _is_model(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _strip(source: str) -> str:
    """Python source without comments and string literals; f-string fields and getattr names kept."""
    kept = [f".{n}" for n in re.findall(r"getattr\(\s*[\w.]+\s*,\s*[\"'](\w+)[\"']", source)]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING:
            if re.match(r"[rbuRBU]*[fF]", tok.string):
                kept.extend(re.findall(r"\{([^{}]*)\}", tok.string))
        elif tok.type != tokenize.COMMENT:
            kept.append(tok.string)
    return " ".join(kept)


@cache
def _code(exclude: str | None = None) -> str:
    """The code of every module of the package except those under `exclude` (a path prefix)."""
    files = sorted(PACKAGE.rglob("*.py"))
    keep = [p for p in files if exclude is None or not str(p.relative_to(PACKAGE)).startswith(exclude)]
    return "\n".join(_strip(p.read_text()) for p in keep)


def _unread(fields: list[tuple[str, str]], code: str, kind: str) -> list[str]:
    return [
        key
        for key, name in fields
        if f"{kind}:{key}" not in ALLOWED_UNREAD and not re.search(rf"\.\s*{name}\b", code)
    ]


def test_every_recipe_key_is_read_outside_the_config_package() -> None:
    unread = _unread(list(_sections(Plan)), _code("config/"), "plan")
    assert not unread, f"recipe keys nothing reads (wire them, remove them, or refuse non-defaults): {unread}"


def test_every_profile_key_is_read() -> None:
    unread = _unread(list(_sections(Profile)), _code(), "profile")
    assert not unread, f"profile keys nothing reads: {unread}"


def test_every_sample_field_is_read() -> None:
    fields = [(f.name, f.name) for f in dataclasses.fields(Sample)]
    unread = _unread(fields, _code("sample.py"), "sample")
    assert not unread, f"Sample fields nothing reads: {unread}"


def test_the_check_finds_an_unread_field() -> None:
    """The search itself: a read in code counts, the same name in a message or comment does not."""
    probe = _strip(
        'x = f"set {plan.train.steps}"  # plan.run.seed\ny = "train.lr"\nz = getattr(t, "grad_clip", 1)\n'
    )
    fields = [("train.steps", "steps"), ("run.seed", "seed"), ("train.lr", "lr"), ("g", "grad_clip")]
    assert _unread(fields, probe, "probe") == ["run.seed", "train.lr"]


@pytest.mark.parametrize("key", sorted(ALLOWED_UNREAD))
def test_allowed_unread_keys_exist(key: str) -> None:
    """An allow-list entry for a field that is gone (or now read) must go too."""
    kind, dotted = key.split(":")
    fields = dict(_sections(Plan if kind == "plan" else Profile))
    assert dotted in fields, f"{key} is not a field any more: remove it from ALLOWED_UNREAD"
    code = _code("config/" if kind == "plan" else None)
    assert not re.search(rf"\.\s*{fields[dotted]}\b", code), (
        f"{key} is read now: remove it from ALLOWED_UNREAD"
    )
