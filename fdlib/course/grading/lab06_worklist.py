r"""Checks for Lab 06's device schedule: ``lab06.work_list``, a ``@triton.jit`` kernel that writes a launch's work list.

The kernel runs as one program. It reads the lengths ``LENS`` [B] (int32) and writes into ``OUT`` (int32, room
for 1 + B·S entries) the list of :mod:`fdlib.worklist`, in the lab's symbols (c in tiles of BLOCK_N keys, as in
the balanced schedule's c; ``chunk`` a multiple of BLOCK_N, so that c·BLOCK_N is :func:`fdlib.worklist.piece_keys`):

.. math::
    \text{tiles}_b = \max(1, \lceil L_b/\text{BLOCK\_N} \rceil), \qquad
    c(L_b) = \max\Bigl(\frac{\text{chunk}}{\text{BLOCK\_N}},\ \Bigl\lceil \frac{\text{tiles}_b}{S} \Bigr\rceil\Bigr),
    \qquad n(L_b) = \Bigl\lceil \frac{\text{tiles}_b}{c(L_b)} \Bigr\rceil \le S

row b is cut into n(L_b) pieces; the rows go longest first (L descending, the lower b first among equal lengths),
each row's pieces consecutive, j = 0, 1, …; ``OUT[0]`` is the number of items Σ_b n(L_b) and ``OUT[1 + i]`` is
item i encoded as b·S + j.

The checks launch the learner's kernel (:func:`run_work_list`) on fresh ragged batches and compare the buffer with
:func:`fdlib.worklist.work_list` exactly. A wrong list is explained by its likely cause (:func:`explain`): a row
dropped, a piece twice, a row cut into the wrong number of pieces, the count wrong, the pieces of a row not
consecutive, the order reversed (shortest first), ties broken the wrong way.
"""
from __future__ import annotations

from collections import Counter

import torch
import triton

from fdlib import runtime, worklist

from .core import CheckFailure, GuardedBuffer, check_case
from .triton_exercise import launch, triton_stub

NAME = "lab06.work_list"
FILL = -1
"""What the list's buffer holds before the kernel runs: an entry still -1 was never written."""

STUB = triton_stub(NAME, '''
@exercise("lab06.work_list")
@triton.jit
def work_list(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program writes the launch's work list for the lengths LENS[0..B-1] (int32) into OUT (int32).

    Row b (L = LENS[b] keys) is cut into n(L) pieces of c(L) tiles, at most S pieces (chunk: the fewest keys a
    piece holds, a multiple of BLOCK_N):
        tiles = max(1, cdiv(L, BLOCK_N))   c(L) = max(chunk // BLOCK_N, cdiv(tiles, S))   n(L) = cdiv(tiles, c(L))
    The list: rows longest first (L descending; equal lengths: the lower b first), the pieces of a row one after
    the other, j = 0, 1, ..., n(L) - 1. Write OUT[0] = the number of items (the sum of n(L_b)) and
    OUT[1 + i] = b * S + j for item i = (b, j). BLOCK_B: B rounded up to a power of two (rows >= B are padding).
    """
    rows = tl.arange(0, BLOCK_B)
    # TODO: load the lengths (masked: rows < B); tiles, c and n of every row (tl.cdiv, tl.maximum; n = 0 for
    #       padding rows); where each row's pieces start = the pieces of the rows that go before it (a
    #       [BLOCK_B, BLOCK_B] comparison, summed along one axis); store the count, then for j in range(0, S)
    #       the codes of piece j of every row that has one.
''')


def block_rows(B: int) -> int:
    """BLOCK_B: B rounded up to a power of two (at least 16, a comfortable tile for the compiler)."""
    return max(16, triton.next_power_of_2(B))


