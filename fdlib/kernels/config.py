"""Launch parameters shared by the kernels: tile sizes and the work split.

``chunk`` is the number of keys per split, a multiple of BLOCK_N: :math:`\\text{chunk} =
\\lceil \\lceil L_{cap}/\\text{splits}\\rceil / N \\rceil \\cdot N`, where L_cap is the longest sequence the launch
must cover. Split i of sequence b covers keys [i·chunk, min((i+1)·chunk, L_b)).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton

from .. import runtime
from .tile import TABLE_AHEAD_PAGE

MAX_SPLITS = 256


@dataclass(frozen=True)
class TileConfig:
    BLOCK_N: int
    num_warps: int
    num_stages: int


# Chosen on an H200 by tools/gpu_tune.py (results/h200/tune.json): 128-key tiles, 4 warps and 3-stage
# software pipelining were within 1% of the best config per shape in geometric mean. GPU_CONFIG is that
# base; tile_config_for adapts its BLOCK_N: short caches of small batches use 64-key tiles so they can still
# be split, head dims above 128 use 32-key tiles to fit shared memory, float32 halves the keys.
# The interpreter, where each tile costs NumPy calls, uses 16-key tiles so that lab-sized problems still
# cross tile boundaries.
GPU_CONFIG = TileConfig(BLOCK_N=128, num_warps=4, num_stages=3)
INTERPRETER_CONFIG = TileConfig(BLOCK_N=16, num_warps=1, num_stages=1)


SMALL_BATCH_ROWS = 128
"""B·H_kv at or below which short caches use 64-key tiles, so they can still be split finely: caches of up to
2048 keys up to SMALL_BATCH_L_ROWS rows, caches of up to SMALL_BATCH_L keys up to 128 rows. At 128 rows, on an
H200 (fp16, graphs) 64-key tiles took B=16 32:8 L=512 from 12.33 to 11.71 µs and B=4 32:32 L=512
from 11.91 to 11.66 (and the unified kernel at two splits of B=16 32:8 L=512 from 17.36 to 12.75), for
34.5 -> 35.9 µs at B=16 32:8 L=2048 (``results/h200/ab/ab-rows128.md``); in one call of 2026-12-02
(``ab/ab-rows128-tiles.json``) auto's 64-key tiles at 2 splits took 36.5 and 36.2 µs at B=16 32:8 and B=4 32:32
L=2048, 128-key tiles at one split 35.0 and 34.7, and at L=1024 21.4 and 21.2 against 20.1 and 19.9, while at
L=512 auto's 64-key tiles were the fastest (12.3 and 12.0, 128 keys 12.6 and 12.3). Why, as read from the H200's build
(``results/h200/kernel-resources.json``, D=128 fp16): a program of 128-key tiles holds 136 KB of shared memory
(its pipelined K and V tiles), so one fits on an SM; at 64 keys it holds 70 KB, and three fit. (Read these from
the GPU: ``tools/compile_check.py``'s build without one, given no alignment facts, reports 40 and 22 KB.) The
fp16 and bf16 grids of that commit met every graph target (``bench-*.json`` of 22:47Z)."""


SMALL_BATCH_L, SMALL_BATCH_L_ROWS = 512, 64
"""See SMALL_BATCH_ROWS: 65-128 rows take 64-key tiles only at L <= SMALL_BATCH_L."""


def tile_config(D: int = 128, L_cap: int = 1 << 30, elem_bytes: int = 2, rows: int | None = None,
                q_rows: int = 1, paged: int = 0) -> TileConfig:
    """The tiles a launch uses here (interpreter or GPU); ``paged``: the page size, 0 for a contiguous cache."""
    return tile_config_for(D, L_cap, compiled_mode=not runtime.INTERPRET, elem_bytes=elem_bytes, rows=rows,
                           q_rows=q_rows, paged=paged)


PAGED_BLOCK_N = 64
"""Keys a tile over pages. Each tile's block-table rows are read one tile ahead
(:func:`fdlib.kernels.tile.attend_slice`, :func:`fdlib.kernels.tile.paged_tile_rows`), so Triton's pipeliner
keeps K/V copies in flight over pages as over a contiguous cache. At 64 keys (3 stages, 69 KB of shared memory at
D=128) three programs share an SM; one program of 128-key tiles (136 KB) streamed gathered tiles more slowly. H200,
pages of 16, fp16, graph µs, unified kernel: B=32 32:8 constant 8192 248.5 against 304.5 at 128 keys, B=128 32:8
uniform mean 1024 155.5 against 215.7 (``results/h200/ab/ab-paged-tiles64.json``); the contiguous cache took
238.9 µs on the first (``ab/ab-paged-prefetch-branch.json``). With the table read in the tile's own iteration (the
kernels before, ``ab/ab-paged-prefetch-main.json``) the pipeliner kept one K/V buffer and the same shape took
252.6 µs at 128 keys, 285.5 at 64; reading ahead at 128 keys alone was slower still (309.2)."""


ONE_WAVE_TILE = TileConfig(BLOCK_N=16, num_warps=2, num_stages=3)
ONE_WAVE_PER_SM = 8
"""Tiles of a one-split plan of equal short rows over pages (:func:`fdlib.splits.one_wave_suits`): 16 keys, 2 warps, 3
stages. A program holds 121-124 registers a thread (GQA 4, D=128, fp16) and 21 KB of shared memory, so
ONE_WAVE_PER_SM = 8 share an SM (65536 registers / (128 · 64 threads)), against 3 of the 64-key, 4-warp tiles (139
registers, 70 KB): 1056 programs at once on an H200 instead of 396, so a batch of about 1000 rows can run in one
wave, with no partial last wave to drain. A program alone streams more slowly (two 8 KB tiles in flight), which is
why the rule keeps these tiles to equal rows of at most 1024 keys.
H200, fp16, pages of 16, graph µs, auto against auto at these tiles
(``results/h200/ab/ab-paged-one-wave-a069986.json``, ceiling 4.57 TB/s): B=128 32:8 rows of 1024 keys 130.5 -> 127.7
(90.1 -> 92.0% of the ceiling), B=32 32:32 1024 keys 129.4 -> 126.9, B=64 32:32 512 keys 129.5 -> 127.5, B=128 32:32
1024 keys (4096 rows) 488.8 -> 489.9; slower on ragged rows (B=128 32:8 uniform mean 1024 143.3 -> 166.0) and long
ones (B=32 32:8 8192 keys 247.1 -> 376.5). 16-key tiles at 4 warps (72-80 registers, 6-7 programs an SM) took
144.8-179.4 on the three batches these tiles sped up."""


QROWS_TILE = 4096
"""Several query tokens: at most this many scores [query rows, BLOCK_N] a tile (a 32 × 128 tile, 32 float32
registers a thread at 4 warps): more query rows get fewer keys a tile."""


def tile_config_for(D: int, L_cap: int, compiled_mode: bool, elem_bytes: int = 2, rows: int | None = None,
                    q_rows: int = 1, paged: int = 0) -> TileConfig:
    """The tiles a compiled (GPU) or interpreted launch would use for head dim D, longest length L_cap,
    element size and ``rows`` = B·H_kv: 128 keys of D <= 128 at 2 bytes, 32 keys of D > 128; float32 halves
    the keys (same tile bytes), never below 16; at most 64 keys for short caches of small batches, which need
    fine splits (L_cap <= 2048 at rows <= SMALL_BATCH_L_ROWS, L_cap <= SMALL_BATCH_L at rows <= SMALL_BATCH_ROWS;
    rows unknown counts as small), while larger batches of short caches keep 128 (measured faster on an H200).
    Warps and stages are GPU_CONFIG's.

    ``q_rows``: for several query tokens, the query rows one program holds, group × q_len (:func:`block_sizes`
    pads them to BLOCK_G); 1 (the default) for one token, whatever the group (the tiles measured on the H200).
    Above 32 rows the keys a tile shrink so that BLOCK_G · BLOCK_N <= QROWS_TILE
    (never below 16), and 8 warps hold an accumulator of BLOCK_G · BLOCK_D >= 16384 floats (at most 64 a
    thread). Up to 32 rows nothing changes. Not yet tuned on a GPU.

    ``paged``: the page size of a cache gathered through a block table (0: contiguous). Pages of at least
    TABLE_AHEAD_PAGE keys, whose tiles read the table a tile ahead, take at most PAGED_BLOCK_N keys a tile;
    smaller pages the contiguous cache's tiles."""
    if not compiled_mode:
        return INTERPRETER_CONFIG
    block_n = (GPU_CONFIG.BLOCK_N if D <= 128 else 32) * 2 // elem_bytes
    if (rows is None or rows <= SMALL_BATCH_L_ROWS) and L_cap <= 2048 or (
            rows is not None and rows <= SMALL_BATCH_ROWS and L_cap <= SMALL_BATCH_L):
        block_n = min(block_n, 64)
    if paged >= TABLE_AHEAD_PAGE.value:
        block_n = min(block_n, PAGED_BLOCK_N)
    num_warps = GPU_CONFIG.num_warps
    block_g, block_d = block_sizes(q_rows, D)
    if block_g > 32:
        block_n = min(block_n, QROWS_TILE // block_g)
        if block_g * block_d >= 16384:
            num_warps = 8
    return TileConfig(BLOCK_N=max(16, block_n), num_warps=num_warps, num_stages=GPU_CONFIG.num_stages)


PERSISTENT_BLOCK_N = 64
PERSISTENT_PER_SM = 2
"""The persistent kernel's tiles and programs per SM: 64-key tiles, 4 warps, 3 stages (96 KB of shared memory
at D=128, so two programs fit on an SM) and 2·SMs programs were the most robust of 32 configurations on the
short-cache, large-batch shapes where it runs (results/h200/explore/explore.json: within 2.6% of the best
configuration on each)."""


def persistent_config(D: int = 128, elem_bytes: int = 2, q_rows: int = 1,
                      compiled_mode: bool | None = None, paged: int = 0) -> TileConfig:
    """Tiles of the persistent (and stream-K) kernel: at most PERSISTENT_BLOCK_N keys on a contiguous cache and on
    pages of at least TABLE_AHEAD_PAGE keys, the unified kernel's tiles on smaller pages (``paged``: the page
    size, 0 for a contiguous cache), fewer where tile_config_for halves them (D > 128, float32, many query rows
    ``q_rows`` = group × q_len); the interpreter's config in the interpreter. ``compiled_mode``: a GPU's (True)
    or the interpreter's (False) tiles whatever this runtime is (default: this runtime's).

    Small pages are looked up in each tile's own iteration, where 128-key tiles streamed faster than 64-key ones
    (H200, pages of 16 before the table was read ahead, ``results/h200/ab/ab-ragged-paged-tiles.json``: stream-K,
    B=128 32:8 uniform mean 1024 191.6 -> 153.3 µs)."""
    if not (not runtime.INTERPRET if compiled_mode is None else compiled_mode):
        return INTERPRETER_CONFIG
    base = tile_config_for(D, 1 << 30, compiled_mode=True, elem_bytes=elem_bytes, q_rows=q_rows)
    small_pages = 0 < paged < TABLE_AHEAD_PAGE.value
    return TileConfig(BLOCK_N=base.BLOCK_N if small_pages else min(PERSISTENT_BLOCK_N, base.BLOCK_N),
                      num_warps=base.num_warps, num_stages=base.num_stages)


def block_sizes(group: int, D: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_D): the query rows a program holds (the group, times q_len for several query tokens)
    padded to >= 16 rows (tl.dot's smallest M) and D to a power of two >= 16."""
    return max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(D))


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for non-negative integers (plain Python: the cost model calls it often on the host)."""
    return -(-a // b)


def chunk_for(L_cap: int, splits, block_n: int):
    """(chunk, splits actually needed) for covering L_cap keys with at most ``splits`` splits.
    ``splits`` may be a NumPy array of candidates (the cost model's); then both results are arrays."""
    import numpy as np
    L_cap = max(int(L_cap), 1)
    s = np.clip(np.asarray(splits, dtype=np.int64), 1, cdiv(L_cap, block_n))
    chunk = cdiv(cdiv(L_cap, s), block_n) * block_n
    eff = cdiv(L_cap, chunk)
    if chunk.ndim == 0:
        return int(chunk), int(eff)
    return chunk, eff


def fp32_dot(dtype) -> bool:
    """Exact float32 products for float32 inputs, and for bfloat16 in the interpreter (see tile_update)."""
    import torch
    return dtype == torch.float32 or (runtime.INTERPRET and dtype == torch.bfloat16)
