"""What a JSON answer must be, and how rayrunner keeps a small model on its distribution while it writes one.

`json_target(request)` turns a chat request's `response_format`, or its forced tool call, into a `JsonTarget`: the
schema the grammar enforces (constrained.py compiles it), the whitespace allowed between JSON tokens, and a note for
the system message. Under a plain JSON grammar a small model runs away (loops on a key, writes blank-line
separators, or stays inside a string until `max_tokens`), so by default:

- whitespace is compact, JSON as `json.dumps` writes it (`", "`, `": "`, nothing else): what the model read most;
- objects with `properties` and no `additionalProperties` are closed (OpenAI strict mode's rule, xgrammar's
  default); objects without `properties` stay open (closed, they could only be `{}`);
- strings get `maxLength` 256 and arrays `maxItems` 16 where the schema sets no bound of its own;
- free-form objects (`json_object`, `{"type": "object"}`) are bounded: identifier keys, at most 16 of them, values
  bounded as above;
- the schema is stated in the system message (compact, `title`s left out): a `json_schema` format's, or the
  arguments' of a forced call of one function, unless a message already quotes every top-level key (instructor,
  pydantic-ai's prompted output and most hand-written prompts that show an example do).

Each is switchable per request (`structured_output_options`, protocol.StructuredOutputOptions); docs/performance.md
has what each is worth on SmolLM2.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rayrunner.openai.tool_calls import forced_call_schema
from rayrunner.openai.tool_replies import forced_choice
from rayrunner.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, StructuredOutputOptions

# Keys whose value is one subschema, a list of them, or a map of names to them: everything else is data (`enum`,
# `const`, `default`, `required`, ...) and is never rewritten.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that bound a string's length already (or make a length bound pointless).
_SHAPED_STRING = ("maxLength", "enum", "const", "pattern", "format")
_FREE_VALUE = "__rayrunner_json_value"  # the root `$defs` entry free-form objects' values refer to
_FREE_KEY = r"^[A-Za-z_][A-Za-z0-9_]{0,31}$"  # a bounded free-form object's keys: identifiers
_MAX_NOTE_CHARS = 4000  # a larger schema is not stated (it would crowd the prompt)

Node = dict[str, Any]


@dataclass(frozen=True)
class JsonTarget:
    """One request's JSON answer: the schema its grammar enforces, compact or flexible whitespace, the note added
    to the system message (None: nothing), and the request field a schema error is reported on."""

    schema: Node
    compact: bool
    system_note: str | None = None
    param: str = "response_format"


def json_target(request: ChatCompletionRequest) -> JsonTarget | None:
    """The JSON a chat request's answer must be: a forced tool call's, else its response_format's; None for text."""
    options = request.structured_output_options or StructuredOutputOptions()
    compact = options.whitespace == "compact"
    choice = forced_choice(request)
    if choice is not None and request.tools:
        parallel = choice == "required" and request.parallel_tool_calls is not False
        schema = _shaped(forced_call_schema(request.tools, choice, parallel), options)
        return JsonTarget(schema, compact, _call_note(request, choice) if options.state_schema else None, "tools")
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None:
        return JsonTarget(_shaped({"type": "object"}, options), compact)
    schema = fmt.json_schema.schema_
    note = _format_note(schema) if options.state_schema and not _states_schema(request.messages, schema) else None
    return JsonTarget(_shaped(schema, options), compact, note)


# ---------------------------------------------------------------- the schema the grammar enforces


def _shaped(schema: Node, options: StructuredOutputOptions) -> Node:
    """`schema` narrowed as `options` ask: objects closed, strings and arrays bounded, free-form objects bounded.
    Every instance of the result is an instance of `schema`."""
    free = _free_value(options)

    def shape(node: Node, in_all_of: bool) -> Node:
        if options.strict_objects and not in_all_of:
            node = _closed(node)
        node = _bounded(node, options.max_string_length, options.max_array_items)
        return _free_object(node, options) if free is not None and _is_free_object(node) else node

    out = _map_schema(schema, shape)
    if free is None or not _refers(out, f"#/$defs/{_FREE_VALUE}"):
        return out
    return {**out, "$defs": {**out.get("$defs", {}), _FREE_VALUE: _map_schema(free, shape)}}


