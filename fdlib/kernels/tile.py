r"""The Triton pieces every decode kernel shares, each written once: the two pieces of arithmetic below,
and around them :func:`attend_slice` / :func:`attend_group` (stream one slice of a sequence through
``tile_update`` and normalise it with :func:`state_to_partial`; contiguous or paged caches, :func:`page_rows`) and :func:`take_ticket` (the unified
kernel's hand-off to the program that merges).

Several query tokens per sequence (q ``[B, q_len, H_q, D]``): a program holds the group × q_len query rows
:math:`r = t\cdot\text{group} + g` of its KV head in one tile (:func:`row_offset` places them in q, out, lse
and the partials), so each K/V tile is still read once per KV head. Row r sees keys
:math:`j < L - q_{len} + 1 + t` (:func:`causal_limit`): the new tokens are the cache's last q_len keys, causal
among themselves; ``tile_update`` takes that as a [G, N] ``valid`` mask. A split's key range is the same for
every row; a row whose limit ends inside it masks the rest, and a row that sees nothing keeps the empty state
(its partial is O = 0, lse = -inf, which the merge weighs 0).

``tile_update`` - online softmax over one K/V tile for the query heads of one group.
For query rows :math:`q_g` (g < group) and a tile of keys :math:`k_j, v_j` (j in the tile):

.. math::
    s_{gj} = \text{scale}\,\log_2 e\; q_g\cdot k_j \quad(-\infty \text{ for keys outside the slice})\\
    m' = \max(m, \max_j s_{gj}),\quad \alpha = 2^{m - m'},\quad p_{gj} = 2^{s_{gj} - m'}\\
    \ell' = \alpha\,\ell + \sum_j p_{gj},\qquad \tilde O' = \alpha\,\tilde O + \sum_j p_{gj} v_j

The kernels keep m in base-2 units (``exp2`` is one hardware instruction); the natural-log value is
``lse = (m + log2 ℓ) · ln 2``. All state is float32 whatever the input dtype.

``combine_heads`` - the stage-2 merge of a query head's partials :math:`(O_i, \text{lse}_i)`:

.. math::
    \text{lse} = \log\sum_i e^{\text{lse}_i},\qquad O = \sum_i e^{\text{lse}_i - \text{lse}}\, O_i

streamed over the splits in blocks with the same running-max rescale as the tile update, so any number
of splits fits in registers. Empty splits (lse = -inf) weigh 0; all empty gives O = 0, lse = -inf.
Stage 2 calls it for one query head, the unified kernel's last program for the heads of a group.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TABLE_AHEAD_PAGE = tl.constexpr(8)
"""Pages of at least this many keys have each tile's block-table rows read one tile ahead (:func:`attend_slice`,
:func:`paged_tile_rows`), so that Triton pipelines the K/V loads over pages as over a contiguous cache; smaller
pages keep the lookup in the tile's own iteration, which streamed them faster (H200, fp16, B=32 mean 8192,
constant rows, auto, graph µs at 32:8 and 32:32: pages of 1 252 and 974 looked up in the tile's iteration with
128-key tiles, ``results/h200/ragged-fp16-b32-page1.json``, against 306 and 1314 read ahead with 64-key tiles,
``ragged-fp16-b32-page1-68b9fde.json``; pages of 4 254/976 against 301/1120; pages of 8, ahead as pages of 16:
253/979 against 259/1021 on constant rows, but 299/1108 against 267/1088 on uniform ones,
``ragged-fp16-b32-page8-2026-11-30.json`` and ``ragged-fp16-b32-page8.json``; two runs on two machines).
Read ahead or not, the sm_90 build's pipeliner issues a tile's table load in the iteration that issues the tile's K/V
copies (it copies each tile two iterations ahead, and recomputes the table rows it needs there), so the copies wait
for that load; a table held in registers removes the wait but drains the pipeline at each reload
(``results/h200/ab/README.md``, run 53)."""
TABLE_REGS_LIMIT = tl.constexpr(256)
"""The most block-table entries :func:`attend_slice` holds in registers at a time (its TABLE_REGS): 512 faulted
on the H200 with an illegal address (``results/h200/ab/README.md``, run 82), where the interpreter was right."""


@triton.jit
def tile_update(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr, k_scale=None, v_scale=None):
    r"""(m, ℓ, Õ) ← state after one more tile. q [G, D]; k, v [N, D]; m, ℓ [G]; Õ [G, D]; ``valid`` [N] (the
    keys of the slice, the same for every row) or [G, N] (also a per-row causal limit, several query tokens).

    FP32_DOT: do both products in exact float32 (float32 inputs, and bfloat16 in the interpreter, whose
    NumPy has no bfloat16 matrix product). Otherwise the tensor cores multiply fp16/bf16 and accumulate fp32.

    ``k_scale``, ``v_scale`` [N]: an 8-bit cache's per-token scales of the tile's keys (:mod:`fdlib.quant`; None:
    none): :math:`s_{gj} \mathrel{*}= \sigma_{K,j}` (column j of the logits), and :math:`p_{gj} \sigma_{V,j}` enters Õ
    while ℓ sums :math:`p_{gj}` (the weights of the product with V, scaled before it). The 16-bit weights are
    :math:`w_{gj} / \max_j w_{gj} \in [0, 1]`, :math:`w_{gj} = p_{gj} \sigma_{V,j}`, and row g of the product is
    multiplied by :math:`\max_j w_{gj}` in float32, so no weight overflows a float16 operand and the largest is 1:
    none that matters sinks below float16's normal range, however far apart the scales. A bfloat16 operand has
    float32's range, and its weights are :math:`p_{gj} \sigma_{V,j} / \max_j \sigma_{V,j}` (no reduction a row).
    k and v are then the stored values in q's dtype (:func:`cache_update`).
    """
    if FP32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if k_scale is not None:
        s = s * k_scale[None, :]
    s = tl.where(valid, s * qk_scale, float("-inf"))       # valid broadcasts from [N] to [G, N]
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)        # whole tile masked: nothing to rescale
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    if FP32_DOT:
        w = p if v_scale is None else p * v_scale[None, :]
        pv = tl.dot(w, v.to(tl.float32), input_precision="ieee")
    elif v_scale is None:
        pv = tl.dot(p.to(v.dtype), v)
    elif v.dtype == tl.float16:   # each row's weights p·s_V over their largest lie in [0, 1], the largest 1: the
        # float16 operand can neither overflow nor sink below its normal range (over max s_V alone, scales 10^5
        # apart did); a row reduction a tile
        w = p * v_scale[None, :]
        w_top = tl.max(w, 1)
        w_top = tl.where(w_top > 0, w_top, 1.0)
        pv = tl.dot((w * (1.0 / w_top)[:, None]).to(v.dtype), v) * w_top[:, None]
    else:   # bfloat16 has float32's range: weights p·s_V/max s_V in [0, 1] neither overflow nor sink
        v_top = tl.max(v_scale, 0)
        v_top = tl.where(v_top > 0, v_top, 1.0)
        pv = tl.dot((p * (v_scale / v_top)[None, :]).to(v.dtype), v) * v_top
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc


@triton.jit
def state_to_partial(m, l, acc, v_fold=None):
    """(m, ℓ, Õ) in base 2  ->  (O = Õ/ℓ, natural lse); an empty state gives (0, -inf). ``v_fold``: an 8-bit
    cache's per-tensor or per-head V scale, O = Õ·(v_fold/ℓ) (one factor a row; :func:`finish_state`)."""
    empty = l == 0.0
    if v_fold is None:
        o = acc / tl.where(empty, 1.0, l)[:, None]
    else:
        o = acc * (v_fold / tl.where(empty, 1.0, l))[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, l))) * 0.6931471805599453)
    return o, lse


# ------------------------------------------------------------------------------------------ 8-bit caches
SCALE_NONE = tl.constexpr(0)
"""K_SCALE / V_SCALE of a 16-bit cache: no scale (the kernels compile to what they were without scales)."""
SCALE_TENSOR = tl.constexpr(1)
"""One scale per tensor (:mod:`fdlib.quant`): K's multiplies qk_scale on the host, V's is the argument v_mul."""
SCALE_HEAD = tl.constexpr(2)
"""One scale per KV head: K's folded into qk_scale (:func:`k_scaled`), V's into the output (:func:`finish_state`)."""
SCALE_TOKEN = tl.constexpr(3)
"""One scale per token and KV head: K's multiply the logits' columns, V's the weights' (:func:`tile_update`)."""


