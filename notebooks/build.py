"""Make the course notebooks from their sources: notebooks/src/NN_topic.md (MyST markdown, read by jupytext).

    python notebooks/build.py                 # every notebook: read, execute, store outputs (a minute each on a CPU)
    python notebooks/build.py 03_split_kv     # one notebook
    python notebooks/build.py --no-run        # cells only, no outputs
    python notebooks/build.py --check         # exit 1 if a notebook's cells differ from its source (no execution)

A lesson is edited in its source; this script only adds what a text file does not carry:

* cell ids (``NN-ii``), the kernelspec, and for every exercise cell (tag ``exercise``, metadata
  ``fdlib.exercise``) its stub in metadata ``fdlib.stub`` (the cell's source as written), which
  ``fdlib.course.grading.notebook_tools.reset_exercise`` puts back;
* outputs, from running the notebook with nbclient in this interpreter. Cells tagged ``machine`` (the runtime
  line, timings, widgets) are run but saved without outputs, so no machine name, path or timing is committed;
  outputs that nbval compares (tag ``nbval-check-output``) must not depend on the machine either.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import jupytext
import nbformat

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
_EXERCISE = re.compile(r"""@exercise\(\s*["']([^"']+)["']""")


def sources() -> list[Path]:
    return sorted(SRC.glob("[0-9][0-9]_*.md"))


def from_source(path: Path) -> nbformat.NotebookNode:
    """The notebook of one source file, without outputs."""
    nb = jupytext.read(path, fmt="md:myst")
    nb.metadata = nbformat.NotebookNode(kernelspec=dict(KERNELSPEC), language_info={"name": "python"})
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{path.stem[:2]}-{i:02d}"
        meta = cell.metadata
        if cell.cell_type == "code" and "exercise" in meta.get("tags", []):
            name = meta.get("fdlib", {}).get("exercise")
            found = _EXERCISE.search(cell.source)
            if not name or not found or found.group(1) != name:
                raise ValueError(f"{path.name} cell {i}: an exercise cell needs metadata fdlib.exercise equal to its "
                                 f"@exercise(...) name (found {name!r} and {found and found.group(1)!r})")
            meta["fdlib"] = {"exercise": name, "stub": cell.source}
    return nb


def execute(nb, cwd: Path = HERE) -> float:
    from nbclient import NotebookClient
    t0 = time.time()
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return time.time() - t0


def scrub(nb) -> None:
    """Clear machine-dependent outputs and run metadata; merge consecutive prints into one stream output."""
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        c.metadata.pop("execution", None)
        if "machine" in c.metadata.get("tags", []):
            c.outputs, c.execution_count = [], None
        merged = []   # check lines come from worker threads in chunks
        for o in c.outputs:
            if merged and o.output_type == "stream" and merged[-1].output_type == "stream" \
                    and merged[-1].name == o.name:
                merged[-1].text += o.text
            else:
                merged.append(o)
        c.outputs = merged
    nb.metadata.pop("widgets", None)
    text = nbformat.writes(nb)
    for private in {str(Path.home()), str(HERE.parent)} - {"/", ""}:
        if private in text:
            raise ValueError(f"an output holds the local path {private!r}: tag its cell 'machine' or print less")


def cells_of(nb) -> list[tuple]:
    """What --check compares: each cell's type, id, source and metadata (not outputs)."""
    return [(c.cell_type, c.get("id"), c.source, {k: v for k, v in c.metadata.items() if k != "execution"})
            for c in nb.cells]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = [a for a in argv if not a.startswith("--")]
    paths = [p for p in sources() if not names or p.stem in names]
    if names and len(paths) != len(names):
        raise SystemExit(f"unknown notebook(s): {sorted(set(names) - {p.stem for p in paths})}")
    stale = []
    for src in paths:
        nb, dst = from_source(src), HERE / f"{src.stem}.ipynb"
        if "--check" in argv:
            if not dst.exists() or cells_of(nbformat.read(dst, as_version=4)) != cells_of(nb):
                stale.append(dst.name)
            continue
        if "--no-run" not in argv:
            print(f"{src.stem}: executed in {execute(nb):.1f} s", flush=True)
        scrub(nb)
        nbformat.validate(nb)
        nbformat.write(nb, dst)
    if stale:
        print("out of date with notebooks/src (run python notebooks/build.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
