r"""Plan once, run every step: the host-side decisions of decode attention, made once per batch shape.

A serving loop calls attention with the same shapes step after step; only the lengths grow. Everything that
depends on the shapes alone is decided once, by :func:`plan`, and kept in a frozen :class:`DecodePlan`:

* the kernel: ``"unified"`` (map and reduce in one launch), ``"split"`` (stage 1 + stage 2),
  ``"persistent"`` (a few programs per SM walk all rows, no split), ``"balanced"`` (a ragged batch cut into
  near-equal work items on the device, :mod:`fdlib.schedule`), ``"streamk"`` (a few programs per SM, as many
  for every KV head, take equal shares of their head's tiles, rows cut wherever the shares fall:
  :mod:`fdlib.kernels.streamk`),
  ``"worklist"`` (rows cut into pieces sized by the batch, or with ``batch_invariant=True`` by each row's own
  length, the pieces listed longest first on the device at every call: :mod:`fdlib.worklist`), ``"invariant"``
  (``batch_invariant=True``) or ``"naive"`` (PyTorch); for a contiguous cache
  ``[B, L_max, H_kv, D]`` or pages ``[n_pages, page_size, H_kv, D]`` behind a block table;
* the tiles (BLOCK_N keys, warps, stages), the split count and the chunk of keys each split covers,
  :math:`\text{chunk} = \lceil\lceil L_{cap}/\text{splits}\rceil / N\rceil\cdot N`, chosen by the cost model
  (:mod:`fdlib.splits`) for L_cap, the longest length the plan is made for (``auto`` gives equal short rows over
  pages that fill the SMs about once or twice smaller tiles, :func:`fdlib.splits.one_wave_suits`);
* the workspace, owned by the plan: the split partials :math:`O_i` ``[B, q_len, H_q, splits, D]`` and
  :math:`\text{lse}_i` ``[B, q_len, H_q, splits]`` (float32), one ticket counter per (b, h_kv) row, the clamp flag,
  an lse buffer for calls that do not ask for lse, and the all-L_max lengths of calls that pass none.

:meth:`DecodePlan.run` then only launches: it reads nothing back from the GPU, allocates nothing but an
output the caller did not pass, and does no Python work that grows with B. It can be captured in a CUDA
graph, and a replay after the lengths were changed in place stays correct.

The lengths a plan is made for are a performance hint, never a correctness condition:

* ``lengths`` (host ints, e.g. a list or a CPU tensor the serving engine already has): the cost model sees
  the real mix; nothing is read from the GPU.
* ``max_seqlen``: a bound the caller promises; splits are chosen as if every row were that long.
* neither: the cache's capacity L_max. For a batch of two or more sequences (:func:`device_schedule_suits`)
  ``auto`` then takes stream-K (:mod:`fdlib.kernels.streamk`), whose launch depends on the shapes alone: every
  program reads the lengths on the device and takes its equal share of the batch's tiles, at every call, so
  the plan needs none.

A row longer than the plan's L_cap is still covered (the last split runs to the row's end; it is only
slower). Lengths on the device outside 0..L_max are clamped there, so no kernel reads outside the cache,
and the plan's flag records it: :meth:`DecodePlan.clamped` reads the flag (one device-to-host copy, done
only when the caller asks). Host lengths (a list, or a tensor in CPU memory) out of range raise ``ValueError``
at once, on every call: reading them costs no device sync. On the CPU runtime (Triton's interpreter) q's device
is the host, so there a CPU tensor of lengths is checked exactly as a list is (and read in place by the kernels).

Several query tokens per sequence (speculative decoding): ``plan(..., q_len=k)`` takes q ``[B, k, H_q, D]``;
query t of sequence b sees keys 0 … L_b − k + t (the k new tokens are already in the cache, causal among
themselves: ``flash_attn_with_kvcache``'s convention). Every kernel packs the group × k query rows of a KV head
into one tile, so each K/V tile is still read once.

One plan's workspace serves one call at a time: calls that may overlap (several CUDA streams) need a plan each.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from . import quant, runtime
from .kernels import launch as _launch_mod
from .kernels.launch import heads_adjacent, pack_for, record, replay, rows4
from .kernels.config import (MAX_SPLITS, ONE_WAVE_TILE, TileConfig, chunk_for, persistent_config, tile_config,
                             tile_config_for)
from .kernels.invariant import invariant_launcher, max_chunks, row_chunks, share_programs
from .kernels.balanced import MAX_BATCH, balanced_args, balanced_launcher, items_max
from .kernels.persistent import persistent_args, persistent_launcher, programs_for, rows_for
from .kernels.stage1 import stage1_args, stage1_launcher
from .kernels.streamk import (MAX_BATCH as STREAMK_MAX_BATCH, slots_for, streamk_args, streamk_launcher,
                              streamk_programs)
from .kernels.stage2 import flat_rows, stage2_args, stage2_launcher
from .kernels.unified import LONGEST_FIRST_MAX_BATCH, remember_resources, unified_args, unified_launcher
from .kernels.worklist import INLINE_BATCH, schedule_args, schedule_launcher
from . import worklist
from .kernels.tile import TABLE_AHEAD_PAGE, TABLE_REGS_LIMIT
from .reference import naive_attention
from .schedule import choose_balanced
from .splits import (PERSISTENT_MIN_WAVES, choose_auto, choose_kernel, choose_splits, one_wave_suits, order_hint,
                     persistent_per_sm, sm_count, streamk_batch)
from .validate import (DTYPES, MAX_HEAD_DIM, check_block_table, check_bool, check_lengths_type, check_max_seqlen,
                       check_method, check_num_splits, check_page_size, check_page_strides, check_pool, check_q_len,
                       check_scale, shape_str)

KERNELS = ("unified", "split", "persistent", "balanced", "streamk", "worklist", "invariant", "naive")


@dataclass(frozen=True)
class Decision:
    """What a launch does, decided on the host from the sizes alone (no tensors)."""
    kernel: str                 # one of KERNELS
    splits: int                 # splits launched per row (1 for persistent and naive)
    chunk: int                  # keys per split (the last split of a row runs to its end)
    tile: TileConfig | None     # BLOCK_N, warps, stages (None for naive)
    L_cap: int                  # the longest length the splits were chosen for
    basis: str                  # "host lengths", "max_seqlen" or "capacity"
    programs: int = 0           # persistent: programs launched
    rows_per_program: int = 0   # persistent: the kernel's ROWS (a power of two)
    budget: int = 0             # balanced: P, the work items the batch is cut into (fdlib.schedule); worklist: the
                                # items pieces sized by the batch come to (0: by each row alone)
    invariant: bool = False     # batch-invariant: chunks by each row's own length (invariant_decision)
    per_program: int = 0        # invariant: chunks one program computes (splits: the most chunks a row can
                                # have, its partial slots; so ⌈splits / per_program⌉ programs a row); 0 under
                                # the device share
    share: int = 0              # invariant: the SMs whose one wave the device share cuts the batch's tiles for
                                # (INVARIANT_SHARE: each row's per_program chosen on the device); 0: per_program
    pack: int = 1               # unified/split: adjacent KV heads a program reads as one (pack_decision)
    order: int = 0              # unified: ORDER_B, sequences launched longest first (longest_first_order); 0: b order
    table_regs: int = 0         # unified over pages: block-table entries held in registers (table_regs_for); 0: none
    inline: int = 0             # worklist: 0, or the power of two >= B whose lengths each program lists itself


def launched_splits(L: int, splits: int, D: int, rows: int | None, elem_bytes: int, compiled: bool) -> int:
    """Splits a launch really has for ``splits`` asked: at most one per BLOCK_N-key tile of L keys
    (:func:`fdlib.kernels.config.chunk_for`), at most MAX_SPLITS; ``compiled`` picks GPU or interpreter tiles."""
    tile = tile_config_for(D, max(int(L), 1), compiled_mode=compiled, elem_bytes=elem_bytes, rows=rows)
    return chunk_for(L, min(int(splits), MAX_SPLITS), tile.BLOCK_N)[1]


INVARIANT_WAVES = int(os.environ.get("FDLIB_INVARIANT_WAVES", "1"))
"""Waves of programs the batch-invariant schedule aims for (:func:`invariant_decision`): ⌊INVARIANT_WAVES · SMs /
(B·H_kv)⌋ programs a row, at least one. 1 is the rule measured on the H200's dense grid, and kept after an H100
run at 1, 2 and 3 (``results/h100/gpu-check/waves/``, bf16, graph timings): two waves took the serving batch of
B=24 28:4 rows of 1..65536 keys from 2.15x the host plan to 1.06x over pages (1.50x to 1.05x contiguous), where
one program a row leaves the longest row alone at the end, and changed no other serving batch by more than 1.3%;
but on equal rows it cost up to 1.07x (B=16 32:8 rows of 8192 keys: 0.99x auto's time at one wave, 1.07x at two;
B=4: 1.05x, 1.10x). The schedule never changes a bit of the results (only who computes which chunks), so the
environment variable ``FDLIB_INVARIANT_WAVES`` sets it at import for A/B runs of whole benchmarks."""
INVARIANT_ORDER = int(os.environ.get("FDLIB_INVARIANT_ORDER", "1"))
"""1 (the default): a batch-invariant plan of one program a row (:func:`invariant_decision`, ``per_program`` = every
chunk) of 2..LONGEST_FIRST_MAX_BATCH sequences, with more rows than SMs (B·H_kv > SMs), launches its rows longest
first, ordered on the device from the lengths of each call (:func:`fdlib.kernels.tile.longest_first`, as the
unified kernel's ``longest_first``), so that the SMs take the longest rows first and end on the shortest (greedy
longest-first list scheduling). It changes who computes a row and when, never a sum: the bits are the same. With
no more rows than SMs every row starts at once and b order is kept. 0: b order always.
On an H100 (``results/h100/invariant-order/``, bf16, graph µs over the host-lengths plan, the read ceiling in the
same run), the serving batches, contiguous / pages of 16, b order → longest first: B=32 32:8 rows of 1..32768
keys 1.24x → 1.00x / 1.25x → 1.20x; B=128 lognormal 1.37x → 0.95x / 1.51x → 1.31x; B=48 64:8 1.11x → 0.99x /
1.17x → 1.03x; B=256 unchanged (1.01-1.02x); but B=24 28:4 (96 rows on 132 SMs) 1.46x → 1.71x / 2.13x → 2.20x,
hence the rows-over-SMs condition. The dense shapes of B 16-64 32:8 moved within the run's noise (3%).
``FDLIB_INVARIANT_ORDER`` sets it at import, for A/B runs."""
INVARIANT_SHARE = int(os.environ.get("FDLIB_INVARIANT_SHARE", "2"))
"""Where a batch-invariant plan's rows (one program kernel, not the persistent walk) let each program choose its
row's chunks a program on the device, from the B lengths of each call
(:func:`fdlib.kernels.invariant.device_share`: a wave of equal shares of the batch's tiles, rounded to whole chunks
of each row), instead of the host giving every row the same programs without the lengths
(:data:`INVARIANT_WAVES`). 2 (the default): only where the host rule gives every row one program
(SMs/2 < B·H_kv < SMs, the ALONE plans), where ragged rows left the longest alone at the end; 1: every plan of
fewer rows than SMs; 0: never. The share changes who computes which chunks, never a sum, so the bits are the
same; the grid is of the shapes alone (:func:`fdlib.kernels.invariant.share_programs`), so a captured graph
replays it. On an H200 (``results/h200/invariant-share/``, bf16, graph µs, invariant time over the host-lengths
plan, contiguous / pages of 16): B=24 28:4 rows of 1..65536 keys (96 rows on 132 SMs) 2.01x / 2.53x at 0,
1.51x / 1.91x at 1 and 2; but 1 cost B=8 with one row of 131072 keys 1.30x → 1.33x / 1.47x → 1.70x, B=1
131072 keys 1.00x → 1.05x / 1.09x → 1.33x, and the dense shapes B 1, 4 and 16 32:8 at L 8192 and 32768 from
0.98x to 1.12x their time at 0 (``dense-s1.md`` against ``dense-s0.md``), where it replaces the ONE_CHUNK and ALONE
kernels (:mod:`fdlib.kernels.invariant`) by the general one. At 2 every serving batch but B=24 ran as at 0; equal
rows in its range pay that kernel: B=16 32:8 (128 rows, planned alike at 1 and 2) 1.08x (L=8192) and 1.04x
(L=32768) its time at 0, the price of B=24's 0.75x. ``FDLIB_INVARIANT_SHARE`` sets it at import."""
ONE_CHUNK_KEYS = 2048
"""A batch-invariant plan of several programs a row whose chunks have at least this many keys gives each program
one chunk (the ONE_CHUNK kernel, no chunk-end work in its loop) rather than about one wave of programs. On an
H200 (``results/h200/ab/ab-inv-one-chunk.md``, graph µs, one chunk a program against four): B=4 32:8 L=32768
132.0 against 137.0, L=131072 474.0 against 518.1; but B=1 32:32 L=32768 130.8 against 125.2 and L=131072 475.4
against 471.2, and shorter chunks lose (B=4 32:8 L=8192, chunks of 512 keys: 45.0 against 41.8). The same
pattern was measured on another H200 the day before (``ab/ab-inv-schedule.md``). Not explained: both layouts
have 32 rows of the same bytes and the same program counts; they differ in the KV heads a key position holds
(8 against 32, so 2 against 8 KB between a row's consecutive keys)."""