@triton.jit
def head_row(SC, h_kv, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr):
    """A kernel's 8-bit scale arguments SC = (KS, VS, stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl,
    stride_vsh, v_mul) with KS and VS moved to KV head h_kv (a per-head scale has strides (0, 0, stride_h), a
    per-token one its tensor's [B or pages, L_max or page slots, H_kv]); SC itself for a 16-bit cache."""
    r = SC
    if K_SCALE != SCALE_NONE or V_SCALE != SCALE_NONE:
        KS, VS, ksb, ksl, ksh, vsb, vsl, vsh, v_mul = SC
        r = (KS + h_kv * ksh, VS + h_kv * vsh, ksb, ksl, ksh, vsb, vsl, vsh, v_mul)
    return r


@triton.jit
def scale_row(SC, b, h_kv, PAGE: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr):
    """SC moved to row (b, h_kv) of a contiguous cache's scales (PAGE = 0), or to KV head h_kv of a page pool's
    (:func:`head_row`; a key's page and slot are added per tile, :func:`scale_offsets`)."""
    r = head_row(SC, h_kv, K_SCALE, V_SCALE)
    if (K_SCALE != SCALE_NONE or V_SCALE != SCALE_NONE) and PAGE == 0:
        KS, VS, ksb, ksl, ksh, vsb, vsl, vsh, v_mul = r
        r = (KS + b.to(tl.int64) * ksb, VS + b.to(tl.int64) * vsb, ksb, ksl, ksh, vsb, vsl, vsh, v_mul)
    return r


@triton.jit
def k_scaled(qk_scale, SC, K_SCALE: tl.constexpr):
    r"""qk_scale with a per-head K scale folded in, :math:`\text{scale}\cdot\log_2 e\cdot s_{K,h}` (SC at the
    row's head: :func:`head_row`); unchanged otherwise (a per-tensor one is folded on the host)."""
    if K_SCALE == SCALE_HEAD:
        qk_scale = qk_scale * tl.load(SC[0])
    return qk_scale


@triton.jit
def finish_state(m, l, acc, SC, V_SCALE: tl.constexpr):
    r""":func:`state_to_partial` with V's per-tensor or per-head scale folded into the output (SC at the row's
    head), :math:`O = \tilde O\, s_V/\ell`; a per-token one is in Õ already (:func:`tile_update`)."""
    if V_SCALE == SCALE_TENSOR or V_SCALE == SCALE_HEAD:
        v_fold = SC[8]
        if V_SCALE == SCALE_HEAD:
            v_fold = v_fold * tl.load(SC[1])
        o, lse = state_to_partial(m, l, acc, v_fold)
    else:
        o, lse = state_to_partial(m, l, acc)
    return o, lse


@triton.jit
def scale_offsets(SC, pos, page, slot, PAGE: tl.constexpr):
    """Where the per-token scales of keys ``pos`` lie from a row's scale pointers (:func:`scale_row`): pos·stride
    over a contiguous cache; page·stride_page + slot·stride_slot over pages (64-bit, as :func:`pool_rows`; page
    from :func:`page_rows`). Returns (K's, V's)."""
    if PAGE == 0:
        ks_off = pos * SC[3]
        vs_off = pos * SC[6]
    else:
        ks_off = page * wide(SC[2]) + wide(slot * tl.cast(SC[3], tl.uint32))
        vs_off = page * wide(SC[5]) + wide(slot * tl.cast(SC[6], tl.uint32))
    return ks_off, vs_off


@triton.jit
def with_scales(k, v, SC, pos, page, slot, PAGE: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr):
    """A tile as loaded, for :func:`cache_update`: (k, v), and where K's or V's scales are per token the offsets
    of its keys' scales (:func:`scale_offsets` of keys ``pos``, at ``page`` and ``slot`` over pages):
    (k, v, ks_off, vs_off). :func:`page_offsets` builds its (k_rows, v_rows[, ks_off, vs_off]) with it too."""
    if K_SCALE == SCALE_TOKEN or V_SCALE == SCALE_TOKEN:
        ks_off, vs_off = scale_offsets(SC, pos, page, slot, PAGE)
        r = (k, v, ks_off, vs_off)
    else:
        r = (k, v)
    return r


@triton.jit
def cache_update(TILE_UPDATE: tl.constexpr, q, tile, seen, m, l, acc, qk_scale, FP32_DOT: tl.constexpr, SC, valid,
                 K_SCALE: tl.constexpr, V_SCALE: tl.constexpr):
    """TILE_UPDATE on a tile as loaded from the cache (``tile`` = (k, v), or :func:`with_scales`'s four). A 16-bit
    cache's tile goes in as it is. An 8-bit one is dequantized in registers first: converted to q's dtype (to
    float32 where FP32_DOT), which is exact (every e4m3 and int8 value is an fp16 and a bf16 value), so the
    products stay fp16/bf16; per-token scales are loaded for the ``valid`` keys from SC at the row
    (:func:`scale_row`) and go in as the update's ``k_scale``/``v_scale``. Per-tensor and per-head scales are
    folded in outside the loop (:func:`k_scaled`, :func:`finish_state`)."""
    k = tile[0]
    v = tile[1]
    if K_SCALE == SCALE_NONE and V_SCALE == SCALE_NONE:
        r = TILE_UPDATE(q, k, v, seen, m, l, acc, qk_scale, FP32_DOT)
    else:
        k = k.to(tl.float32 if FP32_DOT else q.dtype)
        v = v.to(tl.float32 if FP32_DOT else q.dtype)
        if K_SCALE == SCALE_TOKEN or V_SCALE == SCALE_TOKEN:
            ks = valid.to(tl.float32)          # placeholders where a tensor is not scaled per token (never read)
            vs = ks
            if K_SCALE == SCALE_TOKEN:
                ks = tl.load(SC[0] + tile[2], mask=valid, other=0.0)
            if V_SCALE == SCALE_TOKEN:
                vs = tl.load(SC[1] + tile[3], mask=valid, other=0.0)
            r = TILE_UPDATE(q, k, v, seen, m, l, acc, qk_scale, FP32_DOT, ks if K_SCALE == SCALE_TOKEN else None,
                            vs if V_SCALE == SCALE_TOKEN else None)
        else:
            r = TILE_UPDATE(q, k, v, seen, m, l, acc, qk_scale, FP32_DOT)
    return r


