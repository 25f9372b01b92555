r"""Per-SM timelines of a ragged decode batch: who runs where, and when, from the model or from the GPU.

A launch of P programs runs on S SMs with r slots each. The hardware block scheduler hands program i (in grid
order, the first grid axis fastest) to the first slot that is free; a program then pays a start-up, streams its
K/V slice, and, if it is the last of its row to finish, merges the row's partials. The **model timeline**
(:func:`model_timeline`) plays that out with the cost model's constants (:mod:`fdlib.costmodel`):

* start-up :math:`t_{\text{wave}}` per program (first loads, pipeline fill, the partial's store);
* streaming of :math:`c_i = 2\,n_i\,D\,\text{elem}` bytes for a program of :math:`n_i` keys of one KV head, all
  streaming programs sharing the GPU: each at rate :math:`\min(\rho,\ BW/n_{\text{streaming}})` (one program
  cannot go faster than ρ, all together not faster than BW);
* the merge of a row's :math:`n_b` partials by its last program, :math:`t_{\text{merge}} + n_b\,t_{\text{split}}
  \cdot \text{group}\,(D+1)/(4\cdot 129)` (the cost model's epilogue), or, for the two-stage path, a kernel boundary
  :math:`t_{\text{stage2}}` and the stage-2 merge after the last stage-1 program;
* programs that have no keys of their row (split :math:`j \ge n_b`, items past the work list) exit at once.

Four schedules (``schedule=``):

* ``"split"`` / ``"unified"``: every row cut into splits of ``chunk`` keys sized for the **longest** row, as
  :func:`fdlib.plan.decide` does on a GPU (splits from :func:`fdlib.costmodel.explain`); grid ``(B, H_kv, splits)``
  for stage 1, ``(H_kv, B, splits)`` for the unified kernel (the first axis the fastest in launch order);
* ``"longest-first"``: the unified kernel with its sequences launched longest first (``ORDER_B``,
  :func:`fdlib.kernels.tile.longest_first`), whole rows by default (``splits`` = 1, as ``auto`` runs it over
  pages), so the SMs take the longest rows first and the last programs to start are the shortest;
* ``"balanced"``: FlashInfer-style chunking (:func:`fdlib.schedule.balanced`, budget P = B·splits as the plan
  sets it); grid ``(P + B, H_kv)``;
* ``"stream-k"``: the schedule of ``method="streamk"`` (:mod:`fdlib.kernels.streamk`) as it launches: P =
  H_kv·P_h programs, P_h = ⌊PERSISTENT_PER_SM·SMs / H_kv⌋, on the persistent kernel's tiles (64 keys at D = 128,
  2 bytes), with the same streaming rate as the others; program p = q·H_kv + h owns tiles
  :math:`[\lfloor qT/P_h\rfloor, \lfloor (q+1)T/P_h\rfloor)` of head h's T tiles laid end to end over the
  sequences; a slice may span row boundaries; every row split between programs is merged by the program that
  finishes its last piece (the ticket). Each extra piece costs one more partial store (:math:`t_{\text{split}}`).

The **recorded timeline** (:func:`from_buffer`) reads what ``plan.run(..., timeline=buf)`` wrote on a GPU: one
row (SM id, start ns, end ns) per program (``tools/record_timeline.py`` saves them with provenance;
:func:`load_recorded` reads those files).

:func:`draw_gantt` draws either kind (one lane per slot of each SM, µs on the x axis; for a model timeline each
program's start-up, the slices of its sequences it streams and its merge; idle SM time and merges in colours of
their own). A chart of 132 SMs is unreadable, so the lessons draw a **pretend GPU** of a few SMs
(:func:`pretend_gpu`): an H200's SMs, per-program rate ρ and latencies, with the whole-GPU bandwidth cut in
proportion to the SMs. :attr:`Timeline.makespan` and :attr:`Timeline.idle_fraction` are the numbers to compare:
the time from the first program's start to the last one's end, and the share of SM time in it with no program of
the launch running on the SM.
"""
from __future__ import annotations

import re

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import costmodel, gpus
from ..costmodel import Calibration
from ..kernels.config import chunk_for, tile_config_for
from ..schedule import balanced
from ..splits import order_hint

SCHEDULES = ("split", "unified", "longest-first", "balanced", "stream-k")
SCHEMA = "fdlib.timeline/1"   # the format name in the recorded files (results/h200/timeline-*.json), not a module path
BATCH = dict(B=32, H_q=32, H_kv=8, D=128, dtype="float16")
"""Lab 06's ragged batch: B=32, H 32:8, D=128, fp16 (lengths from :func:`batch_lengths`)."""
MEANS = {"uniform": 16384, "zipf": 8192}
"""The default mean length of each of Lab 06's length mixes."""


