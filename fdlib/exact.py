r"""Exact decode without a running max: FlashDecoding++'s unified-max softmax, its safe window, and φ.

**The idea** (Hong et al., *FlashDecoding++*, MLSys 2024). Softmax does not care which number is subtracted
from the logits before exponentiating:

.. math::
    \operatorname{softmax}(s)_j = \frac{e^{s_j-\varphi}}{\sum_i e^{s_i-\varphi}}\quad\text{for any }\varphi .

Flash-Decoding takes φ = the running max m, which every split learns only for itself, so its partials need
the log-sum-exp merge. With one φ fixed ahead of time (per query head h, or per row (b, h)), every split
computes :math:`\ell_i = \sum_{j\in i} e^{s_j-\varphi}` and :math:`\tilde O_i = \sum_{j\in i} e^{s_j-\varphi}v_j`
and the partials are simply added: :math:`O = \sum_i\tilde O_i / \sum_i\ell_i`, :math:`\text{lse} = \varphi +
\log\sum_i\ell_i`. No split waits for another's max, and no tile rescales its accumulator.

**The float32 exponent window.** This is exact only while every :math:`e^{x}`, :math:`x = s - \varphi`, is a
normal float32 and no sum overflows. float32 is finite below :math:`\text{FLT\_MAX} \approx 3.40\cdot10^{38}
= e^{88.72}` and normal above :math:`\text{FLT\_MIN} = 2^{-126} = e^{-87.34}`; below that, numbers are
denormal (fewer significant bits; GPUs' fast ``exp2`` flushes them to 0) and finally 0. So a window
[w_lo, w_hi] for x must sit inside :math:`[\ln\text{FLT\_MIN}, \ln\text{FLT\_MAX}] = [-87.34, 88.72]`, and
tighter still, because the kernel *adds* up to L terms:

* **upper end w_hi** (overflow): :math:`\ell \le L e^{w_{hi}}` and :math:`|\tilde O_d| \le L e^{w_{hi}} V` for
  values :math:`|v| \le V`; both finite when :math:`w_{hi} \le \ln\text{FLT\_MAX} - \ln L - \ln V`.
  :data:`V_BOUND` = 65504 (the float16 maximum) by default; a larger value that overflows Õ is still caught,
  by the finaliser's finiteness check, and recomputed.
* **lower end w_lo** (underflow): each term :math:`p_j = e^{x_j} \ge e^{w_{lo}}` is normal, so
  :math:`\ell \ge e^{w_{lo}}`;
  a product :math:`p_j v_{jd}` may still fall below FLT_MIN and lose up to :math:`2^{-149}` (the denormal
  spacing) each, :math:`L\,2^{-149}` over the row; relative to ℓ this is at most float32's unit roundoff
  :math:`2^{-24}` when :math:`e^{w_{lo}} \ge L\,2^{-125}`, i.e. :math:`w_{lo} \ge \ln L - 125\ln 2`.

:func:`default_window` returns :math:`w_{lo} = \ln L - 125\ln 2`,
:math:`w_{hi} = \ln\text{FLT\_MAX} - \ln L - \ln V`
(about [−74.9, 65.9] for L = 128k: a window some 140 nats wide). A valid logit outside it marks its row, which
is then recomputed with the exact online softmax: the answer is always exact; only speed depends on φ. The
same window for float16 accumulators (``acc_dtype=torch.float16``, for comparison only: the kernel always
accumulates in float32) is empty for any useful L, which is why the accumulators here are float32.

**Choosing φ.** :func:`calibrate_phi` takes the largest logit seen per head in sample logits (the largest
sampled logit lands at x = 0: w_hi of headroom above it, |w_lo| below it). Without a φ,
:func:`unified_max_attention` estimates one per row (b, h) from the row's first
:data:`FIRST_KEYS` keys (their largest logit, one small batched product on the device: no host sync); a
|q|·max|k| bound was rejected because by Cauchy-Schwarz it overshoots q·k by about √D, pushing real logits
toward the bottom of the window. :func:`recompute_rate` / :func:`recompute_curve` measure how often rows leave
the window for a φ, for the notebook's plot.

The kernels are :mod:`fdlib.kernels.unified_max`; :func:`unified_max_attention` is the checked, allocating entry
point and :func:`run_unified_max` the launch-only one a plan calls.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from . import runtime
from .kernels.unified_max import REDUCES, check_reduce, make_workspace, workspace_bytes  # noqa: F401
from .kernels.unified_max import launchers as _launchers
from .kernels.unified_max import run_unified_max as _run

FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN = torch.finfo(torch.float32).tiny      # smallest normal float32, 2^-126
LN_FLT_MAX = math.log(FLT_MAX)                 # 88.7228
LN_FLT_MIN = math.log(FLT_MIN)                 # -87.3365
V_BOUND = 65504.0
"""|v| the default window's upper end allows for (the float16 maximum)."""
FIRST_KEYS = 64
"""Keys per row the φ estimate of :func:`unified_max_attention` looks at when no φ is given."""


