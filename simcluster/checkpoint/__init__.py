"""Checkpoints that any layout can resume: each rank writes its own shards, a manifest says which
elements of which global tensor each file holds, and a resume re-slices on load
(torch.distributed.checkpoint's idea; the format is ours, documented in docs/checkpoint.md).

A checkpoint folder (--save-checkpoint DIR) holds one folder per complete checkpoint, written aside,
renamed into place and named by DIR/latest (folder.py: killed at any point, DIR still
holds the previous checkpoint whole).

In a checkpoint:
  manifest.json                 written last
  rank{r:05d}-step{k}.bin       one per rank that holds elements no other rank writes: raw arrays
The manifest (JSON, sorted keys):
  format, version, step         steps completed; the next step to run is `step` (0-based)
  training                      what makes two runs the same training (model, seed, optimizer, numerics):
                                a resume must match it; the layout (parallel.*, micro_batch) may differ
  saved_by                      the mesh and ZeRO stage that wrote it (for people; a resume ignores it)
  sequence                      the order of the saves into one folder (1, 2, ...)
  states                        state -> dtype: master (fp32), adam_m, adam_v, and in mixed precision the
                                16-bit working copy `working`
  tensors                       name -> global shape
  files                         file -> {bytes, sha256}
  pieces                        [{tensor, file, runs: [start, length, ...], offsets: {state: byte offset}}]
  router_bias                   (a mixture of experts with DeepSeek-V3's selection bias) each MoE layer's
                                bias, `router_bias.layers.{i}` -> one fp32 number an expert
  checksum                      the sha256 of the manifest without this key (as written: indent 1, sorted)
A piece holds the tensor's elements at row-major indices start .. start+length-1 for each run, in that
order; each state's values of them lie contiguously at its offset, little-endian, in the state's dtype.
Every element of every tensor is in exactly one piece: a rank writes only what no lower replica holds
(DDP's replicas, tensors tensor parallelism replicates), as the gradient norm counts them (dp_wrap.py).
A resume checks the whole manifest (validate) before it reads any data.

Data position and dropout masks are functions of (seed, step) here, so the step restores both.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from simcluster.checkpoint import folder as folders
from simcluster.checkpoint.folder import LATEST, MANIFEST, PARTIAL, CheckpointError, resolve  # noqa: F401
from simcluster.config.scenario import Scenario
from simcluster.model.optimizer import WEIGHT_DECAY
from simcluster.numerics.tensor import dtype_name, numpy_dtype

FORMAT, VERSION = "simcluster-checkpoint", 2  # 2: step folders, `sequence` and `checksum` (1 is still read)


@dataclass(frozen=True)
class Checkpointing:
    """What a run does with checkpoints: save after `at` steps into the folder `save`, keeping the newest
    `keep`; resume from `resume` (one checkpoint's folder: resolve)."""

    save: str | None = None
    at: int | None = None
    resume: str | None = None
    keep: int = 2

    @property
    def staging(self) -> str:
        """Where the ranks write this save while it is in progress."""
        return str(Path(self.save or ".") / f"{PARTIAL}{self.at:08d}")


def of(sc: Scenario) -> Checkpointing | None:
    r = sc.run
    if not (r.save_checkpoint or r.resume):
        if r.save_at_step is not None:
            raise CheckpointError("run.save_at_step (--at-step) needs run.save_checkpoint (--save-checkpoint DIR)")
        return None
    return Checkpointing(r.save_checkpoint, r.steps if r.save_at_step is None else r.save_at_step,
                         folders.resolve(r.resume) if r.resume else None, r.keep_checkpoints)


@contextmanager
def saving(sc: Scenario) -> Iterator[None]:
    """Around a run of `sc` (a no-op for one that does not save): its checkpoint folder locked
    (folder.locked)."""
    ck = of(sc)
    if ck is None or not ck.save:
        yield
        return
    with folders.locked(Path(ck.save), Path(ck.staging)):
        yield


def training(sc: Scenario) -> dict[str, Any]:
    """What a resumed run must share with the run that saved (the layout is free)."""
    model = {f"model.{k}": v for k, v in sc.model.as_dict().items() if k != "micro_batch"}
    r = sc.run
    decay = WEIGHT_DECAY[sc.model.arch] if r.weight_decay is None else r.weight_decay
    return model | {"run.seed": r.seed, "run.lr": r.lr, "run.weight_decay": decay,
                    "run.clip_grad": r.clip_grad, "run.numerics": r.numerics}


def check_scenario(sc: Scenario) -> None:
    """Before any work: what the scenario asks of checkpoints is possible, and a resume's checkpoint
    is whole and belongs to this training. One line otherwise."""
    ck = of(sc)
    if ck is None:
        return
    r = sc.run
    if r.program != "transformer":
        raise CheckpointError(f"checkpoints are for run.program = 'transformer' (a training run); this is {r.program!r}")
    if r.numerics == "meta":
        raise CheckpointError("run.numerics = 'meta' carries no numbers to save or resume; use exact or fast")
    if sc.variants and ck.save:
        raise CheckpointError("--save-checkpoint with a [compare] scenario: each variant would overwrite the "
                              "last; choose one with --set")
    start = 0
    if ck.resume:
        manifest = read_manifest(ck.resume)
        start = manifest["step"]
        want, have = manifest["training"], training(sc)
        differ = [k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
        if differ:
            k = differ[0]
            raise CheckpointError(f"checkpoint {ck.resume!r} was written by another training: {k} = "
                                  f"{want.get(k)!r} there, {have.get(k)!r} here ({len(differ)} keys differ); "
                                  f"a resume may change the layout (parallel.*, model.micro_batch), not the model")
        verify_files(ck.resume)
        if start >= r.steps:
            raise CheckpointError(f"checkpoint {ck.resume!r} is after step {start}; run.steps = {r.steps} "
                                  f"leaves nothing to run (set run.steps above {start})")
    if ck.save:
        if not start <= ck.at <= r.steps:
            raise CheckpointError(f"--at-step {ck.at} must be between {start} (where the run starts) and "
                                  f"run.steps = {r.steps}")
        folder = Path(ck.save)  # (made when the run locks it, and removed again if the run is refused)
        there = next(p for p in (folder, *folder.absolute().parents) if p.exists() or p == Path("/"))
        if not there.is_dir():
            raise CheckpointError(f"--save-checkpoint {ck.save!r}: {str(there)!r} is a file; give a folder")
        if not os.access(there, os.W_OK):
            raise CheckpointError(f"--save-checkpoint {ck.save!r}: no permission to write there")


def start_step(sc: Scenario) -> int:
    ck = of(sc)
    return read_manifest(ck.resume)["step"] if ck is not None and ck.resume else 0


# -- which global elements a rank's flat chunk holds --------------------------------------------------
def element_index(shapes: list[tuple[int, ...]], shard: Any, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """For chunk k of n of the flat buffer of tensors (each first cut by `shard(i, full)`, the layout's
    tensor-parallel piece): each element's row-major index in its global tensor (-1: padding) and
    which tensor (its position in `shapes`)."""
    index, which = [], []
    for i, shape in enumerate(shapes):
        local = np.asarray(shard(i, np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape))).reshape(-1)
        index.append(local)
        which.append(np.full(local.shape, i, np.int32))
    index_all, which_all = np.concatenate(index), np.concatenate(which)
    pad = -len(index_all) % n
    index_all = np.concatenate([index_all, np.full(pad, -1, np.int64)]).reshape(n, -1)[k]
    which_all = np.concatenate([which_all, np.full(pad, -1, np.int32)]).reshape(n, -1)[k]
    return index_all, which_all


def _runs(index: np.ndarray) -> list[int]:
    """[start, length, ...] of the maximal runs of consecutive indices."""
    if not len(index):
        return []
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [len(index)]]))
    return [int(v) for pair in zip(index[starts], lengths) for v in pair]


