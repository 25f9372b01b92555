"""auto's choices for ragged host lengths (fdlib.splits), and the budget of method="balanced"
(fdlib.schedule.balance_gain): the list-scheduling model it rests on, and its verdicts on batches whose answer is
clear."""
from __future__ import annotations

import pytest
import torch

from fdlib import costmodel, schedule, splits


def test_makespan_is_list_scheduling():
    assert schedule.makespan([], 4) == 0.0
    assert schedule.makespan([5.0], 4) == 5.0
    assert schedule.makespan([3.0, 3.0, 3.0, 3.0], 2) == 6.0
    assert schedule.makespan([10.0, 1.0, 1.0, 1.0], 2) == 10.0     # the long piece sets the end
    assert schedule.makespan([1.0, 1.0, 1.0, 10.0], 2) == 11.0     # ... later when it starts late


def best_gain(lengths, H_kv, L_cap, s):
    return min(schedule.balance_gain(lengths, H_kv, 128, torch.float16, L_cap, s, b)
               for b in schedule.balanced_candidates(len(lengths), H_kv, s))


def pretend_interpreter_gpu(monkeypatch):
    """The model's verdicts below are for the interpreter's pretend GPU of INTERPRETER_SMS SMs, on any machine
    (on an H200 its 132 SMs change the budgets and the gains)."""
    monkeypatch.setattr(splits, "sm_count", lambda: splits.INTERPRETER_SMS)


def test_equal_lengths_gain_nothing(monkeypatch):
    pretend_interpreter_gpu(monkeypatch)
    assert best_gain([4096] * 16, 1, 4096, 1) >= 0.99


def test_one_long_row_among_short_ones_is_balanced(monkeypatch):
    """One KV head, so the long row is one program among few: the split schedule waits for it."""
    pretend_interpreter_gpu(monkeypatch)
    assert best_gain([64] * 31 + [32768], 1, 32768, 1) < 0.5


def test_too_many_items_cost_their_start_up(monkeypatch):
    """A budget far above what fills the SMs cuts rows into pieces whose start-ups the model counts."""
    pretend_interpreter_gpu(monkeypatch)
    lengths = [64] * 31 + [32768]
    fine = schedule.balance_gain(lengths, 1, 128, torch.float16, 32768, 1, 64)
    coarse = schedule.balance_gain(lengths, 1, 128, torch.float16, 32768, 1, 2)
    assert fine > coarse


def test_balanced_candidates(monkeypatch):
    pretend_interpreter_gpu(monkeypatch)
    sms = splits.sm_count()
    c = schedule.balanced_candidates(1, 1, 1)
    assert 1 in c and any(s >= 2 * sms for s in c) and c == sorted(c)
    assert schedule.balanced_candidates(1024, 8, 3) == [1, 2, 3, 4]


def pretend_h200(monkeypatch, chosen: int):
    """A compiled run on a GPU of 132 SMs whose cost model chooses ``chosen`` splits, at the same predicted time
    for the unified and two-stage paths."""
    from types import SimpleNamespace
    monkeypatch.setattr(splits.runtime, "INTERPRET", False)
    monkeypatch.setattr(splits, "sm_count", lambda: 132)
    monkeypatch.setattr(splits, "_explain",
                        lambda *a: SimpleNamespace(chosen=chosen, candidates=[SimpleNamespace(time_us=10.0)],
                                                   calibration=costmodel.H200_DEFAULT, programs_per_sm=3))


def test_large_epilogues_go_to_the_two_stage_path(monkeypatch):
    """On a GPU, auto leaves the unified kernel when its one-program merge would hold splits·group·(D+1) ≥
    EPILOGUE_WORK values or TWO_STAGE_SPLITS splits, even where the cost model calls the two equal; below both
    the model decides."""
    assert max(32 * 4 * 65, 24 * 1 * 257) < splits.EPILOGUE_WORK and splits.TWO_STAGE_SPLITS == 32
    for s, group, D, want in ((26, 8, 256, "split"), (16, 4, 128, "unified"), (40, 4, 64, "split"),
                              (32, 4, 64, "split"), (31, 4, 64, "unified"), (24, 1, 256, "unified")):
        pretend_h200(monkeypatch, s)
        kernel, got = splits.choose_auto(1, 8 * group, 8, D, torch.float16, 65536)
        assert (kernel, got) == (want, s), (s, group, D)


