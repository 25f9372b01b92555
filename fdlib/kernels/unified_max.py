r"""FlashDecoding++'s unified-max ("asynchronized") softmax in Triton: partials scaled by one fixed φ, simply added.

The split kernels keep a running max m per split and rescale when it grows; their partials can only be merged
with log-sum-exp weights, which need every split's max. Here every program of query head h scales its
exponentials by the **same** number :math:`\varphi_h` (or :math:`\varphi_{b,h}`), fixed before the launch:

.. math::
    x_j = s_j - \varphi,\qquad \ell_i = \sum_{j\in\text{split } i} e^{x_j},\qquad
    \tilde O_i = \sum_{j\in\text{split } i} e^{x_j} v_j \quad(\text{float32}),\\
    \ell = \sum_i \ell_i,\quad \tilde O = \sum_i \tilde O_i,\qquad O = \tilde O/\ell,\qquad
    \text{lse} = \varphi + \log\ell

so no program ever needs another's max, and no tile rescales its accumulator. This is exact softmax
(:math:`e^{s_j}/\sum e^{s_i}` with a common factor :math:`e^{-\varphi}` cancelled) as long as every
:math:`e^{x_j}` is a normal float32 and the sums do not overflow: a program that sees a valid logit with
:math:`x_j \notin [w_{lo}, w_{hi}]` (the window of :mod:`fdlib.exact`) **marks** its row. Two launches, no host sync:

1. :func:`unified_max_kernel`, grid ``(B, H_kv, splits)`` (GQA: each K/V tile is read once for the group's
   query heads). A row of one split finalises itself. Otherwise each program hands its unnormalised partial
   :math:`(\tilde O_i, \ell_i, \text{flag}_i)` over, either

   * ``reduce="ticket"`` (the default): stores it in slot i of the row's workspace, takes the row's ticket
     (:func:`~fdlib.kernels.tile.take_ticket`), and the last program adds the slots **in split order** (a plain
     sum, no exponentials): deterministic run to run, and no worse than the unified kernel's merge (it reads
     the same number of slots); or
   * ``reduce="atomic"``: ``tl.atomic_add`` of :math:`\tilde O_i` and :math:`\ell_i` into one float32
     accumulator per row, then the ticket; the last program reads the sums and zeroes the accumulator. No slot
     reads at the end, but float addition is not associative and the atomics land in whatever order the
     programs finish, so results may differ in the last bits from run to run (not batch-invariant). It saves
     the last program's read of splits·group·D floats, at the price of that many atomic adds in L2; which is
     faster is for :mod:`fdlib.bench.unified_max` to measure, so the deterministic one is the default.

   The finaliser writes :math:`O = \tilde O/\ell` and :math:`\text{lse} = \varphi + \log\ell`, and ``marks[b, h]``
   = 1 when a split flagged the row, or when :math:`\ell` or :math:`\tilde O` is not finite, or
   :math:`\ell < e^{w_{lo}}` (a second net under the window: NaN inputs, values too large for the window's bound);
   else 0. Every row's mark is written on every call, so nothing has to be cleared between calls.
2. :func:`recompute_kernel`, same grid: a program whose group has no marked query head exits at once;
   otherwise it recomputes its split with the exact online softmax (:func:`~fdlib.kernels.tile.tile_update`,
   running max, as the unified kernel does) and the row's last program merges the partials with log-sum-exp
   weights (:func:`~fdlib.kernels.tile.combine_heads`), overwriting O and lse of the whole group. Marked rows are never
   skipped; unmarked rows cost one early-exit program per split. (The alternative, reading the marks on the host
   and relaunching only when one is set, saves that launch but syncs, and cannot be captured in a CUDA graph.)

The product of the weights p with V keeps p in float32's range for every input dtype: float16/bfloat16 values are
widened (exactly) to tf32 for the tensor cores, so p keeps 10 mantissa bits (the exact kernels round p to fp16/bf16)
and the float32 window holds; p rounded to float16 would overflow above e^11 and the window would shrink to [ln 2^-14,
ln 65504], about 21 nats.

Empty rows (L_b = 0) give O = 0, lse = −∞ and are never marked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .config import block_sizes, fp32_dot
from .launch import Launcher, paging
from .tile import (LOG2E, attend_group, combine_blocks, combine_heads, kv_base, kv_start, kv_step, load_kv,
                   load_lengths, split_range, take_ticket, tile_update)

REDUCES = ("ticket", "atomic")


@triton.jit
def _finalize(acc, l, flagged, phi, nonempty, lo2, heads, mask_g, mask_gd, offs_d, OUT_ROW, stride_oh,
              LSE_ROW, stride_sh, MARK_ROW):
    """O = Õ/ℓ, lse = φ + log ℓ of the group's rows, and their marks (see the module doc)."""
    bad_o = tl.max(tl.where(mask_gd & ~(tl.abs(acc) < float("inf")), 1, 0), 1)
    ok_l = (l >= tl.exp2(lo2)) & (l < float("inf"))
    mark = nonempty & ((flagged > 0) | ~ok_l | (bad_o > 0))
    empty = l == 0.0
    o = acc / tl.where(empty, 1.0, l)[:, None]
    lse = tl.where(empty | ~nonempty, float("-inf"), phi + tl.log(tl.where(empty, 1.0, l)))
    o = tl.where(nonempty, o, 0.0)
    tl.store(OUT_ROW + heads[:, None] * stride_oh + offs_d[None, :], o.to(OUT_ROW.dtype.element_ty), mask=mask_gd)
    tl.store(LSE_ROW + heads * stride_sh, lse, mask=mask_g)
    tl.store(MARK_ROW + heads, mark.to(tl.int32), mask=mask_g)