def batch_lengths(dist: str = "uniform", seed: int = 0, B: int = 32, mean: int | None = None) -> list[int]:
    """Lengths of the lab's ragged batches (:func:`fdlib.bench.ragged.draw_lengths`): ``"uniform"`` in
    1..2·mean (default mean 16384: 1..32768), ``"zipf"`` Zipf-like (default mean 8192: most short, a few long)."""
    from ..bench.ragged import draw_lengths
    if dist not in MEANS:
        raise ValueError(f"dist: expected 'uniform' or 'zipf', got {dist!r}")
    return draw_lengths(dist, B, MEANS[dist] if mean is None else int(mean), seed)


_PRETEND: dict[str, Calibration] = {}


def pretend_gpu(sms: int = 8, like: str = "H200") -> gpus.GPU:
    r"""A pretend GPU of ``sms`` SMs cut from ``like`` (a preset name), for timelines a reader can follow.

    Each SM is ``like``'s: the same registers and shared memory (so the same programs per SM r), the same rate ρ
    of one program and the same start-up, merge and launch costs. The whole-GPU bandwidth, the datasheet's and the
    model's BW, is scaled by sms / SMs(like), so the number of streaming programs that saturates it per SM,
    :math:`BW / (\rho\,S)`, is ``like``'s. :func:`model_timeline` uses that calibration for it."""
    base = gpus.resolve(like)
    if not isinstance(sms, int) or not 1 <= sms <= base.sms:
        raise ValueError(f"sms: expected an integer from 1 to {base.sms} (the SMs of {base.name}), got {sms!r}")
    from dataclasses import replace
    from ..calibration import calibration_for
    f = sms / base.sms
    g = replace(base, name=f"pretend {base.name} with {sms} SMs", sms=sms, bandwidth_tbs=base.bandwidth_tbs * f)
    cal = calibration_for(base)
    _PRETEND[g.name] = replace(cal, bw_tbs=cal.bw_tbs * f,
                               source=f"{cal.source}; bandwidth scaled to {sms} of {base.sms} SMs")
    return g


# ----------------------------------------------------------------------------------------------- data
@dataclass
class Timeline:
    """Programs of one launch (or two, for the two-stage path) on the SMs of one GPU.

    ``sm``, ``start_us``, ``end_us``, ``row`` (the sequence b a program works on; -1 when it spans several or is
    unknown) are arrays with one entry per program that did work. ``bands``: (label, start µs, end µs) spans that
    involve every SM (the two-stage path's kernel boundary and stage 2). ``parts``: what each program does when
    (model timelines only)."""
    sm: np.ndarray
    start_us: np.ndarray
    end_us: np.ndarray
    row: np.ndarray
    sms: int
    device: str
    mode: str
    source: str                       # "timeline model" or "recorded on ..."
    bands: list = field(default_factory=list)
    kv_mb: float | None = None        # bytes the launch must read (for the effective bandwidth)
    info: dict = field(default_factory=dict)
    parts: list = field(default_factory=list)
    """Model timelines: (program, kind, b, start µs, end µs) of each program's ``"start-up"``, the ``"stream"`` of
    each sequence b it reads, and its ``"merge"`` (:func:`simulate`); empty for a recorded timeline."""

    @property
    def programs(self) -> int:
        return int(len(self.sm))

    @property
    def makespan(self) -> float:
        """µs from the first program's start to the end of the last program or band."""
        if not self.programs:
            return 0.0
        last = max([float(self.end_us.max())] + [b[2] for b in self.bands])
        return last - float(self.start_us.min())

    def busy_us(self) -> np.ndarray:
        """[sms] µs during which each SM runs at least one program (the union of its programs' intervals)."""
        busy = np.zeros(self.sms)
        order = np.lexsort((self.start_us, self.sm))
        sm, s, e = self.sm[order], self.start_us[order], self.end_us[order]
        for k in np.unique(sm):
            sel = sm == k
            cur_s = cur_e = None
            tot = 0.0
            for a, b in zip(s[sel], e[sel]):
                if cur_e is None or a > cur_e:
                    if cur_e is not None:
                        tot += cur_e - cur_s
                    cur_s, cur_e = a, b
                else:
                    cur_e = max(cur_e, b)
            if cur_e is not None:
                tot += cur_e - cur_s
            busy[int(k)] = tot
        for label, a, b in self.bands:
            if "merge" in label:   # the stage-2 merge keeps every SM busy; the kernel boundary does not
                busy += b - a
        return busy

    @property
    def idle_fraction(self) -> float:
        """1 − Σ_SM busy time / (SMs × makespan)."""
        span = self.makespan
        return 0.0 if span <= 0 else float(1.0 - self.busy_us().sum() / (self.sms * span))

    def sm_last_end_us(self) -> np.ndarray:
        """[sms] µs at which each SM's last program ends (NaN for an SM that ran none)."""
        ends = np.full(self.sms, np.nan)
        np.fmax.at(ends, self.sm.astype(np.int64), self.end_us)
        return ends

    def span_parts(self) -> dict:
        r"""Where the makespan M goes, per SM k that ran programs (means over those SMs, µs):

        * ``ramp``: :math:`\overline{s_k}`, its first program's start after the launch's first start;
        * ``tail``: :math:`M - \overline{e_k}`, the time after its last program ends (:meth:`sm_last_end_us`);
        * ``gaps``: :math:`\overline{e_k - s_k - \text{busy}_k}`, time between its first start and last end with
          none of its programs running (programs waiting to be scheduled, or fewer programs than slots);
        * ``busy``: :math:`\overline{\text{busy}_k}` (:meth:`busy_us`); ramp + gaps + busy + tail = M;
        * ``program``: the median program's duration; ``programs_per_sm``: the most programs running at once
          on one SM (the lanes :func:`lanes` draws)."""
        busy = self.busy_us()
        ks = np.unique(self.sm).astype(np.int64)
        first = np.full(self.sms, np.inf)
        np.fmin.at(first, self.sm.astype(np.int64), self.start_us)
        first, last = first[ks], self.sm_last_end_us()[ks]
        span = self.makespan
        return dict(makespan=span, ramp=float(first.mean()), tail=float(span - last.mean()),
                    gaps=float((last - first - busy[ks]).mean()), busy=float(busy[ks].mean()),
                    program=float(np.median(self.end_us - self.start_us)), programs_per_sm=int(lanes(self).max()) + 1,
                    sms_used=int(len(ks)))

    def lines(self) -> list[str]:
        return [f"{self.mode} on {self.device} [{self.source}]:",
                f"  {self.programs} programs, makespan {self.makespan:.1f} µs, SMs idle {self.idle_fraction:.1%} of it"]

    def __str__(self) -> str:
        return "\n".join(self.lines())


