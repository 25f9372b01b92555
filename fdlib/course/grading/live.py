r"""Reveal a solution, reset an exercise, restore a backup: in the notebook open in JupyterLab, never in its file.

JupyterLab keeps the notebook you edit in the browser; the file on disk holds only what you last saved. A tool
that edits the file backs up and changes the wrong version, and the *Reload Notebook from Disk* it then needs
throws away every unsaved edit. So :func:`reveal_solution`, :func:`reset_exercise` and :func:`restore_backup`
change the notebook where you see it, in two steps:

1. In the kernel: check the exercise name, work out the new source of its exercise cell (the reference solution,
   the stub, or the version in a backup) and send it to the page in a small script (a display output).
2. In the page (:data:`PAGE_SCRIPT`): find the notebook that output belongs to, save **all of it as it is in the
   browser** (unsaved edits included) to ``backups/<notebook>.<time>.ipynb`` next to the notebook, read that
   copy back and compare, and only then put the new source into the exercise cell. Nothing is written over your
   notebook: the change is an ordinary unsaved edit (*Edit → Undo* takes it back) until you save. The script's
   output is then replaced by a line saying what happened, so it never runs twice.

``backups/`` is an ordinary folder: JupyterLab's file browser shows it and opens its notebooks (it hides
folders whose name starts with a dot, so the old ``.backups/`` could not be opened there). A ``.gitignore``
in it keeps the backups out of git. :func:`list_backups` lists a notebook's backups with their times (old
``.backups/`` ones too); :func:`restore_backup` puts a backup's version of an exercise back the same way, after
backing up the current state, so a restore can be undone in turn.

The page step needs JupyterLab's application object, which JupyterLab gives page scripts only when started with
``--LabApp.expose_app_in_browser=True`` (``./course lab`` does). Anywhere else (another front end, a JupyterLab
started without it, plain Python) nothing is changed and a message says so; ``show_solution(name)`` prints
the solution to copy by hand.
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from . import core

BACKUP_DIR = "backups"
LEGACY_BACKUP_DIR = ".backups"
LAB_FLAG = "--LabApp.expose_app_in_browser=True"
_STAMP = re.compile(r"\.(\d{8}-\d{6})(?:-\d+)?$")


# ---------------------------------------------------------------------------------------------- the kernel side
def _exercise(name) -> str:
    """``name`` if it is a known exercise, else a ValueError naming the known ones."""
    known = core.exercises()
    if name not in known:
        raise ValueError(f"expected the name of an exercise, one of {known}; got {name!r}")
    return name


def _args(first: str, second: str | None) -> tuple[str, str | None]:
    """(exercise, notebook file name or None): accepts ``(name)`` and the old ``(path, name)`` form."""
    if second is None:
        return _exercise(first), None
    return _exercise(second), Path(first).name


def notebook_path() -> Path | None:
    """The notebook this kernel runs for: JupyterLab passes its path in ``JPY_SESSION_NAME``; None elsewhere."""
    p = os.environ.get("JPY_SESSION_NAME", "")
    return Path(p) if p.endswith(".ipynb") else None


def home_notebook(name: str) -> str:
    """The file name of the notebook that holds exercise ``name`` (``01_naive_decode.ipynb``), or a pattern."""
    nn = name.split(".", 1)[0][3:]
    root = Path(__file__).resolve().parents[3] / "notebooks"
    found = sorted(root.glob(f"{nn}_*.ipynb"))
    return found[0].name if found else f"{nn}_*.ipynb"


def request(action: str, cells: dict, notebook: str | None = None, source: str | None = None) -> dict:
    """What the page script does: back up the notebook, then give each exercise in ``cells`` its new source
    (``None``: the stub stored in the cell's metadata ``fdlib.stub``)."""
    now = time.time()
    return {
        "id": uuid.uuid4().hex,
        "action": action,
        "cells": cells,
        "homes": {n: home_notebook(n) for n in cells},
        "notebook": notebook,            # the notebook file name the caller named (old form), checked by the page
        "source": source,                # restore: the backup the sources come from
        "folder": BACKUP_DIR,
        "stamp": time.strftime("%Y%m%d-%H%M%S", time.localtime(now)),
        "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)),
        "kernel": _kernel_id(),
    }


def _kernel_id() -> str | None:
    """This kernel's id (its connection file is ``kernel-<id>.json``), so that the page acts only for it."""
    try:
        from ipykernel.connect import get_connection_file
        m = re.match(r"kernel-(.+)\.json$", Path(get_connection_file()).name)
        return m.group(1) if m else None
    except Exception:  # noqa: BLE001 - not in a kernel
        return None


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _prepare_folder() -> None:
    """Make ``backups/`` next to this kernel's notebook, with a ``.gitignore`` (the page cannot write dot files)."""
    nb = notebook_path()
    if nb is None:
        return
    folder = nb.parent / BACKUP_DIR
    try:
        folder.mkdir(exist_ok=True)
        ignore = folder / ".gitignore"
        if not ignore.exists():
            ignore.write_text("# learners' notebook backups stay out of git\n*\n")
    except OSError:
        pass   # the page creates the folder itself if it can


def send(req: dict) -> bool:
    """Hand ``req`` to the page script; False (and a message, nothing changed) where there is no notebook page."""
    what = {"reveal": "reveal_solution", "reset": "reset_exercise", "restore": "restore_backup"}[req["action"]]
    if not _in_kernel():
        print(f"{what}: changes the exercise cell of a notebook open in JupyterLab, so it only works in a notebook; "
              f"nothing was changed here. show_solution(name) prints a solution.")
        return False
    from IPython.display import display
    _prepare_folder()
    fallback = (f"{what}: this front end does not run the page script, so nothing was changed. It works in "
                f"JupyterLab started with ./course lab; show_solution(name) prints a solution to copy by hand.")
    script = PAGE_SCRIPT.replace("__REQUEST__", json.dumps(req))
    display({"text/plain": fallback, "application/javascript": script}, raw=True)
    return True


def reveal_solution(name: str, exercise: str | None = None) -> None:
    """Write the reference solution into the exercise cell of ``name`` (after backing the notebook up)."""
    name, nb = _args(name, exercise)
    send(request("reveal", {name: core.solution_source(name)}, nb))


def reset_exercise(name: str, exercise: str | None = None) -> None:
    """Put the original stub back into the exercise cell of ``name`` (after backing the notebook up)."""
    name, nb = _args(name, exercise)
    send(request("reset", {name: None}, nb))


# ---------------------------------------------------------------------------------------------- backups
@dataclass
class Backup:
    path: Path
    time: str              # "YYYY-MM-DD HH:MM:SS", local time
    action: str            # reveal, reset, restore, or "" (made by an older fdlib)
    exercises: list[str]

    def describe(self) -> str:
        if not self.action:
            return "made by an older fdlib"
        what = {"reveal": "reveal_solution", "reset": "reset_exercise", "restore": "restore_backup"}.get(
            self.action, self.action)
        return f"before {what} of {', '.join(self.exercises) or '?'}"


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def exercise_sources(nb: dict) -> dict[str, str]:
    """``{exercise name: source}`` of the exercise cells of a notebook read as JSON."""
    out = {}
    for cell in nb.get("cells", []):
        cell = {**cell, "source": _source(cell)}
        name = core.exercise_name(cell)
        if name:
            out[name] = cell["source"]
    return out


def find_backups(notebook: Path) -> list[Backup]:
    """The backups of ``notebook`` in ``backups/`` and the old ``.backups/`` next to it, newest first."""
    found = []
    for folder in (notebook.parent / BACKUP_DIR, notebook.parent / LEGACY_BACKUP_DIR):
        for p in folder.glob(f"{notebook.stem}.*.ipynb"):
            if not _STAMP.search(p.stem):
                continue
            try:
                meta = _read(p).get("metadata", {}).get("fdlib_backup", {})
            except (OSError, ValueError):
                continue          # half-written or not a notebook: not offered
            when = meta.get("time") or time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p.stat().st_mtime))
            found.append(Backup(p, when, meta.get("action", ""), list(meta.get("exercises", []))))
    return sorted(found, key=lambda b: (b.time, b.path.name), reverse=True)


