"""How many splits to cut each sequence into, and which kernel ``method="auto"`` runs.

* On a GPU every method asks the cost model (:mod:`fdlib.costmodel`), for the unified kernel, so that
  ``"split"`` and ``"unified"`` run the same splits and compare like with like.
* In the interpreter there are no SMs to fill: a simple rule (:func:`simple_rule`, enough programs for
  about two per SM, never more splits than tiles) on a pretend GPU of 8 SMs, which still makes lab-sized
  problems split.
"""
from __future__ import annotations

from . import runtime
from .kernels.config import MAX_SPLITS, ONE_WAVE_PER_SM, cdiv, tile_config

INTERPRETER_SMS = 8


def simple_rule(B: int, H_kv: int, L: int, sms: int, block_n: int) -> int:
    """splits = ⌈2·SMs / (B·H_kv)⌉, at most one split per tile and at most MAX_SPLITS."""
    want = cdiv(2 * sms, max(B * H_kv, 1))
    return max(1, min(want, cdiv(max(L, 1), block_n), MAX_SPLITS))


def choose_splits(B: int, H_q: int, H_kv: int, D: int, dtype, L_cap: int, lengths=None, paged: int = 0) -> int:
    """Splits (the same for the unified and two-stage methods, so that they compare like with like) for B
    sequences of ``lengths`` (host ints; None: every sequence counts as L_cap long), H_q query and H_kv KV
    heads of dim D, elements of ``dtype``: the unified kernel's best by the cost model, for the tiles of a
    contiguous cache or of pages (``paged``)."""
    block_n = tile_config(D, L_cap, dtype.itemsize, rows=B * H_kv, paged=paged).BLOCK_N
    if runtime.INTERPRET:
        return simple_rule(B, H_kv, L_cap, INTERPRETER_SMS, block_n)
    return _explain(B, H_q, H_kv, D, dtype, L_cap, lengths, "unified", paged).chosen


