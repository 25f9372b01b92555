"""Every choice fdlib's chooser makes on the benchmarked cases, one line a case, with no GPU.

    python tools/decision_table.py [OUT.txt] [--set NAME=VALUE ...] [--diff results/cpu/decisions/baseline.txt.gz]
    python tools/decision_table.py results/cpu/decisions/sensitivity.txt --diff results/cpu/decisions/baseline.txt.gz --sweep

For each case it prints, on one line, what :func:`fdlib.plan.decide` returns (the kernel, splits, chunk, tiles, programs, budget,
pack, order, ...: the :class:`~fdlib.plan.Decision`'s repr), under each GPU identity the chooser tells apart:

* ``H100``, ``H200``: a compiled run (``runtime.INTERPRET`` off) on a live GPU of 132 SMs named as the driver names
  it (the chooser reads words of the name, :func:`fdlib.splits.persistent_max_keys`), with the cost model's
  calibration fixed to the one measured on that GPU (below), and no kernel launched yet in the process (the cost
  model's programs-per-SM estimate, not a compiled kernel's resources); ``H200+launched``: the same after the
  unified kernel at D=128 has run (its compiled resources, :data:`LAUNCHED`);
* ``interp``: Triton's interpreter, the pretend GPU of :data:`fdlib.splits.INTERPRETER_SMS` SMs.

The cases are the benchmarks' batches: the dense grid (:data:`fdlib.bench.harness.DEFAULT_GRID`), the heads sweep
(:data:`~fdlib.bench.harness.HEADS_SWEEP`), the query-length grid (:data:`fdlib.bench.qlen.QLEN_GRID`), the ragged grid
(:data:`fdlib.bench.ragged.RAGGED_GRID`, lengths drawn as ``--ragged`` draws them) and the batches of
``tools/ab_ragged.py`` runs (``tools/gpu_common.sh``'s kernel grid, the persistent and device-lengths grids), the
seven serving batches (:data:`fdlib.bench.serving.CASES`, issue 50's), each contiguous and over pages of 16, with
host lengths and without (device lengths: the plan ``decode_attention`` makes), ``auto`` everywhere and, with host
lengths, every other method, ``batch_invariant=True``, forced split counts, ``max_seqlen``, ``longest_first`` and
``pack_heads``; 8-bit caches on the serving batches.
A refactor of the chooser that changes no line of this table changes no decision on those cases.
"""
from __future__ import annotations

import os
import sys

for _var in [v for v in os.environ if v.startswith("FDLIB_") and v not in ("FDLIB_CACHE",)]:
    del os.environ[_var]   # settings read at import (FDLIB_INVARIANT_WAVES, ...) at their defaults
