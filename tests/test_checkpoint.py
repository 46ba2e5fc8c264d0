"""Checkpoint and resume (simcluster/checkpoint.py): the steps after a resume are byte-identical to the
uninterrupted run's, under the layout that saved or any other; a damaged checkpoint is refused."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcluster.checkpoint import CheckpointError, read_manifest, resolve
from simcluster.cli import main
from simcluster.config.scenario import build
from simcluster.run.job import job_of
from simcluster.run.runner import run_scenario

MODEL = ["model.layers=4", "model.hidden=32", "model.heads=4", "model.ffn_hidden=64", "model.seq=16",
         "model.global_batch=8", "model.tied_head=false"]

# One layout per family (and the hybrids the issue names), as --set lists.
LAYOUTS = {
    "one device": ["parallel.dp=1"],
    "ddp dp2": ["parallel.dp=2", "parallel.zero=0"],
    "zero1 dp4": ["parallel.dp=4", "parallel.zero=1"],
    "zero2 dp4 micro": ["parallel.dp=4", "parallel.zero=2", "model.micro_batch=1"],
    "zero3 dp8": ["parallel.dp=8", "parallel.zero=3"],
    "tp2": ["parallel.dp=1", "parallel.tp=2"],
    "tp4 sp": ["parallel.dp=1", "parallel.tp=4", "parallel.sp=true"],
    "pp2 1f1b": ["parallel.dp=1", "parallel.pp=2", "model.micro_batch=2"],
    "pp4 zb-h1": ["parallel.dp=1", "parallel.pp=4", "parallel.schedule=zb-h1", "model.micro_batch=2"],
    "pp2 interleaved": ["parallel.dp=1", "parallel.pp=2", "parallel.schedule=interleaved",
                        "parallel.virtual_stages=2", "model.micro_batch=2"],
    "pp2 dualpipe dp2": ["parallel.dp=2", "parallel.pp=2", "parallel.schedule=dualpipe", "model.micro_batch=1",
                         "parallel.zero=1"],  # two copies of each layer: each element saved once
    "cp2 ulysses": ["parallel.dp=2", "parallel.cp=2"],
    "cp2 ring zero-over-dp": ["parallel.dp=2", "parallel.cp=2", "parallel.attention=ring", "parallel.zero_over=dp"],
    "4d": ["parallel.dp=2", "parallel.pp=2", "parallel.cp=2", "parallel.tp=2", "parallel.zero=1",
           "model.micro_batch=2"],
}


def scenario(layout, *extra, steps=3, model=MODEL):
    world = 1
    for text in LAYOUTS[layout]:
        key, _, value = text.partition("=")
        if key in ("parallel.dp", "parallel.pp", "parallel.cp", "parallel.tp"):
            world *= int(value)
    return build({}, [*model, *LAYOUTS[layout], f"run.steps={steps}", f"cluster.gpus_per_node={world}", *extra])


def outputs(sc):
    outcome = run_scenario(sc)
    return outcome, job_of(sc).outputs(outcome.result.results)


def newest(folder):
    """The checkpoint --resume DIR takes: the folder of the newest complete save into DIR."""
    return Path(resolve(str(folder)))


def same_bytes(a, b):
    return {k for k in a if k in b and np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_is_byte_identical_to_the_uninterrupted_run(layout, tmp_path):
    """Every family: a 3-step run saving after step 1, then a run resumed there; the steps after the
    resume (losses, last gradients, weights, Adam moments) equal the uninterrupted run's, byte for byte."""
    folder = str(tmp_path / "ck")
    whole, full = outputs(scenario(layout, f"run.save_checkpoint={folder!r}", "run.save_at_step=1"))
    assert whole.report["checkpoint"]["step"] == 1
    resumed, rest = outputs(scenario(layout, f"run.resume={folder!r}"))
    assert set(rest) == {k for k in full if not k.startswith("first_grads.") and k != "loss[0]"}
    assert {"loss[1]", "loss[2]"} <= set(rest) and any(k.startswith("adam_v.") for k in rest)
    assert same_bytes(rest, full) == set(rest)
    assert resumed.report["verification"]["bit_exact"] and resumed.report["steps"] == 2