def test_balanced_method_picks_its_budget_from_the_model(monkeypatch):
    """On a GPU with host lengths, method='balanced' takes the candidate budget the schedule model predicts
    fastest; without lengths (or in the interpreter) the split count of the cost model."""
    pretend_h200(monkeypatch, 30)
    lengths = [64] * 31 + [32768]
    got = schedule.choose_balanced(32, 32, 8, 128, torch.float16, 32768, lengths)
    gains = {b: schedule.balance_gain(lengths, 8, 128, torch.float16, 32768, 30, b)
             for b in schedule.balanced_candidates(32, 8, 30)}
    assert got == min(gains, key=gains.get)
    assert schedule.choose_balanced(32, 32, 8, 128, torch.float16, 32768, None) == 30


def test_streamk_suits_ragged_batches_of_long_rows_or_a_row_per_sm(monkeypatch):
    """auto's stream-K rule on a contiguous cache: ragged host lengths of 2 or more sequences (as without lengths), with
    rows averaging more than STREAMK_MAX_MEAN keys or at least one row (b, h_kv) per SM (the measured cases named in
    results/notes/chooser.md); equal rows never."""
    monkeypatch.setattr(splits, "sm_count", lambda: 132)

    def suits(B, H_kv, lengths):
        return splits.streamk_suits(B, H_kv, 128, torch.float16, lengths)
    short = [1 + (37 * i) % 2047 for i in range(128)]           # mean ~ 1024, ragged
    long = [8 * x for x in short]                                # mean ~ 8192
    assert suits(128, 8, short)                                  # 1024 rows
    assert suits(8, 32, short[:8])                               # 256 rows of short rows
    assert not suits(8, 8, short[:8])                            # 64 rows on 132 SMs: splits win
    assert suits(32, 8, [4096 + 1000 * i for i in range(32)])
    assert suits(128, 8, long)
    assert suits(8, 32, [4096 + 1000 * i for i in range(8)])        # 8 long rows
    assert suits(8, 8, [4096 + 1000 * i for i in range(8)])
    assert suits(4, 8, [4096 + 1000 * i for i in range(4)])         # fewer sequences too (as without lengths)
    assert suits(2, 8, [4096, 9000]) and not suits(1, 8, [9000])    # one sequence: its splits
    assert not suits(16, 8, short[:16])                          # short rows: 128 rows on 132 SMs
    assert suits(17, 8, short[:17])                              # 136 rows
    assert not suits(32, 4, short[:32])                          # many sequences, but short rows on 128 rows
    assert not suits(128, 8, [8192] * 128)                       # equal rows: the unified or persistent kernel


def _gpu_auto(monkeypatch, gain):
    """choose_auto on :func:`pretend_h200` at 4 splits, the unified kernel's, with the balanced schedule
    predicted at ``gain`` of the split schedule's time."""
    pretend_h200(monkeypatch, 4)
    monkeypatch.setattr(schedule, "best_balanced", lambda *a: (gain, 2))
    # whole rows longest first (tests/test_longest_first.py) would take some of these batches before this choice
    monkeypatch.setattr(splits, "LONGEST_FIRST_IMBALANCE", 0.0)


def test_auto_never_takes_the_balanced_kernel_whatever_its_model_predicts(monkeypatch):
    """The balanced kernel left auto (results/h100/kernel-grid/: never the fastest by more than 0.4%): with the
    balanced schedule predicted at 1% or at 200% of the split schedule's time, auto makes the same choices. Over
    pages a ragged batch too short for stream-K (fewer than STREAMK_PAGED_MIN_TILES tiles a program) takes the
    unified kernel; a contiguous cache takes stream-K; equal lengths follow the model."""
    ragged = [1 + (1499 * i) % 2047 for i in range(32)]
    monkeypatch.setattr(splits, "sm_count", lambda: 132)
    assert splits.streamk_suits(32, 8, 128, torch.float16, ragged)
    for gain in (0.01, 2.0):
        _gpu_auto(monkeypatch, gain)
        assert splits.streamk_tiles_per_program(8, 128, torch.float16, ragged, 16) < splits.STREAMK_PAGED_MIN_TILES
        assert splits.choose_auto(32, 32, 8, 128, torch.float16, 8192, ragged, paged=16)[0] == "unified"
        assert splits.choose_auto(32, 32, 8, 128, torch.float16, 8192, ragged) == ("streamk", 1)
        assert splits.choose_auto(8, 32, 8, 128, torch.float16, 8192, ragged[:8], paged=16)[0] == "unified"
        assert splits.choose_auto(8, 32, 8, 128, torch.float16, 8192, ragged[:8])[0] == "unified"
        assert splits.choose_auto(32, 32, 8, 128, torch.float16, 8192, [8192] * 32, paged=16)[0] == "unified"


