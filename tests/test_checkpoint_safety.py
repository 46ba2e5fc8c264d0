"""Nothing lost (docs/checkpoint.md): a save killed at any phase, a second save at the same time, a full
disk, or a manifest edited by hand never leaves a folder that resumes wrongly, and every refusal is
one line naming what is wrong."""

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simcluster import checkpoint
from simcluster.checkpoint import CheckpointError, read_manifest, resolve
from simcluster.checkpoint import folder as checkpoint_folder
from simcluster.cli import main
from simcluster.config.scenario import build
from simcluster.run.runner import run_scenario

SMALL = ["model.layers=2", "model.hidden=16", "model.heads=2", "model.ffn_hidden=32", "model.seq=8",
         "model.vocab=16", "model.global_batch=4", "model.tied_head=false", "run.steps=3"]
TP2 = ["parallel.dp=1", "parallel.tp=2", "cluster.gpus_per_node=2"]
ZERO3 = ["parallel.dp=2", "parallel.zero=3", "cluster.gpus_per_node=2"]


def save(folder, layout, at, *extra):
    return run_scenario(build({}, [*SMALL, *layout, f"run.save_checkpoint={str(folder)!r}",
                                   f"run.save_at_step={at}", *extra]))


def resumes_bit_exact(folder, layout=ZERO3):
    """--resume DIR under `layout` to step 4: the steps after the checkpoint equal one device's from the
    start."""
    outcome = run_scenario(build({}, [*SMALL, *layout, "run.steps=4", f"run.resume={str(folder)!r}"]))
    return outcome.report["verification"]["bit_exact"]


def files_of(checkpoint_folder):
    return {p.name: p.read_bytes() for p in sorted(Path(checkpoint_folder).iterdir())}