# ----------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class _Program:
    pieces: tuple            # ((row key, MB), ...) streamed one after another
    startup_us: float
    row: int                 # b, or -1 for a slice over several sequences


def simulate(progs: list, sms: int, r: int, bw_tbs: float, rho_tbs: float, merge_us: dict,
             parts: bool = False) -> tuple:
    r"""Play a launch out: programs dispatched in list order to the first free slot (slots start round-robin over
    the SMs), each paying its start-up, streaming its pieces at :math:`\min(\rho, BW/n)` with n programs
    streaming (processor sharing, tracked in "virtual bytes" V so each event costs O(log P)), then the merge of
    every row (key of ``merge_us``) whose last piece it finished. Returns (sm, start µs, end µs) arrays, and with
    ``parts=True`` a fourth item: the list of (program, kind, key, t0 µs, t1 µs), kind ``"start-up"``,
    ``"stream"`` (one per piece, key the piece's row key) or ``"merge"``. A piece ends when V has grown by the
    MB of the pieces up to it; V is linear in time between events, so that time is exact."""
    n = len(progs)
    sm = np.zeros(n, dtype=np.int64)
    start = np.zeros(n)
    end = np.zeros(n)
    left = {}
    for p in progs:
        for key, _ in p.pieces:
            left[key] = left.get(key, 0) + 1
    free = [(0.0, k * sms + s, s) for k in range(r) for s in range(sms)]   # (time freed, order, SM)
    heapq.heapify(free)
    order = r * sms
    fixed: list = []             # (end time, pid, phase) of start-up and merge phases
    stream: list = []            # (virtual finish, pid)
    V, t, nxt, active = 0.0, 0.0, 0, 0
    mb_of = [sum(mb for _, mb in p.pieces) for p in progs]
    hist_t, hist_V = [0.0], [0.0]                # V(t) at every event (piecewise linear in between)
    stream_from = np.full(n, np.nan)             # t and V when a program's streaming begins, when it ends
    stream_V0 = np.zeros(n)
    stream_to = np.full(n, np.nan)

    def finish_stream(pid, now):
        stream_to[pid] = now
        extra = 0.0
        for key, _ in progs[pid].pieces:
            left[key] -= 1
            if left[key] == 0:
                extra += merge_us.get(key, 0.0)
        if extra > 0:
            heapq.heappush(fixed, (now + extra, pid, "merge"))
        else:
            done(pid, now)

    def done(pid, now):
        nonlocal order, active
        end[pid] = now
        active -= 1
        heapq.heappush(free, (now, order, int(sm[pid])))
        order += 1

    while nxt < n or active:
        while nxt < n and free and free[0][0] <= t + 1e-12:
            _, _, s = heapq.heappop(free)
            sm[nxt], start[nxt] = s, t
            active += 1
            heapq.heappush(fixed, (t + progs[nxt].startup_us, nxt, "startup"))
            nxt += 1
        n_str = len(stream)
        rate = min(rho_tbs, bw_tbs / n_str) if n_str else 0.0
        t_fixed = fixed[0][0] if fixed else np.inf
        t_str = t + (stream[0][0] - V) / rate if n_str else np.inf
        t_free = free[0][0] if (free and nxt < n and free[0][0] > t) else np.inf
        t_new = min(t_fixed, t_str, t_free)
        if t_new == np.inf:
            break
        V += rate * (t_new - t)
        t = t_new
        hist_t.append(t)
        hist_V.append(V)
        while stream and stream[0][0] <= V + 1e-9:
            _, pid = heapq.heappop(stream)
            finish_stream(pid, t)
        while fixed and fixed[0][0] <= t + 1e-12:
            _, pid, phase = heapq.heappop(fixed)
            if phase == "startup":
                stream_from[pid], stream_V0[pid] = t, V
                if mb_of[pid] > 0:
                    heapq.heappush(stream, (V + mb_of[pid], pid))
                else:
                    finish_stream(pid, t)
            else:
                done(pid, t)
    if not parts:
        return sm, start, end
    # V never falls, and it rises strictly while any program streams. A piece boundary is reached while its program
    # streams, so on a rising stretch: keep the points that start or end one (a flat stretch keeps only its ends,
    # which no boundary falls between) and interpolate
    ht, hv = np.asarray(hist_t), np.asarray(hist_V)
    up = hv[1:] > hv[:-1]
    edge = np.append(up, False) | np.insert(up, 0, False)
    ht, hv = ht[edge], hv[edge]
    inner = [stream_V0[pid] + c for pid, p in enumerate(progs) if len(p.pieces) > 1
             for c in np.cumsum([mb for _, mb in p.pieces[:-1]])]
    t_inner = iter(np.interp(inner, hv, ht).tolist() if inner else [])
    out = []
    for pid, p in enumerate(progs):
        t_s, t_e = float(stream_from[pid]), float(stream_to[pid])
        if t_s > start[pid]:
            out.append((pid, "start-up", p.pieces[0][0] if p.pieces else None, float(start[pid]), t_s))
        if not p.pieces:
            continue
        bounds = [t_s] + [min(max(next(t_inner), t_s), t_e) for _ in p.pieces[:-1]] + [t_e]
        out += [(pid, "stream", key, a, b) for (key, _), a, b in zip(p.pieces, bounds, bounds[1:]) if b > a]
        if end[pid] > t_e + 1e-12:
            out.append((pid, "merge", None, t_e, float(end[pid])))
    return sm, start, end, out


