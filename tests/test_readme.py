"""The README is a user's page: its sections, the quick start CI runs, figures with commands."""

from __future__ import annotations

import re

from tests.helpers import REPO

README = (REPO / "README.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"no '## {title}' section"
    return match.group(1)


def test_a_users_sections_in_order():
    titles = re.findall(r"^## (.+)$", README, re.M)
    wanted = ["Quick start", "Commands", "Models", "Data", "Outputs", "Measured figures",
              "Scale-out"]  # fmt: skip
    assert [t for t in titles if t in wanted] == wanted, titles


def test_quick_start_holds_the_two_commands_ci_runs():
    quick = _section("Quick start")
    assert "```bash\npython -m pip install -e . && symattn train\n```" in quick
    assert '```bash\npython -m pip install -q -e ".[dev]" && python -m pytest -q\n```' in quick
    ci = (REPO / ".ci" / "run").read_text()
    assert 'python -m pip install -q -e ".[dev]" && python -m pytest -q' in ci


def test_every_figure_comes_with_its_command():
    rows = [r for r in _section("Measured figures").splitlines() if r.startswith("| `")]
    assert len(rows) >= 4
    for row in rows:
        command = row.split("|")[1].strip()
        assert re.fullmatch(r"`symattn [a-z-]+[^`]*`", command), row
        assert re.search(r"\d", row.split("|")[2]), row  # a measured value


def test_no_lab_notebook():
    """History (earlier commits, other hosts) lives in git log; the docs say what to run."""
    assert not re.search(r"commit `?[0-9a-f]{7}", README)
    for phrase in (
        "Earlier commits",
        "earlier commit",
        "later host",
        "eight runs",
        "Earlier rounds",
        "re-timed",
        "sharing the 2 cores",
        "load average",
    ):
        assert phrase.lower() not in README.lower(), phrase
    results = (REPO / "docs" / "results.md").read_text()
    assert "symattn_cli train -m" in results and "symattn_cli report multirun/" in results


def test_the_run_file_schema_lives_in_the_docs():
    assert "docs/runfile.md" in _section("Outputs")
    runfile = (REPO / "docs" / "runfile.md").read_text()
    for path in ("/config", "/metrics/epoch/<name>", "/summary/<name>", "/results/<table>"):
        assert f"`{path}" in runfile, path


def test_the_layout_is_one_line_per_floor():
    assert "docs/architecture.md" in _section("Layout")
