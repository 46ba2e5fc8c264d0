"""Scenarios: a TOML document of [model], [cluster], [parallel] and [run], plus `--set` overrides.

A Scenario holds one typed section per table (schema.py declares every key once, with its type,
default and valid values); loading checks each value where it enters and names the key, the value
and what would be valid.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from simcluster.config.schema import (SCHEMA, SECTIONS, TOP_LEVEL, ClusterSection, FaultsSection, GoodputSection,
                                      ModelSection, ParallelSection, RunSection, ScenarioError, TargetSection,
                                      all_keys, check_value, suggest)
from simcluster.topology import profile
from simcluster.topology.presets import PRESETS, ClusterSpec


LIBRARY = Path(__file__).resolve().parents[2] / "scenarios"  # the scenarios/ folder of the checkout


@dataclass(frozen=True)
class Scenario:
    name: str = "default"
    description: str = ""
    model: ModelSection = field(default_factory=ModelSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    run: RunSection = field(default_factory=RunSection)
    faults: FaultsSection = field(default_factory=FaultsSection)
    goodput: GoodputSection = field(default_factory=GoodputSection)
    target: TargetSection = field(default_factory=TargetSection)
    source: str = "built-in default"
    overrides: tuple[str, ...] = field(default=())
    variants: tuple[tuple[str, "Scenario"], ...] = field(default=())  # from [compare]: (label, scenario)
    notes: tuple[str, ...] = field(default=())  # what the command line did: to the [compare] table, to fit a layout

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def warnings(self) -> list[str]:
        """Settings that do nothing in this layout (each variant's, once each): a line per setting."""
        out: list[str] = []
        for _, v in self.variants or (("", self),):
            for line in v._inert():
                if line not in out:
                    out.append(line)
        return out

    def _inert(self) -> list[str]:
        p, d = self.parallel, ParallelSection()
        out = []
        f, c = self.faults, self.cluster
        if f.degraded_rank is not None and f.degraded_link == "nic" and self.world_size <= c.gpus_per_node:
            out.append("faults.degraded_link = 'nic' does nothing here: every rank is on one node, so no traffic "
                       "crosses a NIC (degrade 'nvlink', or spread the ranks over cluster.nodes)")
        if f.degraded_rank is not None and f.degraded_link == "nvlink" and c.gpus_per_node == 1:
            out.append("faults.degraded_link = 'nvlink' does nothing with cluster.gpus_per_node = 1 (no NVLink peer)")
        if self.run.program != "transformer":
            return out
        if p.sp and p.tp == 1:
            out.append("parallel.sp = true does nothing with parallel.tp = 1 (sequence parallelism splits what "
                       "tensor parallelism replicates)")
        if p.attention != d.attention and p.cp == 1:
            out.append(f"parallel.attention = {p.attention!r} does nothing with parallel.cp = 1 (it is how "
                       f"context parallelism attends across ranks)")
        if p.zero_over != d.zero_over and (p.cp == 1 or p.zero == 0):
            out.append(f"parallel.zero_over = {p.zero_over!r} does nothing with "
                       + ("parallel.cp = 1" if p.cp == 1 else "parallel.zero = 0"))
        if not p.prefetch and p.zero != 3:
            out.append(f"parallel.prefetch = false does nothing with parallel.zero = {p.zero} (only ZeRO-3 "
                       f"gathers weights)")
        if p.schedule != d.schedule and p.pp == 1:
            out.append(f"parallel.schedule = {p.schedule!r} does nothing with parallel.pp = 1")
        if p.moe_dispatcher != d.moe_dispatcher and p.ep == 1:
            out.append(f"parallel.moe_dispatcher = {p.moe_dispatcher!r} does nothing with parallel.ep = 1 (it is how "
                       f"expert parallelism sends tokens to the ranks holding their experts)")
        if p.virtual_stages > 1 and (p.schedule != "interleaved" or p.pp == 1):
            out.append(f"parallel.virtual_stages = {p.virtual_stages} does nothing without the interleaved "
                       f"schedule and parallel.pp > 1")
        return out

    def cluster_spec(self) -> ClusterSpec:
        c = self.cluster
        figures = c.figures
        try:
            shape = {} if c.torus is None else {"torus": c.torus}
            spec = PRESETS[c.preset].with_overrides(nodes=c.nodes, gpus_per_node=c.gpus_per_node, **shape)
            if c.profile:
                measured = profile.load(self._find(c.profile))
                measured.gemm_rate(1, 1, 1, 1, self.model.dtype)  # (a ProfileError now, if it lacks the dtype)
                spec = profile.apply(spec, measured)
            spec = spec.with_overrides(**figures) if figures else spec
        except (TypeError, ValueError) as exc:
            raise ScenarioError(str(exc)) from None
        if spec.world_size != self.world_size:
            p = self.parallel
            raise ScenarioError(
                f"parallel degrees dp={p.dp} x pp={p.pp} x cp={p.cp} x tp={p.tp} = {self.world_size} "
                f"ranks, but the cluster has cluster.nodes={spec.nodes} x cluster.gpus_per_node={spec.gpus_per_node}"
                f" = {spec.world_size} GPUs; they must be equal")
        return spec

    def _find(self, path: str) -> Path:
        """A file the scenario names: beside the scenario file if it is there, else from the working directory."""
        p = Path(path)
        if not p.is_absolute() and self.source != "built-in default":
            beside = Path(self.source).parent / p
            if beside.is_file():
                return beside
        return p

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "description": self.description, "model": self.model.as_dict(),
               "cluster": {k: v for k, v in self.cluster.as_dict().items() if v is not None},
               "parallel": self.parallel.as_dict(), "run": self.run.as_dict()}
        for section in ("faults", "goodput", "target"):  # (only when used: they are off by default)
            values = getattr(self, section)
            if values != type(values)():
                out[section] = values.as_dict()
        return out


