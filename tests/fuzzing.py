"""A fuzzer of the command line, as a new user (or a cat on the keyboard) would drive it: generated
scenario files and library names, `--set` overrides and options, good values and bad ones.

`generate(rnd, folder)` draws one case from a random.Random (the hypothesis test gets one from
hypothesis, benchmarks/fuzz.py from a seed); `attempt(case)` runs it in this process with a time
limit, in `folder`, and says what happened. The tool must never raise out of `main`, never exit with
an unexpected status, say each refusal in one line, and never hang. Every path it writes, relative
or absolute, is inside `folder`.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simcluster.cli import main
from simcluster.config.scenario import library
from simcluster.config.schema import SCHEMA

class RAW(str):
    """A value written into TOML as it is (a date, a time)."""


STATUSES = {0, 1, 2, 3, 4}  # verified / mismatch / refused / out of memory / hung (cli.py)
ODD = [0, 1, 2, 3, 4, 8, -1, 7, 2**31, 10**12, 10**30, 0.5, -0.0, 1e-300, math.nan, math.inf, -math.inf, "", "x",
       "[/x]", "[bold]oops", "é", "a" * 300, True, False, [], [1, 2], {}, {"a": 1},
       # issue 36's classes: numbers no float holds, control and unicode characters, dates, nesting
       1e308, -1e308, int("9" * 400), -int("9" * 400), 2**63, 2**40, "\x07\x1b[31m", "名前\u202e", "\t\n", " ",
       RAW("1979-05-27T07:32:00Z"), RAW("07:32:00"), [[[[[[1]]]]]], {"a": {"b": {"c": {"d": 1}}}}]
JUNK_KEYS = ["model.hiden", "foo.bar", "parallel", "name", "description", "run", "cluster.gpus", "model.layers.x",
             "compare", "at_scale", ""]
COMMANDS = ["run"] * 8 + ["verify", "timeline", "timeline", "export", "list", "plan"]


def _nested(rnd: Any) -> str:
    """An array or inline table nested deeper than any scenario (to depths past Python's recursion limit)."""
    depth = rnd.choice([20, 400, 1200, 3000])
    if rnd.random() < 0.5:
        return "[" * depth + "1" + "]" * depth
    return "{a = " * depth + "1" + "}" * depth


@dataclass
class Case:
    argv: list[str]
    note: str  # what was generated, for a failure's report
    folder: Path = Path(".")  # where it runs: every path it writes, relative or not, lies inside


def _toml_value(v: Any) -> str:
    if isinstance(v, RAW):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _key(rnd: Any) -> str:
    if rnd.random() < 0.08:
        return rnd.choice(JUNK_KEYS)
    section = rnd.choice(sorted(SCHEMA))
    return f"{section}.{rnd.choice(sorted(SCHEMA[section]))}"


def _value(rnd: Any, key: str) -> Any:
    section, _, name = key.partition(".")
    spec = SCHEMA.get(section, {}).get(name)
    roll = rnd.random()
    if spec is None or roll < 0.12:
        return rnd.choice(ODD)
    if spec.choices and roll < 0.7:
        return rnd.choice(spec.choices)
    if spec.type is bool:
        return rnd.random() < 0.5
    if spec.type is int:
        return rnd.choice([1, 1, 2, 2, 4, 8, 3, 16, 0, 5, 12, 64])
    if spec.type is float:
        return rnd.choice([0.0, 0.1, 0.5, 1.0, 2.0, 1e-3, 100.0, 1e9])
    return rnd.choice(["x", "", "none.toml", "[/x]"])


def _document(rnd: Any) -> str:
    """A scenario file: mostly well-formed TOML, sometimes not."""
    lines: dict[str, list[str]] = {}
    for _ in range(rnd.randrange(0, 7)):
        key = _key(rnd)
        section, _, name = key.partition(".")
        lines.setdefault(section if name else "", []).append(f"{name or section} = {_toml_value(_value(rnd, key))}")
    out = [line for line in lines.pop("", [])]
    if rnd.random() < 0.1:
        out.append(f"description = {_toml_value(rnd.choice(['[/x] y', 'plain', 'a' * 100]))}")
    for section, body in lines.items():
        out.append(f"[{section}]")
        out += body
    if rnd.random() < 0.1:
        key = _key(rnd)
        out += ["[compare]", f'"{key}" = {_toml_value([_value(rnd, key), _value(rnd, key)])}']
    if rnd.random() < 0.08:
        key = _key(rnd)
        out += ["[at_scale]", f'"{key}" = {_toml_value(_value(rnd, key))}']
    if rnd.random() < 0.05:  # a key twice (TOML refuses it)
        out += out[-1:] if out and "=" in out[-1] else ["description = 1", "description = 2"]
    if rnd.random() < 0.05:
        out.insert(0, f"description = {_nested(rnd)}")
    if rnd.random() < 0.04:
        out += ["[at_scale]", f"model = {_nested(rnd)}"]
    text = "\n".join(out) + "\n"
    if rnd.random() < 0.06:  # broken syntax
        text = text[: rnd.randrange(0, len(text) + 1)] + rnd.choice(["[", "= =", '"', "[[x]]", "\x00"])
    return text


def _override(rnd: Any) -> str:
    roll = rnd.random()
    if roll < 0.06:
        return rnd.choice(["novalue", "=", "a.b.c=1", "parallel.tp=", "=3", "model.layers==2", "run.steps=1e12",
                           "", "model.hidden", "run.lr=1" + "0" * 400])
    if roll < 0.08:
        return f"{_key(rnd)}={_nested(rnd)}"
    key = _key(rnd)
    value = _value(rnd, key)
    text = _toml_value(value) if rnd.random() < 0.8 else str(value)
    return f"{key}={text}"


def generate(rnd: Any, folder: Path) -> Case:
    command = rnd.choice(COMMANDS)
    argv = [command]
    note = ""
    if command == "list":
        return Case(argv, "list", folder)
    roll = rnd.random()
    if roll < 0.45:
        path = folder / f"s{rnd.randrange(10**6)}.toml"
        text = _document(rnd)
        path.write_text(text, errors="surrogateescape")
        argv.append(str(path))
        note = text
    elif roll < 0.7:
        argv.append(rnd.choice([f.stem for f in library()]))
    elif roll < 0.75:
        argv.append(rnd.choice(["nosuch", "x" * 5000, str(folder), "zero_memry", "/dev/null", "", "/dev/zero",
                                "名前.toml", "\x1b[2J"]))
    elif roll < 0.8:  # special files: a FIFO (never opened), a loop of links, a file named with controls
        argv.append(_special(rnd, folder))
    sets = [_override(rnd) for _ in range(rnd.randrange(0, 5))]
    if rnd.random() < 0.75:  # mostly shapes only: a fuzzer should try many inputs, not wait on a few
        sets.insert(0, "run.numerics=meta")
    for s in sets:
        argv += ["--set", s]
    options = {
        "run": ["--json", "--width", "--svg", "--save-checkpoint", "--resume", "--at-step", "--at-scale", "--no-fold"],
        "verify": ["--at-scale"],
        "timeline": ["--ranks", "--streams", "--start-us", "--end-us", "--width", "--passes", "--svg"],
        "export": ["-o"],
        "plan": ["--simulate", "--json", "--fix"],
    }[command]
    if command == "export":
        argv += ["-o", rnd.choice([str(folder / "t.json"), str(folder), str(folder / "no" / "t.json"), "x" * 300,
                                   "/dev/full"])]
    if command == "plan":
        argv += ["--simulate", rnd.choice(["1", "0", "2"])]
    for option in rnd.sample(options, rnd.randrange(0, min(3, len(options)) + 1)):
        argv += _option(rnd, option, folder)
        if rnd.random() < 0.1:  # the same option again
            argv += _option(rnd, option, folder)
    return Case(argv, note, folder)


def _special(rnd: Any, folder: Path) -> str:
    kind = rnd.choice(["fifo", "loop", "named"])
    path = folder / f"{kind}{rnd.randrange(10**6)}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        path.symlink_to(path)
    else:
        path = folder / f"s\x07\u202e名{rnd.randrange(10**6)}.toml"
        path.write_text("[model]\nlayers = 2\n")
    return str(path)


def _option(rnd: Any, option: str, folder: Path) -> list[str]:
    pick = rnd.choice
    values = {
        "--width": [pick(["5", "20", "80", "100000", "-1", "x"])],
        "--svg": [pick([str(folder / "p.svg"), str(folder), str(folder / "no" / "p.svg"), "/dev/full",
                        "/proc/version"])],  # (a full device, a read-only one)
        "--save-checkpoint": [pick([str(folder / "ck"), str(folder / "s.toml"), str(folder), "/proc/ck"])],
        "--resume": [pick([str(folder / "ck"), str(folder / "nothing"), str(folder)])],
        "--at-step": [pick(["0", "1", "2", "-1", "99"])],
        "--ranks": [pick(["0", "0,1", "99", "-1", "x", "", "0,,1"])],
        "--streams": [pick(["compute", "comm:dp", "nope", ","])],
        "--start-us": [pick(["0", "10", "nan", "-5", "1e308"])],
        "--end-us": [pick(["5", "inf", "100", "0"])],
        "--simulate": [pick(["1", "0", "3"])],
        "--fix": [pick(["tp=1", "tp=x", "bogus=1", "pp=1,2", "="])],
    }
    return [option] + values.get(option, [])


@dataclass
class Outcome:
    status: int | None  # None: raised or hung
    problem: str  # "" when the tool behaved
    seconds_limit: float


class _Timeout(BaseException):
    """(Not an Exception: the emulator reports a program's exceptions as that rank's error, exit 2.)"""


def attempt(case: Case, limit_s: int = 20) -> Outcome:
    """Run the case; a problem is a traceback (an exception out of `main`), an unknown exit status, a
    refusal longer than one line, or a run over `limit_s` seconds (SIGALRM: main thread only; a run the
    alarm interrupted is over its limit however the tool then ended)."""
    fired = []

    def alarm(signum: int, frame: Any) -> None:
        fired.append(True)
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, alarm)
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    signal.alarm(limit_s)
    try:  # (in the case's folder: a relative path it names, "x" or "[/x]", is written there)
        os.chdir(case.folder)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(case.argv)
    except _Timeout:
        return Outcome(None, f"did not finish in {limit_s} s", limit_s)
    except SystemExit as exc:  # argparse: a usage error, exit status 2 with its usage line
        status = exc.code if isinstance(exc.code, int) else 2
    except BaseException as exc:  # noqa: BLE001 - this is what the fuzzer looks for
        return Outcome(None, f"traceback: {type(exc).__name__}: {exc}"[:500], limit_s)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(here)
    if fired:
        return Outcome(None, f"did not finish in {limit_s} s", limit_s)
    if status not in STATUSES:
        return Outcome(status, f"exit status {status!r}", limit_s)
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    if status == 2 and "usage:" not in err.getvalue() and len(errors) != 1:
        return Outcome(status, f"a refusal in {len(errors)} error lines: {err.getvalue()[-300:]!r}", limit_s)
    return Outcome(status, "", limit_s)


