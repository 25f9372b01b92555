"""A/B timing of fdlib's methods on ragged batches, with the tiles of the row-walking kernels overridden.

    python tools/ab_ragged.py OUT.json [--cases B:H_q:H_kv:dist:mean:page,...] [--methods auto,streamk,...]

A method is a plan method (``auto``, ``streamk``, ``balanced``, ``unified``, ``split``, ``persistent``), or
``streamk@NxWxS`` / ``persistent@NxWxS``: that kernel with BLOCK_N = N keys, W warps and S pipeline stages in place
of :func:`fdlib.kernels.config.persistent_config`'s, ``balanced@NxWxS`` / ``unified@NxWxS`` / ``split@NxWxS`` /
``auto@NxWxS``: the same in place of the plan's :func:`fdlib.kernels.config.tile_config` (``worklist@NxWxS``: of
its :func:`~fdlib.kernels.config.tile_config_for`) (auto's one-wave tiles
then off: :func:`grid_tiles`), or ``streamk+NAME=VALUE``: the stream-K
kernel with the integer constant NAME (:mod:`fdlib.kernels.streamk`'s ROW_WINDOW, ALIGN_IDLE, MIN_BLOCK_B or
MAX_REGISTERS,
:mod:`fdlib.kernels.config`'s PERSISTENT_PER_SM, the row walkers' programs per SM, or :mod:`fdlib.plan`'s
TABLE_REGS_MAX, the most block-table entries a unified split holds in registers) set to VALUE; both may be
combined, ``streamk@64x4x3+PERSISTENT_PER_SM=3``; ``NAME#S`` (e.g. ``unified#4``, before any ``@`` or ``+``): the
plan of NAME with ``num_splits=S``; ``+longest_first``: the plan made with ``longest_first=True`` (e.g.
``unified#1+longest_first``: whole rows launched longest first, what run 44's ``unified#1`` ran at 68c1242;
``+device``: the plan made without the lengths (a capacity plan, as ``decode_attention`` with lengths on the
device makes); ``+WORK_CHUNK_TILES=T``: a work-list plan's pieces of at least T tiles, ``+WORK_SPLITS=S`` at most S a row, ``+WORK_WAVES=W`` W programs an SM,
``+DEVICE_SCHEDULE=1``: ``auto`` without lengths takes stream-K (:func:`fdlib.plan.device_schedule_suits`);
``+stale_order``: the plan's longest-first order reversed, so that every program sorts, as after the lengths change
order under a plan: :func:`stale_order`);
``row_read`` / ``row_read@W`` / ``row_read#S@W``: the batch's rows and pages walked in tiles of 64 keys by one
program per (KV head, sequence, split), S splits (1) of whole tiles sized for the longest row, W warps (4), with no
attention; ``flat_read``: the batch's bytes read in one launch of the
read-ceiling kernel (both :mod:`fdlib.bench.readbound`).
``--kv-dtype``/``--kv-scale``: every batch over an 8-bit cache (:mod:`fdlib.bench.kv8`, as ``--ragged``'s).
``page`` 0 is a contiguous cache; a paged batch's pages lie shuffled in the pool, or each row's in order with
``--page-order sequential``. ``dist/desc`` (e.g. ``uniform/desc``): the same lengths, sorted longest first
over b, so that the grid kernels (b stage 1's fastest grid axis, the unified kernel's second after the KV head)
launch the longest rows first and end on the shortest. Lengths, inputs and timings are the ragged bench's (:mod:`fdlib.bench.ragged`: the
same draw of lengths from ``--seed``, CUDA graphs rotating over copies holding >= 4x the L2, the read ceiling
measured in the same run); each shape's batch is planned from its host lengths. The JSON carries the device,
versions, date, command and commit.
"""
import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = "128:32:8:uniform:1024:16,32:32:8:uniform:8192:16,128:32:32:constant:1024:16,128:32:8:constant:1024:0"


def _parts(method: str) -> tuple[str, str, str]:
    """(plan method, forced split count or "", tile spec or "") of ``name[#S][@NxWxS][+NAME=VALUE...]``."""
    head, _, tiles = method.split("+")[0].partition("@")
    name, _, splits = head.partition("#")
    return name, splits, tiles


def splits_of(method: str):
    """The forced split count S of ``name#S...``, else None."""
    splits = _parts(method)[1]
    return int(splits) if splits else None


def tiles_of(method: str):
    """(plan method, TileConfig or None) of ``name``, ``name#S`` or ``name@NxWxS``."""
    from fdlib.kernels.config import TileConfig
    name, _, spec = _parts(method)
    if not spec:
        return name, None
    n, w, s = (int(x) for x in spec.split("x"))
    return name, TileConfig(BLOCK_N=n, num_warps=w, num_stages=s)


