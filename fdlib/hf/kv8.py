r"""An 8-bit :class:`~fdlib.hf.DecodeCache`: K and V stored in ``torch.float8_e4m3fn`` or ``torch.int8`` with
their scales (:mod:`fdlib.quant`), quantized as they are written (:mod:`fdlib.hf.append`) and read by fdlib's
8-bit decode path.

**Where each layer's scales come from.**

* ``"token"``: one scale per token and KV head, :math:`\max_d |x_d| / q_{max}`, made for each token as it is
  written (``layer.k_scale``/``v_scale``, float32, the cache's shape without D). Nothing to choose.
* ``"head"`` or ``"tensor"``: one fixed scale per KV head, or per layer. Given by the user (``k_scale=``,
  ``v_scale=``: a float, a float32 ``[H_kv]`` for ``"head"``, or a list of those, one a layer), or else
  *calibrated from the prefill*: the first step written into an empty cache (the prompt, or its first chunk)
  sets each layer's scale to its real tokens' absolute maximum over :math:`q_{max}` (per head, or over the
  layer), exactly :func:`fdlib.quant.quantize_kv`'s scale of those tokens. Later tokens are quantized with
  that scale, and a value beyond :math:`q_{max} s` saturates at :math:`\pm q_{max}`: a prompt should hold the
  range the generation will (give the scales yourself otherwise). :meth:`DecodeCache.reset` forgets calibrated
  scales; the next prompt calibrates again. Calibration runs on an eager step (a per-tensor scale is read back
  once: fdlib takes it as a float).

**A value that is not finite** (NaN, ±∞) in the K or V of a token of sequence b and KV head h is kept: from
the step that writes it on, every query of b that reads it has a NaN output in every query head of KV head h.
A 16-bit cache's is NaN or infinite there (:math:`q\cdot k` = ±∞ or NaN, the softmax of +∞ NaN,
:math:`p\,v` = ±∞), except where an infinite key gives a logit of −∞ (weight 0); the 8-bit cache gives NaN
there too. Queries of the same step before that token may be NaN as well (in a 16-bit cache they are, for a
value in V: weight 0 times NaN). Every other output (other sequences, other KV heads' query heads, earlier
steps, and those earlier queries of the step where they stay finite) is bit for bit that of the same run with
those values 0. (Where a plan reads KV heads packed, two adjacent heads as one,
:func:`fdlib.plan.pack_decision`, a NaN stored in one head also makes the other's queries NaN, as in a 16-bit
cache.)

How the token is kept (:mod:`fdlib.hf.append`): with per-token scales its scale is NaN; in e4m3 with fixed
scales its non-finite values are e4m3's NaN; int8 has no NaN, so with fixed scales each layer records the
position :math:`f_{bh}` of the first such token (``layer.nonfinite_from``, int32 ``[B_max, H_kv]``, else
:data:`ALL_FINITE`), and decode sets to NaN the outputs of sequence b in the query heads of KV head h where
:math:`f_{bh} < L_b` (after the step): every query of the step that writes it and of every later step
(:meth:`KV8.nonfinite_output`, two elementwise operations, only for such a cache). A later prefill chunk reads
the dequantized cache (:meth:`KV8.dequantized`), NaN at those tokens (int8: key :math:`f_{bh}`, as a 16-bit
cache's would be NaN there). Calibration ignores the values that are not finite (:meth:`KV8.calibrate`),
:meth:`DecodeCache.reset` forgets the recorded positions, and :meth:`DecodeCache.set_lengths` those it cuts off.
"""
from __future__ import annotations

import numbers

import torch

from ..quant import GRANULARITIES, KV_DTYPES, QMAX, absmax_scale, dequantize_kv

ALL_FINITE = 2 ** 31 - 1
"""``layer.nonfinite_from`` of a sequence and KV head that holds no token that is not finite (past every key)."""