def _listing(notebook: Path, backups: list[Backup], mark: int | None = None) -> str:
    lines = [f"Backups of {notebook.name}, newest first (open them from the folder {BACKUP_DIR}/ next to it):"]
    for i, b in enumerate(backups):
        where = b.path.relative_to(notebook.parent)
        lines.append(f"{'→' if i == mark else ' '} [{i}] {b.time}  {b.describe():48s} {where}")
    return "\n".join(lines)


def _no_notebook(what: str) -> None:
    print(f"{what}: run it in a notebook open in JupyterLab (it works on that notebook's backups); "
          f"here no notebook is known")


def list_backups(notebook=None) -> None:
    """Print the backups of this notebook (or of ``notebook``, a path) with their times, newest first."""
    nb = Path(notebook) if notebook is not None else notebook_path()
    if nb is None:
        return _no_notebook("list_backups")
    backups = find_backups(nb)
    if not backups:
        print(f"No backups of {nb.name} yet: reveal_solution, reset_exercise and restore_backup make one in "
              f"{BACKUP_DIR}/ before they change a cell.")
        return
    print(_listing(nb, backups))


def restore_backup(which: int | str = 0, exercise: str | None = None) -> None:
    """Put an exercise cell back as it was in a backup of this notebook (after backing up the current state).

    ``which``: 0 for the newest backup (the default), 1 for the one before, ... as :func:`list_backups` numbers
    them, or a backup's file name. ``exercise``: which exercise to restore; by default the one(s) the backup was
    made for (every exercise cell for a backup made by an older fdlib).
    """
    nb = notebook_path()
    if nb is None:
        return _no_notebook("restore_backup")
    backups = find_backups(nb)
    if not backups:
        print(f"No backups of {nb.name} yet in {BACKUP_DIR}/: nothing to restore (reveal_solution, "
              f"reset_exercise and restore_backup make one before they change a cell).")
        return
    if isinstance(which, int) and not isinstance(which, bool):
        if not 0 <= which < len(backups):
            raise ValueError(f"restore_backup: expected a backup number from 0 to {len(backups) - 1} "
                             f"(see list_backups()), got {which}")
        i = which
    else:
        names = [b.path.name for b in backups]
        if Path(str(which)).name not in names:
            raise ValueError(f"restore_backup: expected a backup number or one of the files {names}, got {which!r}")
        i = names.index(Path(str(which)).name)
    chosen = backups[i]
    saved = exercise_sources(_read(chosen.path))
    if exercise is not None:
        _exercise(exercise)
        wanted = [exercise]
    else:
        wanted = [n for n in chosen.exercises if n in saved] or sorted(saved)
    missing = [n for n in wanted if n not in saved]
    if missing or not wanted:
        raise ValueError(f"restore_backup: expected the backup {chosen.path.name} to hold the exercise cell of "
                         f"{missing or 'an exercise'}; it holds {sorted(saved) or 'no exercise cell'}")
    print(_listing(nb, backups, mark=i))
    print(f"Restoring {', '.join(wanted)} from [{i}] {chosen.path.name} (saved {chosen.time}).")
    send(request("restore", {n: saved[n] for n in wanted}, source=chosen.path.relative_to(nb.parent).as_posix()))