ROW_WALKERS = ("streamk", "persistent")
"""Plan methods whose tiles are :func:`fdlib.kernels.config.persistent_config`'s (the others take tile_config's)."""


@contextlib.contextmanager
def grid_tiles(tiles, method: str = "auto"):
    """Plans made inside take ``tiles`` (a TileConfig; None: change nothing): for the row walkers (``method`` in
    ROW_WALKERS) fdlib.plan's persistent_config returns them; for the others its tile_config does, and auto's
    one-wave rule (:func:`fdlib.splits.one_wave_suits`), whose tiles would replace them, is off. All three are
    restored on the way out."""
    plan_module = sys.modules["fdlib.plan"]          # the module (fdlib.plan is the function)
    saved = plan_module.tile_config, plan_module.one_wave_suits, plan_module.persistent_config
    saved_for = plan_module.tile_config_for
    if tiles is not None and method in ROW_WALKERS:
        plan_module.persistent_config = lambda *a, **k: tiles
    elif tiles is not None and method == "worklist":   # its tiles come from tile_config_for (worklist_decision)
        plan_module.tile_config_for = lambda *a, **k: tiles
    elif tiles is not None:
        plan_module.tile_config = lambda *a, **k: tiles
        plan_module.one_wave_suits = lambda *a, **k: False
    try:
        yield
    finally:
        plan_module.tile_config, plan_module.one_wave_suits, plan_module.persistent_config = saved
        plan_module.tile_config_for = saved_for


@contextlib.contextmanager
def stale_order(on: bool):
    """Plans made inside keep their longest-first order reversed (``+stale_order``; nothing where ``on`` is False
    or a plan has no order): for n >= 2 rows it fails the kernel's check (:func:`fdlib.kernels.tile.order_holds`),
    so every program sorts the lengths, as after the batch's lengths change order under a plan."""
    import fdlib
    make = fdlib.plan

    def plan(*a, **k):
        p = make(*a, **k)
        order = p.workspace.order
        if order is not None:
            order[:p.B] = order[:p.B].flip(0)
        return p
    if on:
        fdlib.plan = plan
    try:
        yield
    finally:
        fdlib.plan = make


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--methods", default="auto,streamk,balanced")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-order", default="shuffled", choices=("shuffled", "sequential"),
                    help="where a paged batch's pages lie in the pool: shuffled (default) or each row's in order")
    ap.add_argument("--max-kv-gb", type=float, default=20.0,
                    help="skip batches whose cache stores more than this (GB, default 20, as the --ragged bench)")
    ap.add_argument("--kv-dtype", choices=("float8_e4m3fn", "int8"),
                    help="an 8-bit cache (fdlib.bench.kv8): the pool quantized as stored, as the --ragged bench's")
    ap.add_argument("--kv-scale", choices=("tensor", "head", "token"),
                    help="with --kv-dtype: one scale per tensor (default), per KV head, or per token and KV head")
    ap.add_argument("--resources", action="store_true",
                    help="also list every kernel compiled (registers, spills, shared memory: "
                         "tools/kernel_resources.py)")
    args = ap.parse_args(argv)

    import fdlib
    from fdlib import runtime
    from fdlib.bench import kv8, ragged
    try:
        kv8.check(args.kv_dtype, args.kv_scale)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    kv = kv8.shape_fields(args.kv_dtype, args.kv_scale)
    from fdlib.bench.harness import measure_ceiling_or_none, provenance
    from fdlib.bench.timing import free_memory

    gpu = runtime.MODE == "gpu"
    settings = {"graphs": gpu, "warmup_ms": 10, "rep_ms": 30, "graph_rep_ms": 10, "cpu_runs": 1}
    ceil = measure_ceiling_or_none(gpu, 4, settings)
    records = []
    sk, kc, pl = sys.modules["fdlib.kernels.streamk"], sys.modules["fdlib.kernels.config"], sys.modules["fdlib.plan"]
    constants = {"ROW_WINDOW": sk, "ALIGN_IDLE": sk, "MIN_BLOCK_B": sk, "MAX_REGISTERS": sk,
                 "PERSISTENT_PER_SM": kc, "TABLE_REGS_MAX": pl, "WORK_CHUNK_TILES": pl,
                 "WORK_SPLITS": pl, "WORK_WAVES": pl, "DEVICE_SCHEDULE": pl}
    for i, text in enumerate(args.cases.split(",")):
        try:
            shape, page = ragged.parse_case(text)
            shape.update(kv)
            lens = ragged.case_lengths(shape["dist"], shape["B"], shape["mean"], args.seed + i)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        base, stored = ragged.case_record(shape, lens, page)
        if stored > args.max_kv_gb * 1e9:
            print(f"{text}: skipped, cache {stored / 1e9:.1f} GB > --max-kv-gb {args.max_kv_gb:g}")
            continue
        copies, ref = ragged.case_inputs(shape, lens, page, args.seed + i, args.page_order, stored, gpu)
        for method in args.methods.split(","):
            if method == "flat_read" or _parts(method)[0] == "row_read":
                records.append(report(text, read_record(method, base, copies, settings, ceil)))
                continue
            name, tiles = tiles_of(method)
            saved = {k: getattr(m, k) for k, m in constants.items()}
            plan_kw, stale = {}, False
            for item in method.split("+")[1:]:
                if item == "longest_first":
                    plan_kw["longest_first"] = True
                    continue
                if item == "stale_order":
                    stale = True
                    continue
                if item == "device":   # planned without the lengths, as decode_attention with device lengths
                    plan_kw["lengths"] = None
                    continue
                key, _, val = item.partition("=")
                if key not in saved:
                    raise SystemExit(f"--methods: {method!r}: expected longest_first, stale_order or one of "
                                     f"{', '.join(constants)} after '+', got {key!r}")
                setattr(constants[key], key, int(val))
            try:
                with grid_tiles(tiles, name), stale_order(stale):
                    rec = ragged._measure(name, copies, ref, base, settings, ceil, splits_of(method), plan_kw)
            finally:
                for k, v in saved.items():
                    setattr(constants[k], k, v)
            rec["method"] = method
            records.append(report(text, rec))
        del copies, ref
        free_memory()
        save(args, records, settings, ceil, argv, final=False)   # what ran so far survives a timeout
    save(args, records, settings, ceil, argv, final=True)


