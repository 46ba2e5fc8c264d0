"""`simcluster run`: the default scenario, --json, --set, files, and one-line errors."""

import contextlib
import html
import json
import re
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from simcluster.cli import main
from simcluster.config.scenario import all_keys, load


def test_default_run_prints_report_timeline_and_passes(capsys):
    assert main(["run", "--width", "60"]) == 0
    out = capsys.readouterr().out
    assert "PASS: bit-exact" in out
    assert "r0 compute" in out and "r7 comm:dp" in out


def test_json_report_has_the_contract_fields(capsys):
    assert main(["run", "--json", "--set", "run.program=mlp", "--set", "parallel.dp=4", "--set", "parallel.tp=2",
                 "--set", "model.seq=16", "--set", "run.lr=0.05"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["world_size"] == 8 and rep["mesh"] == {"dp": 4, "pp": 1, "cp": 1, "tp": 2}
    assert rep["verification"]["bit_exact"] is True and rep["verification"]["outputs_compared"] == 8
    assert rep["step_time_ns"] > 0 and 0 < rep["mfu"] < 1
    assert {(c["group"], c["collective"]) for c in rep["communication"]} == {("dp", "all_reduce"), ("tp", "all_reduce")}
    assert set(rep["busy_ns"]) == {str(r) for r in range(8)}


def test_default_gpt_report_has_memory_and_zero3_traffic(capsys):
    assert main(["run", "--json", "--set", "run.steps=1"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["scenario"]["run"]["program"] == "transformer" and rep["scenario"]["parallel"]["zero"] == 3
    assert rep["verification"]["bit_exact"] is True
    collectives = {c["collective"] for c in rep["communication"]}
    assert {"all_gather", "reduce_scatter"} <= collectives
    peaks = rep["memory_peak_bytes"]["0"]
    assert {"parameters", "gradients", "optimizer", "activations", "total"} <= set(peaks)


def test_json_is_deterministic(capsys):
    main(["run", "--json", "--set", "run.steps=1"])
    first = capsys.readouterr().out
    main(["run", "--json", "--set", "run.steps=1"])
    assert capsys.readouterr().out == first


def test_scenario_file_and_meta_mode(tmp_path, capsys):
    f = tmp_path / "big.toml"
    f.write_text('description = "meta at scale"\n[model]\nlayers = 4\nhidden = 4096\nheads = 32\nffn_hidden = 16384\n'
                 'seq = 2048\nvocab = 50304\nglobal_batch = 32\n[cluster]\nnodes = 2\n[parallel]\ndp = 16\n'
                 '[run]\nnumerics = "meta"\n')
    assert main(["run", str(f), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["scenario"]["name"] == "big" and rep["world_size"] == 16
    assert rep["verification"]["status"].startswith("not applicable")


@pytest.mark.parametrize("args,message", [
    (["run", "--set", "paralel.tp=2"], "unknown key 'paralel.tp' (did you mean 'parallel.tp'?)"),
    (["run", "--set", "parallel.tp=two"], "parallel.tp must be int, got str 'two'"),
    (["run", "nope.toml"], "scenario file 'nope.toml' not found"),
    (["run", "--set", "parallel.dp=4", "--set", "cluster.nodes=2"], "= 4 ranks, but the cluster has"),
    (["run", "--set", "run.numerics=slow"], "run.numerics = 'slow' is not valid; valid: exact, fast, meta"),
    (["run", "--set", "run.program=mlp", "--set", "parallel.tp=3", "--set", "parallel.dp=1",
      "--set", "cluster.gpus_per_node=3", "--set", "model.ffn_hidden=256"], "tp=3 must divide ffn_hidden=256"),
    (["run", "--set", "parallel.tp=3", "--set", "parallel.dp=1", "--set", "cluster.gpus_per_node=3",
      "--set", "parallel.zero=0"], "tensor-parallel degree 3 must divide heads=4; valid degrees: 1, 2, 4"),
    (["run", "--set", "parallel.cp=3", "--set", "parallel.dp=1", "--set", "parallel.zero=0",
      "--set", "cluster.gpus_per_node=3", "--set", "model.seq=33"], "ulysses degree 3 must divide heads=4; valid degrees: 1, 2, 4"),
    (["run", "--set", "parallel.cp=2", "--set", "parallel.tp=2", "--set", "parallel.dp=2", "--set", "model.heads=2"],
     "ulysses degree 2 must divide heads/tp=1; valid degrees: 1"),
    (["run", "--set", "parallel.tp=2", "--set", "parallel.dp=4", "--set", "parallel.sp=true", "--set", "model.seq=33",
      "--set", "model.heads=2", "--set", "model.ffn_hidden=128"], "sequence parallelism: tp=2 must divide seq=33"),
    (["run", "--set", "parallel.zero_over=dpcp"], "parallel.zero_over = 'dpcp' is not valid; valid: dp_cp, dp"),
    (["run", "--set", "parallel.zero=4"], "parallel.zero = 4 is not valid; valid: 0, 1, 2, 3"),
    (["run", "--set", "parallel.pp=2", "--set", "parallel.dp=4", "--set", "model.tied_head=false",
      "--set", "parallel.schedule=interleaved", "--set", "model.global_batch=12"], "model.micro_batch"),
    (["run", "--set", "parallel.pp=8", "--set", "parallel.dp=1", "--set", "parallel.zero=0",
      "--set", "model.tied_head=false"], "8 pipeline stages for 2 layers"),
    (["run", "--set", "model.global_batch=12"], "model.global_batch=12 must be divisible by parallel.dp=8"),
    (["run", "--set", "model.heads=3"], "heads=3 must divide hidden=64; valid: 1, 2, 4, 8, 16, 32, 64"),
    # not a number, a window that is not one, an output that cannot be written: refused before the run
    (["run", "--set", "cluster.peak_tflops=nan"], "cluster.peak_tflops must be a finite number, got nan"),
    (["run", "--set", "run.lr=inf"], "run.lr must be a finite number, got inf"),
    (["timeline", "--width", "5"], "--width must be between 20 and 10000 columns, got 5"),
    (["timeline", "--start-us", "nan"], "--start-us must be a number of microseconds from 0 to 1e+12, got nan"),
    # found by the fuzzer (benchmarks/fuzz.py): each was a traceback
    (["timeline", "--start-us", "1e308"], "--start-us must be a number of microseconds from 0 to 1e+12"),
    (["run", "x" * 5000], "File name too long"),
    (["run", "--set", "parallel.cp=3", "--set", "model.seq=1000000000000"],  # (listing its divisors took hours)
     "valid degrees: 1, 2, 4, 5, 8, 10, 16, 20, ... (153 more), 50000000000"),
    (["run", "collectives", "--set", "run.numerics=meta", "--set", "parallel.dp=2048", "--set", "parallel.tp=8",
      "--set", "cluster.nodes=2048"], "run.program = 'collectives' on 16,384 ranks would route at least 1.6e+09"),
    (["run", "--set", "run.numerics=meta", "--set", "parallel.dp=1000000000000"],
     "has 1,000,000,000,000 ranks; simcluster simulates at most 262,144"),
    (["timeline", "--start-us", "5", "--end-us", "2"], "--end-us (2) must be after --start-us (5)"),
    (["timeline", "--ranks", "99"], "--ranks 99: ranks are 0 to 7 in this scenario"),
    (["timeline", "--streams", "nope"], "--streams nope: no such stream here; the streams are comm:dp"),
    (["export", "-o", "/"], "-o/--output '/' is a folder; give a file name"),
    (["run", "--svg", "/no-such-folder/x.svg"], "--svg '/no-such-folder/x.svg': the folder '/no-such-folder' does not"),
    (["export", "-o", "x" * 300 + ".json"], "the file name is longer than 255 bytes"),
    (["run", "--set", "parallel.tp=[/x]"], "parallel.tp must be int, got str '[/x]'"),
    (["run", "--set", "cluster.profile=/no-such-profile.toml"], "cannot read the hardware profile"),
    # too big to finish here: refused at once, with a lower bound of the cost (simcluster/run/budget.py)
    (["run", "--set", "run.steps=1000000000000"], "exact mode would need at least 3.5 MB of memory"),
    (["run", "--set", "run.numerics=meta", "--set", "model.layers=1000000000"],
     "meta mode would replay at least 6.0e+10 kernels (3 steps x 1 micro-batches x 1,000,000,000 layers)"),
    (["verify", "--set", "model.hidden=8192", "--set", "model.ffn_hidden=32768", "--set", "model.layers=48",
      "--set", "model.heads=64"], "use run.numerics = meta"),
    (["run", "--set", "run.numerics=fast", "--set", "model.layers=1000000000"], "at least 1.6 PB of memory"),
    (["export", "--format", "hta", "-o", "README.md"], "-o/--output 'README.md' is a file; this format writes a folder"),
    (["timeline", "collectives", "--variant", "2"], "--variant 2: scenario 'collectives' has no [compare] table"),
    (["timeline", "pipeline_schedules", "--variant", "7"], "--variant 7: the variants are 1 to 6: 1 'schedule=gpipe"),
    (["keys", "paralel"], "no section or key 'paralel'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    """(A test of its own also shows Ctrl-C is one line: test_interrupted_is_one_line.) The command's main
    in this process, under a time limit: a size refused up front must not run instead."""
    with within_seconds(300):
        try:
            status = main(args)
        except SystemExit as exc:  # (argparse's usage errors)
            status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    assert message in " ".join(err.split())


@contextlib.contextmanager
def within_seconds(limit: int):
    """SIGALRM after `limit` seconds: a test that would hang fails instead (the main thread only)."""
    def late(signum, frame):
        raise TimeoutError(f"did not finish in {limit} s")

    previous = signal.signal(signal.SIGALRM, late)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


TINY = ["--set", "model.layers=2", "--set", "model.hidden=16", "--set", "model.heads=4", "--set", "model.ffn_hidden=16",
        "--set", "model.seq=8", "--set", "model.vocab=16", "--set", "model.tied_head=false", "--set", "run.steps=2",
        "--set", "model.micro_batch=1"]


@pytest.mark.parametrize("layout", [
    "pp=2 tp=2 dp=2", "pp=2 tp=2 sp=true dp=2", "tp=2 cp=2 dp=2", "pp=2 cp=2 dp=2", "tp=2 pp=2 dp=4 zero=1",
    "tp=2 cp=2 pp=2 dp=2 zero=3", "tp=2 dp=4 zero=3", "pp=2 dp=4 zero=2", "cp=2 dp=4 zero=1 attention=ring",
])
def test_the_hybrids_verify_from_the_command_line(layout, capsys):
    """Every combination a user tried and was refused before: pp+tp, pp+tp+sp, tp+cp, pp+cp, 3D, 4D, ZeRO with
    tp, pp or cp."""
    sets = [f"parallel.{kv}" for kv in layout.split()]
    degrees = {k: int(v) for k, v in (kv.split("=") for kv in layout.split()) if k in ("dp", "pp", "cp", "tp")}
    world = degrees["dp"] * degrees.get("pp", 1) * degrees.get("cp", 1) * degrees.get("tp", 1)
    args = ["verify", *TINY, "--set", f"cluster.nodes={max(1, world // 8)}", "--set",
            f"cluster.gpus_per_node={min(world, 8)}", "--set", f"model.global_batch={2 * degrees['dp']}"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert "bit-exact" in capsys.readouterr().out


def test_interrupted_is_one_line(monkeypatch, capsys):
    """Ctrl-C anywhere in a command: 'interrupted' and exit 130, not a traceback."""
    import simcluster.cli as cli

    def pressed(*_args, **_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("simcluster.cli.run.simulated", pressed)
    assert cli.main(["run"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_names_and_descriptions_are_printed_verbatim_not_as_markup(tmp_path, monkeypatch, capsys):
    """Rich markup in a scenario's name, description or compared values is the user's text: printed as
    written (it used to raise MarkupError: a closing tag that matches nothing)."""
    f = tmp_path / "odd.toml"
    f.write_text('name = "x[/bold]y [red]z"\ndescription = "shows [/x] and [b]bold[/b]"\n'
                 '[model]\nlayers = 1\n[run]\nnumerics = "meta"\n[compare]\n"parallel.zero" = [0, 1]\n')
    assert main(["run", str(f), "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "scenario 'x[/bold]y [red]z': 2 variants" in out
    monkeypatch.setattr("simcluster.cli.library.library", lambda: [f])
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "shows [/x] and [b]bold[/b]" in out
    f.write_text('name = "x[/bold]y"\n[model]\nlayers = 1\n[run]\nnumerics = "meta"\n')
    assert main(["run", str(f), "--width", "80"]) == 0
    assert "scenario 'x[/bold]y': gpt" in capsys.readouterr().out


@pytest.mark.parametrize("setting,layout,message", [
    ("parallel.sp=true", ["parallel.tp=2", "parallel.dp=4"], "parallel.sp = true does nothing with parallel.tp = 1"),
    ("parallel.attention=ring", ["parallel.cp=2", "parallel.dp=4"],
     "parallel.attention = 'ring' does nothing with parallel.cp = 1"),
    ("parallel.prefetch=false", ["parallel.zero=3"], "parallel.prefetch = false does nothing with parallel.zero = 1"),
    ("parallel.schedule=gpipe", ["parallel.pp=2", "parallel.dp=4", "model.tied_head=false"],
     "parallel.schedule = 'gpipe' does nothing with parallel.pp = 1"),
    ("parallel.moe_dispatcher=allgather", ["model.moe_experts=4", "parallel.ep=2"],
     "parallel.moe_dispatcher = 'allgather' does nothing with parallel.ep = 1"),
])
def test_a_setting_that_does_nothing_is_warned_about(setting, layout, message, capsys):
    """Warned on stderr (the run goes on); not where the layout uses it."""
    base = ["run.numerics=meta", "parallel.zero=1"]
    assert main(["run", "--json"] + [a for s in base + [setting] for a in ("--set", s)]) == 0
    err = capsys.readouterr().err
    assert f"warning: {message}" in err and err.count("warning:") == 1
    assert main(["run", "--json"] + [a for s in base + [setting] + layout for a in ("--set", s)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_set_of_a_compared_key_narrows_the_comparison_to_that_value(capsys):
    """pipeline_schedules compares six schedules, five of them with virtual_stages = 1."""
    sc = load("pipeline_schedules", ["parallel.virtual_stages=1"])
    assert [v.parallel.schedule for _, v in sc.variants] == ["gpipe", "1f1b", "zb-h1", "zb-v", "dualpipe"]
    assert "5 of its 6 variants" in sc.notes[0]
    one = load("zero_memory", ["parallel.zero=2"])  # one run left: the scenario is that run
    assert not one.variants and one.parallel.zero == 2 and "one variant" in one.notes[0]
    none = load("pipeline_schedules", ["parallel.virtual_stages=3"])  # no run has it: once, without [compare]
    assert not none.variants and none.parallel.virtual_stages == 3 and "runs none" in none.notes[0]
    assert main(["verify", "pipeline_schedules", "--set", "parallel.schedule=1f1b"]) == 0  # (was an unrelated error)
    captured = capsys.readouterr()
    assert "bit-exact" in captured.out and "note: --set parallel.schedule=\"1f1b\"" in captured.err


def test_timeline_and_export_say_which_variant_they_draw(capsys, tmp_path):
    assert main(["timeline", "pipeline_schedules", "--passes", "--variant", "dualpipe", "--width", "60"]) == 0
    captured = capsys.readouterr()
    assert "variant 6 of 6: schedule=dualpipe" in captured.err and "stage 3" in captured.out
    assert main(["export", "tp_cliff", "-o", str(tmp_path / "t.json")]) == 0
    assert "variant 1 of 3: tp=4, gpus_per_node=4, nodes=1 (--variant N picks another)" in capsys.readouterr().err


def test_keys_prints_every_key_with_its_default_and_valid_values(capsys):
    assert main(["keys"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {k}  default " in out for k in all_keys() if "." in k)
    assert main(["keys", "parallel.zero"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("[parallel] parallel.zero default 3; 0, 1, 2, 3 0: DDP; 1, 2, 3: ZeRO stages")


def test_the_pipeline_picture_draws_one_rank_per_stage_and_names_other_replicas_by_rank():
    """dp=2 x pp=4: ranks 0-3 are replica 0's stages 0-3, ranks 4-7 replica 1's (pp inside dp)."""
    from simcluster.cli.timeline import stage_rows
    from simcluster.program.mesh import DeviceMesh

    mesh = DeviceMesh(dp=2, pp=4)
    assert stage_rows(mesh, None) == ([0, 1, 2, 3], {r: f"stage {r}" for r in range(4)})
    assert stage_rows(mesh, [0, 5]) == ([0, 5], {0: "rank 0 (stage 0)", 5: "rank 5 (stage 1)"})


def _special_files(tmp_path):
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    (tmp_path / "deep.toml").write_text("description = " + "[" * 1000 + "]" * 1000 + "\n")
    (tmp_path / "deep_scale.toml").write_text('description = "x"\n[at_scale]\nmodel = ' + "{a = " * 400 + "1" +
                                              "}" * 400 + "\n")


@pytest.mark.parametrize("args,message", [
    (["run", "--set", "run.lr=1" + "0" * 400], "run.lr = 100000000000... (401 digits) is too large for a float"),
    (["run", "--set", "run.numerics=meta", "--set", "model.hidden=1099511627776"], "beyond what the emulator counts"),
    (["run", "TMP/deep.toml"], "nested more than 16 deep"),
    (["run", "TMP/deep_scale.toml", "--at-scale"], "nested more than 16 deep"),
    (["run", "--set", "model.hidden=" + "[" * 2000 + "]" * 2000], "nested more than 16 deep"),
    (["run", "TMP/folder"], "is a folder; give a scenario file"),
    (["run", "TMP/fifo"], "is not a regular file (a pipe or a device)"),
    (["run", "/dev/zero"], "is not a regular file (a pipe or a device)"),
    (["run", "TMP/loop_a"], "is a link that leads nowhere"),
    (["run", "--svg", "/dev/full"], "--svg /dev/full: No space left on device"),
    (["sweep", "--key", "parallel.dp", "--values", "1", "--svg", "/dev/full"], "--svg /dev/full: No space left"),
    # found by `benchmarks/fuzz.py --cases 10000` (session 27): an integer of 417 digits (it hung listing its
    # divisors), times past the int64 clock, an empty rank list, a folder name past the file system's limit
    (["run", "--set", "model.ffn_hidden=1" + "0" * 416], "model.ffn_hidden = 100000000000... (417 digits) is too "
                                                         "large: integers here are at most 2^53"),
    (["run", "--set", "run.numerics=meta", "--set", "faults.watchdog_s=1e+308"], "faults.watchdog_s = 1e+308 is "
                                                                                "past the emulator's clock"),
    (["run", "--set", "run.numerics=meta", "--set", "faults.straggler_rank=0", "--set",
      "faults.straggler_factor=1e308"], "faults.straggler_factor = 1e+308: at most 1e+06"),
    (["timeline", "collectives", "--ranks", "0,1", "--ranks", ""], "--ranks wants at least one integer"),
    (["run", "--set", "run.numerics=meta", "--set", "run.resume=" + "a" * 300], "File name too long"),
])
def test_inputs_that_gave_tracebacks_are_one_line(tmp_path, capsys, args, message):
    """Issue 36's reproducers (a number too large for a float or for the emulator's counters, nesting
    deeper than Python's recursion, special files as scenarios, output on a full device): each one
    line, exit 2, and nothing runs away (a FIFO is not opened, /dev/zero not read)."""
    if not Path("/dev/full").exists() and "/dev/full" in args:
        pytest.skip("this OS has no /dev/full")
    _special_files(tmp_path)
    assert main([a.replace("TMP", str(tmp_path)) for a in args]) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_divisors_an_error_lists_stop_at_2_20_for_a_number_past_2_40():
    """(A size past 2^53 is refused where it enters; the listing is bounded all the same: a loop to the
    square root of a 400-digit number never ends.)"""
    from simcluster.numerics.divisors import divisors

    assert divisors(2**40) == [2**i for i in range(41)]  # every divisor, to 2^40
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    huge = divisors(10**416)
    assert huge[:6] == [1, 2, 4, 5, 8, 10] and max(huge) == 2**20 and all(10**416 % d == 0 for d in huge)


def test_version_is_the_packages(capsys):
    import tomllib
    from pathlib import Path

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out.strip() == f"simcluster {project['version']}"


def _complete(script, line):
    """What bash completes for `line` with `script` loaded (COMPREPLY, sorted)."""
    words = line.split(" ")
    code = (f"source {script}; COMP_WORDS=({' '.join(words)}); COMP_CWORD={len(words) - 1}; "
            f"COMP_LINE='{line}'; COMP_POINT={len(line)}; _shtab_simcluster; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
    done = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=60)
    return sorted(w for w in done.stdout.split() if w)


def test_the_bash_completion_completes_commands_options_and_choices(tmp_path, capsys):
    """The script is made from the parsers (shtab): a command, an option added this round, a choice."""
    assert main(["completion", "bash"]) == 0
    script = tmp_path / "simcluster.bash"
    script.write_text(capsys.readouterr().out)
    assert _complete(script, "simcluster ru") == ["run"]
    assert _complete(script, "simcluster run --summ") == ["--summary"]
    assert _complete(script, "simcluster completion z") == ["zsh"]
    assert _complete(script, "simcluster timeline --pass") == ["--passes"]
    assert main(["completion", "zsh"]) == 0 and "#compdef simcluster" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["run", "--set", "parallel.tp=3"], ["plan", "--set", "model.layer=2"],
                                  ["sweep", "--key", "parallel.tpp", "--values", "1,2"]])
def test_json_errors_are_json_on_stdout(args, capsys):
    """With --json a mistake is still a document on stdout (`| jq` reads it), and one line on stderr."""
    assert main([*args, "--json"]) == 2
    out = capsys.readouterr()
    error = json.loads(out.out)
    assert error["exit_status"] == 2 and error["error"] and out.err.startswith("error: ")


def test_summary_is_the_first_table_and_the_verdict(capsys):
    assert main(["run", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "verdict" in out and "PASS" in out
    assert "timeline" not in out and "busy time per stream" not in out and "memory over time" not in out
    assert len(out.splitlines()) <= 30


@pytest.mark.parametrize("command", [["run", "--summary"], ["timeline", "collectives"]])
def test_the_terminal_svgs_need_nothing_from_outside(command, tmp_path, capsys):
    """No web font to fetch (an offline renderer put the labels elsewhere): every reference is inside
    the file, and each character of a run of text stands at its own column."""
    path = tmp_path / "out.svg"
    assert main([*command, "--svg", str(path)]) == 0
    svg = path.read_text()
    assert "@font-face" not in svg and "Fira Code" not in svg
    assert all(ref.startswith("#") for ref in re.findall(r"url\(([^)]*)\)", svg))
    texts = re.findall(r"<text [^>]*>", svg)
    assert texts and all('lengthAdjust="spacingAndGlyphs"' in t for t in texts if "textLength" in t)
    runs = re.findall(r"<text [^>]*>([^<]*)</text>", svg)  # (each character of a run at its own column)
    assert all(re.search(r'x="[\d.]+ [\d.]+', t) for t, run in zip(texts, runs)
               if len(html.unescape(run)) > 1 and "-title" not in t)


def ink_spans(svg, line_words):
    """The timeline's axis line rendered offline (cairosvg, the reader's own monospace font): for each
    word on it, whether ink lies where its columns are, and none in the blanks between the words."""
    import html
    import io

    try:  # (the test extra installs it; it draws through the system's cairo library)
        import cairosvg
        from PIL import Image
    except (ImportError, OSError) as exc:
        pytest.skip(f"cairosvg cannot draw on this machine: {exc}")

    axis = next(m for m in re.finditer(r'<text [^>]*?x="([\d. ]+)"[^>]*? y="([\d.]+)"[^>]*>([^<]*)</text>', svg)
                if all(w in html.unescape(m.group(3)).split() for w in line_words))
    xs, y, text = [float(v) for v in axis.group(1).split()], float(axis.group(2)), html.unescape(axis.group(3))
    cell = 12.2  # (rich's: 20 px x 0.61)
    at = xs if len(xs) == len(text) else [xs[0] + i * cell for i in range(len(text))]  # (a run's own start)
    ox, oy = map(float, re.search(r'<g transform="translate\(([\d.]+), ([\d.]+)\)" clip-path', svg).groups())
    image = Image.open(io.BytesIO(cairosvg.svg2png(bytestring=svg.encode()))).convert("L")
    ink = set()
    for dy in range(2, 12):  # (the glyphs' bodies, above the baseline)
        row = [image.getpixel((x, int(oy + y - dy))) for x in range(image.width)]
        background = max(set(row), key=row.count)
        ink |= {x - ox for x, v in enumerate(row) if abs(v - background) > 60}
    words, blanks, i = [], [], 0
    for m in re.finditer(r"\S+", text):
        words.append((at[m.start()], at[m.end() - 1] + cell))
        if m.start() > i + 1:  # the blank before the word, less half a column each side
            blanks.append((at[i] + cell / 2, at[m.start()] - cell / 2))
        i = m.end()
    inked = [any(a <= x < b for x in ink) for a, b in words]
    clear = [not any(a <= x < b for x in ink) for a, b in blanks[1:]]  # (the indent before the first: the lane labels')
    return inked, clear


def test_an_svg_renders_offline_with_its_labels_in_their_columns(tmp_path):
    """The timeline SVG drawn by cairosvg without a network: every label of the time axis has ink in its
    own columns and none spills into the blanks between them. (Each run stretched to its width by
    textLength alone put the last label 13 px, a column, left of its place, into the blank.)"""
    from simcluster.cli import common

    path = tmp_path / "t.svg"
    assert main(["timeline", "--width", "80", "--svg", str(path)]) == 0
    svg = path.read_text()
    inked, clear = ink_spans(svg, ["ns"])
    assert len(inked) == 6 and all(inked) and all(clear)
    stretched = svg  # the same picture, each run placed by its start and stretched (the old drawing)
    for m in re.finditer(r' x="([\d.]+(?: [\d.]+)+)"', svg):
        first, *rest = m.group(1).split()
        width = 12.2 * (len(rest) + 1)
        stretched = stretched.replace(m.group(0), f' x="{first}" lengthAdjust="spacingAndGlyphs" textLength="{width:g}"', 1)
    inked, clear = ink_spans(stretched, ["ns"])
    assert not (all(inked) and all(clear))
    assert common._RUN.pattern  # (the rewrite under test: cli/common.py)


def test_an_svgs_title_says_which_run_it_is(tmp_path, capsys):
    """The scenario, --at-scale, the variant and every --set (the titles had the scenario's name alone)."""
    path = tmp_path / "p.svg"
    assert main(["timeline", "pipeline_schedules", "--passes", "--variant", "2", "--set", "model.layers=8",
                 "--svg", str(path)]) == 0
    assert "pipeline_schedules --variant 2 --set model.layers=8" in path.read_text()
    assert main(["sweep", "collectives", "--key", "parallel.tp", "--values", "1,2", "--set", "run.seed=3",
                 "--svg", str(path)]) == 0
    assert "sweep of parallel.tp: collectives --set run.seed=3" in path.read_text()


@pytest.mark.parametrize("scenario", [None, "llama3_4d"])
def test_the_figures_a_reader_needs_are_on_the_first_screen(scenario, capsys):
    """The first table, the verdict and whether it fits come before the details (streams, collectives,
    timeline): within the first 40 lines at 80 columns, for the default and for a 4D layout."""
    assert main(["run", *([scenario] if scenario else []), "--width", "80"]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = lambda words: next(i for i, line in enumerate(lines) if words in line)  # noqa: E731
    assert first("step time") < first("verdict") < first("80 GiB (85.9 GB): fits") < 40
    assert first("fits") < first("busy time per stream") < first("timeline")
