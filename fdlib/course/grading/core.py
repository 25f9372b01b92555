r"""The grading machinery: exercises, checks, and a runner that never breaks.

Vocabulary
----------
* An **exercise** is a function the learner writes in a notebook cell, registered by name with
  ``@exercise("lab01.naive_attention")``. Its stub body calls :func:`todo` (or raises ``NotImplementedError``).
* A **solution** is the reference implementation of an exercise (``labsolutions/labNN_topic.py``), registered
  with ``@solution(name)``.
* A **stub** is the exercise cell as shipped, kept as text in ``fdlib/course/grading/labNN.py`` and registered with
  :func:`exercise_stub` (``notebooks/src`` must hold the same text, ``tests/test_notebook_sources.py`` checks
  it). A Triton stub cannot call :func:`todo` (it has to compile), so it is recognised by its code: its
  ``guard`` runs before each of the exercise's checks (:mod:`fdlib.course.grading.triton_exercise`).
* A **check** is a small function ``check_fn(impl, gen)`` written once in ``fdlib/course/grading/labNN.py`` with
  ``@check_case(name, "what it checks")``. It builds fresh inputs from ``gen`` (a generator seeded per check), calls the implementation
  through :func:`call` and compares with :func:`assert_close` / :func:`expect_tensor`. A check fails by raising
  :class:`CheckFailure` with a useful message.
* **Points**: every check is worth ``points`` (``@check_case(..., points=2)``; 1 unless said otherwise): 2 for a
  check of the exercise's main case or of the kernel it plugs into, 1 for each edge case. A passed check earns
  its points, a failed one none; ``./course grade`` sums them per lab (partial credit, as nbgrader and
  otter-grader give it).

Running checks (:func:`run_checks`): every check runs in its own thread with a timeout; anything it raises
(learner exceptions, wrong types, grader bugs) becomes a ❌ line, never a traceback. A Python thread cannot be
killed: a check that times out keeps running in the background until it returns (it is a daemon thread, so it
does not stop the interpreter from exiting). The result of a timed-out check is ignored.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
import threading
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

DEFAULT_TIMEOUT_S = 30.0


class TodoError(NotImplementedError):
    """Raised by :func:`todo` in an exercise stub. ``line``, if given, is the TODO line's text in place of
    "implement NAME (its body is still the stub), then run this cell again" (a bug-zoo cell is shipped with buggy
    code to fix, not with a stub)."""

    def __init__(self, message: str = "", line: str = ""):
        super().__init__(message)
        self.line = line


class CheckFailure(AssertionError):
    """A check found something wrong; the message is shown to the learner after ❌."""


class LearnerError(CheckFailure):
    """The learner's function raised an exception."""


def todo(name: str = "this exercise"):
    """Call this in an exercise stub: the grader then prints a TODO line instead of a failure."""
    raise TodoError(f"implement {name}")


# ---------------------------------------------------------------------------------------------- registries
_LEARNER: dict[str, Callable] = {}
_SOLUTIONS: dict[str, Callable] = {}
_CHECKS: dict[str, list["Check"]] = {}
_STUBS: dict[str, str] = {}
_GUARDS: dict[str, Callable] = {}
_LAST: dict[str, "Result"] = {}


@dataclass
class Check:
    exercise: str
    name: str
    fn: Callable
    timeout_s: float = DEFAULT_TIMEOUT_S
    points: float = 1

    @property
    def seed(self) -> int:
        """A seed of its own for every check (stable from run to run, distinct between checks)."""
        return zlib.crc32(f"{self.exercise}/{self.name}".encode())


def exercise(name: str):
    """Decorator for a learner's exercise function: ``@exercise("lab01.naive_attention")``."""
    def deco(fn):
        fn.__exercise__ = name
        _LEARNER[name] = fn
        _LAST.pop(name, None)
        return fn
    return deco


def solution(name: str):
    """Decorator for a reference solution (used in ``labsolutions/``)."""
    def deco(fn):
        fn.__exercise__ = name
        fn.__solution__ = True
        _SOLUTIONS[name] = fn
        return fn
    return deco


def check_case(name: str, title: str, timeout_s: float = DEFAULT_TIMEOUT_S, points: float = 1):
    """Decorator for one check of exercise ``name``, worth ``points``; the check receives ``(impl, gen)`` with a
    seeded generator."""
    if not points > 0:
        raise ValueError(f"check_case({name!r}, {title!r}): points must be > 0, got {points!r}")

    def deco(fn):
        lst = _CHECKS.setdefault(name, [])
        lst[:] = [c for c in lst if c.name != title]
        lst.append(Check(name, title, fn, timeout_s, points))
        return fn
    return deco


