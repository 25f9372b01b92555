""":func:`fdlib.decode_attention` under ``torch.compile``: the op ``torch.ops.fdlib.decode_attention`` and the
checks a trace makes before it.

The op is opaque to the compiler: it runs the eager call itself (a fake implementation gives the shapes while
tracing), so every option, every method, 8-bit caches with their scales (a tensor, or a float as a float), the
checks, the clamp flag and the bits are the eager call's.

What the op's schema cannot carry as it came (an int where a bool goes, True where a float goes, an int scale's value,
lengths in a list that are not ints, an option of no type the op takes), and ``method`` and ``num_splits``, are
checked while tracing, with the eager call's own check functions and in its order. An error found there is not
raised while tracing: dynamo would report it as its own ``Unsupported`` ("Observed exception") under
``fullgraph=True``. The trace records the op ``torch.ops.fdlib.refuse`` instead, which raises that error, the same
type and the same message, when the compiled code runs the call, as the eager call raises it; an error the op's
eager call finds (a shape, a dtype, a length, a scale's value) is raised there likewise. So a compiled call raises
what the eager call raises, with ``fullgraph=True`` or not, on every backend. NumPy scalars, which dynamo traces as
arrays, are first taken back to what the eager checks see (:func:`host_options`).
"""
from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from . import quant
from .validate import (check_bool, check_lengths_type, check_max_seqlen, check_method, check_num_splits,
                       check_removed, check_scale, check_tensor, check_unified_max)

ERRORS = {e.__name__: e for e in (TypeError, ValueError, NotImplementedError)}
"""The errors the checks raise, by name (an op's schema takes a string, not a class)."""


def _outputs(q):
    """Shapes only: out like q, lse q.shape[:-1] float32 ([B, H_q], or [B, q_len, H_q] for a 4-D q)."""
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


# ------------------------------------------------------------------------------------------ the ops
@torch.library.custom_op("fdlib::decode_attention", mutates_args=())
def decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None,
              scale: float | None, method: str, num_splits: int | None, max_seqlen: int | None,
              block_table: torch.Tensor | None = None, batch_invariant: bool = False, check_lengths: bool = False,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
              k_scale_value: float | None = None, v_scale_value: float | None = None,
              host_lengths: list[int] | None = None, scale_np: torch.Tensor | None = None,
              k_scale_np: torch.Tensor | None = None,
              v_scale_np: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.fdlib.decode_attention``: (out, lse) of :func:`fdlib.decode_attention` with these options, as
    an opaque op: it runs the eager call itself, so every option, the checks (``check_lengths``: its one read,
    and its ValueError raised when the compiled code runs) and the clamp flag (:func:`fdlib.clamped`) are the eager
    call's. A scale is a tensor (``k_scale``) or a float (``k_scale_value``); lengths on the host in a list come as
    ``host_lengths`` (``cache_seqlens`` None). ``scale_np``, ``k_scale_np``, ``v_scale_np``: a scale that came as a
    NumPy float64 scalar, as a 0-d host tensor, read here as the float it is (:func:`host_options`)."""
    from .api import decode_attention
    scale, k_scale_value, v_scale_value = (x if t is None else float(t) for x, t in
                                           zip((scale, k_scale_value, v_scale_value),
                                               (scale_np, k_scale_np, v_scale_np)))
    return decode_attention(q, k_cache, v_cache, cache_seqlens if host_lengths is None else host_lengths,
                            block_table=block_table, scale=scale, method=method, num_splits=num_splits,
                            return_lse=True, max_seqlen=max_seqlen, check_lengths=check_lengths,
                            batch_invariant=batch_invariant,
                            k_scale=k_scale if k_scale_value is None else k_scale_value,
                            v_scale=v_scale if v_scale_value is None else v_scale_value)


@decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, scale, method, num_splits, max_seqlen, block_table=None,
      batch_invariant=False, check_lengths=False, k_scale=None, v_scale=None, k_scale_value=None, v_scale_value=None,
      host_lengths=None, scale_np=None, k_scale_np=None, v_scale_np=None):
    return _outputs(q)


@torch.library.custom_op("fdlib::refuse", mutates_args=())
def refuse(q: torch.Tensor, kind: str, message: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.fdlib.refuse``: raise ``kind(message)`` (a name of :data:`ERRORS`), the error a trace found in a
    call's options, when the compiled code runs the call. Outputs (never made) shaped as the decode op's."""
    raise ERRORS[kind](message)


@refuse.register_fake
def _(q, kind, message):
    return _outputs(q)


has_side_effect(torch.ops.fdlib.refuse.default)   # kept in the graph where nothing reads its outputs


def no_gradient(op) -> None:
    """Give ``op`` the eager call's autograd behaviour: its outputs are not differentiable (the eager call's come
    from Triton launches, so they require no grad whatever its inputs do). Without this, AOT autograd refuses to
    compile a call whose input requires grad ("no autograd formula was registered") that runs eagerly."""
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*(output if isinstance(output, tuple) else (output,)))

    def backward(ctx, *grads):
        raise NotImplementedError(f"fdlib::{op._name}: fdlib's attention has no backward (it is for inference)")

    op.register_autograd(backward, setup_context=setup_context)


no_gradient(decode_op)
no_gradient(refuse)


