"""Where a checkpoint folder keeps its saves, as torch.distributed.checkpoint's and Orbax's managers
keep them (the format of one checkpoint is the package's, __init__.py):

  step-00000003/                one checkpoint: its manifest and the rank files (a second save of the same
                                step beside it: step-00000003-2)
  latest                        the name of the newest complete one, switched atomically, last
  .partial-step-00000003/       a save in progress: the ranks write here; renamed into place when complete
  .lock                         held (fcntl) by the run that saves: a second one is refused

A save never touches a complete checkpoint: its files and manifest are written and fsynced under
.partial-*, the folder is renamed into place, `latest` switched, and only then are the oldest
checkpoints beyond run.keep_checkpoints deleted. Killed at any point, the folder still holds the
previous checkpoint whole, and --resume DIR takes the newest complete one (resolve).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from simcluster.config.schema import ScenarioError

MANIFEST, LATEST, LOCK, PARTIAL = "manifest.json", "latest", ".lock", ".partial-step-"
STEP_FOLDER = re.compile(r"step-(\d{8})(?:-(\d+))?")  # what publish names a checkpoint


class CheckpointError(ScenarioError):
    """A checkpoint that cannot be written or resumed (one line, for the user)."""


def _phase(name: str) -> None:
    """A point of a save where a process may be killed (tests/test_checkpoint_safety.py stops one at each)."""


def resolve(folder: str) -> str:
    """The checkpoint --resume DIR names: the one DIR/latest names; where `latest` is missing or names no
    complete checkpoint, DIR's newest complete one; else DIR itself when it holds a manifest (one
    checkpoint's folder, or one saved before step folders)."""
    try:
        return _resolve(folder)
    except OSError as exc:  # (a name the file system refuses: too long, a loop of links)
        raise CheckpointError(f"--resume {folder[:200]!r}: {exc.strerror or exc}") from None


def _resolve(folder: str) -> str:
    d = Path(folder)
    try:
        name = (d / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if STEP_FOLDER.fullmatch(name) and (d / name / MANIFEST).is_file():
        return str(d / name)
    complete = complete_checkpoints(d)
    if complete:
        return str(complete[-1])
    if (d / MANIFEST).is_file():
        return folder
    if not d.is_dir():
        raise CheckpointError(f"--resume {folder!r}: no such folder" if not d.exists() else
                              f"--resume {folder!r} is not a folder; give the checkpoint folder")
    raise CheckpointError(f"--resume {folder!r}: no complete checkpoint there (no {MANIFEST}, no step folder with "
                          f"one: not a checkpoint folder, or no save into it finished)")


def complete_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints in a checkpoint folder, oldest save first (their manifests' sequence)."""
    return [d for _, _, d in _complete(folder)]


def next_sequence(folder: Path) -> int:
    """The `sequence` of the next save into `folder`."""
    return 1 + max((sequence for sequence, _, _ in _complete(folder)), default=0)


def _complete(folder: Path) -> list[tuple[int, str, Path]]:
    found = []
    try:
        entries = sorted(folder.iterdir()) if folder.is_dir() else []
    except OSError:
        entries = []
    for d in entries:
        if STEP_FOLDER.fullmatch(d.name) and (d / MANIFEST).is_file():
            try:
                sequence = json.loads((d / MANIFEST).read_text()).get("sequence", 0)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                continue  # (a damaged one is not complete)
            found.append((sequence if isinstance(sequence, int) else 0, d.name, d))
    return sorted(found)


@contextmanager
def locked(folder: Path, staging: Path) -> Iterator[None]:
    """Around a run that saves into `folder` by way of `staging`: the folder's lock held, so that a second
    save into it at the same time is refused in one line; what an earlier, killed save left behind
    removed; and if this run fails, what it wrote. (A killed process's lock goes with it.)"""
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CheckpointError(f"--save-checkpoint {str(folder)!r}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise CheckpointError(f"--save-checkpoint {str(folder)!r}: another run is saving into this folder"
                                  f"{f' (process {holder})' if holder.isdigit() else ''}; wait for it to finish, "
                                  f"or save into another folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        for stale in folder.glob(PARTIAL + "*"):  # a save that was killed: never complete, never read
            shutil.rmtree(stale, ignore_errors=True)
        try:
            yield
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if created:  # a run refused before it saved anything: no folder of a lock alone left behind
                with contextlib.suppress(OSError):
                    if set(os.listdir(folder)) <= {LOCK}:
                        (folder / LOCK).unlink()
                        folder.rmdir()
            raise
    finally:
        os.close(fd)


def publish(folder: Path, staging: Path, at: int, manifest: bytes, keep: int) -> tuple[str, int]:
    """A save whose rank files are in `staging`, complete: its manifest written, the folder renamed into
    place as step-AT (it exists from then on), `latest` switched to it, and the oldest beyond `keep`
    deleted. Its name, and how many checkpoints the folder keeps."""
    _phase("files")
    write_atomically(staging / MANIFEST, manifest)
    sync_folder(staging)
    _phase("manifest")
    name, n = f"step-{at:08d}", 1
    while (folder / name).exists():
        n += 1
        name = f"step-{at:08d}-{n}"
    try:
        os.rename(staging, folder / name)
        sync_folder(folder)
        _phase("renamed")
        write_atomically(folder / LATEST, (name + "\n").encode())
        sync_folder(folder)
    except OSError as exc:
        raise CheckpointError(f"cannot write {str(folder / name)!r}: {exc.strerror or exc}") from None
    _phase("latest")
    old = [d for d in complete_checkpoints(folder) if d.name != name]
    for d in old[:max(0, len(old) - (keep - 1))]:
        shutil.rmtree(d, ignore_errors=True)
    return name, 1 + min(len(old), keep - 1)


def write_atomically(path: Path, data: bytes) -> None:
    """Nothing is overwritten in place: a temporary name, flushed, then renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # (a full disk: what was written goes, and the space with it)
        raise CheckpointError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None


def sync_folder(folder: Path) -> None:
    """A rename or a new file in `folder` on disk (the folder's own entry fsynced), where the OS allows."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