def invariant_tile(D: int, dtype, q_rows: int = 1) -> TileConfig:
    """The tiles of every batch-invariant plan (:func:`invariant_decision`, :func:`worklist_decision` with
    ``invariant``): those of a long cache of a large batch, fixed by D, the dtype and the query rows, never by the
    batch or the cache's layout, so contiguous and paged caches give the same bits (128 keys at D <= 128 in 16
    bits on a GPU). The 64-key tiles the stream-K kernel reads pages in were slower on most batches, both layouts:
    on an H100 (``results/h100/chooser-ab/invariant-tile/``, the serving batches, graph µs over the host-lengths
    plan) B=32 32:8 rows of 1..32768 keys 1.01x -> 1.26x over pages, B=128 lognormal 1.00x -> 1.46x; faster only
    where the plan misses most, and not by enough (B=24 28:4 1.43x -> 1.35x over pages)."""
    return tile_config_for(D, 1 << 30, compiled_mode=not runtime.INTERPRET, elem_bytes=dtype.itemsize,
                           rows=1 << 30, q_rows=q_rows)


WALK_L, WALK_ROWS, INVARIANT_PER_SM = 512, 2, 2
"""The batch-invariant plan's persistent walk (:func:`invariant_decision`): rows of at most WALK_L keys, at most
WALK_ROWS rows a program, INVARIANT_PER_SM programs an SM (its 128-key tiles at FEW_STAGES stages hold 72 KB
of shared memory and 230 registers a thread: two fit on an H200's SM, ``results/h200/kernel-resources-9702767.json``).
On an H200 (``results/h200/ab/ab-inv-persist.md``, graph µs, one program a row against the walk, both at
FEW_STAGES stages): B=64 32:8 L=512 (512 rows) 41.25 against 38.72, B=16 32:32 L=512 (512 rows) 39.17 against
37.65; but with more rows a program or longer rows the walk lost: B=64 32:32 L=512 (2048 rows, 8 a program)
132.1 against 133.9, B=16 32:32 L=2048 126.4 against 129.7, B=64 32:32 L=2048 484.1 against 513.1 (it won only
B=64 32:8 L=2048, 131.4 against 129.9). Its loop does more each tile than the plain persistent kernel's: the
chunk fold and the row's result (the merge's O and lse) on every tile, selected where a chunk or row ends."""
FEW_STAGES, FEW_STAGES_L = 2, 2048
"""The batch-invariant plan's pipeline stages for short rows of a large batch (see :func:`invariant_decision`).
On an H200 (fp16 grid, time against ``auto``; ``results/h200/invariant-fp16-s2-926a1b4.md``, every invariant
plan at 2 stages, against ``invariant-fp16.md`` of 2026-11-30 at 3): with B·H_kv >= 264 rows and L <= 2048,
1.291 -> 1.146 (B=16 32:32 L=512), 1.276 -> 1.182 (B=64 32:8 L=512), 1.238 -> 1.083 (B=64 32:32 L=512),
1.073 -> 1.039, 1.096 -> 1.077 and 1.035 -> 1.034 at L=2048; but 1.005 -> 1.036 at B=64 32:8 L=8192, and
1.051 -> 1.367 with 128 rows (B=16 32:8 L=512), one wave of one program a row. At 2 stages a program of
128-key tiles holds 72 KB of shared memory (136 KB at 3) and, with its 188 registers a thread, two fit on an
SM (``results/h200/kernel-resources-417a393.json``)."""