@triton.jit
def unified_max_kernel(Q, K, V, LENS, PHI, O_PART, L_PART, F_PART, COUNTERS, OUT, LSE, MARKS, FLAG, BT,
                       stride_qb, stride_qh,
                       stride_kb, stride_kl, stride_kh,
                       stride_vb, stride_vl, stride_vh,
                       stride_phib, stride_phih,
                       stride_pb, stride_ph, stride_ps,
                       stride_lb, stride_lh,
                       stride_ob, stride_oh, stride_sb, stride_sh, stride_mb,
                       qk_scale, lo2, hi2, chunk, H_KV, L_MAX, stride_bt, n_pages,
                       GROUP: tl.constexpr, D: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, FP32_DOT: tl.constexpr,
                       PAGE: tl.constexpr, ATOMIC: tl.constexpr):
    """Pass 1. ``lo2``, ``hi2``: the window [w_lo, w_hi] in base 2 (w_lo·log₂e, w_hi·log₂e). Ticket mode: ``O_PART``
    [B, H_q, splits, D], ``L_PART``/``F_PART`` [B, H_q, splits]; atomic mode: ``O_PART`` [B, H_q, D],
    ``L_PART``/``F_PART`` [B, H_q] (stride_ps = 0, slot index ignored), zero between calls."""
    b = tl.program_id(0)
    h_kv = tl.program_id(1)
    split = tl.program_id(2)
    L = load_lengths(LENS, b, b >= 0, L_MAX, FLAG)
    n_splits = tl.minimum(tl.maximum(tl.cdiv(L, chunk), 1), tl.num_programs(2))
    if split < n_splits:
        start, end = split_range(split, n_splits, chunk, L)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_d = offs_d < D
        mask_g = offs_g < GROUP
        mask_gd = mask_g[:, None] & mask_d[None, :]
        heads = h_kv * GROUP + offs_g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_gd, other=0.0)
        phi = tl.load(PHI + b * stride_phib + heads * stride_phih, mask=mask_g, other=0.0)
        phi2 = phi * 1.4426950408889634
        k_ptrs, v_ptrs = kv_base(K, V, b, h_kv, stride_kb, stride_kh, stride_vb, stride_vh, offs_d, PAGE)
        BT_ROW = BT + b.to(tl.int64) * stride_bt
        l = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        out_of_window = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.int32)
        k_ptrs, v_ptrs = kv_start(k_ptrs, v_ptrs, start, offs_n, stride_kl, stride_vl, PAGE)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            valid = pos < end
            k, v = load_kv(k_ptrs, v_ptrs, pos, valid, mask_d, stride_kl, stride_vl, BT_ROW, stride_kb, stride_vb,
                            n_pages, FLAG, PAGE)
            k_ptrs, v_ptrs = kv_step(k_ptrs, v_ptrs, stride_kl, stride_vl, BLOCK_N, PAGE)
            if FP32_DOT:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            x = s * qk_scale - phi2[:, None]                       # x_j = s_j - φ, base 2
            out_of_window = out_of_window | (valid[None, :] & ((x > hi2) | (x < lo2))).to(tl.int32)
            p = tl.exp2(tl.where(valid[None, :], x, float("-inf")))
            l += tl.sum(p, 1)
            if FP32_DOT:
                acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:   # p may be up to e^b: keep float32's range (tf32: 10 mantissa bits, as fp16's P; v exact)
                acc += tl.dot(p, v.to(tl.float32), input_precision="tf32")
        flagged = tl.max(out_of_window, 1)
        OUT_ROW = OUT + b * stride_ob
        LSE_ROW = LSE + b * stride_sb
        MARK_ROW = MARKS + b * stride_mb
        if n_splits == 1:
            _finalize(acc, l, flagged, phi, L > 0, lo2, heads, mask_g, mask_gd, offs_d, OUT_ROW, stride_oh,
                      LSE_ROW, stride_sh, MARK_ROW)
        else:
            O_ROW = O_PART + b * stride_pb
            L_ROW = L_PART + b * stride_lb
            F_ROW = F_PART + b * stride_lb
            if ATOMIC:
                tl.atomic_add(O_ROW + heads[:, None] * stride_ph + offs_d[None, :], acc, mask=mask_gd, sem="relaxed")
                tl.atomic_add(L_ROW + heads * stride_lh, l, mask=mask_g, sem="relaxed")
                tl.atomic_max(F_ROW + heads * stride_lh, flagged, mask=mask_g, sem="relaxed")
            else:
                tl.store(O_ROW + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :], acc, mask=mask_gd)
                tl.store(L_ROW + heads * stride_lh + split, l, mask=mask_g)
                tl.store(F_ROW + heads * stride_lh + split, flagged, mask=mask_g)
            if take_ticket(COUNTERS + b * H_KV + h_kv, n_splits):
                offs_h = tl.arange(0, BLOCK_H)
                hh = h_kv * GROUP + offs_h
                mask_h = offs_h < GROUP
                mask_hd = mask_h[:, None] & mask_d[None, :]
                if ATOMIC:
                    o_ptrs = O_ROW + hh[:, None] * stride_ph + offs_d[None, :]
                    acc_t = tl.load(o_ptrs, mask=mask_hd, other=0.0, cache_modifier=".cg")
                    l_t = tl.load(L_ROW + hh * stride_lh, mask=mask_h, other=0.0, cache_modifier=".cg")
                    f_t = tl.load(F_ROW + hh * stride_lh, mask=mask_h, other=0, cache_modifier=".cg")
                    tl.store(o_ptrs, tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32), mask=mask_hd)
                    tl.store(L_ROW + hh * stride_lh, tl.zeros([BLOCK_H], dtype=tl.float32), mask=mask_h)
                    tl.store(F_ROW + hh * stride_lh, tl.zeros([BLOCK_H], dtype=tl.int32), mask=mask_h)
                else:   # the slots, added in split order
                    offs_s = tl.arange(0, BLOCK_S)
                    acc_t = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
                    l_t = tl.zeros([BLOCK_H], dtype=tl.float32)
                    f_t = tl.zeros([BLOCK_H], dtype=tl.int32)
                    for s0 in range(0, n_splits, BLOCK_S):
                        sp = s0 + offs_s
                        mask_hs = mask_h[:, None] & (sp < n_splits)[None, :]
                        l_i = tl.load(L_ROW + hh[:, None] * stride_lh + sp[None, :], mask=mask_hs, other=0.0,
                                      cache_modifier=".cg")
                        f_i = tl.load(F_ROW + hh[:, None] * stride_lh + sp[None, :], mask=mask_hs, other=0,
                                      cache_modifier=".cg")
                        o_i = tl.load(O_ROW + hh[:, None, None] * stride_ph + sp[None, :, None] * stride_ps
                                      + offs_d[None, None, :], mask=mask_hs[:, :, None] & mask_d[None, None, :],
                                      other=0.0, cache_modifier=".cg")
                        acc_t += tl.sum(o_i, 1)
                        l_t += tl.sum(l_i, 1)
                        f_t = tl.maximum(f_t, tl.max(f_i, 1))
                phi_h = tl.load(PHI + b * stride_phib + hh * stride_phih, mask=mask_h, other=0.0)
                _finalize(acc_t, l_t, f_t, phi_h, L > 0, lo2, hh, mask_h, mask_hd, offs_d, OUT_ROW, stride_oh,
                          LSE_ROW, stride_sh, MARK_ROW)


