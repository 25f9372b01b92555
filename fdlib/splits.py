r"""``method="auto"``: which kernel runs a batch and at how many splits, read top to bottom.

The cost model (:mod:`fdlib.costmodel`) predicts :math:`T(s)`, a launch's time at s splits, for the unified kernel
and for the two-stage path (stage 1 + stage 2), and its best count :math:`s^*`. :func:`choose_auto` takes the first
of these that holds:

1. Triton's interpreter (no SMs, no timing): the unified kernel at :func:`simple_rule`'s splits on a pretend GPU of
   INTERPRETER_SMS SMs (the persistent kernel where :func:`choose_kernel` takes it).
2. Ragged host lengths over pages: whole rows launched longest first, one split (:func:`longest_first_suits`).
3. Host lengths stream-K suits (:func:`streamk_suits`): the stream-K kernel.
4. The two-stage path where :func:`auto_path` takes it: predicted faster, or a unified epilogue too large.
5. The unified kernel at :math:`s^*`; at one split the persistent kernel where :func:`choose_kernel` takes it.

:func:`fdlib.plan.decide` adds two: a plan made without host lengths runs stream-K
(:func:`fdlib.plan.device_schedule_suits`), and equal short rows over pages take small tiles (:func:`one_wave_suits`).
``"unified"`` and ``"split"`` run :math:`s^*` of the unified kernel (:func:`choose_splits`), so they compare like
with like. Each constant below is a boundary measured on a GPU where the model alone chose wrong; the runs behind
each are in ``results/notes/chooser.md``, and ``tools/decision_table.py --set NAME=VALUE`` shows the benchmarked
batches whose choice it decides.
"""
from __future__ import annotations

from . import runtime
from .kernels.config import MAX_SPLITS, ONE_WAVE_PER_SM, cdiv, tile_config

INTERPRETER_SMS = 8
"""The interpreter's pretend GPU: enough SMs that lab-sized problems still split."""

EPILOGUE_WORK = 10_000
"""The unified kernel's last program merges s·group·(D+1) values alone on its SM; at this many or more the two-stage
path, which spreads the merge over B·H_q programs, was faster (H200)."""
TWO_STAGE_SPLITS = 32
"""The merge reads the partials one split after another: from this many splits the two-stage path was faster
whatever the group and D (H200)."""
PAGED_EPILOGUE_WORK = 24_768
"""Over pages the two-stage path was never more than 1.4% faster up to 48·4·129 merged values (H200): the unified
kernel up to there, whatever the model predicts."""

STREAMK_MAX_MEAN = 2048
"""On a contiguous cache stream-K took ragged rows averaging more than this many keys, and shorter rows where there
is a row (b, h_kv) per SM (H200)."""
STREAMK_PAGED_MIN_TILES = 40
"""Over pages stream-K took ragged batches whose programs stream at least this many tiles each (H200)."""
STREAMK_PAGED_DENSE_TILES = 384
"""... and equal rows from this many tiles a program, halfway between 256 (slower) and 496 (faster, H200)."""

LONGEST_FIRST_IMBALANCE = 1.05
"""Whole rows longest first where the greedy schedule's busiest SM is within this of the mean (H200)."""

ONE_WAVE_WAVES = 2
"""One-wave tiles for B·H_kv rows that make one to this many whole waves of ONE_WAVE_PER_SM·SMs programs, to the
nearest wave: one and two were faster, four not (H200) ..."""
ONE_WAVE_MAX_KEYS = 1024
"""... of equal rows of at most this many keys (512 and 1024 faster, 2048 and longer slower)."""

PERSISTENT_MIN_WAVES = 2
"""The persistent kernel takes at least this many rows an SM (two waves of the unified grid)."""
PERSISTENT_MAX_KEYS = {"H200": 65536, "H100": 1536}
"""... and at most this many keys a program, by GPU (a word of the live GPU's name; the interpreter's pretend GPU
takes the H200's, another GPU the smallest): where it was measured faster."""