def invariant_decision(B: int, H_q: int, H_kv: int, D: int, L_max: int, dtype, q_rows: int = 1,
                       L_cap: int | None = None) -> Decision:
    r"""Batch-invariant decode (:mod:`fdlib.kernels.invariant`): everything that shapes a row's arithmetic is
    fixed by D, the dtype and the row's own length, never by the batch: tiles of BLOCK_N keys (as for a long
    cache of a large batch), the row cut into :math:`n_b \le` CHUNKS chunks by its length alone
    (:func:`~fdlib.kernels.invariant.row_chunks`), and the merge reading the chunks' partials in index order in
    blocks sized for CHUNKS. The batch decides only the schedule: each program computes ``per_program``
    consecutive chunks of its row (restarting the online softmax at each), chosen so that the launch has about
    INVARIANT_WAVES waves of programs, :math:`\lfloor W\,\text{SMs} / (B H_{kv}) \rfloor` a row (at least one,
    at most the chunks of an ``L_cap`` row; ``L_cap``: the lengths the schedule is chosen for, default L_max), by a
    rule of the shape alone, so the schedule is the same on every GPU of a kind (it took the unified kernel's split
    count before, which follows the live calibration: two H200s differed at B=1 32:8 L=2048, 9.0 against
    11.5 µs, ``results/README.md``); the ticket decides only *who* merges. So a sequence's out and
    lse are bitwise the same whatever its batchmates, the batch size, its place in the batch, the run, and
    whether the cache is paged. Chunks of at least ONE_CHUNK_KEYS keys are computed one a program whenever a row
    gets more than one program.
    With fewer rows than SMs (B·H_kv < SMs) and :data:`INVARIANT_SHARE`, the rule above gives way to the device
    share: each program reads the B lengths and takes its row's chunks a program from one wave of equal shares of
    the batch's tiles (:func:`fdlib.kernels.invariant.device_share`, whose docstring tabulates the cases), so a
    ragged batch is balanced without host lengths, and equal rows get the rule's schedule or one within a chunk of
    it; ``per_program`` is then 0 and ``share`` the SMs.
    Short rows of a large batch (B·H_kv >= PERSISTENT_MIN_WAVES · SMs rows, L_cap <= FEW_STAGES_L, one
    program a row) are compiled with FEW_STAGES pipeline stages instead of the tiles' 3: the stages change which
    loads are in flight, never a sum, so the results are the same bits, and a program then holds less shared
    memory, so more of them share an SM (one program of 128-key tiles holds 136 KB at 3 stages on an H200,
    ``results/h200/kernel-resources.json``). Of those, rows of at most WALK_L keys, at most WALK_ROWS a
    program, are walked by the persistent kernel (:mod:`fdlib.kernels.persistent` with CHUNKS), which folds each
    row's chunks as they end exactly as a program alone on its row does: one start-up a program, not a row.
    ``q_rows``: group × q_len for several query tokens (1 for one; see :func:`tile_config_for`): q_len is the
    plan's, so a sequence's results are invariant among calls of the same q_len."""
    compiled = not runtime.INTERPRET
    tile = invariant_tile(D, dtype, q_rows)
    L_cap = max(L_max if L_cap is None else min(L_cap, L_max), 1)
    chunk, n_max = row_chunks(max(L_max, 1), tile.BLOCK_N)[0], max_chunks(L_max, tile.BLOCK_N)
    chunk_cap, n_cap = row_chunks(L_cap, tile.BLOCK_N)
    sms = sm_count()
    want = max(1, min(INVARIANT_WAVES * sms // (B * H_kv), n_cap))
    # one program a row (want = 1): it takes every chunk any row can have (a shorter row may have more chunks
    # than an L_cap one), so the kernel is compiled ALONE: no partial stored, no ticket
    if want == 1:
        per_program = n_max
        if B * H_kv >= PERSISTENT_MIN_WAVES * sms and L_cap <= FEW_STAGES_L:
            per_sm = INVARIANT_PER_SM if compiled else 1
            if compiled:
                tile = TileConfig(tile.BLOCK_N, tile.num_warps, FEW_STAGES)   # the same arithmetic, less smem
            if L_cap <= WALK_L and B * H_kv <= WALK_ROWS * sms * per_sm:   # the rows walked by fewer programs
                programs = programs_for(B * H_kv, sms, per_sm)
                return Decision("persistent", n_max, chunk, tile, L_cap,
                                "batch-invariant: chunks by each row's length", programs=programs,
                                rows_per_program=rows_for(B * H_kv, programs), invariant=True, per_program=n_max)
    elif chunk_cap >= ONE_CHUNK_KEYS:   # long chunks: one a program (the ONE_CHUNK kernel)
        per_program = 1
    else:
        per_program = -(-n_cap // want)
    if B * H_kv < sms and (INVARIANT_SHARE == 1 or INVARIANT_SHARE == 2 and want == 1):   # fewer rows than SMs
        return Decision("invariant", n_max, chunk, tile, L_cap, "batch-invariant: chunks by each row's length",
                        invariant=True, per_program=0, share=sms)
    order = (longest_first_order(B) if INVARIANT_ORDER and per_program >= n_max and B * H_kv > sms
             and 2 <= B <= LONGEST_FIRST_MAX_BATCH else 0)
    return Decision("invariant", n_max, chunk, tile, L_cap, "batch-invariant: chunks by each row's length",
                    invariant=True, per_program=per_program, order=order)


DEVICE_SCHEDULE = int(os.environ.get("FDLIB_DEVICE_SCHEDULE", "1"))
"""1: ``auto`` without host lengths (``decode_attention`` with lengths on the device, or a plan captured before
they are known) takes the stream-K plan where :func:`device_schedule_suits`; 0: it plans every row for L_cap. The
environment variable ``FDLIB_DEVICE_SCHEDULE`` sets it at import (for A/B runs of whole benchmarks)."""


def device_schedule_suits(B: int, q_len: int = 1) -> bool:
    r"""Whether ``auto`` made without host lengths takes stream-K (:data:`DEVICE_SCHEDULE`): at least two
    sequences (at most :data:`fdlib.kernels.streamk.MAX_BATCH`) and one query token, K/V of any dtype (16- and
    32-bit, or an 8-bit cache).

    Stream-K's launch depends on the shapes alone (H_kv·P_h programs,
    :func:`~fdlib.kernels.streamk.streamk_programs`): every program reads the B lengths on the device and takes its
    equal share of the batch's tiles, so the plan made without lengths is the very kernel the host-lengths plan runs
    on ragged batches, and a captured graph replays balanced. On an H100 (``results/h100/streamk-device/``, bf16,
    graph µs, the read ceiling in the same run) it took 0.99-1.00x the host-lengths plan on the six serving batches
    of 8-256 sequences, pages of 16 and contiguous, called and captured (93-97% of the ceiling,
    ``serving-streamk.md``), where the plan for L_cap took up to 2.67x; with this rule the default call took
    0.99-1.01x on all seven batches (91-95%, ``landed/``); on equal rows, where the host plan runs the unified or
    the persistent kernel, 1.02-1.07x, and 1.00-1.03x since a share inside one row runs the unified kernel's loop
    (``results/h100/streamk-lean/final/``). 8-bit caches (``results/h100/kv8-device/``, e4m3 per token and int8
    per head, six ragged batches of 8-128 sequences, contiguous and pages of 16): stream-K without lengths took
    0.98-1.02x the host-lengths plan (0.61x and 0.67x on B=128 rows of about 1024 keys over pages), where the plan
    for L_cap took 0.98-5.30x. One sequence keeps the plan for L_cap (its splits: exact for a full row); several
    query tokens have not been timed without lengths, and keep it too.

    An 8-bit cache takes stream-K wherever this holds, with host lengths too (:func:`decide`): the unified
    kernel's programs, one or two an SM where the cost model (calibrated on 16-bit caches) fills the SMs once, read
    an 8-bit cache at a fraction of stream-K's rate. On an H200 (``results/h200/invariant-share/kv8-token-fp16.md``,
    int8 with scales per token, equal rows B 8 and 32 32:8, L 8192 and 32768, graph µs) stream-K took 0.40-0.50x
    the unified kernel's time, float16 and bfloat16; the H100's ragged batches above, 0.61-1.02x the host plan."""
    return bool(DEVICE_SCHEDULE) and streamk_batch(B) and q_len == 1


WORK_SPLITS, WORK_CHUNK_TILES, WORK_WAVES = 32, 4, 2
"""A work-list plan (:mod:`fdlib.worklist`): rows cut into at most WORK_SPLITS pieces (S) of at least
WORK_CHUNK_TILES tiles (``chunk``); pieces sized by the batch come to about WORK_WAVES programs an SM (the budget
of items is ⌈WORK_WAVES · SMs / H_kv⌉). On an H200 (``results/h200/worklist/ab-worklist.md``, pieces by each row
alone, graph µs): at most 16 pieces a row cut B=1 32:8 L=131072 into 128 programs of 8192 keys, 181.1 against
auto's 128.1, 32 pieces 131.1, 64 pieces 163.6 (the last program merges 64 partials); two-tile pieces of B=1 32:8
L=8192 took 14.5 µs at 16 a row and 20.4 at 32; pieces by the row alone cut equal rows of a large batch needlessly
(B=32 32:8 L=8192: 273.6 µs at 8 tiles a piece against 243.1 whole), hence the budget."""


def worklist_decision(B: int, H_kv: int, D: int, L_max: int, dtype, q_rows: int = 1, paged: int = 0,
                      num_splits: int | None = None, invariant: bool = False, L_cap: int | None = None,
                      basis: str = "capacity") -> Decision:
    r"""The work-list plan (:mod:`fdlib.worklist`, :mod:`fdlib.kernels.worklist`): S = ``num_splits`` (default
    WORK_SPLITS) pieces a row at most, of at least ``chunk`` = WORK_CHUNK_TILES · BLOCK_N keys; the schedule is
    made on the device at every call from the lengths it finds, so the plan needs none. Rows are cut into pieces
    sized by the batch (the decision's ``budget``: ⌈WORK_WAVES · SMs / H_kv⌉ items,
    :func:`fdlib.worklist.balanced_chunk`), or with ``invariant`` (``batch_invariant=True``) by each row's own length
    alone (budget 0). Its tiles depend on
    D, the dtype, the query rows and (unless ``invariant``) whether the cache is paged, never on B or L_max: with
    ``invariant`` they are those of :func:`invariant_decision`, the same over pages and contiguous caches, so a
    sequence's out and lse are the same bits whatever its batchmates, the batch size, its place in the batch and
    the layout. Batches of at most INLINE_BATCH sequences are listed in the attention kernel's registers
    (``inline``), with no schedule launch."""
    S = WORK_SPLITS if num_splits is None else min(int(num_splits), MAX_SPLITS)
    tile = (invariant_tile(D, dtype, q_rows) if invariant else
            tile_config_for(D, 1 << 30, compiled_mode=not runtime.INTERPRET, elem_bytes=dtype.itemsize,
                            rows=1 << 30, q_rows=q_rows, paged=paged))
    L_cap = max(L_max if L_cap is None else L_cap, 1)
    sms = sm_count()
    return Decision("worklist", S, WORK_CHUNK_TILES * tile.BLOCK_N, tile, L_cap,
                    "batch-invariant: pieces by each row's length, listed on the device" if invariant
                    else basis, invariant=invariant, budget=0 if invariant else -(-WORK_WAVES * sms // H_kv),
                    inline=max(2, 1 << (B - 1).bit_length()) if B <= INLINE_BATCH else 0)


def pack_decision(B: int, H_q: int, H_kv: int, D: int, L_max: int, dtype, pack_heads: bool | None = None,
                  **kw) -> Decision | None:
    r"""The plan of a batch whose small heads are read P at a time, or None where they are not.

    In the token-major cache ``[.., L, H_kv, D]`` one KV head's row is D·bytes of every H_kv·D·bytes: at D = 64
    in fp16, 128 bytes of every 256 when H_kv = 2, and the program reading the other half runs at another
    time. Packing reads P adjacent KV heads as one head of P·D dims (:func:`~fdlib.kernels.launch.pack_for`:
    P·D <= 128, P | H_kv), so each tile row is one run of P·D·bytes, and the P·group query heads of the pack
    share a program: query head h holds its q in its own KV head's D dims of the row and zeros elsewhere
    (:func:`~fdlib.kernels.tile.own_dims`), so :math:`q'\cdot k' = q\cdot k_{h_{kv}}` and its softmax and
    output are exactly its own head's. The dot products are P times as long, which a tile of at most 16 query
    rows gets for free (tl.dot's smallest M is 16 rows anyway at group·P <= 16); the bytes read are the same.
    The cost model then chooses splits and kernel for the packed shape (H_kv/P heads of P·D dims, group·P);
    a pack is kept only where that is the unified kernel or the two-stage path.
    ``pack_heads``: True packs wherever the heads allow it, False never, None (the default) where it was
    measured faster (:func:`packs_by_default`). Only one query token, not batch-invariant (the caller checks);
    the cache must hold each token's heads side by side (:func:`~fdlib.kernels.launch.heads_adjacent`, checked
    at run)."""
    P = pack_for(H_kv, D)
    if pack_heads is False or P == 1:
        return None
    if pack_heads is None and not packs_by_default(B, H_kv, D, P, dtype, kw.get("lengths"), kw.get("max_seqlen"),
                                                   L_max):
        return None
    # asked for (True), the pack is planned for L_cap even without host lengths; by default stream-K's device
    # schedule, unpacked, takes such a call (robust to a ragged batch the pack's plan cannot see)
    d = decide(B, H_q, H_kv // P, D * P, L_max, dtype, pack_heads=False, device_schedule=pack_heads is not True, **kw)
    return replace(d, pack=P) if d.kernel in ("unified", "split") else None


PACK_MIN_ROWS, PACK_MIN_BYTES = 8, 1 << 27
"""Packing by default (:func:`packs_by_default`) needs this many packed rows B·H_kv/P and this many KV bytes."""


def packs_by_default(B: int, H_kv: int, D: int, P: int, dtype, lengths, max_seqlen, L_max: int) -> bool:
    """Whether a plan packs P KV heads unasked: on a GPU (compiled kernels), D = 64 (P = 2, the measured case),
    at least PACK_MIN_ROWS packed rows and PACK_MIN_BYTES of K and V at the plan's lengths. H200, fp16, D = 64,
    graph µs, the heads sweep's 24 shapes packed against the same commit's parent in one call
    (``results/h200/heads-sweep-d64-pack*.json`` and ``heads-sweep-d64-old.json``): packed/unpacked auto
    0.941-0.956 at B=8 16:4 and 16:16 from L = 65536 and B=8 16:2 L=262144 (there 258.8 -> 245.6 µs, cuDNN
    241.5), 0.977-1.002 on the other shapes of >= 128 MB and >= 8 packed rows (1.002 at B=1 16:16 L=65536);
    but with one or two packed rows (B=1 16:2, 16:4) up to 1.13 (14.7 -> 16.6 µs at B=1 16:2 L=65536: half the
    rows, each needing twice the splits), and 1.010-1.011 on the short B=8 16:2 and 16:4 L=8192 (34 and 67 MB)."""
    if runtime.INTERPRET or D != 64 or P != 2 or B * H_kv // P < PACK_MIN_ROWS:
        return False
    keys = sum(lengths) if lengths is not None else B * (L_max if max_seqlen is None else max_seqlen)
    return keys * H_kv * D * dtype.itemsize * 2 >= PACK_MIN_BYTES


def decide(B: int, H_q: int, H_kv: int, D: int, L_max: int, dtype, *, lengths=None, max_seqlen=None,
           method: str = "auto", num_splits: int | None = None, batch_invariant: bool = False,
           q_len: int = 1, paged: int = 0, pack_heads: bool | None = None,
           longest_first: bool | None = None, device_schedule: bool = True) -> Decision:
    """The kernel, tiles, splits and chunk for a batch of these sizes on this runtime (see the module doc).
    ``lengths``: host ints, one per sequence, or None; ``max_seqlen``: a host int bound, or None;
    ``batch_invariant``: :func:`invariant_decision`. ``q_len`` query tokens per sequence: a program holds
    group × q_len query rows, which the tiles count (:func:`~fdlib.kernels.config.tile_config_for`) and the
    cost model sees as H_q·q_len query heads (the same K/V bytes, q_len times the queries and outputs).
    ``pack_heads``: read small adjacent KV heads several at a time (:func:`pack_decision`). ``longest_first``:
    the unified kernel launches the sequences longest first (:func:`longest_first_order`): None where ``auto``'s
    rule takes it (:func:`fdlib.splits.longest_first_suits`), True always (``method="unified"`` only), False never.
    ``device_schedule``: False keeps ``auto`` from the stream-K that :func:`device_schedule_suits` gives a plan
    without lengths or of an 8-bit cache, for a plan of packed heads asked for (:func:`pack_decision`)."""
    if longest_first and method != "unified":
        raise ValueError(f"longest_first: True orders the unified kernel's sequences; pass method='unified', got "
                         f"method={method!r}")
    if longest_first and B > LONGEST_FIRST_MAX_BATCH:
        raise ValueError(f"longest_first: the order sorts the batch's lengths in registers, B <= "
                         f"{LONGEST_FIRST_MAX_BATCH}, got B={B}")
    if longest_first and (batch_invariant or pack_heads):
        raise ValueError("longest_first: True runs the plain unified kernel; pass batch_invariant=False and "
                         "pack_heads=None or False")
    if (not batch_invariant and q_len == 1 and method in ("auto", "unified", "split") and pack_heads is not False
            and not longest_first):
        d = pack_decision(B, H_q, H_kv, D, L_max, dtype, pack_heads, lengths=lengths, max_seqlen=max_seqlen,
                          method=method, num_splits=num_splits, paged=paged)
        if d is not None:
            return d
    q_rows = H_q // H_kv * q_len if q_len > 1 else 1
    given = max(lengths, default=1) if lengths is not None else max_seqlen   # what a device schedule is sized for
    if method == "worklist":
        return worklist_decision(B, H_kv, D, L_max, dtype, q_rows, paged, num_splits, batch_invariant, given)
    if batch_invariant:
        if method not in ("auto", "unified") or num_splits is not None:
            raise ValueError(f"batch_invariant: runs its own kernel, at chunks fixed by each row's length; pass "
                             f"method='auto' or 'unified' and num_splits=None (or method='worklist'), got "
                             f"method={method!r}, num_splits={num_splits!r}")
        return invariant_decision(B, H_q * q_len, H_kv, D, L_max, dtype, q_rows, given)
    L_cap, basis = ((max(max(lengths, default=0), 1), "host lengths") if lengths is not None else
                    (max(int(max_seqlen), 1), "max_seqlen") if max_seqlen is not None else (max(L_max, 1), "capacity"))
    if method == "naive":
        return Decision("naive", 1, L_cap, None, L_cap, basis)
    batch = (B, H_q * q_len, H_kv, D, dtype, L_cap, lengths, paged)   # what the choosers read
    kernel = method
    if method == "auto" and num_splits is None:
        # stream-K, shares made on the device from the lengths: without host lengths, or on an 8-bit cache
        if (device_schedule and device_schedule_suits(B, q_len)
                and (lengths is None or isinstance(dtype, quant.KVQuant))):
            kernel, num_splits = "streamk", 1
            basis = "device lengths" if lengths is None else basis
        else:
            kernel, num_splits = choose_auto(*batch)
            if kernel == "longest_first" and longest_first is False:
                kernel, num_splits = "unified", choose_splits(*batch)
    elif kernel in ("persistent", "streamk"):
        num_splits = 1
    elif num_splits is None:
        num_splits = (choose_balanced if kernel == "balanced" else choose_splits)(*batch)
    tile = tile_config(D, L_cap, dtype.itemsize, rows=B * H_kv, q_rows=q_rows, paged=paged)
    chunk, splits = chunk_for(L_cap, num_splits, tile.BLOCK_N)
    if kernel == "auto":   # forced splits: the unified kernel, or the persistent one at one split
        kernel = choose_kernel(B, H_kv, L_cap, splits, paged=paged)
    if (method == "auto" and kernel == "unified" and splits == 1 and not longest_first
            and one_wave_suits(B, H_kv, D, dtype, lengths, paged, q_len)):
        tile = ONE_WAVE_TILE   # equal short rows over pages, all programs on the SMs at once
        chunk, splits = chunk_for(L_cap, 1, tile.BLOCK_N)
    most = {"balanced": MAX_BATCH, "streamk": STREAMK_MAX_BATCH}.get(kernel, B)
    if B > most:
        raise ValueError(f"method: {kernel!r} keeps the batch's lengths in registers, B <= {most}, got B={B}")
    if kernel == "balanced":
        return Decision("balanced", splits, chunk, tile, L_cap, basis, budget=B * splits)
    if kernel in ("streamk", "persistent"):
        # the row walkers' tiles (persistent_config): 64 keys, where the unified kernel's 128 made the stream-K loop
        # slower on the H200, except on pages too small to read the table ahead
        sms, per_sm = sm_count(), persistent_per_sm()
        programs = streamk_programs(H_kv, sms, per_sm) if kernel == "streamk" else programs_for(B * H_kv, sms, per_sm)
        return Decision(kernel, 1, L_cap, persistent_config(D, dtype.itemsize, q_rows, paged=paged), L_cap, basis,
                        programs, 0 if kernel == "streamk" else rows_for(B * H_kv, programs))
    order = longest_first_order(B) if kernel == "longest_first" or longest_first else 0   # auto's rule, or asked for
    return Decision("unified" if kernel == "longest_first" else kernel, splits, chunk, tile, L_cap, basis,
                    order=order, table_regs=table_regs_for(chunk, paged, D) if kernel != "split" else 0)

TABLE_REGS_MAX = TABLE_REGS_LIMIT.value
"""The most block-table entries a split holds in registers: splits of up to 4096 keys at pages of 16. Timed on the
H200 (results/h200/ab/README.md): at 64 entries in runs 55, 62 and 63 (B=8 32:8 rows of 1024 keys over pages
15.7 -> 14.5 µs), at 256 in run 65 (B=8 32:8 rows of 8192, splits of 2048 keys: 1.5% faster than reading each
tile's entries a tile ahead; the sm_90 loop is the same size at 64, 128 and 256). A longer split holds its table a
block of TABLE_REGS_MAX entries at a time, reloading at each block's start (run 82: 0.3-0.4% faster than reading
a tile ahead on the four paged shapes it changed, none slower). It is the kernel's own limit,
:data:`fdlib.kernels.tile.TABLE_REGS_LIMIT` (512 faulted on the H200)."""


TABLE_REGS_MAX_D = 128
"""The largest head dim whose unified plans hold block-table entries in registers (:func:`table_regs_for`); above
it (D = 256: 32-key tiles) they read each tile's entries a tile ahead, as the split kernel does. A precaution:
two A/Bs on an H100 met an illegal memory access on D = 256 batches over pages whose unified plans held 64 and
128 entries, where 32 entries, and the split kernel's reading ahead, ran; the interpreter finds every address in
bounds there (``results/notes/fault-d256.md``, which names the GPU call that settles it)."""


def table_regs_for(chunk: int, page: int, D: int) -> int:
    """TABLE_REGS of a unified plan over pages of at least TABLE_AHEAD_PAGE keys: the block-table entries one split of
    ``chunk`` keys touches (one more where a split may start inside a page), rounded up to a power of two, at most
    TABLE_REGS_MAX (a longer split reloads its entries a block at a time); 0 on pages smaller than
    TABLE_AHEAD_PAGE and at head dims above TABLE_REGS_MAX_D. A split loads its first block with its row's length
    and gathers each tile's pages from registers (:func:`fdlib.kernels.tile.attend_slice`)."""
    if page < TABLE_AHEAD_PAGE.value or D > TABLE_REGS_MAX_D:
        return 0
    entries = chunk // page if chunk % page == 0 else -(-chunk // page) + 1
    regs = 1 << max(entries - 1, 0).bit_length()
    return min(regs, TABLE_REGS_MAX)   # a longer split holds its table a block of TABLE_REGS_MAX entries at a time


def longest_first_order(B: int) -> int:
    """ORDER_B of a unified plan that launches its sequences longest first (:func:`fdlib.kernels.tile.longest_first`):
    the smallest power of two >= B, at least 16 (B <= LONGEST_FIRST_MAX_BATCH). The order itself is checked or
    computed on the device from the lengths of each call (the plan's :func:`order_hint` first), so a plan made for
    ragged lengths stays ordered when they change.
    ``auto`` takes it for ragged batches over pages where :func:`fdlib.splits.longest_first_suits` holds (whole
    rows, one split); elsewhere the sort in every program measured slower (results/h200/README.md)."""
    if B > LONGEST_FIRST_MAX_BATCH:
        raise ValueError(f"B: the longest-first order sorts at most {LONGEST_FIRST_MAX_BATCH} lengths, got B={B}")
    return max(16, 1 << (B - 1).bit_length())


@dataclass(frozen=True)
class Workspace:
    """Device memory a plan owns (None where its kernel needs none)."""
    o_part: torch.Tensor | None      # [B, q_len, H_q, splits, D] float32 (balanced: [items, q_len, H_q, D])
    lse_part: torch.Tensor | None    # [B, q_len, H_q, splits] float32 (balanced: [q_len, H_q, items])
    counters: torch.Tensor | None    # [B·H_kv] int32, zero between calls (the unified kernel resets them)
    flag: torch.Tensor               # [1] int32: 1 once a device length or a page index was clamped (may be shared)
    lse: torch.Tensor                # [B, q_len, H_q] float32, for calls that do not ask for lse
    full_lengths: torch.Tensor       # [B] int32, all L_max: calls that pass no cache_seqlens
    order: torch.Tensor | None = None   # [ORDER_B] int32 right before counters, in their buffer: the order to check
    items: torch.Tensor | None = None   # [2 + B·S] int32 right before counters: the work list (its count, its
    #                                     unit, then its items: work_room, fdlib.kernels.worklist)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if t is not None)


@dataclass(frozen=True)
class DecodePlan:
    r"""Everything decided for one batch shape, and the workspace it runs in. Make it with :func:`plan`;
    call :meth:`run` every step.

    Per-program timeline (a GPU's per-SM Gantt chart from real times)::

        buf = plan.timeline_buffer()              # zeroed int64 [n_programs, 3] on the plan's device
        plan.run(q, k, v, lens, timeline=buf)     # row i <- (SM id, start ns, end ns) of program i

    ``timeline=`` launches a variant of the plan's kernel compiled with ``TIMELINE=True``: each program reads
    the GPU's global clock (``tl.extra.cuda.globaltimer``, ns) when it starts and again when it ends, and its SM
    (``tl.extra.cuda.smid``), and stores the three in its row. The normal kernels are compiled with
    ``TIMELINE=False`` and contain none of it: the flag costs nothing when off. Rows are programs in grid order,
    :math:`i = (p_0 n_1 + p_1) n_2 + p_2`: for stage 1 (the two-stage path times stage 1 only) program
    (b, h_kv, split) is row :math:`(b H_{kv} + h_{kv})\,\text{splits} + \text{split}`, for the unified kernel
    (h_kv, b, split) is row :math:`(h_{kv} B + b)\,\text{splits} + \text{split}` (b: the place in the
    longest-first order where the plan launches its sequences longest first); for the work list (h_kv, b, k) is
    row :math:`(h_{kv} B + b)\,n_2 + k`, item :math:`b + Bk` of the list, :math:`n_2` = :func:`work_grid`; for the
    balanced kernel (item, h_kv) is :math:`\text{item}\cdot H_{kv} + h_{kv}`; a persistent program writes one
    row for all its rows. Programs with nothing to do (a split past its row's end, an item past the work
    list) still write theirs, with start ≈ end. A call with fewer sequences than planned leaves the rows of the
    programs it did not launch at 0. The clock is the GPU's, shared by its SMs (ns, with a resolution of about
    1 µs on recent GPUs: short programs may show start = end). In Triton's interpreter ``timeline=`` raises: the
    interpreter has no per-program clock."""
    B: int
    H_q: int
    H_kv: int
    D: int
    L_max: int
    dtype: torch.dtype
    device: torch.device
    scale: float
    method: str
    page_size: int          # 0: K/V are [B, L_max, H_kv, D]; else pages [n_pages, page_size, H_kv, D]
    decision: Decision
    workspace: Workspace = field(repr=False)
    _host_lengths: torch.Tensor = field(repr=False, compare=False)   # [B] int32 on the device: host-given lengths
    _launchers: tuple = field(repr=False, compare=False)             # the kernels with their constexprs fixed
    q_len: int = 1          # query tokens per sequence: q is [B', q_len, H_q, D] (or [B', H_q, D] when 1)
    _timeline: dict = field(default_factory=dict, repr=False, compare=False)   # TIMELINE launchers, made on first use
    _replays: dict = field(default_factory=dict, repr=False, compare=False)    # layout of a call -> its launches
    kv: quant.KVQuant | None = None   # an 8-bit cache's dtype and scale granularities; None: K/V in q's dtype

    @property
    def kernel(self) -> str:
        return self.decision.kernel

    @property
    def splits(self) -> int:
        return self.decision.splits

    @property
    def chunk(self) -> int:
        return self.decision.chunk

    def __str__(self) -> str:
        d = self.decision
        tile = f", {d.tile.BLOCK_N}-key tiles" if d.tile else ""
        if d.invariant and d.tile.num_stages == FEW_STAGES:
            tile += f" ({FEW_STAGES} pipeline stages)"
        extra = f", {d.programs} programs" if d.kernel in ("persistent", "streamk") else ""
        paged = f", pages of {self.page_size}" if self.page_size else ""
        paged += f", q_len={self.q_len}" if self.q_len > 1 else ""
        paged += f", {self.kv}" if self.kv else ""
        if d.kernel == "streamk":
            return (f"DecodePlan: streamk kernel, {d.programs} programs ({d.programs // self.H_kv} a KV head) taking "
                    f"equal shares of each head's tiles{tile}; "
                    f"B={self.B}, H_q={self.H_q}, H_kv={self.H_kv}, D={self.D}, L_max={self.L_max}{paged}, "
                    f"{str(self.dtype)[6:]} on {self.device}; workspace {self.workspace.nbytes()} bytes")
        if d.kernel == "worklist":
            cut = (f"batch-invariant, each row cut by its own length into <= {d.splits} pieces of >= {d.chunk} keys"
                   if not d.budget else f"rows cut into <= {d.splits} equal pieces sized by the batch (a budget of "
                   f"{d.budget} items, pieces of >= {d.chunk} keys)")
            listed = "in each program's registers" if d.inline else "by a schedule kernel"
            return (f"DecodePlan: worklist kernel ({cut}, listed longest first {listed} at every call){tile}; "
                    f"B={self.B}, "
                    f"H_q={self.H_q}, H_kv={self.H_kv}, D={self.D}, L_max={self.L_max}{paged}, "
                    f"{str(self.dtype)[6:]} on {self.device}; workspace {self.workspace.nbytes()} bytes")
        if d.invariant:
            walk = (f", {d.programs} programs walking the rows" if d.kernel == "persistent" else
                    f", chunks a program chosen on the device from the lengths (one wave of {d.share} SMs)"
                    if d.share else
                    f", {d.per_program} chunk(s) a program" + (", rows launched longest first" if d.order else ""))
            kind = "," if d.kernel == "invariant" else ", batch-invariant:"
            return (f"DecodePlan: {d.kernel} kernel{kind} rows cut by their own lengths into <= {d.splits} chunk(s) "
                    f"({d.chunk}-key chunks for L_max){walk}{tile}; B={self.B}, "
                    f"H_q={self.H_q}, "
                    f"H_kv={self.H_kv}, D={self.D}, L_max={self.L_max}{paged}, {str(self.dtype)[6:]} on "
                    f"{self.device}; schedule chosen for L_cap={d.L_cap}; workspace {self.workspace.nbytes()} "
                    f"bytes")
        extra += f", {d.pack} KV heads read as one" if d.pack > 1 else ""
        extra += ", sequences launched longest first" if d.order else ""
        return (f"DecodePlan: {d.kernel} kernel, {d.splits} split(s) of {d.chunk} keys{tile}{extra}; B={self.B}, "
                f"H_q={self.H_q}, H_kv={self.H_kv}, D={self.D}, L_max={self.L_max}{paged}, {str(self.dtype)[6:]} on "
                f"{self.device}; splits chosen for L_cap={d.L_cap} ({d.basis}); workspace "
                f"{self.workspace.nbytes()} bytes")

    # ------------------------------------------------------------------------------------------- run
    def run(self, q, k_cache, v_cache, cache_seqlens=None, *, out=None, lse=None, block_table=None,
            return_lse: bool = False, timeline=None, k_scale=None, v_scale=None):
        """Attention of ``q`` ``[B', H_q, D]`` (or ``[B', q_len, H_q, D]`` with the plan's q_len, which may be 1;
        B' <= the planned B) against
        ``k_cache``/``v_cache`` ``[B', L_max, H_kv, D]`` (a paged plan: pages ``[n_pages, page_size, H_kv, D]``
        and ``block_table`` int32 ``[B', L_max / page_size]``) with ``cache_seqlens`` (int32/int64 ``[B']`` on
        the device, or host lengths: a list or a CPU tensor, checked on every call, on the CPU runtime too; None:
        all L_max). Writes ``out`` (q's shape and dtype)
        and ``lse`` (``q.shape[:-1]`` float32: ``[B', H_q]`` or ``[B', q_len, H_q]``) when given, else returns new
        ones. Query t of sequence b sees keys 0 … L_b − q_len + t (the new tokens are already in the cache).
        Returns ``out``, or
        ``(out, lse)`` when ``return_lse`` or ``lse`` is given. Launches only (see the module doc).
        ``timeline``: a buffer from :meth:`timeline_buffer` (GPU only): the launch records each program's SM and
        start and end times in it (see the class doc). Everything after ``cache_seqlens`` is keyword-only
        (``out=``, ``lse=``, ``block_table=``, ...), so a table can never land in ``out`` by position.
        ``k_scale``, ``v_scale``: an 8-bit plan's scales (:mod:`fdlib.quant`), of the granularities it was made for.

        A call laid out like an earlier checked one (the same shapes, strides, dtypes and devices of every
        tensor argument, and the same arguments left out) replays that call's launches with the new tensors'
        addresses (:func:`~fdlib.kernels.launch.replay`): its checks passed for that layout, and its strides and
        sizes are the same, so only the pointers are read again. Any other call is checked in full."""
        key = None
        if timeline is None and _launch_mod.FAST_LAUNCH:
            key = call_layout(q, k_cache, v_cache, cache_seqlens, out, lse, block_table, return_lse, k_scale, v_scale)
            steps = self._replays.get(key)
            if steps is not None:
                got = self.replayed(steps, q, k_cache, v_cache, cache_seqlens, out, lse, block_table, return_lse,
                                    k_scale, v_scale)
                if got is not None:
                    return got
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        tail = (self.q_len, self.H_q, self.D) if q.dim() == 4 else (self.H_q, self.D) if self.q_len == 1 else None
        B = q.shape[0] if q.dim() else 0
        if (tail is None or q.shape[1:] != tail or q.dtype != self.dtype
                or q.device != self.device or B > self.B or q.stride(-1) != 1 and self.D > 1):
            self._mismatch("q", q, B)
        if self.page_size:
            if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32
                    or block_table.shape != (B, self.L_max // self.page_size) or block_table.device != self.device
                    or block_table.stride(1) != 1 and block_table.shape[1] > 1):
                self._table_mismatch(block_table, B)
            kv_shape = (self.page_size, self.H_kv, self.D)
            for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
                if (t.dim() != 4 or t.shape[1:] != kv_shape or t.shape[0] < 1 or t.dtype != self._kv_dtype
                        or t.device != self.device or t.stride(-1) != 1 and self.D > 1):
                    if isinstance(t, torch.Tensor) and t.dim() == 4:
                        check_pool(name, t)
                    self._mismatch(name, t, B)
                check_page_strides(name, t, self.page_size)
                self._check_pack(name, t)
        else:
            if block_table is not None:
                raise ValueError("block_table: this plan is for a contiguous cache [B, L_max, H_kv, D]; make a "
                                 "paged plan with fdlib.plan(..., page_size=...)")
            kv_shape = (B, self.L_max, self.H_kv, self.D)
            for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
                if (t.shape != kv_shape or t.dtype != self._kv_dtype or t.device != self.device
                        or t.stride(-1) != 1 and self.D > 1):
                    self._mismatch(name, t, B)
                self._check_pack(name, t)
        quant.check_run(self.kv, k_cache, v_cache, k_scale, v_scale, bool(self.page_size))
        lens = self._lengths(cache_seqlens, B)
        if out is not None and (out.shape != q.shape or out.dtype != self.dtype or out.device != self.device
                                or out.stride(-1) != 1 and self.D > 1):
            self._mismatch("out", out, B, want=q)
        lse_shape = tuple(q.shape[:-1])
        if lse is not None and (tuple(lse.shape) != lse_shape or lse.dtype != torch.float32
                                or lse.device != self.device):
            raise ValueError(f"lse: expected a float32 tensor of shape {list(lse_shape)} on {self.device}, got "
                             f"{lse.dtype} {list(lse.shape)} on {lse.device}")
        want_lse = return_lse or lse is not None
        out, lse = self._outputs(q, out, lse, want_lse)
        times = None if timeline is None else self._check_timeline(timeline, B)
        calls = [] if key is not None else None
        self._launch(q, k_cache, v_cache, lens, out, lse, block_table, times, calls, k_scale, v_scale)
        if calls and lens is (self.workspace.full_lengths if cache_seqlens is None else cache_seqlens):
            ws = self.workspace
            steps = record(calls, (q, k_cache, v_cache, lens, out, lse, block_table,
                                   *quant.tensors(k_scale, v_scale)),
                           tuple(t for t in vars(ws).values() if t is not None))
            if steps is not None:
                if len(self._replays) >= 64:   # layouts seen: a bound, not a cache of lengths or pointers
                    self._replays.clear()
                self._replays[key] = steps
        return (out, lse) if want_lse else out

    def replayed(self, steps, q, k_cache, v_cache, cache_seqlens, out, lse, block_table, return_lse, k_scale,
                 v_scale):
        """The result of a call laid out like the checked one whose launches ``steps`` are (:attr:`_replays`,
        keyed by :func:`call_layout`): those launches with this call's addresses; None, having launched nothing,
        where :func:`~fdlib.kernels.launch.replay` declines (the caller then takes the checked path)."""
        if cache_seqlens is not None and self.device.type == "cpu":   # on the host: checked every call
            check_length_values(cache_seqlens, self.L_max)
        want_lse = return_lse or lse is not None
        out_t, lse_t = self._outputs(q, out, lse, want_lse)
        lens = self.workspace.full_lengths if cache_seqlens is None else cache_seqlens
        if replay(steps, (q, k_cache, v_cache, lens, out_t, lse_t, block_table, *quant.tensors(k_scale, v_scale))):
            return (out_t, lse_t) if want_lse else out_t
        return None

    def _check_pack(self, name, t):
        """A plan that reads several KV heads as one needs each token's heads side by side in ``t``."""
        if self.decision.pack > 1 and not heads_adjacent(t, self.D):
            raise ValueError(f"{name}: this plan reads {self.decision.pack} adjacent KV heads as one, which needs each "
                             f"token's heads side by side (stride(-2) == D = {self.D}, stride(-1) == 1); got strides "
                             f"{tuple(t.stride())}. Make the plan with fdlib.plan(..., pack_heads=False) for this "
                             f"layout (decode_attention does so itself).")

    def _outputs(self, q, out, lse, want_lse: bool):
        """(out, lse) a call writes: the caller's where given, else a new out like q, and a new float32 lse
        ``q.shape[:-1]`` when the caller wants one back (else the plan's own buffer)."""
        if out is None:
            out = torch.empty_like(q)
        if lse is None:
            lse = (torch.empty(q.shape[:-1], dtype=torch.float32, device=self.device) if want_lse
                   else self.workspace.lse)
        return out, lse

    @property
    def _kv_dtype(self):
        """The dtype of the K/V caches this plan reads: q's, or the 8-bit one of :attr:`kv`."""
        return self.dtype if self.kv is None else self.kv.dtype

    def _launch(self, q, k_cache, v_cache, lens, out, lse, bt, times=None, calls=None, k_scale=None, v_scale=None):
        """Launch the decided kernel(s): q, out ``[B', q_len, H_q, D]``, lse ``[B', q_len, H_q]``, or the
        one-token form ``[B', H_q, D]``, ``[B', H_q]`` as the caller gave them (the launches read the strides of
        the query-token axis without making views: :func:`~fdlib.kernels.launch.strides4`);
        ``times``: a checked timeline buffer (the TIMELINE variant of the kernel), or None; ``calls``: a list
        that gets each launch as ``(launcher, (grid, ptrs, scalars))``, for :func:`~fdlib.kernels.launch.record`;
        ``k_scale``/``v_scale``: an 8-bit cache's (:func:`fdlib.quant.launch_args`: a per-tensor K scale multiplies the
        softmax scale)."""
        d, ws = self.decision, self.workspace
        k_mul, *scales, _ = quant.launch_args(self.kv, k_scale, v_scale, ws.flag)
        scale = self.scale * k_mul
        go = self._launchers if times is None else self._timeline_launchers()
        if calls is not None:
            go = tuple(_Noted(g, calls) for g in go)
        if d.kernel == "unified":
            compiled = go[0](*unified_args(q, k_cache, v_cache, lens, scale, d.chunk, d.splits, out, lse,
                                           ws.o_part, ws.lse_part, ws.counters, ws.flag, bt, times, d.pack, scales))
            if compiled is not None:
                remember_resources(compiled, self.kv or self.dtype, self.D * d.pack,
                                   self.H_q // self.H_kv * self.q_len * d.pack, d.tile)
        elif d.kernel == "worklist":   # the list from the lengths, then the pieces it lists
            if not d.inline:
                go[0](*schedule_args(lens, q.shape[0], ws.items, ws.flag, d.chunk, self.L_max, d.budget))
            grid, ptrs, scalars = unified_args(q, k_cache, v_cache, lens, scale, d.chunk, d.splits, out, lse,
                                               ws.o_part, ws.lse_part, ws.counters, ws.flag, bt, times, 1, scales)
            B_call = q.shape[0]   # programs for the list's room only (S pieces a row stay the partials' layout)
            go[-1]((grid[0], B_call, work_grid(B_call, d)), ptrs, scalars)
        elif d.kernel == "invariant":   # splits: the longest row's chunks (partial slots); chunk := per program
            grid, ptrs, scalars = unified_args(q, k_cache, v_cache, lens, scale, max(d.per_program, 1), d.splits,
                                               out, lse, ws.o_part, ws.lse_part, ws.counters, ws.flag, bt, times,
                                               scales=scales)
            scalars = (*scalars, *((q.shape[0], d.share) if d.share else (0, 0)))   # the call's B, the share's SMs
            if d.share:   # (H_kv, programs a head): each program's row and chunks chosen on the device
                go[0]((grid[0], share_programs(q.shape[0], grid[0], d.share, d.splits), 1), ptrs, scalars)
            else:
                programs = -(-d.splits // d.per_program)   # a row's programs, at most
                go[0]((grid[0], grid[1], programs) if d.order else (grid[1], grid[0], programs), ptrs, scalars)
        elif d.kernel == "split":
            go[0](*stage1_args(q, k_cache, v_cache, lens, scale, d.chunk, d.splits, ws.o_part, ws.lse_part,
                               ws.flag, bt, times, d.pack, scales))
            out, lse = rows4(out), rows4(lse, 3)   # stage 2 merges (t, h) rows: views with the token axis
            if flat_rows(out) is None or flat_rows(lse) is None:   # stage 2 merges (t, h) rows of flat strides
                o_tmp, l_tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device), lse.contiguous()
                go[1](*stage2_args(ws.o_part, ws.lse_part, o_tmp, l_tmp))
                out.copy_(o_tmp)
                lse.copy_(l_tmp)
            else:
                go[1](*stage2_args(ws.o_part, ws.lse_part, out, lse))
        elif d.kernel == "persistent":
            go[0](*persistent_args(q, k_cache, v_cache, lens, scale, out, lse, d.programs, ws.flag, bt, times,
                                   scales))
        elif d.kernel == "streamk":
            go[0](*streamk_args(q, k_cache, v_cache, lens, scale, d.programs, out, lse, ws.o_part, ws.lse_part,
                                ws.counters, ws.flag, bt, times, scales))
        elif d.kernel == "balanced":
            go[0](*balanced_args(q, k_cache, v_cache, lens, scale, d.budget, out, lse, ws.o_part, ws.lse_part,
                                 ws.counters, ws.flag, bt, times, scales))
        else:
            if self.kv is not None:   # the cache it stands for, in float32
                k_cache, v_cache = quant.dequantize_kv(k_cache, k_scale), quant.dequantize_kv(v_cache, v_scale)
            lens = lens[: q.shape[0]]   # the call's B' rows (a call without lengths: the plan's all-L_max hold B)
            clamped = lens.clamp(0, self.L_max)
            ws.flag.copy_(torch.maximum(ws.flag, (clamped != lens).any().to(torch.int32)))
            if bt is not None:   # gather the pages into [B, L_max, H_kv, D]; indices clamped to the pool
                n = k_cache.shape[0]
                idx = bt.long().clamp(0, n - 1)
                used = torch.arange(bt.shape[1], device=bt.device) * self.page_size < clamped[:, None]
                ws.flag.copy_(torch.maximum(ws.flag, ((idx != bt) & used).any().to(torch.int32)))   # as the kernels
                k_cache = k_cache[idx].reshape(q.shape[0], self.L_max, self.H_kv, self.D)
                v_cache = v_cache[idx].reshape(q.shape[0], self.L_max, self.H_kv, self.D)
            o, l = naive_attention(q, k_cache, v_cache, clamped, self.scale)
            out.copy_(o)
            if lse.dim() > l.dim():   # the plan's own [B, 1, H_q] buffer under a one-token call
                lse = lse[:, 0]
            lse[: l.shape[0]].copy_(l)

    # -------------------------------------------------------------------------------------- timeline
    def timeline_programs(self, B: int | None = None) -> int:
        """Programs one launch of the plan's kernel starts for a batch of B sequences (default: the planned B);
        for the two-stage path, stage 1's."""
        B = self.B if B is None else B
        d = self.decision
        if d.kernel in ("unified", "split"):
            return B * self.H_kv // d.pack * d.splits
        if d.kernel == "worklist":   # the grid (H_kv, B, ⌈room / B⌉) of the list's room (_launch)
            return self.H_kv * B * work_grid(B, d)
        if d.kernel == "invariant":
            if d.share:   # the grid (H_kv, share_programs) of _launch
                return self.H_kv * share_programs(B, self.H_kv, d.share, d.splits)
            return B * self.H_kv * -(-d.splits // d.per_program)
        if d.kernel == "balanced":
            return items_max(B, d.budget) * self.H_kv
        if d.kernel == "persistent":
            return max(1, min(d.programs, B * self.H_kv))
        if d.kernel == "streamk":
            return d.programs
        raise ValueError("timeline: method='naive' runs PyTorch, no Triton kernel, so it has no programs to time; "
                         "plan another method")

    def timeline_buffer(self) -> torch.Tensor:
        """A zeroed int64 tensor ``[n_programs, 3]`` on the plan's device, one row per program of one launch
        (:meth:`timeline_programs`), for ``run(..., timeline=buf)``: row i gets (SM id, start ns, end ns) of
        program i (see the class doc)."""
        return torch.zeros((self.timeline_programs(), 3), dtype=torch.int64, device=self.device)

    def _check_timeline(self, buf, B: int):
        if runtime.INTERPRET:
            raise RuntimeError("timeline: per-program times come from the GPU's clock and SM registers "
                               "(tl.extra.cuda.globaltimer, smid) in a compiled kernel; Triton's interpreter "
                               "(TRITON_INTERPRET=1) has neither. Run on a CUDA GPU, or use a recorded timeline.")
        n = self.timeline_programs(B)
        if (not isinstance(buf, torch.Tensor) or buf.dtype != torch.int64 or buf.device != self.device
                or buf.dim() != 2 or buf.shape[0] < n or buf.shape[1] != 3 or not buf.is_contiguous()):
            got = (f"{buf.dtype} {shape_str(buf)} on {buf.device}" if isinstance(buf, torch.Tensor)
                   else type(buf).__name__)
            raise ValueError(f"timeline: expected a contiguous int64 tensor [>= {n}, 3] on {self.device} (one row "
                             f"per program: plan.timeline_buffer()), got {got}")
        return buf

    def _timeline_launchers(self) -> tuple:
        """The plan's kernels compiled with TIMELINE=True, made on first use."""
        if "go" not in self._timeline:
            self._timeline["go"] = _launchers(self.decision, self.dtype, self.H_q // self.H_kv, self.D,
                                              self.page_size, self.B, self.q_len, timeline=True, kv=self.kv)
        return self._timeline["go"]

    def _lengths(self, cache_seqlens, B):
        """The lengths as the kernels read them: a dense int32/int64 tensor on the plan's device. Lengths on the
        host (a list, or a CPU tensor) are checked, ``ValueError`` for one outside 0..L_max: reading them costs no
        device sync. A CPU plan's (Triton's interpreter) device is the host, so there a tensor is both: the kernels
        read it where it is, and it is checked as a list is."""
        if cache_seqlens is None:
            return self.workspace.full_lengths
        if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.device == self.device:
            if cache_seqlens.dtype not in (torch.int32, torch.int64) or cache_seqlens.shape != (B,):
                raise ValueError(f"cache_seqlens: expected an int32 or int64 tensor of shape [{B}], got "
                                 f"{cache_seqlens.dtype} {list(cache_seqlens.shape)}")
            if self.device.type == "cpu":
                check_length_values(cache_seqlens, self.L_max)
            # the kernels read LENS + b: a strided view costs one copy (a kernel launch, captured in a graph)
            return cache_seqlens if cache_seqlens.stride(0) == 1 or B == 1 else cache_seqlens.contiguous()
        host = host_lengths(cache_seqlens, B, self.L_max, self.device)
        buf = self._host_lengths[:B]
        buf.copy_(host, non_blocking=True)
        return buf

    def _table_mismatch(self, bt, B):
        check_block_table(bt, B, self.device)
        raise ValueError(f"block_table: this plan expects [{B}, {self.L_max // self.page_size}] (L_max={self.L_max} "
                         f"in pages of {self.page_size}), got {list(bt.shape)}")

    def _mismatch(self, name, t, B, want=None):
        """Raise the error that says how ``t`` differs from what this plan was made for."""
        if want is not None:
            shape = list(want.shape)
        elif name == "q":
            if t.dim() in (3, 4) and (t.shape[1] if t.dim() == 4 else 1) != self.q_len:
                raise ValueError(f"q: this plan was made for q_len={self.q_len} query token(s) per sequence, q "
                                 f"[B, {self.q_len}, {self.H_q}, {self.D}]" + (f" or [B, {self.H_q}, {self.D}]"
                                                                             if self.q_len == 1 else "")
                                 + f"; got {shape_str(t)}. Make a plan with fdlib.plan(..., q_len=...) for other "
                                 f"q_len.")
            shape = (f"[B, {self.H_q}, {self.D}] or [B, 1, {self.H_q}, {self.D}] with B <= {self.B}" if self.q_len == 1
                     else f"[B, {self.q_len}, {self.H_q}, {self.D}] with B <= {self.B}")
        elif self.page_size:
            shape = f"[n_pages, {self.page_size}, {self.H_kv}, {self.D}]"
        else:
            shape = f"[{B}, {self.L_max}, {self.H_kv}, {self.D}]"
        want_dtype = self._kv_dtype if name in ("k_cache", "v_cache") else self.dtype
        if t.dtype != want_dtype:
            raise TypeError(f"{name}: this plan runs {str(want_dtype)[6:]}, got {str(t.dtype)[6:]}")
        if t.device != self.device:
            raise ValueError(f"{name}: this plan runs on device {self.device}, got a tensor on device {t.device}")
        if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: the last (head) dimension must be contiguous (stride 1), got strides "
                             f"{tuple(t.stride())}")
        raise ValueError(f"{name}: this plan expects shape {shape}, got {shape_str(t)}. Make a new plan for "
                         f"other shapes (fdlib.plan(...)); decode_attention keeps one per shape.")

    # ----------------------------------------------------------------------------------------- checks
    def clamped(self, reset: bool = True) -> bool:
        """Whether a device length outside 0..L_max, or a block-table entry outside the pool that a length
        reaches, was clamped since the last check (reads the flag: one device-to-host copy, so call it outside
        the hot loop and outside graph capture); ``reset``: set the flag back to 0. Entries past a sequence's
        length are never read and never flagged. A flag given to several plans (``clamp_flag=``) is theirs
        together: :func:`fdlib.decode_attention`'s plans share one a device, read by :func:`fdlib.clamped`."""
        seen = bool(self.workspace.flag.item())
        if reset and seen:
            self.workspace.flag.zero_()
        return seen


def call_layout(q, k_cache, v_cache, cache_seqlens, out, lse, block_table, return_lse, k_scale, v_scale):
    """The key of a call's recorded launches (:meth:`DecodePlan.run`): :func:`_layout` of its tensors and
    :func:`fdlib.quant.layout` of its scales; None where an argument is not a tensor (such calls are checked)."""
    try:
        return (_layout(q, k_cache, v_cache, cache_seqlens, out, lse, block_table, return_lse),
                quant.layout(k_scale, v_scale))
    except AttributeError:   # not a tensor: the checks say what was expected
        return None


def _layout(q, k_cache, v_cache, cache_seqlens, out, lse, block_table, return_lse) -> tuple:
    """What a call's checks and launch arguments depend on, besides its addresses: every tensor argument's
    shape, strides, dtype and device (None for one left out); AttributeError for an argument that is not a
    tensor (a host list of lengths: those calls are always checked)."""
    return (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
            None if cache_seqlens is None else (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype,
                                                cache_seqlens.device),
            None if out is None else (out.shape, out.stride(), out.dtype, out.device),
            None if lse is None else (lse.shape, lse.stride(), lse.dtype, lse.device),
            None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                              block_table.device),
            bool(return_lse))


class _Noted:
    """A launcher that also notes each launch's arguments in ``calls`` (for :func:`record`)."""
    __slots__ = ("go", "calls")

    def __init__(self, go, calls: list):
        self.go, self.calls = go, calls

    def __call__(self, *args):
        self.calls.append((self.go, args))
        return self.go(*args)


def host_lengths(cache_seqlens, B: int, L_max: int, device, name: str = "cache_seqlens") -> torch.Tensor:
    """Lengths the caller has on the host (a list, tuple or CPU tensor) as an int32 CPU tensor, checked:
    ``ValueError`` naming ``name`` when the count or a value is wrong. Reads no GPU memory."""
    if not isinstance(cache_seqlens, torch.Tensor):
        return torch.tensor(checked_length_list(cache_seqlens, B, L_max, name), dtype=torch.int32)
    if cache_seqlens.device.type != "cpu":
        where = "on q's device ({device}) or on the host (CPU)" if name == "cache_seqlens" else "on the host (CPU)"
        raise ValueError(f"{name}: must be {where.format(device=device)}, got {cache_seqlens.device}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: dtype must be torch.int32 or torch.int64, got {cache_seqlens.dtype}")
    t = cache_seqlens.to(torch.int32)
    if tuple(t.shape) != (B,):
        raise ValueError(f"{name}: expected {B} lengths (one per sequence), got shape {list(t.shape)}")
    check_length_values(t, L_max, name)
    return t


def checked_length_list(lengths, B: int, L_max: int, name: str = "cache_seqlens") -> list:
    """A list or tuple of B ints in 0..L_max, checked in Python (no tensor is made or read); ``TypeError`` or
    ``ValueError`` naming ``name``."""
    check_lengths_type(lengths, name, optional=False)
    if len(lengths) != B:
        raise ValueError(f"{name}: expected {B} lengths (one per sequence), got shape [{len(lengths)}]")
    if lengths:
        _length_range(min(lengths), max(lengths), L_max, name)
    return list(lengths)


def check_length_values(t: torch.Tensor, L_max: int, name: str = "cache_seqlens") -> None:
    """``ValueError`` naming ``name`` unless every length of the host tensor ``t`` lies in 0..L_max."""
    if t.numel():
        _length_range(int(t.min()), int(t.max()), L_max, name)


def _length_range(lo: int, hi: int, L_max: int, name: str = "cache_seqlens") -> None:
    if lo < 0:
        raise ValueError(f"{name}: lengths must be >= 0, got a minimum of {lo}")
    if hi > L_max:
        raise ValueError(f"{name}: lengths must be <= the cache's L_max={L_max}, got a maximum of {hi}")


def check_lengths_and_table(cache_seqlens, block_table, B: int, L_max: int, page_size: int, n_pages: int,
                            device) -> None:
    r"""``check_lengths=True`` (:func:`fdlib.decode_attention`): the lengths lie in 0..L_max, and every block-table
    entry a length reaches lies in the pool: entry j of sequence b, read when :math:`j \cdot 	ext{page\_size} < L_b`,
    in 0..n_pages − 1 (entries past a length are never read and may hold anything, −1 say). What is on the device
    (the lengths, the table) is reduced there and read back together: one device-to-host copy, a sync, whatever
    is checked. ``ValueError`` naming ``cache_seqlens``, or ``block_table`` with the sequence, the entry, its
    value and the pool's size. Lengths on the host are checked without a read; no lengths: all L_max."""
    on_device = isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.device.type != "cpu"
    if cache_seqlens is not None and not on_device:
        cache_seqlens = host_lengths(cache_seqlens, B, L_max, device)
    if block_table is None:
        if on_device:
            lo, hi = torch.stack([cache_seqlens.min(), cache_seqlens.max()]).tolist()   # the one read
            _length_range(lo, hi, L_max)
        return
    bt = block_table
    pages = bt.shape[1]
    lens = (torch.full((B,), L_max, dtype=torch.int64, device=bt.device) if cache_seqlens is None
            else cache_seqlens.to(device=bt.device, dtype=torch.int64))
    reached = torch.arange(pages, device=bt.device) * page_size < lens[:, None]
    bad = (reached & ((bt < 0) | (bt >= n_pages))).flatten()
    first = bad.to(torch.int32).argmax()                       # the first bad entry (0 when none is)
    row = first // pages
    lo, hi, any_bad, at, value, length = torch.stack([
        lens.min(), lens.max(), bad.any().to(torch.int64), first.to(torch.int64), bt.flatten()[first].to(torch.int64),
        lens[row]]).tolist()                                   # the one read
    if on_device:
        _length_range(lo, hi, L_max)
    if any_bad:
        b, j = divmod(at, pages)
        raise ValueError(f"block_table: sequence {b} reads entry [{b}, {j}] = {value}, outside the pool of {n_pages} "
                         f"pages (indices 0..{n_pages - 1}); its length {length} reaches entries 0.."
                         f"{(length - 1) // page_size} (pages of {page_size}). Entries past a sequence's length are "
                         f"never read and may hold anything (-1, say).")


def plan(B: int, H_q: int, H_kv: int, D: int, L_max: int, *, dtype=torch.float16, device=None, lengths=None,
         max_seqlen: int | None = None, scale: float | None = None, method: str = "auto",
         num_splits: int | None = None, page_size: int | None = None, batch_invariant: bool = False,
         q_len: int = 1, pack_heads: bool | None = None, longest_first: bool | None = None,
         clamp_flag: torch.Tensor | None = None, kv_dtype=None, k_scale: str | None = None,
         v_scale: str | None = None) -> DecodePlan:
    """Decide everything for decode attention over a batch of these sizes, and allocate its workspace.

    Args:
        B, H_q, H_kv, D, L_max: batch, query heads, KV heads (H_q a multiple), head dim, cache capacity.
        dtype: of q, K and V (float16, bfloat16, float32). device: where they live (default: fdlib's;
            ``"cuda"`` is the current GPU, and raises ``ValueError`` where torch sees none).
        lengths: the sequences' lengths if the caller has them on the host (a list or a CPU tensor, each in
            0..L_max); read without any device sync, they make the cost model see the real mix of lengths.
        max_seqlen: else, a host bound on the lengths, a Python int in 0..L_max (splits are chosen for it);
            default: L_max.
        scale: multiplies q·k (default 1/√D). method, num_splits: as in :func:`fdlib.decode_attention`.
        page_size: for a paged cache (pages ``[n_pages, page_size, H_kv, D]`` behind a block table of
            L_max / page_size entries per sequence): a power of two from 1 to 256 dividing L_max.
        batch_invariant: results bitwise independent of the batch (:func:`invariant_decision`).
        q_len: query tokens per sequence, 1 to 16 (speculative decoding verifies q_len − 1 draft tokens):
            :meth:`DecodePlan.run` then takes q ``[B, q_len, H_q, D]``. The new tokens are already the last q_len
            keys of each sequence's cache, and query t sees keys 0 … L_b − q_len + t, causal among themselves
            (``flash_attn_with_kvcache``'s convention); a query that sees no key (L_b < q_len − t) gives
            out = 0, lse = −inf. Each K/V tile is still read once per KV head: a program holds the
            group × q_len query rows in one ``tl.dot`` tile.
        pack_heads: read small adjacent KV heads several at a time, as one wider head (:func:`pack_decision`):
            True wherever the heads allow it, False never, None (default) where measured faster
            (:func:`packs_by_default`). A packing plan needs caches whose KV heads lie side by side
            (stride(-2) == D), as contiguous and paged ones do.
        longest_first: launch the sequences longest first, ordered on the device from each call's lengths
            (the unified kernel's ``ORDER_B``, :func:`longest_first_order`): None (default) where ``auto``
            takes it (ragged host lengths over pages, :func:`fdlib.splits.longest_first_suits`), True always
            (with ``method="unified"``, B <= LONGEST_FIRST_MAX_BATCH), False never.
        clamp_flag: the int32 ``[1]`` tensor on ``device`` where the plan's launches record a clamp (set to 1
            when a device length outside 0..L_max or a used block-table entry outside the pool was clamped;
            :meth:`DecodePlan.clamped` reads it): default a new one, the plan's own; plans given the same
            tensor share it (:func:`fdlib.decode_attention`'s plans share one a device, :func:`fdlib.clamped`).
        kv_dtype: an 8-bit cache (``torch.float8_e4m3fn`` or ``torch.int8``, :mod:`fdlib.quant`) with q of
            ``dtype`` float16 or bfloat16; None (default): K and V in q's dtype. k_scale, v_scale: the granularity
            of its scales, ``"tensor"`` (default), ``"head"`` or ``"token"``; :meth:`DecodePlan.run` then takes the
            scales themselves. Tiles and the cost model count the cache's bytes (1 an element, plus 4 a key and KV
            head for per-token scales). Heads are packed (``pack_heads``) only with per-tensor scales.
    """
    for name, v in (("B", B), ("H_q", H_q), ("H_kv", H_kv), ("D", D), ("L_max", L_max)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if B < 1 or H_kv < 1 or L_max < 0:
        raise ValueError(f"B, H_kv: expected >= 1 and L_max >= 0, got B={B}, H_kv={H_kv}, L_max={L_max}")
    if H_q < 1 or H_q % H_kv:
        raise ValueError(f"H_q: {H_q} query heads must be a positive multiple of H_kv={H_kv} KV heads")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"D: head dim must be between 1 and {MAX_HEAD_DIM}, got {D}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype: must be float16, bfloat16 or float32, got {dtype}")
    check_method(method)
    check_num_splits(num_splits, method)
    if page_size is not None:
        check_page_size(page_size)
        if L_max % page_size or L_max == 0:
            raise ValueError(f"page_size: L_max={L_max} must be a positive multiple of page_size={page_size}")
    scale = check_scale(scale, D)
    device = check_device(device)
    if isinstance(lengths, (list, tuple)):   # checked in Python: a call's own all-L_max lengths read no tensor
        lengths = tuple(checked_length_list(lengths, B, L_max, name="lengths"))
    elif lengths is not None:
        lengths = tuple(host_lengths(lengths, B, L_max, device, name="lengths").tolist())
    check_max_seqlen(max_seqlen, L_max)
    if method != "naive":
        runtime.smoke_check()
    check_bool("batch_invariant", batch_invariant)
    check_q_len(q_len, L_max)
    for name, flag in (("pack_heads", pack_heads), ("longest_first", longest_first)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name}: expected None, True or False, got {type(flag).__name__}")
    if clamp_flag is not None and (not isinstance(clamp_flag, torch.Tensor) or clamp_flag.dtype != torch.int32
                                   or tuple(clamp_flag.shape) != (1,) or clamp_flag.device != device):
        got = (f"{clamp_flag.dtype} {shape_str(clamp_flag)} on {clamp_flag.device}"
               if isinstance(clamp_flag, torch.Tensor) else type(clamp_flag).__name__)
        raise ValueError(f"clamp_flag: expected an int32 tensor [1] on {device}, got {got}")
    kv = quant.plan_format(kv_dtype, k_scale, v_scale, dtype)
    if kv is not None and (kv.k != "tensor" or kv.v != "tensor"):
        if pack_heads:
            raise ValueError(f"pack_heads: KV heads read as one share their scales; {kv} has scales per head or "
                             f"token, so pass pack_heads=None or False")
        pack_heads = False
    d = decide(B, H_q, H_kv, D, L_max, kv or dtype, lengths=lengths, max_seqlen=max_seqlen, method=method,
               num_splits=num_splits, batch_invariant=batch_invariant, q_len=q_len, paged=page_size or 0,
               pack_heads=pack_heads, longest_first=longest_first)
    page = page_size or 0
    return DecodePlan(B, H_q, H_kv, D, L_max, dtype, device, scale, method, page, d,
                      _workspace(B, H_q, H_kv, D * d.pack, L_max, d, device, q_len, lengths, clamp_flag),
                      torch.empty(B, dtype=torch.int32, device=device),
                      _launchers(d, dtype, H_q // H_kv, D, page, B, q_len, kv=kv), q_len, kv=kv)


def check_device(device) -> torch.device:
    """The plan's device: fdlib's for None; ``"cuda"`` means the current CUDA device, as for tensors. A device
    torch does not know, or CUDA where no GPU is visible, raises ``ValueError`` naming ``device``."""
    try:
        device = torch.device(runtime.DEVICE if device is None else device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected a torch.device or a device string such as 'cpu' or 'cuda', got "
                         f"{device!r}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {str(device)!r} asked, but no CUDA GPU is visible to torch here (fdlib's "
                             f"runtime: {runtime.MODE}, device {runtime.DEVICE!r}); pass device=None or "
                             f"{runtime.DEVICE!r}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"device: {str(device)!r} asked, but torch sees {torch.cuda.device_count()} CUDA "
                             f"device(s)")
    return device


def _launchers(d: Decision, dtype, group: int, D: int, page: int, B: int, q_len: int = 1,
               timeline: bool = False, kv: quant.KVQuant | None = None) -> tuple:
    """The kernels a decision launches, each with its constexprs fixed (:class:`fdlib.kernels.launch.Launcher`);
    only the lengths (pointer 3) may change dtype between runs: run checks the others against the plan. ``kv``: an
    8-bit cache's format (the kernels' K_SCALE and V_SCALE)."""
    modes = quant.scale_modes(kv)
    if d.pack > 1:   # the pack's group and width (pack_decision)
        group, D = group * d.pack, D * d.pack
    if d.kernel == "unified":
        return (unified_launcher(dtype, group, D, d.splits, d.tile, dtype_slots=(3,), page=page, q_len=q_len,
                                 timeline=timeline, pack=d.pack, order=d.order, table_regs=d.table_regs,
                                 scale_modes=modes),)
    if d.kernel == "worklist":   # the schedule kernel, unless each program lists the lengths itself
        main = unified_launcher(dtype, group, D, d.splits, d.tile, dtype_slots=(3,), page=page, q_len=q_len,
                                timeline=timeline, scale_modes=modes, work=work_room(B, d), work_b=d.inline,
                                work_p=d.budget)
        return (main,) if d.inline else (schedule_launcher(d.splits, d.tile.BLOCK_N, d.budget > 0), main)
    if d.kernel == "invariant":
        return (invariant_launcher(dtype, group, D, d.tile, dtype_slots=(3,), page=page, q_len=q_len,
                                   timeline=timeline, one_chunk=d.per_program == 1,
                                   alone=not d.share and d.per_program >= d.splits, max_row_chunks=d.splits,
                                   scale_modes=modes, order=d.order, share_batch=B if d.share else 0),)
    if d.kernel == "split":
        return (stage1_launcher(dtype, group, D, d.tile, dtype_slots=(3,), page=page, q_len=q_len, timeline=timeline,
                                pack=d.pack, scale_modes=modes),
                stage2_launcher(D, d.splits, dtype_slots=(), pack=d.pack, group=group // d.pack))
    if d.kernel == "balanced":
        return (balanced_launcher(dtype, group, D, B, d.tile, dtype_slots=(3,), page=page, q_len=q_len,
                                  timeline=timeline, scale_modes=modes),)
    if d.kernel == "streamk":
        return (streamk_launcher(dtype, group, D, B, d.tile, dtype_slots=(3,), page=page, q_len=q_len,
                                 timeline=timeline, scale_modes=modes),)
    if d.kernel == "persistent":
        return (persistent_launcher(dtype, group, D, d.tile, d.rows_per_program, dtype_slots=(3,), page=page,
                                    invariant=d.invariant,
                                    q_len=q_len, timeline=timeline, scale_modes=modes),)
    return ()


def _workspace(B, H_q, H_kv, D, L_max, d: Decision, device, q_len: int = 1, lengths=None,
               flag: torch.Tensor | None = None) -> Workspace:
    """Allocate what the decided kernel needs; out of memory says how much and what needs less. A plan that
    launches its sequences longest first also keeps its order, from ``lengths`` (:func:`order_hint`), right before
    the ticket counters, where the kernel checks it before sorting (:func:`fdlib.kernels.tile.longest_first`)."""
    partials = d.kernel == "split" or d.kernel in ("unified", "invariant", "worklist") and d.splits > 1
    slots = (items_max(B, d.budget) if d.kernel == "balanced" else slots_for(d.programs) if d.kernel == "streamk"
             else B * d.splits if partials else 0)
    try:
        f32 = dict(dtype=torch.float32, device=device)
        if d.kernel == "balanced":   # partials by item: a row's items are consecutive (fdlib.schedule)
            o_part = torch.empty((slots, q_len, H_q, D), **f32)
            lse_part = torch.empty((q_len, H_q, slots), **f32)
        elif d.kernel == "streamk":   # pieces of rows cut by the shares: one KV head's query rows a slot
            o_part = torch.empty((slots, q_len * (H_q // H_kv), D), **f32)
            lse_part = torch.empty((q_len * (H_q // H_kv), slots), **f32)
        else:
            o_part = torch.empty((B, q_len, H_q, d.splits, D), **f32) if partials else None
            lse_part = torch.empty((B, q_len, H_q, d.splits), **f32) if partials else None
        counters = order = items = None
        if d.kernel in ("unified", "balanced", "invariant", "streamk", "worklist"):
            room = work_room(B, d)
            buf = torch.zeros(d.order + room + B * H_kv, dtype=torch.int32, device=device)
            counters = buf[d.order + room:]
            if d.order:
                order = buf[:d.order]
                order[:B] = torch.tensor(order_hint(B, L_max, lengths), dtype=torch.int32)
            if room:
                items = buf[:room]
        return Workspace(
            o_part=o_part,
            lse_part=lse_part,
            counters=counters,
            order=order,
            items=items,
            flag=torch.zeros(1, dtype=torch.int32, device=device) if flag is None else flag,
            lse=torch.empty((B, q_len, H_q), **f32),
            full_lengths=torch.full((B,), L_max, dtype=torch.int32, device=device))
    except _OOM as e:
        need = workspace_bytes(slots, H_q, D, q_len)
        raise _OOM(f"fdlib.plan: out of memory on {device} allocating the split workspace, {need} bytes "
                   f"(B={B}, q_len={q_len}, H_q={H_q}, D={D}, splits={d.splits}); fewer splits (num_splits) or a "
                   f"smaller batch needs less. {e}") from e


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def work_room(B: int, d: Decision) -> int:
    """Int32 entries of a work-list plan's list (its count, its unit, then at most B·S items, budget + B where
    sized by the batch: :func:`fdlib.worklist.capacity`); 0 for other kernels."""
    return 2 + worklist.capacity(B, d.splits, d.budget) if d.kernel == "worklist" else 0


def work_grid(B: int, d: Decision) -> int:
    """The third axis of a work-list launch over B sequences, (H_kv, B, ⌈room / B⌉): programs for the list's room
    only (:func:`fdlib.worklist.capacity`), S pieces a row staying the partials' layout; 0 for no sequences (an
    empty grid, as the other kernels launch for B' = 0)."""
    return -(-worklist.capacity(B, d.splits, d.budget) // max(B, 1))


def workspace_bytes(slots: int, H_q: int, D: int, q_len: int = 1) -> int:
    """Bytes of the float32 split partials O_i and lse_i of ``slots`` partials per query row (q_len · H_q rows)."""
    return slots * q_len * H_q * (D + 1) * 4


__all__ = ["plan", "DecodePlan", "Decision", "Workspace", "decide", "pack_decision", "packs_by_default",
           "launched_splits", "host_lengths", "check_length_values", "check_lengths_and_table", "check_device",
           "longest_first_order", "order_hint", "KERNELS"]
