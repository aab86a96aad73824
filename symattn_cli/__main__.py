"""``python -m symattn_cli`` is the ``symattn`` command."""

from symattn_cli.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