os.environ["FDLIB_INTERPRET"] = "1"
os.environ["TRITON_INTERPRET"] = "1"
os.environ["FDLIB_NO_CALIBRATE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fdlib import calibration, costmodel, gpus, quant, runtime  # noqa: E402
from fdlib.bench import harness  # noqa: E402
from fdlib.plan import decide  # noqa: E402

from decision_cases import cases, constant, holders, paged_cap, parse_set  # noqa: E402  (tools/, beside it)

# The calibrations measured on each GPU (results/h100/default-landed/calibrate.txt, results/h200/calibration.json),
# fixed here so that the table does not move when a newer run is committed.
CALIBRATIONS = {
    "H100": costmodel.Calibration(bw_tbs=3.3081250000000004, rho_tbs=0.044721359549995794,
                                  t_launch_us=3.4428852516851194, t_wave_us=2.076655615751778, t_merge_us=0.0,
                                  t_split_us=0.04506570011991934, source="H100 run", t_stage2_us=1.9),
    "H200": costmodel.Calibration(bw_tbs=5.160000000000001, rho_tbs=0.04819930185472696,
                                  t_launch_us=4.451256031000559, t_wave_us=2.5119083131824484,
                                  t_merge_us=0.10146259825608767, t_split_us=0.05912518846825979, source="H200 run",
                                  t_stage2_us=1.9),
}
LIVE = {"H100": gpus.GPU("NVIDIA H100 80GB HBM3 (live)", sms=132, bandwidth_tbs=3.35, l2_mb=50),
        "H200": gpus.GPU("NVIDIA H200 (live)", sms=132, bandwidth_tbs=4.8, l2_mb=60)}
IDENTITIES = ("H100", "H200", "H200+launched", "interp")
LAUNCHED = {128: {"num_warps": 4, "n_regs": 191, "shared": 139264}, 64: {"num_warps": 4, "n_regs": 136, "shared": 71680}}
"""The compiled unified kernel's resources at D=128 (results/h200/kernel-resources.json), by BLOCK_N: what the cost
model counts programs an SM from once that kernel has run in the process (``H200+launched``)."""


def become(identity: str) -> None:
    """Make the chooser plan for ``identity`` (see the module doc)."""
    if identity == "interp":
        runtime.INTERPRET = True
        gpus.live_gpu = lambda: None
        return
    from fdlib.kernels import unified
    unified._RESOURCES.clear()
    if identity.endswith("+launched"):
        identity = identity[:-len("+launched")]
        for dtype in (torch.float16, torch.bfloat16):
            for group in (1, 4):
                for block_n, res in LAUNCHED.items():
                    unified._RESOURCES[(dtype, 128, group, block_n)] = dict(res)
    runtime.INTERPRET = False
    torch.cuda.is_current_stream_capturing = lambda: False   # a CPU build of torch has no CUDA streams
    gpu = LIVE[identity]
    gpus.live_gpu = lambda: gpu
    calibration._CAL[gpu.name] = CALIBRATIONS[identity]


def variants(kv, B: int):
    """(tag, lengths given? (None: max_seqlen), decide keywords) of a case."""
    yield "host auto", True, dict(method="auto")
    yield "device auto", False, dict(method="auto")
    if kv is None:
        for m in ("unified", "split", "balanced", "persistent", "streamk", "worklist"):
            yield f"host {m}", True, dict(method=m)
        yield "host invariant", True, dict(method="auto", batch_invariant=True)
        yield "device invariant", False, dict(method="auto", batch_invariant=True)
        yield "max_seqlen auto", None, dict(method="auto")
        yield "device worklist", False, dict(method="worklist")
        for s in (1, 4):
            yield f"host auto#{s}", True, dict(method="auto", num_splits=s)
        yield "host auto longest_first=False", True, dict(method="auto", longest_first=False)
        if B <= 128:
            yield "host unified longest_first=True", True, dict(method="unified", longest_first=True)
        for p in (True, False):
            yield f"host auto pack_heads={p}", True, dict(method="auto", pack_heads=p)


def decision(B, hq, hk, D, dt, lens, page, q_len, kv, given, kw) -> str:
    dtype = harness.DTYPES[dt]
    L_max = paged_cap(lens, page)
    fmt = quant.plan_format(*kv, dtype) if kv else None
    pack = False if fmt is not None and (fmt.k != "tensor" or fmt.v != "tensor") else None
    kw = dict(kw)
    kw.setdefault("pack_heads", pack)
    try:
        d = decide(B, hq, hk, D, L_max, fmt or dtype, lengths=tuple(lens) if given else None, q_len=q_len,
                   paged=page, max_seqlen=max(lens) if given is None else None, **kw)
    except Exception as e:  # noqa: BLE001 - an error is a decision too
        return f"error {type(e).__name__}: {e}"
    return compact(d)


def compact(d) -> str:
    """A decision's fields, those at their defaults left out, tiles as BLOCK_N/warps/stages, the basis by its first
    word."""
    from dataclasses import fields
    parts = [d.kernel]
    for f in fields(d)[1:]:
        v = getattr(d, f.name)
        if f.name == "tile":
            parts.append("tile=" + ("-" if v is None else f"{v.BLOCK_N}/{v.num_warps}/{v.num_stages}"))
        elif f.name == "basis":   # its first words: host, max_seqlen, capacity, device, batch-invariant
            parts.append(f"basis={v.split(':')[0].split()[0]}")
        elif f.name in ("splits", "chunk", "L_cap") or v != f.default:
            parts.append(f"{f.name}={v}")
    return " ".join(parts)


def table() -> list[str]:
    rows = list(cases())
    lines = []
    for identity in IDENTITIES:
        become(identity)
        for label, B, hq, hk, D, dt, lens, page, q_len, kv in rows:
            where = f"pages of {page}" if page else "contiguous"
            chosen = " ; ".join(f"{tag}: {decision(B, hq, hk, D, dt, lens, page, q_len, kv, given, kw)}"
                                for tag, given, kw in variants(kv, B))
            lines.append(f"{identity} | {label} | {where} | L_max={paged_cap(lens, page)} sum={sum(lens)} | {chosen}")
    return lines


def set_constant(text: str) -> None:
    """``NAME=VALUE`` (a Python literal): NAME set to VALUE in every fdlib module that has it (a module that
    imported it by name holds its own copy), for the whole run."""
    name, value = parse_set(text)
    for m in holders(name):
        setattr(m, name, value)


SWEEP = (
    ("EPILOGUE_WORK", (5000, 20000, 10**12)), ("TWO_STAGE_SPLITS", (24, 48, 10**6)),
    ("PAGED_EPILOGUE_WORK", (12000, 50000, 10**12)),
    ("STREAMK_MAX_MEAN", (1024, 4096, 10**12)), ("STREAMK_PAGED_MIN_TILES", (20, 80, 10**12)),
    ("STREAMK_PAGED_DENSE_TILES", (192, 768, 10**12)), ("LONGEST_FIRST_IMBALANCE", (1.0, 1.1, 0.0)),
    ("ONE_WAVE_WAVES", (1, 3, 100)),
    ("ONE_WAVE_MAX_KEYS", (512, 2048, 0)), ("PERSISTENT_MIN_WAVES", (1, 3, 10**6)),
    ("PERSISTENT_MAX_KEYS", ({"H200": 32768, "H100": 1536}, {"H200": 131072, "H100": 1536},
                             {"H200": 65536, "H100": 768}, {"H200": 65536, "H100": 3072}, {"H200": 0, "H100": 0})),
    ("PACK_MIN_ROWS", (4, 16, 10**6)), ("PACK_MIN_BYTES", (1 << 26, 1 << 28, 1 << 62)),
)
"""The chooser's constants and the values :func:`sweep` tries for each: about half and twice the value, and one
that turns its rule off."""


def sweep(base: list[str]) -> list[str]:
    """For each constant of SWEEP at each value: the cases (identity | batch | cache) whose line differs from
    ``base``."""
    out = []
    for name, values in SWEEP:
        for value in values:
            setting = constant(name, value)
            with setting:
                changed = [" | ".join(b.split(" | ")[:3]) for a, b in zip(base, table()) if a != b]
            out.append(f"{name}={value!r} (now {setting.kept[0]!r}): {len(changed)} of {len(base)} lines differ")
            out += [f"    {c}" for c in changed]
    return out


def _open(path, mode="r"):
    """A text file, gzip-compressed where its name ends in .gz (the committed baseline is)."""
    import gzip
    return gzip.open(path, mode + "t") if str(path).endswith(".gz") else open(path, mode)


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="write the table here (default: stdout)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a chooser constant at another value (Python literal), in every fdlib module holding it")
    ap.add_argument("--diff", metavar="BASELINE", help="print only the lines that differ from BASELINE's, and their "
                                                       "count (exit status 1 if any)")
    ap.add_argument("--sweep", action="store_true", help="with --diff: each constant of SWEEP at other values, the "
                                                             "cases whose choice changes")
    args = ap.parse_args()
    for item in args.set:
        set_constant(item)
    lines = table()
    if args.diff:
        with _open(args.diff) as f:
            base = f.read().splitlines()
        if args.sweep:
            text = "\n".join(sweep(base)) + "\n"
            if args.out:
                with _open(args.out, "w") as f:
                    f.write(text)
            else:
                sys.stdout.write(text)
            return
        changed = [(a, b) for a, b in zip(base, lines) if a != b]
        if len(base) != len(lines):
            print(f"{len(base)} lines in {args.diff}, {len(lines)} now")
        for a, b in changed:
            print(f"- {a}\n+ {b}")
        print(f"{len(changed)} of {len(lines)} lines differ")
        raise SystemExit(1 if changed or len(base) != len(lines) else 0)
    text = "\n".join(lines) + "\n"
    if args.out:
        with _open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
