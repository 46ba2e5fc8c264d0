"""`simcluster keys [SECTION | KEY]`: every scenario key with its meaning, default and valid values
(the schema in scenario.py is the one source)."""

from __future__ import annotations

import textwrap

from simcluster.config.imports import alias
from simcluster.config.schema import CLUSTER_FIGURES, SCHEMA, TOP_LEVEL, Key, ScenarioError, suggest


def valid(key: Key) -> str:
    """The values a key accepts, in words."""
    if key.choices:
        return ", ".join(str(c) for c in key.choices)
    if key.type is bool:
        return "true or false"
    kind = {int: "an integer", float: "a number", str: "text"}[key.type]
    if key.minimum is not None:
        kind += f" >= {key.minimum:g}"
    return kind


def default(section: str, name: str, key: Key) -> str:
    if key.default is not None:
        return str(key.default).lower() if key.type is bool else repr(key.default) if key.type is str else str(key.default)
    return "the preset's" if section == "cluster" and name in CLUSTER_FIGURES else "unset"


def describe(which: str | None = None, width: int = 100) -> str:
    """The keys by section (every section, the one named, or the one key named): a line with the key,
    its default and valid values, then its meaning, indented."""
    sections: dict[str, dict[str, Key]] = {"": TOP_LEVEL, **SCHEMA}
    heading = []
    section, _, name = (which or "").partition(".")
    ours = which in TOP_LEVEL or (section in SCHEMA and (not name or name in SCHEMA[section]))
    if which is not None and not ours and alias(which):
        spelling, which = alias(which)  # (a Megatron-LM argument or a torchtitan key: the key it sets)
        heading = [f"{spelling} is {which} here (simcluster import reads it)", ""]
    if which is not None:
        section, _, name = which.partition(".")
        if which in TOP_LEVEL:
            sections = {"": {which: TOP_LEVEL[which]}}
        elif section in SCHEMA and not name:
            sections = {section: SCHEMA[section]}
        elif section in SCHEMA and name in SCHEMA[section]:
            sections = {section: {name: SCHEMA[section][name]}}
        else:
            raise ScenarioError(f"no section or key {which!r}{suggest(which)}; sections: {', '.join(SCHEMA)}")
    lines = heading
    for section, keys in sections.items():
        lines.append(f"[{section}]" if section else "top level (name = ..., description = ...)")
        for name, key in keys.items():
            head = f"  {section + '.' if section else ''}{name}  default {default(section, name, key)}; {valid(key)}"
            lines.extend(textwrap.wrap(head, width, subsequent_indent="      "))
            lines.extend(textwrap.wrap(key.help, width, initial_indent="      ", subsequent_indent="      "))
        lines.append("")
    if which is None:
        lines.extend(textwrap.wrap(
            "A scenario file may also have [compare] (keys mapped to lists of values, one run per position: "
            "\"parallel.zero\" = [0, 1, 2, 3]; a --set of a compared key keeps the runs with that value) and "
            "[at_scale] (tables of these keys that --at-scale applies: a realistic size, in meta mode).", width))
    return "\n".join(lines)