# -- writing ---------------------------------------------------------------------------------------------
RANK_FILE = re.compile(r"rank\d{5}-step\d+\.bin")  # what write_rank names a file (and all a manifest may name)


def write_rank(folder: str, rank: int, step: int, units: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Write this rank's file: for each unit {names, index, which, mask, states: {state: chunk}}, the
    elements it owns (mask) grouped by tensor. Returns the file's entry and pieces (None: nothing owned)."""
    blobs: list[bytes] = []
    pieces, at = [], 0
    for unit in units:
        keep = unit["mask"] & (unit["index"] >= 0)
        for i, name in enumerate(unit["names"]):
            sel = keep & (unit["which"] == i)
            if not sel.any():
                continue
            offsets = {}
            for state, chunk in unit["states"].items():
                data = np.ascontiguousarray(np.asarray(chunk)[sel]).tobytes()
                offsets[state] = at
                blobs.append(data)
                at += len(data)
            pieces.append({"tensor": name, "runs": _runs(unit["index"][sel]), "offsets": offsets})
    if not pieces:
        return None
    name = f"rank{rank:05d}-step{step}.bin"
    data = b"".join(blobs)
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write {folder!r}: {exc.strerror or exc}") from None
    folders.write_atomically(Path(folder) / name, data)
    folders._phase("rank file")
    for p in pieces:
        p["file"] = name
    return {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pieces": pieces}


def checksum(manifest: dict[str, Any]) -> str:
    """The sha256 of a manifest's text without its checksum (json, indent 1, sorted keys)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, indent=1, sort_keys=True).encode()).hexdigest()


def commit(sc: Scenario, written: list[dict[str, Any] | None], mesh: dict[str, int],
           shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """After every rank has written its file: the manifest, and the checkpoint published in its folder
    (folder.publish). Returns what the report says of it."""
    ck = of(sc)
    assert ck is not None and ck.save
    precision = dtype_name(sc.model.dtype)
    states = {"master": "fp32", "adam_m": "fp32", "adam_v": "fp32"} | (
        {"working": precision} if precision != "fp32" else {})
    files = {w["file"]: {"bytes": w["bytes"], "sha256": w["sha256"]} for w in written if w and w.get("file")}
    bias = {k: v for w in written if w for k, v in w.get("router_bias", {}).items()}
    sequence = folders.next_sequence(Path(ck.save))
    manifest = {"format": FORMAT, "version": VERSION, "step": ck.at, "training": training(sc),
                "saved_by": {"mesh": mesh, "zero": sc.parallel.zero, "scenario": sc.name}, "sequence": sequence,
                "states": states, "tensors": {k: list(v) for k, v in shapes.items()}, "files": files,
                "pieces": [p for w in written if w for p in w.get("pieces", ())]}
    if bias:
        manifest["router_bias"] = bias
    manifest["checksum"] = checksum(manifest)
    text = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    name, kept = folders.publish(Path(ck.save), Path(ck.staging), ck.at, text, ck.keep)
    return {"saved": str(Path(ck.save) / name), "step": ck.at, "files": len(files),
            "bytes": sum(f["bytes"] for f in files.values()), "kept": kept}


# -- reading ---------------------------------------------------------------------------------------------
def read_manifest(folder: str) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"--resume {folder!r}: no {MANIFEST} there (not a checkpoint, or its save did not "
                              f"finish)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"--resume {folder!r}: {MANIFEST} cannot be read ({exc}); the checkpoint is "
                              f"damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"--resume {folder!r}: {MANIFEST} is not a simcluster checkpoint's")
    if manifest.get("version") not in (1, VERSION):
        raise CheckpointError(f"--resume {folder!r}: format version {manifest.get('version')!r}; this simcluster "
                              f"reads versions 1 and {VERSION}")
    validate(manifest, folder)
    return manifest


def validate(manifest: dict[str, Any], folder: str) -> None:
    """The whole manifest, before any data is read: its checksum (version 2), every field's type and
    range, every piece inside its file, every element of every tensor in exactly one piece. A refusal
    names the field."""
    def bad(field: str, what: str) -> CheckpointError:
        return CheckpointError(f"--resume {folder!r}: {MANIFEST}: {field} {what}; the checkpoint is damaged")

    def count(value: Any, field: str, least: int = 0) -> int:
        if type(value) is not int or value < least:
            raise bad(field, f"is {str(value)[:40]!r}, not an integer of at least {least}")
        return value

    if manifest["version"] >= 2 and manifest.get("checksum") != checksum(manifest):
        raise bad("checksum", "does not match the manifest's contents (edited or corrupted)")
    count(manifest.get("step"), "step")
    for key in ("training", "states", "tensors", "files"):
        if not isinstance(manifest.get(key), dict):
            raise bad(key, "is missing or not a table")
    states = manifest["states"]
    for state in ("master", "adam_m", "adam_v"):
        if state not in states:
            raise bad("states", f"lacks {state}")
    for state, dtype in states.items():
        if dtype not in ("fp32", "bf16", "fp16"):
            raise bad(f"states.{state}", f"is {str(dtype)[:20]!r}, not fp32, bf16 or fp16")
    size = {}
    for name, shape in manifest["tensors"].items():
        if not isinstance(shape, list) or not shape:
            raise bad(f"tensors.{name}", "is not a shape")
        size[name] = int(np.prod([count(n, f"tensors.{name}", 1) for n in shape], dtype=np.int64))
    for name, entry in manifest["files"].items():
        if not RANK_FILE.fullmatch(name):
            raise bad(f"files.{name[:40]}", "is not a rank file's name")
        if not isinstance(entry, dict):
            raise bad(f"files.{name}", "is not a table")
        count(entry.get("bytes"), f"files.{name}.bytes")
        if not (isinstance(entry.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            raise bad(f"files.{name}.sha256", "is not a sha256 digest")
    bias = manifest.get("router_bias", {})
    if not isinstance(bias, dict):
        raise bad("router_bias", "is not a table")
    for name, values in bias.items():
        if not re.fullmatch(r"router_bias\.layers\.\d{1,6}", name):
            raise bad(f"router_bias.{name[:40]}", "is not a layer's bias")
        if not isinstance(values, list) or not values or not all(
                type(v) in (int, float) and np.isfinite(v) for v in values):
            raise bad(f"router_bias.{name}", "is not a list of finite numbers")
    pieces = manifest.get("pieces")
    if not isinstance(pieces, list):
        raise bad("pieces", "is missing or not a list")
    starts: dict[str, list[np.ndarray]] = {k: [] for k in size}
    for i, piece in enumerate(pieces):
        field = f"pieces[{i}]"
        if not isinstance(piece, dict):
            raise bad(field, "is not a table")
        tensor, file, runs, offsets = (piece.get(k) for k in ("tensor", "file", "runs", "offsets"))
        if tensor not in size:
            raise bad(f"{field}.tensor", f"names {str(tensor)[:40]!r}, which is not in tensors")
        if file not in manifest["files"]:
            raise bad(f"{field}.file", f"names {str(file)[:40]!r}, which is not in files")
        if not isinstance(runs, list) or len(runs) % 2 or not runs:
            raise bad(f"{field}.runs", "is not a list of (start, length) pairs")
        for j, v in enumerate(runs):
            count(v, f"{field}.runs[{j}]", j % 2)
        pairs = np.asarray(runs, np.int64).reshape(-1, 2)
        if int((pairs[:, 0] + pairs[:, 1]).max()) > size[tensor]:
            raise bad(f"{field}.runs", f"reach past the {size[tensor]} elements of {tensor}")
        if not isinstance(offsets, dict) or set(offsets) != set(states):
            raise bad(f"{field}.offsets", f"has states {sorted(offsets) if isinstance(offsets, dict) else offsets!r}, "
                                          f"not {sorted(states)}")
        n = int(pairs[:, 1].sum())
        for state, at in offsets.items():
            end = count(at, f"{field}.offsets.{state}") + n * numpy_dtype(states[state]).itemsize
            if end > manifest["files"][file]["bytes"]:
                raise bad(f"{field}.offsets.{state}", f"puts {n} values past the end of {file}")
        starts[tensor].append(pairs)
    for name, runs_of in starts.items():
        edges = np.zeros(size[name] + 1, np.int64)
        for pairs in runs_of:
            np.add.at(edges, pairs[:, 0], 1)
            np.add.at(edges, pairs[:, 0] + pairs[:, 1], -1)
        held = np.cumsum(edges[:-1])
        if not (held == 1).all():
            raise bad("pieces", f"hold {int((held == 0).sum())} elements of {name} in no piece and "
                                f"{int((held > 1).sum())} in several")


def _file(folder: str, name: str, entry: dict[str, Any]) -> bytes:
    """A shard file, checked against the manifest's size and checksum."""
    try:
        data = (Path(folder) / name).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"--resume {folder!r}: {name}: {exc.strerror or exc}") from None
    if len(data) != entry["bytes"]:
        raise CheckpointError(f"--resume {folder!r}: {name} has {len(data)} bytes, the manifest says "
                              f"{entry['bytes']}: the file is truncated or was replaced")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"--resume {folder!r}: {name} does not match its checksum in the manifest: the "
                              f"file is corrupted")
    return data