def test_dropout_masks_continue_after_a_resume(tmp_path):
    """The random state: with dropout, the masks of steps after the resume are the uninterrupted run's."""
    folder = str(tmp_path / "ck")
    _, full = outputs(scenario("tp2", "model.dropout=0.1", f"run.save_checkpoint={folder!r}",
                               "run.save_at_step=2"))
    _, rest = outputs(scenario("4d", "model.dropout=0.1", f"run.resume={folder!r}"))
    assert same_bytes(rest, full) == set(rest) and "loss[2]" in rest


PAIRS = sorted(LAYOUTS)


SAVED: dict[str, str] = {}  # a layout's checkpoint after step 1, saved once (a save is a function of its scenario)


@settings(max_examples=max(12, settings.default.max_examples // 2))
@given(st.sampled_from(PAIRS), st.sampled_from(PAIRS))
def test_a_checkpoint_resumes_under_any_other_layout(tmp_path_factory, saved_by, resumed_by):
    """Property: saved under one layout after step 1, resumed under another, the resumed run equals the
    single-device uninterrupted run byte for byte (its verification), which every layout equals. (Half
    the profile's examples, 1 s each here: the issue's named changes are the test below; the thorough
    profile draws 125 of the 196 pairs.)"""
    if saved_by not in SAVED:
        SAVED[saved_by] = str(tmp_path_factory.mktemp("ck"))
        run_scenario(scenario(saved_by, f"run.save_checkpoint={SAVED[saved_by]!r}", steps=1))
    resumed, rest = outputs(scenario(resumed_by, f"run.resume={SAVED[saved_by]!r}", steps=2))
    v = resumed.report["verification"]
    assert v["bit_exact"], (saved_by, resumed_by, v["mismatches"])
    assert "loss[1]" in rest and "loss[0]" not in rest


def test_the_named_layout_changes(tmp_path):
    """The issue's pairs, each once: tp2 -> tp4, ZeRO-3 over dp8 -> DDP over dp2, pp2 -> pp4, 4D -> one device."""
    for a, b in (("tp2", "tp4 sp"), ("zero3 dp8", "ddp dp2"), ("pp2 1f1b", "pp4 zb-h1"), ("4d", "one device")):
        folder = str(tmp_path / f"{a}-{b}".replace(" ", "_"))
        run_scenario(scenario(a, f"run.save_checkpoint={folder!r}", steps=1))
        resumed, _ = outputs(scenario(b, f"run.resume={folder!r}", steps=2))
        assert resumed.report["verification"]["bit_exact"], (a, b)


def test_each_element_is_written_once(tmp_path):
    """Replicas do not write: DDP over dp2 writes one file; ZeRO-3 over dp8, eight; every element of
    every tensor is in one piece (the pieces' lengths add up to the model's parameters)."""
    counts = {}
    for layout in ("ddp dp2", "zero3 dp8", "tp4 sp"):
        folder = tmp_path / layout.replace(" ", "_")
        outcome = run_scenario(scenario(layout, f"run.save_checkpoint={str(folder)!r}", steps=1))
        manifest = read_manifest(str(newest(folder)))
        counts[layout] = len(manifest["files"])
        held = sum(n for p in manifest["pieces"] for n in p["runs"][1::2])
        assert held == outcome.report["parameters"]
        assert sorted(p.name for p in folder.iterdir()) == [".lock", "latest", "step-00000001"]  # nothing temporary
    assert counts == {"ddp dp2": 1, "zero3 dp8": 8, "tp4 sp": 4}


@pytest.fixture
def saved(tmp_path):
    folder = tmp_path / "ck"
    run_scenario(scenario("zero1 dp4", f"run.save_checkpoint={str(folder)!r}", steps=1))
    return folder


def refusal(folder, *extra):
    with pytest.raises(CheckpointError) as exc:
        run_scenario(scenario("tp2", f"run.resume={str(folder)!r}", *extra, steps=2))
    return str(exc.value)


def test_a_truncated_file_is_refused(saved):
    f = sorted(newest(saved).glob("*.bin"))[1]
    f.write_bytes(f.read_bytes()[:-8])
    assert "truncated" in refusal(saved) and f.name in refusal(saved)


def test_a_corrupted_file_is_refused(saved):
    f = sorted(newest(saved).glob("*.bin"))[0]
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(bytes(data))
    assert "checksum" in refusal(saved)


def test_a_damaged_or_missing_manifest_is_refused(saved, tmp_path):
    assert "no such folder" in refusal(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "no complete checkpoint there" in refusal(tmp_path / "empty")
    (newest(saved) / "manifest.json").write_text('{"format": "simcluster-checkpoint", "vers')
    assert "damaged" in refusal(saved)


def test_another_training_is_refused(saved):
    message = refusal(saved, "run.seed=1")
    assert "run.seed = 0 there, 1 here" in message
    with pytest.raises(CheckpointError, match="nothing to run"):
        run_scenario(scenario("tp2", f"run.resume={str(saved)!r}", steps=1))


def test_saving_again_keeps_the_newest_checkpoints(saved):
    """A second save into the same folder is a new step folder beside the first, and `latest` names it;
    with run.keep_checkpoints = 2 a third deletes the oldest (a save of a step already there gets a
    folder of its own); what is not ours is kept, nothing temporary is left, and --resume DIR takes
    the newest."""
    first = newest(saved)
    assert first.name == "step-00000001" and len(list(first.glob("*.bin"))) == 4  # 4 ZeRO-1 ranks
    (saved / "notes.txt").write_text("mine")
    run_scenario(scenario("tp2", f"run.save_checkpoint={str(saved)!r}", steps=2))
    second = newest(saved)
    manifest = read_manifest(str(second))
    assert second.name == "step-00000002" and first.is_dir() and (saved / "latest").read_text() == "step-00000002\n"
    assert manifest["step"] == 2 and manifest["saved_by"]["mesh"]["tp"] == 2 and manifest["sequence"] == 2
    run_scenario(scenario("tp2", f"run.save_checkpoint={str(saved)!r}", "run.save_at_step=1", steps=2))
    assert newest(saved).name == "step-00000001-2" and not first.exists() and second.is_dir()
    assert sorted(p.name for p in saved.iterdir()) == [".lock", "latest", "notes.txt", "step-00000001-2",
                                                       "step-00000002"]
    resumed, _ = outputs(scenario("ddp dp2", f"run.resume={str(saved)!r}", steps=3))
    assert resumed.report["verification"]["bit_exact"] and resumed.report["steps"] == 2


def test_checkpoint_options_that_cannot_work_are_one_line(tmp_path, capsys):
    cases = [
        (["--set", "run.numerics=meta", "--save-checkpoint", str(tmp_path / "a")], "meta"),
        (["--set", "run.program=mlp", "--set", "parallel.tp=1", "--save-checkpoint", str(tmp_path / "a")],
         "run.program"),
        (["--save-checkpoint", str(tmp_path / "b"), "--at-step", "9"], "--at-step 9"),
        (["--at-step", "1"], "needs run.save_checkpoint"),
    ]
    (tmp_path / "file").write_text("x")
    cases.append((["--save-checkpoint", str(tmp_path / "file")], "is a file"))
    for argv, words in cases:
        assert main(["run", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_command_line_saves_and_resumes(tmp_path, capsys):
    folder = str(tmp_path / "ck")
    small = ["--set", "model.layers=2", "--set", "model.hidden=32", "--set", "model.ffn_hidden=64",
             "--set", "model.seq=16", "--set", "parallel.dp=2", "--set", "cluster.gpus_per_node=2"]
    assert main(["run", *small, "--set", "run.steps=2", "--save-checkpoint", folder, "--at-step", "1"]) == 0
    out = capsys.readouterr().out
    assert "saved" in out and "after step 1" in out
    assert json.loads(Path(resolve(folder), "manifest.json").read_text())["step"] == 1
    assert main(["run", *small, "--set", "run.steps=2", "--set", "parallel.zero=0", "--resume", folder,
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checkpoint"]["resumed"] == {"from": str(Path(folder) / "step-00000001"), "step": 1}
    assert report["verification"]["bit_exact"] and report["steps"] == 1
    # under another layout, named by its degrees alone: the one node is fitted to its 2 ranks
    model = small[:8]
    assert main(["run", *model, "--set", "run.steps=2", "--set", "parallel.tp=2", "--set", "parallel.dp=1",
                 "--set", "parallel.zero=0", "--resume", folder, "--json"]) == 0
    done = capsys.readouterr()
    report = json.loads(done.out)
    assert report["world_size"] == 2 and report["verification"]["bit_exact"] and report["steps"] == 1
    assert "cluster.gpus_per_node = 2" in done.err


def test_the_documented_reader_reads_a_checkpoint(tmp_path):
    """docs/checkpoint.md's numpy reader, run as written, gives the run's own final weights."""
    folder = tmp_path / "ck"
    sc = scenario("zero3 dp8", f"run.save_checkpoint={str(folder)!r}", steps=1)
    _, got = outputs(sc)
    text = (Path(__file__).parent.parent / "docs" / "checkpoint.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0].replace("DIR", str(folder))
    space = {}
    exec(code, space)
    assert space["full"].tobytes() == np.asarray(got["params.layers.0.mlp.w_fc"]).tobytes()


def test_fast_mode_resumes_byte_identical_under_the_same_layout(tmp_path):
    """Fast mode (BLAS, float sums in the backend's order) resumes too; under the layout that saved,
    the steps after it are the uninterrupted run's bytes."""
    folder = str(tmp_path / "ck")
    _, full = outputs(scenario("zero1 dp4", "run.numerics=fast", f"run.save_checkpoint={folder!r}",
                               "run.save_at_step=1"))
    resumed, rest = outputs(scenario("zero1 dp4", "run.numerics=fast", f"run.resume={folder!r}"))
    assert same_bytes(rest, full) == set(rest) and "loss[2]" in rest
    assert resumed.report["verification"]["passed"]


def test_llama_with_replicated_key_value_heads_resumes_elsewhere(tmp_path):
    """Llama with grouped-query attention: tp 4 over 2 kv heads holds each kv head on two ranks (one
    writes it); resumed on dp 2 x pp 2 and on cp 2 with ring attention, bit-exact."""
    llama = [*MODEL, "model.arch=llama", "model.kv_heads=2", "model.ffn_hidden=48"]
    folder = str(tmp_path / "ck")
    run_scenario(scenario("tp4 sp", f"run.save_checkpoint={folder!r}", "model.dropout=0.1", steps=1, model=llama))
    held = sum(n for p in read_manifest(resolve(folder))["pieces"] for n in p["runs"][1::2])
    for layout in ("pp2 1f1b", "cp2 ring zero-over-dp"):
        resumed, rest = outputs(scenario(layout, f"run.resume={folder!r}", "model.dropout=0.1", steps=2, model=llama))
        assert resumed.report["verification"]["bit_exact"], (layout, resumed.report["verification"]["mismatches"])
        assert held == resumed.report["parameters"] and "loss[1]" in rest


def test_a_tied_heads_checkpoint_across_stages_resumes_on_any_layout(tmp_path):
    """A GPT whose head is the embedding, over 2 stages: the last stage's copy is not written again (every
    element in one piece), and the checkpoint resumes on one device, under DualPipe and with tp 2, each
    the uninterrupted single-device run byte for byte."""
    from simcluster.config.scenario import load
    from simcluster.run.runner import run_scenario

    base = ["model.arch=gpt", "model.tied_head=true", "run.numerics=exact", "run.steps=2", "model.hidden=16",
            "model.heads=2", "model.ffn_hidden=24", "model.seq=8", "model.vocab=32", "model.global_batch=4",
            "model.layers=4", "model.micro_batch=1", "parallel.dp=1", "cluster.nodes=1"]
    folder = str(tmp_path / "ck")
    run_scenario(load(None, base + ["parallel.pp=2", "cluster.gpus_per_node=2", f"run.save_checkpoint={folder!r}",
                                    "run.save_at_step=1"]))
    pieces = read_manifest(resolve(folder))["pieces"]
    assert sum(sum(p["runs"][1::2]) for p in pieces if p["tensor"] == "wte") == 32 * 16  # (V x h, once)
    for sets in (["parallel.pp=1", "cluster.gpus_per_node=1"],
                 ["parallel.pp=2", "cluster.gpus_per_node=2", "parallel.schedule=dualpipe"],
                 ["parallel.pp=2", "parallel.tp=2", "cluster.gpus_per_node=4", "parallel.zero=1"]):
        v = run_scenario(load(None, base + sets + [f"run.resume={folder!r}"])).report["verification"]
        assert v["bit_exact"] and not v["mismatches"], sets