# ------------------------------------------------------------------------------------------ the traced call
def traced_call(q, k_cache, v_cache, cache_seqlens, block_table, scale, method, num_splits, return_lse, max_seqlen,
                check_lengths, batch_invariant, validate, k_scale, v_scale):
    """:func:`fdlib.decode_attention` while ``torch.compile`` traces it: the options checked
    (:func:`check_options`), then the decode op, or the refuse op with the error the checks found."""
    (scale, k_scale, v_scale, num_splits, max_seqlen, return_lse, check_lengths, batch_invariant), floats = \
        host_options(scale, k_scale, v_scale, num_splits, max_seqlen, return_lse, check_lengths, batch_invariant)
    try:
        scale, lengths, host, scales = check_options(q, k_cache, v_cache, cache_seqlens, block_table, scale, method,
                                                     num_splits, return_lse, max_seqlen, check_lengths,
                                                     batch_invariant, validate, k_scale, v_scale)
    # one clause an error type, its name written out: dynamo of torch 2.11 cannot trace type(e).__name__ (it raised
    # its own Unsupported there, on a GPU, in place of the check's TypeError)
    except TypeError as e:
        out, lse = refuse_call(q, "TypeError", str(e))
    except ValueError as e:
        out, lse = refuse_call(q, "ValueError", str(e))
    except NotImplementedError as e:
        out, lse = refuse_call(q, "NotImplementedError", str(e))
    else:
        out, lse = torch.ops.fdlib.decode_attention(q, k_cache, v_cache, lengths, scale, method, num_splits,
                                                    max_seqlen, block_table, batch_invariant, check_lengths,
                                                    *scales, host, *floats)
    return (out, lse) if return_lse else out


class _Named:
    """A stand-in that the checks name as a NumPy scalar type (``type(x).__name__``) and accept as nothing."""


NUMPY_NAMES = {n: type(n, (_Named,), {}) for n in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                                   "uint32", "uint64", "float16", "float32", "float64",
                                                   "complex64", "complex128")}
"""Stand-ins by NumPy type name, made on import (a trace makes no class)."""


def host_options(*options):
    """The options (scale, k_scale, v_scale, then the others) as the checks see them eagerly, and the NumPy
    floats of the first three that the op reads (each a 0-d tensor, or None). Dynamo traces a NumPy scalar as a
    0-d array; eagerly a ``numpy.float64`` is a float (a float subclass) and any other NumPy scalar is refused,
    named by its type. So a 0-d float64 among the three float options becomes 1.0 for the checks (its value goes
    to the op as a 0-d host tensor: the op reads and checks it as the eager call does), any other 0-d array a
    stand-in named by its dtype, and a larger array stays, named ``ndarray`` as eagerly. (A 0-d NumPy array,
    which the trace cannot tell from a scalar, is taken as the scalar.)"""
    out, floats = [], [None, None, None]
    for i, x in enumerate(options):
        if type(x).__name__ == "ndarray" and type(x).__module__ == "numpy":
            t = torch.as_tensor(x)
            if t.dim() == 0 and t.dtype == torch.float64 and i < 3:
                floats[i], x = t, 1.0
            elif t.dim() == 0:
                name = str(t.dtype).replace("torch.", "")
                x = NUMPY_NAMES[name]() if name in NUMPY_NAMES else x
        out.append(x)
    return out, floats


def refuse_call(q, kind: str, message: str):
    """The refuse op recorded in the trace: ``kind(message)`` raised when the compiled code runs the call."""
    return torch.ops.fdlib.refuse(q if isinstance(q, torch.Tensor) else torch.empty(0), kind, message)


def check_options(q, k_cache, v_cache, cache_seqlens, block_table, scale, method, num_splits, return_lse, max_seqlen,
                  check_lengths, batch_invariant, validate, k_scale, v_scale):
    """What a trace checks: the arguments the decode op's schema would refuse or coerce, each by the eager call's
    check (the same error), in the eager call's order. Returns what the op takes: the scale as a float (or None),
    the lengths (a tensor or None) and host lengths (a list of ints or None), and (k_scale, v_scale,
    k_scale_value, v_scale_value), each scale a tensor or a float. What the schema carries as it came is the op's
    eager call to check."""
    check_removed(validate)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t)
    if method == "unified_max":
        check_unified_max(k_cache, k_scale, v_scale, batch_invariant, max_seqlen, check_lengths)
    else:
        check_method(method)
    check_bool("return_lse", return_lse)
    if block_table is not None:
        check_tensor("block_table", block_table)
    if any(not _scale_fits(s) or _is_int(s) for s in (k_scale, v_scale)):
        quant.check_cache(q, k_cache, v_cache, k_scale, v_scale, block_table is not None, read=False)
    check_lengths_type(cache_seqlens)
    check_num_splits(num_splits, "unified" if method == "unified_max" else method)
    scale = None if scale is None else check_scale(scale, 1, value=_is_int(scale))
    check_max_seqlen(max_seqlen)
    check_bool("batch_invariant", batch_invariant)
    check_bool("check_lengths", check_lengths)
    host = list(cache_seqlens) if isinstance(cache_seqlens, (list, tuple)) else None
    scales = tuple(s if isinstance(s, torch.Tensor) else None for s in (k_scale, v_scale)) + \
        tuple(None if s is None or isinstance(s, torch.Tensor) else float(s) for s in (k_scale, v_scale))
    return scale, None if host is not None else cache_seqlens, host, scales


def _is_int(s) -> bool:
    """An int (not a bool): its value is checked while tracing, as the eager call checks it, since the op takes
    a float (an error would name 0 as 0.0, and an int too large for a float would overflow there)."""
    return isinstance(s, int) and not isinstance(s, bool)


def _scale_fits(s) -> bool:
    """A scale the op takes as it came: None, a tensor, or a number (not a bool)."""
    return s is None or isinstance(s, torch.Tensor) or isinstance(s, (int, float)) and not isinstance(s, bool)
