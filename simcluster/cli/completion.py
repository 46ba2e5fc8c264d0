"""`simcluster completion SHELL`: a completion script for bash, zsh or tcsh, made from the command
line's own parsers by shtab (sub-commands, options, their choices, files), so it never falls behind.

    simcluster completion bash > ~/.local/share/bash-completion/completions/simcluster
    simcluster completion zsh > "${fpath[1]}/_simcluster"
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console

SHELLS = ("bash", "zsh", "tcsh")


def add(sub: Any) -> None:
    completion = sub.add_parser("completion", help="print a shell completion script (bash, zsh or tcsh)",
                                description="Print a completion script for SHELL on standard output: "
                                            "`simcluster completion bash > ~/.local/share/bash-completion/"
                                            "completions/simcluster`, or for zsh into a folder of $fpath as "
                                            "_simcluster.")
    completion.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash, zsh or tcsh")
    completion.set_defaults(command_of=command)


def command(args: argparse.Namespace, out: Console, err: Console) -> int:
    import shtab

    sys.stdout.write(shtab.complete(args.parser, shell=args.shell))  # (the parser that read this command line)
    return 0