def choose_auto(B: int, H_q: int, H_kv: int, D: int, dtype, L_cap: int, lengths=None,
                paged: int = 0) -> tuple[str, int]:
    """(kernel, splits) of ``method="auto"``: the unified kernel or the two-stage path, whichever the cost
    model predicts faster at its own best split count (ties, within 2%, go to the unified kernel's single
    launch), except that the two-stage path takes every batch whose unified epilogue would merge
    splits·group·(D+1) ≥ EPILOGUE_WORK values in one program, or would merge TWO_STAGE_SPLITS splits or more
    (over pages: the unified kernel up to PAGED_EPILOGUE_WORK, :func:`auto_path`); ``"longest_first"`` for
    ragged host lengths over pages where :func:`longest_first_suits` (the unified kernel at one split with the
    sequences launched longest first, :func:`fdlib.plan.longest_first_order`); the stream-K kernel for
    ragged host lengths where :func:`streamk_suits` (over pages also where a program streams
    STREAMK_PAGED_MIN_TILES tiles or more,
    :func:`streamk_tiles_per_program`), and over pages for equal host lengths where a program streams
    STREAMK_PAGED_DENSE_TILES tiles or more; then the persistent kernel where :func:`choose_kernel` takes it at
    one split. The balanced kernel is not among them (``method="balanced"`` still runs it): on an H100, every
    kernel forced on 24 batches from host lengths (``results/h100/kernel-grid/``), it was never the fastest by
    more than 0.4%, and the unified kernel or stream-K came within 0.4% of the fastest on every batch. In the
    interpreter (no SMs, no timing): the unified kernel at :func:`simple_rule`'s splits."""
    if runtime.INTERPRET:
        splits = choose_splits(B, H_q, H_kv, D, dtype, L_cap, lengths, paged)
    else:
        unified = _explain(B, H_q, H_kv, D, dtype, L_cap, lengths, "unified", paged)
        # over pages auto_path reads the unified explanation only: the two-stage one is not computed
        split = None if paged else _explain(B, H_q, H_kv, D, dtype, L_cap, lengths, "split", paged)
        kernel, splits = auto_path(unified, split, H_q // H_kv, D, paged)
        ragged = lengths is not None and len(set(lengths)) > 1
        if ragged and paged and longest_first_suits(B, H_kv, D, dtype, lengths, paged, unified.calibration,
                                                           unified.programs_per_sm):
            return "longest_first", 1
        if lengths is not None and streamk_suits(B, H_kv, lengths):
            if ragged and not paged:
                return "streamk", 1
            if paged and streamk_tiles_per_program(H_kv, D, dtype, lengths, paged) >= (
                    STREAMK_PAGED_MIN_TILES if ragged else STREAMK_PAGED_DENSE_TILES):
                return "streamk", 1
        if kernel == "split":
            return kernel, splits
    from .kernels.config import chunk_for
    eff = chunk_for(L_cap, splits, tile_config(D, L_cap, dtype.itemsize, rows=B * H_kv, paged=paged).BLOCK_N)[1]
    return choose_kernel(B, H_kv, L_cap, eff, paged=paged), splits


def auto_path(unified, two_stage, group: int, D: int, paged: int = 0) -> tuple[str, int]:
    """("unified" or "split", splits): of the cost model's two explanations (:func:`fdlib.costmodel.explain`
    with ``method="unified"`` and ``"split"``), the two-stage path where it is predicted more than 2% faster
    at its own best count, or where the unified epilogue would merge splits·group·(D+1) >= EPILOGUE_WORK
    values in one program or TWO_STAGE_SPLITS splits or more (at the unified count); else the unified kernel
    (:func:`choose_auto`'s first step).
    Over pages (``paged``) the unified kernel up to PAGED_EPILOGUE_WORK merged values, the two-stage path
    beyond; ``two_stage`` is not read there (None)."""
    if paged:
        return ("split" if unified.chosen * group * (D + 1) > PAGED_EPILOGUE_WORK else "unified"), unified.chosen
    if min(c.time_us for c in two_stage.candidates) < min(c.time_us for c in unified.candidates) / 1.02:
        return "split", two_stage.chosen
    if unified.chosen * group * (D + 1) >= EPILOGUE_WORK or unified.chosen >= TWO_STAGE_SPLITS:
        return "split", unified.chosen
    return "unified", unified.chosen


# The unified kernel's last program merges splits × group rows of D+1 values alone on one SM, after everything
# else; stage 2 spreads that merge over B·H_q programs. Measured on the H200 (graph timings, same splits,
# results/h200/heads-sweep.json and bench-{float16,bfloat16}.json, 143 shapes): above 10^4 merged values the
# two-stage path was faster on every shape but one (by up to 1.9x: B=1, 16:2, D=256, L=8k, 26 splits), and
# the cost model's epilogue term, fitted at 32:8 and D=128, did not see it. With this rule auto's pick was
# within 1.02x of the faster of the two on 141 of the 143 shapes (8 misses before).
EPILOGUE_WORK = 10_000
# The merge's partials are read one split after another, so its time grows with the splits whatever the group and
# D. At 32 splits or more the two-stage path was faster on every shape of three H200 heads sweeps (d1ea4d5's,
# in the git history of results/h200/heads-sweep.json, heads-sweep-0db0230.json and heads-sweep-sat-ca67155.json;
# 13-21 shapes a run, 0.59-0.99x the unified kernel's time at the same count), among them one below
# EPILOGUE_WORK: B=1 16:4 D=64 L=65536, 32 splits, 8320 merged values, 0.952-0.957x. At 24 splits (B=1 16:16
# D=256 L=65536, 6168 values) the two were even (0.999x, 1.006x); below 24 the bench grids and sweeps have
# nothing faster through this rule than through EPILOGUE_WORK. With the rule (heads-sweep-1cd9273.json) auto
# takes stage 2 there: 22.5 µs, the unified kernel 23.7.
TWO_STAGE_SPLITS = 32
# Over pages the two-stage path took 0.986-1.836x the unified kernel's time at the same split counts, geometric
# mean 1.059, on the 50 shapes of the paged ragged grid (H200, fp16, pages of 16, 32:8 and 32:32, D=128, up to 48
# splits, so up to 48·4·129 = 24768 merged values; results/h200/ragged-fp16-page16-unified-split.json, 35787c5):
# never more than 1.4% faster, up to 1.84x slower (B=128 32:32 Zipf mean 1024). So over pages auto keeps the
# unified kernel up to the epilogues measured there, and the two-stage path beyond, where nothing was measured.
PAGED_EPILOGUE_WORK = 24_768

START_KEYS = 128     # a program's start-up (launch, q and lengths loads, pipeline fill), in keys of D=128 streamed


# Stream-K (fdlib.kernels.streamk) against auto's choice before this rule, same run: H200, fp16, D=128,
# contiguous caches, graph timings, the ragged grid (results/h200/ragged-fp16-e16cc5e.json). On the 10 ragged
# batches of mean <= 2048 keys and >= 1 row per SM, stream-K took 0.871x auto's time in geometric mean, faster
# on 9 (B=128 32:32 Zipf: 420.3 vs 618.5 µs, unified). Since its shares are per KV head and its rows are found
# within windows of 32 sequences (results/h200/ragged-fp16-20bb156.json, 2026-12-01), it also beats
# auto's unified and two-stage choices on every ragged batch of B >= 32 sequences, whatever the mean: B=32 32:8
# Zipf mean 8192 194.4 vs 233.1 µs (split), uniform 8192 242.1 vs 263.8 (unified), B=32 32:32 uniform 8192
# 1037.3 vs 1079.8; B=128 32:8 uniform 8192 1115.1 vs 1127.7. At B = 8 it does not: 32:32, uniform mean 8192
# 251.2 vs 243.9 µs and 32768 813.0 vs 766.2 (unified), Zipf 32768 689.7 vs 665.3; 32:8 within ±4% either
# way (with 16-length blocks; at 32, B = 8 streams as fast as the persistent kernel, fdlib.kernels.streamk
# MIN_BLOCK_B, and beat the unified kernel on ragged rows: 32:8 uniform mean 32768 233.6 vs 246.1 µs, 32:32
# uniform 8192 259.3 vs 273.0, results/h200/ab/ab-ragged-b8.json). Hence: many sequences (STREAMK_MIN_BATCH);
# long rows in a batch of at least STREAMK_MIN_LONG_BATCH (nothing smaller was measured); short rows on average
# with a row per SM.
STREAMK_MAX_MEAN = 2048
STREAMK_MIN_ROWS_PER_SM = 1
STREAMK_MIN_BATCH = 32
STREAMK_MIN_LONG_BATCH = 8


# Over pages (where fdlib.kernels.streamk branches once a row), H200, fp16, pages of 16 shuffled, graph timings, the
# paged ragged grid of ae0e1e9 (results/h200/ragged-fp16-page16-ae0e1e9.json): on the 23 ragged batches that suit
# stream-K where a program streams at least 40 tiles, it took 0.961-1.004x the time of the fastest of auto's
# choice then (unified or balanced), the unified and the balanced kernels (geometric mean 0.982; B=8 32:32 uniform
# mean 8192: 0.961, B=32 32:32 uniform mean 1024: 0.969); on the 8 below, 0.955-1.180x (B=8 32:32 uniform mean
# 1024, 20 tiles a program: 0.955; B=8 32:8 uniform mean 8192, 25 tiles: 1.067; Zipf, 13 tiles: 1.180).
STREAMK_PAGED_MIN_TILES = 40

# Equal lengths over pages, the same kernel and pages: stream-K's equal shares against the unified grid, whose rows
# of one length fill the SMs in waves. H200, fp16, D=128, graph timings, two calls (the paged grid of 0c7189a,
# results/h200/ragged-fp16-page16-0c7189a.json, and results/h200/ab/ab-paged-constant.json at 0c0368e, the same
# kernels), stream-K's time / the unified kernel's: where a program streams 496-2048 tiles of 64 keys, 0.953-0.997
# (B=32 32:32 rows of 8192 keys 0.953 and 0.957, B=128 32:8 8192 0.968 in both, B=8 32:32 32768 0.979 and 0.982);
# at 256 tiles 1.009 and 1.006 (B=128 32:32 rows of 1024 keys); at 4-128 tiles 0.994-1.263 (B=32 32:8 rows of 1024
# keys 1.263, B=128 32:8 1024 1.060 and 1.055, B=32 32:8 8192 1.043 and 1.042). Hence stream-K from halfway
# between 256 and 496 tiles a program. The grid of 9a7bfdb, which has the rule, again: 0.955-0.994 at 496-2048
# tiles, 1.004 at 256 (results/h200/ragged-fp16-page16.json).
STREAMK_PAGED_DENSE_TILES = 384


# Ragged batches over pages, whole rows launched longest first (the unified kernel at one split, ORDER_B:
# fdlib.kernels.tile.longest_first) against stream-K, H200, fp16, pages of 16, graph timings, the same lengths in
# one call (results/h200/ab/ab-lpt-{drawn,desc}.json, 8850a6e): with the rows sorted longest first, B=128 32:8
# uniform mean 1024 123.8 µs against stream-K's 134.4-140.0, B=32 32:32 uniform mean 1024 120.8 against
# 131.0-132.4; in the order drawn the unified kernel at one split took 139.9 and 143.0. Greedy longest-first list
# scheduling of whole rows finishes within a short row of perfect balance when there are many rows of bounded
# length, and saves stream-K's cut rows, merges and per-tile row search; one long row (Zipf mean 1024 at B=128: 8192
# keys) is the makespan itself (192.7 µs against stream-K's 90.4-106.2). Hence whole rows longest first where the
# greedy schedule of :func:`longest_first_imbalance` is within LONGEST_FIRST_IMBALANCE of perfect balance and a
# stream-K program would stream fewer than STREAMK_PAGED_DENSE_TILES tiles (above that, stream-K reads 95-98% of the
# ceiling on the paged grid). One program streams a row at its own rate ρ, so a row that alone takes longer than
# the whole batch at the bandwidth is the makespan whatever the order: the rule also asks that it does not. A second
# call (results/h200/ab/ab-lpt-rule.json, 68c1242, other draws of lengths) found two more limits. The first wave:
# the hardware fills every slot at once, so the longest rows start three to an SM (the paged unified kernel's
# programs an SM) whatever their lengths, and only the later rows go where work ran out; a model that handed out
# every row greedily called B=32 32:32 Zipf mean 1024 and 8192 balanced, and they took 114.2 and 814.8 µs against
# stream-K's 80.3 and 561.8 (the model below fills the first wave first and leaves both out). And the order's sort
# of B keys in every program: at B=512 32:8 uniform mean 1024 527.3 µs against stream-K's 504.1, where at B=128 it
# won on the same kind of batch (143.4 against 148.0; B=128 32:32 uniform 479.7 against 488.1, Zipf 468.8 against
# 482.9; B=32 32:32 uniform 103.4 against 111.8), so the rule stops at B=128
# (fdlib.kernels.unified.LONGEST_FIRST_MAX_BATCH).
LONGEST_FIRST_IMBALANCE = 1.05
LONGEST_FIRST_START_TILES = 1   # a row's start-up in the greedy model, in tiles


def order_hint(B: int, L_max: int, lengths=None) -> list[int]:
    """The longest-first order of host ``lengths`` (clamped to 0..L_max; ties: the lower b first), place → b, or b
    order without them: the order a longest-first plan keeps for its kernel to check against each call's lengths
    before it sorts them (:func:`fdlib.kernels.tile.longest_first`), and the order the model timeline launches
    (:func:`fdlib.course.timeline.model_timeline`). Decode steps, where every length grows by one, keep it."""
    if lengths is None:
        return list(range(B))
    return sorted(range(B), key=lambda b: (-min(max(lengths[b], 0), L_max), b))


def longest_first_imbalance(H_kv: int, lengths, block_n: int, sms: int, per_sm: int = 1) -> float:
    """The busiest SM's load over the mean when the B·H_kv rows, max(1, ⌈L/N⌉) + LONGEST_FIRST_START_TILES tiles
    each, are launched longest first on ``sms`` SMs of ``per_sm`` program slots: the first sms·per_sm rows fill
    every slot at once, SM by SM in turn (row i on SM i mod sms), then each next row goes to the SM that has
    streamed least so far (greedy list scheduling: the hardware gives the next program to an SM whose program
    ended; an SM's programs share its bandwidth, so its load is the sum of its rows' tiles)."""
    import heapq
    tiles = sorted((max(1, -(-int(L) // block_n)) + LONGEST_FIRST_START_TILES for L in lengths), reverse=True)
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


def longest_first_suits(B: int, H_kv: int, D: int, dtype, lengths, paged: int, cal, per_sm: int) -> bool:
    """Whether auto runs a ragged batch over pages as whole rows launched longest first (see above): at most
    LONGEST_FIRST_MAX_BATCH sequences, fewer than STREAMK_PAGED_DENSE_TILES tiles a stream-K program, the longest
    row read by one program at its rate ρ no slower than the whole batch at the bandwidth BW (``cal``, the cost
    model's calibration), and the greedy model with ``per_sm`` programs an SM within LONGEST_FIRST_IMBALANCE of
    balance."""
    from .kernels.unified import LONGEST_FIRST_MAX_BATCH
    if not paged or B > LONGEST_FIRST_MAX_BATCH or len(set(lengths)) < 2:
        return False
    if streamk_tiles_per_program(H_kv, D, dtype, lengths, paged) >= STREAMK_PAGED_DENSE_TILES:
        return False
    if max(lengths) / cal.rho_tbs > H_kv * sum(lengths) / cal.bw_tbs:   # bytes per key cancel
        return False
    block_n = tile_config(D, max(lengths), dtype.itemsize, rows=B * H_kv, paged=paged).BLOCK_N
    return longest_first_imbalance(H_kv, lengths, block_n, sm_count(), per_sm) <= LONGEST_FIRST_IMBALANCE


ONE_WAVE_MIN_ROWS, ONE_WAVE_MAX_ROWS = 0.75, 2.0   # B·H_kv, in programs the SMs hold at once at ONE_WAVE_TILE
ONE_WAVE_KEYS = (512, 1024)   # the row lengths measured


def one_wave_suits(B: int, H_kv: int, D: int, dtype, lengths, paged: int, q_len: int = 1, sms: int | None = None,
                   compiled: bool | None = None) -> bool:
    """Whether a one-split unified plan takes :data:`~fdlib.kernels.config.ONE_WAVE_TILE` (16-key tiles, 2 warps,
    8 programs an SM) in place of its 64-key tiles: on a GPU, over pages of at least TABLE_AHEAD_PAGE keys, one
    query token, D = 128 at 2 bytes an element, host lengths all equal to some L in ONE_WAVE_KEYS' range, and
    B·H_kv rows between ONE_WAVE_MIN_ROWS and ONE_WAVE_MAX_ROWS times the ONE_WAVE_PER_SM·SMs programs the GPU holds
    at once (about one or two whole waves). Those are the conditions under which it was measured faster
    (:data:`~fdlib.kernels.config.ONE_WAVE_TILE`); ragged rows, long rows and other sizes keep the 64-key tiles."""
    from .kernels.tile import TABLE_AHEAD_PAGE
    compiled = not runtime.INTERPRET if compiled is None else compiled
    if not compiled or paged < TABLE_AHEAD_PAGE.value or q_len != 1 or D != 128 or dtype.itemsize != 2:
        return False
    lengths = [] if lengths is None else [int(x) for x in lengths]   # host ints (a list, a tuple, a CPU tensor)
    if len(set(lengths)) != 1 or not ONE_WAVE_KEYS[0] <= lengths[0] <= ONE_WAVE_KEYS[1]:
        return False
    slots = ONE_WAVE_PER_SM * (sm_count() if sms is None else sms)
    return ONE_WAVE_MIN_ROWS * slots <= B * H_kv <= ONE_WAVE_MAX_ROWS * slots


def streamk_tiles_per_program(H_kv: int, D: int, dtype, lengths, paged: int) -> float:
    """The K/V tiles a stream-K program streams on ``lengths``: H_kv·Σ_b max(1, ⌈L_b/N⌉) over its programs
    (:func:`fdlib.kernels.streamk.streamk_programs`), N its tile's keys."""
    from .kernels.config import persistent_config
    from .kernels.streamk import streamk_programs
    n = persistent_config(D, dtype.itemsize, paged=paged).BLOCK_N
    tiles = H_kv * sum(max(1, -(-int(L) // n)) for L in lengths)
    return tiles / streamk_programs(H_kv, sm_count(), persistent_per_sm())


def streamk_suits(B: int, H_kv: int, lengths) -> bool:
    """Whether auto takes the stream-K kernel for a ragged batch with host ``lengths`` (contiguous cache): at
    least STREAMK_MIN_BATCH sequences; or rows averaging more than STREAMK_MAX_MEAN keys in a batch of at least
    STREAMK_MIN_LONG_BATCH; or shorter rows with at least STREAMK_MIN_ROWS_PER_SM rows (B·H_kv) per SM. Left
    out: small batches of short rows on few rows, where the split schedule's programs finish as soon (see the
    measurements above)."""
    from .kernels.streamk import MAX_BATCH
    if B > MAX_BATCH:
        return False
    if B >= STREAMK_MIN_BATCH:
        return True
    if sum(lengths) > STREAMK_MAX_MEAN * len(lengths):
        return B >= STREAMK_MIN_LONG_BATCH
    return B * H_kv >= STREAMK_MIN_ROWS_PER_SM * sm_count()


def choose_balanced(B: int, H_q: int, H_kv: int, D: int, dtype, L_cap: int, lengths=None,
                    paged: int = 0) -> int:
    """splits of ``method="balanced"`` (its budget is B·splits items per KV head): with host lengths on a GPU,
    the candidate of :func:`balanced_candidates` whose schedule :func:`balance_gain` predicts fastest, so that
    a batch with one long row is not cut into items of one or two tiles each paying a start-up; otherwise
    :func:`choose_splits`."""
    splits = choose_splits(B, H_q, H_kv, D, dtype, L_cap, lengths, paged)
    if runtime.INTERPRET or lengths is None:
        return splits
    return best_balanced(lengths, H_kv, D, dtype, L_cap, splits, paged)[1]


def balanced_candidates(B: int, H_kv: int, splits: int) -> list[int]:
    """splits the balanced kernel is tried at (its budget is P = B·splits items per KV head): the split
    schedule's, and 1, 2 and 4 times what makes P·H_kv programs two per SM. More items even out the SMs' loads;
    each also pays a start-up, which :func:`balance_gain` counts."""
    need = cdiv(2 * sm_count(), max(B * H_kv, 1))
    return sorted({splits, need, 2 * need, 4 * need} & set(range(1, MAX_SPLITS + 1)) or {1})


def makespan(pieces, sms: int) -> float:
    """Time to run ``pieces`` (costs, in launch order) on ``sms`` SMs when each SM takes the next piece as soon as
    it is free (the hardware's block scheduler, one program at a time per SM; co-resident programs share the
    SM's bandwidth, so this is the same finish time): list scheduling with a heap."""
    import heapq
    free = [0.0] * min(sms, len(pieces))
    for c in pieces:
        t = heapq.heappop(free)
        heapq.heappush(free, t + c)
    return max(free, default=0.0)


def balance_gain(lengths, H_kv: int, D: int, dtype, L_cap: int, splits: int, bal_splits: int,
                 paged: int = 0) -> float:
    """Predicted time(balanced) / time(split schedule) for host ``lengths``: every row cut into pieces of the
    split schedule's chunk (sized for the longest row, L_cap / splits), against the balanced schedule's
    near-equal items (:func:`fdlib.schedule.balanced` at a budget of B·bal_splits), each piece costing
    START_KEYS + its keys (scaled by D/128), for each of the H_kv heads, on the live GPU's SMs."""
    split_t, balanced_t = _schedule_times(lengths, H_kv, D, dtype, L_cap, splits, paged)
    return balanced_t(bal_splits) / split_t


def best_balanced(lengths, H_kv: int, D: int, dtype, L_cap: int, splits: int,
                  paged: int = 0) -> tuple[float, int]:
    """(gain, splits) of the :func:`balanced_candidates` budget whose :func:`balance_gain` is smallest; the
    split schedule's time is computed once for all candidates."""
    split_t, balanced_t = _schedule_times(lengths, H_kv, D, dtype, L_cap, splits, paged)
    return min((balanced_t(b) / split_t, b) for b in balanced_candidates(len(lengths), H_kv, splits))


def _schedule_times(lengths, H_kv: int, D: int, dtype, L_cap: int, splits: int, paged: int = 0):
    """(the split schedule's makespan, a function of bal_splits giving the balanced schedule's), in keys
    (:func:`balance_gain`)."""
    from .kernels.config import chunk_for
    from .schedule import items
    B = len(lengths)
    block_n = tile_config(D, L_cap, dtype.itemsize, rows=B * H_kv, paged=paged).BLOCK_N
    chunk = chunk_for(L_cap, splits, block_n)[0]
    start = START_KEYS * 128 / D
    sms = sm_count()
    split = [start + min(chunk, L - j * chunk) for L in lengths for j in range(max(1, cdiv(L, chunk)))]
    split_t = max(makespan(split * H_kv, sms), 1e-9)

    def balanced_t(bal_splits: int) -> float:
        bal = [start + (e - s) for _, s, e in items(lengths, B * bal_splits, block_n)]
        return makespan(bal * H_kv, sms)
    return split_t, balanced_t


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


PERSISTENT_MIN_WAVES = 2
PERSISTENT_MAX_KEYS = {"H200": 65536, "H100": 1536}
"""The most keys a persistent program streams for :func:`choose_kernel` to take it, by GPU (a word of the live GPU's
name: "NVIDIA H100 80GB HBM3"; the interpreter's pretend GPU takes the H200's, other GPUs, a GH200 among them, the
smallest): where it was measured faster."""


def persistent_max_keys() -> int:
    """PERSISTENT_MAX_KEYS of the GPU the choices plan for (see there)."""
    if runtime.INTERPRET:
        return PERSISTENT_MAX_KEYS["H200"]
    from .gpus import live_gpu
    name = live_gpu().name
    words = name.split()
    return next((keys for gpu, keys in PERSISTENT_MAX_KEYS.items() if gpu in words), min(PERSISTENT_MAX_KEYS.values()))


def sm_count() -> int:
    """SMs the choices here plan for: the live GPU's (:func:`fdlib.gpus.sm_count`, the one home of the SM count),
    or INTERPRETER_SMS in the interpreter. A thin wrapper kept for that pretend GPU: the interpreter has no SMs
    to fill, and the persistent kernel's program count and :func:`choose_kernel` still need a number."""
    if runtime.INTERPRET:
        return INTERPRETER_SMS
    from .gpus import sm_count as live_sms
    return live_sms()


def persistent_per_sm() -> int:
    """Programs per SM the persistent kernel launches: PERSISTENT_PER_SM on a GPU, 1 in the interpreter."""
    from .kernels.config import PERSISTENT_PER_SM
    return 1 if runtime.INTERPRET else PERSISTENT_PER_SM


def choose_kernel(B: int, H_kv: int, L_cap: int, splits: int, paged: int = 0) -> str:
    """The kernel ``method="auto"`` launches: ``"persistent"`` when every row is one split, there are at least
    PERSISTENT_MIN_WAVES·SMs rows (B·H_kv), and each of its programs has little work, at most
    :func:`persistent_max_keys` keys (rows·L_cap / (SMs·programs per SM)); else ``"unified"``.

    Why: with one split and many rows the plain grid starts one program per row, and each pays its start-up
    (launch, lengths and queries, pipeline fill and drain) at the same moment as its neighbours on the SM;
    the persistent kernel pays it once per program. That matters when rows are short and stops mattering when
    they are long. Measured on an H200 (the fp16 bench of 2026-11-30 14:20Z, graph timings, since replaced): B=64,
    H 32:8, L=512 41.8 µs unified, 36.3 persistent; B=16, 32:32, L=2048 127.7 vs 127.0; but B=64, 32:32,
    L=2048 (≈16k keys per program) 495.9 vs 531.4, and with 128 rows (one wave of the plain grid) B=16, 32:8,
    L=512 12.3 vs 15.6. In the run of 2026-11-30 18:34Z (results/h200/bench-float16.json of then, in the git
    history), on the shapes of two or more waves of rows, the persistent kernel took 0.827-0.972x the unified
    kernel's time where a program has at most 4096 keys (B=64, 32:8, L=512: 35.7 vs 43.2 µs) and 0.978-1.043x
    beyond (B=64, 32:32, L=2048: 514.2 vs 498.1), which is the rule above. In the run of 20:49Z (fp16 and bf16
    on two H200s) it took 0.825-0.981x up to 4096 keys and 0.966-1.051x beyond, where the runs disagree on
    which is faster (B=64, 32:32, L=2048: 0.978 and 0.966, persistent faster). The limit is 65536 keys since
    the runs of 2026-12-01: on every grid shape of two or more waves of rows (B·H_kv >= 264), which all have at most
    63550 keys a program, the persistent kernel took 0.815-1.001x the faster of the unified and two-stage paths
    at one split in the fp16 and bf16 grids of four runs (``bench-*.json`` of 2026-11-30 22:47Z, in the git
    history, and ``bench-*.json``, ``bench-*-d1ea4d5.json`` and ``bench-*-c1a57e1.json`` of 2026-12-01);
    ``results/h200/ab/ab-persistent.json`` has 0.969x at B=64, 32:32, L=2048 and 0.989x at B=64, 32:32, L=8192.
    One earlier run disagrees at the two shapes of 63550 keys: the fp16 grid of 2026-11-30 22:22Z (git history)
    had 1.062x at B=64, 32:8, L=32768 and 1.020x at B=64, 32:32, L=8192, in a run whose timings of one kernel
    varied by up to 9% on those 8.6 GB shapes. Beyond 65536 keys nothing was measured. An H100 differs
    (``results/h100/streamk-lean/persistent/``, contiguous equal rows, 32:8 and 32:32, the same run): the persistent
    kernel took 0.953x the unified kernel's time at 662 keys a program (B=64 32:8 rows of 512: 48.5 against 50.9 µs),
    0.998x at 1324, and 1.007-1.030x from 1986 to 10592 keys (B=128 32:32 rows of 1024: 695.3 against 675.0), as in
    ``results/h100/kernel-grid/ab-persistent-grid.md`` before it; hence its limit of 1536 keys, between. The
    persistent kernel's 64-key tiles fit three programs an SM, the unified kernel's 128-key tiles one
    (``results/h200/kernel-resources.json``: 74 against 136 KB of shared memory)."""
    if paged:
        # Not over pages: on the H200 (ragged run of 2026-11-30 15:45Z, pages of 16, every row 1024 keys), B=128
        # 32:8 took 199.7 µs through the persistent kernel against 127.7 µs for a contiguous cache. That kernel
        # looked the table up in each tile's iteration. Read a tile ahead, at its 64-key tiles, it is still slower
        # than the unified kernel over pages of 16, at 2 and at 3 programs an SM (results/h200/ab/ab-paged-per-sm.json,
        # constant rows: B=32 32:32 rows of 1024 keys 153.2 and 142.0 µs against 129.9; rows of 8192 keys 1169.7 and
        # 1075.1 against 1001.8; B=128 32:8 rows of 1024 keys 152.8 and 141.8 against 131.9). Again at 4599d31
        # (ab-paged-persistent-4599d31.json): B=128 32:8 rows of 1024 keys 140.0 and 136.7 against 130.5.
        return "unified"
    rows = B * H_kv
    sms = sm_count()
    keys_per_program = rows * L_cap / (sms * persistent_per_sm())
    if splits == 1 and rows >= PERSISTENT_MIN_WAVES * sms and keys_per_program <= persistent_max_keys():
        return "persistent"
    return "unified"
