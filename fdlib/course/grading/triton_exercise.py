r"""Triton exercises: the learner writes a ``@triton.jit`` function that fdlib's kernels call.

Lab 03's tile update, Lab 04's stage-2 kernel and Lab 05's ticket are Triton functions. Their stubs cannot call
:func:`~fdlib.course.grading.core.todo` (a stub must still compile inside the kernel), so an untouched stub is
recognised by its code: the same statements as the stub's, comments and docstring aside (:func:`is_untouched`).

A lab registers such a stub once per exercise, and every check of the exercise then starts with ``require``::

    STUB = triton_stub(NAME, '''
    @exercise("lab03.tile_update")
    @triton.jit
    def tile_update(...):
        ...
    ''')

* :func:`require_triton` (Labs 03, 04): the untouched stub is a TODO; anything but a Triton function fails.
* :func:`require_triton_function` (Lab 05's ticket): the same, and a plain Python function that still calls
  ``todo()`` (or raises ``NotImplementedError``) is a TODO too.

:func:`launch` runs a kernel launch with the learner's function inside and turns what it raises into a ❌ line.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Callable

import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .core import CheckFailure, LearnerError, TodoError, exercise_stub


def body_code(src: str) -> str | None:
    """The code of the first function in ``src`` without its docstring (comments are not in the AST)."""
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return None
    fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fn is None:
        return None
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def is_untouched(impl, stub_src: str) -> bool:
    """True if ``impl`` (a Triton function) has the code of the stub ``stub_src``."""
    fn = getattr(impl, "fn", impl)
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    mine = body_code(src)
    return mine is not None and mine == body_code(stub_src)


def is_triton_function(fn) -> bool:
    """A ``@triton.jit`` function: compiled (JITFunction) or run by the interpreter (InterpretedFunction)."""
    return isinstance(fn, (JITFunction, InterpretedFunction))


def require_triton(impl, name: str, stub_src: str) -> None:
    """TODO for the untouched stub; a clear failure unless ``impl`` is a ``@triton.jit`` function."""
    if is_untouched(impl, stub_src):
        raise TodoError(f"implement {name}")
    if not isinstance(impl, triton.runtime.KernelInterface):
        raise CheckFailure(f"expected a @triton.jit function, got {type(impl).__name__}: put @triton.jit "
                           f"right above the def (and @exercise(\"{name}\") above that)")


def require_triton_function(impl, name: str, stub_src: str) -> None:
    """TODO for the untouched stub, or for a plain Python stub (its call raises ``todo()``); a failure unless
    ``impl`` is a Triton function."""
    if is_untouched(impl, stub_src):
        raise TodoError(f"implement {name}")
    if is_triton_function(impl):
        return
    try:
        impl(None, 1)
    except (TodoError, NotImplementedError):
        raise
    except Exception:  # noqa: BLE001 - anything else: not a Triton function
        pass
    raise CheckFailure(f"{name.split('.', 1)[1]} must be a Triton function: put @triton.jit on the line under "
                       f"@exercise(...)")


def triton_stub(name: str, source: str, require: Callable = require_triton) -> str:
    """Register ``source`` as the stub of the Triton exercise ``name``: each of its checks first runs
    ``require(impl, name, source)``. Returns ``source``."""
    return exercise_stub(name, source, guard=lambda impl: require(impl, name, source))


def launch(what: str, fn):
    """Run ``fn()`` (a kernel launch with the learner's code inside); its exceptions become ❌ lines."""
    try:
        return fn()
    except (TodoError, NotImplementedError, CheckFailure):
        raise
    except Exception as e:  # noqa: BLE001
        msg = " ".join(str(e).split())
        if len(msg) > 400:
            msg = msg[:400] + " ..."
        raise LearnerError(f"{what} raised {type(e).__name__}: {msg}") from e