class Window(NamedTuple):
    """The safe window [w_lo, w_hi] for x = s − φ, in natural-log units (e-folds): ``lo`` is w_lo, ``hi`` w_hi."""
    lo: float
    hi: float


def default_window(L_max: int, *, acc_dtype=torch.float32, v_bound: float = V_BOUND) -> Window:
    r"""The widest window for sums of up to ``L_max`` terms in ``acc_dtype`` (module docstring):
    :math:`w_{lo} = \ln L + \ln\delta - \ln u`, :math:`w_{hi} = \ln\text{max} - \ln L - \ln V`, with δ the
    dtype's denormal spacing, u its unit roundoff and max its largest finite value; for float32 (δ = 2^-149,
    u = 2^-24) :math:`w_{lo} = \ln L - 125\ln 2`, :math:`w_{hi} = \ln\text{FLT\_MAX} - \ln L - \ln V`. Raises
    ``ValueError`` if that window is empty (float16 accumulators at any useful L)."""
    if isinstance(L_max, bool) or not isinstance(L_max, int) or L_max < 1:
        raise ValueError(f"L_max: expected an int >= 1 (the most keys a row sums), got {L_max!r}")
    if not (isinstance(v_bound, (int, float)) and math.isfinite(v_bound) and v_bound >= 1):
        raise ValueError(f"v_bound: expected a finite number >= 1 (a bound on |v|), got {v_bound!r}")
    fi = torch.finfo(acc_dtype)
    spacing = fi.tiny * fi.eps             # the denormal spacing: tiny · 2^-(mantissa bits)
    unit = fi.eps / 2                      # unit roundoff (2^-24 for float32)
    w_lo = math.log(L_max) + math.log(spacing) - math.log(unit)
    w_hi = math.log(fi.max) - math.log(L_max) - math.log(v_bound)
    if not w_lo < w_hi:
        raise ValueError(f"acc_dtype: {acc_dtype} sums of {L_max} terms leave no safe window (w_lo={w_lo:.2f} >= "
                         f"w_hi={w_hi:.2f}); accumulate in float32")
    return Window(w_lo, w_hi)


def check_window(window, L_max: int) -> Window:
    """A caller's window as a :class:`Window`, checked: w_lo < w_hi, both finite, inside float32's range for
    sums of L_max terms (w_lo >= ln FLT_MIN, w_hi <= ln FLT_MAX − ln L_max). ``ValueError`` names what is wrong."""
    try:
        w_lo, w_hi = (float(x) for x in window)
    except (TypeError, ValueError):
        raise TypeError(f"window: expected a pair (w_lo, w_hi) of numbers, got {window!r}") from None
    if not (math.isfinite(w_lo) and math.isfinite(w_hi) and w_lo < w_hi):
        raise ValueError(f"window: expected finite w_lo < w_hi, got ({w_lo}, {w_hi})")
    if w_lo < LN_FLT_MIN:
        raise ValueError(f"window: w_lo={w_lo:.2f} lets e^x go denormal; float32 needs w_lo >= ln(FLT_MIN) = "
                         f"{LN_FLT_MIN:.2f}")
    hi = LN_FLT_MAX - math.log(max(L_max, 1))
    if w_hi > hi:
        raise ValueError(f"window: w_hi={w_hi:.2f} lets a sum of L_max={L_max} terms overflow float32; need w_hi <= "
                         f"ln(FLT_MAX) - ln(L_max) = {hi:.2f}")
    return Window(w_lo, w_hi)


