"""Every term is defined where the course first uses it, and the glossary holds each definition.

``notebooks/glossary.md`` lists the terms, one a line::

    * **SM**, **streaming multiprocessor** (Lab 00): one of the GPU's cores (an H200 has 132); ...

the bold words being the term's forms (a plural with s/es counts as the same form), the lab being the one that
defines it. In that lab the definition is marked by the term in **bold**, in the sentence that explains it. The
order the tests hold, over the prose a learner reads (code, math, link targets and HTML left out):

* a term does not appear in a lab before the lab that defines it;
* in its defining lab, it does not appear before its bold definition (a heading may name it: a heading announces
  what the section below defines);
* no other lab sets it in bold (the bold marks the one definition);
* every lab links the glossary.

Lab 00's two tables are left out: the course map (its rows are kept as written) and the notation table, which by
design point forward, each row naming its lab.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_notebook_sources import SOURCES

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "notebooks" / "glossary.md"
_ENTRY = re.compile(r"^\* (?P<forms>(?:\*\*[^*]+\*\*(?:, )?)+) \(Lab (?P<lab>\d\d)\): (?P<text>.+)$")


def glossary(text: str) -> dict[str, tuple[str, list[str], str]]:
    """term -> (defining lab "NN", its forms, its definition) from the glossary's bullet list."""
    entries, lines = {}, []
    for line in text.splitlines():                   # join a bullet's continuation lines
        if line.startswith("* "):
            lines.append(line)
        elif line.startswith("  ") and lines:
            lines[-1] += " " + line.strip()
    for line in lines:
        m = _ENTRY.match(line)
        assert m, f"glossary: a line that is not '* **term** (Lab NN): definition': {line!r}"
        forms = re.findall(r"\*\*([^*]+)\*\*", m["forms"])
        entries[forms[0]] = (m["lab"], forms, m["text"])
    return entries


def reading_text(name: str, markdown: str) -> str:
    """What a learner reads as prose: ``markdown`` without code fences, inline code, math, link targets and
    HTML tags; in Lab 00 also without its tables (the course map and the notation table)."""
    text = re.sub(r"^```.*?^```[^\n]*$", " ", markdown, flags=re.S | re.M)
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    text = re.sub(r"\$[^$\n]+\$", " ", text)
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = re.sub(r"\]\([^)\s]*\)", "]", text)
    text = re.sub(r"<[^>\n]+>", " ", text)
    if name.startswith("00"):
        text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))
    return text


def _form(form: str) -> str:
    words = r"[\s-]+".join(re.escape(w) for w in form.split())
    return words + r"(?:s|es)?"


def _flags(form: str) -> int:
    return 0 if not re.search(r"[a-z]", form) else re.IGNORECASE     # SM, HBM, L2, GQA: as written


def uses(forms: list[str], text: str) -> list[int]:
    """Where the term appears in ``text`` (any form, bold or not)."""
    found = []
    for f in forms:
        found += [m.start() for m in re.finditer(r"(?<![\w-])" + _form(f) + r"(?![\w-])", text, _flags(f))]
    return sorted(found)


def definitions(forms: list[str], text: str) -> list[int]:
    """Where the term stands in bold by itself: its definition."""
    found = []
    for f in forms:
        found += [m.start() for m in re.finditer(r"\*\*" + _form(f) + r"\*\*", text, _flags(f))]
    return sorted(found)


def _without_headings(text: str) -> str:
    return "\n".join(" " * len(line) if line.startswith("#") else line for line in text.splitlines())


def order_errors(lessons: list[tuple[str, str]], terms: dict) -> list[str]:
    """The terms used before their definition. lessons: (name "NN_topic", markdown) in course order;
    terms: as :func:`glossary` returns them."""
    errors = []
    for term, (lab, forms, _) in terms.items():
        if not any(name[:2] == lab for name, _ in lessons):
            errors.append(f"{term!r}: the glossary says Lab {lab} defines it, and there is no Lab {lab}")
            continue
        for name, markdown in lessons:
            text = reading_text(name, markdown)
            used, defined = uses(forms, text), definitions(forms, text)
            where = lambda pos: f"{name}: ...{' '.join(text[max(0, pos - 60):pos + 40].split())}..."
            if name[:2] < lab and used:
                errors.append(f"{term!r} is used in Lab {name[:2]}, before Lab {lab} defines it ({where(used[0])})")
            elif name[:2] == lab:
                used = uses(forms, _without_headings(text))
                if not defined:
                    errors.append(f"{term!r}: Lab {lab} is its defining lab but never sets it in bold")
                elif used[0] < defined[0]:
                    errors.append(f"{term!r} is used in Lab {lab} before its bold definition ({where(used[0])})")
            elif name[:2] > lab and defined:
                errors.append(f"{term!r} is set in bold again in Lab {name[:2]} (Lab {lab} defines it: "
                              f"link or say it plainly) ({where(defined[0])})")
    return errors


LESSONS = [(p.stem, p.read_text(encoding="utf-8")) for p in SOURCES]
TERMS = glossary(GLOSSARY.read_text(encoding="utf-8"))


def test_the_glossary_lists_terms_with_their_labs():
    assert len(TERMS) >= 40, f"the glossary holds only {len(TERMS)} terms"
    for term, (lab, forms, text) in TERMS.items():
        assert text.endswith("."), f"glossary: {term!r}: a definition is one sentence ending with a period"
        assert not re.search(r"[.!?] [A-Z]", text), f"glossary: {term!r}: one sentence, not several: {text!r}"


def test_every_term_is_defined_before_it_is_used():
    errors = order_errors(LESSONS, TERMS)
    assert not errors, f"{len(errors)} term(s) out of order:\n" + "\n".join(errors)


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_every_lab_links_the_glossary(src):
    assert "](glossary.md)" in src.read_text(encoding="utf-8"), f"{src.name}: no link to the glossary"


def test_the_order_check_catches_a_term_used_too_early():
    terms = glossary("* **wave** (Lab 02): one round of programs.\n"
                     "* **SM**, **streaming multiprocessor** (Lab 01): a core\n  of the GPU.\n")
    assert terms["SM"] == ("01", ["SM", "streaming multiprocessor"], "a core of the GPU.")
    good = [("01_a", "A GPU has 132 **SMs**, and `waves` in code do not count.\n```python\nwave = 1\n```\n"),
            ("02_b", "Programs run in **waves**: the SMs take one wave at a time.")]
    assert order_errors(good, terms) == []
    early = [("01_a", "One **SM** runs one program; the second wave starts later."), good[1]]
    assert [e.split(" (")[0] for e in order_errors(early, terms)] == \
        ["'wave' is used in Lab 01, before Lab 02 defines it"]
    headed = [good[0], ("02_b", "## Waves\nPrograms run in **waves**.")]
    assert order_errors(headed, terms) == []
    before = [good[0], ("02_b", "Each wave is one round. Programs run in **waves**.")]
    assert [e.split(" (")[0] for e in order_errors(before, terms)] == \
        ["'wave' is used in Lab 02 before its bold definition"]
    never = [good[0], ("02_b", "Programs run in waves.")]
    assert order_errors(never, terms) == ["'wave': Lab 02 is its defining lab but never sets it in bold"]
    again = [good[0], good[1], ("03_c", "The **streaming multiprocessors** are busy.")]
    assert order_errors(again, terms)[0].startswith("'SM' is set in bold again in Lab 03")
    lowercase = [("01_a", "An sm, in lower case, is not the acronym. An **SM** is a core."), good[1]]
    assert order_errors(lowercase, terms) == []