def exercise_stub(name: str, source: str, guard: Callable | None = None) -> str:
    """Register ``source`` as the stub of exercise ``name``; returns it. ``guard(impl)``, if given, runs before
    each of the exercise's checks: it raises :class:`TodoError` for the untouched stub and
    :class:`CheckFailure` for an implementation of the wrong kind (e.g. not a Triton function)."""
    _STUBS[name] = source
    if guard is not None:
        _GUARDS[name] = guard
    return source


def stub_source(name: str) -> str:
    """The stub of exercise ``name`` (the text of its exercise cell as shipped)."""
    load_checks(name)
    return _STUBS[name].strip("\n")


def _lab(name: str) -> str:
    lab = name.split(".", 1)[0]
    if not (lab.startswith("lab") and lab[3:].isdigit()):
        raise ValueError(f"exercise names look like 'lab01.naive_attention', got {name!r}")
    return lab


def load_checks(name: str) -> list[Check]:
    """The checks of exercise ``name`` (imports ``fdlib.course.grading.labNN`` on first use)."""
    if name not in _CHECKS:
        try:
            importlib.import_module(f"fdlib.course.grading.{_lab(name)}")
        except ModuleNotFoundError:
            pass
    if name not in _CHECKS:
        raise KeyError(f"no checks for exercise {name!r}; known: {sorted(_CHECKS)}")
    return list(_CHECKS[name])


def exercises(lab: str | None = None) -> list[str]:
    """Names of the exercises that have checks (of one lab, e.g. ``"lab01"``, or of all labs found)."""
    for m in pkgutil.iter_modules([str(Path(__file__).parent)]):     # the modules of fdlib/course/grading
        if m.name.startswith("lab") and (lab is None or m.name == lab):
            importlib.import_module(f"fdlib.course.grading.{m.name}")
    return sorted(n for n in _CHECKS if lab is None or n.startswith(lab + "."))


def _import_labsolutions():
    """``labsolutions`` sits next to ``fdlib`` in the checkout; import it from there if it is not installed."""
    try:
        import labsolutions
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[3]
        if not (root / "labsolutions" / "__init__.py").exists():
            raise
        sys.path.append(str(root))
        import labsolutions
    return labsolutions


def reference(name: str) -> Callable:
    """The reference solution of ``name`` from the ``labsolutions`` package."""
    if name not in _SOLUTIONS:
        labsolutions = _import_labsolutions()
        lab = _lab(name)
        for m in pkgutil.iter_modules(labsolutions.__path__):
            if m.name.startswith(lab + "_") or m.name == lab:
                importlib.import_module(f"labsolutions.{m.name}")
    if name not in _SOLUTIONS:
        raise KeyError(f"no reference solution for {name!r} in labsolutions/")
    return _SOLUTIONS[name]


