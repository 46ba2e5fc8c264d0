"""The scenario file's JSON Schema (draft 2020-12), made from the typed sections (schema.py): what an
editor's TOML support (Taplo, Even Better TOML) checks and completes as a scenario is written.
`simcluster keys --json-schema` prints it; docs/scenario.schema.json is a copy a test keeps current.

What the schema cannot say, the loader still checks: a degree that does not divide, a key that does
nothing in its layout (a warning), a [compare] list's values."""

from __future__ import annotations

from typing import Any

from simcluster.config.schema import LARGEST_INT, SCHEMA, SECTIONS, TOP_LEVEL, Key

DIALECT = "https://json-schema.org/draft/2020-12/schema"
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def key_schema(key: Key) -> dict[str, Any]:
    """One key: its JSON type, the values it takes, its default (when it has one) and its meaning."""
    out: dict[str, Any] = {"type": JSON_TYPES[key.type], "description": key.help}
    if key.choices is not None:
        out["enum"] = list(key.choices)
    if key.type in (int, float):
        out["minimum"] = key.minimum if key.minimum is not None else -LARGEST_INT
        if key.type is int:
            out["maximum"] = LARGEST_INT
    if key.default is not None:
        out["default"] = key.default
    return out


def _table(keys: dict[str, Key], doc: str) -> dict[str, Any]:
    return {"type": "object", "description": doc, "additionalProperties": False,
            "properties": {name: key_schema(k) for name, k in keys.items()}}


def scenario_schema() -> dict[str, Any]:
    """The whole scenario file: the top-level keys, a table per section, [compare] and [at_scale]."""
    tables = {name: _table(SCHEMA[name], (cls.__doc__ or "").strip()) for name, cls in SECTIONS.items()}
    every_key = [f"{s}.{k}" for s, keys in SCHEMA.items() for k in keys]
    compare = {"type": "object", "description": "one run per position: keys mapped to lists of values of one "
               "length (several keys are zipped)", "minProperties": 1,
               "propertyNames": {"enum": every_key},
               "additionalProperties": {"type": "array", "minItems": 1}}
    at_scale = {"type": "object", "description": "what --at-scale sets: tables of the keys above (a realistic "
                "size, usually in meta mode)", "additionalProperties": False, "properties": tables}
    return {"$schema": DIALECT, "title": "simcluster scenario",
            "description": "A scenario file of simcluster (TOML): `simcluster keys` explains each key.",
            "type": "object", "additionalProperties": False,
            "properties": {**{name: key_schema(k) for name, k in TOP_LEVEL.items()}, **tables,
                           "compare": compare, "at_scale": at_scale}}
