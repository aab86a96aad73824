"""The package's floors (docs/architecture.md): each imports only its own floor and those below."""

from __future__ import annotations

import ast

from tests.helpers import REPO

# Lowest first; names on one floor may import each other.
FLOORS = [
    {"errors", "version", "options"},
    {"groups", "data"},
    {"nn"},
    {"train"},
    {"configs"},
    {"models"},
    {"verify", "bench", "report"},
    {"commands"},
    {"cli", "__main__", "__init__"},
]
LEVEL = {name: level for level, names in enumerate(FLOORS) for name in names}


def _imports(tree: ast.AST) -> set[str]:
    """The first name below ``symattn_cli`` of every import (``""``: the package root)."""
    out = set()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "symattn_cli":
                out.add(parts[1] if len(parts) > 1 else "")
    return out


def test_every_import_goes_down_or_sideways():
    package = REPO / "symattn_cli"
    wrong = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        floor = parts[0] if len(parts) > 1 else path.stem
        assert floor in LEVEL, f"{floor} is on no floor of docs/architecture.md"
        for target in _imports(ast.parse(path.read_text())):
            if target == "" and floor not in ("cli", "__main__", "__init__"):
                wrong.append(f"{path.relative_to(REPO)} imports the package root")
            elif target and LEVEL[target] > LEVEL[floor]:
                wrong.append(f"{path.relative_to(REPO)} ({floor}) imports {target}")
    assert not wrong, wrong


def test_the_layout_doc_names_every_floor_in_order():
    text = (REPO / "docs" / "architecture.md").read_text()
    positions = [min(text.index(f"`{name}`") for name in names) for names in FLOORS[1:-1]]
    assert positions == sorted(positions)