# ---------------------------------------------------------------------------------------------- helpers for checks
def _describe_value(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {list(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__}"


def call(fn: Callable, args: dict, kwargs: dict | None = None, outputs=()):
    """Call the learner's ``fn(*args.values(), **kwargs)``; report exceptions and any change to a tensor input.

    ``args`` maps argument names (used in messages) to values, passed positionally in order. Arguments named in
    ``outputs`` are buffers the function is meant to write (pair them with :class:`GuardedBuffer`).
    """
    kwargs = kwargs or {}
    snapshots = {k: v.clone() for k, v in {**args, **kwargs}.items()
                 if isinstance(v, torch.Tensor) and k not in outputs}
    try:
        out = fn(*args.values(), **kwargs)
    except (TodoError, NotImplementedError):
        raise
    except CheckFailure:
        raise
    except Exception as e:  # noqa: BLE001 - every learner error becomes a ❌ line
        where = _learner_frame(e)
        raise LearnerError(f"your function raised {type(e).__name__}: {e}{where}") from e
    for k, before in snapshots.items():
        now = {**args, **kwargs}[k]
        if now.shape != before.shape or not torch.equal(torch.nan_to_num(now), torch.nan_to_num(before)):
            raise CheckFailure(f"your function modified its input `{k}` (work on a copy, e.g. `{k}.float()` "
                               f"or `{k}.clone()`, instead of writing into it)")
    return out


def _learner_frame(e: BaseException) -> str:
    """' (at line N: <code>)' for the innermost frame of the learner's code, if it can be found."""
    tb = traceback.extract_tb(e.__traceback__)
    here = __file__.rsplit(".", 1)[0]
    frames = [f for f in tb if not f.filename.startswith(here) and "site-packages" not in f.filename
              and "/torch/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" (in {f.name}, line {f.lineno}: {f.line.strip()})" if f.line else f" (in {f.name}, line {f.lineno})"


def expect_tensor(x, what: str, shape=None, dtype=None, device=None) -> torch.Tensor:
    """Fail clearly unless ``x`` is a tensor of the given shape/dtype(s)/device."""
    if not isinstance(x, torch.Tensor):
        raise CheckFailure(f"{what}: expected a torch.Tensor, got {_describe_value(x)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise CheckFailure(f"{what}: expected shape {list(shape)}, got {list(x.shape)}")
    if dtype is not None:
        ok = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        if x.dtype not in ok:
            want = " or ".join(str(d) for d in ok)
            raise CheckFailure(f"{what}: expected dtype {want}, got {x.dtype}")
    if device is not None and torch.device(x.device).type != torch.device(device).type:
        raise CheckFailure(f"{what}: expected a tensor on {device}, got one on {x.device}")
    return x


def expect_tuple(x, what: str, n: int, names: str) -> tuple:
    if not isinstance(x, (tuple, list)) or len(x) != n:
        got = f"a {type(x).__name__} of length {len(x)}" if isinstance(x, (tuple, list)) else _describe_value(x)
        raise CheckFailure(f"{what}: expected a tuple of {n} ({names}), got {got}")
    return tuple(x)


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str, atol: float, rtol: float) -> None:
    """Compare in float64 on the CPU; ±inf must match exactly, NaN is always wrong. The report says where and how much."""
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if g.shape != e.shape:
        raise CheckFailure(f"{what}: expected shape {list(e.shape)}, got {list(g.shape)}")
    if g.numel() == 0:
        return
    close = torch.isclose(g, e, atol=atol, rtol=rtol) & ~torch.isnan(g)
    close |= torch.isnan(g) & torch.isnan(e)
    if bool(close.all()):
        return
    bad = ~close
    n_bad = int(bad.sum())
    err = (g - e).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    err = torch.where(bad, err, torch.full_like(err, -1.0))
    flat = int(torch.argmax(err.reshape(-1)))
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape)) if g.dim() else ()
    kinds = []
    if bool(torch.isnan(g).any()):
        kinds.append(f"{int(torch.isnan(g).sum())} NaN")
    if bool((torch.isinf(g) & ~torch.isinf(e)).any()):
        kinds.append("inf where a finite value was expected")
    if bool((~torch.isinf(g) & torch.isinf(e)).any()):
        kinds.append("finite where ±inf was expected")
    finite = ~torch.isnan(g) & ~torch.isinf(g) & ~torch.isinf(e)
    max_err = float((g - e).abs()[finite].max()) if bool(finite.any()) else float("nan")
    extra = f" ({', '.join(kinds)})" if kinds else ""
    raise CheckFailure(
        f"{what}: {n_bad} of {g.numel()} values differ{extra}; max abs error {max_err:.3g} "
        f"(tolerance atol={atol:g}, rtol={rtol:g}); worst at index {list(idx)}: expected {float(e[idx]):.6g}, "
        f"got {float(g[idx]):.6g}")


def with_likely_cause(message: str, got, candidates, atol: float = 1e-4, rtol: float = 1e-4) -> str:
    """``message`` and 'Likely cause: <why>.' for the first known mistake whose output equals the learner's
    (``message`` alone if none does).

    ``got``: the learner's tensors (a tuple); ``candidates``: [(why, tensors or None)], each the output the mistake
    described by ``why`` gives on the same inputs (None to leave one out; a tensor may be None where the mistake
    says nothing about that output). Equal: same shape, close everywhere, ±inf where the candidate has it."""
    got = [None if g is None else g.detach().to("cpu", torch.float64) for g in got]
    for why, want in candidates:
        if want is None:
            continue
        same = True
        for g, w in zip(got, want):
            if w is None:
                continue
            w = w.detach().to("cpu", torch.float64)
            if g is None or g.shape != w.shape or not bool(
                    (torch.isclose(g, w, atol=atol, rtol=rtol) | (torch.isnan(g) & torch.isnan(w))).all()):
                same = False
                break
        if same:
            return f"{message.rstrip('.')}. Likely cause: {why}."
    return message


class GuardedBuffer:
    """An output buffer with guard bands: ``guard`` sentinel elements before and after the learner's view.

    ``buf.view`` is what the learner writes into; :meth:`verify` fails if anything outside it changed.
    """
    SENTINEL = 12345.0

    def __init__(self, shape, dtype=torch.float32, device="cpu", guard: int = 64, fill: float = 0.0):
        n = 1
        for s in shape:
            n *= int(s)
        self.guard, self.n = guard, n
        self.storage = torch.full((n + 2 * guard,), self.SENTINEL, dtype=dtype, device=device)
        self.storage[guard:guard + n] = fill
        self.view = self.storage[guard:guard + n].view(*shape)

    def verify(self, what: str = "output buffer") -> None:
        before = self.storage[:self.guard]
        after = self.storage[self.guard + self.n:]
        for part, side in ((before, "before"), (after, "after")):
            changed = (part != self.SENTINEL).nonzero()
            if len(changed):
                raise CheckFailure(f"your function wrote outside its {what}: {len(changed)} element(s) {side} "
                                   f"the buffer were changed (check the offsets and masks of your stores)")


TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
"""(atol, rtol) for an attention output per input dtype: the result is rounded to that dtype once."""


def randn(gen: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------- exercise cells
EXERCISE_TAG = "exercise"
_NAME_RE = re.compile(r"""@exercise\(\s*["']([^"']+)["']""")


def exercise_name(cell) -> str | None:
    """The exercise a notebook cell defines (a code cell tagged ``exercise`` whose metadata ``fdlib.exercise`` or
    ``@exercise("labNN.name")`` decorator names it), or None if it is not an exercise cell."""
    if cell.get("cell_type") != "code" or EXERCISE_TAG not in cell.get("metadata", {}).get("tags", []):
        return None
    name = cell.get("metadata", {}).get("fdlib", {}).get("exercise")
    if name:
        return name
    found = _NAME_RE.search(cell.get("source", ""))
    return found.group(1) if found else None


# ---------------------------------------------------------------------------------------------- running checks
@dataclass
class CheckOutcome:
    name: str
    status: str          # "pass", "fail", "todo"
    message: str = ""
    worth: float = 0     # the check's points (earned if status == "pass")
    todo_line: str = ""  # a TODO's own line text (TodoError.line), if it gave one

    def line(self) -> str:
        if self.status == "pass":
            return f"✅ PASS {self.name}"
        if self.status == "todo":
            return f"📝 TODO: {self.message}"
        return f"❌ FAIL {self.name}: {self.message}"


@dataclass
class Result:
    exercise: str
    outcomes: list[CheckOutcome] = field(default_factory=list)
    todo: bool = False
    max_points: float = 0    # the points of all the exercise's checks (also for a TODO)

    @property
    def points(self) -> float:
        """Points earned: the sum of the passed checks' points."""
        return sum(o.worth for o in self.outcomes if o.status == "pass")

    @property
    def passed(self) -> int:
        return sum(o.status == "pass" for o in self.outcomes)

    @property
    def failed(self) -> int:
        return sum(o.status != "pass" for o in self.outcomes)

    @property
    def total(self) -> int:
        return len(self.outcomes)

    @property
    def ok(self) -> bool:
        return not self.todo and self.total > 0 and self.failed == 0

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        state = "TODO" if self.todo else f"{self.passed}/{self.total} checks passed"
        return f"<Result {self.exercise}: {state}>"

    def _ipython_display_(self) -> None:
        """A check cell shows its lines once: they were printed while the checks ran, so the Result that ends
        the cell adds nothing. ``display(result)`` (or a cell ending in it) after that prints them again."""
        if self.__dict__.pop("_printed", False):
            return
        for o in self.outcomes:
            print(o.line())


def run_one(chk: Check, impl: Callable, timeout_s: float | None = None) -> CheckOutcome:
    """Run one check in a daemon thread; every problem becomes an outcome, nothing is raised."""
    timeout = chk.timeout_s if timeout_s is None else timeout_s
    box: dict = {}

    def target():
        gen = torch.Generator().manual_seed(chk.seed)
        try:
            if chk.exercise in _GUARDS:
                _GUARDS[chk.exercise](impl)
            chk.fn(impl, gen)
            box["outcome"] = CheckOutcome(chk.name, "pass")
        except (TodoError, NotImplementedError) as e:
            box["outcome"] = CheckOutcome(chk.name, "todo", str(e) or f"implement {chk.exercise}",
                                          todo_line=getattr(e, "line", ""))
        except CheckFailure as e:
            box["outcome"] = CheckOutcome(chk.name, "fail", str(e))
        except BaseException as e:  # noqa: BLE001 - grader bugs must not break the notebook either
            box["outcome"] = CheckOutcome(chk.name, "fail", f"{type(e).__name__}: {e}{_learner_frame(e)}")

    t = threading.Thread(target=target, name=f"check {chk.exercise}/{chk.name}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        # The thread cannot be killed; it finishes in the background and its result is dropped.
        out = CheckOutcome(chk.name, "fail", f"timed out after {timeout:g} s (infinite loop? sizes too large?)")
    else:
        out = box.get("outcome", CheckOutcome(chk.name, "fail", "the check ended without a result"))
    out.worth = chk.points
    return out


def run_checks(name: str, impl: Callable, quiet: bool = False, timeout_s: float | None = None) -> Result:
    """Run every check of exercise ``name`` on ``impl``; print one line per check unless ``quiet``."""
    checks = load_checks(name)
    res = Result(name, max_points=sum(c.points for c in checks))
    for i, chk in enumerate(checks):
        out = run_one(chk, impl, timeout_s)
        if out.status == "todo" and i == 0:
            res.todo = True
            res.outcomes = [CheckOutcome(chk.name, "todo", out.todo_line or f"implement {name} (its body is still "
                                         f"the stub), then run this cell again", chk.points, out.todo_line)]
            if not quiet:
                print(res.outcomes[0].line())
            return res
        if out.status == "todo":
            out = CheckOutcome(out.name, "fail", f"raised NotImplementedError: {out.message}", chk.points)
        res.outcomes.append(out)
        if not quiet:
            print(out.line())
    if not quiet:
        print(f"{'🎉' if res.ok else '  '} {name}: {res.passed}/{res.total} checks passed")
    return res


def check(target, impl: Callable | None = None, quiet: bool = False, timeout_s: float | None = None) -> Result:
    """Check an exercise: ``check("lab01.naive_attention")`` or ``check(naive_attention)``.

    With ``impl=`` any function can be checked under that exercise's name (``impl="solution"`` checks the reference).
    """
    if callable(target):
        name = getattr(target, "__exercise__", None)
        if name is None:
            print("❌ FAIL this function is not an exercise: decorate it with @exercise(\"labNN.name\")")
            return Result("?", [CheckOutcome("registration", "fail", "not an exercise")])
        impl = impl or target
    else:
        name = str(target)
    if impl == "solution":
        impl = reference(name)
    if impl is None:
        impl = _LEARNER.get(name)
        if impl is None:
            print(f"📝 TODO: run the cell that defines the exercise {name} first")
            res = Result(name, [CheckOutcome(name, "todo", "not defined")], todo=True)
            res._printed = True
            return res
    res = run_checks(name, impl, quiet=quiet, timeout_s=timeout_s)
    res._printed = not quiet                     # its lines are on screen already (see Result._ipython_display_)
    if impl is _LEARNER.get(name):
        _LAST[name] = res
    return res


def use(name: str, quiet: bool = False) -> Callable:
    """The learner's function if it passes its checks, else the reference solution (with a note)."""
    fn = _LEARNER.get(name)
    if fn is not None:
        res = _LAST.get(name)
        if res is None:
            res = run_checks(name, fn, quiet=True)
            _LAST[name] = res
        if res.ok:
            if not quiet:
                print(f"using your {name} (✅ PASS)")
            return fn
        why = "is still a TODO" if res.todo else f"fails {res.failed} of {res.total} checks"
    else:
        why = "is not defined"
    if not quiet:
        print(f"ℹ️  your {name} {why}: the reference solution runs in its place")
    return reference(name)


def solution_source(name: str, decorator: str = "exercise") -> str:
    """Source code of the reference solution, decorated with ``@exercise`` (ready to paste into the exercise cell)."""
    fn = reference(name)
    src = inspect.getsource(getattr(fn, "fn", fn))   # a @triton.jit function keeps the Python one in .fn
    return src.replace("@solution(", f"@{decorator}(", 1)


def show_solution(name: str) -> None:
    """Print the reference solution of ``name``."""
    print(solution_source(name))