# ------------------------------------------------------------------------------------------------ φ
def calibrate_phi(sample_logits: torch.Tensor, *, head_dim: int = -2) -> torch.Tensor:
    r"""φ per query head from sample logits :math:`s = \text{scale}\,q\cdot k` (natural units): the largest finite
    sample of each head (−inf entries are masked keys and ignored; a head with none gets 0).

    ``sample_logits``: any shape with the heads on ``head_dim`` (default ``[..., H_q, N]``), e.g. the logits
    of a few prompts' decode steps. Returns float32 ``[H_q]`` on the samples' device."""
    if not isinstance(sample_logits, torch.Tensor) or not sample_logits.is_floating_point():
        raise TypeError(f"sample_logits: expected a floating-point tensor, got {type(sample_logits).__name__}"
                        + (f" of {sample_logits.dtype}" if isinstance(sample_logits, torch.Tensor) else ""))
    if sample_logits.dim() < 1 or sample_logits.numel() == 0:
        raise ValueError(f"sample_logits: expected a non-empty tensor, got shape {list(sample_logits.shape)}")
    if torch.isnan(sample_logits).any() or torch.isposinf(sample_logits).any():
        raise ValueError("sample_logits: contains NaN or +inf (only finite values and -inf for masked keys)")
    s = sample_logits.float().movedim(head_dim, 0).reshape(sample_logits.shape[head_dim], -1)
    mx = s.amax(dim=1)
    return torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))


def _phi_rows(phi, B: int, H_q: int) -> torch.Tensor:
    """φ broadcast to [B, H_q] float32 (from a number, [H_q] or [B, H_q])."""
    phi = torch.as_tensor(phi, dtype=torch.float32)
    if phi.dim() == 0:
        phi = phi.expand(H_q)
    if phi.dim() == 1:
        phi = phi[None, :]
    return phi.expand(B, H_q)


def would_mark(logits: torch.Tensor, phi, window) -> torch.Tensor:
    r"""The rows the kernel marks (no overflow elsewhere): row r of ``logits [..., L]`` (natural units; −inf =
    masked key) is marked when a finite logit has :math:`s - \varphi_r \notin [w_{lo}, w_{hi}]`. ``phi`` broadcasts
    against ``logits.shape[:-1]``. Returns a bool tensor of shape ``logits.shape[:-1]``."""
    w_lo, w_hi = window
    valid = torch.isfinite(logits)
    phi = torch.as_tensor(phi, dtype=logits.dtype, device=logits.device)
    x = logits - phi[..., None]
    return (valid & ((x > w_hi) | (x < w_lo))).any(dim=-1)