class KV8:
    """The 8-bit format of a cache (``dtype``, ``granularity``) and whether its fixed scales are calibrated."""

    def __init__(self, kv_dtype, granularity: str, k_scale, v_scale, model_dtype, n_layers: int, H_kv: int):
        if kv_dtype is None:
            raise ValueError("k_scale/v_scale: fixed scales are for an 8-bit cache; pass kv_dtype=torch.float8_e4m3fn "
                             "or torch.int8 too")
        if kv_dtype not in KV_DTYPES:
            raise TypeError(f"kv_dtype: expected None, torch.float8_e4m3fn or torch.int8, got {kv_dtype}")
        if model_dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"dtype: an 8-bit DecodeCache (kv_dtype={kv_dtype}) serves a float16 or bfloat16 model "
                            f"(fdlib's 8-bit kernels dequantize to q's dtype), got {model_dtype}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity: expected one of {', '.join(map(repr, GRANULARITIES))}, got "
                             f"{granularity!r}")
        self.dtype, self.granularity, self.token = kv_dtype, granularity, granularity == "token"
        given = [s is not None for s in (k_scale, v_scale)]
        if self.token and any(given):
            raise ValueError("k_scale/v_scale: per-token scales are made as each token is written; pass none with "
                             "granularity='token'")
        if given[0] != given[1]:
            raise ValueError("k_scale/v_scale: give both fixed scales, or neither (both calibrated from the prefill)")
        self.calibrating = not self.token and not given[0]
        self.fixed = None if self.token or self.calibrating else \
            [_per_layer(name, s, granularity, n_layers, H_kv) for name, s in (("k_scale", k_scale),
                                                                                ("v_scale", v_scale))]
        self.calibrated = False
        self.marks = kv_dtype == torch.int8 and not self.token   # no NaN to store: positions are recorded

    def scales(self, shape, n_layers: int, device) -> list:
        """Each layer's (k_scale, v_scale) tensors: float32 ``shape[:3]`` per token, else ``[H_kv]`` (ones until
        calibrated, or the given ones)."""
        if self.token:
            return [(torch.ones(shape[:3], dtype=torch.float32, device=device),
                     torch.ones(shape[:3], dtype=torch.float32, device=device)) for _ in range(n_layers)]
        H = shape[2]
        if self.fixed is None:
            return [(torch.ones(H, dtype=torch.float32, device=device),
                     torch.ones(H, dtype=torch.float32, device=device)) for _ in range(n_layers)]
        return [tuple(s[i].to(device=device, dtype=torch.float32).expand(H).contiguous() for s in self.fixed)
                for i in range(n_layers)]

    def nonfinite_from(self, B_max: int, H_kv: int, n_layers: int, device) -> list:
        """Each layer's ``nonfinite_from`` (int32 ``[B_max, H_kv]``, all :data:`ALL_FINITE`) where :attr:`marks`
        (int8, fixed scales), else None."""
        return [torch.full((B_max, H_kv), ALL_FINITE, dtype=torch.int32, device=device) if self.marks else None
                for _ in range(n_layers)]

    def nonfinite_output(self, layer, out: torch.Tensor, lengths: torch.Tensor) -> None:
        r"""NaN, in place, in decode's ``out`` ``[B, T, H_q, D]`` wherever sequence b holds a token that is not
        finite in KV head h (module doc): every query of b, in the query heads of KV head h, where
        :math:`f_{bh} < L_b` (``lengths`` [B], after the step). Two elementwise operations, no sync (it captures
        in a CUDA graph)."""
        if not self.marks:
            return
        held = layer.nonfinite_from[:out.shape[0]] < lengths[:, None]               # [B, H_kv]
        out.unflatten(2, (held.shape[1], -1)).masked_fill_(held[:, None, :, None, None], float("nan"))

    def host_scales(self, layer) -> None:
        """A per-tensor layer's scales as floats (``layer.k_host``/``v_host``: fdlib takes a per-tensor scale as a
        float): one sync, when the scales are set."""
        if self.granularity == "tensor":
            layer.k_host, layer.v_host = float(layer.k_scale[0]), float(layer.v_scale[0])

    def calibrate(self, layer, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None) -> None:
        """Set ``layer``'s fixed scales from a first step's K/V ``[B, H_kv, T, D]`` (pad tokens excluded, and values
        that are not finite: a NaN or infinity in one sequence's K or V would make the shared scale NaN or infinite
        and every sequence's output NaN, where a 16-bit cache keeps it to that sequence)."""
        qmax = QMAX[self.dtype]
        for x, s in ((k, layer.k_scale), (v, layer.v_scale)):
            a = x.abs()
            a = a.masked_fill(~torch.isfinite(a), 0)
            if real is not None:
                a = a.masked_fill(~real[:, None, :, None], 0)
            amax = (a.amax((0, 2, 3)) if self.granularity == "head" else a.amax().expand(s.shape[0])).float()
            s.copy_(absmax_scale(amax, qmax))
        self.host_scales(layer)

    def run_scales(self, layer, B: int, paged: bool) -> tuple:
        """(k_scale, v_scale) as fdlib's run takes them for ``layer``: floats per tensor, the ``[H_kv]`` tensors
        per head, the per-token tensors (of the first B sequences unless paged)."""
        if self.granularity == "tensor":
            return layer.k_host, layer.v_host
        if self.granularity == "head" or paged:
            return layer.k_scale, layer.v_scale
        return layer.k_scale[:B], layer.v_scale[:B]

    def dequantized(self, stored: torch.Tensor, scale: torch.Tensor, dtype,
                    nonfinite_from: torch.Tensor | None = None) -> torch.Tensor:
        """``stored`` ``[B, n, H_kv, D]`` (keys 0 .. n - 1) times its scales (``[B, n, H_kv]`` per token, else
        ``[H_kv]``), in ``dtype``: multiplied in float32 (the scale as it is kept, as the decode kernels apply it),
        then rounded once: a scale cast to float16 first would lose bits below its normal range 2^-14 (a token or
        head whose max|x| lies below 2^-14 q_max: about 0.027 for e4m3, 0.0078 for int8), or become 0.
        ``nonfinite_from`` (``[B, H_kv]``, where :attr:`marks`): key :math:`f_{bh}` of sequence b and KV head h is
        NaN, K and V (the first such token: a query that reads any of them reads it too)."""
        out = dequantize_kv(stored, scale, dtype=torch.float32).to(dtype)
        if nonfinite_from is not None:
            keys = torch.arange(stored.shape[1], device=stored.device)
            bad = keys[None, :, None] == nonfinite_from[:, None, :]                 # [B, n, H_kv]
            out.masked_fill_(bad[..., None], float("nan"))
        return out