def model_inputs(lengths, H_q: int, H_kv: int, D: int = 128, dtype_bytes: int = 2, gpu="H200", cal=None):
    """(gpu, calibration, tile, r): what the cost model uses for this batch on ``gpu`` (a preset name or
    :class:`fdlib.gpus.GPU`): the compiled tiles for the longest row, r programs per SM."""
    g = gpus.resolve(gpu)
    if cal is None:
        from ..calibration import calibration_for
        cal = _PRETEND.get(g.name) or calibration_for(g)
    L_cap = max(max(lengths, default=0), 1)
    tile = tile_config_for(D, L_cap, compiled_mode=True, elem_bytes=dtype_bytes, rows=len(lengths) * H_kv)
    r = costmodel.kernel_programs_per_sm(g, D, dtype_bytes, tile.BLOCK_N, tile.num_warps, tile.num_stages)
    return g, cal, tile, r


def model_splits(lengths, H_q: int, H_kv: int, D: int = 128, dtype_bytes: int = 2, gpu="H200", cal=None) -> int:
    """The split count the plan takes on that GPU for these lengths (the cost model's choice for the unified
    kernel, used by the split and unified methods alike: :func:`fdlib.splits.choose_splits`)."""
    g, cal, _, _ = model_inputs(lengths, H_q, H_kv, D, dtype_bytes, gpu, cal)
    return costmodel.explain(len(lengths), H_q, H_kv, list(lengths), D, dtype_bytes, g, "unified", cal=cal).chosen


def _merge_cost(cal, n: int, group: int, D: int) -> float:
    """The cost model's epilogue: the last program of a row merges n partials of ``group`` heads."""
    per_split = cal.t_split_us * (D + 1) / (costmodel.CAL_GROUP * (costmodel.CAL_D + 1))
    return cal.t_merge_us + n * per_split * group if n > 1 else 0.0