def test_paged_ragged_batches_of_many_tiles_a_program_take_stream_k(monkeypatch):
    """Over pages, stream-K takes a ragged batch that suits it (:func:`streamk_suits`) once its programs stream
    at least STREAMK_PAGED_MIN_TILES tiles of 64 keys each (264 programs on 132 SMs), whatever the balanced
    model says; equal lengths from STREAMK_PAGED_DENSE_TILES tiles a program; below those counts the other rules
    decide."""
    _gpu_auto(monkeypatch, 0.01)
    long_rows = [1 + (5113 * i) % 16383 for i in range(32)]             # 8·Σ⌈L/64⌉ / 264 ≈ 122 tiles
    tiles = splits.streamk_tiles_per_program(8, 128, torch.float16, long_rows, 16)
    want = 8 * sum(max(1, -(-L // 64)) for L in long_rows) / 264
    assert tiles == pytest.approx(want) and tiles >= splits.STREAMK_PAGED_MIN_TILES
    assert splits.choose_auto(32, 32, 8, 128, torch.float16, 16384, long_rows, paged=16) == ("streamk", 1)
    assert splits.choose_auto(32, 32, 8, 128, torch.float16, 16384, long_rows) == ("streamk", 1)
    # the same rows at 32:32 stream four times the tiles a program; eight of them at 32:8, about 30: unified
    assert splits.choose_auto(32, 32, 32, 128, torch.float16, 16384, long_rows, paged=16) == ("streamk", 1)
    assert splits.streamk_tiles_per_program(8, 128, torch.float16, long_rows[:8], 16) < splits.STREAMK_PAGED_MIN_TILES
    assert splits.choose_auto(8, 32, 8, 128, torch.float16, 16384, long_rows[:8], paged=16)[0] == "unified"
    # equal lengths keep the unified kernel over pages up to 384 tiles a program (8·32·256/264 ≈ 248 here) ...
    assert splits.STREAMK_PAGED_DENSE_TILES == 384
    assert splits.choose_auto(32, 32, 8, 128, torch.float16, 16384, [16384] * 32, paged=16)[0] == "unified"
    # ... and take stream-K from there (8·32·512/264 ≈ 496 tiles), over pages only
    dense = [32768] * 32
    assert splits.streamk_tiles_per_program(8, 128, torch.float16, dense, 16) == pytest.approx(8 * 32 * 512 / 264)
    assert splits.choose_auto(32, 32, 8, 128, torch.float16, 32768, dense, paged=16) == ("streamk", 1)
    assert splits.choose_auto(32, 32, 8, 128, torch.float16, 32768, dense)[0] != "streamk"
    assert splits.choose_auto(32, 32, 8, 128, torch.float16, 32768, None, paged=16)[0] != "streamk"   # no host lengths


def test_tiles_over_pages_are_64_keys_from_pages_that_read_the_table_ahead():
    """A GPU launch over pages of at least TABLE_AHEAD_PAGE keys takes PAGED_BLOCK_N = 64-key tiles, where a long
    contiguous cache and smaller pages take 128; head dims above 128 keep their 32 either way; the row-walking
    kernels take 64 except on small pages (128); the interpreter's tiles do not change."""
    from fdlib.kernels.config import (INTERPRETER_CONFIG, PAGED_BLOCK_N, PERSISTENT_BLOCK_N, persistent_config,
                                      tile_config_for)
    from fdlib.kernels.tile import TABLE_AHEAD_PAGE
    assert TABLE_AHEAD_PAGE.value == 8 and PAGED_BLOCK_N == 64
    for rows in (8, 4096):
        assert tile_config_for(128, 1 << 20, compiled_mode=True, rows=rows).BLOCK_N == 128
        for page in (8, 16, 256):
            assert tile_config_for(128, 1 << 20, compiled_mode=True, rows=rows, paged=page).BLOCK_N == PAGED_BLOCK_N
        for page in (1, 4):
            assert tile_config_for(128, 1 << 20, compiled_mode=True, rows=rows, paged=page).BLOCK_N == 128
    assert tile_config_for(256, 1 << 20, compiled_mode=True, paged=16).BLOCK_N == 32
    assert tile_config_for(128, 1 << 20, compiled_mode=False, paged=16) == INTERPRETER_CONFIG
    assert persistent_config(128, 2, compiled_mode=True).BLOCK_N == PERSISTENT_BLOCK_N == 64
    assert persistent_config(128, 2, compiled_mode=True, paged=16).BLOCK_N == 64
    assert persistent_config(128, 2, compiled_mode=True, paged=4).BLOCK_N == 128


def test_over_pages_auto_keeps_the_unified_kernel_up_to_the_measured_epilogues(monkeypatch):
    """Over pages the two-stage path is taken only beyond PAGED_EPILOGUE_WORK merged values, even where the
    model predicts it faster; on a contiguous cache the model's 2% rule and EPILOGUE_WORK still decide."""
    from types import SimpleNamespace
    pretend_h200(monkeypatch, 48)
    fast_split = {"unified": 10.0, "split": 5.0}                         # the model: two-stage 2x faster
    monkeypatch.setattr(splits, "_explain", lambda *a: SimpleNamespace(
        chosen=48, candidates=[SimpleNamespace(time_us=fast_split[a[7]])]))
    assert splits.choose_auto(32, 32, 8, 128, torch.float16, 32768)[0] == "split"               # contiguous
    assert splits.choose_auto(32, 32, 8, 128, torch.float16, 32768, paged=16) == ("unified", 48)  # 24768
    assert 48 * 4 * 129 == splits.PAGED_EPILOGUE_WORK
    assert splits.choose_auto(32, 32, 8, 256, torch.float16, 32768, paged=16) == ("split", 48)    # 49344
    assert splits.choose_auto(8, 64, 8, 128, torch.float16, 32768, paged=16) == ("split", 48)     # group 8


def test_paged_plans_before_the_first_launch_match_later_ones():
    """Over pages, the cost model's programs an SM before the unified kernel has compiled (an estimate) equal the
    compiled kernel's (3 at 64-key tiles, D = 128: 138 registers, 71680 bytes of shared memory on the H200), so a
    plan made in a fresh process picks the splits a later one does; the contiguous estimate (2 an SM) took 16
    splits instead of 32 at B=1 32:8 L=131072 over pages."""
    from fdlib import costmodel
    from fdlib.gpus import resolve
    gpu = resolve("H200")
    cal = costmodel.default_calibration(gpu)
    compiled = {"num_warps": 4, "n_regs": 138, "shared": 71680}
    assert costmodel.kernel_programs_per_sm(gpu, 128, 2, 64, 4, 3, compiled) == 3
    assert costmodel.kernel_programs_per_sm(gpu, 128, 2, 64, 4, 3, paged=16) == 3
    assert costmodel.kernel_programs_per_sm(gpu, 128, 2, 64, 4, 3) == 2          # contiguous: unchanged
    differ = [(B, H_kv, L) for B in (1, 2, 4, 8, 16, 32, 64, 128) for H_kv in (1, 2, 8, 32)
              for L in (512, 2048, 8192, 32768, 131072)
              if costmodel.explain(B, 32, H_kv, L, 128, 2, gpu, cal=cal, paged=16).chosen
              != costmodel.explain(B, 32, H_kv, L, 128, 2, gpu, cal=cal, compiled=compiled, paged=16).chosen]
    assert differ == []
    assert costmodel.explain(1, 32, 8, 131072, 128, 2, gpu, cal=cal, paged=16).chosen == 32
    assert costmodel.explain(1, 32, 8, 131072, 128, 2, gpu, cal=cal).chosen == 16   # contiguous tiles: 128 keys


def test_one_wave_tiles_take_only_equal_short_rows_over_pages_that_fill_the_sms():
    """ONE_WAVE_TILE (16 keys, 2 warps, 8 programs an SM) is taken by a GPU plan of equal rows of at most 1024 keys
    over pages of >= TABLE_AHEAD_PAGE keys, one query token, D=128 in 2 bytes, with B·H_kv rows one or two waves of
    the programs the SMs hold at once (8·132 = 1056 on an H200), to the nearest wave: the shapes where it was
    measured faster."""
    from fdlib.kernels.config import ONE_WAVE_PER_SM
    h200 = dict(sms=132, compiled=True)
    f16, eq = torch.float16, (lambda B, L: [L] * B)
    assert ONE_WAVE_PER_SM * 132 == 1056
    assert splits.one_wave_suits(128, 8, 128, f16, eq(128, 1024), 16, **h200)          # 1024 rows, measured
    assert splits.one_wave_suits(128, 8, 128, f16, torch.full((128,), 1024), 16, **h200)   # a CPU tensor
    assert splits.one_wave_suits(32, 32, 128, torch.bfloat16, eq(32, 1024), 16, **h200)
    assert splits.one_wave_suits(64, 32, 128, f16, eq(64, 512), 256, **h200)            # 2048 rows
    assert splits.one_wave_suits(66, 8, 128, f16, eq(66, 1024), 16, **h200)             # 528 = 0.5 · 1056
    assert not splits.one_wave_suits(65, 8, 128, f16, eq(65, 1024), 16, **h200)         # 520 rows: too few
    assert splits.one_wave_suits(82, 32, 128, f16, eq(82, 1024), 16, **h200)            # 2624 rows: 2.48 waves
    assert not splits.one_wave_suits(83, 32, 128, f16, eq(83, 1024), 16, **h200)       # 2656 rows: 2.52 waves
    assert not splits.one_wave_suits(128, 32, 128, f16, eq(128, 1024), 16, **h200)      # 4096 rows: equal there
    assert not splits.one_wave_suits(128, 8, 128, f16, eq(127, 1024) + [1023], 16, **h200)   # ragged
    assert not splits.one_wave_suits(128, 8, 128, f16, eq(128, 2048), 16, **h200)       # long rows
    assert splits.one_wave_suits(128, 8, 128, f16, eq(128, 256), 16, **h200)            # shorter rows too
    assert not splits.one_wave_suits(128, 8, 128, f16, eq(128, 1024), 0, **h200)        # contiguous
    assert not splits.one_wave_suits(128, 8, 128, f16, eq(128, 1024), 4, **h200)        # small pages
    assert not splits.one_wave_suits(128, 8, 128, f16, None, 16, **h200)                # no host lengths
    assert not splits.one_wave_suits(128, 8, 128, f16, [], 16, **h200)
    assert not splits.one_wave_suits(128, 8, 128, f16, eq(128, 1024), 16, q_len=2, **h200)
    assert not splits.one_wave_suits(128, 8, 64, f16, eq(128, 1024), 16, **h200)
    assert not splits.one_wave_suits(128, 8, 128, torch.float32, eq(128, 1024), 16, **h200)
    assert not splits.one_wave_suits(128, 8, 128, f16, eq(128, 1024), 16, sms=132, compiled=False)


def test_auto_plans_equal_short_rows_over_pages_at_one_wave_tiles(monkeypatch):
    """Where one_wave_suits holds, auto's one-split unified plan takes ONE_WAVE_TILE and a chunk of whole 16-key
    tiles; method="unified", a longest-first plan and a plan the rule does not suit keep the usual tiles."""
    import sys
    from fdlib.kernels.config import ONE_WAVE_TILE
    plan_module = sys.modules["fdlib.plan"]
    asked = []
    monkeypatch.setattr(plan_module, "one_wave_suits", lambda *a: asked.append(a) or True)
    lens = [40] * 16
    d = plan_module.decide(16, 8, 2, 128, 64, torch.float16, lengths=lens, paged=16)
    assert (d.kernel, d.splits, d.tile, d.chunk) == ("unified", 1, ONE_WAVE_TILE, 48)
    assert asked[-1] == (16, 2, 128, torch.float16, lens, 16, 1)
    assert plan_module.decide(16, 8, 2, 128, 64, torch.float16, lengths=lens, paged=16, method="unified").tile \
        != ONE_WAVE_TILE
    assert plan_module.decide(16, 8, 2, 128, 64, torch.float16, lengths=lens, paged=16, method="unified",
                              longest_first=True).tile != ONE_WAVE_TILE
    monkeypatch.setattr(plan_module, "one_wave_suits", lambda *a: False)
    assert plan_module.decide(16, 8, 2, 128, 64, torch.float16, lengths=lens, paged=16).tile != ONE_WAVE_TILE
