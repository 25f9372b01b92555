"""Record per-program timelines of the split, balanced and stream-K plans on a GPU (results/notes/06_paged_ragged.md
reads them; Lab 06 draws the model's timelines).

    python tools/record_timeline.py --out OUT_DIR [--seed 0] [--repeats 5]
    python tools/record_timeline.py --out OUT_DIR --cases B:H_q:H_kv:dist:mean:page,... \
        [--methods auto,streamk,auto@16x4x3]

For each of Lab 06's ragged batches (``fdlib.course.timeline.BATCH``: B=32, H 32:8, D=128, fp16; lengths
``fdlib.course.timeline.batch_lengths``: "uniform" in 1..32768, the batch of issue 13, and "zipf", Zipf-like of mean 8192,
both from ``--seed``), or for each of ``--cases`` (the ragged bench's batches, :mod:`fdlib.bench.ragged`: lengths
drawn from ``dist`` with mean ``mean`` and seed ``--seed`` + the case's place, D=128, fp16, ``page`` 0 a
contiguous cache, else pages of that many keys in shuffled order; ``dist/desc``: sorted longest first; written as
``timeline-B<B>-<H_q>x<H_kv>-<dist>-<mean>-page<page>.json``), it plans each method (``split``, ``balanced``,
``streamk``, and ``auto`` for reference) with the host lengths, runs it once to compile, then ``--repeats`` times
with the timeline flag (``plan.run(q, k, v, lens, timeline=plan.timeline_buffer())``: one row (SM id, start ns,
end ns) per program, from the GPU's global timer), keeps the run of median makespan and prints where it goes
(``fdlib.course.timeline.Timeline.span_parts``: ramp, gaps, busy, tail). It writes ``OUT_DIR/timeline-<batch>.json``
(``fdlib.course.timeline.save_recorded``, read back by ``fdlib.course.timeline.load_recorded``) with the provenance of
``fdlib.bench.harness.provenance`` (device, versions, date, this command). Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

import fdlib
from fdlib import runtime
from fdlib.course import timeline
from fdlib.bench.harness import provenance, reference_rows, rel_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_ragged import grid_tiles, splits_of, tiles_of  # noqa: E402  (NAME#S and NAME@NxWxS, as tools/ab_ragged.py)

METHODS = ("split", "balanced", "streamk", "auto")


def record_batch(name: str, seed: int, repeats: int, methods=METHODS) -> tuple[dict, list]:
    """(batch description, runs) of one of Lab 06's batches: every method's plan, run ``repeats`` times with the
    timeline on."""
    b = timeline.BATCH
    B, H_q, H_kv, D = b["B"], b["H_q"], b["H_kv"], b["D"]
    dtype = getattr(torch, b["dtype"])
    lengths = timeline.batch_lengths(name, seed, B)
    L_max = max(lengths)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H_q, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, L_max, H_kv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, L_max, H_kv, D, device="cuda", dtype=dtype, generator=g)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    ref = reference_rows(q, k, v, lengths)                              # float32, one sequence at a time
    batch = dict(b, name=name, seed=seed, lengths=lengths, L_max=L_max,
                 kv_mb=2 * sum(lengths) * H_kv * D * dtype.itemsize / 1e6)
    return batch, record_runs(batch, (q, k, v, lens, None), ref, repeats, methods)


def case_name(text: str) -> str:
    """``timeline-<this>.json`` of a ``--cases`` entry B:H_q:H_kv:dist:mean:page."""
    B, H_q, H_kv, dist, mean, page = text.split(":")
    return f"B{B}-{H_q}x{H_kv}-{dist.replace('/', '-')}-{mean}-page{page}"


def record_case(text: str, seed: int, repeats: int, methods) -> tuple[dict, list]:
    """(batch description, runs) of a ragged-bench batch B:H_q:H_kv:dist:mean:page
    (:func:`fdlib.bench.ragged.parse_case`; the lengths of :func:`fdlib.bench.ragged.case_lengths`; pages
    shuffled)."""
    from fdlib.bench import ragged
    try:
        shape, page = ragged.parse_case(text)
        lengths = ragged.case_lengths(shape["dist"], shape["B"], shape["mean"], seed)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    inputs = ragged._inputs(shape, lengths, page, seed)
    q, k, v, lens, bt = inputs
    ref = reference_rows(q, k, v, lengths, bt)
    base, _ = ragged.case_record(shape, lengths, page)
    batch = dict(base, name=case_name(text), seed=seed, lengths=lengths)
    return batch, record_runs(batch, inputs, ref, repeats, methods)


def record_runs(batch: dict, inputs, ref, repeats: int, methods) -> list:
    """Every method's plan for ``batch`` (planned from its host lengths), run once to compile and check against
    ``ref``, then ``repeats`` times with the timeline on; the run of median makespan is kept."""
    q, k, v, lens, bt = inputs
    B, H_q, D = q.shape
    H_kv = k.shape[2]
    lengths = batch["lengths"]
    runs = []
    for method in methods:
        # "unified#4": the plan of unified with num_splits=4; "auto@16x4x3": auto's plan with those tiles
        name, tiles = tiles_of(method)
        L_max = max(lengths) if bt is None else bt.shape[1] * k.shape[1]   # a paged plan covers its whole table
        with grid_tiles(tiles, name):
            plan = fdlib.plan(B, H_q, H_kv, D, L_max, dtype=q.dtype, device=q.device, lengths=lengths,
                              method=name, num_splits=splits_of(method),
                              page_size=k.shape[1] if bt is not None else None)
        out = plan.run(q, k, v, lens, block_table=bt)                   # compile, and check the numbers
        if q.is_cuda:
            torch.cuda.synchronize()
        err = rel_error(out, ref)
        if not err < 1e-2:
            raise RuntimeError(f"{batch['name']} batch, method {method}: relative error {err:.3g} against the "
                               f"reference")
        recorded = []
        for _ in range(repeats):
            buf = plan.timeline_buffer()
            plan.run(q, k, v, lens, block_table=bt, timeline=buf)
            torch.cuda.synchronize()
            rows = buf.cpu()
            ran = rows[:, 2] > 0
            span = int(rows[ran, 2].max() - rows[ran, 1].min()) if bool(ran.any()) else 0
            recorded.append((span, rows.tolist()))
        recorded.sort(key=lambda r: r[0])
        span, rows = recorded[len(recorded) // 2]
        d = plan.decision
        mode = (f"{method}: {d.kernel} kernel, {d.splits} splits of {d.chunk} keys"
                + (f", budget {d.budget}" if d.kernel == "balanced" else "")
                + (f", {d.programs} programs" if d.kernel == "streamk" else ""))
        parts = timeline.from_buffer(rows, "GPU", mode).span_parts()
        runs.append(dict(method=method, mode=mode, kernel=d.kernel, splits=d.splits, chunk=d.chunk,
                         budget=d.budget, block_n=d.tile.BLOCK_N if d.tile else None, rel_err=err,
                         makespans_us=[r[0] / 1e3 for r in recorded], span_parts_us=parts, programs=rows))
        print(f"{batch['name']:8s} {mode}: makespan {span / 1e3:.1f} µs (median of {repeats}), relative error "
              f"{err:.2e}; ramp {parts['ramp']:.1f}, gaps {parts['gaps']:.1f}, busy {parts['busy']:.1f}, tail "
              f"{parts['tail']:.1f} µs (SM means), program {parts['program']:.1f} µs, "
              f"{parts['programs_per_sm']} at once an SM", flush=True)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for timeline-<batch>.json")
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths and the inputs (default 0)")
    ap.add_argument("--repeats", type=int, default=5, help="recorded runs per method; the median makespan is kept")
    ap.add_argument("--batches", default="uniform,zipf", help="comma-separated: uniform, zipf")
    ap.add_argument("--cases", default="", help="comma-separated ragged-bench batches B:H_q:H_kv:dist:mean:page "
                                                "(in place of --batches)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated (default {','.join(METHODS)}); NAME#S plans NAME with num_splits=S, "
                         "NAME@NxWxS with tiles of N keys, W warps and S stages (as tools/ab_ragged.py)")
    args = ap.parse_args(argv)
    if runtime.MODE != "gpu":
        print("record_timeline: needs a CUDA GPU (the timestamps come from the GPU's global timer)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "tools/record_timeline.py", *map(shlex.quote, sys.argv[1:] if argv is None
                                                                   else argv)])
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.cases:
        todo = [(case_name(c), lambda c=c, i=i: record_case(c, args.seed + i, args.repeats, methods))
                for i, c in enumerate(args.cases.split(","))]
    else:
        todo = [(n.strip(), lambda n=n: record_batch(n.strip(), args.seed, args.repeats, methods))
                for n in args.batches.split(",")]
    for name, record in todo:
        batch, runs = record()
        path = timeline.save_recorded(out / f"timeline-{name}.json", batch, runs, provenance(command))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