@triton.jit
def recompute_kernel(Q, K, V, LENS, MARKS, O_PART, LSE_PART, COUNTERS, OUT, LSE, FLAG, BT,
                     stride_qb, stride_qh,
                     stride_kb, stride_kl, stride_kh,
                     stride_vb, stride_vl, stride_vh,
                     stride_pb, stride_ph, stride_ps,
                     stride_lb, stride_lh,
                     stride_ob, stride_oh, stride_sb, stride_sh, stride_mb,
                     qk_scale, chunk, H_KV, L_MAX, stride_bt, n_pages,
                     GROUP: tl.constexpr, D: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, FP32_DOT: tl.constexpr, PAGE: tl.constexpr):
    """Pass 2: the exact online softmax (running max) over the groups with a marked query head; others exit."""
    b = tl.program_id(0)
    h_kv = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = h_kv * GROUP + offs_g
    marked = tl.max(tl.load(MARKS + b * stride_mb + heads, mask=mask_g, other=0), 0)
    if marked > 0:
        L = load_lengths(LENS, b, b >= 0, L_MAX, FLAG)
        n_splits = tl.minimum(tl.maximum(tl.cdiv(L, chunk), 1), tl.num_programs(2))
        if split < n_splits:
            start, end = split_range(split, n_splits, chunk, L)
            # the exact online softmax of the slice, as every kernel computes it (one query token)
            o, lse, _, mask_gd = attend_group(Q, K, V, b, h_kv, start, end, L, stride_qb, 0, stride_qh, stride_kb,
                                              stride_kl, stride_kh, stride_vb, stride_vl, stride_vh, qk_scale, BT,
                                              stride_bt, n_pages, FLAG, GROUP, 1, D, BLOCK_G, BLOCK_N, BLOCK_D,
                                              FP32_DOT, tile_update, PAGE)
            offs_d = tl.arange(0, BLOCK_D)
            OUT_ROW = OUT + b * stride_ob
            LSE_ROW = LSE + b * stride_sb
            if n_splits == 1:
                tl.store(OUT_ROW + heads[:, None] * stride_oh + offs_d[None, :], o.to(OUT_ROW.dtype.element_ty),
                         mask=mask_gd)
                tl.store(LSE_ROW + heads * stride_sh, lse, mask=mask_g)
            else:
                O_ROW = O_PART + b * stride_pb
                L_ROW = LSE_PART + b * stride_lb
                tl.store(O_ROW + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :], o, mask=mask_gd)
                tl.store(L_ROW + heads * stride_lh + split, lse, mask=mask_g)
                if take_ticket(COUNTERS + b * H_KV + h_kv, n_splits):
                    h0 = h_kv * GROUP   # the group's exact partials, merged as every kernel merges them
                    combine_heads(O_ROW + h0 * stride_ph, L_ROW + h0 * stride_lh, n_splits, 0, stride_ph, stride_ps,
                                  0, stride_lh, OUT_ROW + h0 * stride_oh, 0, stride_oh, LSE_ROW + h0 * stride_sh, 0,
                                  stride_sh, GROUP, 1, BLOCK_H, BLOCK_S, BLOCK_D, D, True, False)


