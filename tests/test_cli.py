"""The dispatcher: instant help, subcommands, errors, completion."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from symattn_cli.cli import COMMANDS, main
from tests.helpers import symattn_env


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "verify-equivariance", "benchmark", "report"):
        assert command in out


@pytest.mark.slow
def test_help_lists_commands_without_importing_torch():
    code = (
        "import sys; from symattn_cli.cli import main; main(['--help']); "
        "heavy = [m for m in ('torch', 'wandb', 'h5py', 'hydra') if m in sys.modules]; "
        "print('HEAVY', heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=symattn_env(), check=True
    ).stdout
    for command in ("train", "verify-equivariance", "benchmark", "report"):
        assert command in out
    assert "HEAVY []" in out


def test_unknown_command_is_a_clear_error(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err


def test_version_and_module_entry(symattn, workdir):
    result = symattn("--version", cwd=workdir)
    assert result.returncode == 0 and result.stdout.startswith("symattn ")


def test_bash_completion_knows_subcommands_and_config_groups(symattn, workdir, capsys,
                                                             monkeypatch):  # fmt: skip
    assert main(["--completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert "complete " in script and all(command in script for command in COMMANDS)
    monkeypatch.setenv("COMP_LINE", "symattn model=")
    result = symattn("train", "-sc", "query=bash", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "model=cnn" in result.stdout.split()


def test_openmp_wait_policy_is_left_to_the_environment(monkeypatch):
    """In this process: the command sees OMP_WAIT_POLICY as the environment has it (the
    subprocess check below also sees that torch is not loaded by then)."""
    from symattn_cli import cli

    seen = []

    class Probe:  # stands in for the command module
        @staticmethod
        def main():
            seen.append(os.environ.get("OMP_WAIT_POLICY"))

    monkeypatch.setattr(cli.importlib, "import_module", lambda name: Probe)
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # main sets the command's argv
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli.main(["train"]) == 0
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert cli.main(["train"]) == 0
    assert seen == [None, "PASSIVE"]


@pytest.mark.slow
def test_openmp_wait_policy_is_the_users():
    """The dispatcher leaves OMP_WAIT_POLICY to the environment (OpenMP's default: idle
    threads spin briefly, then sleep), and a setting there reaches the command."""
    code = textwrap.dedent(
        """
        import importlib, os, sys
        from symattn_cli import cli

        class Probe:  # stands in for the command module
            @staticmethod
            def main():
                torch_loaded = "torch" in sys.modules
                print("SEEN", os.environ.get("OMP_WAIT_POLICY"), torch_loaded)

        importlib.import_module = lambda name: Probe
        cli.main(["train"])
        """
    )
    env = symattn_env()
    env.pop("OMP_WAIT_POLICY", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "SEEN None False" in out.stdout, out.stderr
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # a shared machine's choice reaches the command
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "SEEN PASSIVE False" in out.stdout, out.stderr


def test_run_exits_with_the_commands_status_and_freezes_what_is_left(monkeypatch):
    """The program's entry: main's status as the exit status, and every object left out of
    the collector's reach, so that shutdown does not search them for cycles."""
    import gc

    from symattn_cli import cli

    monkeypatch.setattr(cli, "main", lambda: 3)
    assert gc.get_freeze_count() == 0
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.run()
        assert exit_.value.code == 3
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_module_entry_runs_the_program(monkeypatch):
    """``python -m symattn_cli``'s module, run here: the program's exit status."""
    import gc
    import runpy

    monkeypatch.setattr(sys, "argv", ["symattn", "trian"])
    try:
        with pytest.raises(SystemExit) as exit_:
            runpy.run_module("symattn_cli", run_name="__main__")
        assert exit_.value.code == 2
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_module_entry_is_the_program():
    out = subprocess.run(
        [sys.executable, "-m", "symattn_cli", "trian"], capture_output=True, text=True,
        env=symattn_env(),
    )  # fmt: skip
    assert out.returncode == 2 and "unknown command 'trian'" in out.stderr
