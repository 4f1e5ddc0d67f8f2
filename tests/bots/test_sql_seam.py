"""The bots app's hand-written SQL lives in bots/sql.py: no other module of the app holds the
text of a statement."""

import ast
import re
from pathlib import Path

import bots

BOTS = Path(bots.__file__).parent
STATEMENT = re.compile(r"^\s*(SELECT|UPDATE|INSERT|DELETE|WITH)\s")


def statement_texts(path: Path) -> list[str]:
    """The string literals of `path` (f-strings' fixed parts too) that begin like a statement."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and STATEMENT.match(node.value)
    ]


def test_no_bots_module_but_bots_sql_holds_a_statement() -> None:
    found = {
        str(path.relative_to(BOTS)): texts
        for path in sorted(BOTS.rglob("*.py"))
        if "migrations" not in path.parts and path.name != "sql.py"
        for texts in [statement_texts(path)]
        if texts
    }
    assert found == {}


def test_bots_sql_is_seen_by_the_check() -> None:
    """The check finds statements where they are."""
    assert len(statement_texts(BOTS / "sql.py")) >= 5