# ---------------------------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class UnifiedMaxWorkspace:
    """Device memory of :func:`run_unified_max` for B sequences, H_q query heads, H_kv KV heads, head dim D and
    ``splits`` splits (None where the configuration needs none):

    * ``o_part`` [B, H_q, splits, D], ``l_part`` [B, H_q, splits] float32 (splits > 1): pass 1's slots in
      ticket mode (Õ_i, ℓ_i), and pass 2's partials (O_i, lse_i) in both modes (pass 2 runs after pass 1
      is done with them);
    * ``f_part`` [B, H_q, splits] int32 (splits > 1, ticket mode): each split's window flag;
    * ``acc`` [B, H_q, D], ``l_sum`` [B, H_q] float32 and ``f_sum`` [B, H_q] int32 (splits > 1, atomic mode):
      the atomic accumulators, **zero between calls** (the finalising program zeroes them);
    * ``counters`` [B·H_kv] int32, **zero between calls** (the ticket; reset by the last program of each row);
    * ``marks`` [B, H_q] int32: written on every call, 1 where the row was recomputed exactly;
    * ``flag`` [1] int32: set to 1 when a device length or page index was clamped (as in the other kernels).
    """
    o_part: torch.Tensor | None
    l_part: torch.Tensor | None
    f_part: torch.Tensor | None
    acc: torch.Tensor | None
    l_sum: torch.Tensor | None
    f_sum: torch.Tensor | None
    counters: torch.Tensor
    marks: torch.Tensor
    flag: torch.Tensor
    splits: int
    reduce: str

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


