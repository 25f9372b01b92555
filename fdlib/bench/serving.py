r"""``python -m fdlib.bench --serving``: seven serving batches, the plan made from host lengths against the calls that
never see them.

A serving engine builds each decode step from a batch of sequences of different lengths. It can plan the step
from the lengths on the host (``fdlib.plan(..., lengths=...)``: the cost model sees the real mix), or run with the
lengths on the GPU only: the call most users write (``fdlib.decode_attention(q, k, v, lens)``), and every CUDA
graph captured once per batch size before the lengths are known. This bench times the three on the same batches,
and gives the host-lengths plan's time as the reference the other two are a ratio to.

**The batches** (bf16, D = 128; lengths drawn from ``seed + i`` for batch i = 0 … 6, so a subset draws the same
lengths):

1. B=32, 32:8 heads, lengths uniform in 1 … 32768;
2. B=128, 32:8, a chat mix: :math:`L = \operatorname{clip}(\operatorname{round}(2048\, e^{z}), 1, 32768)`,
   z ~ N(0, 1) (log-normal of median 2048, σ = 1 in log space);
3. B=8, 32:8, one row of 131072 keys (at a position drawn from the seed) and seven uniform in 1 … 20000;
4. B=48, 64:8, uniform in 1 … 16384;
5. B=24, 28:4, uniform in 1 … 65536;
6. B=256, 32:8, uniform in 1 … 2048;
7. B=1, 32:8, 131072 keys.

Each batch runs on two caches, as :mod:`fdlib.bench.ragged` builds them: pages of 16 keys shuffled in a pool of
exactly the pages the rows use, behind a block table; and contiguous ``[B, L_max, H_kv, D]``, L_max the longest
row. ``--quick``: the same seven laws on tiny shapes (4:1, 8:1 and 7:1 heads, D = 32, lengths up to 128) for
Triton's interpreter.

**The rows** of each batch and cache:

* ``plan_host``: ``p = fdlib.plan(..., lengths=<host list>)`` (``auto``, outside the timed region), then
  ``p.run(q, k, v, lens, block_table=...)`` with the lengths on the device: the reference;
* ``default``: ``fdlib.decode_attention(q, k, v, lens, block_table=...)``, device lengths, as most users call it;
* ``captured``: a plan made without lengths (``fdlib.plan(...)``, ``auto``), its call captured in a CUDA graph while
  the device lengths tensor holds L_max in every row; the batch's lengths are then copied into that same tensor
  and the graph replayed (:func:`fdlib.bench.timing.time_graph_after`). The answer checked is the replay's;
* each ``--methods`` spec, a plan made without host lengths and run with device lengths: ``NAME`` (a plan method:
  ``unified``, ``streamk``, ...), ``NAME#S`` (``num_splits=S``), ``NAME+invariant`` (``batch_invariant=True``;
  ``invariant`` alone is ``auto+invariant``), ``NAME@captured`` (the captured protocol), combined in that order
  (``unified#4+invariant@captured``). A method fdlib lacks, or any call that raises, gives a row with an
  ``error`` field; the run goes on.

Every row's answer is compared with the reference of the rows, softmax and products in float32 one sequence at a
time (:func:`fdlib.bench.harness.reference_rows`, as ``--ragged`` does): a relative error of 1e-2 or more marks it
``wrong`` (still timed, flagged in the table).
Times are CUDA-graph replays rotating over copies of the inputs that hold at least 4× the L2, and eager launches
with the L2 flushed (:mod:`fdlib.bench.timing`; no eager time for a captured row). A row's bandwidth is the bytes
the batch must read, :math:`2 \sum_b L_b H_{kv} D \cdot 2`, over its time, and % of ceiling compares it with the
read ceiling measured once in the same run.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import torch

from .. import runtime
from .harness import Progress, _short, measure_ceiling_or_none, provenance, rel_error, tolerance
from .ragged import case_inputs, case_record, draw_lengths
from .timing import Rotating, captured_call, free_memory, synchronize, time_eager, time_graph, time_graph_after

PAGE_SIZE = 16
LAYOUTS = (("paged", PAGE_SIZE), ("contiguous", 0))

# (name, B, H_q, H_kv, length law); a law is ("uniform", hi), ("lognormal", median, sigma, hi),
# ("one_long", long, short_hi) or ("constant", L)
CASES = (
    ("B=32 32:8, uniform 1..32768", 32, 32, 8, ("uniform", 32768)),
    ("B=128 32:8, lognormal (chat mix)", 128, 32, 8, ("lognormal", 2048, 1.0, 32768)),
    ("B=8 32:8, one row of 131072, seven 1..20000", 8, 32, 8, ("one_long", 131072, 20000)),
    ("B=48 64:8, uniform 1..16384", 48, 64, 8, ("uniform", 16384)),
    ("B=24 28:4, uniform 1..65536", 24, 28, 4, ("uniform", 65536)),
    ("B=256 32:8, uniform 1..2048", 256, 32, 8, ("uniform", 2048)),
    ("B=1 32:8, 131072 keys", 1, 32, 8, ("constant", 131072)),
)
QUICK_CASES = (
    ("B=4 4:1, uniform 1..64", 4, 4, 1, ("uniform", 64)),
    ("B=8 4:1, lognormal", 8, 4, 1, ("lognormal", 16, 1.0, 64)),
    ("B=3 4:1, one row of 128, two 1..40", 3, 4, 1, ("one_long", 128, 40)),
    ("B=3 8:1, uniform 1..32", 3, 8, 1, ("uniform", 32)),
    ("B=3 7:1, uniform 1..64", 3, 7, 1, ("uniform", 64)),
    ("B=8 4:1, uniform 1..16", 8, 4, 1, ("uniform", 16)),
    ("B=1 4:1, 128 keys", 1, 4, 1, ("constant", 128)),
)
BASE_ROWS = ("plan_host", "default", "captured")
SPEC = re.compile(r"^(?P<name>[a-z_0-9]+)(?:#(?P<splits>\d+))?(?P<inv>\+invariant)?(?P<cap>@captured)?$")


def draw_case_lengths(law: tuple, B: int, seed: int) -> list[int]:
    """B lengths of one batch's law (see the module doc), reproducible from ``seed``."""
    kind, *args = law
    if kind == "uniform":                      # uniform in 1..hi: ragged's uniform law of mean hi / 2
        (hi,) = args
        if hi % 2:
            raise ValueError(f"law: uniform needs an even upper bound, got {hi}")
        return draw_lengths("uniform", B, hi // 2, seed)
    if kind == "lognormal":
        median, sigma, hi = args
        z = torch.randn(B, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return [int(x) for x in torch.clamp(torch.round(median * torch.exp(sigma * z)), 1, hi).tolist()]
    if kind == "one_long":
        long, short_hi = args
        lens = draw_case_lengths(("uniform", short_hi), B - 1, seed)
        at = int(torch.randint(0, B, (1,), generator=torch.Generator().manual_seed(seed + 10_000)))
        return lens[:at] + [long] + lens[at:]
    if kind == "constant":
        return [args[0]] * B
    raise ValueError(f"law: expected uniform, lognormal, one_long or constant, got {kind!r}")


@dataclass(frozen=True)
class Row:
    """One row of a batch: ``kind`` plan_host, default or plan (a plan made without host lengths, of ``method``,
    ``splits`` and ``invariant``); ``captured``: timed by the captured protocol."""
    label: str
    kind: str
    method: str = "auto"
    splits: int | None = None
    invariant: bool = False
    captured: bool = False
    error: str | None = None


def parse_row(spec: str) -> Row:
    """A ``--methods`` spec as a :class:`Row` (the grammar is the module doc's); one that does not parse is a row
    whose ``error`` says why (it is reported, never raised)."""
    if spec in BASE_ROWS:
        return base_rows()[BASE_ROWS.index(spec)]
    m = SPEC.match(spec)
    if m is None:
        return Row(spec, "plan", error=f"spec: expected NAME[#S][+invariant][@captured], got {spec!r}")
    name = m["name"]
    inv = bool(m["inv"])
    if name == "invariant":
        name, inv = "auto", True
    return Row(spec, "plan", name, int(m["splits"]) if m["splits"] else None, inv, bool(m["cap"]))


def base_rows() -> tuple[Row, ...]:
    return (Row("plan_host", "plan_host"), Row("default", "default"), Row("captured", "plan", captured=True))


@dataclass
class Step:
    """One input copy's call, the tensor its answer lands in, its plan's decision; a captured row's host action
    before the replays (``set_lengths``: :func:`~fdlib.bench.timing.captured_call`)."""
    call: object
    out: torch.Tensor | None = None
    decision: object = None
    set_lengths: object = None


def _step(row: Row, c) -> Step:
    import fdlib
    from ..api import plan_for
    from ..validate import check_inputs
    q, k, v, lens, bt = c
    if row.kind == "default":
        d = plan_for(q, k, v, lens, block_table=bt).decision
        return Step(lambda: fdlib.decode_attention(q, k, v, lens, block_table=bt), decision=d)
    s = check_inputs(q, k, v, lens, None, "auto", None, False, bt)    # the checked sizes of these tensors
    p = fdlib.plan(s.B, s.H_q, s.H_kv, s.D, s.L_max, dtype=q.dtype, device=q.device, page_size=s.page_size or None,
                   lengths=lens.tolist() if row.kind == "plan_host" else None, method=row.method,
                   num_splits=row.splits, batch_invariant=row.invariant)
    if not row.captured:
        return Step(lambda: p.run(q, k, v, lens, block_table=bt), decision=p.decision)
    out = torch.empty_like(q)
    call, put = captured_call(lambda held: p.run(q, k, v, held, block_table=bt, out=out), lens, s.L_max)
    return Step(call, out, p.decision, put)


def set_lengths(steps) -> None:
    """The captured protocol's one host action: the batch's lengths copied into the tensors the graph reads."""
    for s in steps:
        s.set_lengths()


def measure_row(row: Row, copies, ref, base: dict, settings: dict) -> dict:
    """One row's record on one batch and cache: its decision, time(s) and relative error (see the module doc)."""
    rec = dict(base, row=row.label, method=row.method if row.kind == "plan" else row.kind, splits_asked=row.splits,
               batch_invariant=row.invariant, captured=row.captured, status="ok")
    if row.error:
        return dict(rec, status="error", error=row.error)
    try:
        steps = [_step(row, c) for c in copies]
        d = steps[0].decision
        rec.update(kernel=d.kernel, splits=d.splits)
        calls = Rotating([s.call for s in steps])
        if row.captured and settings["graphs"]:
            rec["graph_us"] = time_graph_after(calls, lambda: set_lengths(steps), settings["graph_rep_ms"])
            out = steps[0].out
        elif row.captured:                       # no graphs (the interpreter): one call stands for the capture
            steps[0].call()
            set_lengths(steps)
            out = steps[0].call()
            rec["eager_us"] = time_eager(steps[0].call, settings["warmup_ms"], settings["rep_ms"],
                                         settings["cpu_runs"])
        else:
            out = steps[0].call()
            synchronize()
            rec["eager_us"] = time_eager(steps[0].call, settings["warmup_ms"], settings["rep_ms"],
                                         settings["cpu_runs"])
            if settings["graphs"]:
                rec["graph_us"] = time_graph(calls, settings["graph_rep_ms"])
        synchronize()
        rec["rel_err"] = rel_error(out, ref)
    except Exception as e:  # noqa: BLE001 - one row's failure is recorded, the run goes on
        free_memory()
        return dict(rec, status="error", error=_short(e))
    if not math.isfinite(rec["rel_err"]) or rec["rel_err"] >= tolerance(base["dtype"]):
        rec.update(status="wrong", error=f"relative error {rec['rel_err']:.3g} >= {tolerance(base['dtype']):g}")
    return rec


def _derive(records: list[dict], ceiling_tbs) -> None:
    """Each record's time (graph, else eager), bandwidth, % of ceiling and ratio to its batch's plan_host."""
    for r in records:
        r["us"] = r.get("graph_us") or r.get("eager_us")
    host = {(r["case"], r["layout"]): r["us"] for r in records if r["row"] == "plan_host" and r["status"] == "ok"}
    for r in records:
        if not r["us"]:
            continue
        r["tbs"] = r["kv_mb"] / r["us"]                # MB/µs = TB/s
        r["pct_ceiling"] = 100 * r["tbs"] / ceiling_tbs if ceiling_tbs else None
        h = host.get((r["case"], r["layout"]))
        r["ratio_plan_host"] = r["us"] / h if h else None


def run_serving(cases=None, methods=None, quick=False, graphs=None, warmup_ms=None, rep_ms=None, graph_rep_ms=None,
                seed=0, ceiling=True, ceiling_gib=None, budget_s=None, progress=True, command=None,
                checkpoint=None) -> dict:
    """Time the rows of the module doc on the serving batches; a results dict of kind ``"serving"``. ``cases``:
    1-based indices into the seven batches (default all); ``methods``: more row specs; ``budget_s``: once this many
    seconds have passed, the batches left are recorded as skipped; ``checkpoint(results)`` is called after every
    batch and cache with the results so far."""
    table = QUICK_CASES if quick else CASES
    picked = tuple(cases or range(1, len(table) + 1))
    bad = [i for i in picked if not 1 <= i <= len(table)]
    if bad:
        raise ValueError(f"cases: expected indices 1..{len(table)}, got {bad}")
    rows = base_rows() + tuple(parse_row(s) for s in (methods or ()))
    gpu = runtime.MODE == "gpu"
    settings = {"graphs": gpu and graphs is not False, "warmup_ms": warmup_ms or (5 if quick else 25),
                "rep_ms": rep_ms or (10 if quick else 100), "graph_rep_ms": graph_rep_ms or 20, "cpu_runs": 1,
                "page_size": PAGE_SIZE, "page_order": "shuffled", "quick": quick, "seed": seed,
                "cases": list(picked), "rows": [r.label for r in rows], "budget_s": budget_s,
                "l2_handling": "eager: 256 MB zero-fill before each call; graphs: rotate over copies holding >= 4x L2",
                "kv_bytes": "2*sum(L)*H_kv*D*2"}
    t0 = time.monotonic()
    ceil = measure_ceiling_or_none(ceiling and gpu, ceiling_gib or 4, settings)
    results = {"schema": "fdlib.bench/1", "kind": "serving", "provenance": provenance(command), "settings": settings,
               "ceiling": ceil, "cases": [], "records": [], "skipped": []}
    bar = Progress(len(picked) * len(LAYOUTS) * len(rows), "serving", progress)
    for i in picked:
        name, B, H_q, H_kv, law = table[i - 1]
        D = 32 if quick else 128
        lens = draw_case_lengths(law, B, seed + i - 1)
        results["cases"].append(dict(case=i, name=name, B=B, H_q=H_q, H_kv=H_kv, D=D, law=list(law), lengths=lens))
        for layout, page in LAYOUTS:
            if budget_s is not None and time.monotonic() - t0 > budget_s:
                results["skipped"].append(dict(case=i, name=name, layout=layout,
                                               reason=f"--budget-s {budget_s:g} s spent"))
                for _ in rows:
                    bar.update()
                continue
            shape = dict(dtype="bfloat16", B=B, H_q=H_q, H_kv=H_kv, D=D)
            base, stored = case_record(shape, lens, page)
            base.update(case=i, name=name, layout=layout)
            try:
                copies, ref = case_inputs(shape, lens, page, seed + i - 1, "shuffled", stored, settings["graphs"])
            except Exception as e:  # noqa: BLE001 - e.g. no memory for this batch's cache: its rows say so
                copies, ref = None, None
                err = _short(e)
            for row in rows:
                rec = (measure_row(row, copies, ref, base, settings) if copies is not None else
                       dict(base, row=row.label, status="error", error=f"inputs: {err}"))
                results["records"].append(rec)
                bar.update(f"{i} {layout} {row.label}: {rec.get('status')}")
            del copies, ref
            free_memory()
            _derive(results["records"], ceil and ceil.get("tbs"))
            if checkpoint:
                checkpoint(results)
    bar.close()
    settings["elapsed_s"] = time.monotonic() - t0
    return results


def _cell(r) -> str:
    """A summary cell: µs, ratio to plan_host and % of ceiling, or the row's status."""
    if r is None:
        return ""
    if r["status"] == "error":
        return "error"
    if not r.get("us"):
        return r["status"]
    mark = " ✗ wrong" if r["status"] == "wrong" else ""
    ratio = "" if r.get("ratio_plan_host") is None else f" · {r['ratio_plan_host']:.2f}×"
    pct = "" if r.get("pct_ceiling") is None else f" · {r['pct_ceiling']:.0f}%"
    return f"{r['us']:.1f}{ratio}{pct}{mark}"


def format_serving_table(results) -> str:
    """Markdown: the provenance, a summary (one line per batch and cache: every row's µs · × plan_host · % of
    ceiling) and every record in full."""
    prov, st = results["provenance"], results["settings"]
    ceil = results.get("ceiling") or {}
    timing = "CUDA graph" if st["graphs"] else "eager (wall clock in the interpreter)" if runtime.MODE != "gpu" \
        else "eager"
    lines = [f"device: {prov['device']} | mode: {prov['mode']} | torch {prov['torch']} | triton {prov['triton']} | "
             f"fdlib {prov.get('fdlib')} | commit {prov.get('git_commit')} | {prov['date_utc']}",
             f"command: {prov['command']}",
             f"read ceiling: {ceil['tbs']:.2f} TB/s" if ceil.get("tbs") else "read ceiling: not measured",
             f"timing: {timing}; pages of {st['page_size']} shuffled, or a contiguous cache; bf16",
             "", "## Summary: µs · × plan_host · % of ceiling", ""]
    labels = st["rows"]
    recs = results["records"]
    lines += ["| # | batch | cache | KV MB | " + " | ".join(labels) + " |",
              "|---|---|---|---|" + "---|" * len(labels)]
    keys = list(dict.fromkeys((r["case"], r["layout"]) for r in recs))
    for case, layout in keys:
        mine = {r["row"]: r for r in recs if (r["case"], r["layout"]) == (case, layout)}
        first = next(iter(mine.values()))
        lines.append(f"| {case} | {first['name']} | {layout} | {first['kv_mb']:.4g} | "
                     + " | ".join(_cell(mine.get(lab)) for lab in labels) + " |")
    lines += ["", "## Every row", "",
              "| # | cache | row | kernel | splits | µs graph | µs eager | × plan_host | TB/s | % ceiling | "
              "rel err | status |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: "" if x is None else format(x, f)  # noqa: E731
    for r in recs:
        lines.append(f"| {r['case']} | {r['layout']} | {r['row']} | {r.get('kernel', '')} "
                     f"| {fmt(r.get('splits'), 'd')} "
                     f"| {fmt(r.get('graph_us'), '.1f')} | {fmt(r.get('eager_us'), '.1f')} "
                     f"| {fmt(r.get('ratio_plan_host'), '.2f')} | {fmt(r.get('tbs'), '.2f')} "
                     f"| {fmt(r.get('pct_ceiling'), '.0f')} | {fmt(r.get('rel_err'), '.1e')} "
                     f"| {r['status']}{': ' + r['error'] if r.get('error') else ''} |")
    for s in results.get("skipped", []):
        lines.append(f"\nskipped: batch {s['case']} ({s['name']}), {s['layout']}: {s['reason']}")
    return "\n".join(lines)
