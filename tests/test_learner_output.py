"""What a learner reads carries no benchmark leftovers: no commit-stamped file names or commit hashes and no
command-line flags, in the shipped notebooks' outputs and in every "what the GPU shows" view (fdlib.course.measured).
The provenance (commit, command, versions) stays in the results files and in results/."""
from __future__ import annotations

import json
import re

import pytest

from shipped import notebook_names, shipped_json

HASH = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z])")
"""A commit hash (7 to 40 hex digits with a letter and a digit), alone or stamped into a file name."""
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
"""A command-line flag such as --max-kv-gb."""


def leftovers(text: str) -> list[str]:
    return HASH.findall(text) + FLAG.findall(text)


def _outputs(nb: dict) -> list[tuple[int, str]]:
    out = []
    for i, cell in enumerate(nb["cells"]):
        for o in cell.get("outputs", []):
            parts = [o.get("text", "")] if "text" in o else []
            data = o.get("data", {})
            parts += [data[k] for k in ("text/plain", "text/markdown", "text/html") if k in data]
            parts += o.get("traceback", [])
            out.append((i, "".join("".join(p) if isinstance(p, list) else p for p in parts)))
    return out


@pytest.mark.parametrize("name", notebook_names())
def test_shipped_outputs_carry_no_commit_or_flag(name):
    nb = json.loads(shipped_json(name))
    found = [(i, hit) for i, text in _outputs(nb) for hit in leftovers(text)]
    assert not found, f"{name}: commit hashes or command-line flags in the outputs of cells {found}"


def test_the_views_carry_no_commit_or_flag():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fdlib.course.measured import format_rows, names, show_measured
    from fdlib.course.measured import lab06
    for view in names():
        try:
            shown = show_measured(view, show=False)
        except FileNotFoundError:   # a view whose GPU run is not recorded yet shows nothing
            continue
        texts = [shown.caption, format_rows(shown.table), *shown.sources]
        texts += [t.get_text() for ax in shown.figure.get_axes() for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]
        if shown.figure._suptitle is not None:
            texts.append(shown.figure._suptitle.get_text())
        plt.close(shown.figure)
        found = [hit for t in texts for hit in leftovers(t)]
        assert not found, f"show_measured({view!r}): {found}"
    assert not leftovers(lab06.schedules()) and not leftovers(lab06.recorded_makespans()["file"])


def test_the_leftover_patterns_see_what_they_forbid():
    assert leftovers("results/h200/ragged-fp16-auto-bf0d81e.json (43 batches, skipped: KV > --max-kv-gb 20.0)") == [
        "bf0d81e", "--max-kv-gb"]
    assert leftovers("`python -m fdlib.bench --dtype float16`, commit 3c4b0db") == ["3c4b0db", "--dtype"]
    assert not leftovers("B=1 32:8 L=131072  123.0  0.973  -----  ---------  results/h200/bench-float16.json "
                         "2026-12-01 00:51 UTC, 1e-05, 2.5e-3, deadbeef-free x-y")