def save(args, records, settings, ceil, argv, final: bool) -> None:
    """Write the JSON (device, versions, date, command, commit; ``complete`` False until every case ran)."""
    import fdlib
    from fdlib.bench.harness import provenance
    out = {"schema": "fdlib.bench/1", "kind": "ab-ragged", "fdlib": fdlib.__version__,
           "provenance": provenance("python tools/ab_ragged.py " + " ".join(argv or sys.argv[1:])),
           "settings": settings, "page_order": args.page_order, "ceiling": ceil, "records": records,
           "complete": final}
    if final and args.resources:
        out["kernels"] = kernel_rows()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def report(case: str, rec: dict) -> dict:
    """Print one record's line (graph µs, else eager µs in the interpreter) and return the record."""
    us = rec.get("graph_us", rec.get("eager_us", float("nan")))
    print(f"{case:32s} {rec['method']:22s} {rec.get('kernel')} {us:9.1f} us "
          f"{rec.get('pct_ceiling', float('nan')):5.1f}% {rec['status']}", flush=True)
    return rec


def read_record(method: str, base: dict, copies, settings: dict, ceil) -> dict:
    """The record of a read of the batch's bytes without attention (:mod:`fdlib.bench.readbound`): ``flat_read``,
    one launch of the read-ceiling kernel with the ceiling's best tile; ``row_read``, ``row_read@W`` or
    ``row_read#S@W``, the row walk over the batch's own rows and pages in 1 (or S) splits a row with 4 (or W) warps
    and tiles of 64 keys, checked against float64."""
    from fdlib.bench.readbound import flat_read_us, row_read_us
    timing = (settings["graph_rep_ms"], settings["warmup_ms"], settings["rep_ms"])
    _, splits, warps = _parts(method)
    rec = dict(base, method=method, status="ok", splits=int(splits or 1))
    if method == "flat_read":
        us = flat_read_us(int(base["kv_mb"] * 1e6), (ceil or {}).get("best_tile"), settings["graphs"], *timing)
        rec["kernel"] = "read_sum"
    else:
        warps = int(warps or 4)
        us, err = row_read_us(copies, settings["graphs"], 64, warps, *timing, splits=rec["splits"])
        rec.update(kernel="row_read", num_warps=warps, rel_err=err)
        if not err < 1e-4:
            rec.update(status="failed", reason=f"relative error {err:.3g}")
    rec["graph_us" if settings["graphs"] else "eager_us"] = us
    rec["tbs"] = base["kv_mb"] / us
    if ceil and ceil.get("tbs"):
        rec["pct_ceiling"] = 100 * rec["tbs"] / ceil["tbs"]
    return rec


def kernel_rows() -> list[dict]:
    """tools/kernel_resources.py's rows of the kernels this process compiled (GPU only), printed too."""
    import kernel_resources
    rows = kernel_resources.kernel_rows(kernel_resources.SHOWN + ("BLOCK_B",))
    for r in rows:
        print(kernel_resources.row_text(r), flush=True)
    return rows


if __name__ == "__main__":
    main()
