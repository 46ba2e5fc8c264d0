"""Checkpoints that any layout can resume: each rank writes its own shards, a manifest says which
elements of which global tensor each file holds, and a resume re-slices on load
(torch.distributed.checkpoint's idea; the format is ours, documented in docs/checkpoint.md).

A folder holds:
  manifest.json                 written last, under a temporary name and then renamed: the commit
  rank{r:05d}-step{k}.bin       one per rank that holds elements no other rank writes: raw arrays
The manifest (JSON, sorted keys):
  format, version, step         steps completed; the next step to run is `step` (0-based)
  training                      what makes two runs the same training (model, seed, optimizer, numerics):
                                a resume must match it; the layout (parallel.*, micro_batch) may differ
  saved_by                      the mesh and ZeRO stage that wrote it (for people; a resume ignores it)
  states                        state -> dtype: master (fp32), adam_m, adam_v, and in mixed precision the
                                16-bit working copy `working`
  tensors                       name -> global shape
  files                         file -> {bytes, sha256}
  pieces                        [{tensor, file, runs: [start, length, ...], offsets: {state: byte offset}}]
A piece holds the tensor's elements at row-major indices start .. start+length-1 for each run, in that
order; each state's values of them lie contiguously at its offset, little-endian, in the state's dtype.
Every element of every tensor is in exactly one piece: a rank writes only what no lower replica holds
(DDP's replicas, tensors tensor parallelism replicates), as the gradient norm counts them (dp_wrap.py).

Data position and dropout masks are functions of (seed, step) here, so the step restores both.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from simcluster.numerics.tensor import dtype_name, numpy_dtype
from simcluster.scenario import Scenario, ScenarioError

FORMAT, VERSION = "simcluster-checkpoint", 1
MANIFEST = "manifest.json"


class CheckpointError(ScenarioError):
    """A checkpoint that cannot be written or resumed (one line, for the user)."""


@dataclass(frozen=True)
class Checkpointing:
    """What a run does with checkpoints: save after `at` steps into `save`; resume from `resume`."""

    save: str | None = None
    at: int | None = None
    resume: str | None = None


def of(sc: Scenario) -> Checkpointing | None:
    r = sc.run
    if not (r["save_checkpoint"] or r["resume"]):
        if r["save_at_step"] is not None:
            raise CheckpointError("run.save_at_step (--at-step) needs run.save_checkpoint (--save-checkpoint DIR)")
        return None
    return Checkpointing(r["save_checkpoint"], r["steps"] if r["save_at_step"] is None else r["save_at_step"],
                         r["resume"])


def training(sc: Scenario) -> dict[str, Any]:
    """What a resumed run must share with the run that saved (the layout is free)."""
    from simcluster.runner import WEIGHT_DECAY

    model = {f"model.{k}": v for k, v in sc.model.items() if k != "micro_batch"}
    r = sc.run
    decay = WEIGHT_DECAY[sc.model["arch"]] if r["weight_decay"] is None else r["weight_decay"]
    return model | {"run.seed": r["seed"], "run.lr": r["lr"], "run.weight_decay": decay,
                    "run.clip_grad": r["clip_grad"], "run.numerics": r["numerics"]}


def check_scenario(sc: Scenario) -> None:
    """Before any work: what the scenario asks of checkpoints is possible, and a resume's checkpoint
    is whole and belongs to this training. One line otherwise."""
    ck = of(sc)
    if ck is None:
        return
    r = sc.run
    if r["program"] != "gpt":
        raise CheckpointError(f"checkpoints are for run.program = 'gpt' (a training run); this is {r['program']!r}")
    if r["numerics"] == "meta":
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
        if start >= r["steps"]:
            raise CheckpointError(f"checkpoint {ck.resume!r} is after step {start}; run.steps = {r['steps']} "
                                  f"leaves nothing to run (set run.steps above {start})")
    if ck.save:
        if not start <= ck.at <= r["steps"]:
            raise CheckpointError(f"--at-step {ck.at} must be between {start} (where the run starts) and "
                                  f"run.steps = {r['steps']}")
        folder = Path(ck.save)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise CheckpointError(f"--save-checkpoint {ck.save!r}: no permission to write there")
        except FileExistsError:
            raise CheckpointError(f"--save-checkpoint {ck.save!r} is a file; give a folder") from None
        except OSError as exc:
            raise CheckpointError(f"--save-checkpoint {ck.save!r}: {exc.strerror or exc}") from None


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
RANK_FILE = re.compile(r"rank\d{5}-step\d+\.bin")  # what write_rank names a file


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
    _write_atomically(Path(folder) / name, data)
    for p in pieces:
        p["file"] = name
    return {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pieces": pieces}


def _write_atomically(path: Path, data: bytes) -> None:
    """Nothing is overwritten in place: a temporary name, flushed, then renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise CheckpointError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None


def commit(sc: Scenario, written: list[dict[str, Any] | None], mesh: dict[str, int],
           shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """After every rank has written its file: the manifest (the checkpoint exists once it is renamed
    into place). Returns what the report says of it."""
    ck = of(sc)
    assert ck is not None and ck.save
    precision = dtype_name(sc.model["dtype"])
    states = {"master": "fp32", "adam_m": "fp32", "adam_v": "fp32"} | (
        {"working": precision} if precision != "fp32" else {})
    files = {w["file"]: {"bytes": w["bytes"], "sha256": w["sha256"]} for w in written if w}
    manifest = {"format": FORMAT, "version": VERSION, "step": ck.at, "training": training(sc),
                "saved_by": {"mesh": mesh, "zero": sc.parallel["zero"], "scenario": sc.name},
                "states": states, "tensors": {k: list(v) for k, v in shapes.items()}, "files": files,
                "pieces": [p for w in written if w for p in w["pieces"]]}
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    _write_atomically(Path(ck.save) / MANIFEST, text.encode())
    for old in Path(ck.save).glob("rank*-step*.bin"):  # a previous save's files, now unlisted
        if RANK_FILE.fullmatch(old.name) and old.name not in files:
            old.unlink(missing_ok=True)
    return {"saved": ck.save, "step": ck.at, "files": len(files), "bytes": sum(f["bytes"] for f in files.values())}


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
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"--resume {folder!r}: format version {manifest.get('version')!r}; this simcluster "
                              f"reads version {VERSION}")
    return manifest


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


def read(folder: str, names: list[str]) -> tuple[int, dict[str, dict[str, np.ndarray]]]:
    """The step and the full global tensors `names` of every state (state -> name -> array), each element
    from exactly one piece."""
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
    return manifest["step"], {s: {k: v.reshape(shapes[k]) for k, v in d.items()} for s, d in out.items()}
