r"""Checks for Lab 06: paged KV caches and ragged batches.

* ``lab06.paged_tile_load(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages, D,
  BLOCK_D, PAGE) -> (k, v)``: a ``@triton.jit`` function. The cache is pages ``[n_pages, PAGE, H_kv, D]`` behind
  a block table; for key positions ``pos`` [N] of one sequence

  .. math:: \text{page} = \text{clamp}(\text{table}[\lfloor pos/\text{PAGE}\rfloor],\ 0,\ n_{pages}-1),\qquad
            \text{slot} = pos \bmod \text{PAGE}

  and the tile rows are ``K[page, slot, h_kv, :D]`` (``V`` alike): the logic of fdlib's
  :func:`fdlib.kernels.tile.page_rows` and :func:`~fdlib.kernels.tile.attend_slice`. Where ``valid`` is False
  (past the sequence's end) the table entry is unused: it is not read and the row is 0; dims >= D are 0.
* ``lab06.work_items(lengths, budget, block_n) -> [(b, start, end), ...]``: the balanced work list of
  :func:`fdlib.schedule.items` (FlashInfer's chunking):

  .. math:: \text{tiles}_b = \max(1, \lceil L_b/\text{BLOCK\_N}\rceil),\quad
            c = \lceil \textstyle\sum_b \text{tiles}_b / P\rceil,\quad n_b = \lceil \text{tiles}_b / c\rceil

  row b cut into n_b items of c tiles, item i covering keys
  :math:`[i\,c\,\text{BLOCK\_N}, \min((i+1)\,c\,\text{BLOCK\_N}, L_b))`, the last one
  running to :math:`L_b`; an empty row gives one empty item (b, 0, 0).
* ``lab06.work_list``: the device schedule's work list, a ``@triton.jit`` kernel; its checks are in
  :mod:`fdlib.course.grading.lab06_worklist`.

The tile checks launch small kernels of this module with the learner's function inside: one that stores every
tile it loads (compared exactly with the rows gathered in PyTorch, the pool surrounded by NaN guard pages so a
read outside it shows), and a decode loop (fdlib's :func:`~fdlib.kernels.tile.tile_update` over the learner's
tiles) compared with the float64 reference. One more runs the tile kernel in the interpreter and records which
block-table entries it reads: every entry in use, none past a row's pages (a read there is invisible in the tiles
when the K/V loads are masked, but may leave the table on a GPU).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as _interpreter

from fdlib import runtime
from fdlib.kernels.config import block_sizes, fp32_dot, tile_config
from fdlib.kernels.tile import LOG2E, state_to_partial, tile_update
from fdlib.reference import reference_attention
from fdlib.schedule import balanced, items as fdlib_items

from . import lab06_worklist  # noqa: F401  (registers lab06.work_list with this lab)
from .core import TOL, CheckFailure, assert_close, call, check_case, exercise_stub, randn
from .triton_exercise import launch, triton_stub

TILE = "lab06.paged_tile_load"
GUARD = 2
"""NaN pages on each side of the pool in the tile checks: a load outside the pool reads NaN."""
ITEMS = "lab06.work_items"

TILE_STUB = triton_stub(TILE, '''
@exercise("lab06.paged_tile_load")
@triton.jit
def paged_tile_load(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """The K and V rows of key positions `pos` [N] of one sequence, from a paged cache. Returns (k, v), each
    [N, BLOCK_D] in the cache's dtype.

    K, V: point at slot 0 of page 0 of this KV head: dim d of slot s of page p is at
    K + p * stride_kp + s * stride_kl + d (V alike). BT_ROW: this sequence's row of the block table (int32):
    entry i is the page that holds keys i*PAGE .. i*PAGE + PAGE - 1. n_pages: pages in the pool.
    valid [N]: False past the sequence's end; the table entries there are unused (anything may be in them):
    do not read them, and return zero rows. A used entry outside 0..n_pages-1 must never take a load outside
    the pool: clamp it into 0..n_pages-1. Dims D..BLOCK_D-1 are zero (BLOCK_D: D rounded up to a power of two).
    """
    # TODO: the table entry of each position (pos // PAGE, masked by valid), clamped into the pool; the slot in
    #       the page (pos % PAGE); then one masked load of the [N, BLOCK_D] rows of K and one of V.
    return pos, pos
''')

ITEMS_STUB = exercise_stub(ITEMS, '''
@exercise("lab06.work_items")
def work_items(lengths, budget, block_n):
    """The balanced work list of a ragged batch: a list of (b, start, end), row after row.

    lengths: int64 tensor [B] of KV lengths L_b; budget: P, the items to aim for (>= 1); block_n: BLOCK_N, keys
    per tile. tiles_b = max(1, ceil(L_b / BLOCK_N)) tiles per row (an empty row still costs a program's
    start-up), c = ceil(sum tiles_b / P) tiles per item, n_b = ceil(tiles_b / c) items of row b; item i of row b
    covers keys [i*c*BLOCK_N, min((i+1)*c*BLOCK_N, L_b)).
    """
    todo("lab06.work_items")
''')


# ---------------------------------------------------------------------------------------------- paged inputs
def paged_problem(gen, *, lengths, PAGE, H_kv=2, D=32, dtype=torch.float32, shuffle=True, shared_prefix=0,
                  unused="stale", bad_entries=(), guard=GUARD, block_n=None):
    """A paged cache and block table for ``lengths``: (pool, table, guarded pool storage, info).

    The pool ``[n_pages, PAGE, H_kv, D]`` is a view into storage with ``guard`` NaN pages on each side, so a load
    outside the pool reads NaN. Rows use their own pages (``shuffle``: in a random order of the pool) except the
    first ``shared_prefix`` pages, shared by every row (a common prompt). Unused table entries (pages past a row's
    end) hold ``unused``: ``"stale"`` (pages of other rows, as a freed and reused page would), ``"outside"``
    (indices outside the pool, within the guard) or ``"mixed"``. ``bad_entries``: (b, i, value) overrides of used
    entries, ``value`` an int or a function of n_pages. The table is a view ``[B, max_pages]`` of a wider one whose
    extra columns (entries -1) cover every position of the last tile, so even an unmasked read stays in memory."""
    B = len(lengths)
    max_pages = max(1, max(-(-L // PAGE) for L in lengths))
    N = block_n or _block_n()
    pad = max(0, -(-(max(1, -(-max(lengths) // N)) * N) // PAGE) - max_pages) + 1
    own = [max(0, -(-L // PAGE) - shared_prefix) for L in lengths]
    n_pages = shared_prefix + sum(own) + 1
    store = torch.full((n_pages + 2 * guard, PAGE, H_kv, D), float("nan"), dtype=dtype)
    store[guard:guard + n_pages] = randn(gen, n_pages, PAGE, H_kv, D, dtype=dtype)
    pool = store[guard:guard + n_pages]
    order = torch.randperm(n_pages, generator=gen) if shuffle else torch.arange(n_pages)
    table = torch.full((B, max_pages + pad), -1, dtype=torch.int32)[:, :max_pages]
    stale = torch.randint(0, n_pages, (B, max_pages), generator=gen, dtype=torch.int32)
    outside = torch.where(torch.rand(B, max_pages, generator=gen) < 0.5, -1 - torch.randint(0, guard, (B, max_pages),
                          generator=gen), n_pages + torch.randint(0, guard, (B, max_pages), generator=gen))
    pick = {"stale": stale, "outside": outside.to(torch.int32),
            "mixed": torch.where(torch.rand(B, max_pages, generator=gen) < 0.5, stale, outside.to(torch.int32))}[unused]
    at = shared_prefix
    for b, L in enumerate(lengths):
        used = -(-L // PAGE)
        table[b] = pick[b]
        table[b, :min(used, shared_prefix)] = order[:min(used, shared_prefix)].to(torch.int32)
        mine = max(0, used - shared_prefix)
        table[b, shared_prefix:shared_prefix + mine] = order[at:at + mine].to(torch.int32)
        at += mine
    for b, i, value in bad_entries:
        table[b, i] = value(n_pages) if callable(value) else value
    return pool, table, store, n_pages


def gathered(pool, table, lengths, rows: int):
    """[B, rows, H_kv, D]: the keys of each row gathered through the table in PyTorch (page entries clamped into
    the pool), zero past the row's length."""
    B = len(lengths)
    n_pages, PAGE, H_kv, D = pool.shape
    out = torch.zeros(B, rows, H_kv, D, dtype=pool.dtype)
    for b, L in enumerate(lengths):
        pos = torch.arange(L)
        page = table[b, pos // PAGE].long().clamp(0, n_pages - 1)
        out[b, :L] = pool[page, pos % PAGE]
    return out


@triton.jit
def _tile_probe(K, V, BT, LENS, OUT_K, OUT_V, stride_kp, stride_kl, stride_kh, stride_vp, stride_vl, stride_vh,
                stride_bt, n_pages, stride_ob, stride_oh, stride_on,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                LOAD: tl.constexpr):
    """Program (b, tile, h_kv): load keys tile·BLOCK_N + [0, BLOCK_N) of sequence b with LOAD, store the whole
    [BLOCK_N, BLOCK_D] tiles of K and V (masked rows and dims included) to OUT_K/OUT_V [B, H_kv, rows, BLOCK_D]."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    h = tl.program_id(2)
    L = tl.load(LENS + b)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    pos = t * BLOCK_N + offs_n
    k, v = LOAD(K + h * stride_kh, V + h * stride_vh, BT + b * stride_bt, pos, pos < L, stride_kp, stride_kl,
                stride_vp, stride_vl, n_pages, D, BLOCK_D, PAGE)
    dst = b * stride_ob + h * stride_oh + pos[:, None] * stride_on + offs_d[None, :]
    tl.store(OUT_K + dst, k.to(OUT_K.dtype.element_ty))
    tl.store(OUT_V + dst, v.to(OUT_V.dtype.element_ty))


def _probe(impl, store, guard: int, n_pages: int, table, lengths, block_n: int):
    """The tiles the learner's function loads for every (sequence, tile, KV head): (k, v) [B, H_kv, rows, BLOCK_D].
    ``store``: the pool with its NaN guard pages (``guard`` on each side); the kernel gets the view between them."""
    _, PAGE, H_kv, D = store.shape
    B = len(lengths)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    tiles = max(1, -(-max(lengths) // block_n))
    rows = tiles * block_n
    dev = runtime.DEVICE
    pool_d = store.to(dev)[guard:guard + n_pages]
    table_d = table.to(dev)
    out_k = torch.full((B, H_kv, rows, BLOCK_D), float("nan"), dtype=store.dtype, device=dev)
    out_v = torch.full_like(out_k, float("nan"))
    lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    launch("a kernel with your paged_tile_load", lambda: _tile_probe[(B, tiles, H_kv)](
        pool_d, pool_d, table_d, lens, out_k, out_v, pool_d.stride(0), pool_d.stride(1), pool_d.stride(2),
        pool_d.stride(0), pool_d.stride(1), pool_d.stride(2), table_d.stride(0), n_pages,
        out_k.stride(0), out_k.stride(1), out_k.stride(2), D=D, BLOCK_D=BLOCK_D, BLOCK_N=block_n, PAGE=PAGE,
        LOAD=impl))
    return out_k.cpu(), out_v.cpu(), rows, BLOCK_D


def _block_n() -> int:
    return tile_config(64, 256).BLOCK_N


def _check_tiles(impl, gen, *, lengths, PAGE, what, D=32, dtype=torch.float32, **kw):
    """Every tile the learner loads equals the rows gathered in PyTorch, exactly (a load copies)."""
    pool, table, store, n_pages = paged_problem(gen, lengths=lengths, PAGE=PAGE, D=D, dtype=dtype, guard=GUARD, **kw)
    N = _block_n()
    got_k, got_v, rows, BLOCK_D = _probe(impl, store, GUARD, n_pages, table, lengths, N)
    want = gathered(pool, table, lengths, rows)                        # [B, rows, H_kv, D]
    want = torch.nn.functional.pad(want, (0, BLOCK_D - D)).permute(0, 2, 1, 3)   # [B, H_kv, rows, BLOCK_D]
    for name, got in (("k", got_k), ("v", got_v)):
        if torch.equal(got, want):
            continue
        nan = torch.isnan(got)
        bad = (got != want) | nan
        b, h, p, d = (int(i) for i in bad.nonzero()[0])
        L = lengths[b]
        where = (f"sequence b={b} (L={L}), KV head {h}, key position {p} (page-table entry {p // PAGE} = "
                 f"{int(table[b, p // PAGE]) if p // PAGE < table.shape[1] else 'past the table'}, slot {p % PAGE}), "
                 f"dim {d}")
        if p >= L:
            hint = "rows past the sequence's end must be 0 (their table entries are unused: mask the loads with valid)"
        elif d >= D:
            hint = f"dims {D}..{BLOCK_D - 1} must be 0 (mask the loads with offs_d < D)"
        elif bool(nan[b, h, p, d]):
            hint = ("a load read outside the page pool (NaN guard pages around it): clamp the page index into "
                    "0..n_pages-1")
        else:
            hint = "page = table[pos // PAGE], slot = pos % PAGE; the row is at page * stride_kp + slot * stride_kl"
        raise CheckFailure(f"{what}: tile {name} differs at {int(bad.sum())} value(s); first at {where}: expected {float(want[b, h, p, d]):.5g}, got "
                           f"{float(got[b, h, p, d]):.5g}. {hint}")


@check_case(TILE, "pages of 16 keys in order, lengths 37 and 16: every tile's K and V rows", points=2)
def _t_basic(impl, gen):
    _check_tiles(impl, gen, lengths=[37, 16], PAGE=16, shuffle=False, what="pages of 16 in order")


@check_case(TILE, "shuffled pages of 1, 4, 16 and 64 keys, a shared prompt prefix; head dims 80 and 32")
def _t_shuffled(impl, gen):
    for PAGE in (1, 4, 16, 64):
        _check_tiles(impl, gen, lengths=[70, 45, 9], PAGE=PAGE, shared_prefix=max(1, 16 // PAGE),
                     what=f"page_size {PAGE}, shuffled, shared prefix")
    _check_tiles(impl, gen, lengths=[50, 33], PAGE=8, D=80, what="D=80 (BLOCK_D 128), page_size 8")


@check_case(TILE, "lengths at page and tile edges (0, 1, PAGE-1, PAGE, PAGE+1, 2 tiles): rows past the end are 0, "
                  "unused table entries never followed")
def _t_edges(impl, gen):
    N = _block_n()
    for PAGE in (4, 16):
        lengths = [0, 1, PAGE - 1, PAGE, PAGE + 1, 2 * N, 2 * N + 1]
        _check_tiles(impl, gen, lengths=lengths, PAGE=PAGE, unused="stale",
                     what=f"page_size {PAGE}, lengths {lengths}, unused entries naming other rows' pages")
        _check_tiles(impl, gen, lengths=lengths, PAGE=PAGE, unused="outside",
                     what=f"page_size {PAGE}, lengths {lengths}, unused entries outside the pool")


@check_case(TILE, "used table entries outside the pool (-1, -2, n_pages) are clamped: no load leaves the pool")
def _t_clamp(impl, gen):
    _check_tiles(impl, gen, lengths=[40, 24], PAGE=8, bad_entries=[(0, 1, -1), (1, 2, lambda n: n), (0, 4, -2)],
                 what="page_size 8, entries -1, -2 and n_pages in use")


@contextmanager
def _recorded_reads(table):
    """Record the (b, i) block-table entries that interpreted loads read (mask on) while the block runs: a list
    filled in place. Entries are mapped through ``table``'s storage (the interpreter runs a CPU tensor in place), so
    a read of the wider storage's padding columns shows as i >= table.shape[1]."""
    base = table.untyped_storage().data_ptr()
    end = base + table.untyped_storage().nbytes()
    esize, stride = table.element_size(), table.stride(0)
    reads: list = []
    load = _interpreter.InterpreterBuilder.create_masked_load

    def recording(self, ptrs, mask, other, *args):
        addr = np.asarray(ptrs.data).astype(np.uint64)
        on = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        hit = addr[on & (addr >= base) & (addr < end)]
        reads.extend(divmod((int(a) - base) // esize, stride) for a in np.unique(hit))
        return load(self, ptrs, mask, other, *args)

    _interpreter.InterpreterBuilder.create_masked_load = recording
    try:
        yield reads
    finally:
        _interpreter.InterpreterBuilder.create_masked_load = load


@check_case(TILE, "the block table is read only where valid: every entry in use, no entry past a row's pages "
                  "(its reads recorded in the interpreter)")
def _t_table_reads(impl, gen):
    N = _block_n()
    interpreted = _interpreter.InterpretedFunction
    probe = interpreted(getattr(_tile_probe, "fn", _tile_probe))
    load = interpreted(getattr(impl, "fn", impl))
    for PAGE in (4, 16):
        lengths = [0, 1, PAGE + 1, N + 3, 2 * N]
        pool, table, store, n_pages = paged_problem(gen, lengths=lengths, PAGE=PAGE, unused="mixed")
        _, _, H_kv, D = store.shape
        BLOCK_D = max(16, triton.next_power_of_2(D))
        tiles = -(-max(lengths) // N)
        out = torch.zeros(len(lengths), H_kv, tiles * N, BLOCK_D, dtype=store.dtype)
        lens = torch.tensor(lengths, dtype=torch.int32)
        with _recorded_reads(table) as reads:
            launch("a kernel with your paged_tile_load", lambda: probe[(len(lengths), tiles, H_kv)](
                pool, pool, table, lens, out, out, pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(0),
                pool.stride(1), pool.stride(2), table.stride(0), n_pages, out.stride(0), out.stride(1),
                out.stride(2), D=D, BLOCK_D=BLOCK_D, BLOCK_N=N, PAGE=PAGE, LOAD=load))
        read = set(reads)
        what = f"page_size {PAGE}, lengths {lengths} (table {list(table.shape)})"
        for b, L in enumerate(lengths):
            used = -(-L // PAGE)
            past = sorted(i for r, i in read if r == b and i >= used)
            if past:
                i = past[0]
                where = "past the end of the table's row" if i >= table.shape[1] else "unused"
                raise CheckFailure(f"{what}: your load read block-table entry {i} of sequence b={b} (L={L}, "
                                   f"{used} page(s) in use; entry {i} is {where}). Entries past a row's pages hold "
                                   f"anything and may lie past the table's end: load the entries with mask=valid")
            missing = [i for i in range(used) if (b, i) not in read]
            if missing:
                raise CheckFailure(f"{what}: your load never read block-table entry {missing[0]} of sequence b={b} "
                                   f"(L={L}, {used} page(s) in use): every page of the row comes from the table")


@triton.jit
def _paged_decode(Q, K, V, BT, LENS, OUT, LSE, stride_qb, stride_qh, stride_kp, stride_kl, stride_kh,
                  stride_vp, stride_vl, stride_vh, stride_bt, n_pages, stride_ob, stride_oh, stride_lb,
                  qk_scale, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PAGE: tl.constexpr, FP32_DOT: tl.constexpr, LOAD: tl.constexpr):
    """One program per (sequence, KV head): decode attention over the whole sequence, tiles loaded with LOAD."""
    b = tl.program_id(0)
    h_kv = tl.program_id(1)
    L = tl.load(LENS + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = h_kv * GROUP + offs_g
    mask_gd = (offs_g < GROUP)[:, None] & (offs_d < D)[None, :]
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_gd, other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, L, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < L
        k, v = LOAD(K + h_kv * stride_kh, V + h_kv * stride_vh, BT + b * stride_bt, pos, valid, stride_kp,
                    stride_kl, stride_vp, stride_vl, n_pages, D, BLOCK_D, PAGE)
        m, l, acc = tile_update(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT)
    o, lse = state_to_partial(m, l, acc)
    tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], o.to(OUT.dtype.element_ty),
             mask=mask_gd)
    tl.store(LSE + b * stride_lb + heads, lse, mask=offs_g < GROUP)


def paged_attention(load_fn, q, k_pages, v_pages, table, lengths, scale=None):
    """Decode attention of q ``[B, H_q, D]`` over a paged cache (pages ``[n_pages, PAGE, H_kv, D]``, int32 ``table``
    ``[B, max_pages]``, host ``lengths``) by a one-program-per-(b, h_kv) loop whose tiles come from ``load_fn``
    (a paged_tile_load) and go through fdlib's tile update: (out, lse) on the kernels' device."""
    B, H_q, D = q.shape
    n_pages, PAGE, H_kv, _ = k_pages.shape
    dev = runtime.DEVICE
    scale = 1 / math.sqrt(D) if scale is None else scale
    qd, kd, vd, td = (t.to(dev) for t in (q, k_pages, v_pages, table))
    lens = torch.tensor(list(lengths), dtype=torch.int32, device=dev)
    out = torch.full((B, H_q, D), float("nan"), dtype=q.dtype, device=dev)
    lse = torch.full((B, H_q), float("nan"), dtype=torch.float32, device=dev)
    BLOCK_G, BLOCK_D = block_sizes(H_q // H_kv, D)
    launch("the decode loop with your paged_tile_load", lambda: _paged_decode[(B, H_kv)](
        qd, kd, vd, td, lens, out, lse, qd.stride(0), qd.stride(1), kd.stride(0), kd.stride(1), kd.stride(2),
        vd.stride(0), vd.stride(1), vd.stride(2), td.stride(0), n_pages, out.stride(0), out.stride(1),
        lse.stride(0), scale * LOG2E, GROUP=H_q // H_kv, D=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D,
        BLOCK_N=_block_n(), PAGE=PAGE, FP32_DOT=fp32_dot(q.dtype), LOAD=load_fn))
    return out, lse


def _decode(impl, gen, *, lengths, PAGE, H_q, H_kv, D, dtype, what):
    pool_k, table, _, n_pages = paged_problem(gen, lengths=lengths, PAGE=PAGE, H_kv=H_kv, D=D, dtype=dtype,
                                              unused="mixed")
    pool_v = randn(gen, *pool_k.shape, dtype=dtype)
    q = randn(gen, len(lengths), H_q, D, dtype=dtype)
    scale = 1 / math.sqrt(D)
    out, lse = paged_attention(impl, q, pool_k, pool_v, table, lengths, scale)
    rows = max(max(lengths), 1)
    k_c = gathered(pool_k, table, lengths, rows)
    v_c = gathered(pool_v, table, lengths, rows)
    ref_o, ref_lse = reference_attention(q, k_c, v_c, torch.tensor(lengths, dtype=torch.int32), scale)
    atol, rtol = TOL[dtype]
    assert_close(out.cpu(), ref_o, f"{what}: out", atol, rtol)
    assert_close(lse.cpu(), ref_lse, f"{what}: lse", 1e-4, 1e-5)


@check_case(TILE, "inside a decode loop: paged attention vs the float64 reference (group 3, ragged, shuffled pages)",
            points=2)
def _t_decode(impl, gen):
    _decode(impl, gen, lengths=[53, 0, 16, 31], PAGE=4, H_q=6, H_kv=2, D=32, dtype=torch.float32,
            what="float32, page_size 4, lengths [53, 0, 16, 31]")
    _decode(impl, gen, lengths=[40, 17], PAGE=16, H_q=4, H_kv=1, D=64, dtype=torch.float16,
            what="float16, page_size 16, lengths [40, 17]")


# ---------------------------------------------------------------------------------------------- work items
def _as_items(got, what) -> list[tuple[int, int, int]]:
    if isinstance(got, torch.Tensor):
        if got.dim() != 2 or got.shape[-1] != 3:
            raise CheckFailure(f"{what}: a tensor of items must be [n_items, 3] (b, start, end), got "
                               f"{list(got.shape)}")
        got = got.tolist()
    if not isinstance(got, (list, tuple)):
        raise CheckFailure(f"{what}: expected a list of (b, start, end) tuples, got {type(got).__name__}")
    out = []
    for i, it in enumerate(got):
        if isinstance(it, torch.Tensor):
            it = it.tolist()
        if not isinstance(it, (list, tuple)) or len(it) != 3:
            raise CheckFailure(f"{what}: item {i} should be a tuple (b, start, end), got {it!r}")
        try:
            out.append(tuple(int(x) for x in it))
        except (TypeError, ValueError):
            raise CheckFailure(f"{what}: item {i} should hold three ints, got {it!r}") from None
    return out


def _coverage(items, lengths, what):
    """Every key of every row exactly once, in order, and one item at least per row (empty rows: (b, 0, 0))."""
    B = len(lengths)
    by_row: dict = {}
    for b, s, e in items:
        if not 0 <= b < B:
            raise CheckFailure(f"{what}: item ({b}, {s}, {e}) names sequence {b}, but there are {B}")
        by_row.setdefault(b, []).append((s, e))
    for b, L in enumerate(lengths):
        parts = by_row.get(b, [])
        if not parts:
            raise CheckFailure(f"{what}: row {b} (L={L}) has no item; every row needs one, an empty row too "
                               f"(its program still starts up and writes O = 0, lse = -inf)")
        at = 0
        for s, e in parts:
            if s != at or e < s:
                raise CheckFailure(f"{what}: row {b} (L={L}): items {parts[:6]} do not cover keys 0..{L} in order "
                                   f"(expected an item starting at {at}, got ({s}, {e}))")
            at = e
        if at != L:
            raise CheckFailure(f"{what}: row {b} (L={L}): the items end at key {at}, not at L={L} "
                               f"({'the tail is dropped' if at < L else 'they run past the row'}); items {parts[:6]}")


def _compare_items(impl, lengths, budget, block_n, what):
    args = {"lengths": torch.tensor(lengths, dtype=torch.int64), "budget": budget, "block_n": block_n}
    got = _as_items(call(impl, args), what)
    want = fdlib_items(lengths, budget, block_n)
    _coverage(got, lengths, what)
    if got != want:
        s = balanced(lengths, budget, block_n)
        T = int(torch.clamp((torch.tensor(lengths, dtype=torch.int64) + block_n - 1) // block_n, min=1).sum())
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise CheckFailure(f"{what}: {len(got)} items, expected {len(want)} (T = {T} tiles, c = ceil(T / P) = "
                           f"{s.chunk_tiles} tiles = {s.chunk_tiles * block_n} keys per item); first difference at "
                           f"item {first}: got {got[first] if first < len(got) else 'nothing'}, expected "
                           f"{want[first] if first < len(want) else 'nothing'}")


def _zipf(gen, B, mean):
    u = torch.rand(B, generator=gen, dtype=torch.float64)
    x = ((1 - u) ** (-1 / 1.5) - 1) * 0.5
    return [int(v) for v in torch.clamp(1 + torch.floor(mean * x), 1, 8 * mean).tolist()]


@check_case(ITEMS, "uniform random lengths, budget B·splits, 128-key tiles: fdlib.schedule's items", points=2)
def _i_uniform(impl, gen):
    for B, splits in ((32, 6), (7, 3), (16, 1)):
        lengths = torch.randint(1, 32769, (B,), generator=gen).tolist()
        _compare_items(impl, lengths, B * splits, 128, f"B={B}, lengths uniform in 1..32768, budget {B * splits}")


@check_case(ITEMS, "Zipf-like lengths (most short, a few long) and one long row among short ones")
def _i_zipf(impl, gen):
    lengths = _zipf(gen, 32, 8192)
    _compare_items(impl, lengths, 32 * 8, 128, "B=32 Zipf-like lengths of mean 8192, budget 256")
    _compare_items(impl, [131072] + [300] * 127, 132, 128, "one row of 131072 among 127 of 300, budget 132")


@check_case(ITEMS, "rows shorter than one tile and empty rows count one tile each (a program's start-up)")
def _i_short(impl, gen):
    _compare_items(impl, [0, 5, 0, 1, 16, 17, 3], 4, 16, "lengths [0, 5, 0, 1, 16, 17, 3], budget 4, 16-key tiles")
    _compare_items(impl, [0, 0, 0], 2, 16, "three empty rows, budget 2")
    _compare_items(impl, [1000, 0, 2], 8, 16, "lengths [1000, 0, 2], budget 8")


@check_case(ITEMS, "budget edge cases: 1, exactly the total tiles, more than the tiles, one row, odd tile sizes")
def _i_budget(impl, gen):
    lengths = [100, 37, 64, 1, 250]
    T = sum(max(1, -(-L // 16)) for L in lengths)
    for P in (1, 2, T, T + 1, 10 * T):
        _compare_items(impl, lengths, P, 16, f"lengths {lengths}, 16-key tiles (Σ tiles_b = {T}), budget {P}")
    _compare_items(impl, [12345], 7, 64, "one row of 12345, budget 7, 64-key tiles")
    _compare_items(impl, [99, 100, 101], 5, 33, "lengths [99, 100, 101], budget 5, 33-key tiles")
