"""Writes docs/configuration.md from the config models' own fields: one table per model (field, type, default,
description), walking nested models so each level of `serve_config.yaml` appears once.

`python scripts/config_docs.py` writes the file; `--check` exits 1 with one line when the file is not what the models
say, or when a field has no description. Imports no torch.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rayrunner.models.spec import ModelSpec
from rayrunner.registry.config import RegistryConfig

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configuration.md"
HEAD = """# Configuration

Every field of the router app's `args` in `serve_config.yaml` and of a model's spec: its type, default and meaning,
one table per level. Generated from the pydantic models by `python scripts/config_docs.py` (`--check` tells whether
this file is current): change a field's `description=` in the model, not this file.
"""
# (heading, root model, its path under the router's args, where else it is written)
SECTIONS: tuple[tuple[str, type[BaseModel], str, str], ...] = (
    ("Router args", RegistryConfig, "", ""),
    ("A model's spec", ModelSpec, "models[].spec", "; also the whole `args` of a model's own app"),
)
_BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def render() -> str:
    """The whole file; ValueError naming every field without a description."""
    seen = {root for _, root, _, _ in SECTIONS}
    parts, missing = [HEAD], list[str]()
    for heading, root, path, also in SECTIONS:
        parts.append(f"## {heading}\n")
        for model, at in _walk(root, path, seen):
            parts.append(_table(model, at, also if model is root else "", missing))
    if missing:
        raise ValueError(f"fields without a description: {', '.join(missing)}")
    return "\n".join(parts)


def check(path: Path = OUT) -> str | None:
    """None when `path` is what the models say, else a one-line reason."""
    try:
        wanted = render()
    except ValueError as exc:
        return str(exc)
    if not path.exists() or path.read_text() != wanted:
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        return f"{shown} is stale: run `python scripts/config_docs.py`"
    return None


def _walk(model: type[BaseModel], path: str, seen: set[type[BaseModel]]) -> Iterator[tuple[type[BaseModel], str]]:
    """`model` and, depth first in field order, each nested model not seen before, with the path it is written at."""
    seen.add(model)
    yield model, path
    for name, field in model.model_fields.items():
        for nested, suffix in _nested(field.annotation):
            if nested not in seen:
                yield from _walk(nested, f"{path}.{name}{suffix}".lstrip("."), seen)


def _nested(annotation: Any, suffix: str = "") -> Iterator[tuple[type[BaseModel], str]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, suffix
        return
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is list:
        yield from _nested(args[0], suffix + "[]")
    elif origin is dict:
        yield from _nested(args[1], suffix + ".<key>")
    elif origin is not Literal:
        for arg in args:
            yield from _nested(arg, suffix)


def _table(model: type[BaseModel], path: str, also: str, missing: list[str]) -> str:
    tag = model.model_fields.get("type")
    at = [f"At `{path}`" + (f" with `type: {tag.default}`" if tag is not None else "") + also + "."] if path else []
    doc = model.__dict__.get("__doc__")
    intro = " ".join(at + ([" ".join(inspect.cleandoc(doc).split())] if doc else []))
    lines = [f"### {model.__name__}\n", intro + "\n"]
    lines += ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if not field.description:
            missing.append(f"{model.__name__}.{name}")
        description = " ".join((field.description or "").split())
        lines.append(f"| `{name}` | {_cell(_type(field.annotation))} | {_cell(_default(name, field))} | "
                     f"{_cell(description)} |")
    return "\n".join(lines) + "\n"


def _type(annotation: Any) -> str:
    choices = _choices(annotation)
    return choices[0] if len(choices) == 1 else ", ".join(choices[:-1]) + " or " + choices[-1]


def _choices(annotation: Any) -> list[str]:
    """The alternatives a value may take, each as markdown: a code span, or a link to a nested model's table."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is NoneType:
        return ["`null`"]
    if origin is Annotated:
        return _choices(args[0])
    if origin in (Union, UnionType):
        return [choice for arg in args for choice in _choices(arg)]
    if origin is Literal:
        return [f"`{_yaml(value)}`" for value in args]
    if origin is list:
        return [f"list of {_type(args[0])}"]
    if origin is dict:
        return [f"map of {_type(args[0])} to {_type(args[1])}"]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [f"[{annotation.__name__}](#{annotation.__name__.lower()})"]
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return [f"`{member.value}`" for member in annotation]
    return ["`any`" if annotation is Any else f"`{getattr(annotation, '__name__', annotation)}`"]


def _default(name: str, field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, BaseModel):
        return "`{}`"
    size = next((f" ({value // unit} {unit_name})" for unit_name, unit in _BYTE_UNITS
                 if "bytes" in name and isinstance(value, int) and value >= unit and value % unit == 0), "")
    return f"`{_yaml(value)}`{size}"


def _yaml(value: Any) -> str:
    """A default as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, list | dict):
        return repr(value)
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = parser.parse_args(argv)
    if args.check:
        problem = check()
        if problem:
            print(problem, file=sys.stderr)
            return 1
        return 0
    try:
        OUT.write_text(render())
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