def choose_auto(B: int, H_q: int, H_kv: int, D: int, dtype, L_cap: int, lengths=None,
                paged: int = 0) -> tuple[str, int]:
    """(kernel, splits) of ``method="auto"`` for B sequences of host ``lengths`` (None: every one L_cap long),
    H_q query and H_kv KV heads of dim D, elements of ``dtype``, a contiguous cache or pages of ``paged`` keys: the
    first of the module doc's five steps that holds; ``"longest_first"`` is the unified kernel at one split with
    the sequences launched longest first (:func:`fdlib.plan.longest_first_order`)."""
    if runtime.INTERPRET:
        splits = choose_splits(B, H_q, H_kv, D, dtype, L_cap, lengths, paged)
        return choose_kernel(B, H_kv, L_cap, splits, paged), splits
    unified = _explain(B, H_q, H_kv, D, dtype, L_cap, lengths, "unified", paged)
    if lengths is not None:
        if longest_first_suits(B, H_kv, D, dtype, lengths, paged, unified.calibration, unified.programs_per_sm):
            return "longest_first", 1
        if streamk_suits(B, H_kv, D, dtype, lengths, paged):
            return "streamk", 1
    # over pages auto_path reads the unified explanation only: the two-stage one is not computed
    split = None if paged else _explain(B, H_q, H_kv, D, dtype, L_cap, lengths, "split", paged)
    kernel, splits = auto_path(unified, split, H_q // H_kv, D, paged)
    return (kernel if kernel == "split" else choose_kernel(B, H_kv, L_cap, splits, paged)), splits


def choose_splits(B: int, H_q: int, H_kv: int, D: int, dtype, L_cap: int, lengths=None, paged: int = 0) -> int:
    """s*: the unified kernel's best split count by the cost model, for the tiles of a contiguous cache or of pages
    (``paged``); in the interpreter :func:`simple_rule`'s."""
    if runtime.INTERPRET:
        block_n = tile_config(D, L_cap, dtype.itemsize, rows=B * H_kv, paged=paged).BLOCK_N
        return simple_rule(B, H_kv, L_cap, INTERPRETER_SMS, block_n)
    return _explain(B, H_q, H_kv, D, dtype, L_cap, lengths, "unified", paged).chosen


def simple_rule(B: int, H_kv: int, L: int, sms: int, block_n: int) -> int:
    """splits = ⌈2·SMs / (B·H_kv)⌉, at most one split per tile and at most MAX_SPLITS."""
    want = cdiv(2 * sms, max(B * H_kv, 1))
    return max(1, min(want, cdiv(max(L, 1), block_n), MAX_SPLITS))


def longest_first_suits(B: int, H_kv: int, D: int, dtype, lengths, paged: int, cal, per_sm: int) -> bool:
    """Whether auto runs a ragged batch over pages as whole rows launched longest first: at most
    LONGEST_FIRST_MAX_BATCH sequences (the order sorts them in every program), fewer than STREAMK_PAGED_DENSE_TILES
    tiles a stream-K program, the longest row read by one program at its rate ρ no slower than the whole batch at
    the bandwidth BW (``cal``, the cost model's calibration; a longer row is the makespan whatever the order), and
    the greedy schedule of :func:`longest_first_imbalance` with ``per_sm`` programs an SM within
    LONGEST_FIRST_IMBALANCE of balance."""
    from .kernels.unified import LONGEST_FIRST_MAX_BATCH
    if not paged or B > LONGEST_FIRST_MAX_BATCH or len(set(lengths)) < 2:
        return False
    if streamk_tiles_per_program(H_kv, D, dtype, lengths, paged) >= STREAMK_PAGED_DENSE_TILES:
        return False
    if max(lengths) / cal.rho_tbs > H_kv * sum(lengths) / cal.bw_tbs:   # bytes per key cancel
        return False
    block_n = tile_config(D, max(lengths), dtype.itemsize, rows=B * H_kv, paged=paged).BLOCK_N
    return longest_first_imbalance(H_kv, lengths, block_n, sm_count(), per_sm) <= LONGEST_FIRST_IMBALANCE


def longest_first_imbalance(H_kv: int, lengths, block_n: int, sms: int, per_sm: int = 1) -> float:
    """The busiest SM's load over the mean when the B·H_kv rows of max(1, ⌈L/N⌉) tiles are launched longest first
    on ``sms`` SMs of ``per_sm`` program slots: the first sms·per_sm rows fill every slot at once, SM by SM in turn
    (row i on SM i mod sms), then each next row goes to the SM that has streamed least so far (greedy list
    scheduling: the hardware gives the next program to an SM whose program ended; an SM's programs share its
    bandwidth, so its load is the sum of its rows' tiles)."""
    import heapq
    tiles = sorted((max(1, -(-int(L) // block_n)) for L in lengths), reverse=True)
    rows = [t for t in tiles for _ in range(H_kv)]
    sms = max(1, sms)
    loads = [0] * sms
    first = min(len(rows), sms * max(1, per_sm))
    for i, t in enumerate(rows[:first]):
        loads[i % sms] += t
    heapq.heapify(loads)
    for t in rows[first:]:
        heapq.heapreplace(loads, loads[0] + t)
    return max(loads) * sms / sum(rows)


def order_hint(B: int, L_max: int, lengths=None) -> list[int]:
    """The longest-first order of host ``lengths`` (clamped to 0..L_max; ties: the lower b first), place → b, or b
    order without them: the order a longest-first plan keeps for its kernel to check against each call's lengths
    before it sorts them (:func:`fdlib.kernels.tile.longest_first`), and the order the model timeline launches
    (:func:`fdlib.course.timeline.model_timeline`). Decode steps, where every length grows by one, keep it."""
    if lengths is None:
        return list(range(B))
    return sorted(range(B), key=lambda b: (-min(max(lengths[b], 0), L_max), b))


def streamk_suits(B: int, H_kv: int, D: int, dtype, lengths, paged: int = 0) -> bool:
    """Whether auto takes the stream-K kernel for host ``lengths``: the sequences it takes without them (2 to
    MAX_BATCH, :func:`streamk_batch`), and
    on a contiguous cache ragged rows averaging more than STREAMK_MAX_MEAN keys or at least a row (b, h_kv) per SM;
    over pages, programs that stream at least STREAMK_PAGED_MIN_TILES tiles each (ragged rows) or
    STREAMK_PAGED_DENSE_TILES (equal rows; :func:`streamk_tiles_per_program`)."""
    if not streamk_batch(B):
        return False
    ragged = len(set(lengths)) > 1
    if paged:
        need = STREAMK_PAGED_MIN_TILES if ragged else STREAMK_PAGED_DENSE_TILES
        return streamk_tiles_per_program(H_kv, D, dtype, lengths, paged) >= need
    return ragged and (sum(lengths) > STREAMK_MAX_MEAN * len(lengths) or B * H_kv >= sm_count())


def streamk_batch(B: int) -> bool:
    """Whether stream-K takes a batch of B sequences: 2 to :data:`fdlib.kernels.streamk.MAX_BATCH` (it balances the
    tiles of several sequences, and keeps their lengths in registers), with host lengths (:func:`streamk_suits`)
    or without (:func:`fdlib.plan.device_schedule_suits`). The host rule asked for 8 until an H100 run found it
    won under 1% on the only benchmarked batches it decided (B=4 32:32 L=131072 over pages, equal rows:
    ``results/notes/chooser.md``)."""
    from .kernels.streamk import MAX_BATCH
    return 2 <= B <= MAX_BATCH


def streamk_tiles_per_program(H_kv: int, D: int, dtype, lengths, paged: int) -> float:
    """The K/V tiles a stream-K program streams on ``lengths``: H_kv·Σ_b max(1, ⌈L_b/N⌉) over its programs
    (:func:`fdlib.kernels.streamk.streamk_programs`), N its tile's keys."""
    from .kernels.config import persistent_config
    from .kernels.streamk import streamk_programs
    n = persistent_config(D, dtype.itemsize, paged=paged).BLOCK_N
    tiles = H_kv * sum(max(1, -(-int(L) // n)) for L in lengths)
    return tiles / streamk_programs(H_kv, sm_count(), persistent_per_sm())


def auto_path(unified, two_stage, group: int, D: int, paged: int = 0) -> tuple[str, int]:
    """("unified" or "split", splits) from the cost model's two explanations (:func:`fdlib.costmodel.explain`,
    ``method="unified"`` and ``"split"``): the two-stage path at its own s* where predicted more than 2% faster;
    else at the unified s* where the unified epilogue would merge s*·group·(D+1) >= EPILOGUE_WORK values or
    s* >= TWO_STAGE_SPLITS splits; else the unified kernel. Over pages (``two_stage`` None, not read) the unified
    kernel up to PAGED_EPILOGUE_WORK merged values, the two-stage path beyond."""
    s = unified.chosen
    if paged:
        return ("split" if s * group * (D + 1) > PAGED_EPILOGUE_WORK else "unified"), s
    if min(c.time_us for c in two_stage.candidates) < min(c.time_us for c in unified.candidates) / 1.02:
        return "split", two_stage.chosen
    return ("split" if s * group * (D + 1) >= EPILOGUE_WORK or s >= TWO_STAGE_SPLITS else "unified"), s


def choose_kernel(B: int, H_kv: int, L_cap: int, splits: int, paged: int = 0) -> str:
    """``"persistent"`` where every row is one split, a contiguous cache, at least PERSISTENT_MIN_WAVES·SMs rows
    (B·H_kv), and each program has at most :func:`persistent_max_keys` keys (rows·L_cap / (SMs·programs an SM));
    else ``"unified"``. The plain grid starts one program a row, each paying its start-up at the same moment as
    its neighbours on the SM; the persistent kernel pays it once a program: it matters while rows are short.
    Over pages the persistent kernel was slower at every count of programs an SM tried."""
    rows, sms = B * H_kv, sm_count()
    if paged or splits != 1 or rows < PERSISTENT_MIN_WAVES * sms:
        return "unified"
    return "persistent" if rows * L_cap / (sms * persistent_per_sm()) <= persistent_max_keys() else "unified"


def one_wave_suits(B: int, H_kv: int, D: int, dtype, lengths, paged: int, q_len: int = 1, sms: int | None = None,
                   compiled: bool | None = None) -> bool:
    """Whether a one-split unified plan takes :data:`~fdlib.kernels.config.ONE_WAVE_TILE` (16-key tiles, 2 warps,
    ONE_WAVE_PER_SM programs an SM) in place of its 64-key tiles: on a GPU, over pages of at least
    TABLE_AHEAD_PAGE keys, one query token, D = 128 at 2 bytes an element, host lengths all equal to some
    L <= ONE_WAVE_MAX_KEYS, and B·H_kv rows that make 1 to ONE_WAVE_WAVES waves of the ONE_WAVE_PER_SM·SMs programs
    the GPU holds at once, to the nearest wave."""
    from .kernels.tile import TABLE_AHEAD_PAGE
    compiled = not runtime.INTERPRET if compiled is None else compiled
    if not compiled or paged < TABLE_AHEAD_PAGE.value or q_len != 1 or D != 128 or dtype.itemsize != 2:
        return False
    lengths = [] if lengths is None else [int(x) for x in lengths]   # host ints (a list, a tuple, a CPU tensor)
    if len(set(lengths)) != 1 or lengths[0] > ONE_WAVE_MAX_KEYS:
        return False
    waves = B * H_kv / (ONE_WAVE_PER_SM * (sm_count() if sms is None else sms))
    return 1 <= int(waves + 0.5) <= ONE_WAVE_WAVES


def persistent_max_keys() -> int:
    """PERSISTENT_MAX_KEYS of the GPU the choices plan for (see there)."""
    if runtime.INTERPRET:
        return PERSISTENT_MAX_KEYS["H200"]
    from .gpus import live_gpu
    words = live_gpu().name.split()
    return next((keys for gpu, keys in PERSISTENT_MAX_KEYS.items() if gpu in words), min(PERSISTENT_MAX_KEYS.values()))


def sm_count() -> int:
    """SMs the choices plan for: the live GPU's (:func:`fdlib.gpus.sm_count`), or INTERPRETER_SMS in the
    interpreter, which has no SMs to fill while the persistent kernel's program count still needs a number."""
    if runtime.INTERPRET:
        return INTERPRETER_SMS
    from .gpus import sm_count as live_sms
    return live_sms()


def persistent_per_sm() -> int:
    """Programs per SM the persistent kernel launches: PERSISTENT_PER_SM on a GPU, 1 in the interpreter."""
    from .kernels.config import PERSISTENT_PER_SM
    return 1 if runtime.INTERPRET else PERSISTENT_PER_SM


def _explain(B, H_q, H_kv, D, dtype, L_cap, lengths, method, paged=0):
    """The cost model's explanation for the live GPU (compiled kernel's resources when known), with the tiles of
    a contiguous cache or of pages (``paged``)."""
    import torch

    from . import calibration, costmodel
    from .gpus import live_gpu
    from .kernels.unified import compiled_resources
    from .quant import scale_bytes   # an 8-bit cache's format (fdlib.quant.KVQuant) reads its scales too
    gpu = live_gpu()
    block_n = tile_config(D, L_cap, dtype.itemsize, rows=B * H_kv, paged=paged).BLOCK_N
    lengths = tuple(lengths) if lengths is not None else (L_cap,) * B
    cal = None
    if torch.cuda.is_current_stream_capturing():   # never calibrate (launch timing kernels) inside a capture
        cal = calibration.calibration_cached(gpu) or costmodel.default_calibration(gpu)
    return costmodel.explain(B, H_q, H_kv, lengths, D, dtype.itemsize, gpu, method, cal=cal,
                             compiled=compiled_resources(dtype, D, H_q // H_kv, block_n), paged=paged,
                             scale_bytes=scale_bytes(dtype))
