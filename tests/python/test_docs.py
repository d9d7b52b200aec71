"""The documentation against the code: docs/python.md's table of the layers kernelize finds has one row per
binder (tests/python/test_binders.py ties the binders to the registry); every section of docs/performance.md
that a code comment points to exists."""

import re
from pathlib import Path

from kernmap.binders import BINDERS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def kernelize_table_layers() -> list[str]:
    text = (DOCS / "python.md").read_text()
    table = text[text.index("| layer | modules | bound forward |"):]
    table = table[:table.index("\n\n")]
    return re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)


def test_the_kernelize_table_has_one_row_per_binder():
    assert sorted(kernelize_table_layers()) == sorted(b.layer for b in BINDERS)



def test_code_comments_point_to_sections_of_the_performance_log():
    sections = set(re.findall(r"^## (.+)$", (DOCS / "performance.md").read_text(), flags=re.M))
    pointers = {}
    for folder in ("kernels", "ops"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".cpp", ".h", ".cu", ".inc"):
                # A pointer may wrap onto the next comment line: join the lines first.
                text = re.sub(r"\n\s*//+\s*", " ", path.read_text())
                for name in re.findall(r'docs/performance\.md, "([^"]+)"', text):
                    pointers.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    assert pointers, "no code comment points to docs/performance.md"
    missing = {name: files for name, files in pointers.items() if name not in sections}
    assert not missing, f"sections named in code comments but not in docs/performance.md: {missing}"