def room(lengths, S: int) -> int:
    """The entries of the buffer the checks give the kernel: the count, B·S items (the list's room), and past them
    as many again as a list with no cap of S pieces would need, so that such a list shows in the buffer (and is
    named) instead of being caught as a write out of bounds."""
    return 1 + worklist.capacity(len(lengths), S) + sum(max(1, -(-int(L) // 16)) for L in lengths) + len(lengths)


def run_work_list(kernel, lengths, chunk: int, S: int, N: int) -> list[int]:
    """Launch ``kernel`` (a ``lab06.work_list``) as one program on ``lengths``; the buffer it wrote, [count, codes...]
    (-1 where nothing was written; :func:`room` entries). Fails if it wrote outside the buffer or into the lengths."""
    B = len(lengths)
    dev = runtime.DEVICE
    lens = torch.tensor([int(L) for L in lengths], dtype=torch.int32, device=dev)
    keep = lens.clone()
    out = GuardedBuffer((room(lengths, S),), dtype=torch.int32, device=dev, fill=FILL)
    launch("your work_list kernel",
           lambda: kernel[(1,)](lens, out.view, B, chunk, S, BLOCK_N=N, BLOCK_B=block_rows(B)))
    out.verify("work-list buffer OUT")
    if not torch.equal(lens, keep):
        raise CheckFailure("your kernel wrote into LENS (the lengths are an input)")
    return out.view.cpu().tolist()


def decode(buf: list[int], S: int) -> list[tuple[int, int]]:
    """The items (b, j) of a buffer [count, codes...]."""
    return [divmod(code, S) for code in buf[1:1 + buf[0]]]


# ---------------------------------------------------------------------------------------------- what went wrong
def _why_pieces(L: int, chunk: int, S: int, N: int) -> str:
    t, c, n = max(1, worklist.cdiv(L, N)), worklist.piece_keys(L, chunk, S, N) // N, worklist.pieces(L, chunk, S, N)
    return (f"tiles = max(1, ⌈{L}/{N}⌉) = {t}, c = max({chunk}/{N}, ⌈{t}/{S}⌉) = {c} tiles a piece, "
            f"n = ⌈{t}/{c}⌉ = {n}")


def explain(buf: list[int], lengths, chunk: int, S: int, N: int) -> str | None:
    """None if the buffer holds the work list of ``lengths``, else what is wrong with it and its likely cause."""
    lengths = [int(L) for L in lengths]
    B, cap = len(lengths), worklist.capacity(len(lengths), S)
    want = worklist.encode(worklist.work_list(lengths, chunk, S, N), S)
    n, count, body = want[0], buf[0], buf[1:]
    past = [i for i, x in enumerate(body[cap:], cap) if x != FILL]
    if count == n and body[:n] == want[1:] and not past:
        return None
    if body[:n] == want[1:] and all(x == FILL for x in body[n:]):
        return (f"the items are right but the count OUT[0] is {count}, expected {n}: the count is the number of "
                f"items, the sum of n(L_b) over the rows (an empty row counts one piece). The count is wrong")
    long = [b for b, L in enumerate(lengths) if L > chunk * S]
    if long and count == sum(max(1, worklist.cdiv(L, chunk)) for L in lengths):
        b = long[0]
        return (f"the count {count} is that of pieces of chunk = {chunk} keys: row b={b} (L={lengths[b]} > chunk·S "
                f"= {chunk * S}) was cut into more than S = {S} pieces. A piece holds c(L) = "
                f"max(chunk/BLOCK_N, ⌈tiles/S⌉) tiles, which grows with L so that n(L) ≤ S: "
                f"{_why_pieces(lengths[b], chunk, S, N)}")
    pads = sorted({code // S for code in body if code != FILL and B <= code // S < block_rows(B) and code % S == 0})
    if pads and count == n + block_rows(B) - B:
        return (f"OUT holds pieces of rows b = {pads[:4]}{'...' if len(pads) > 4 else ''}, and the count "
                f"{count} is {block_rows(B) - B} too many: the padding rows (rows >= B = {B} of the BLOCK_B = "
                f"{block_rows(B)}) were cut into pieces. Set n = 0 where rows >= B (tl.where), so that they add "
                f"nothing to the count and store nothing")
    if past:
        return (f"OUT[{1 + past[0]}] was written, past the list's room of B·S = {cap} items (expected {n} items): "
                f"a row has more than S pieces, or a piece is stored at the wrong place. Piece j of row b goes to "
                f"OUT[1 + first_b + j], first_b = the pieces of the rows that go before b (the sum over them of n, "
                f"one number per row b)")
    if not 0 <= count <= cap:
        return f"the count OUT[0] = {count} is outside 0..B·S = {cap} (expected {n}): the count is wrong"
    items = body[:count]
    for i, code in enumerate(items):
        if code == FILL:
            return (f"item {i} (OUT[{1 + i}]) was never written, though the count OUT[0] says {count} items "
                    f"(expected {n}): the count is wrong, a store is masked off, or a piece is stored at the wrong "
                    f"place (piece j of row b goes to OUT[1 + first_b + j], first_b = the pieces of the rows that "
                    f"go before b)")
        if not 0 <= code < cap:
            return (f"item {i} is {code}, which is no code b·S + j of a row b < B = {B} (expected "
                    f"{want[1 + i] if i < n else 'no item there'}): store b * S + j")
    got = [divmod(code, S) for code in items]
    rows_seen = {b for b, _ in got}
    for b in worklist.order(lengths):
        if b not in rows_seen:
            L = lengths[b]
            why = " (an empty row is still one piece: n(0) = 1, its program writes O = 0, lse = -inf)" if L == 0 \
                else ""
            return f"row b={b} (L={L}) has no item: a row dropped{why}"
    times = Counter(got)
    for (b, j), k in times.items():
        if k > 1:
            where = [i for i, it in enumerate(got) if it == (b, j)]
            return f"piece j={j} of row b={b} (L={lengths[b]}) is in the list {k} times (items {where}): a piece twice"
    for b in range(B):
        has = sorted(j for r, j in got if r == b)
        n_b = worklist.pieces(lengths[b], chunk, S, N)
        if has != list(range(n_b)):
            return (f"row b={b} (L={lengths[b]}) has pieces j = {has}, expected j = 0..{n_b - 1}: "
                    f"{_why_pieces(lengths[b], chunk, S, N)}")
    for b in range(B):
        at = [i for i, (r, _) in enumerate(got) if r == b]
        if at != list(range(at[0], at[0] + len(at))):
            return (f"the pieces of row b={b} are items {at[:8]}: not consecutive. A row's pieces follow each other "
                    f"in the list (one row after another, not piece 0 of every row, then piece 1, ...)")
        js = [j for r, j in got if r == b]
        if js != sorted(js):
            return f"the pieces of row b={b} come in the order j = {js[:8]}; a row's pieces go j = 0, 1, 2, …"
    seq = list(dict.fromkeys(b for b, _ in got))              # the rows in the order of the list
    best = worklist.order(lengths)
    Ls = lambda rows: [lengths[b] for b in rows]              # noqa: E731
    shortest = sorted(range(B), key=lambda b: (lengths[b], b))
    if Ls(seq) == Ls(shortest) and Ls(seq) != Ls(best):
        return (f"the rows come shortest first (lengths {Ls(seq)[:8]}...): the order is reversed. Longest first: "
                f"L descending, so the largest pieces start first and the short ones fill the end of the launch")
    if Ls(seq) == Ls(best):
        i = next(i for i, (a, e) in enumerate(zip(seq, best)) if a != e)
        return (f"rows {seq[i]} and {best[i]} have the same length {lengths[best[i]]} and come as b={seq[i]} "
                f"first: ties broken the wrong way. Among equal lengths the lower b goes first (so the list is one "
                f"order, whatever sorts it)")
    i = next(i for i, (a, e) in enumerate(zip(seq, best)) if a != e)
    return (f"the rows come in the order b = {seq[:8]}, lengths {Ls(seq)[:8]}; expected b = {best[:8]} (longest "
            f"first: L descending, the lower b first among equal lengths); the first difference is row {i} of the "
            f"order")


def check_lengths(impl, lengths, chunk: int, S: int, N: int, what: str) -> None:
    buf = run_work_list(impl, lengths, chunk, S, N)
    why = explain(buf, lengths, chunk, S, N)
    if why is not None:
        want = worklist.encode(worklist.work_list(lengths, chunk, S, N), S)
        shown = lambda xs: str(xs[:12])[:-1] + (", ...]" if len(xs) > 12 else "]")   # noqa: E731
        raise CheckFailure(f"{what} (lengths {list(lengths)}, chunk {chunk}, S {S}, BLOCK_N {N}): {why}. "
                           f"OUT starts {shown(buf[:1 + max(0, min(buf[0], len(buf) - 1))])}, expected "
                           f"{shown(want)}")


def _ragged(gen, B: int, top: int) -> list[int]:
    return torch.randint(0, top + 1, (B,), generator=gen).tolist()


# ---------------------------------------------------------------------------------------------- the checks
@check_case(NAME, "fresh ragged batches (B = 5, 8, 13; chunk 32, S 4, BLOCK_N 16): fdlib.worklist's list",
            points=2)
def _w_ragged(impl, gen):
    for B in (5, 8, 13):
        check_lengths(impl, _ragged(gen, B, 300), 32, 4, 16, f"B={B}, lengths uniform in 0..300")


@check_case(NAME, "lengths 0 and 1 and lengths not a multiple of BLOCK_N: an empty row is still one piece")
def _w_short(impl, gen):
    N = 16
    odd = [int(x) * N + int(r) for x, r in zip(torch.randint(1, 12, (3,), generator=gen),
                                               torch.randint(1, N, (3,), generator=gen))]
    lengths = [0, 1] + odd + [0, N - 1, N + 1]
    perm = torch.randperm(len(lengths), generator=gen).tolist()
    check_lengths(impl, [lengths[p] for p in perm], 32, 4, N, "empty, one-key and odd lengths")


@check_case(NAME, "equal lengths (ties): the lower b first; every row equal; a batch of one")
def _w_ties(impl, gen):
    a, b = sorted(_ragged(gen, 2, 200))
    check_lengths(impl, [a, b, a, b, b, a, 0, 0], 32, 4, 16, "two lengths, each four times")
    L = int(torch.randint(1, 400, (1,), generator=gen))
    check_lengths(impl, [L] * 6, 32, 4, 16, "six equal rows")
    for L in (0, 1, L):
        check_lengths(impl, [L], 32, 4, 16, "B=1")


@check_case(NAME, "rows longer than chunk·S: S pieces of c(L) > chunk keys, beside short rows")
def _w_long(impl, gen):
    chunk, S, N = 32, 4, 16
    longs = [chunk * S + 1 + int(x) for x in torch.randint(0, 2000, (2,), generator=gen)]
    check_lengths(impl, [5, longs[0], 40, 0, longs[1], chunk * S], chunk, S, N, "two long rows among short ones")
    check_lengths(impl, [int(torch.randint(3000, 5000, (1,), generator=gen))], chunk, S, N, "B=1, one long row")


@check_case(NAME, "other plans: S = 1 (whole rows), chunk = BLOCK_N, S = 8, a batch of 32")
def _w_plans(impl, gen):
    check_lengths(impl, _ragged(gen, 9, 500), 64, 1, 16, "S=1: every row one piece")
    check_lengths(impl, _ragged(gen, 9, 200), 16, 8, 16, "chunk = BLOCK_N = 16, S = 8")
    check_lengths(impl, _ragged(gen, 32, 1000), 64, 4, 32, "B=32, tiles of 32")
