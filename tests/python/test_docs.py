"""The documentation's lists of layers against the code's: docs/python.md's table of the layers kernelize finds
has one row per binder (tests/python/test_binders.py ties the binders to the registry)."""

import re
from pathlib import Path

from kernmap.binders import BINDERS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def kernelize_table_layers() -> list[str]:
    text = (DOCS / "python.md").read_text()
    table = text[text.index("| layer | modules | bound forward |"):]
    table = table[:table.index("\n\n")]
    return re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)


def test_the_kernelize_table_has_one_row_per_binder():
    assert sorted(kernelize_table_layers()) == sorted(b.layer for b in BINDERS)