def model_timeline(lengths, H_q: int, H_kv: int, D: int = 128, dtype_bytes: int = 2, schedule: str = "split",
                   gpu="H200", splits: int | None = None, budget: int | None = None, cal=None) -> Timeline:
    r"""The model timeline (module docstring) of one decode step over a batch of ``lengths`` with ``schedule``.

    ``splits``: the split count (default: the cost model's choice for this batch, :func:`model_splits`; 1 for
    ``"longest-first"``);
    ``budget``: the balanced schedule's P (default B·splits, as :func:`fdlib.plan.decide` sets it) or the
    stream-K program count, rounded down to a multiple of H_kv (default: as the kernel launches it,
    :func:`fdlib.kernels.streamk.streamk_programs` of PERSISTENT_PER_SM·SMs, on the persistent kernel's tiles)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 0:
        raise ValueError(f"lengths: expected at least one length, all >= 0, got {lengths[:8]}")
    if H_q < 1 or H_kv < 1 or H_q % H_kv:
        raise ValueError(f"H_q: {H_q} query heads must be a positive multiple of H_kv={H_kv}")
    g, cal, tile, r = model_inputs(lengths, H_q, H_kv, D, dtype_bytes, gpu, cal)
    N, group, B = tile.BLOCK_N, H_q // H_kv, len(lengths)
    if splits is None:
        splits = 1 if schedule == "longest-first" else model_splits(lengths, H_q, H_kv, D, dtype_bytes, g, cal)
    L_cap = max(max(lengths), 1)
    chunk, used = chunk_for(L_cap, splits, N)
    mb_per_key = 2 * D * dtype_bytes / 1e6
    progs, merge, bands, info = [], {}, [], {"splits": used, "chunk": chunk, "block_n": N, "programs_per_sm": r}
    if schedule in ("split", "unified", "longest-first"):
        n_b = [max(1, -(-L // chunk)) for L in lengths]
        # launch order: stage 1's grid (B, H_kv, splits) has b the fastest, the unified kernel's (H_kv, B, splits) h;
        # longest first, the unified kernel's place i runs the i-th longest sequence (ties: lower b first)
        seqs = order_hint(B, L_cap, lengths) if schedule == "longest-first" else range(B)
        order = [(b, h) for h in range(H_kv) for b in range(B)] if schedule == "split" else \
            [(b, h) for b in seqs for h in range(H_kv)]
        for j in range(used):
            for b, h in order:
                L = lengths[b]
                if j >= n_b[b]:
                    progs.append(_Program((), 0.0, b))  # exits at once
                    continue
                keys = (L if j == n_b[b] - 1 else min((j + 1) * chunk, L)) - j * chunk
                progs.append(_Program((((b, h), keys * mb_per_key),), cal.t_wave_us, b))
        if schedule != "split":
            merge = {(b, h): _merge_cost(cal, n_b[b], group, D) for b in range(B) for h in range(H_kv)}
        kind = {"split": "two-stage split", "unified": "unified", "longest-first": "unified, longest rows first,"}
        mode = f"{kind[schedule]} schedule, {used} splits of {chunk} keys"
    elif schedule == "balanced":
        P = budget if budget is not None else B * used
        s = balanced(lengths, P, N)
        info.update(budget=P, items=s.items, chunk_tiles=s.chunk_tiles)
        n_b = s.splits.tolist()
        c_keys = s.chunk_tiles * N
        for h in range(H_kv):                               # grid (P + B, H_kv): items fastest
            for b, L in enumerate(lengths):
                for j in range(n_b[b]):
                    keys = (L if j == n_b[b] - 1 else min((j + 1) * c_keys, L)) - min(j * c_keys, L)
                    progs.append(_Program((((b, h), max(keys, 0) * mb_per_key),), cal.t_wave_us, b))
            progs += [_Program((), 0.0, -1)] * (P + B - s.items)
        merge = {(b, h): _merge_cost(cal, n_b[b], group, D) for b in range(B) for h in range(H_kv)}
        mode = f"balanced schedule, {s.items} items of ≤ {s.chunk_tiles} tiles (budget {P})"
    else:   # as fdlib.kernels.streamk launches it: the persistent kernel's tiles, PERSISTENT_PER_SM programs an SM,
        # P_h shares a KV head over that head's rows in sequence order, program p = q·H_kv + h
        from ..kernels.config import PERSISTENT_PER_SM, persistent_config
        from ..kernels.streamk import active_shares, streamk_programs
        sk = persistent_config(D, dtype_bytes, compiled_mode=True)
        N = sk.BLOCK_N
        r = costmodel.kernel_programs_per_sm(g, D, dtype_bytes, N, sk.num_warps, sk.num_stages)
        info.update(block_n=N, programs_per_sm=r)
        P = streamk_programs(H_kv, PERSISTENT_PER_SM * g.sms if budget is None else budget, 1)
        P_h = P // H_kv
        tiles = [max(1, -(-L // N)) for L in lengths]
        bounds = np.concatenate([[0], np.cumsum(tiles)])   # sequence b: tiles [bounds[b], bounds[b+1]) of each head
        T = int(bounds[-1])
        P_a = active_shares(tiles, P_h)                     # the shares that take part, as the kernel's rule
        cuts = [q * T // P_a for q in range(P_a + 1)] + [T] * (P_h - P_a)
        parts: dict = {}
        for p in range(P):
            q, h = divmod(p, H_kv)
            a, e = cuts[q], cuts[q + 1]
            pieces = []
            b = int(np.searchsorted(bounds, a, side="right") - 1)
            while a < e:
                hi = min(e, int(bounds[b + 1]))
                t0, t1 = a - int(bounds[b]), hi - int(bounds[b])
                keys = max(0, min(t1 * N, lengths[b]) - min(t0 * N, lengths[b]))
                pieces.append(((b, h), keys * mb_per_key))
                parts[(b, h)] = parts.get((b, h), 0) + 1
                a, b = hi, b + 1
            row = pieces[0][0][0] if len({pc[0][0] for pc in pieces}) == 1 else -1
            progs.append(_Program(tuple(pieces), cal.t_wave_us + (len(pieces) - 1) * cal.t_split_us if pieces
                                  else 0.0, row))
        merge = {key: _merge_cost(cal, n, group, D) for key, n in parts.items()}
        info.update(programs=P, shares=P_a * H_kv, tiles=T * H_kv, tiles_per_program=T / P_a)
        per_head = f", {P_h} for each KV head" if H_kv > 1 else ""
        taking = f", {P_a * H_kv} with a share" if P_a < P_h else ""
        mode = (f"stream-K schedule: {P} programs{per_head}{taking}, ~{T / P_a:.1f} tiles a share, one in each slot "
                f"({r} an SM)")
    sm, start, end, raw = simulate(progs, g.sms, r, cal.bw_tbs, cal.rho_tbs, merge, parts=True)
    work = np.array([bool(p.pieces) for p in progs], dtype=bool)
    kept = np.cumsum(work) - 1                               # a working program's index in the Timeline's arrays
    parts = [(int(kept[pid]), kind, key[0] if key is not None else -1, a, b) for pid, kind, key, a, b in raw
             if work[pid]]
    if schedule == "split":
        t1 = float(end.max()) if len(end) else 0.0
        per_split = cal.t_split_us * (D + 1) / (costmodel.CAL_GROUP * (costmodel.CAL_D + 1))
        bands = [("kernel boundary", t1, t1 + cal.t_stage2_us),
                 ("stage 2: merge", t1 + cal.t_stage2_us, t1 + cal.t_stage2_us + used * per_split)]
    kv_mb = 2 * sum(lengths) * H_kv * D * dtype_bytes / 1e6
    return Timeline(sm[work], start[work], end[work], np.array([p.row for p in progs])[work], g.sms, g.name, mode,
                    "timeline model", bands, kv_mb, dict(info, B=B, H_q=H_q, H_kv=H_kv, D=D, dtype_bytes=dtype_bytes,
                                               calibration=cal.source), parts)


# ----------------------------------------------------------------------------------------------- recorded
def from_buffer(buf, device: str, mode: str, sms: int | None = None, kv_mb: float | None = None,
                source: str | None = None, rows=None) -> Timeline:
    """A timeline from what ``plan.run(..., timeline=buf)`` recorded: ``buf`` int64 ``[n_programs, 3]``
    (SM id, start ns, end ns; a tensor, array or nested list). Rows that never ran (end <= 0) are dropped; times
    become µs from the first start. ``rows``: the sequence of each program, if known."""
    a = np.asarray(buf.cpu().numpy() if hasattr(buf, "cpu") else buf, dtype=np.int64).reshape(-1, 3)
    ran = a[:, 2] > 0
    a = a[ran]
    if not len(a):
        raise ValueError("buf: no program recorded a start and an end (was the timeline flag passed to run?)")
    if (a[:, 2] < a[:, 1]).any():
        raise ValueError("buf: a program ends before it starts (columns must be SM id, start ns, end ns)")
    t0 = a[:, 1].min()
    sms = int(sms if sms is not None else a[:, 0].max() + 1)
    row = np.asarray(rows, dtype=np.int64)[ran] if rows is not None else np.full(len(a), -1)
    return Timeline(a[:, 0].copy(), (a[:, 1] - t0) / 1e3, (a[:, 2] - t0) / 1e3, row, sms, device, mode,
                    source or f"recorded on {device}", [], kv_mb)


def load_recorded(path) -> list[Timeline]:
    """The timelines of one ``tools/record_timeline.py`` file (``timeline-*.json``), each with its provenance
    line in ``info["provenance"]``."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a timeline file of tools/record_timeline.py (schema {data.get('schema')!r})")
    prov = data["provenance"]
    out = []
    for run in data["runs"]:
        tl = from_buffer(run["programs"], prov["device"], run["mode"], sms=prov.get("sm_count"),
                         kv_mb=data["batch"]["kv_mb"],
                         source=f"recorded on {prov['device']} {prov['date_utc'][:10]}")
        tl.info.update(run, provenance=provenance_line(prov), batch=data["batch"])
        tl.info.pop("programs", None)
        out.append(tl)
    return out


