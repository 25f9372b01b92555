r"""The unified Flash-Decoding kernel: map and reduce in one launch.

Grid ``(H_kv, B, max_splits)``, the KV head the fastest axis: a sequence's H_kv programs of a split are launched
together and read the same keys' rows, which lie side by side in the cache (one page, one run of memory per key),
at about the same time. Measured against b the fastest axis on an H200 (``results/h200/ab/ab-grid-order-*.json``,
graph µs, twice each): over pages of 16, B=128 32:8 rows of 1024 keys 130.0-130.1 -> 128.0-128.5, B=32 32:8 rows
of 8192 241.6-242.6 -> 240.1-241.0, B=64 32:32 rows of 512 0.994-0.996x; on a contiguous cache B=128 32:8 rows of
1024 keys 134.7-137.2 -> 130.1. Sequence b uses :math:`n_b = \max(1, \lceil L_b/\text{chunk}\rceil)` splits
(at most max_splits), computed on the device from ``cache_seqlens`` (so a short sequence in a long batch is
not over-split and a captured CUDA graph stays right when lengths change); programs with i >= n_b exit at once.

* :math:`n_b = 1`: the program owns the whole row, and writes :math:`O=\tilde O/\ell` and lse directly.
* otherwise each program stores its partial :math:`(O_i, \text{lse}_i)` (the map), then takes a ticket
  ``t = atomic_add(counter[b, h_kv], 1)`` with acquire-release ordering (:func:`~fdlib.kernels.tile.take_ticket`). The program that draws
  :math:`t = n_b - 1` is the last of its row: every other partial is already visible to it, so it
  resets the counter to 0 (ready for the next call or graph replay) and merges the n_b partials of each
  query head of the group with :func:`~fdlib.kernels.tile.combine_heads` (the reduce). Nobody waits for
  anybody, so no program relies on others being resident at the same time.

Several query tokens (q ``[B, q_len, H_q, D]``): each program holds the group × q_len query rows of its KV head
(:func:`~fdlib.kernels.tile.attend_group`), the splits and their count are those of the row's keys, and the last
program merges all of the head's rows.

Packed KV heads (``PACK`` > 1, one query token, :func:`~fdlib.kernels.tile.own_dims`): a program reads PACK
adjacent KV heads of a small head dim as one head PACK times as wide, so each tile row is one run of memory; the
launch's group, D, KV-head stride and H_kv are the pack's (:func:`unified_args`' ``pack``).

Longest rows first (``ORDER_B`` > 0, a power of two >= B): place i of the grid's sequence axis runs the i-th
longest sequence, ordered on the device from ``cache_seqlens`` in every program
(:func:`~fdlib.kernels.tile.longest_first`), so the SMs take the longest rows first and the last programs to start
are the shortest, whatever order the batch comes in and however its lengths change between graph replays. Each
program first checks the plan's order (ORDER_B int32 right before the ticket counters, in the same buffer, so at
the same place whatever the batch launched: :class:`fdlib.plan.Workspace`'s ``order``) against the lengths it
reads, and sorts them only where it fails.
``auto`` asks for it where :func:`fdlib.splits.longest_first_suits` holds (ragged batches over pages, whole rows),
``plan(..., longest_first=True)`` always (:func:`fdlib.plan.decide`).

A work list (``WORK`` > 0, :mod:`fdlib.kernels.worklist`): program (h_kv, i), i counted in launch order, reads
item i of the list a schedule kernel wrote right before the ticket counters, a sequence b and a piece j, and
cuts the row by its own length (:mod:`fdlib.worklist`: pieces of c(L) keys, at most S = ``WORK_S``); the grid
is ``(H_kv, B, ⌈room/B⌉)`` for the list's room (:func:`fdlib.worklist.capacity`), and programs past the list's
end exit at once. The rows then start longest first and a row's pieces
depend on its length alone.

In the interpreter the programs run one after another; the ticket still decides who merges.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import block_sizes, fp32_dot
from .launch import Launcher, check_pack, packed_kv, paging, q_len_of, scale_args, strides4
from .worklist import piece_rule, work_item
from .tile import (LOG2E, attend_group, combine_blocks, finish_row, first_table, load_lengths, longest_first,
                   split_range, take_ticket, tile_update, timeline_record, timeline_start)


@triton.jit
def unified_kernel(Q, K, V, LENS, O_PART, LSE_PART, COUNTERS, OUT, LSE, FLAG, BT, TIMES, KS, VS,
                   stride_qb, stride_qt, stride_qh,
                   stride_kb, stride_kl, stride_kh,
                   stride_vb, stride_vl, stride_vh,
                   stride_pb, stride_pt, stride_ph, stride_ps,
                   stride_lb, stride_lt, stride_lh,
                   stride_ob, stride_ot, stride_oh, stride_sb, stride_st, stride_sh,
                   qk_scale, chunk, H_KV, L_MAX, stride_bt, n_pages,
                   stride_ksb, stride_ksl, stride_ksh, stride_vsb, stride_vsl, stride_vsh, v_mul,
                   GROUP: tl.constexpr, D: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, FP32_DOT: tl.constexpr,
                   TILE_UPDATE: tl.constexpr, TAKE_TICKET: tl.constexpr, PAGE: tl.constexpr,
                   Q_LEN: tl.constexpr = 1, TIMELINE: tl.constexpr = False, PACK: tl.constexpr = 1,
                   ORDER_B: tl.constexpr = 0, TABLE_REGS: tl.constexpr = 0, K_SCALE: tl.constexpr = 0,
                   V_SCALE: tl.constexpr = 0, WORK: tl.constexpr = 0, WORK_B: tl.constexpr = 0,
                   WORK_P: tl.constexpr = 0, WORK_S: tl.constexpr = 0):
    if TIMELINE:
        t_start = timeline_start()
    h_kv = tl.program_id(0)   # the KV heads of a sequence are launched together (see the module doc)
    if WORK > 0:              # item i of the work list right before the counters (fdlib.kernels.worklist)
        b, split, unit = work_item(COUNTERS - WORK, LENS, tl.program_id(1) + tl.num_programs(1) * tl.program_id(2),
                                   tl.num_programs(1), chunk, WORK_S, L_MAX, h_kv == 0, BLOCK_N, WORK_B, WORK_P)
    elif ORDER_B > 0:           # place i of the grid runs the i-th longest sequence (see the module doc)
        b = longest_first(LENS, COUNTERS - ORDER_B, tl.program_id(1), tl.num_programs(1), L_MAX, ORDER_B)
    else:
        b = tl.program_id(1)
    if WORK == 0:
        split = tl.program_id(2)
    if TABLE_REGS > 0:   # the split's table entries go out with the length's load
        first = first_table(BT, b, split * chunk, L_MAX, stride_bt, TABLE_REGS, PAGE)
    else:
        first = None
    L = load_lengths(LENS, b, b >= 0, L_MAX, FLAG)
    if WORK > 0:              # the row's pieces: by its own length, or by the batch's unit (fdlib.worklist)
        chunk, _ = piece_rule(L, unit, WORK_S, BLOCK_N, WORK_P > 0)
        n_splits = tl.minimum(tl.maximum(tl.cdiv(L, chunk), 1), WORK_S)
    else:
        # at most the launched splits, so that the ticket count always reaches n_splits - 1 and the counter
        # is reset, even if a length exceeds the plan's L_cap (lengths grown since planning): the last split
        # then runs to L
        n_splits = tl.minimum(tl.maximum(tl.cdiv(L, chunk), 1), tl.num_programs(2))
    if split < n_splits:
        start, end = split_range(split, n_splits, chunk, L)
        o, lse, rows, mask_gd = attend_group(Q, K, V, b, h_kv, start, end, L, stride_qb, stride_qt, stride_qh,
                                             stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
                                             qk_scale, BT, stride_bt, n_pages, FLAG, GROUP, Q_LEN, D, BLOCK_G,
                                             BLOCK_N, BLOCK_D, FP32_DOT, TILE_UPDATE, PAGE, PACK, TABLE_REGS,
                                             first, (KS, VS, stride_ksb, stride_ksl, stride_ksh, stride_vsb,
                                                     stride_vsl, stride_vsh, v_mul), K_SCALE, V_SCALE)
        finish_row(o, lse, rows, mask_gd, h_kv * GROUP, split, n_splits, O_PART + b * stride_pb, stride_pt,
                   stride_ph, stride_ps, LSE_PART + b * stride_lb, stride_lt, stride_lh,
                   COUNTERS + b * H_KV + h_kv, OUT + b * stride_ob, stride_ot, stride_oh,
                   LSE + b * stride_sb, stride_st, stride_sh,
                   GROUP, Q_LEN, BLOCK_H, BLOCK_S, BLOCK_D, D, TAKE_TICKET, PACK)
    if TIMELINE:
        timeline_record(TIMES, t_start)


LONGEST_FIRST_MAX_BATCH = 128
"""Sequences a longest-first launch orders (ORDER_B: each program checks its plan's order, else sorts the lengths
in its registers); larger batches run in b order.
On the H200 the order won at B=128 and lost to stream-K at B=512 (fdlib.splits, LONGEST_FIRST_IMBALANCE's note)."""

_COUNTERS: dict = {}
_RETIRED: list = []
COUNTERS_MIN = 65536
"""Counters allocated at first use: one int32 per (b, h_kv) row, enough for B·H_kv up to 65536 (256 KB)."""

_RESOURCES: dict = {}


def compiled_resources(dtype, D: int, group: int, block_n: int) -> dict | None:
    """Warps, registers per thread and shared memory of the compiled unified kernel for this kind of call
    (known after its first launch; None before), for the cost model's programs-per-SM."""
    return _RESOURCES.get((dtype, D, group, block_n))


def ticket_counters(n: int, device) -> torch.Tensor:
    """Zeroed int32 ticket counters, one per (b, h_kv) row, kept between calls (the kernel resets them), for
    launches that bring none (a :class:`~fdlib.plan.DecodePlan` owns its own).

    One buffer per device, shared by every such call: calls on several CUDA streams at the same time must not
    overlap (they would share tickets). A buffer that grows keeps the old one alive, so a CUDA graph captured
    with it never writes to freed memory."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"unified decode: the ticket counters must exist before CUDA-graph capture; need {n}, have "
                f"{0 if buf is None else buf.numel()}. Run one eager call with the same shape before capturing, "
                f"or use fdlib.plan(...), whose plan owns its counters.")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, COUNTERS_MIN), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


_FLAGS: dict = {}


def scratch_flag(device) -> torch.Tensor:
    """A [1] int32 clamp flag for launches that bring none (see :func:`~fdlib.kernels.tile.load_lengths`)."""
    key = str(device)
    if key not in _FLAGS:
        _FLAGS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _FLAGS[key]


def unified_launcher(dtype, group: int, D: int, splits: int, cfg, tile_update_fn=None, ticket_fn=None,
                     dtype_slots=None, page: int = 0, merge_splits: int | None = None, q_len: int = 1,
                     timeline: bool = False, pack: int = 1, order: int = 0, table_regs: int = 0,
                     scale_modes: tuple = (0, 0), work: int = 0, work_b: int = 0,
                     work_p: int = 0) -> Launcher:
    """The unified kernel with its constexprs fixed for q's dtype, the group, D, the launched splits, the tiles,
    the page size (0: a contiguous cache) and the query tokens per sequence (group × q_len rows a program).
    ``merge_splits``: size the merge's blocks for this many splits instead of the launched ones
    (batch-invariant plans fix it, so the merge order never depends on the launch). ``timeline``: the variant
    that records each program's (SM, start, end) (:meth:`fdlib.plan.DecodePlan.timeline_buffer`). ``pack``: KV heads
    read as one (:func:`~fdlib.kernels.tile.own_dims`); ``group`` and ``D`` are then the pack's. ``order``: 0, or
    ORDER_B, a power of two >= the batch: its sequences launched longest first. ``table_regs``: 0, or the block-table
    entries a program holds in registers (:func:`fdlib.kernels.tile.attend_slice`'s TABLE_REGS). ``scale_modes``:
    (K_SCALE, V_SCALE) of an 8-bit cache (:data:`fdlib.quant.SCALE_CODES`), (0, 0) for a 16-bit one. ``work``: 0, or
    the room of a work list right before the ticket counters (:mod:`fdlib.kernels.worklist`): program i runs item i,
    and ``splits`` is S, the most pieces a row is cut into; ``work_b``: 0, or a power of two >= the batch whose
    lengths each program lists itself (:func:`~fdlib.kernels.worklist.work_item`); ``work_p``: 0, or the budget
    of items pieces sized by the batch come to (:func:`fdlib.worklist.balanced_chunk`). A work-list launch's
    third grid axis holds only the list's room, so S reaches the kernel as the constexpr WORK_S."""
    if work and (order or table_regs):
        raise ValueError("work: a work-list launch takes its rows from the list; order and table_regs must be 0")
    check_pack(pack, D, q_len)
    BLOCK_G, BLOCK_D = block_sizes(group * q_len, D)
    block_h, block_s = combine_blocks(group * q_len, merge_splits or splits, BLOCK_D)
    return Launcher(unified_kernel, dict(GROUP=group, D=D, BLOCK_G=BLOCK_G, BLOCK_N=cfg.BLOCK_N, BLOCK_D=BLOCK_D,
                                         BLOCK_H=block_h, BLOCK_S=block_s, FP32_DOT=fp32_dot(dtype),
                                         TILE_UPDATE=tile_update_fn or tile_update, TAKE_TICKET=ticket_fn or take_ticket,
                                         PAGE=page, Q_LEN=q_len, TIMELINE=timeline, PACK=pack, ORDER_B=order,
                                         TABLE_REGS=table_regs, K_SCALE=scale_modes[0], V_SCALE=scale_modes[1],
                                         WORK=work, WORK_B=work_b, WORK_P=work_p,
                                         WORK_S=splits if work else 0, num_warps=cfg.num_warps,
                                         num_stages=cfg.num_stages), dtype_slots)


def unified_args(q, k_cache, v_cache, lens, scale, chunk, splits, out, lse, o_part, lse_part, counters, flag,
                 block_table=None, times=None, pack: int = 1, scales=None):
    """(grid, pointers, scalars) of one launch (see :class:`~fdlib.kernels.launch.Launcher`); with a
    ``block_table`` [B, max_pages] the caches are pages [n_pages, page_size, H_kv, D]. q, out ``[B, H_q, D]``,
    lse ``[B, H_q]``, partials ``[B, H_q, splits, D]``/``[B, H_q, splits]``; or with the query-token axis:
    ``[B, q_len, H_q, D]``, ``[B, q_len, H_q]``, ``[B, q_len, H_q, splits, D]``/``[B, q_len, H_q, splits]``.
    ``times``: the timeline buffer of a TIMELINE launch (else the flag stands in for the unused pointer).
    ``pack``: KV heads a program reads as one (:func:`~fdlib.kernels.launch.packed_kv`; partials ``pack·D`` wide).
    ``scales``: an 8-bit cache's scale pointers and scalars (:func:`~fdlib.kernels.launch.scale_args`)."""
    sp, sc = scale_args(scales, flag)
    qs, os_, ss = strides4(q), strides4(out), strides4(lse, 3)
    if splits == 1:   # one split per row: the program writes out/lse itself and never touches the workspace
        o_part, lse_part = out, lse
        ps, ls = (*os_[:3], 0), ss
    else:
        ps, ls = strides4(o_part, 5), strides4(lse_part)
    H_kv, ks, vs = packed_kv(k_cache, v_cache, pack)
    bt, bt_stride, n_pages, L_max = paging(k_cache, block_table, flag)
    return ((H_kv, q.shape[0], splits),
            (q, k_cache, v_cache, lens, o_part, lse_part, counters, out, lse, flag, bt,
             flag if times is None else times, *sp),
            (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], ps[0], ps[1], ps[2], ps[3],
             ls[0], ls[1], ls[2], os_[0], os_[1], os_[2], ss[0], ss[1], ss[2], scale * LOG2E, chunk,
             H_kv, L_max, bt_stride, n_pages, *sc))


def remember_resources(compiled, dtype, D: int, group: int, cfg) -> None:
    """After a compiled launch: keep the kernel's warps, registers and shared memory for the cost model
    (``group``: the query rows a program holds, group × q_len)."""
    n_regs = getattr(compiled, "n_regs", None)
    if n_regs:
        _RESOURCES[(dtype, D, group, cfg.BLOCK_N)] = {"num_warps": cfg.num_warps, "n_regs": n_regs,
                                                      "shared": compiled.metadata.shared}


def run_unified(q, k_cache, v_cache, lens, scale, chunk, splits, cfg, out, lse, tile_update_fn=None,
                ticket_fn=None, *, o_part=None, lse_part=None, counters=None, flag=None, block_table=None):
    """One launch: partials, tickets and the merge. Writes ``out`` and ``lse`` in place. q is ``[B, H_q, D]`` or
    ``[B, q_len, H_q, D]`` (out like q, lse ``q.shape[:-1]``). ``o_part``,
    ``lse_part`` ([B, H_q, splits, D] and [B, H_q, splits] float32, with the q_len axis after B for a 4-D q),
    ``counters`` (zeroed int32, one per
    (b, h_kv) row) and ``flag`` are a plan's workspace; without them the call allocates the partials and
    uses the shared counters and flag of the device."""
    B, H_q, D = q.shape[0], q.shape[-2], q.shape[-1]
    H_kv = k_cache.shape[2]
    group = H_q // H_kv
    counters = ticket_counters(B * H_kv, q.device) if counters is None else counters
    flag = scratch_flag(q.device) if flag is None else flag
    if splits > 1 and o_part is None:
        o_part = q.new_empty((*q.shape[:-1], splits, D), dtype=torch.float32)
        lse_part = q.new_empty((*q.shape[:-1], splits), dtype=torch.float32)
    launcher = unified_launcher(q.dtype, group, D, splits, cfg, tile_update_fn, ticket_fn,
                                page=0 if block_table is None else k_cache.shape[1], q_len=q_len_of(q))
    compiled = launcher(*unified_args(q, k_cache, v_cache, lens, scale, chunk, splits, out, lse, o_part, lse_part,
                                      counters, flag, block_table))
    remember_resources(compiled, q.dtype, D, group * q_len_of(q), cfg)
