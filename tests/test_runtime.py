"""The runtime line and the start-up smoke check."""
from __future__ import annotations

import re

import os
import subprocess
import sys

import pytest

import fdlib  # noqa: I001  (before triton: fdlib decides TRITON_INTERPRET first)
import torch
import triton
from fdlib import runtime


def test_describe_is_one_line_with_mode_device_sms_and_versions():
    line = fdlib.describe()
    assert "\n" not in line
    assert ("GPU (compiled Triton)" in line) == (runtime.MODE == "gpu")
    assert f"torch {torch.__version__}" in line and f"triton {triton.__version__}" in line
    assert re.search(r"\| (\d+ SMs|no GPU SMs) \|", line)


def test_mode_matches_the_environment():
    import os
    assert runtime.MODE in ("gpu", "interpreter")
    if runtime.MODE == "interpreter":
        assert os.environ.get("TRITON_INTERPRET") == "1"


def test_smoke_check_passes_on_a_working_install():
    runtime._SMOKE_DONE = False
    runtime.smoke_check()
    assert runtime._SMOKE_DONE


class _Launcher:
    """Stands in for a jitted kernel: launching it does nothing (a silently broken interpreter) or raises."""

    def __init__(self, fail: bool):
        self.fail = fail

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self.fail:
                raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
        return launch


@pytest.mark.parametrize("fail, words", [(False, "instead of"), (True, "failed on a 3-line test kernel")])
def test_smoke_check_reports_a_broken_interpreter_with_the_fix(monkeypatch, fail, words):
    monkeypatch.setattr(runtime.triton, "jit", lambda fn: _Launcher(fail))
    monkeypatch.setattr(runtime, "_SMOKE_DONE", False)
    with pytest.raises(runtime.InterpreterBroken) as e:
        runtime.smoke_check()
    msg = str(e.value)
    assert words in msg and "numpy" in msg and "constraints.txt" in msg


@pytest.mark.skipif(runtime.MODE != "interpreter", reason="only the interpreter is affected by the import order")
def test_triton_imported_before_fdlib_gets_a_clear_message():
    code = "import triton, fdlib; fdlib.runtime.smoke_check()"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FDLIB_INTERPRET")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert "InterpreterBroken" in r.stderr and "import fdlib first" in r.stderr


@pytest.mark.parametrize("triton_v, numpy_v, hint", [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False),
                                                      ("3.9.0", "2.4.6", False)])
def test_smoke_check_names_the_triton_that_runs_with_numpy_2_4(monkeypatch, triton_v, numpy_v, hint):
    """numpy >= 2.4 breaks Triton 3.6's interpreter only; the message says a newer triton is the other way out."""
    import numpy
    monkeypatch.setattr(runtime.triton, "jit", lambda fn: _Launcher(True))
    monkeypatch.setattr(runtime.triton, "__version__", triton_v)
    monkeypatch.setattr(numpy, "__version__", numpy_v)
    monkeypatch.setattr(runtime, "_SMOKE_DONE", False)
    monkeypatch.setattr(runtime, "TRITON_IMPORTED_FIRST", False)
    with pytest.raises(runtime.InterpreterBroken) as e:
        runtime.smoke_check()
    assert ("upgrade triton" in str(e.value)) == (hint and runtime.MODE == "interpreter")
    assert "constraints.txt" in str(e.value)


def test_gpu_test_modules_import_without_nbformat():
    """The GPU machine has torch, triton, pytest and hypothesis but no Jupyter packages: the test files that
    tools/gpu_validate.sh runs there import without nbformat (it once failed their collection through
    tests/helpers.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = open(os.path.join(root, "tools", "gpu_validate.sh")).read()
    files = re.search(r"\$\{GPU_TESTS:-([^}]*)\}", script).group(1).split()
    modules = [os.path.basename(f)[:-3] for f in files]
    assert "test_gpu" in modules and "test_streamk" in modules, files
    code = ("import sys; sys.modules['nbformat'] = None\n"    # a None entry makes `import nbformat` fail
            f"import {', '.join(modules)}\n"
            "assert 'fdlib.course.grading.notebook_tools' not in sys.modules")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "tests"), root]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
