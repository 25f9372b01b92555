r"""Checks for Lab 05: the adaptive unified kernel.

* ``lab05.predict_time(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r) -> (time_us, splits_used)``:
  the cost model's predicted time of one unified decode step that asks for ``splits`` splits
  (:func:`fdlib.costmodel.predict` with ``method="unified"``):

  .. math::
      T = t_{\text{launch}} + \frac{P}{r\cdot\text{SMs}}\,t_{\text{wave}}
          + \operatorname{smax}\!\Big(\frac{\text{bytes}_\text{kv}}{BW},\
                                      W\,n\,\frac{\text{bytes}_\text{prog}}{\rho}\Big)
          + [\text{splits}>1]\,(t_{\text{merge}} + \text{splits}\cdot t_{\text{split}}),\qquad
          \operatorname{smax}(x,y)=(x^4+y^4)^{1/4}

  with chunk and splits (the splits actually used) from :func:`fdlib.kernels.config.chunk_for`,
  P = Σ_b H_kv·max(1, ⌈L_b/chunk⌉) programs, W = ⌈P/(r·SMs)⌉ waves, n = 1 + (min(⌈P/SMs⌉, r) − 1)·γ the busiest
  SM's load (γ = :data:`fdlib.costmodel.SECOND_PROGRAM`; the library's :func:`fdlib.costmodel.sm_load`, equal
  for the r ≤ 2 of the lab's cases), bytes_prog = 2·chunk·D·elem bytes per program,
  bytes_kv = 2·Σ_b L_b·H_kv·D·elem bytes (MB and TB/s = MB/µs give µs).
* ``lab05.choose_splits(lengths, H_kv, D, dtype_bytes, gpu, cal, block_n, r, predict) -> int``: call
  ``predict`` (same signature as predict_time) for every count in :data:`fdlib.costmodel.CANDIDATES`; return the
  smallest *used* split count whose time is within 1% of the fastest (:func:`fdlib.costmodel.explain`).
* ``lab05.take_ticket(counter_ptr, n_splits) -> is_last``: a ``@triton.jit`` function with the contract of
  :func:`fdlib.kernels.tile.take_ticket`: one atomic add (acquire-release, gpu scope) per program; the program
  that draws ticket n_splits − 1 is last, resets the counter to 0 and returns True.

The cost-model checks compare with :mod:`fdlib.costmodel` and with the recorded H200 splits sweep
(``results/h200/sweep-fp16.json``). The ticket checks run in Triton's interpreter, where the programs of a launch
run one after another: they test who merges and the counter reset, but cannot show memory-ordering bugs.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import torch
import triton
import triton.language as tl

from fdlib import costmodel, runtime
from fdlib.calibration import calibration_for
from fdlib.gpus import PRESETS
from fdlib.kernels import unified
from fdlib.kernels.config import chunk_for, tile_config, tile_config_for
from fdlib.occupancy import schedule
from fdlib.reference import reference_attention

from .core import CheckFailure, LearnerError, assert_close, call, check_case, exercise_stub, randn, reference
from .triton_exercise import require_triton_function, triton_stub

PREDICT = "lab05.predict_time"
CHOOSE = "lab05.choose_splits"
TICKET = "lab05.take_ticket"

PREDICT_STUB = exercise_stub(PREDICT, '''
@exercise("lab05.predict_time")
def predict_time(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r):
    """Predicted µs of one unified decode step that asks for `splits` splits, and the split count it uses.

    lengths: the B sequence lengths (a list of ints); H_kv, D: KV heads and head dim; dtype_bytes: 2 for fp16;
    gpu: a fdlib.gpus.GPU (gpu.sms); cal: a fdlib.costmodel.Calibration (bw_tbs, rho_tbs, t_launch_us,
    t_wave_us, t_merge_us, t_split_us; TB/s = MB/µs); block_n: keys per tile; r: programs per SM.
    Returns (time_us, splits_used).
    """
    # TODO: chunk, used = fdlib.kernels.config.chunk_for(max(max(lengths), 1), splits, block_n)
    #       P programs, W = ceil(P / (r * SMs)) waves, n = 1 + (min(ceil(P / SMs), r) - 1) * gamma the busiest
    #       SM's load (gamma = fdlib.costmodel.SECOND_PROGRAM), bytes_kv/BW and W * n * bytes_prog/rho in µs, their
    #       smax, the start-up term, and the merge term when more than one split is used.
    todo("lab05.predict_time")
''')

CHOOSE_STUB = exercise_stub(CHOOSE, '''
@exercise("lab05.choose_splits")
def choose_splits(lengths, H_kv, D, dtype_bytes, gpu, cal, block_n, r, predict):
    """The split count to launch: call predict(lengths, H_kv, D, dtype_bytes, count, gpu, cal, block_n, r)
    -> (time_us, splits_used) for every count in fdlib.costmodel.CANDIDATES, and return the smallest
    splits_used whose time is within 1% of the fastest."""
    todo("lab05.choose_splits")
''')

TICKET_STUB = triton_stub(TICKET, '''
@exercise("lab05.take_ticket")
@triton.jit
def take_ticket(counter_ptr, n_splits):
    """Called once by every program of a row after it stored its partial. Returns is_last: True for exactly
    one program, the last of the row's n_splits programs to arrive; that one also sets the counter back to 0.

    counter_ptr: pointer to this row's int32 counter (0 before the first program arrives); n_splits: int32.
    """
    # TODO: take a ticket with one atomic read-modify-write on the counter (which memory ordering makes every
    #       partial stored before it visible to whoever arrives last?), decide from the old value whether this
    #       program is the last, and if it is, leave the counter ready for the next call.
    return n_splits < 0
''', require=require_triton_function)

SWEEP_FILE = Path(__file__).resolve().parents[3] / "results" / "h200" / "sweep-fp16.json"
SWEEP_TOLERANCE = 1.10


# ---------------------------------------------------------------------------------------------- cost model helpers
def model_inputs(lengths, H_kv, D=128, dtype_bytes=2, gpu="H200"):
    """(gpu, block_n, r) exactly as :func:`fdlib.costmodel.explain` derives them (no compiled kernel known)."""
    gpu = PRESETS[gpu] if isinstance(gpu, str) else gpu
    cfg = tile_config_for(D, max(list(lengths) + [1]), compiled_mode=True, elem_bytes=dtype_bytes,
                          rows=len(lengths) * H_kv)
    r = costmodel.kernel_programs_per_sm(gpu, D, dtype_bytes, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages)
    return gpu, cfg.BLOCK_N, r


def _model_terms(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r) -> dict:
    """The reference's terms of T(S), each in µs (and the counts behind them), for reports and diagnoses."""
    chunk, s = chunk_for(max(max(lengths), 1), splits, block_n)
    P = sum(H_kv * max(1, -(-L // chunk)) for L in lengths)
    W = schedule(P, r, gpu.sms).waves
    n = float(costmodel.sm_load(min(-(-P // gpu.sms), r)))
    t_bw = 2 * sum(lengths) * H_kv * D * dtype_bytes / 1e6 / cal.bw_tbs
    c_rho = 2 * chunk * D * dtype_bytes / 1e6 / cal.rho_tbs
    return {"chunk": chunk, "s": s, "P": P, "W": W, "n": n, "t_bw": t_bw, "c_rho": c_rho,
            "launch": cal.t_launch_us, "startup": P / (r * gpu.sms) * cal.t_wave_us, "t_prog": W * n * c_rho,
            "merge": cal.t_merge_us + s * cal.t_split_us if s > 1 else 0.0}


def _terms(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r) -> str:
    """The reference's terms, for mismatch reports."""
    m = _model_terms(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r)
    return (f"chunk={m['chunk']}, splits used={m['s']}, P={m['P']} programs, W={m['W']} wave(s), n={m['n']:g}; "
            f"terms: launch {m['launch']:.3g} + start-up {m['startup']:.3g} + smax(bytes_kv/BW={m['t_bw']:.4g}, "
            f"W·n·bytes_prog/ρ={m['t_prog']:.4g}) = {(m['t_bw'] ** 4 + m['t_prog'] ** 4) ** 0.25:.4g} + merge "
            f"{m['merge']:.3g} µs")


def _diagnosis(got_us, lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r) -> str:
    """What a wrong time most likely left out or counted wrong: the known mistakes whose time equals ``got_us``
    (each recomputed from the reference's terms with one term changed), or '' if none does."""
    m = _model_terms(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r)
    smax = (m["t_bw"] ** 4 + m["t_prog"] ** 4) ** 0.25
    ref = m["launch"] + m["startup"] + smax + m["merge"]
    slots = r * gpu.sms

    def stream(t_prog):
        return (m["t_bw"] ** 4 + t_prog ** 4) ** 0.25

    requested_merge = cal.t_merge_us + splits * cal.t_split_us if splits > 1 else 0.0
    mistakes = [
        (ref - m["merge"] + requested_merge,
         f"the merge term counts the {splits} splits you asked for; S in [S>1](t_merge + S·t_split) is the count "
         f"chunk_for returns, the splits used ({m['s']} here): use splits_used in both places"),
        (ref - m["merge"], "the merge term t_merge + S·t_split is missing (it applies whenever more than one split "
                           "is used)"),
        (ref - m["merge"] + (cal.t_merge_us + m["s"] * cal.t_split_us),
         "the merge term is added at one split too: it applies only when s > 1"),
        (ref - m["startup"], "the start-up term P/(r·SMs)·t_wave is missing"),
        (ref - smax + max(m["t_bw"], m["t_prog"]), "max(bytes_kv/BW, W·n·bytes_prog/ρ) where the formula has smax, (a⁴ + b⁴)^(1/4)"),
        (ref - smax + m["t_bw"], "the per-program limit W·n·bytes_prog/ρ is missing: only bytes_kv/BW streams"),
        (ref - smax + stream(m["P"] / slots * m["n"] * m["c_rho"]),
         "W = P/(r·SMs) without rounding up: a last wave with few programs still takes a whole program's time, "
         "W = ⌈P/(r·SMs)⌉"),
        (ref - smax + stream(m["W"] * m["c_rho"]), f"n is missing from W·n·bytes_prog/ρ (the busiest SM's load, {m['n']:g} "
                                                   f"here: n = 1 + (min(⌈P/SMs⌉, r) − 1)·γ)"),
        (ref - smax + stream(m["W"] * min(-(-m["P"] // gpu.sms), r) * m["c_rho"]),
         "n counts a second program on an SM as a whole one: it adds only γ = fdlib.costmodel.SECOND_PROGRAM"),
    ]
    # P without max(1, ·): a length-0 sequence launching no program changes P, and with it W, n and the start-up
    P0 = sum(H_kv * -(-L // m["chunk"]) for L in lengths)
    if P0 != m["P"]:
        W0 = schedule(max(P0, 1), r, gpu.sms).waves
        n0 = float(costmodel.sm_load(min(-(-P0 // gpu.sms), r)))
        mistakes.append((m["launch"] + P0 / slots * cal.t_wave_us + stream(W0 * n0 * m["c_rho"]) + m["merge"],
                         f"P = {m['P']} programs, not {P0}: a sequence of length 0 still launches one program (it "
                         f"writes O = 0, lse = −inf), so P = Σ_b H_kv·max(1, ⌈L_b / chunk⌉)"))
    hits = [why for t, why in mistakes
            if not math.isclose(t, ref, rel_tol=1e-9) and math.isclose(got_us, t, rel_tol=1e-6, abs_tol=1e-9)]
    return f" Likely cause: {hits[0]}." if hits else ""


def _as_prediction(got, what):
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise CheckFailure(f"{what}: expected a tuple (time_us, splits_used), got {type(got).__name__}"
                           + (f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""))
    t, s = got
    try:
        t = float(t)
    except (TypeError, ValueError):
        raise CheckFailure(f"{what}: time_us should be a number, got {type(t).__name__}") from None
    if isinstance(s, torch.Tensor) and s.numel() == 1:
        s = s.item()
    if not isinstance(s, int) and not (isinstance(s, float) and s.is_integer()):
        raise CheckFailure(f"{what}: splits_used should be an int, got {s!r}")
    return t, int(s)


def _compare_predictions(impl, lengths, H_kv, D=128, dtype_bytes=2, gpu="H200", cal=None, r=None,
                         splits=costmodel.CANDIDATES):
    gpu, block_n, r0 = model_inputs(lengths, H_kv, D, dtype_bytes, gpu)
    r = r0 if r is None else r
    cal = cal or calibration_for(gpu)
    for s in splits:
        ref = costmodel.predict(lengths, H_kv, D, dtype_bytes, s, gpu, cal, block_n, r, "unified")
        args = {"lengths": list(lengths), "H_kv": H_kv, "D": D, "dtype_bytes": dtype_bytes, "splits": s, "gpu": gpu,
                "cal": cal, "block_n": block_n, "r": r}
        what = (f"predict_time(B={len(lengths)}, H_kv={H_kv}, L={_short(lengths)}, D={D}, splits={s}) on {gpu.name} "
                f"(r={r}, block_n={block_n})")
        t, used = _as_prediction(call(impl, args), what)
        if used != ref.splits:
            raise CheckFailure(f"{what}: splits_used {used}, expected {ref.splits} "
                               f"(chunk_for caps the count and rounds chunks to whole tiles)")
        if not math.isclose(t, ref.time_us, rel_tol=1e-6, abs_tol=1e-9):
            raise CheckFailure(f"{what}: predicted {t:.4f} µs, expected {ref.time_us:.4f} µs "
                               f"({_terms(lengths, H_kv, D, dtype_bytes, s, gpu, cal, block_n, r)})."
                               + _diagnosis(t, lengths, H_kv, D, dtype_bytes, s, gpu, cal, block_n, r))


def _short(lengths):
    lengths = list(lengths)
    if len(set(lengths)) == 1:
        return str(lengths[0])
    return str(lengths if len(lengths) <= 6 else lengths[:6] + ["..."])


@lru_cache(maxsize=1)
def recorded_sweep() -> tuple:
    """((B, H_q, H_kv, L, D, {splits used: µs}), ...) from the committed H200 sweep, and its provenance line."""
    data = json.loads(SWEEP_FILE.read_text())
    rows = []
    for s in data["sweep"]:
        pts = {p["splits"]: p["us"] for p in s["points"] if p.get("us")}
        if pts:
            rows.append((s["B"], s["H_q"], s["H_kv"], s["L"], s["D"], pts))
    prov = data["provenance"]
    return tuple(rows), f"{prov['device']}, {prov['date_utc'][:10]}, command: {prov['command']}"


def _check_against_sweep(choose_fn, label):
    rows, prov = recorded_sweep()
    worst, n = [], 0
    for B, H_q, H_kv, L, D, pts in rows:
        s = choose_fn(B, H_kv, L, D)
        if s not in pts:
            continue
        n += 1
        ratio = pts[s] / min(pts.values())
        if ratio > SWEEP_TOLERANCE:
            best = min(pts, key=pts.get)
            worst.append(f"B={B} H={H_q}:{H_kv} L={L}: {label} {s} splits -> {pts[s]:.1f} µs, best was {best} "
                         f"splits at {pts[best]:.1f} µs ({ratio:.2f}×)")
    if n == 0:
        raise CheckFailure(f"{label}: none of its split counts was measured in the recorded sweep")
    if worst:
        raise CheckFailure(f"{len(worst)} of {n} recorded H200 shapes are more than {SWEEP_TOLERANCE - 1:.0%} slower "
                           f"than the best measured split count; e.g. " + "; ".join(worst[:3]))


def _choose_with(predict):
    """The reference choice rule around any predict function (for the predict_time sweep check)."""
    def choose(B, H_kv, L, D):
        lengths = [L] * B
        gpu, block_n, r = model_inputs(lengths, H_kv, D)
        cal = costmodel.H200_DEFAULT
        preds = []
        for s in costmodel.CANDIDATES:
            args = {"lengths": lengths, "H_kv": H_kv, "D": D, "dtype_bytes": 2, "splits": s, "gpu": gpu, "cal": cal,
                    "block_n": block_n, "r": r}
            preds.append(_as_prediction(call(predict, args), f"predict_time(B={B}, H_kv={H_kv}, L={L}, splits={s})"))
        best = min(t for t, _ in preds)
        return min(u for t, u in preds if t <= best * 1.01)
    return choose


# ---------------------------------------------------------------------------------------------- predict_time
@check_case(PREDICT, "one sequence, L=131072, H_kv=8 on the H200 preset: every candidate split count", points=2)
def _p_long(impl, gen):
    _compare_predictions(impl, [131072], 8)


@check_case(PREDICT, "short caches (L=512, 2048): splits capped by the tiles, chunks rounded to whole tiles")
def _p_short(impl, gen):
    _compare_predictions(impl, [512], 8)
    _compare_predictions(impl, [2048] * 2, 32)


@check_case(PREDICT, "wave quantisation: programs just above and below a full wave (W = ⌈P/(r·SMs)⌉)")
def _p_waves(impl, gen):
    # H_kv=33 rows, 8 splits -> 264 programs = 2 waves of 132 slots at r=1 exactly; 9 splits -> 297, 3 waves
    _compare_predictions(impl, [65536], 33, r=1, splits=(4, 8, 9, 12, 16))
    _compare_predictions(impl, [65536] * 3, 11, r=2, splits=(6, 8, 9, 10))


@check_case(PREDICT, "ragged batch (lengths 0, 7, 300, 4096, 100000): programs per sequence follow its length")
def _p_ragged(impl, gen):
    _compare_predictions(impl, [0, 7, 300, 4096, 100000], 8)
    _compare_predictions(impl, [5000, 1, 17000], 2, D=64)


@check_case(PREDICT, "other GPUs (A100, L4, RTX 4090) with their scaled calibrations; fp32 and D=256")
def _p_gpus(impl, gen):
    _compare_predictions(impl, [32768] * 2, 8, gpu="A100 SXM4 80GB")
    _compare_predictions(impl, [8192], 4, gpu="L4", dtype_bytes=4)
    _compare_predictions(impl, [20000] * 4, 2, gpu="RTX 4090", D=256)


@check_case(PREDICT, "the split count your model prefers runs within 10% of the best on the recorded H200 sweep")
def _p_sweep(impl, gen):
    _check_against_sweep(_choose_with(impl), "your model's choice")


# ---------------------------------------------------------------------------------------------- choose_splits
def _choose_call(impl, lengths, H_kv, D=128, dtype_bytes=2, gpu="H200", predict=None):
    gpu, block_n, r = model_inputs(lengths, H_kv, D, dtype_bytes, gpu)
    cal = calibration_for(gpu)
    if predict is None:
        predict = reference(PREDICT)
    args = {"lengths": list(lengths), "H_kv": H_kv, "D": D, "dtype_bytes": dtype_bytes, "gpu": gpu, "cal": cal,
            "block_n": block_n, "r": r, "predict": predict}
    got = call(impl, args)
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, float) and got.is_integer():
        got = int(got)
    if not isinstance(got, int) or isinstance(got, bool):
        raise CheckFailure(f"choose_splits should return an int, got {got!r}")
    return got, gpu, cal


def _choose_vs_model(impl, lengths, H_kv, H_q=32, D=128, dtype_bytes=2, gpu="H200"):
    got, g, cal = _choose_call(impl, lengths, H_kv, D, dtype_bytes, gpu)
    ex = costmodel.explain(len(lengths), max(H_q, H_kv), H_kv, list(lengths), D, dtype_bytes, g, cal=cal,
                           epilogue=False)
    if got != ex.chosen:
        times = {c.splits: c.time_us for c in ex.candidates}
        best = min(times.values())
        near = [s for s, t in times.items() if t <= best * 1.01]
        got_t = f"{times[got]:.2f} µs" if got in times else "not a split count the model can use"
        raise CheckFailure(f"B={len(lengths)}, H_kv={H_kv}, L={_short(lengths)}, D={D} on {g.name}: you chose {got} "
                           f"({got_t}), expected {ex.chosen}; fastest {best:.2f} µs, counts within 1% of it: {near}")


@check_case(CHOOSE, "same choice as fdlib.costmodel on the H200 preset: B 1..64, H_kv 1/8/32, L 256..131072", points=2)
def _c_grid(impl, gen):
    for B in (1, 2, 4, 16, 64):
        for H_kv in (1, 8, 32):
            for L in (256, 2048, 8192, 131072):
                _choose_vs_model(impl, [L] * B, H_kv)


@check_case(CHOOSE, "ragged batches (one long sequence among short ones, a zero-length sequence)")
def _c_ragged(impl, gen):
    _choose_vs_model(impl, [131072, 300, 300, 12], 8)
    _choose_vs_model(impl, [0, 4096], 4)
    lens = torch.randint(1, 60000, (9,), generator=gen).tolist()
    _choose_vs_model(impl, lens, 8)


@check_case(CHOOSE, "other GPU presets (A100, H100, L4, RTX 4090)")
def _c_gpus(impl, gen):
    for name in ("A100 SXM4 80GB", "H100 SXM", "L4", "RTX 4090"):
        for B, H_kv, L in ((1, 8, 65536), (2, 4, 8192), (8, 8, 2048)):
            _choose_vs_model(impl, [L] * B, H_kv, gpu=name)


@check_case(CHOOSE, "ties: the smallest split count within 1% of the fastest, as predict reports it used")
def _c_ties(impl, gen):
    def flat(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r):
        return 10.0, splits                          # every count equally fast: fewest splits wins

    got, *_ = _choose_call(impl, [4096], 8, predict=flat)
    if got != 1:
        raise CheckFailure(f"all split counts predicted equally fast: expected 1 (fewest splits), got {got}")

    def near(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r):
        return {1: 20.0, 2: 10.05, 3: 10.2}.get(splits, 10.0 + splits / 1000), splits

    got, *_ = _choose_call(impl, [4096], 8, predict=near)
    if got != 2:
        raise CheckFailure("predicted µs: 1 split 20.0, 2 splits 10.05, 4 splits 10.004 (fastest): expected 2 "
                           f"(the smallest count within 1% of the fastest), got {got}")

    def capped(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r):
        used = min(splits, 7)                        # e.g. only 7 tiles: asking for more still uses 7
        return 100.0 / used, used

    got, *_ = _choose_call(impl, [4096], 8, predict=capped)
    if got != 7:
        raise CheckFailure(f"predict reports at most 7 splits used (the fastest): expected 7, got {got}; return the "
                           f"split count predict says is used, not the count you asked for")


@check_case(CHOOSE, "your choices run within 10% of the best on the recorded H200 sweep")
def _c_sweep(impl, gen):
    def choose(B, H_kv, L, D):
        got, *_ = _choose_call(impl, [L] * B, H_kv, D)
        return got
    _check_against_sweep(choose, "your choice")


# ---------------------------------------------------------------------------------------------- take_ticket
@triton.jit
def _ticket_probe(COUNTERS, ROW_OF, N_OF, IS_LAST, TAKE_TICKET: tl.constexpr):
    """Program p belongs to row ROW_OF[p]; it takes a ticket and records whether it was last."""
    pid = tl.program_id(0)
    row = tl.load(ROW_OF + pid)
    n = tl.load(N_OF + row)
    last = TAKE_TICKET(COUNTERS + row, n)
    tl.store(IS_LAST + pid, tl.where(last, 1, 0))


def _probe(fn, counters, ns, gen):
    """Launch one program per ticket, rows interleaved in a random order; check who is last."""
    device = counters.device
    row_of = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(ns)])
    row_of = row_of[torch.randperm(len(row_of), generator=gen)].to(device)
    is_last = torch.full((len(row_of),), -1, dtype=torch.int32, device=device)
    n_of = torch.tensor(ns, dtype=torch.int32, device=device)
    try:
        _ticket_probe[(len(row_of),)](counters, row_of, n_of, is_last, TAKE_TICKET=fn)
    except Exception as e:  # noqa: BLE001
        raise LearnerError(f"running your take_ticket inside a kernel raised {type(e).__name__}: "
                           f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}") from e
    is_last, row_of = is_last.cpu(), row_of.cpu()
    for i, n in enumerate(ns):
        mine = (row_of == i).nonzero().flatten()
        lasts = mine[is_last[mine] == 1].tolist()
        arrival = mine.tolist()       # the interpreter runs the programs in launch order
        if len(lasts) != 1:
            raise CheckFailure(f"a row of {n} program(s): {len(lasts)} of them returned is_last=True, expected exactly "
                               f"one (the last to take a ticket: ticket == n_splits - 1)")
        if runtime.INTERPRET and lasts[0] != arrival[-1]:   # on a GPU the arrival order is unknown
            k = arrival.index(lasts[0]) + 1
            raise CheckFailure(f"a row of {n} programs: the {_ordinal(k)} program to arrive returned is_last=True, "
                               f"expected the {_ordinal(n)} (the last; the others' partials are not stored yet)")


def _ordinal(k):
    return f"{k}{'tsnrhtdd'[(k // 10 % 10 != 1) * (k % 10 < 4) * k % 10::4]}"


def _expect_zero(counters, when):
    c = counters.cpu()
    if bool((c != 0).any()):
        bad = c[c != 0].tolist()
        shown = f"values {bad}" if len(bad) <= 8 else f"the first 8 of {len(bad)} values: {bad[:8]}"
        raise CheckFailure(f"{when}: {len(bad)} ticket counter(s) are not back at 0 ({shown}); "
                           f"the last program must reset its row's counter for the next call")


@check_case(TICKET, "one launch: in each row exactly the last program to take a ticket is last (rows of 1, 2, 3, 5, 8)", points=2)
def _t_contract(impl, gen):
    counters = torch.zeros(5, dtype=torch.int32, device=runtime.DEVICE)
    _probe(impl, counters, [1, 2, 3, 5, 8], gen)
    _expect_zero(counters, "after the launch")


@check_case(TICKET, "back-to-back launches on the same counters: the reset makes the second launch right too")
def _t_back_to_back(impl, gen):
    counters = torch.zeros(4, dtype=torch.int32, device=runtime.DEVICE)
    for call_no in (1, 2, 3):
        try:
            _probe(impl, counters, [4, 2, 6, 3], gen)
        except CheckFailure as e:
            raise CheckFailure(f"launch {call_no} of 3: {e}") from None


def _unified(fn, gen, *, B, H_q, H_kv, D, L_max, lengths, splits, dtype=torch.float32, calls=1):
    """Run the real unified kernel with the learner's ticket; out/lse pre-filled with NaN; counters checked."""
    dev = runtime.DEVICE
    lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    cfg = tile_config(D, L_max, torch.tensor([], dtype=dtype).element_size(), rows=B * H_kv)
    chunk, n_splits = chunk_for(L_max, splits, cfg.BLOCK_N)
    scale = D ** -0.5
    counters = None
    try:
        for call_no in range(1, calls + 1):
            q = randn(gen, B, H_q, D, dtype=dtype).to(dev)
            if counters is None:      # the buffer run_unified uses (keyed by q's device)
                counters = unified.ticket_counters(B * H_kv, q.device)
                counters.zero_()
            k = randn(gen, B, L_max, H_kv, D, dtype=dtype).to(dev)
            v = randn(gen, B, L_max, H_kv, D, dtype=dtype).to(dev)
            out = torch.full_like(q, float("nan"))
            lse = torch.full((B, H_q), float("nan"), dtype=torch.float32, device=dev)
            try:
                unified.run_unified(q, k, v, lens, scale=scale, chunk=chunk, splits=n_splits, cfg=cfg, out=out,
                                    lse=lse, ticket_fn=fn)
            except Exception as e:  # noqa: BLE001
                raise LearnerError(f"the unified kernel with your take_ticket raised {type(e).__name__}: "
                                   f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}") from e
            ref_o, ref_lse = reference_attention(q, k, v, lens, scale)
            when = f"call {call_no} of {calls} ({n_splits} splits of {chunk} keys, lengths {lengths})"
            tol = 2e-5 if dtype == torch.float32 else 2e-3
            assert_close(out, ref_o, f"{when}: out", tol, tol)
            assert_close(lse, ref_lse, f"{when}: lse", 1e-4, 1e-5)
            _expect_zero(counters[:B * H_kv], f"after {when}")
    finally:
        if counters is not None:
            counters.zero_()   # never leave a broken counter behind for the next real call


@check_case(TICKET, "inside the unified kernel: ragged batch (lengths 100, 37, 0, 64, 1) vs float64 reference", points=2)
def _t_unified(impl, gen):
    _unified(impl, gen, B=5, H_q=4, H_kv=2, D=32, L_max=100, lengths=[100, 37, 0, 64, 1], splits=4)


@check_case(TICKET, "unified kernel, 3 calls back to back (new inputs each), GQA group 4, fp16: counters back at 0")
def _t_unified_repeat(impl, gen):
    _unified(impl, gen, B=2, H_q=8, H_kv=2, D=16, L_max=80, lengths=[80, 50], splits=5, dtype=torch.float16, calls=3)
