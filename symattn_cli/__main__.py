"""``python -m symattn_cli`` is the ``symattn`` command."""

from symattn_cli.cli import run

if __name__ == "__main__":
    run()