def save_recorded(path, batch: dict, runs: list, provenance: dict) -> Path:
    """Write one ``timeline-*.json`` file: ``batch`` (name, B, H_q, H_kv, D, dtype, lengths, seed, kv_mb),
    ``runs`` (each: method, mode, kernel, splits, ..., ``programs`` as [[SM id, start ns, end ns], ...]) and the
    run's ``provenance`` (:func:`fdlib.bench.harness.provenance`). :func:`load_recorded` reads it back."""
    path = Path(path)
    path.write_text(json.dumps({"schema": SCHEMA, "provenance": provenance, "batch": batch, "runs": runs}))
    return path


def provenance_line(prov: dict) -> str:
    """'recorded on <device> <date> (versions), command: <command>', the command without its output folder."""
    command = re.sub(r"\s--out(=|\s+)\S+", "", prov["command"])
    return (f"recorded on {prov['device']} {prov['date_utc'][:10]} (torch {prov['torch']}, triton {prov['triton']}, "
            f"fdlib {prov['fdlib']}), command: {command}")


# ----------------------------------------------------------------------------------------------- drawing
def lanes(tl: Timeline) -> np.ndarray:
    """A lane per program within its SM (0, 1, ...), so programs that share an SM at once do not overlap."""
    lane = np.zeros(tl.programs, dtype=np.int64)
    for k in np.unique(tl.sm):
        idx = np.flatnonzero(tl.sm == k)
        idx = idx[np.argsort(tl.start_us[idx], kind="stable")]
        ends: list[float] = []
        for i in idx:
            for j, e in enumerate(ends):
                if e <= tl.start_us[i] + 1e-9:
                    ends[j] = tl.end_us[i]
                    lane[i] = j
                    break
            else:
                lane[i] = len(ends)
                ends.append(tl.end_us[i])
    return lane