# ---------------------------------------------------------------------------------------------- the page side
PAGE_SCRIPT = r"""
(async () => {
  const REQ = __REQUEST__;
  const out = element;
  const say = (text, bad) => {
    out.textContent = text;
    out.style.whiteSpace = 'pre-wrap';
    out.style.color = bad ? 'var(--jp-error-color1, #d32f2f)' : '';
  };
  const app = window.jupyterapp;
  if (!app) {
    say('Nothing was changed: this JupyterLab does not let page scripts reach its notebooks. Start it with ' +
        './course lab (or add --LabApp.expose_app_in_browser=True), or copy the solution that ' +
        'show_solution(name) prints.', true);
    return;
  }
  // JupyterLab runs this while it renders the output, before the output is in the page: wait until it is
  for (let i = 0; i < 100 && !out.isConnected; i++) await new Promise((r) => setTimeout(r, 20));
  const doneKey = 'fdlib-live-' + REQ.id;
  try {
    if (window.localStorage.getItem(doneKey)) { say('(done earlier)', false); return; }
    window.localStorage.setItem(doneKey, String(Date.now()));
  } catch (e) { /* no localStorage: the output is replaced below anyway */ }

  const panel = Array.from(app.shell.widgets('main')).find(
    (w) => w.context && w.content && w.content.model && w.content.model.cells && w.node.contains(out));
  const host = panel && panel.content.widgets.find((c) => c.node.contains(out));
  // Replace this script's output by a line of text, so that it never runs again (saved, reopened, re-rendered).
  const finish = (text, bad) => {
    say(text, bad);
    if (!host || !host.model.outputs) return;
    const outputs = host.model.outputs;
    for (let i = 0; i < outputs.length; i++) {
      const data = outputs.get(i).data || {};
      const js = data['application/javascript'];
      if (typeof js === 'string' && js.includes(REQ.id)) {
        outputs.set(i, {output_type: 'stream', name: bad ? 'stderr' : 'stdout', text: text + '\n'});
        break;
      }
    }
  };
  if (!panel) { say('Nothing was changed: this output is not inside a notebook.', true); return; }
  const kernel = panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
  if (REQ.kernel && !(kernel && kernel.id === REQ.kernel)) {    // an old output, shown again: never act on it
    finish('Nothing was changed: this request came from a kernel that is not this notebook\'s now ' +
           '(an old output?). Run the call again.', true);
    return;
  }
  const path = panel.context.path;
  const slash = path.lastIndexOf('/');
  const dir = slash >= 0 ? path.slice(0, slash) : '';
  const file = path.slice(slash + 1);
  const stem = file.replace(/\.ipynb$/, '');
  if (REQ.notebook && REQ.notebook !== file) {
    finish(`Nothing was changed: you named the notebook ${REQ.notebook}, but this is ${file}. ` +
           'Run it in the notebook you mean, with just the exercise name.', true);
    return;
  }

  const NAME = /@exercise\(\s*["']([^"']+)["']/;
  const srcOf = (c) => (Array.isArray(c) ? c.join('') : (c || ''));
  const nameOf = (type, tags, meta, source) => {
    if (type !== 'code' || !(tags || []).includes('exercise')) return null;
    if (meta && meta.exercise) return meta.exercise;
    const m = NAME.exec(source);
    return m ? m[1] : null;
  };
  const cells = panel.content.model.cells;
  const targets = {};
  for (const name of Object.keys(REQ.cells)) {
    const found = [];
    for (let i = 0; i < cells.length; i++) {
      const c = cells.get(i);
      if (nameOf(c.type, c.getMetadata('tags'), c.getMetadata('fdlib'), c.sharedModel.getSource()) === name) {
        found.push(c);
      }
    }
    if (found.length !== 1) {
      const where = REQ.homes[name] && REQ.homes[name] !== file ? ` It is in ${REQ.homes[name]}: run this there.` : '';
      finish(`Nothing was changed: expected one exercise cell of ${name} in ${file} (a code cell tagged ` +
             `"exercise"), found ${found.length}.${where}`, true);
      return;
    }
    let source = REQ.cells[name];
    if (source === null) {
      const meta = found[0].getMetadata('fdlib') || {};
      if (typeof meta.stub !== 'string') {
        finish(`Nothing was changed: the exercise cell of ${name} has no stored stub (metadata fdlib.stub).`, true);
        return;
      }
      source = meta.stub;
    }
    targets[name] = {cell: found[0], before: found[0].sharedModel.getSource(), after: source};
  }
  const names = Object.keys(targets);
  const changing = names.filter((n) => targets[n].before !== targets[n].after);
  if (changing.length === 0) {
    finish(`Nothing to change: the exercise cell of ${names.join(', ')} already holds that version.`, false);
    return;
  }

  // 1. back up the whole notebook as it is in the browser, unsaved edits included
  const contents = app.serviceManager.contents;
  const folder = dir ? `${dir}/${REQ.folder}` : REQ.folder;
  let backup = '';
  try {
    try {
      await contents.get(folder, {content: false});
    } catch (e) {
      await contents.save(folder, {type: 'directory'});
    }
    const nb = panel.context.model.toJSON();
    nb.metadata = Object.assign({}, nb.metadata, {fdlib_backup: {
      time: REQ.time, action: REQ.action, exercises: changing, notebook: path, source: REQ.source}});
    for (let k = 0; ; k++) {
      backup = `${folder}/${stem}.${REQ.stamp}${k ? '-' + k : ''}.ipynb`;
      try { await contents.get(backup, {content: false}); } catch (e) { break; }   // a free name
    }
    await contents.save(backup, {type: 'notebook', format: 'json', content: nb});
    // 2. read it back: it must hold every cell that is about to change, exactly
    const back = await contents.get(backup, {type: 'notebook', content: true});
    const saved = {};
    for (const c of back.content.cells) {
      const src = srcOf(c.source);
      const n = nameOf(c.cell_type, (c.metadata || {}).tags, (c.metadata || {}).fdlib, src);
      if (n) saved[n] = src;
    }
    for (const n of changing) {
      if (saved[n] !== targets[n].before) throw new Error(`the copy of ${n}'s cell in ${backup} differs from the notebook's`);
    }
  } catch (e) {
    finish(`Nothing was changed: backing up ${file} to ${folder}/ failed (${e.message || e}).`, true);
    return;
  }
  // 3. only now change the cells (unless one was edited while the backup was written)
  for (const n of changing) {
    if (targets[n].cell.sharedModel.getSource() !== targets[n].before) {
      finish(`Nothing was changed: the cell of ${n} was edited while it was being backed up; run this again. ` +
             `(A backup was written to ${backup}.)`, true);
      return;
    }
  }
  for (const n of changing) {
    const t = targets[n];
    t.cell.sharedModel.setSource(t.after);
    if (!(host && t.cell === host.model) && t.cell.outputs) {
      t.cell.outputs.clear();
      t.cell.executionCount = null;
    }
  }
  const what = {reveal: 'the reference solution is now in', reset: 'the original stub is back in',
                restore: `the version from ${REQ.source} is back in`}[REQ.action];
  finish(`${changing.join(', ')}: ${what} its exercise cell (not saved yet: File > Save keeps it, Edit > Undo ` +
         `takes it back; run the cell to use it). What the cell held before is in ${backup}; ` +
         'restore_backup() puts it back.', false);
})();
"""