def recompute_rate(logits: torch.Tensor, phi, window) -> float:
    """The fraction of rows of ``logits [..., L]`` with at least one key (a finite logit) that
    :func:`would_mark` marks; 0.0 if no row has a key."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError("logits: expected a floating-point tensor [..., L]")
    rows = torch.isfinite(logits).any(dim=-1)
    n = int(rows.sum())
    return 0.0 if n == 0 else float((would_mark(logits, phi, window) & rows).sum()) / n


LOGIT_KINDS = ("gaussian", "student_t")


def synthetic_logits(kind: str = "gaussian", *, rows: int = 512, L: int = 4096, std: float = 3.0,
                     row_std: float = 2.0, df: int = 3, seed: int = 0) -> torch.Tensor:
    r"""Logits ``[rows, L]`` of a stated kind, for recompute-rate curves (float32, CPU, seeded):

    * ``"gaussian"``: :math:`s_{rj} = \mu_r + \sigma z_{rj}`, :math:`z \sim N(0, 1)` (q·k of random vectors);
    * ``"student_t"``: :math:`s_{rj} = \mu_r + \sigma t_{rj}`, :math:`t` Student-t with ``df`` degrees of freedom
      (heavy tails: a few keys far above the rest, as attention sinks and outlier tokens do);

    with a level :math:`\mu_r \sim N(0, \text{row\_std}^2)` per row (rows of one head sit at different
    heights, which one φ per head must cover)."""
    if kind not in LOGIT_KINDS:
        raise ValueError(f"kind: expected one of {LOGIT_KINDS}, got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(rows, 1, generator=g) * row_std
    z = torch.randn(rows, L, generator=g)
    if kind == "student_t":   # t = z / sqrt(chi2_df / df), chi2_df a sum of df squared standard normals
        if isinstance(df, bool) or not isinstance(df, int) or not 1 <= df <= 64:
            raise ValueError(f"df: expected an int from 1 to 64 (degrees of freedom), got {df!r}")
        chi2 = torch.zeros(rows, L)
        for _ in range(df):
            chi2 += torch.randn(rows, L, generator=g) ** 2
        z = z / torch.sqrt(chi2 / df)
    return (mu + std * z).float()


def recompute_curve(phis, *, kinds=LOGIT_KINDS, window: Window | None = None, rows: int = 512, L: int = 4096,
                    std: float = 3.0, row_std: float = 2.0, df: int = 3, seed: int = 0) -> dict:
    r"""Recompute rate against φ for each logit kind of :func:`synthetic_logits` (same parameters), with one φ
    for all rows (φ per head, the rows being one head's sequences). ``window`` defaults to
    :func:`default_window` (L). Returns ``{"phi": [...], "rate": {kind: [...]}, "window": (w_lo, w_hi),
    "setup": {...}}``: the rate is the fraction of rows with a logit outside [φ + w_lo, φ + w_hi].

    With the float32 window the Gaussian rows stay inside over a plateau some 100 nats wide; the heavy-tailed
    rows leave it far more often, through both ends (a key far *below* φ marks its row too under the
    per-logit rule, although such a key hardly contributes)."""
    phis = torch.as_tensor(phis, dtype=torch.float64).flatten()
    window = default_window(L) if window is None else Window(*window)
    rates = {}
    for kind in kinds:
        s = synthetic_logits(kind, rows=rows, L=L, std=std, row_std=row_std, df=df, seed=seed).double()
        hi, lo = s.amax(dim=1), s.amin(dim=1)          # a row leaves the window iff its max or min does
        marked = (hi[None, :] - phis[:, None] > window.hi) | (lo[None, :] - phis[:, None] < window.lo)
        rates[kind] = marked.double().mean(dim=1).tolist()
    return {"phi": phis.tolist(), "rate": rates, "window": (window.lo, window.hi),
            "setup": dict(rows=rows, L=L, std=std, row_std=row_std, df=df, seed=seed,
                          note="s = mu_r + std*z, mu_r ~ N(0, row_std^2); z ~ N(0,1) or Student-t(df)")}


# ---------------------------------------------------------------------------------------------- attention
def estimate_phi(q, k_cache, lens, scale: float, block_table=None, first_keys: int = FIRST_KEYS) -> torch.Tensor:
    r"""φ per row (b, h) when none is given: the largest logit :math:`\text{scale}\,q_{b,h}\cdot k_{b,j}` over the
    row's first ``min(L_b, first_keys)`` keys (0 for an empty row). float32 ``[B, H_q]`` on q's device; torch
    ops only (no host sync)."""
    B, H_q, D = q.shape
    H_kv = k_cache.shape[2]
    if block_table is None:
        n = min(first_keys, k_cache.shape[1])
        k = k_cache[:, :n]
    else:
        page = k_cache.shape[1]
        pages = min(-(-first_keys // page), block_table.shape[1])
        idx = block_table[:, :pages].long().clamp(0, k_cache.shape[0] - 1)
        k = k_cache[idx].reshape(B, pages * page, H_kv, D)
        n = min(first_keys, k.shape[1])
        k = k[:, :n]
    if n == 0:
        return torch.zeros(B, H_q, dtype=torch.float32, device=q.device)
    qg = q.float().reshape(B, H_kv, H_q // H_kv, D)
    s = torch.matmul(qg, k.float().permute(0, 2, 3, 1)) * scale            # [B, H_kv, group, n]
    keep = torch.arange(n, device=q.device)[None, :] < lens.to(q.device)[:, None]
    s = s.masked_fill(~keep[:, None, None, :], float("-inf")).reshape(B, H_q, n)
    mx = s.amax(dim=-1)
    return torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))


def run_unified_max(q, k, v, lens, *, scale, phi, window, out, lse, num_splits, chunk, cfg, workspace,
                    block_table=None, launch=None):
    r"""Launch-only unified-max decode (for :mod:`fdlib.plan`): no host sync, no allocation, graph-capturable.
    Pass 1 adds the φ-scaled partials and marks rows, pass 2 recomputes marked rows exactly
    (:mod:`fdlib.kernels.unified_max`). Writes ``out`` [B, H_q, D] (q's dtype), ``lse`` [B, H_q] float32 and
    ``workspace.marks`` [B, H_q] int32 (1 = recomputed).

    Arguments as :func:`fdlib.kernels.unified_max.run_unified_max`: ``phi`` float32 [H_q] or [B, H_q] on the
    device, ``window`` (w_lo, w_hi) checked with :func:`check_window`, ``num_splits``/``chunk``/``cfg`` as a plan's
    Decision (splits, chunk, tile).

    **Workspace** (:func:`make_workspace` (B, H_q, H_kv, D, num_splits, device, reduce); its size is
    :func:`workspace_bytes`): with splits > 1, float32 slots ``[B, H_q, splits, D]`` and ``[B, H_q, splits]``
    (pass 1's Õ_i, ℓ_i in ticket mode; pass 2's O_i, lse_i), plus int32 flags ``[B, H_q, splits]`` (ticket) or
    float32 accumulators ``[B, H_q, D]``, ``[B, H_q]`` and int32 ``[B, H_q]`` (atomic); always int32 ticket counters
    ``[B·H_kv]``, marks ``[B, H_q]`` and a clamp flag ``[1]``. Counters and accumulators are zero when made and
    are left zero by every call; one workspace serves one call at a time."""
    _run(q, k, v, lens, scale=scale, phi=phi, window=window, out=out, lse=lse, splits=num_splits, chunk=chunk,
         cfg=cfg, workspace=workspace, block_table=block_table, launch=launch)


def unified_max_attention(q, k_cache, v_cache, cache_seqlens=None, *, phi=None, scale=None, window=None,
                          num_splits=None, block_table=None, return_lse: bool = False, return_stats: bool = False,
                          reduce: str = "ticket", clamp_flag=None):
    r"""Decode attention with FlashDecoding++'s unified-max softmax, exact on every row.

    .. math:: O_{b,h} = \frac{\sum_{j<L_b} e^{s_j-\varphi}\,v_j}{\sum_{j<L_b} e^{s_j-\varphi}},\qquad
              \text{lse}_{b,h} = \varphi + \log\sum_{j<L_b} e^{s_j-\varphi},\qquad s_j = \text{scale}\;q\cdot k_j

    computed with a fixed φ (module docstring); rows where a logit leaves the window are recomputed with the
    exact online softmax.

    Args:
        q, k_cache, v_cache, cache_seqlens, scale, block_table: as :func:`fdlib.decode_attention` (q
            ``[B, H_q, D]`` or ``[B, 1, H_q, D]``; contiguous ``[B, L_max, H_kv, D]`` or paged caches).
        phi: a number, float32 ``[H_q]`` (:func:`calibrate_phi`) or ``[B, H_q]``, in natural units; None:
            :func:`estimate_phi` (first :data:`FIRST_KEYS` keys of each row).
        window: (w_lo, w_hi); default :func:`default_window` (L_max).
        num_splits: splits per row (default: fdlib's cost model, as for ``method="unified"``).
        return_lse: also return lse. return_stats: return ``(out, lse, stats)``, stats a dict with
            ``marked`` (bool ``[B, H_q]`` on the CPU: the rows recomputed), ``recompute_rate`` (marked / rows
            with at least one key), ``phi``, ``window``, ``splits``, ``reduce`` (reads the marks: a sync).
        reduce: ``"ticket"`` (deterministic) or ``"atomic"`` (:mod:`fdlib.kernels.unified_max`).
        clamp_flag: an int32 ``[1]`` tensor on q's device that the call sets to 1 when it clamps a device length
            or a used page index (default: the call's own, dropped with it); :func:`fdlib.decode_attention` passes
            the flag that :func:`fdlib.clamped` reads.
    """
    from .plan import check_length_values, decide, host_lengths
    from .quant import is_8bit
    from .validate import check_inputs
    if is_8bit(k_cache) or is_8bit(v_cache):
        raise NotImplementedError("k_cache/v_cache: unified_max_attention does not read 8-bit caches yet; "
                                  "fdlib.decode_attention's other methods take them with k_scale/v_scale")
    pr = check_inputs(q, k_cache, v_cache, cache_seqlens, scale, "unified", num_splits, return_lse, block_table)
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats: expected a bool, got {type(return_stats).__name__}")
    check_reduce(reduce)
    runtime.smoke_check()
    q3, B, H_q, H_kv, D, L_max = pr.q, pr.B, pr.H_q, pr.H_kv, pr.D, pr.L_max
    device = q.device
    host = None
    if cache_seqlens is None:
        lens = torch.full((B,), L_max, dtype=torch.int32, device=device)
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.device == device:
        if device.type == "cpu":   # on the host (Triton's interpreter): checked as a list is, as plan.run does
            check_length_values(cache_seqlens, L_max)
        lens = cache_seqlens.contiguous()
    else:
        host = host_lengths(cache_seqlens, B, L_max, device)
        lens = host.to(device)
    win = default_window(max(L_max, 1)) if window is None else check_window(window, max(L_max, 1))
    if phi is None:
        phi_t = estimate_phi(q3, k_cache, lens, pr.scale, block_table)
    else:
        if isinstance(phi, bool) or not isinstance(phi, (int, float, torch.Tensor)):
            raise TypeError(f"phi: expected a number, a tensor [H_q] or [B, H_q], or None, got {type(phi).__name__}")
        phi_t = torch.as_tensor(phi, dtype=torch.float32).to(device)
        if (phi_t.dim() > 2 or (phi_t.dim() >= 1 and phi_t.shape[-1] != H_q)
                or (phi_t.dim() == 2 and phi_t.shape[0] != B)):
            raise ValueError(f"phi: expected a number, [H_q={H_q}] or [B={B}, H_q={H_q}], got shape "
                             f"{list(phi_t.shape)}")
        if not bool(torch.isfinite(phi_t).all()):
            raise ValueError("phi: every value must be finite")
        phi_t = _phi_rows(phi_t, B, H_q).contiguous() if phi_t.dim() == 0 else phi_t.contiguous()
    d = decide(B, H_q, H_kv, D, L_max, q.dtype, method="unified", num_splits=num_splits,
               lengths=None if host is None else tuple(host.tolist()))
    ws = make_workspace(B, H_q, H_kv, D, d.splits, device, reduce)
    if clamp_flag is not None:
        if (not isinstance(clamp_flag, torch.Tensor) or clamp_flag.dtype != torch.int32
                or tuple(clamp_flag.shape) != (1,) or clamp_flag.device != device):
            raise ValueError(f"clamp_flag: expected an int32 tensor [1] on {device}")
        ws = dataclasses.replace(ws, flag=clamp_flag)
    out3 = torch.empty_like(q3)
    lse = torch.empty((B, H_q), dtype=torch.float32, device=device)
    launch = _launchers(q.dtype, H_q // H_kv, D, d.splits, d.tile, pr.page_size, reduce)
    run_unified_max(q3, k_cache, v_cache, lens, scale=pr.scale, phi=phi_t, window=win, out=out3, lse=lse,
                    num_splits=d.splits, chunk=d.chunk, cfg=d.tile, workspace=ws, block_table=block_table,
                    launch=launch)
    out = out3[:, None] if pr.q_was_4d else out3
    if not return_stats:
        return (out, lse) if return_lse else out
    marked = ws.marks.cpu().bool()
    nonempty = (lens.cpu().clamp(0, L_max) > 0)[:, None].expand(B, H_q)
    n = int(nonempty.sum())
    stats = {"marked": marked, "recompute_rate": 0.0 if n == 0 else float((marked & nonempty).sum()) / n,
             "phi": phi_t.cpu(), "window": (win.lo, win.hi), "splits": d.splits, "reduce": reduce}
    return out, lse, stats


__all__ = ["Window", "default_window", "check_window", "calibrate_phi", "would_mark", "recompute_rate",
           "synthetic_logits", "recompute_curve", "estimate_phi", "run_unified_max", "unified_max_attention",
           "make_workspace", "workspace_bytes", "LOGIT_KINDS", "REDUCES"]