def parse_override(text: str) -> tuple[str, Any]:
    """'parallel.tp=4' -> ('parallel.tp', 4). Values are TOML; a bare word is a string."""
    if "=" not in text:
        raise ScenarioError(f"override {text!r} must look like section.key=value, e.g. parallel.tp=4")
    key, raw = (s.strip() for s in text.split("=", 1))
    try:
        value = _shallow(tomllib.loads(f"v = {raw}"), f"--set {key}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError:
        raise _too_deep(f"--set {key}") from None
    return key, value


MAX_DEPTH = 16  # tables and arrays within each other: a scenario needs three


def _too_deep(where: str) -> ScenarioError:
    return ScenarioError(f"{where}: tables or arrays nested more than {MAX_DEPTH} deep; a scenario needs at most 3")


def _shallow(doc: Any, where: str) -> Any:
    """`doc`, if no table or array in it is nested more than MAX_DEPTH deep (iteratively: any depth)."""
    todo = [(doc, 0)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise _too_deep(where)
        if isinstance(value, dict):
            todo += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            todo += [(v, depth + 1) for v in value]
    return doc


def build(doc: dict[str, Any], overrides: Sequence[str] = (), *, source: str = "built-in default") -> Scenario:
    """A checked Scenario from a parsed document and `--set` overrides."""
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    top = {k: key.default for k, key in TOP_LEVEL.items()}

    def put(path: str, value: Any) -> None:
        if path in TOP_LEVEL:
            top[path] = check_value(path, TOP_LEVEL[path], value)
            return
        section, _, name = path.partition(".")
        if section not in SCHEMA or name not in SCHEMA[section]:
            raise ScenarioError(f"unknown key {path!r}{suggest(path)}")
        values[section][name] = check_value(path, SCHEMA[section][name], value)

    compare = doc.pop("compare", None)
    for k, v in doc.items():
        if isinstance(v, dict):
            if k not in SCHEMA:
                raise ScenarioError(f"unknown section [{k}]{suggest(k)}; sections: {', '.join(SCHEMA)}")
            for name, value in v.items():
                put(f"{k}.{name}", value)
        else:
            put(k, v)
    for text in overrides:
        put(*parse_override(text))
    fitted = _fit_layout(values, {parse_override(o)[0] for o in overrides})
    sections = {name: SECTIONS[name](**given) for name, given in values.items()}
    base = Scenario(top["name"], top["description"], **sections, source=source, overrides=tuple(overrides),
                    notes=fitted)
    if compare is None:
        return base
    return _with_variants(base, doc, compare, overrides, source)


_DEGREES = ("dp", "pp", "cp", "tp")


def _fit_layout(values: dict[str, dict[str, Any]], given: set[str]) -> tuple[str, ...]:
    """Where `--set` changes a parallel degree and the cluster no longer holds the layout (and sets no
    cluster size itself), fit one to the other in `values` (each section's keys as given), as `sweep`
    does: dp follows, world / (pp x cp x tp), when the command line leaves dp alone (and it divides);
    with dp set too, a one-node cluster takes the layout's rank count. The notes that say so; none where
    nothing was fitted (a mismatch left is refused with the cluster's figures)."""
    par, clu = values["parallel"], values["cluster"]
    if not any(f"parallel.{d}" in given for d in _DEGREES) or {"cluster.nodes", "cluster.gpus_per_node"} & given:
        return ()
    degrees = {d: par.get(d, SCHEMA["parallel"][d].default) for d in _DEGREES}
    nodes, per_node = (clu.get(k, SCHEMA["cluster"][k].default) for k in ("nodes", "gpus_per_node"))
    gpus, world = nodes * per_node, math.prod(degrees.values())
    rest = world // degrees["dp"]
    if world == gpus:
        return ()
    if "parallel.dp" not in given:
        if gpus % rest:
            return ()
        par["dp"] = gpus // rest
        return (f"parallel.dp = {gpus // rest}: data parallelism fills the cluster's {gpus} GPUs around "
                f"pp x cp x tp = {rest} (set parallel.dp, or the cluster's size, to choose)",)
    if nodes == 1 and clu.get("torus") is None:  # (dp given too: the layout is the user's)
        clu["gpus_per_node"] = world
        return (f"cluster.gpus_per_node = {world}: one node holds the layout's {world} ranks (set "
                f"cluster.gpus_per_node or cluster.nodes to choose)",)
    return ()


def _with_variants(base: Scenario, doc: dict[str, Any], compare: Any, overrides: Sequence[str], source: str) -> Scenario:
    """[compare]: section.key = [values]; several keys are zipped. Each variant is the scenario with
    those values set. A `--set` of a key the comparison varies narrows it to the variants with that
    value; when none has it, the scenario runs once with the given value, without its comparison."""
    if not isinstance(compare, dict) or not compare:
        raise ScenarioError("[compare] must map keys to lists of values, e.g. \"parallel.zero\" = [0, 1, 2, 3]")
    lengths = {len(v) if isinstance(v, list) else -1 for v in compare.values()}
    if -1 in lengths or len(lengths) != 1 or 0 in lengths:
        raise ScenarioError("[compare] values must be non-empty lists of the same length (one per variant)")
    given = dict(parse_override(o) for o in overrides)
    count = lengths.pop()
    varied = [k for k in compare if k in given]
    kept = [i for i in range(count) if all(compare[k][i] == given[k] for k in varied)]
    asked = ", ".join(f"{k}={toml_value(given[k])}" for k in varied)
    if not kept:
        return replace(base, notes=base.notes + (f"--set {asked}: [compare] runs none with that value; running the "
                                                 f"scenario once with it, without its comparison",))
    variants = []
    notes = (f"--set {asked}: the comparison narrowed to the {len(kept)} of its {count} variants with that value"
             if len(kept) > 1 else f"--set {asked}: running the one variant of [compare] with that value",)
    for i in kept:
        picks = {k: v[i] for k, v in compare.items() if k not in given}
        label = ", ".join(f"{k.split('.', 1)[-1]}={toml_value(v[i]).strip(chr(34))}" for k, v in compare.items())
        texts = [f"{k}={toml_value(v)}" for k, v in picks.items()] + list(overrides)
        variants.append((label, build(dict(doc), texts, source=source)))
    if varied and len(variants) == 1:  # (one left: the scenario is that run, with its whole report)
        return replace(variants[0][1], notes=base.notes + notes)
    return replace(base, variants=tuple(variants), notes=base.notes + (notes if varied else ()))


def toml_value(value: Any) -> str:
    """A scalar as TOML writes it (a string quoted and escaped)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def dumps(doc: dict[str, Any]) -> str:
    """A scenario document as a TOML file: the top-level keys, then a table a section (unset keys left
    out, as a scenario file leaves them); `load` reads it back to the same scenario."""
    lines = [f"{k} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict) and v is not None]
    for section, table in doc.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"] + [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def library() -> list[Path]:
    """The scenario files of the library, by name."""
    return sorted(LIBRARY.glob("*.toml")) if LIBRARY.is_dir() else []


def resolve(name_or_path: str) -> Path:
    """A scenario file from a path, or from a library name ("zero_memory")."""
    p = Path(name_or_path)
    shown = name_or_path if len(name_or_path) <= 80 else name_or_path[:60] + f"... ({len(name_or_path)} characters)"
    try:
        if p.is_file():
            return p
        named = LIBRARY / f"{name_or_path}.toml"
        if named.is_file():
            return named
        if p.is_dir():
            raise ScenarioError(f"scenario {shown!r} is a folder; give a scenario file (.toml) or a library name")
        if p.exists():  # a FIFO, a device (/dev/zero), a socket: nothing to read a scenario from
            raise ScenarioError(f"scenario {shown!r} is not a regular file (a pipe or a device); give a scenario "
                                f"file (.toml)")
        if p.is_symlink():
            raise ScenarioError(f"scenario {shown!r} is a link that leads nowhere (a loop, or a missing file)")
    except OSError as exc:  # a name too long, a folder without permission, a loop of links
        raise ScenarioError(f"scenario file {shown!r}: {exc.strerror or exc}") from None
    known = [f.stem for f in library()]
    close = difflib.get_close_matches(name_or_path, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else (f"; library scenarios: {', '.join(known)}" if known else "")
    raise ScenarioError(f"scenario file {shown!r} not found{hint}")


def load(path: str | Path | None, overrides: Sequence[str] = (), *, at_scale: bool = False) -> Scenario:
    """Load a scenario file (None: the built-in default) and apply overrides; with `at_scale`, first the
    file's [at_scale] overrides (a realistic size, usually in meta mode)."""
    if path is None:
        if at_scale:
            raise ScenarioError("--at-scale needs a scenario file with an [at_scale] table")
        return build({}, overrides)
    p = resolve(str(path))
    try:
        doc = _shallow(tomllib.loads(p.read_text()), str(p))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p}: not valid TOML: {exc}") from None
    except RecursionError:  # (tomllib parses nesting by recursion)
        raise _too_deep(str(p)) from None
    except OSError as exc:
        raise ScenarioError(f"{p}: {exc.strerror or exc}") from None
    doc.setdefault("name", p.stem)
    scale = doc.pop("at_scale", {})
    if not isinstance(scale, dict):
        raise ScenarioError(f"{p}: [at_scale] must be a table of overrides")
    if at_scale:
        if not scale:
            raise ScenarioError(f"{p.stem} has no [at_scale] table")
        overrides = [f"{k}={toml_value(v)}" for k, v in flatten(scale)] + list(overrides)
    return build(doc, overrides, source=str(p))


def flatten(table: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in table.items():
        if isinstance(v, dict):
            out += flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out
