"""The ``symattn`` command: a thin dispatcher over one Hydra app per subcommand.

``symattn <command> [overrides...]`` hands the rest of the command line to that command's
Hydra app, so overrides, ``-m`` sweeps, ``--cfg job``, ``--help`` and shell completion all work
per command. This module imports only the standard library: ``symattn --help`` is instant.
"""

from __future__ import annotations

import gc
import importlib
import sys

COMMANDS = {
    "train": ("symattn_cli.commands.train", "train a model on a dataset (Hydra app)"),
    "verify-equivariance": (
        "symattn_cli.commands.verify",
        "measure equivariance error per group element, layer and model",
    ),
    "benchmark": ("symattn_cli.commands.benchmark", "time and memory of layers and models"),
    "report": (
        "symattn_cli.commands.report",
        "compare runs: final metrics per group of runs, CSV, Markdown, HDF5, plots",
    ),
}

USAGE = """\
usage: symattn <command> [hydra overrides ...]

Symmetry-aware attention experiments: GSA-Nets and knowledge attention.

commands:
{commands}

Each command is a Hydra application: `symattn train --help` lists its config groups,
`symattn train model=r8_sa data=rotmnist trainer.epochs=5` overrides values,
`symattn train -m model=z2_sa,r4_sa seed=0,1` sweeps, `symattn train --cfg job` prints the
composed config. Runs land in outputs/<command>/<time>/ with one run.h5 each;
`symattn report multirun/train/<date>/<time>` compares the runs of a sweep.

options:
  -h, --help           show this message
  --version            print the version
  --completion bash    print a bash completion script (eval "$(symattn --completion bash)")
"""

BASH_COMPLETION = r"""
_symattn_complete() {
    local commands="%(commands)s"
    local words=($COMP_LINE)
    local word="${COMP_WORDS[COMP_CWORD]}"
    if [ "$COMP_CWORD" -le 1 ]; then
        COMPREPLY=($(compgen -W "$commands --help --version --completion" -- "$word"))
        return
    fi
    local command="${words[1]}"
    case " $commands " in *" $command "*) ;; *) return ;; esac
    # The command's Hydra app completes config groups and keys from the line without the
    # subcommand (Hydra strips the program name itself).
    local rest="${COMP_LINE#*$command}"
    local choices
    choices=$(COMP_LINE="symattn${rest}" symattn "$command" -sc query=bash 2>/dev/null)
    COMPREPLY=($(compgen -o nospace -W "$choices" -- "$word"))
}
COMP_WORDBREAKS=${COMP_WORDBREAKS//=}
complete -o nospace -o default -F _symattn_complete symattn
"""


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] == "--version":
        from symattn_cli.version import __version__

        print(f"symattn {__version__}")
        return 0
    if args[0] == "--completion":
        shell = args[1] if len(args) > 1 else "bash"
        if shell != "bash":
            print(
                f"symattn: error: --completion {shell!r} is not supported; use bash",
                file=sys.stderr,
            )
            return 2
        print(BASH_COMPLETION % {"commands": " ".join(COMMANDS)})
        return 0
    command = args[0]
    if command not in COMMANDS:
        print(
            f"symattn: error: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}"
            "\n(run `symattn --help` for usage)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    sys.argv = [f"symattn {command}", *args[1:]]
    try:
        module.main()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0


def run() -> None:
    """The ``symattn`` program: :func:`main`, then exit with its status. By then the command
    has closed what it wrote; the objects left are taken out of the garbage collector's reach
    (``gc.freeze``), so that interpreter shutdown does not search them all (hundreds of
    thousands once torch is loaded) for reference cycles, pass after pass."""
    code = main()
    gc.freeze()
    raise SystemExit(code)