@triton.jit
def row_offset(r, h0, stride_t, stride_h, GROUP: tl.constexpr, Q_LEN: tl.constexpr):
    r"""Where row r of one KV head's query rows lies: the rows pack (query token t, head h0 + g of the group
    whose first head is h0) as :math:`r = t\cdot\text{group} + g`, at
    :math:`t\cdot\text{stride\_t} + (h_0 + g)\cdot\text{stride\_h}` (one query token:
    :math:`(h_0 + r)\cdot\text{stride\_h}`). q, out, lse and the partials all use it, each with its own strides."""
    if Q_LEN == 1:
        off = (h0 + r) * stride_h
    else:
        off = (r // GROUP) * stride_t + (h0 + r % GROUP) * stride_h
    return off


@triton.jit
def own_dims(ptrs, mask, head, offs_d, HEAD_GROUP: tl.constexpr, PACK: tl.constexpr, D: tl.constexpr):
    r"""Packed KV heads (PACK > 1): a program reads PACK adjacent KV heads of D/PACK dims as one KV head of D dims
    (a token's heads lie side by side in the cache, so a tile's rows are whole runs of memory). Query head
    ``head`` (its index in q, one per row) owns dims :math:`[c, c + D/\text{PACK})` of the packed row,
    :math:`c = (\lfloor \text{head}/\text{HEAD\_GROUP}\rfloor \bmod \text{PACK})\cdot D/\text{PACK}`: its query
    is placed there with zeros elsewhere, so :math:`q'\cdot k' = q\cdot k_{own}` and the softmax is its own
    head's; its output is those dims of :math:`\sum_j p_j v'_j`. Given [rows, BLOCK_D] pointers into q or out
    (dim d of a row at ``ptrs[:, d]``) and their mask, returns the pointers that place dim d of the packed row at
    the head's dim d - c, and the mask kept to the owned dims; PACK = 1: both unchanged."""
    if PACK > 1:
        c = (head // HEAD_GROUP) % PACK * (D // PACK)
        ptrs -= c[:, None]
        mask &= (offs_d[None, :] >= c[:, None]) & (offs_d[None, :] < c[:, None] + D // PACK)
    return ptrs, mask


@triton.jit
def combine_heads(o_ptr, lse_ptr, n_splits, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                  out_ptr, stride_out_t, stride_out_h, lse_out_ptr, stride_lse_t, stride_lse_h,
                  GROUP: tl.constexpr, Q_LEN: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                  CACHE_CG: tl.constexpr, ANY_O: tl.constexpr = True, PACK: tl.constexpr = 1, head0=0,
                  HEAD_GROUP: tl.constexpr = 1):
    """Merge the partials of the GROUP·Q_LEN rows r = t·GROUP + g (:func:`row_offset`) at once: O_i of row r at
    ``o_ptr + row_offset(r, stride_ot, stride_oh) + i·stride_os`` (D floats), lse_i at
    ``lse_ptr + row_offset(r, stride_lt, stride_lh) + i``; store O (output dtype) and lse of each row.
    Stage 2 merges one row (GROUP = Q_LEN = 1), the unified and balanced kernels a KV head's rows.
    ANY_O: the partials may come from anywhere (stage 2's callers), so an empty split's O (lse = −∞) is
    replaced by 0 before it is weighted, for 0·NaN would be NaN; False where the same launch wrote every
    partial it merges, whose empty splits hold O = 0 (:func:`state_to_partial`): that select per merged value
    lies on the critical path of the one program that merges.
    PACK > 1: the partials are rows of PACK packed KV heads (:func:`own_dims`); row r, query head head0 + r
    (HEAD_GROUP query heads a KV head), stores only the D/PACK dims it owns."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP * Q_LEN
    mask_d = offs_d < D
    o_rows = row_offset(offs_h, 0, stride_ot, stride_oh, GROUP, Q_LEN)
    lse_rows = row_offset(offs_h, 0, stride_lt, stride_lh, GROUP, Q_LEN)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        split = s0 + offs_s
        mask_hs = mask_h[:, None] & (split < n_splits)[None, :]
        lse_ptrs = lse_ptr + lse_rows[:, None] + split[None, :]
        o_ptrs = (o_ptr + o_rows[:, None, None] + split[None, :, None] * stride_os
                  + offs_d[None, None, :])
        mask_hsd = mask_hs[:, :, None] & mask_d[None, None, :]
        if CACHE_CG:   # partials written by other programs of this launch: read them from L2, not L1
            lse_i = tl.load(lse_ptrs, mask=mask_hs, other=float("-inf"), cache_modifier=".cg")
            o_i = tl.load(o_ptrs, mask=mask_hsd, other=0.0, cache_modifier=".cg")
        else:
            lse_i = tl.load(lse_ptrs, mask=mask_hs, other=float("-inf"))
            o_i = tl.load(o_ptrs, mask=mask_hsd, other=0.0)
        if ANY_O:   # an empty split's O never enters (0·NaN)
            o_i = tl.where((lse_i == float("-inf"))[:, :, None], 0.0, o_i)
        m_new = tl.maximum(m, tl.max(lse_i, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        w = tl.exp(lse_i - m_ref[:, None])
        den = den * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_i, 1)
        m = m_new
    empty = den == 0.0
    o = acc / tl.where(empty, 1.0, den)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, den)))
    out_ptrs, mask_out = own_dims(out_ptr + row_offset(offs_h, 0, stride_out_t, stride_out_h, GROUP, Q_LEN)[:, None]
                                  + offs_d[None, :], mask_h[:, None] & mask_d[None, :], head0 + offs_h, offs_d,
                                  HEAD_GROUP, PACK, D)
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_out)
    tl.store(lse_out_ptr + row_offset(offs_h, 0, stride_lse_t, stride_lse_h, GROUP, Q_LEN), lse, mask=mask_h)


def combine_blocks(heads: int, splits: int, block_d: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_S) for combine_heads: all ``heads`` rows of the KV head (group × q_len), and as many
    splits per step as keep the
    [BLOCK_H, BLOCK_S, BLOCK_D] float32 tile within 8192 elements (64 registers a thread at 4 warps)."""
    block_h = triton.next_power_of_2(heads)
    room = max(1, 8192 // (block_h * block_d))
    return block_h, max(1, min(triton.next_power_of_2(splits), room))


@triton.jit
def fold_partial(m, den, acc, o_i, lse_i):
    r"""One partial (O_i, lse_i) folded into a running merge (m, den, acc) of the rows (the sequential form of
    :func:`combine_heads`, for a merge whose order must not depend on who merges):

    .. math::  m' = \max(m, \text{lse}_i),\quad \alpha = e^{m - m'},\quad w = e^{\text{lse}_i - m'},\quad
               \text{den}' = \text{den}\,\alpha + w,\quad \text{acc}' = \text{acc}\,\alpha + w\,O_i

    (start from m = −∞, den = 0, acc = 0; finish with :func:`fold_result`). The multiply-adds are explicit
    ``tl.fma``, so that every caller's code computes the same bits (no contraction left to the compiler)."""
    m_new = tl.maximum(m, lse_i)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_ref)
    w = tl.exp(lse_i - m_ref)
    den = tl.fma(den, alpha, w)
    acc = tl.fma(acc, alpha[:, None], w[:, None] * o_i)
    return m_new, den, acc


@triton.jit
def fold_where(cond, m, den, acc, o_i, lse_i):
    """:func:`fold_partial` where the scalar ``cond`` holds (a chunk ends here, a slot holds a chunk), else the
    merge kept as it is: selected, not branched, so a loop that folds at some tiles stays one pipelined loop."""
    n_m, n_den, n_acc = fold_partial(m, den, acc, o_i, lse_i)
    return tl.where(cond, n_m, m), tl.where(cond, n_den, den), tl.where(cond, n_acc, acc)


@triton.jit
def fold_result(m, den, acc):
    """(O, lse) of a finished :func:`fold_partial` merge; rows that merged nothing but empty partials give
    (0, −∞)."""
    empty = den == 0.0
    o = acc / tl.where(empty, 1.0, den)[:, None]
    return o, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, den)))


@triton.jit
def clamp_and_flag(x, hi, valid, FLAG):
    """min(max(x, 0), hi) for the ``valid`` entries of ``x`` (a scalar or a vector read from memory); where that
    changes a valid entry, ``FLAG[0]`` is set to 1. Lengths and page indices go through it, so no kernel ever
    reads outside the cache or the page pool, and nothing has to be read back on the host to know it."""
    y = tl.minimum(tl.maximum(x, 0), hi)
    bad = valid & (y != x)
    tl.store(FLAG + y * 0, bad.to(tl.int32), mask=bad)
    return y