def _per_layer(name, s, granularity, n_layers, H_kv) -> list:
    """A fixed scale as one float32 tensor ([1] or [H_kv]) a layer, checked: finite, positive."""
    items = list(s) if isinstance(s, (list, tuple)) else [s] * n_layers
    if len(items) != n_layers:
        raise ValueError(f"{name}: expected one scale or a list of {n_layers} (one a layer), got {len(items)}")
    out = []
    for x in items:
        _check_type(name, x, granularity)
        try:
            t = torch.as_tensor(x, dtype=torch.float32).detach().cpu().reshape(-1)
        except OverflowError:   # an int beyond float: refused below as infinite
            t = torch.full((1,), float("inf"))
        if t.numel() not in ((1,) if granularity == "tensor" else (1, H_kv)):
            want = "a float" if granularity == "tensor" else f"a float or a float32 tensor [H_kv] = [{H_kv}]"
            raise ValueError(f"{name}: expected {want} (granularity={granularity!r}), got {x!r}")
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            tiny = (" (as float32: a positive value below its smallest, about 1.4e-45, rounds to 0)"
                    if isinstance(x, (int, float)) and x > 0 and bool((t == 0).any()) else "")
            raise ValueError(f"{name}: scales must be finite and positive, got {t.tolist()}{tiny}")
        out.append(t)
    return out


def _check_type(name, x, granularity) -> None:
    """One layer's fixed scale: a real number (not a bool, as fdlib's scales), or a floating tensor or NumPy
    array."""
    if isinstance(x, torch.Tensor):
        ok = x.is_floating_point()
        got = f"a {str(x.dtype).replace('torch.', '')} tensor"
    else:
        ok = isinstance(x, numbers.Real) and not isinstance(x, bool) or \
            type(x).__name__ == "ndarray" and getattr(x.dtype, "kind", None) == "f"
        got = type(x).__name__
    if not ok:
        want = "a float" if granularity == "tensor" else "a float or a float32 tensor [H_kv]"
        raise TypeError(f"{name}: expected {want} (or a list of those, one a layer), got {got}")
