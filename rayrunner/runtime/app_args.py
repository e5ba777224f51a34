"""An application builder's `args` validated by a pydantic model; invalid ones described in one line that names the
field (`builder_args` for the builders inside Ray, `args_problem` for the check before `serve run`)."""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def args_problem(model: type[BaseModel], args: Any) -> str | None:
    """None when `args` validate as `model`; else the first problem as `.field.path: what is wrong`
    (`: what is wrong` for a check across fields)."""
    try:
        model.model_validate(args)
    except ValidationError as exc:
        return describe(model, args, exc)
    return None


def builder_args(model: type[M], args: Any, what: str) -> M:
    """An application builder's `args` as `model`. Invalid ones raise RayServeException with one line naming the
    field: Serve's build task does not retry that type (it retried any other exception three times, ~25 s on 2
    cores, before DEPLOY_FAILED) and shows its message alone as the app's status message, not a pydantic dump
    inside a traceback."""
    from ray.serve.exceptions import RayServeException

    try:
        return model.model_validate(args)
    except ValidationError as exc:
        raise RayServeException(f"invalid {what}: args{describe(model, args, exc)}") from None


def describe(model: type[BaseModel], args: Any, exc: ValidationError) -> str:
    """One line for a ValidationError of `model` on `args`. An unknown field comes first: a misspelt field is
    often also reported as the required field it was meant to be."""
    errors = exc.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(first["loc"])
    if first["type"] == "extra_forbidden":
        message = "unknown field" + _hint(str(loc[-1]), _field_names(model, loc[:-1]))
    elif first["type"] == "missing":
        message = "required field missing"
    else:
        message = str(first["msg"]).removeprefix("Value error, ")
    return f"{_shown(args, loc)}: {message}"


def _shown(data: Any, loc: tuple[Any, ...]) -> str:
    """`loc` as the user wrote it (`.models[1].spec.engine`): pydantic's union tags, which are not keys of the
    data, are left out."""
    shown = ""
    for key in loc:
        if isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data):
            shown, data = f"{shown}[{key}]", data[key]
        elif isinstance(data, dict) and key in data:
            shown, data = f"{shown}.{key}", data[key]
        elif key == loc[-1]:
            shown = f"{shown}.{key}"  # a required field that is missing
    return shown


def _hint(name: str, fields: list[str]) -> str:
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]}?)"
    return f" (known fields: {', '.join(fields)})" if fields else ""


def _field_names(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the model(s) that `loc` leads to from `root` (every member of a union whose tag the loc
    does not name)."""
    models = [root]
    for key in loc:
        if not isinstance(key, str):
            continue  # a list index or dict key: the annotation already named the item's models
        inner = [m.model_fields[key].annotation for m in models if key in m.model_fields]
        if inner:
            models = [found for annotation in inner for found in _models_in(annotation)]
        else:  # a union's tag, e.g. `plain` of `which`
            models = [m for m in models if key in _tags(m)] or models
    return sorted({name for m in models for name in m.model_fields})


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [found for arg in typing.get_args(annotation) for found in _models_in(arg)]


def _tags(model: type[BaseModel]) -> set[str]:
    """The values of a tagged union member's `type` field (its Literal)."""
    field = model.model_fields.get("type")
    if field is None or typing.get_origin(field.annotation) is not Literal:
        return set()
    return {str(value) for value in typing.get_args(field.annotation)}