KILL = """
import os, sys
from simcluster.checkpoint import folder as checkpoint_folder
seen = []
def phase(name):
    seen.append(name)
    if name == sys.argv[1] and seen.count(name) == int(sys.argv[2]):
        os._exit(137)  # as kill -9: no clean-up runs
checkpoint_folder._phase = phase
from simcluster.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("phase,nth", [("rank file", 1), ("rank file", 2), ("files", 1), ("manifest", 1),
                                       ("renamed", 1), ("latest", 1)])
def test_a_save_killed_at_any_phase_leaves_the_previous_checkpoint_whole(tmp_path, phase, nth):
    """Issue 36's reproducer: a tp2 checkpoint after step 1, then a ZeRO-3 save of the same step into the
    same folder killed at `phase`: the first checkpoint's files are untouched, --resume DIR resumes
    bit-exact (the first checkpoint, or the new one once `latest` names it), and the next save clears
    what the killed one left."""
    folder = tmp_path / "ck"
    save(folder, TP2, 1)
    first = Path(resolve(str(folder)))
    before = files_of(first)
    argv = ["run", *[a for s in [*SMALL, *ZERO3] for a in ("--set", s)], "--save-checkpoint", str(folder),
            "--at-step", "1"]
    done = subprocess.run([sys.executable, "-c", KILL, phase, str(nth), *argv], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 137, done.stderr[-2000:]
    assert files_of(first) == before
    now = Path(resolve(str(folder)))
    assert now == first if phase != "latest" else now.name == "step-00000001-2"  # (`latest` switched last)
    assert resumes_bit_exact(folder)
    save(folder, TP2, 2)
    assert not list(folder.glob(".partial-*"))


def test_a_second_save_into_a_folder_being_saved_into_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "ck"
    save(folder, TP2, 1)
    with open(folder / ".lock", "w") as held:  # another run, saving now
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        argv = [a for s in [*SMALL, *ZERO3] for a in ("--set", s)]
        assert main(["run", *argv, "--save-checkpoint", str(folder), "--at-step", "2"]) == 2
        err = capsys.readouterr().err
        assert "another run is saving into this folder (process 4242)" in err and len(err.strip().splitlines()) == 1
        assert resumes_bit_exact(folder)  # reading is not saving: a resume goes on meanwhile
    save(folder, ZERO3, 2)  # the lock released, the next save goes ahead
    assert Path(resolve(str(folder))).name == "step-00000002"


def test_two_saves_at_once_leave_a_complete_checkpoint_and_a_refusal_or_two(tmp_path):
    """Issue 36's second reproducer, as processes: a tp2 save at step 3 and a ZeRO-3 save at step 1 into
    one folder at once. Each either completes or is refused in one line (exit 2); at least one
    completes, and the folder resumes bit-exact."""
    folder = tmp_path / "ck"
    runs = [subprocess.Popen([sys.executable, "-m", "simcluster.cli", "run", *[a for s in [*SMALL, *layout]
                                                                              for a in ("--set", s)],
                              "--save-checkpoint", str(folder), "--at-step", at, "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for layout, at in ((TP2, "3"), (ZERO3, "1"))]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in runs]
    for code, err in results:
        assert code == 0 or (code == 2 and "another run is saving" in err and len(err.strip().splitlines()) == 1), err
    assert any(code == 0 for code, _ in results)
    assert resumes_bit_exact(folder)


def test_a_full_disk_fails_the_save_in_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ck"
    save(folder, TP2, 1)
    before = sorted(p.name for p in folder.iterdir())

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint_folder.os, "fsync", full)
    argv = [a for s in [*SMALL, *ZERO3] for a in ("--set", s)]
    assert main(["run", *argv, "--save-checkpoint", str(folder), "--at-step", "2"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == before  # no .partial-*, no .tmp
    assert resumes_bit_exact(folder)


# -- the manifest, checked whole before any data is read ---------------------------------------------------

def _edit(manifest, path, value):
    *parents, last = path
    node = manifest
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value(node[last]) if callable(value) else value


DELETE = object()
EDITS = [  # (where, the edit, the field the refusal names)
    (("step",), -1, "step"),
    (("step",), "1", "step"),
    (("states", "adam_m"), DELETE, "states lacks adam_m"),
    (("states", "master"), "fp8", "states.master"),
    (("tensors", "layers.0.ln1.g"), [0], "tensors.layers.0.ln1.g"),
    (("training",), [], "training"),
    (("pieces", 0, "tensor"), "nope", "pieces[0].tensor"),
    (("pieces", 0, "file"), "rank00009-step1.bin", "pieces[0].file"),
    (("pieces", 0, "runs"), lambda r: r[:-1], "pieces[0].runs"),
    (("pieces", 0, "runs"), lambda r: [r[0] + 10 ** 9, r[1]] + r[2:], "pieces[0].runs"),
    (("pieces", 0, "offsets", "adam_m"), DELETE, "pieces[0].offsets"),
    (("pieces", 0, "offsets", "adam_m"), lambda o: o + 10 ** 9, "pieces[0].offsets.adam_m"),
    (("pieces", 0, "offsets", "adam_m"), -4, "pieces[0].offsets.adam_m"),
    (("pieces",), lambda p: p + p[:1], "pieces hold 0 elements"),  # a piece twice: elements in several
    (("pieces",), lambda p: p[1:], "pieces hold"),  # a piece gone: elements in none
]


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ck")
    save(folder, ZERO3, 1)
    return Path(resolve(str(folder)))


@pytest.mark.parametrize("where,edit,field", EDITS, ids=[e[2] for e in EDITS])
def test_every_manifest_field_is_checked_and_named(one_checkpoint, tmp_path, where, edit, field):
    """A manifest edited with its checksum made to match (so that only the fields' checks can catch it):
    refused before any data is read, naming the field."""
    manifest = json.loads((one_checkpoint / "manifest.json").read_text())
    _edit(manifest, where, edit)
    manifest["checksum"] = checkpoint.checksum(manifest)
    copy = tmp_path / "step-00000001"
    copy.mkdir()
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    with pytest.raises(CheckpointError) as refused:
        read_manifest(str(copy))
    assert field in str(refused.value) and "\n" not in str(refused.value)


def test_any_flipped_byte_of_the_manifest_is_refused(one_checkpoint, tmp_path):
    """Issue 36 flipped single bytes of manifest.json; one (step 1 -> 0) was accepted. Every 37th byte
    flipped, one at a time: each refused (its checksum, or JSON that no longer parses)."""
    text = (one_checkpoint / "manifest.json").read_bytes()
    copy = tmp_path / "flipped"
    copy.mkdir()
    positions = range(0, len(text), 37)
    for i in positions:
        flipped = bytearray(text)
        flipped[i] ^= 0x01
        (copy / "manifest.json").write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError):
            read_manifest(str(copy))
    assert len(positions) > 20


def test_a_file_name_in_the_manifest_cannot_leave_the_folder(one_checkpoint, tmp_path):
    manifest = json.loads((one_checkpoint / "manifest.json").read_text())
    name = sorted(manifest["files"])[0]
    manifest["files"]["../" + name] = manifest["files"].pop(name)
    manifest["checksum"] = checkpoint.checksum(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"files\.\.\./rank.*is not a rank file's name"):
        read_manifest(str(tmp_path))
    assert os.path.exists(one_checkpoint / name)


def test_a_refused_run_leaves_no_checkpoint_folder_behind(tmp_path):
    """A save refused after its folder was locked (here: an option the layout cannot run with) removes the
    folder it made for the lock."""
    from simcluster.config.scenario import load
    from simcluster.config.schema import ScenarioError
    from simcluster.run.runner import run_scenario

    folder = tmp_path / "ck"
    with pytest.raises(ScenarioError):
        run_scenario(load(None, ["model.arch=llama", "model.moe_experts=4", "parallel.tp=2", "parallel.sp=false",
                                 "cluster.gpus_per_node=2", f"run.save_checkpoint={str(folder)!r}"]))
    assert not folder.exists()