@triton.jit
def page_rows(BT_ROW, pos, valid, n_pages, FLAG, PAGE: tl.constexpr):
    r"""Paged cache: the page and the slot in it of key positions ``pos`` of one sequence,
    :math:`\text{page} = \text{table}[\lfloor pos/\text{PAGE}\rfloor]`, slot = pos mod PAGE (``BT_ROW`` points at
    the sequence's row of the block table). A page index outside 0..n_pages-1 is clamped (no load ever leaves
    the pool) and sets ``FLAG[0]`` to 1, like a clamped length. Both come back as unsigned 64-bit integers of
    32-bit values: positions are never negative, so ⌊pos/PAGE⌋ and pos mod PAGE are a shift and a mask, and a
    product with a stride (:func:`wide`) is one 32 × 32 → 64-bit multiply (:func:`page_offsets`)."""
    pos = pos.to(tl.uint32)
    page = clamp_and_flag(tl.load(BT_ROW + pos // PAGE, mask=valid, other=0), n_pages - 1, valid, FLAG)
    return wide(page), pos % PAGE


@triton.jit
def first_table(BT, b, start, L_MAX, stride_bt, TABLE_REGS: tl.constexpr, PAGE: tl.constexpr):
    """The TABLE_REGS block-table entries of sequence b from the page of key ``start`` on, those below the capacity
    L_MAX (the table's width): a split's entries loaded before its row's length is known, so that the two loads
    go out together (:func:`attend_slice` clamps and flags those its keys use)."""
    pidx = start // PAGE + tl.arange(0, TABLE_REGS)
    return tl.load(BT + b.to(tl.int64) * stride_bt + pidx, mask=pidx * PAGE < L_MAX, other=0)


@triton.jit
def wide(x):
    """A non-negative 32-bit integer (a stride, a clamped page index) as an unsigned 64-bit one: zero-extended,
    so that its product with another such value compiles to one 32 × 32 → 64-bit multiply-add. ``tl.cast``, not
    ``x.to``: a stride equal to 1 reaches a compiled kernel as a plain int (Triton's specialisation)."""
    return tl.cast(tl.cast(x, tl.uint32), tl.uint64)


@triton.jit
def kv_start(k_ptrs, v_ptrs, start, offs_n, stride_kl, stride_vl, PAGE: tl.constexpr):
    """The pointers :func:`load_kv` reads from, for keys ``start + offs_n``: in a contiguous cache (PAGE = 0) the
    [BLOCK_N, BLOCK_D] tile itself, its 64-bit offset start·stride added once as a scalar (a cache of 8M keys ×
    8 heads × 128 dims passes 2^31 elements), then moved on by :func:`kv_step`, so the loop does no per-key
    offset arithmetic; over pages the pool's page-0 pointers, unchanged (each tile gathers through the table)."""
    if PAGE == 0:
        k_ptrs = k_ptrs + start.to(tl.int64) * stride_kl + (offs_n * stride_kl)[:, None]
        v_ptrs = v_ptrs + start.to(tl.int64) * stride_vl + (offs_n * stride_vl)[:, None]
    return k_ptrs, v_ptrs


@triton.jit
def kv_step(k_ptrs, v_ptrs, stride_kl, stride_vl, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """:func:`kv_start`'s pointers moved to the next tile of BLOCK_N keys (a contiguous cache; pages: unchanged)."""
    if PAGE == 0:
        k_ptrs += BLOCK_N * stride_kl
        v_ptrs += BLOCK_N * stride_vl
    return k_ptrs, v_ptrs


@triton.jit
def load_kv(k_ptrs, v_ptrs, pos, valid, mask_d, stride_kl, stride_vl, BT_ROW, stride_kb, stride_vb, n_pages, FLAG,
            PAGE: tl.constexpr, SC=None, K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    """One tile of keys and values at positions ``pos`` through :func:`kv_start`'s pointers: a contiguous cache
    (PAGE = 0; the pointers are the tile's), or pages behind the block table row ``BT_ROW`` (:func:`page_rows`;
    64-bit page offsets); masked rows read 0. Returns the tile as loaded, (k, v), with the offsets of its keys'
    scales where an 8-bit cache's are per token (:func:`with_scales`; SC at the row, :func:`scale_row`)."""
    kv_mask = valid[:, None] & mask_d[None, :]
    if PAGE == 0:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        tile = with_scales(k, v, SC, pos, 0, 0, PAGE, K_SCALE, V_SCALE)
    else:
        rows = page_offsets(BT_ROW, pos, valid, n_pages, FLAG, stride_kb, stride_kl, stride_vb, stride_vl, PAGE, SC,
                            K_SCALE, V_SCALE)
        k = tl.load(k_ptrs + rows[0][:, None], mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs + rows[1][:, None], mask=kv_mask, other=0.0)
        tile = with_rows(k, v, rows, K_SCALE, V_SCALE)
    return tile


@triton.jit
def empty_state(BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online-softmax state of no key yet: m = −∞, ℓ = 0, Õ = 0 for BLOCK_G query rows."""
    return (tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], dtype=tl.float32),
            tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32))


@triton.jit
def attend_tile(q, k_ptrs, v_ptrs, n0, offs_n, end, limit, mask_d, m, l, acc, qk_scale, stride_kl, stride_vl,
                BT_ROW, stride_kb, stride_vb, n_pages, FLAG, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
                TILE_UPDATE: tl.constexpr, PAGE: tl.constexpr, Q_LEN: tl.constexpr, SC=None,
                K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    """One step of a slice's loop: the tile of keys n0 + offs_n below ``end`` (:func:`load_kv`, then the
    pointers moved on by :func:`kv_step`), each query row also stopping at its ``limit`` when Q_LEN > 1, folded
    into (m, ℓ, Õ) by TILE_UPDATE (:func:`cache_update`: an 8-bit tile dequantized first; SC at the row,
    :func:`scale_row`). Returns the new state and pointers."""
    pos = n0 + offs_n
    valid = pos < end
    tile = load_kv(k_ptrs, v_ptrs, pos, valid, mask_d, stride_kl, stride_vl, BT_ROW, stride_kb, stride_vb, n_pages,
                   FLAG, PAGE, SC, K_SCALE, V_SCALE)
    k_ptrs, v_ptrs = kv_step(k_ptrs, v_ptrs, stride_kl, stride_vl, BLOCK_N, PAGE)
    m, l, acc = cache_update(TILE_UPDATE, q, tile, keys_seen(valid, pos, limit, Q_LEN), m, l, acc, qk_scale, FP32_DOT,
                             SC, valid, K_SCALE, V_SCALE)
    return m, l, acc, k_ptrs, v_ptrs


@triton.jit
def first_rows(BT_ROW, start, offs_n, end, n_pages, FLAG, stride_kb, stride_kl, stride_vb, stride_vl,
               PAGE: tl.constexpr, SC=None, K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    """:func:`page_offsets` of a slice's first tile (keys ``start + offs_n`` below ``end``): what
    :func:`attend_tile_ahead` takes at the slice's start."""
    pos = start + offs_n
    return page_offsets(BT_ROW, pos, pos < end, n_pages, FLAG, stride_kb, stride_kl, stride_vb, stride_vl, PAGE, SC,
                        K_SCALE, V_SCALE)


@triton.jit
def attend_tile_ahead(q, k_ptrs, v_ptrs, rows, n0, offs_n, end, limit, mask_d, m, l, acc, qk_scale, stride_kl,
                      stride_vl, BT_ROW, stride_kb, stride_vb, n_pages, FLAG, BLOCK_N: tl.constexpr,
                      FP32_DOT: tl.constexpr, TILE_UPDATE: tl.constexpr, PAGE: tl.constexpr, Q_LEN: tl.constexpr,
                      SC=None, K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    """:func:`attend_tile` over pages with the tile's block-table rows read one tile ahead: the tile of keys
    n0 + offs_n loaded through ``rows`` (:func:`page_offsets`, read by the step before, or :func:`first_rows`),
    the next tile's rows read, then the tile folded in, so that no K/V load of an iteration waits for a table load
    of its own and Triton pipelines the loads as over a contiguous cache. The same tile and the same update as
    :func:`attend_tile`: the same bits. Returns (m, ℓ, Õ, the next tile's rows)."""
    pos = n0 + offs_n
    valid = pos < end
    kv_mask = valid[:, None] & mask_d[None, :]
    k = tl.load(k_ptrs + rows[0][:, None], mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs + rows[1][:, None], mask=kv_mask, other=0.0)
    tile = with_rows(k, v, rows, K_SCALE, V_SCALE)
    nxt = pos + BLOCK_N
    rows = page_offsets(BT_ROW, nxt, nxt < end, n_pages, FLAG, stride_kb, stride_kl, stride_vb, stride_vl, PAGE, SC,
                        K_SCALE, V_SCALE)
    m, l, acc = cache_update(TILE_UPDATE, q, tile, keys_seen(valid, pos, limit, Q_LEN), m, l, acc, qk_scale, FP32_DOT,
                             SC, valid, K_SCALE, V_SCALE)
    return m, l, acc, rows


@triton.jit
def keys_seen(valid, pos, limit, Q_LEN: tl.constexpr):
    """The keys ``pos`` a tile's query rows see: the valid ones (below the slice's end), and with several query
    tokens (Q_LEN > 1) only those below each row's causal ``limit`` ([rows, keys])."""
    if Q_LEN == 1:
        seen = valid
    else:
        seen = valid[None, :] & (pos[None, :] < limit[:, None])
    return seen


@triton.jit
def batch_tiles(LENS, n_batch, L_MAX, FLAG, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """All B lengths of the batch in registers (clamped, :func:`load_lengths`), and each row's tiles
    max(1, ⌈L_b/BLOCK_N⌉) (0 past the batch): the schedules the balanced and stream-K kernels compute on the
    device start from these. Returns (offs_b, lens, tiles)."""
    offs_b = tl.arange(0, BLOCK_B)
    mine = offs_b < n_batch
    lens = load_lengths(LENS, offs_b, mine, L_MAX, FLAG)
    return offs_b, lens, tl.where(mine, tl.maximum(tl.cdiv(lens, BLOCK_N), 1), 0)


@triton.jit
def row_walk_offsets(stride_kl, stride_vl, GROUP: tl.constexpr, Q_LEN: tl.constexpr, D: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The index vectors and masks of a kernel whose loop walks tiles of several rows (persistent, stream-K):
    query rows r = t·GROUP + g, keys of a tile, dims, the masks of real rows and dims, and the 32-bit in-tile
    K/V offsets offs_n·stride + offs_d that :func:`row_tile_kv` adds to each tile's base."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_g = offs_g < GROUP * Q_LEN
    mask_gd = mask_g[:, None] & mask_d[None, :]
    k_offs = (offs_n * stride_kl)[:, None] + offs_d[None, :]
    v_offs = (offs_n * stride_vl)[:, None] + offs_d[None, :]
    return offs_g, offs_n, offs_d, mask_d, mask_g, mask_gd, k_offs, v_offs


@triton.jit
def page_offsets(BT_ROW, pos, valid, n_pages, FLAG, stride_kb, stride_kl, stride_vb, stride_vl, PAGE: tl.constexpr,
                 SC=None, K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    """The 64-bit offsets page·stride + slot·stride of keys ``pos`` (where ``valid``) in the K and V page pools,
    through the block-table row ``BT_ROW`` (:func:`page_rows`): what a loop reads one tile ahead, so that its
    K/V loads depend on no load of their own iteration. (k_rows, v_rows), and where an 8-bit cache's scales are
    per token those of the keys' scales too (:func:`scale_offsets`): (k_rows, v_rows, ks_off, vs_off)."""
    page, slot = page_rows(BT_ROW, pos, valid, n_pages, FLAG, PAGE)
    k_slot, v_slot = slot_offsets(slot, stride_kl, stride_vl)
    k_rows, v_rows = pool_rows(page, k_slot, v_slot, stride_kb, stride_vb)
    return with_scales(k_rows, v_rows, SC, pos, page, slot, PAGE, K_SCALE, V_SCALE)


@triton.jit
def with_rows(k, v, rows, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr):
    """The tile as loaded (:func:`with_scales`) from K/V loaded through ``rows`` (:func:`page_offsets`, whose
    scale offsets it keeps)."""
    if K_SCALE == SCALE_TOKEN or V_SCALE == SCALE_TOKEN:
        tile = (k, v, rows[2], rows[3])
    else:
        tile = (k, v)
    return tile


@triton.jit
def slot_offsets(slot, stride_kl, stride_vl):
    """slot·stride: the 64-bit offsets of slots ``slot`` (32-bit, :func:`page_rows`) inside a K and a V page."""
    return wide(slot * tl.cast(stride_kl, tl.uint32)), wide(slot * tl.cast(stride_vl, tl.uint32))


@triton.jit
def pool_rows(page, k_slot, v_slot, stride_kb, stride_vb):
    """page·stride + slot·stride: the 64-bit offsets in the K and V page pools of the rows in pages ``page``
    (:func:`wide`) at slot offsets ``k_slot``/``v_slot`` (:func:`slot_offsets`)."""
    return page * wide(stride_kb) + k_slot, page * wide(stride_vb) + v_slot


@triton.jit
def paged_tile_rows(BT, b, n0, L, offs_n, stride_bt, n_pages, FLAG, stride_kb, stride_kl, stride_vb, stride_vl,
                    PAGE: tl.constexpr, SC=None, K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    """:func:`page_offsets` of keys n0 + offs_n (below L) of sequence b, for the row-walking loops."""
    pos = n0 + offs_n
    return page_offsets(BT + b.to(tl.int64) * stride_bt, pos, pos < L, n_pages, FLAG, stride_kb, stride_kl,
                        stride_vb, stride_vl, PAGE, SC, K_SCALE, V_SCALE)


@triton.jit
def row_tile_kv(K, V, b, h_kv, n0, pos, valid, mask_d, offs_d, k_offs, v_offs, stride_kb, stride_kl, stride_kh,
                stride_vb, stride_vl, stride_vh, BT, stride_bt, n_pages, FLAG, PAGE: tl.constexpr,
                rows=None, SC=None, K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    """The K/V tile of keys ``pos`` = n0 + offs_n of row (b, h_kv), for kernels whose loop jumps between rows
    (persistent, stream-K): a contiguous cache from a 64-bit scalar base plus the 32-bit in-tile offsets
    ``k_offs``/``v_offs`` = offs_n·stride + offs_d; pages gathered through the block table (:func:`page_rows`),
    or through ``rows`` read ahead by :func:`paged_tile_rows`. Returns the tile as loaded (:func:`load_kv`)."""
    kv_mask = valid[:, None] & mask_d[None, :]
    if PAGE == 0:
        k = tl.load(K + (b.to(tl.int64) * stride_kb + h_kv * stride_kh + n0.to(tl.int64) * stride_kl) + k_offs,
                    mask=kv_mask, other=0.0)
        v = tl.load(V + (b.to(tl.int64) * stride_vb + h_kv * stride_vh + n0.to(tl.int64) * stride_vl) + v_offs,
                    mask=kv_mask, other=0.0)
        tile = with_scales(k, v, SC, pos, 0, 0, PAGE, K_SCALE, V_SCALE)
    else:
        if rows is None:
            rows = page_offsets(BT + b.to(tl.int64) * stride_bt, pos, valid, n_pages, FLAG, stride_kb, stride_kl,
                                stride_vb, stride_vl, PAGE, SC, K_SCALE, V_SCALE)
        k = tl.load(K + rows[0][:, None] + h_kv * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + rows[1][:, None] + h_kv * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        tile = with_rows(k, v, rows, K_SCALE, V_SCALE)
    return tile


@triton.jit
def attend_slice(q, k_ptrs, v_ptrs, stride_kl, stride_vl, start, end, limit, mask_d, qk_scale,
                 BT_ROW, stride_kb, stride_vb, n_pages, FLAG,
                 BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr,
                 TILE_UPDATE: tl.constexpr, PAGE: tl.constexpr, Q_LEN: tl.constexpr, TABLE_REGS: tl.constexpr = 0,
                 first=None, SC=None, K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    """Stream keys [start, end) of one sequence and KV head through on-chip memory, one BLOCK_N tile at a
    time, and return the group's state (m, ℓ, Õ). ``k_ptrs``/``v_ptrs`` point at key 0, dims ``offs_d``
    (a contiguous cache, PAGE = 0), or at page 0's slot 0 of this KV head (a paged cache: PAGE keys a page,
    rows gathered through the block table with :func:`page_rows`; from pages of TABLE_AHEAD_PAGE keys, each
    tile's table rows are read one tile ahead, :func:`page_offsets`).
    ``TILE_UPDATE`` is :func:`tile_update` (Lab 03 passes the learner's version to check it).
    Q_LEN > 1 (several query tokens): row r also sees only keys below ``limit[r]`` (its causal limit,
    :func:`causal_limit`); the slice [start, end) is the same for every row, a row whose limit ends inside it
    masks the rest, and a row whose limit is at or below ``start`` keeps the empty state.
    TABLE_REGS > 0 (pages of at least TABLE_AHEAD_PAGE keys): the table entries of TABLE_REGS pages are loaded into
    registers at a time (clamped as :func:`page_rows` clamps) and each tile's pages gathered from them, so no load
    of the tile loop feeds the K/V addresses; a slice longer than TABLE_REGS pages reloads them at each block's
    start, where the tile pipeline drains once a block (at most TABLE_REGS_LIMIT entries).
    ``first`` (with TABLE_REGS > 0): the slice's first TABLE_REGS entries, loaded already (:func:`first_table`).
    An 8-bit cache (K_SCALE, V_SCALE, SC at the row: :func:`scale_row`): each tile is dequantized right after its
    load (:func:`cache_update`), its keys' per-token scales read beside it; qk_scale holds a per-head K scale
    already (:func:`k_scaled`)."""
    m, l, acc = empty_state(BLOCK_G, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    if PAGE < TABLE_AHEAD_PAGE:   # a contiguous cache (PAGE = 0), or small pages looked up in each tile's iteration
        k_ptrs, v_ptrs = kv_start(k_ptrs, v_ptrs, start, offs_n, stride_kl, stride_vl, PAGE)
        for n0 in range(start, end, BLOCK_N):
            m, l, acc, k_ptrs, v_ptrs = attend_tile(q, k_ptrs, v_ptrs, n0, offs_n, end, limit, mask_d, m, l, acc,
                                                    qk_scale, stride_kl, stride_vl, BT_ROW, stride_kb, stride_vb,
                                                    n_pages, FLAG, BLOCK_N, FP32_DOT, TILE_UPDATE, PAGE, Q_LEN, SC,
                                                    K_SCALE, V_SCALE)
    elif TABLE_REGS > 0:
        tl.static_assert(TABLE_REGS <= TABLE_REGS_LIMIT, "TABLE_REGS: at most TABLE_REGS_LIMIT = 256 entries")
        # blocks of TABLE_REGS whole pages from the page of the slice's first key; a split starts on the
        # BLOCK_N grid (its chunk is a multiple of BLOCK_N) and TABLE_REGS·PAGE is one too, so every tile lies in
        # one block and gathers entries 0..TABLE_REGS-1 of it, even where the slice starts inside a page
        offs_p = tl.arange(0, TABLE_REGS)
        q_start = start // PAGE * PAGE
        for q0 in range(q_start, end, TABLE_REGS * PAGE):
            p_first = q0 // PAGE
            pidx = p_first + offs_p
            pvalid = pidx * PAGE < end
            if q0 == q_start:
                raw = first
            else:   # a slice longer than its TABLE_REGS pages (a split of more than TABLE_REGS_MAX entries, or
                    # lengths grown since planning)
                raw = tl.load(BT_ROW + pidx, mask=pvalid, other=0)
            pages = clamp_and_flag(raw, n_pages - 1, pvalid, FLAG)
            # the block's tiles read keys n_lo + j·BLOCK_N + offs_n: where BLOCK_N is a multiple of PAGE their
            # slots are the same in every tile and their entries j·BLOCK_N/PAGE further on, so the slots' row
            # offsets are computed once a block
            n_lo = tl.maximum(q0, start)
            upos0 = (n_lo + offs_n).to(tl.uint32)
            idx0 = (upos0 // PAGE - p_first).to(tl.int32)
            slot0 = upos0 % PAGE
            k_slot0, v_slot0 = slot_offsets(slot0, stride_kl, stride_vl)
            for n0 in range(n_lo, tl.minimum(q0 + TABLE_REGS * PAGE, end), BLOCK_N):
                pos = n0 + offs_n
                valid = pos < end
                if BLOCK_N % PAGE == 0:
                    page = wide(tl.gather(pages, idx0 + (n0 - n_lo) // PAGE, 0))
                    slot = slot0
                    k_slot, v_slot = k_slot0, v_slot0
                else:   # pages larger than a tile: the tile's slots move with it
                    upos = pos.to(tl.uint32)
                    page = wide(tl.gather(pages, (upos // PAGE - p_first).to(tl.int32), 0))
                    slot = upos % PAGE
                    k_slot, v_slot = slot_offsets(slot, stride_kl, stride_vl)
                k_row, v_row = pool_rows(page, k_slot, v_slot, stride_kb, stride_vb)
                kv_mask = valid[:, None] & mask_d[None, :]
                k = tl.load(k_ptrs + k_row[:, None], mask=kv_mask, other=0.0)
                v = tl.load(v_ptrs + v_row[:, None], mask=kv_mask, other=0.0)
                m, l, acc = cache_update(TILE_UPDATE, q, with_scales(k, v, SC, pos, page, slot, PAGE, K_SCALE, V_SCALE),
                                         keys_seen(valid, pos, limit, Q_LEN), m, l, acc, qk_scale, FP32_DOT, SC, valid,
                                         K_SCALE, V_SCALE)
    else:
        # pages: each tile's row offsets (page·stride + slot·stride) are read from the table one tile ahead and
        # carried, so the tile's K/V loads depend on no load of their own iteration
        rows = first_rows(BT_ROW, start, offs_n, end, n_pages, FLAG, stride_kb, stride_kl, stride_vb, stride_vl, PAGE,
                          SC, K_SCALE, V_SCALE)
        for n0 in range(start, end, BLOCK_N):
            m, l, acc, rows = attend_tile_ahead(q, k_ptrs, v_ptrs, rows, n0, offs_n, end, limit, mask_d, m, l, acc,
                                                qk_scale, stride_kl, stride_vl, BT_ROW, stride_kb, stride_vb, n_pages,
                                                FLAG, BLOCK_N, FP32_DOT, TILE_UPDATE, PAGE, Q_LEN, SC, K_SCALE, V_SCALE)
    return m, l, acc


@triton.jit
def causal_limit(r, L, GROUP: tl.constexpr, Q_LEN: tl.constexpr):
    r"""Keys row r = t·GROUP + g sees: :math:`j < L - Q_{len} + 1 + t`. The Q_len new tokens are already the last
    Q_len keys of the cache (``flash_attn_with_kvcache``'s convention), causal among themselves; a limit <= 0
    (L < Q_len − t) sees no key: O = 0, lse = −∞."""
    return L - Q_LEN + 1 + r // GROUP


@triton.jit
def load_lengths(LENS, idx, mask, L_MAX, FLAG):
    r"""The lengths :math:`L = \min(\max(L_{in}, 0), L_{max})` of the sequences ``idx`` (a scalar or a vector,
    ``mask`` its valid entries): a length outside the cache is clamped on the device, so no kernel ever reads
    outside it, and ``FLAG[0]`` is set to 1 (no host read: :meth:`fdlib.plan.DecodePlan.clamped` reads it)."""
    return clamp_and_flag(tl.load(LENS + idx, mask=mask, other=0), L_MAX, mask, FLAG).to(tl.int32)


@triton.jit
def order_key(L, b, L_MAX, BLOCK_B: tl.constexpr):
    r"""The longest-first key of sequence b with L keys, :math:`k_b = \min(\max(L, 0), L_{max})\cdot\text{BLOCK\_B}
    + (\text{BLOCK\_B} - 1 - b)`: larger for a longer row, and for the lower b of two equal ones, so the keys of
    distinct sequences are distinct (b < BLOCK_B). The lengths are clamped as :func:`clamp_and_flag` does but
    without its flag: each program's own :func:`load_lengths` of its row sets that."""
    return tl.minimum(tl.maximum(L.to(tl.int64), 0), L_MAX) * BLOCK_B + (BLOCK_B - 1 - b)


@triton.jit
def order_holds(LENS, HINT, n, L_MAX, BLOCK_B: tl.constexpr):
    r"""1 where ``HINT[0..n-1]`` (entries clamped to 0..n-1) is the longest-first order of the lengths read now,
    :math:`k_{h_0} > k_{h_1} > \dots > k_{h_{n-1}}` (:func:`order_key`), else 0: two loads of the hint, two of the
    lengths through it, one reduction. Distinct keys make that order the only one that passes."""
    offs = tl.arange(0, BLOCK_B)
    real, has_next = offs < n, offs + 1 < n
    hint = tl.minimum(tl.maximum(tl.load(HINT + offs, mask=real, other=0), 0), n - 1)
    nxt = tl.minimum(tl.maximum(tl.load(HINT + offs + 1, mask=has_next, other=0), 0), n - 1)
    down = (order_key(tl.load(LENS + hint, mask=real, other=0), hint, L_MAX, BLOCK_B)
            > order_key(tl.load(LENS + nxt, mask=has_next, other=0), nxt, L_MAX, BLOCK_B))
    return tl.min(tl.where(has_next, down, True).to(tl.int32), 0)


@triton.jit
def longest_first(LENS, HINT, i, n, L_MAX, BLOCK_B: tl.constexpr):
    r"""The sequence at place i of the batch ordered longest first (ties: the lower b first), from the lengths on
    the device: the b of the i-th largest :func:`order_key`. A grid whose place i runs the i-th longest row hands
    the SMs the longest rows first, so the last programs to start are the shortest (greedy longest-first list
    scheduling). Any order is a permutation of 0..n-1, so the lengths only move work around, never change it.

    ``HINT[0..n-1]``: an order to try first, place k → :math:`h_k` (a plan's, from the lengths it was made for).
    The keys are distinct, so exactly one order has them strictly decreasing place by place: where
    :math:`k_{h_0} > k_{h_1} > \dots > k_{h_{n-1}}` for the lengths read now (:func:`order_holds`), the hint is
    that order and place i runs :math:`h_i` (entries clamped alike in both, so no hint reads outside the batch).
    Otherwise the program sorts the n keys (padding keys −1, after every real one; n <= BLOCK_B) and reads b off
    the i-th. On the H200 the sort in every program cost 2.8-2.9 µs of a 125-µs launch (B=128 32:8 rows uniform
    around 1024; one dependent load in its place cost 0.2-0.3 µs: ``results/h200/ab/README.md``, run 76), and
    decode steps keep a plan's order: every length grows by one."""
    if order_holds(LENS, HINT, n, L_MAX, BLOCK_B) == 1:
        b = tl.minimum(tl.maximum(tl.load(HINT + i), 0), n - 1).to(tl.int32)
    else:
        offs = tl.arange(0, BLOCK_B)
        real = offs < n
        key = tl.where(real, order_key(tl.load(LENS + offs, mask=real, other=0), offs, L_MAX, BLOCK_B), -1)
        k_i = tl.sum(tl.where(offs == i, tl.sort(key, descending=True), 0), 0)
        b = (BLOCK_B - 1 - k_i % BLOCK_B).to(tl.int32)
    return b


@triton.jit
def split_range(split, n_splits, chunk, L):
    """Keys [start, end) of split ``split`` of a row of L keys cut into ``n_splits`` chunks: the last split runs
    to L, so a row longer than the plan's chunk·splits (lengths grown since planning) is still covered."""
    start = split * chunk
    end = tl.where(split == n_splits - 1, L, tl.minimum(start + chunk, L))
    return start, end


@triton.jit
def take_ticket(counter_ptr, n_splits):
    """The unified kernel's hand-off: after storing its partial, a program takes a ticket
    t = atomic_add(counter, 1) with acquire-release ordering (release: its partial is visible before the
    ticket; acquire: the last one sees everybody's partials). The program drawing t = n_splits - 1 is last:
    it resets the counter to 0 for the next call and returns True."""
    tl.debug_barrier()   # every thread of this program has stored its part of the partial
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == n_splits - 1
    if is_last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return is_last


@triton.jit
def store_partial(o, lse, rows, mask_gd, h0, split, O_ROW, stride_pt, stride_ph, stride_ps, LSE_ROW, stride_lt,
                  stride_lh, keep, GROUP: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_D: tl.constexpr):
    """Slot ``split`` of the partials of a KV head's query rows ``rows`` ← (O, lse): O at
    ``O_ROW + row_offset(r, h0, stride_pt, stride_ph) + split·stride_ps``, lse at
    ``LSE_ROW + row_offset(r, h0, stride_lt, stride_lh) + split``; nothing where ``keep`` (a scalar) is False."""
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(O_ROW + row_offset(rows, h0, stride_pt, stride_ph, GROUP, Q_LEN)[:, None] + split * stride_ps
             + offs_d[None, :], o, mask=tl.where(keep, mask_gd, False))
    tl.store(LSE_ROW + row_offset(rows, h0, stride_lt, stride_lh, GROUP, Q_LEN) + split, lse,
             mask=tl.where(keep, rows < GROUP * Q_LEN, False))


@triton.jit
def store_out(o, lse, rows, mask_gd, h0, OUT_ROW, stride_ot, stride_oh, LSE_OUT_ROW, stride_st, stride_sh, keep,
              GROUP: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_D: tl.constexpr, PACK: tl.constexpr = 1):
    """O (in the output's dtype) and lse of a KV head's query rows ``rows`` (head h0 + g of token t), as
    :func:`row_offset` places them; nothing where ``keep`` (a scalar, selected into the masks) is False.
    PACK > 1: rows of PACK packed KV heads, BLOCK_D dims wide; each row stores the dims it owns (:func:`own_dims`)."""
    offs_d = tl.arange(0, BLOCK_D)
    out_ptrs, mask = own_dims(OUT_ROW + row_offset(rows, h0, stride_ot, stride_oh, GROUP, Q_LEN)[:, None]
                              + offs_d[None, :], tl.where(keep, mask_gd, False), h0 + rows, offs_d, GROUP // PACK,
                              PACK, BLOCK_D)
    tl.store(out_ptrs, o.to(OUT_ROW.dtype.element_ty), mask=mask)
    tl.store(LSE_OUT_ROW + row_offset(rows, h0, stride_st, stride_sh, GROUP, Q_LEN), lse,
             mask=tl.where(keep, rows < GROUP * Q_LEN, False))


@triton.jit
def restart_where(cond, m, l, acc):
    """(m, ℓ, Õ) emptied (−∞, 0, 0) where the scalar ``cond`` holds, else kept: a loop that ends a row or a
    chunk at some tile starts the next one afresh without a branch, so it stays one software-pipelined loop."""
    return tl.where(cond, float("-inf"), m), tl.where(cond, 0.0, l), tl.where(cond, 0.0, acc)


@triton.jit
def row_tile_update(Q, K, V, b, h_kv, n0, L, m, l, acc, offs_g, offs_n, offs_d, mask_d, k_offs, v_offs, qk_scale,
                    stride_qb, stride_qt, stride_qh, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
                    BT, stride_bt, n_pages, FLAG, GROUP: tl.constexpr, Q_LEN: tl.constexpr, D: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr, TILE_UPDATE: tl.constexpr,
                    PAGE: tl.constexpr, rows=None, q=None, SC=None, K_SCALE: tl.constexpr = 0,
                    V_SCALE: tl.constexpr = 0):
    """One step of a loop that jumps between rows (persistent, stream-K): row (b, h_kv)'s queries ``q``
    (loaded here with :func:`group_queries` when None), its tile of keys n0 + offs_n below L
    (:func:`row_tile_kv`; over pages through ``rows`` when the loop read them ahead), each query row
    also stopping at its causal limit when Q_LEN > 1, folded into (m, ℓ, Õ) by TILE_UPDATE (an 8-bit tile
    dequantized first, :func:`cache_update`: SC at the row, :func:`scale_row`, qk_scale with its per-head K scale
    folded in, :func:`k_scaled`)."""
    if q is None:
        q = group_queries(Q, b, h_kv, stride_qb, stride_qt, stride_qh, GROUP, Q_LEN, D, BLOCK_G, BLOCK_D)[0]
    pos = n0 + offs_n
    valid = pos < L
    tile = row_tile_kv(K, V, b, h_kv, n0, pos, valid, mask_d, offs_d, k_offs, v_offs, stride_kb, stride_kl, stride_kh,
                       stride_vb, stride_vl, stride_vh, BT, stride_bt, n_pages, FLAG, PAGE, rows, SC, K_SCALE, V_SCALE)
    if Q_LEN == 1:
        seen = valid
    else:
        seen = valid[None, :] & (pos[None, :] < causal_limit(offs_g, L, GROUP, Q_LEN)[:, None])
    return cache_update(TILE_UPDATE, q, tile, seen, m, l, acc, qk_scale, FP32_DOT, SC, valid, K_SCALE, V_SCALE)


@triton.jit
def finish_row(o, lse, rows, mask_gd, h0, split, n_splits, O_ROW, stride_pt, stride_ph, stride_ps, LSE_ROW, stride_lt,
               stride_lh, COUNTER, OUT_ROW, stride_ot, stride_oh, LSE_OUT_ROW, stride_st, stride_sh,
               GROUP: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_D: tl.constexpr, D: tl.constexpr, TAKE_TICKET: tl.constexpr, PACK: tl.constexpr = 1):
    """After a program's split: a row of one split writes O and lse of its KV head's query rows ``rows``
    (r = t·GROUP + g: query token t, head h0 + g; :func:`row_offset`) directly; otherwise the partial goes to
    slot ``split`` of the rows' partials (:func:`store_partial`), and the program that draws the last ticket
    of ``COUNTER`` merges the row's ``n_splits`` partials (:func:`combine_heads`). Shared by the unified and
    balanced kernels. PACK > 1: packed KV heads (:func:`own_dims`): partials are whole packed rows, outputs only
    each row's own dims."""
    if n_splits == 1:
        store_out(o, lse, rows, mask_gd, h0, OUT_ROW, stride_ot, stride_oh, LSE_OUT_ROW, stride_st, stride_sh, True,
                  GROUP, Q_LEN, BLOCK_D, PACK)
    else:
        store_partial(o, lse, rows, mask_gd, h0, split, O_ROW, stride_pt, stride_ph, stride_ps, LSE_ROW, stride_lt,
                      stride_lh, True, GROUP, Q_LEN, BLOCK_D)
        if TAKE_TICKET(COUNTER, n_splits):
            combine_heads(O_ROW + h0 * stride_ph, LSE_ROW + h0 * stride_lh, n_splits, stride_pt, stride_ph, stride_ps,
                          stride_lt, stride_lh, OUT_ROW + h0 * stride_oh, stride_ot, stride_oh,
                          LSE_OUT_ROW + h0 * stride_sh, stride_st, stride_sh,
                          GROUP, Q_LEN, BLOCK_H, BLOCK_S, BLOCK_D, D, True, False, PACK, h0, GROUP // PACK)


@triton.jit
def kv_base(K, V, b, h_kv, stride_kb, stride_kh, stride_vb, stride_vh, offs_d, PAGE: tl.constexpr):
    """Pointers to key 0, dims ``offs_d``, of KV head h_kv: in sequence b's rows of a contiguous cache
    (PAGE = 0), or in page 0 of the pool (a paged cache; :func:`load_kv` adds each row's page)."""
    if PAGE == 0:
        k_ptrs = K + b.to(tl.int64) * stride_kb + h_kv * stride_kh + offs_d[None, :]
        v_ptrs = V + b.to(tl.int64) * stride_vb + h_kv * stride_vh + offs_d[None, :]
    else:
        k_ptrs = K + h_kv * stride_kh + offs_d[None, :]
        v_ptrs = V + h_kv * stride_vh + offs_d[None, :]
    return k_ptrs, v_ptrs


@triton.jit
def group_queries(Q, b, h_kv, stride_qb, stride_qt, stride_qh, GROUP: tl.constexpr, Q_LEN: tl.constexpr,
                  D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PACK: tl.constexpr = 1):
    """The GROUP·Q_LEN query rows of KV head h_kv of sequence b (row r = t·GROUP + g: :func:`row_offset`), loaded
    once as a [BLOCK_G, BLOCK_D] tile, with the row and dim indices and masks (offs_g, offs_d, mask_d, mask_gd).
    PACK > 1 (one query token): h_kv is a pack of PACK KV heads, D dims wide, and each row holds its query in the
    dims it owns, zeros elsewhere (:func:`own_dims`)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_gd = (offs_g < GROUP * Q_LEN)[:, None] & mask_d[None, :]
    q_ptrs, q_mask = own_dims(Q + b * stride_qb + row_offset(offs_g, h_kv * GROUP, stride_qt, stride_qh, GROUP,
                                                             Q_LEN)[:, None] + offs_d[None, :],
                              mask_gd, h_kv * GROUP + offs_g, offs_d, GROUP // PACK, PACK, D)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    return q, offs_g, offs_d, mask_d, mask_gd


@triton.jit
def attend_group(Q, K, V, b, h_kv, start, end, L, stride_qb, stride_qt, stride_qh, stride_kb, stride_kl, stride_kh,
                 stride_vb, stride_vl, stride_vh, qk_scale, BT, stride_bt, n_pages, FLAG,
                 GROUP: tl.constexpr, Q_LEN: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr, TILE_UPDATE: tl.constexpr,
                 PAGE: tl.constexpr, PACK: tl.constexpr = 1, TABLE_REGS: tl.constexpr = 0, first=None, SC=None,
                 K_SCALE: tl.constexpr = 0, V_SCALE: tl.constexpr = 0):
    """The partial (O, lse) of KV head h_kv's GROUP·Q_LEN query rows r = t·GROUP + g (query token t, head
    h_kv·GROUP + g; :func:`row_offset`) of sequence b (L keys) over its keys [start, end): load the rows'
    queries once, stream the K/V slice (:func:`attend_slice`, each row stopping at its :func:`causal_limit`
    when Q_LEN > 1), normalise. Also returns the rows r and the [BLOCK_G, BLOCK_D] mask of real rows and dims,
    for the caller's stores. PAGE = 0: K/V are ``[B, L_max, H_kv, D]``; else pages ``[n_pages, PAGE, H_kv, D]``
    behind the block table BT. PACK > 1: h_kv is a pack of PACK adjacent KV heads read as one (:func:`own_dims`;
    the caller passes the pack's strides and D = PACK × the head dim). An 8-bit cache: K_SCALE, V_SCALE and the
    kernel's scale arguments SC (:func:`head_row`); a per-head K scale is folded into qk_scale (:func:`k_scaled`),
    a per-tensor or per-head V scale into the output (:func:`finish_state`)."""
    q, offs_g, offs_d, mask_d, mask_gd = group_queries(Q, b, h_kv, stride_qb, stride_qt, stride_qh, GROUP, Q_LEN, D,
                                                      BLOCK_G, BLOCK_D, PACK)
    k_ptrs, v_ptrs = kv_base(K, V, b, h_kv, stride_kb, stride_kh, stride_vb, stride_vh, offs_d, PAGE)
    if Q_LEN == 1:
        limit = end
    else:
        limit = causal_limit(offs_g, L, GROUP, Q_LEN)
    if K_SCALE != SCALE_NONE or V_SCALE != SCALE_NONE:
        SC = scale_row(SC, b, h_kv, PAGE, K_SCALE, V_SCALE)
    m, l, acc = attend_slice(q, k_ptrs, v_ptrs, stride_kl, stride_vl, start, end, limit, mask_d,
                             k_scaled(qk_scale, SC, K_SCALE), BT + b.to(tl.int64) * stride_bt, stride_kb, stride_vb,
                             n_pages, FLAG, BLOCK_G, BLOCK_N, BLOCK_D, FP32_DOT, TILE_UPDATE, PAGE, Q_LEN, TABLE_REGS,
                             first, SC, K_SCALE, V_SCALE)
    o, lse = finish_state(m, l, acc, SC, V_SCALE)
    return o, lse, offs_g, mask_gd


@triton.jit
def program_index():
    """This program's row in a timeline: its linear index in the grid, (pid0·n1 + pid1)·n2 + pid2."""
    return (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)


@triton.jit
def timeline_start():
    """The GPU's global clock (ns) when a program starts (``%globaltimer``; kernels compiled with TIMELINE only)."""
    return tl.extra.cuda.globaltimer()


@triton.jit
def timeline_record(TIMES, t_start):
    """Row :func:`program_index` of ``TIMES`` [n_programs, 3] int64 ← (SM id, start ns, end ns) of this program:
    ``%smid`` and ``%globaltimer`` read at its end. Only kernels compiled with TIMELINE = True call it; the
    others do not contain it at all."""
    t_end = tl.extra.cuda.globaltimer()
    row = TIMES + program_index().to(tl.int64) * 3
    tl.store(row, tl.extra.cuda.smid().to(tl.int64))
    tl.store(row + 1, t_start)
    tl.store(row + 2, t_end)