SEQUENCE_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
"""A program's colour is its sequence b's (cycling): matplotlib's tab10 without its red and grey, which mean
the merge and idle time here."""
MERGE_COLOR = "#d62728"
IDLE_STYLE = dict(facecolor="#f4f4f4", edgecolor="#c4c4c4", hatch="////", linewidth=0.0)
RECORDED_COLOR = "#5b7fa6"
"""Recorded programs: the files do not say which sequence a program served."""
MIN_MERGE_WIDTH = 0.004
"""A merge takes a fraction of a µs: it is drawn at least this share of the x axis wide, so it shows."""


def idle_spans(tl: Timeline, sm: int) -> list[tuple[float, float]]:
    """(start µs, end µs) spans within the makespan during which SM ``sm`` runs no program of the launch and no
    merge band (the two-stage path's kernel boundary is idle time): the complement of what :meth:`Timeline.busy_us`
    counts, so their lengths add up to the SM's share of :attr:`Timeline.idle_fraction`."""
    t0 = float(tl.start_us.min()) if tl.programs else 0.0
    span_end = t0 + tl.makespan
    sel = tl.sm == sm
    busy = sorted(zip(tl.start_us[sel].tolist(), tl.end_us[sel].tolist()))
    busy += [(a, b) for label, a, b in tl.bands if "merge" in label]
    busy.sort()
    out, at = [], t0
    for a, b in busy:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if span_end > at:
        out.append((at, span_end))
    return [(a, b) for a, b in out if b - a > 1e-9]


def _legend_handles(tl_list, sequences: bool):
    from matplotlib.patches import Patch
    handles = []
    rows = sorted({int(b) for tl in tl_list for _, kind, b, _, _ in tl.parts if b >= 0})
    modelled = any(tl.parts for tl in tl_list)
    if modelled and sequences and len(rows) <= len(SEQUENCE_COLORS):
        handles += [Patch(facecolor=SEQUENCE_COLORS[b % len(SEQUENCE_COLORS)], label=f"sequence {b}") for b in rows]
    elif modelled:
        handles.append(Patch(facecolor=SEQUENCE_COLORS[0], label="streaming (colour: sequence)"))
    if modelled:
        handles.append(Patch(facecolor=SEQUENCE_COLORS[0], alpha=0.4, label="start-up (pale)"))
    if any(not tl.parts for tl in tl_list):
        handles.append(Patch(facecolor=RECORDED_COLOR, label="program"))
    if any(kind == "merge" for tl in tl_list for _, kind, *_ in tl.parts) or any(
            "merge" in label for tl in tl_list for label, *_ in tl.bands):
        handles.append(Patch(facecolor=MERGE_COLOR, label="merge"))
    handles.append(Patch(**{**IDLE_STYLE, "linewidth": 0.5}, label="idle SM"))
    return handles


