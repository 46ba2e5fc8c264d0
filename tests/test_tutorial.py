"""docs/tutorial.md cannot rot: its files are written into an empty folder, its commands run there,
and each prints exactly what the tutorial shows (pytest's own timing aside). The README's example of
simcluster.testing runs too."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
FILE = re.compile(r"# (\w+\.py)\n")


def files(doc):
    """name -> text of each python block whose first line names its file (`# my_embedding.py`)."""
    out = {}
    for lang, body in FENCE.findall(doc.read_text()):
        named = FILE.match(body) if lang == "python" else None
        if lang == "python":
            assert named, f"a python block in {doc.name} does not start with '# FILE.py': {body[:60]!r}"
            out[named.group(1)] = body
    return out


def commands(doc):
    """(command, what it prints) of each `$ ` line of the console blocks."""
    out = []
    for lang, body in FENCE.findall(doc.read_text()):
        if lang == "console":
            for part in re.split(r"^\$ ", body, flags=re.M)[1:]:
                command, _, printed = part.partition("\n")
                out.append((command, printed))
    return out


TUTORIAL = ROOT / "docs" / "tutorial.md"
COMMANDS = commands(TUTORIAL)


def run(command, folder):
    words = command.split()
    assert words[0] == "python", f"the tutorial runs python only: {command}"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *words[1:]], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)


def normal(text):
    return [re.sub(r" in [\d.]+s$", " in Ts", line.rstrip()) for line in text.strip("\n").splitlines()]


def test_every_file_of_the_tutorial_is_run_or_imported_by_a_command():
    written = files(TUTORIAL)
    assert len(written) >= 6 and len(COMMANDS) >= 6
    ran = {w for command, _ in COMMANDS for w in command.split() if w.endswith(".py")}
    for name in written:
        stem = name[:-3]
        imported = any(re.search(rf"^(from {stem} import|import {stem}$)", written[other], re.M) for other in ran)
        assert name in ran or imported, f"{name} is neither run nor imported by a file that is"


@pytest.mark.parametrize("command,printed", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_each_command_prints_what_the_tutorial_shows(tmp_path, command, printed):
    if "gloo" in command:
        pytest.importorskip("torch", reason="the gloo step needs the torch extra; the test set-up installs it")
    for name, text in files(TUTORIAL).items():
        (tmp_path / name).write_text(text)
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert normal(done.stdout) == normal(printed), done.stderr


def test_the_readme_example_of_the_testing_api_passes(tmp_path):
    example = files(ROOT / "README.md")
    assert list(example) == ["test_layouts.py"]
    (tmp_path / "test_layouts.py").write_text(example["test_layouts.py"])
    done = run("python -m pytest -q -p no:cacheprovider test_layouts.py", tmp_path)
    assert done.returncode == 0 and normal(done.stdout)[-1] == "1 passed in Ts", done.stdout + done.stderr


def test_the_readme_sample_is_what_simcluster_run_prints(request):
    """README's "What `simcluster run` prints" is the default run's output at 80 columns (rewrite it on
    purpose with pytest --update-golden, and read the diff)."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    samples = [body for lang, body in FENCE.findall(text) if lang == "console" and body.startswith("$ simcluster run\n")]
    assert len(samples) == 1, "one sample of `simcluster run` in README.md"
    env = os.environ | {"COLUMNS": "80", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "simcluster.cli", "run"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    printed = "\n".join(normal(done.stdout)) + "\n"
    if request.config.getoption("--update-golden"):
        readme.write_text(text.replace(samples[0], "$ simcluster run\n" + printed))
        samples[0] = "$ simcluster run\n" + printed
    assert normal(samples[0].partition("\n")[2]) == normal(done.stdout)
