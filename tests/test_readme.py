"""The README is a short front door: the two set-up commands, the notebook to open, the course table, the
library in one screen and links. The reference lives in docs/; CI runs the README's test command."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAX_WORDS = 1500
AUTO_MAX_WORDS = 120


def test_readme_is_short_and_has_no_development_history():
    assert len(README.split()) <= MAX_WORDS, f"README.md has {len(README.split())} words (at most {MAX_WORDS})"
    hashes = re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", README)
    assert not hashes, f"commit hashes in README.md: {hashes}"
    assert not re.search(r"\bruns? \d+", README), "run numbers in README.md"


def test_quick_start_names_the_commands_and_the_first_notebook():
    start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "./course lab" in start and "./course test" in start and "00_welcome.ipynb" in start
    assert (ROOT / "notebooks" / "00_welcome.ipynb").exists()
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\./course test$", ci, re.M), "CI must run the README's test command"
    course = (ROOT / "course").read_text()
    assert "--LabApp.default_url=/lab/tree/notebooks/00_welcome.ipynb" in course   # the printed URL opens it


def test_course_table_lists_every_notebook_and_only_those():
    listed = re.findall(r"^\| `(\d\d_[a-z0-9_]+)` \|", README, re.M)
    shipped = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert listed == shipped, (listed, shipped)


def test_links_resolve():
    docs = [README] + [p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md")]
    bases = [ROOT] + [ROOT / "docs"] * (len(docs) - 1)
    for text, base in zip(docs, bases):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (base / target).exists(), f"broken link {target!r} (from {base})"


def test_auto_is_described_in_at_most_120_words():
    lib = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
    section = lib.split("### What `auto` chooses", 1)[1].split("\n#", 1)[0]
    assert 0 < len(section.split()) <= AUTO_MAX_WORDS, len(section.split())