def verify_files(folder: str) -> None:
    manifest = read_manifest(folder)
    for name, entry in sorted(manifest["files"].items()):
        _file(folder, name, entry)


def read(folder: str, names: list[str]) -> tuple[int, dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """The step, the full global tensors `names` of every state (state -> name -> array), each element
    from exactly one piece, and the experts' selection biases by output name (fp32; none: empty)."""
    manifest = read_manifest(folder)
    states, shapes = manifest["states"], manifest["tensors"]
    wanted = set(names)
    out = {s: {k: np.empty(int(np.prod(shapes[k])), numpy_dtype(d)) for k in names} for s, d in states.items()}
    seen = {k: np.zeros(int(np.prod(shapes[k])), np.int8) for k in names}
    cache: dict[str, bytes] = {}
    for piece in manifest["pieces"]:
        k = piece["tensor"]
        if k not in wanted:
            continue
        f = piece["file"]
        if f not in cache:
            cache[f] = _file(folder, f, manifest["files"][f])
        runs = piece["runs"]
        index = np.concatenate([np.arange(s, s + n) for s, n in zip(runs[::2], runs[1::2])])
        seen[k][index] += 1
        for state, dtype in states.items():
            out[state][k][index] = np.frombuffer(cache[f], numpy_dtype(dtype), len(index), piece["offsets"][state])
    for k in names:
        if not (seen[k] == 1).all():
            missing, twice = int((seen[k] == 0).sum()), int((seen[k] > 1).sum())
            raise CheckpointError(f"--resume {folder!r}: tensor {k} has {missing} elements in no piece and {twice} "
                                  f"in several: the manifest is inconsistent")
    biases = {k: np.asarray(v, np.float32) for k, v in manifest.get("router_bias", {}).items()}
    return manifest["step"], {s: {k: v.reshape(shapes[k]) for k, v in d.items()} for s, d in out.items()}, biases
