"""Lab 06 reference solutions: the paged tile load, the balanced work list, and the device schedule's work list."""
import torch  # noqa: F401  (available to the solutions, as in the notebook)
import triton
import triton.language as tl

from fdlib.grading import solution


@solution("lab06.paged_tile_load")
@triton.jit
def paged_tile_load(K, V, BT_ROW, pos, valid, stride_kp, stride_kl, stride_vp, stride_vl, n_pages,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """(k, v) [N, BLOCK_D]: the rows of key positions `pos` gathered through the block table (fdlib's page_rows)."""
    offs_d = tl.arange(0, BLOCK_D)
    entry = tl.load(BT_ROW + pos // PAGE, mask=valid, other=0)        # unused entries are never read
    page = tl.minimum(tl.maximum(entry, 0), n_pages - 1).to(tl.int64)  # never a load outside the pool
    slot = pos % PAGE
    mask = valid[:, None] & (offs_d < D)[None, :]
    k = tl.load(K + (page * stride_kp + slot * stride_kl)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(V + (page * stride_vp + slot * stride_vl)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@solution("lab06.work_items")
def work_items(lengths, budget, block_n):
    """The balanced items (b, start, end) of fdlib.schedule: rows cut into items of c tiles each."""
    L = torch.as_tensor(lengths, dtype=torch.int64)
    tiles = torch.clamp((L + block_n - 1) // block_n, min=1)      # t_b; an empty row still costs one program
    c = max(1, -(-int(tiles.sum()) // budget))                     # tiles per item
    n = (tiles + c - 1) // c                                        # items of each row
    chunk = c * block_n
    items = []
    for b, (L_b, n_b) in enumerate(zip(L.tolist(), n.tolist())):
        for j in range(n_b):
            start = j * chunk
            items.append((b, start, L_b if j == n_b - 1 else min(start + chunk, L_b)))
    return items


@solution("lab06.work_list")
@triton.jit
def work_list(LENS, OUT, B, chunk, S, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """fdlib.worklist in one program: rows longest first, each cut into n(L) pieces of c(L) tiles, coded b*S + j."""
    rows = tl.arange(0, BLOCK_B)
    L = tl.maximum(tl.load(LENS + rows, mask=rows < B, other=0), 0)
    tiles = tl.maximum(1, tl.cdiv(L, BLOCK_N))                             # an empty row: one tile, one piece
    c = tl.maximum(chunk // BLOCK_N, tl.cdiv(tiles, S))                    # tiles a piece
    n = tl.where(rows < B, tl.cdiv(tiles, c), 0)                           # pieces a row (padding: none)
    # row r goes before row b: longer, or as long and a lower index   [b, r]
    before = (L[None, :] > L[:, None]) | ((L[None, :] == L[:, None]) & (rows[None, :] < rows[:, None]))
    first = tl.sum(tl.where(before, n[None, :], 0), axis=1)               # the item where row b's pieces start
    tl.store(OUT, tl.sum(n, axis=0))
    for j in range(0, S):
        tl.store(OUT + 1 + first + j, rows * S + j, mask=j < n)