def check_reduce(reduce) -> None:
    if reduce not in REDUCES:
        raise ValueError(f"reduce: expected one of {', '.join(repr(r) for r in REDUCES)}, got {reduce!r}")


def workspace_bytes(B: int, H_q: int, H_kv: int, D: int, splits: int, reduce: str = "ticket") -> int:
    """Bytes :func:`make_workspace` allocates (see :class:`UnifiedMaxWorkspace`)."""
    n = 4 * (B * H_kv + B * H_q + 1)
    if splits > 1:
        n += 4 * B * H_q * splits * (D + 1)
        n += 4 * B * H_q * splits if reduce == "ticket" else 4 * B * H_q * (D + 2)
    return n


def make_workspace(B: int, H_q: int, H_kv: int, D: int, splits: int, device, reduce: str = "ticket"
                   ) -> UnifiedMaxWorkspace:
    """Allocate a :class:`UnifiedMaxWorkspace` (zeroed where it must be zero between calls)."""
    check_reduce(reduce)
    f32 = dict(dtype=torch.float32, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    multi = splits > 1
    atomic = multi and reduce == "atomic"
    return UnifiedMaxWorkspace(
        o_part=torch.empty((B, H_q, splits, D), **f32) if multi else None,
        l_part=torch.empty((B, H_q, splits), **f32) if multi else None,
        f_part=torch.empty((B, H_q, splits), **i32) if multi and not atomic else None,
        acc=torch.zeros((B, H_q, D), **f32) if atomic else None,
        l_sum=torch.zeros((B, H_q), **f32) if atomic else None,
        f_sum=torch.zeros((B, H_q), **i32) if atomic else None,
        counters=torch.zeros(B * H_kv, **i32),
        marks=torch.zeros((B, H_q), **i32),
        flag=torch.zeros(1, **i32),
        splits=splits, reduce=reduce)


def launchers(dtype, group: int, D: int, splits: int, cfg, page: int = 0, reduce: str = "ticket"
              ) -> tuple[Launcher, Launcher]:
    """(pass 1, pass 2) with their constexprs fixed for q's dtype, the group, D, the launched splits, the tiles
    (``cfg``: BLOCK_N, warps, stages), the page size (0: contiguous) and the reduction."""
    check_reduce(reduce)
    BLOCK_G, BLOCK_D = block_sizes(group, D)
    block_h, block_s = combine_blocks(group, splits, BLOCK_D)
    common = dict(GROUP=group, D=D, BLOCK_G=BLOCK_G, BLOCK_N=cfg.BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_H=block_h,
                  BLOCK_S=block_s, FP32_DOT=fp32_dot(dtype), PAGE=page, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    return (Launcher(unified_max_kernel, dict(common, ATOMIC=reduce == "atomic"), (3,)),
            Launcher(recompute_kernel, common, (3,)))


def _window2(window) -> tuple[float, float]:
    w_lo, w_hi = window
    return float(w_lo) * LOG2E, float(w_hi) * LOG2E


def run_unified_max(q, k_cache, v_cache, lens, *, scale: float, phi, window, out, lse, splits: int, chunk: int, cfg,
                    workspace: UnifiedMaxWorkspace, block_table=None, launch=None, recompute: bool = True) -> None:
    r"""Launches only (no host sync, no allocation: CUDA-graph capturable): pass 1 (unified max, marks) then
    pass 2 (exact recomputation of the marked rows). Writes ``out`` (q's dtype, [B, H_q, D]), ``lse``
    ([B, H_q] float32) and ``workspace.marks`` in place.

    Args:
        q: [B, H_q, D]; k_cache, v_cache: [B, L_max, H_kv, D], or pages [n_pages, page_size, H_kv, D] with
            ``block_table`` int32 [B, max_pages]; lens: int32/int64 [B] on the device.
        scale: multiplies q·k. phi: float32 on the device, [H_q] (one φ per query head) or [B, H_q], natural
            units (compared with scale·q·k). window: (w_lo, w_hi), natural units (:func:`fdlib.exact.default_window`
            checks it).
        splits, chunk, cfg: the launched splits per row, keys per split, tiles (as a plan's Decision).
        workspace: :func:`make_workspace` (B, H_q, H_kv, D, splits, reduce); its counters (and atomic
            accumulators) must be zero before the first call, and are left zero.
        launch: :func:`launchers` for these constexprs (a caller that launches often makes them once).
        recompute: False skips pass 2 (only to time pass 1 alone: marked rows are then wrong).
    """
    B, H_q, D = q.shape
    H_kv = k_cache.shape[2]
    ws = workspace
    if ws.splits != splits:
        raise ValueError(f"workspace: made for {ws.splits} splits, launch asks for {splits}")
    if launch is None:
        launch = launchers(q.dtype, H_q // H_kv, D, splits, cfg, 0 if block_table is None else k_cache.shape[1],
                           ws.reduce)
    phi2d = phi if phi.dim() == 2 else phi[None, :]
    phi_sb = phi2d.stride(0) if phi2d.shape[0] > 1 else 0
    lo2, hi2 = _window2(window)
    bt, bt_stride, n_pages, L_max = paging(k_cache, block_table, ws.flag)
    qs, ks, vs, os_, ls, ms = q.stride(), k_cache.stride(), v_cache.stride(), out.stride(), lse.stride(), \
        ws.marks.stride()
    if splits == 1:   # one split per row: no slots, the program finalises its row
        o_part, l_part, f_part = out, lse, ws.marks
        pstr, lstr = (0, 0, 0), (0, 0)
    elif ws.reduce == "atomic":
        o_part, l_part, f_part = ws.acc, ws.l_sum, ws.f_sum
        pstr, lstr = (ws.acc.stride(0), ws.acc.stride(1), 0), ws.l_sum.stride()
    else:
        o_part, l_part, f_part = ws.o_part, ws.l_part, ws.f_part
        pstr, lstr = ws.o_part.stride()[:3], ws.l_part.stride()[:2]
    grid = (B, H_kv, splits)
    strides_qkv = (qs[0], qs[1], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])
    launch[0](grid, (q, k_cache, v_cache, lens, phi2d, o_part, l_part, f_part, ws.counters, out, lse, ws.marks,
                     ws.flag, bt),
              strides_qkv + (phi_sb, phi2d.stride(1)) + tuple(pstr) + tuple(lstr)
              + (os_[0], os_[1], ls[0], ls[1], ms[0], scale * LOG2E, lo2, hi2, chunk, H_kv, L_max, bt_stride,
                 n_pages))
    if not recompute:
        return
    if splits == 1:
        o2, l2, pstr2, lstr2 = out, lse, (0, 0, 0), (0, 0)
    else:
        o2, l2 = ws.o_part, ws.l_part
        pstr2, lstr2 = ws.o_part.stride()[:3], ws.l_part.stride()[:2]
    launch[1](grid, (q, k_cache, v_cache, lens, ws.marks, o2, l2, ws.counters, out, lse, ws.flag, bt),
              strides_qkv + tuple(pstr2) + tuple(lstr2)
              + (os_[0], os_[1], ls[0], ls[1], ms[0], scale * LOG2E, chunk, H_kv, L_max, bt_stride, n_pages))