def draw_gantt(tl: Timeline, ax=None, max_sms: int | None = None, title: str | None = None, legend: bool = True,
               xmax: float | None = None):
    """The per-SM timeline: one band per SM (a lane per slot: a program running on it at once), time in µs on the x
    axis.

    A model timeline (:attr:`Timeline.parts`) shows each program's start-up (pale), the slice of each sequence b
    it streams (b's colour, :data:`SEQUENCE_COLORS`) and its merge (:data:`MERGE_COLOR`, at least
    :data:`MIN_MERGE_WIDTH` of the axis wide); a recorded one a bar per program. Idle SM time (:func:`idle_spans`)
    is hatched; the two-stage path's stage 2 is a merge band over every SM. The title gives the schedule, the GPU,
    the source (model or recording), the makespan and the idle share. ``max_sms``: draw only the first SMs (the
    numbers still count all); ``xmax``: the axis' end (µs), to compare panels."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.6))
    lane = lanes(tl)
    width = max(int(lane.max()) + 1 if tl.programs else 1, 1)
    shown = tl.sms if max_sms is None else min(max_sms, tl.sms)
    x_end = xmax if xmax is not None else max(tl.makespan, 1e-3) * 1.02
    min_w = MIN_MERGE_WIDTH * x_end
    h = 0.9 / width

    for k in range(shown):
        spans = idle_spans(tl, k)
        if spans:
            ax.broken_barh([(a, b - a) for a, b in spans], (k, 0.9), **IDLE_STYLE)
    if tl.parts:
        for i, kind, b, a, e in tl.parts:
            if tl.sm[i] >= shown:
                continue
            y = tl.sm[i] + lane[i] / width
            if kind == "merge":
                ax.broken_barh([(a, max(e - a, min_w))], (y, h), facecolors=MERGE_COLOR, linewidth=0)
                continue
            color = SEQUENCE_COLORS[b % len(SEQUENCE_COLORS)] if b >= 0 else "0.5"
            ax.broken_barh([(a, e - a)], (y, h), facecolors=color, alpha=0.4 if kind == "start-up" else 1.0,
                           edgecolor="white", linewidth=0.4)
    else:
        for i in range(tl.programs):
            if tl.sm[i] < shown:
                ax.broken_barh([(tl.start_us[i], tl.end_us[i] - tl.start_us[i])], (tl.sm[i] + lane[i] / width, h),
                               facecolors=RECORDED_COLOR, edgecolor="white", linewidth=0.3)
    for label, a, b in tl.bands:
        if "merge" in label:
            ax.broken_barh([(a, max(b - a, min_w))], (0, shown), facecolors=MERGE_COLOR, linewidth=0)
        else:   # the kernel boundary: idle (hatched above); name it
            ax.annotate(label, xy=((a + b) / 2, 0), xytext=(0, 3), textcoords="offset points", ha="right",
                        va="bottom", fontsize=7.5, color="0.35", annotation_clip=False)
    ax.set_ylim(shown, 0)
    ax.set_xlim(0, x_end)
    if shown <= 32:
        ax.set_yticks([k + 0.45 for k in range(shown)], [str(k) for k in range(shown)])
    ax.set_xlabel("time since the first program started (µs)")
    slots = f"; {width} slots each" if width > 1 else ""
    ax.set_ylabel(f"SM id ({shown} of {tl.sms} shown{slots})" if shown < tl.sms else f"SM id ({tl.sms} SMs{slots})")
    ax.grid(False)
    ax.set_title(title or f"{tl.mode}\n{tl.device}, {tl.source}: makespan {tl.makespan:.1f} µs, "
                          f"SMs idle {tl.idle_fraction:.0%}", fontsize=9.5)
    if legend:
        ax.legend(handles=_legend_handles([tl], sequences=True), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  borderaxespad=0.0, fontsize=8)   # beside the bars, not over them
    return ax


def draw_gantts(tls: list, max_sms: int | None = None, suptitle: str | None = None, height: float = 2.3):
    """Several timelines stacked on one time axis (the longest makespan), one legend beside the top panel: the
    same colours mean the same sequence in every panel. Returns the figure."""
    import matplotlib.pyplot as plt

    if not tls:
        raise ValueError("tls: expected at least one Timeline, got none")
    shown = [tl.sms if max_sms is None else min(max_sms, tl.sms) for tl in tls]
    fig, axes = plt.subplots(len(tls), 1, figsize=(9.5, sum(0.9 + height * min(n, 16) / 8 for n in shown)),
                             sharex=True, squeeze=False)
    x_end = max(tl.makespan for tl in tls) * 1.02
    for ax, tl in zip(axes[:, 0], tls):
        draw_gantt(tl, ax=ax, max_sms=max_sms, legend=False, xmax=x_end)
        if ax is not axes[-1, 0]:
            ax.set_xlabel("")
    axes[0, 0].legend(handles=_legend_handles(tls, sequences=True), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      borderaxespad=0.0, fontsize=8)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10.5)
    return fig


__all__ = ["BATCH", "MEANS", "batch_lengths", "pretend_gpu", "Timeline", "model_timeline", "model_splits", "simulate",
           "from_buffer", "load_recorded", "save_recorded", "lanes", "idle_spans", "draw_gantt", "draw_gantts",
           "SCHEDULES"]