def _closed(node: Node) -> Node:
    """An object with `properties` and nothing said of other keys allows none. Left alone: objects that say (any
    of the `*Properties` keywords) and those that require a key they do not list (closing would leave no instance).
    `allOf` members are never closed: each would refuse the keys the others add."""
    if "properties" not in node or any(k in node for k in ("additionalProperties", "patternProperties",
                                                             "unevaluatedProperties")):
        return node
    if not set(node.get("required", [])) <= set(node["properties"]):
        return node
    return {**node, "additionalProperties": False}


def _types(node: Node) -> set[str]:
    kind = node.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def _bounded(node: Node, strings: int | None, items: int | None) -> Node:
    types = _types(node)
    if strings and "string" in types and not any(k in node for k in _SHAPED_STRING):
        node = {**node, "maxLength": max(strings, node.get("minLength", 0))}
    if items and "array" in types and "maxItems" not in node:
        node = {**node, "maxItems": max(items, node.get("minItems", 0))}
    return node


def _is_free_object(node: Node) -> bool:
    """`{"type": "object"}` (what `json_object` asks for), perhaps with `additionalProperties: true` or notes."""
    return _types(node) == {"object"} and node.get("additionalProperties", True) is True and set(node) <= {
        "type", "additionalProperties", "title", "description"}


def _free_value(options: StructuredOutputOptions) -> Node | None:
    """Any JSON value, its strings, arrays and objects bounded as `options` say (None for open free-form objects:
    llguidance's own any-value grammar)."""
    if options.free_objects == "open":
        return None
    ref = {"$ref": f"#/$defs/{_FREE_VALUE}"}
    return {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
                      {"type": "array", "items": ref}, {"type": "object"}]}


def _free_object(node: Node, options: StructuredOutputOptions) -> Node:
    out = {**node, "patternProperties": {_FREE_KEY: {"$ref": f"#/$defs/{_FREE_VALUE}"}},
           "additionalProperties": False}
    return {**out, "maxProperties": options.max_array_items} if options.max_array_items else out


def _refers(node: Any, ref: str) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == ref or any(_refers(value, ref) for value in node.values())
    return isinstance(node, list) and any(_refers(value, ref) for value in node)


def _map_schema(node: Any, fn: Callable[[Node, bool], Node], in_all_of: bool = False) -> Any:
    """`fn` applied to every subschema of `node`, innermost first (`in_all_of`: the subschema is an `allOf`
    member). Boolean schemas and data are left as they are."""
    if not isinstance(node, dict):
        return node
    out: Node = {}
    for key, value in node.items():
        if key in _MAP and isinstance(value, dict):
            out[key] = {name: _map_schema(sub, fn) for name, sub in value.items()}
        elif key in _LIST and isinstance(value, list):
            out[key] = [_map_schema(sub, fn, key == "allOf") for sub in value]
        elif key in _ONE:
            out[key] = _map_schema(value, fn)
        else:
            out[key] = value
    return fn(out, in_all_of)


# ---------------------------------------------------------------- the schema stated to the model


def _states_schema(messages: list[ChatMessage], schema: Node) -> bool:
    """Whether a message already shows the schema or an example of it: it quotes every top-level key."""
    keys = [f'"{key}"' for key in schema.get("properties", {})]
    return bool(keys) and any(all(key in message.text() for key in keys) for message in messages)


def _stated(schema: Node) -> str | None:
    """The schema as the system message states it: compact, `title`s left out; None when it is too large."""
    text = json.dumps(_map_schema(schema, lambda node, _: {k: v for k, v in node.items() if k != "title"}),
                      ensure_ascii=False)
    return text if len(text) <= _MAX_NOTE_CHARS else None


def _format_note(schema: Node) -> str | None:
    """What the system message says of a `json_schema` format."""
    text = _stated(schema)
    what = "a JSON object" if "properties" in schema or _types(schema) == {"object"} else "JSON"
    return None if text is None else f"Reply with {what} that matches this JSON Schema:\n{text}"


def _call_note(request: ChatCompletionRequest, choice: Literal["required"] | NamedToolChoice) -> str | None:
    """What the system message says of a forced call of one function (the tools prompt lists them all): its
    arguments' schema, unless a message quotes their keys. None when the call may be to one of several."""
    tools = request.tools or []
    wanted = [tool.function for tool in tools if choice == "required" or tool.function.name == choice.function.name]
    if len(wanted) != 1 or _states_schema(request.messages, wanted[0].parameters):
        return None
    text = _stated(wanted[0].parameters)
    return None if text is None else (f"Call {wanted[0].name}. Its arguments are a JSON object that matches this "
                                      f"JSON Schema:\n{text}")
