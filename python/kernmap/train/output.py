"""What `python -m kernmap align | ablate` prints: the C++ command's tables (cli/table.cpp: left-aligned text,
right-aligned numbers, a rule under the header), its number formats, and a progress bar on a terminal."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable

_NUMERIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?[x%]?$")


def fixed(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def sci(value: float) -> str:
    return f"{value:.2e}"


def pct(value: float) -> str:
    return ("+" if value >= 0 else "") + fixed(value, 1)


def render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(r[c]) for r in rows if c < len(r)]) for c, h in enumerate(header)]

    def line(cells: list[str], head: bool) -> str:
        out = []
        for c, w in enumerate(widths):
            cell = cells[c] if c < len(cells) else ""
            out.append(cell.rjust(w) if not head and _NUMERIC.match(cell) else cell.ljust(w))
        return "  ".join(out).rstrip() + "\n"

    total = sum(w + 2 for w in widths)
    return line(header, True) + "-" * max(total - 2, 0) + "\n" + "".join(line(r, False) for r in rows)


def progress_bar(what: str, enabled: bool) -> Callable[[int, int], None] | None:
    """A one-line bar on stderr when it is a terminal (and `enabled`: the printing process, without --json)."""
    if not (enabled and sys.stderr.isatty()):
        return None

    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\r{what} [{'#' * filled}{' ' * (width - filled)}] {done}/{total} steps")
        if done == total:
            sys.stderr.write("\r\033[K")
        sys.stderr.flush()

    return show


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_document(doc: dict) -> str:
    """As the C++ command's --json: numbers that read back to the same double, a non-finite one as null."""
    return json.dumps(_finite(doc), allow_nan=False, indent=2) + "\n"
