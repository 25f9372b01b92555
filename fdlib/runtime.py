"""Where fdlib's Triton kernels run: compiled for a CUDA GPU, or Triton's interpreter on the CPU.

The choice is made once, when fdlib is imported, before any kernel is defined, because Triton reads
``TRITON_INTERPRET`` when a kernel is decorated:

* a CUDA GPU is visible and ``FDLIB_INTERPRET`` is not ``1``  ->  mode ``"gpu"``: kernels are compiled;
* otherwise (no GPU, or ``FDLIB_INTERPRET=1`` to debug on a GPU machine)  ->  mode ``"interpreter"``:
  every program of the grid runs, one after another, in NumPy on the CPU. Same kernels, same results,
  thousands of times slower, so labs use small shapes there.

``describe()`` gives the one-line summary that every notebook prints first.
"""
from __future__ import annotations

import os
import sys

FORCE_ENV = "FDLIB_INTERPRET"


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is reported by the import below anyway
        return False


TRITON_IMPORTED_FIRST: bool = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1"
"""Triton was imported before fdlib without TRITON_INTERPRET=1: its own library functions (tl.zeros, ...)
were then built for compiled kernels, and the interpreter cannot run them."""


def _decide() -> str:
    forced = os.environ.get(FORCE_ENV, "0") == "1"
    if forced or os.environ.get("TRITON_INTERPRET", "0") == "1" or not _cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"
        return "interpreter"
    return "gpu"


MODE: str = _decide()
INTERPRET: bool = MODE == "interpreter"

import torch  # noqa: E402  (after the decision on purpose)
import triton  # noqa: E402

from .gpus import sm_count  # noqa: E402,F401  (SMs of the live GPU, None without one: fdlib.gpus is its one home)


def _e4m3_nan_in_the_interpreter() -> None:
    """Make Triton's interpreter keep e4m3's NaN, as a GPU does. The interpreter converts a ``tl.float8e4nv``
    (``torch.float8_e4m3fn``) value by its bit fields alone: the NaN byte S.1111.111 reads as ±480, and a NaN is
    written as a finite byte, so an 8-bit cache's NaN (:mod:`fdlib.hf.append`) would turn into finite values on
    the CPU runtime. Its converter is wrapped: from e4m3, a NaN byte gives the target type's NaN; to e4m3, a NaN
    gives 0x7F (as the GPU's ``cvt ... satfinite`` and PyTorch do). Every other value converts as before. A
    Triton without that converter is left alone."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_convert_float", None)
    if convert is None or getattr(convert, "keeps_e4m3_nan", False):
        return

    def bits(a, dtype):
        return np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=getattr(np, f"uint{dtype.primitive_bitwidth}"))

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        out = convert(input, input_dtype, output_dtype, rounding_mode)
        if input_dtype == tl.float8e4nv and output_dtype != tl.float8e4nv:
            nan = (bits(input, input_dtype) & 0x7F) == 0x7F
            m, e = output_dtype.fp_mantissa_width, output_dtype.primitive_bitwidth - output_dtype.fp_mantissa_width - 1
            quiet = ((1 << e) - 1) << m | 1 << (m - 1)
        elif output_dtype == tl.float8e4nv and input_dtype != tl.float8e4nv:
            m, e = input_dtype.fp_mantissa_width, input_dtype.primitive_bitwidth - input_dtype.fp_mantissa_width - 1
            x = bits(input, input_dtype)
            nan = ((x >> m) & ((1 << e) - 1) == (1 << e) - 1) & (x & ((1 << m) - 1) != 0)
            quiet = 0x7F
        else:
            return out
        if nan.any():
            out = out.copy()
            out.reshape(-1)[nan] = quiet
        return out

    _convert_float.keeps_e4m3_nan = True
    interpreter._convert_float = _convert_float


if INTERPRET:
    _e4m3_nan_in_the_interpreter()

DEVICE: str = "cuda" if MODE == "gpu" else "cpu"
"""Where fdlib puts tensors it creates for its kernels by default (labs and tests use it too)."""


def device_name() -> str:
    if MODE == "gpu":
        return torch.cuda.get_device_name()
    import platform
    return f"CPU ({platform.processor() or platform.machine()})"


def describe() -> str:
    """One line: mode, device, SM count, torch and triton versions."""
    sms = sm_count()
    sm_txt = f"{sms} SMs" if sms is not None else "no GPU SMs"
    mode = "GPU (compiled Triton)" if MODE == "gpu" else "Triton interpreter on the CPU"
    return (f"fdlib runtime: {mode} | device: {device_name()} | {sm_txt} | "
            f"torch {torch.__version__} | triton {triton.__version__}")


class InterpreterBroken(RuntimeError):
    pass


_SMOKE_DONE = False


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '3.6.0' or '2.4.0rc1'; (0, 0) if unreadable."""
    import re
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _smoke_kernel():
    import triton.language as tl

    @triton.jit
    def _row_sums_plus_one(x_ptr, n_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        n = tl.load(n_ptr)                        # a loop bound read from memory, as the decode kernels do
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, n):
            acc += tl.load(x_ptr + i * BLOCK + offs)
        tl.store(y_ptr + offs, acc + 1.0)
    return _row_sums_plus_one


def smoke_check() -> None:
    """Run a tiny kernel once and make sure it really computes.

    Some triton/numpy combinations break the interpreter: it returns zeros silently, or fails on a loop
    bound read from memory (numpy >= 2.4 with triton 3.6). This check sums rows of x with such a loop and
    raises :class:`InterpreterBroken` with the fix if the answer is wrong or the kernel fails.
    """
    global _SMOKE_DONE
    if _SMOKE_DONE:
        return
    import numpy

    _row_sums_plus_one = _smoke_kernel()
    x = torch.arange(1, 25, dtype=torch.float32, device=DEVICE).reshape(3, 8)
    n = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    y = torch.zeros(8, dtype=torch.float32, device=DEVICE)
    versions = f"triton {triton.__version__}, numpy {numpy.__version__}, torch {torch.__version__}"
    fix = ("Reinstall the pinned versions with the README's set-up command (./course lab or ./course test "
           "recreate .venv from constraints.txt), which pins a triton/numpy pair known to work.")
    if MODE == "interpreter" and TRITON_IMPORTED_FIRST:
        fix = ("triton was imported before fdlib, so its library functions were built for compiled kernels: "
               "import fdlib first (before triton), or set TRITON_INTERPRET=1 in the environment before starting "
               "Python.")
    elif MODE == "interpreter" and _release(numpy.__version__) >= (2, 4) and _release(triton.__version__) < (3, 7):
        fix += (" Or keep this numpy and upgrade triton: 3.7.1, 3.8.0 and 3.9.0 pass this check and fdlib's kernel "
                "tests with numpy 2.4.6; the interpreter of triton 3.6 does not run with numpy >= 2.4.")
    try:
        _row_sums_plus_one[(1,)](x, n, y, BLOCK=8)
    except Exception as e:  # noqa: BLE001 - any failure here means the toolchain is broken, say how to fix it
        raise InterpreterBroken(f"Triton ({MODE}) failed on a 3-line test kernel ({type(e).__name__}: {e}) with "
                                f"{versions}. {fix}") from e
    want = x.sum(0) + 1
    if not torch.equal(y.cpu(), want.cpu()):
        raise InterpreterBroken(f"Triton ({MODE}) computed {y.cpu().tolist()} instead of {want.cpu().tolist()} "
                                f"on a test kernel: kernels return wrong values with {versions}. {fix}")
    _SMOKE_DONE = True
