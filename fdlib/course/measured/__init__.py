"""What the GPU shows: each lab's one figure and one table, drawn from committed results.

A lesson's "What the GPU shows" section is one call::

    from fdlib.measured import show_measured
    show_measured("ragged")          # the figure, the table, and a caption naming the results file

Every view is a function ``view(results_dir) -> Shown`` registered under a short name with :func:`view`, in the
module of its lab (``fdlib/course/measured/labNN.py``); the parsing of result files lives there, not in a notebook.
``results_dir`` defaults to the repository's ``results/h200``.
"""
from __future__ import annotations

import importlib
import json
import math
import pkgutil
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parents[3] / "results" / "h200"

_VIEWS: dict[str, Callable] = {}

CAPTION_WIDTH = 88
"""Printed captions are wrapped to this many characters (a notebook's output area breaks long lines anywhere)."""


@dataclass
class Shown:
    """What a view drew: the figure, the table's rows (header first), and the caption that names its file(s)."""
    figure: object
    table: list[list[str]]
    caption: str
    sources: list[str] = field(default_factory=list)


def gmean(xs) -> float:
    """exp(mean(log x)): the average of ratios."""
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def load(path: Path) -> dict:
    """A recorded results file (JSON), or FileNotFoundError naming it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such results file (python -m fdlib.bench writes it)")
    return json.loads(path.read_text())


def provenance(prov: dict) -> str:
    """'NVIDIA H200, 2026-12-01 00:51 UTC' from a file's ``provenance``. The command, the commit and the versions
    stay in the file (and in results/), not in what a learner reads."""
    return f"{prov['device']}, {prov['date_utc'][:16].replace('T', ' ')} UTC"


def skipped_reason(reasons) -> str:
    """Why a run skipped shapes, in words: 'their cache above 20 GB' for the benchmark's size cap (recorded as
    'KV 137.4 GB > --max-kv-gb 20.0' or 'cache 34.4 GB > ...'), else 'reasons in the file'."""
    caps = set()
    for r in reasons:
        m = re.fullmatch(r"(?:KV|cache) [0-9.]+ GB > --max-kv-gb ([0-9.]+)", str(r).strip())
        if not m:
            return "reasons in the file"
        caps.add(float(m.group(1)))
    return f"their cache above {caps.pop():g} GB" if len(caps) == 1 else "reasons in the file"


def shown_path(path: Path) -> str:
    """A results file named from the repository root (results/h200/...) where it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(RESULTS.parents[1]))
    except ValueError:
        return str(path)


def view(name: str):
    """Register ``fn(results_dir) -> Shown`` as the view ``name``."""
    def deco(fn):
        if name in _VIEWS and _VIEWS[name] is not fn:
            raise ValueError(f"view {name!r} is registered twice")
        _VIEWS[name] = fn
        return fn
    return deco


def _load_all():
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def names() -> list[str]:
    """The registered views' names."""
    _load_all()
    return sorted(_VIEWS)


def format_rows(rows: list[list[str]]) -> str:
    """A plain-text table: columns padded to their widest cell, a rule under the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def wrap_caption(caption: str, width: int = CAPTION_WIDTH) -> str:
    """``caption`` with each of its lines wrapped at ``width``: words kept whole, and a token longer than a line
    (a file name, a command) left unbroken on a line of its own."""
    return "\n".join(textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False) if line else ""
                     for line in caption.split("\n"))


def show_measured(name: str, results_dir=None, show: bool = True) -> Shown:
    """Draw the view ``name``: its figure, then its table and its caption as text (the caption wrapped by
    :func:`wrap_caption`). Returns the :class:`Shown`, its caption unwrapped."""
    _load_all()
    if name not in _VIEWS:
        raise ValueError(f"name: expected one of {sorted(_VIEWS)}, got {name!r}")
    shown = _VIEWS[name](Path(results_dir) if results_dir is not None else RESULTS)
    if show:
        import matplotlib.pyplot as plt
        plt.show()
        print(format_rows(shown.table))
        print()
        print(wrap_caption(shown.caption))
    return shown
