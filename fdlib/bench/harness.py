r"""The benchmark: shapes x methods, correctness first, then eager and CUDA-graph timings.

For every shape (dtype, B, H_q, H_kv, L, D; every sequence of length L):

1. random q, K, V; the reference O in float32 on the GPU (float64 :func:`fdlib.reference_attention` in the
   interpreter);
2. for each method: one call, relative error :math:`\lVert O - O_{ref}\rVert / \lVert O_{ref}\rVert`; a method
   at or above the tolerance (1e-2 for fp16/bf16, 1e-3 for fp32) is marked failed and not timed;
3. eager and CUDA-graph median µs (see :mod:`fdlib.bench.timing` for the L2 handling), effective bandwidth
   = KV bytes / time with KV bytes = 2·B·H_kv·L·D·elem_size, % of the read ceiling measured in the same run,
   and time / cuDNN's time.

:func:`run_sweep` times the unified kernel at every candidate split count instead, and compares the best with
the split counts fdlib and the cost model choose.
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import subprocess
import sys

import torch
import triton

from .. import costmodel, runtime
from ..gpus import live_gpu
from ..kernels.config import MAX_SPLITS, chunk_for
from ..reference import reference_attention
from . import kv8
from . import methods as M
from .ceiling import measure_ceiling
from .timing import (L2_FACTOR, Rotating, copies_for_l2, free_memory, l2_bytes, synchronize, time_eager,
                     time_graph)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SCHEMA = "fdlib.bench/1"

DEFAULT_GRID = dict(B=(1, 4, 16, 64), L=(512, 2048, 8192, 32768, 131072), heads=((32, 8), (32, 32)), D=(128,),
                    dtypes=("float16", "bfloat16"))
HEADS_SWEEP = dict(B=(1, 8), L=(8192, 65536, 262144), heads=((16, 16), (16, 4), (16, 2), (16, 1)), D=(64, 128, 256),
                   dtypes=("float16",))
"""Issue-11 grid of head layouts: groups 1, 4, 8 and 16 (H_kv=1 is MQA) at H_q=16, three head dims."""
QUICK_GRID = dict(B=(2,), L=(64, 200), heads=((4, 2),), D=(32,), dtypes=("float16",))
SWEEP_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def tolerance(dtype_name: str) -> float:
    return 1e-2 if dtype_name in ("float16", "bfloat16") else 1e-3


def elem_bytes(shape: dict) -> int:
    return DTYPES[shape["dtype"]].itemsize


def kv_bytes(shape: dict) -> int:
    """Bytes of K and V fdlib reads in one step: every key of every row, 1 byte an element and the per-token scales for
    an 8-bit cache (:func:`fdlib.bench.kv8.bytes_per_key`)."""
    return shape["B"] * shape["H_kv"] * shape["L"] * kv8.bytes_per_key(shape, elem_bytes(shape))


def kv16_bytes(shape: dict) -> int:
    """Bytes of the 16-bit cache (what SDPA's peers read, and what a shape allocates besides an 8-bit cache)."""
    return 2 * shape["B"] * shape["H_kv"] * shape["L"] * shape["D"] * elem_bytes(shape)


def shape_grid(B, L, heads, D, dtypes, max_kv_gb=20.0, kv=None):
    """(shapes to run, shapes skipped with the reason); order: dtype, heads, B, L. ``kv``: the fields of an 8-bit
    cache (:func:`fdlib.bench.kv8.shape_fields`), given to every shape; the limit counts its 16-bit cache."""
    shapes, skipped = [], []
    for dt in dtypes:
        for (hq, hkv) in heads:
            for d in D:
                for b in B:
                    for l in L:
                        s = {"dtype": dt, "B": int(b), "H_q": int(hq), "H_kv": int(hkv), "L": int(l), "D": int(d),
                             **(kv or {})}
                        nb = kv16_bytes(s)
                        if nb > max_kv_gb * 1e9:
                            skipped.append(dict(s, kv_mb=nb / 1e6, reason=f"KV {nb / 1e9:.1f} GB > --max-kv-gb {max_kv_gb}"))
                        else:
                            shapes.append(s)
    return shapes, skipped


# ----------------------------------------------------------------------------------------------- inputs

def make_inputs(shape: dict, seed: int = 0) -> M.Inputs:
    g = torch.Generator(device=runtime.DEVICE).manual_seed(seed)
    dt, dev = DTYPES[shape["dtype"]], runtime.DEVICE
    B, Hq, Hkv, L, D = (shape[k] for k in ("B", "H_q", "H_kv", "L", "D"))
    q = torch.randn(B, Hq, D, generator=g, device=dev, dtype=dt)
    k = torch.randn(B, L, Hkv, D, generator=g, device=dev, dtype=dt)
    v = torch.randn(B, L, Hkv, D, generator=g, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    return M.Inputs(q, k, v, lens)


def reference(inp: M.Inputs) -> torch.Tensor:
    """O_ref [B, H_q, D]: float32 on the GPU (:func:`reference_rows`), float64 fdlib reference on the CPU."""
    if inp.q.device.type != "cuda":
        return reference_attention(inp.q, inp.k, inp.v)[0]
    return reference_rows(inp.q, inp.k, inp.v)


def row_keys(k, v, b: int, L: int, block_table=None):
    """The first L keys and values of sequence b, [L, H_kv, D] each: rows of a contiguous cache, or pages gathered
    through ``block_table``."""
    if block_table is None:
        return k[b, :L], v[b, :L]
    idx = block_table[b, : -(-L // k.shape[1])].long()
    H_kv, D = k.shape[2], k.shape[3]
    return k[idx].reshape(-1, H_kv, D)[:L], v[idx].reshape(-1, H_kv, D)[:L]


def reference_rows(q, k, v, lens=None, block_table=None) -> torch.Tensor:
    """O_ref [B, H_q, D] in float32, one sequence at a time (the whole score matrix of a long cache never
    exists at once): every row L_max long, or ``lens`` long; K/V contiguous, or pages gathered through
    ``block_table``. A length-0 row gives 0."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = 1.0 / math.sqrt(D)
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        L = k.shape[1] if lens is None else int(lens[b])
        if L == 0:
            continue
        kb, vb = row_keys(k, v, b, L, block_table)
        qg = q[b].float().reshape(Hkv, Hq // Hkv, D)
        p = torch.softmax(torch.matmul(qg, kb.float().permute(1, 2, 0)) * scale, dim=-1)    # [H_kv, group, L]
        out[b] = torch.matmul(p, vb.float().permute(1, 0, 2)).reshape(Hq, D)
        del p
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.detach().to(ref.device, torch.float64).reshape(ref.shape)
    r = ref.to(torch.float64)
    den = float(r.norm())
    return float((o - r).norm()) / (den if den > 0 else 1.0)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


# ----------------------------------------------------------------------------------------------- progress

class Progress:
    """tqdm on stderr when importable, else a one-line ``\\r`` counter on stderr; silent when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled, self.n, self.bar = total, desc, enabled, 0, None
        if enabled:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
            except Exception:  # noqa: BLE001 - tqdm is optional
                self.bar = None

    def update(self, note: str = ""):
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(1)
        else:
            sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} {note[:60]:<60}")
            sys.stderr.flush()

    def close(self):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ----------------------------------------------------------------------------------------------- provenance

def _git():
    """(commit, dirty) of the code that runs. A run from a ``git archive`` snapshot has no git metadata: its commit
    comes from ``FDLIB_GIT_COMMIT`` (set by ``tools/gpu_snapshot.sh``), and a snapshot is clean by construction."""
    if os.environ.get("FDLIB_GIT_COMMIT"):
        return os.environ["FDLIB_GIT_COMMIT"], False
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                    capture_output=True, text=True, timeout=10).stdout.strip()) if commit else None
        return commit, dirty
    except Exception:  # noqa: BLE001 - no git on the machine
        return None, None


def provenance(command: str | None) -> dict:
    from .. import __version__   # set last in fdlib/__init__.py: read when called
    commit, dirty = _git()
    cudnn = None
    try:
        cudnn = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        pass
    return {
        "device": runtime.device_name(),
        "sm_count": runtime.sm_count(),
        "l2_mb": l2_bytes() / 2**20 if torch.cuda.is_available() else None,
        "mode": runtime.MODE,
        "runtime": runtime.describe(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "python": platform.python_version(),
        "fdlib": __version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


# ----------------------------------------------------------------------------------------------- one method

def _measure(method: M.Method, copies: list[M.Inputs], ref, tol, settings) -> dict:
    """Correctness, then eager and graph timings of one method on one shape's input copies."""
    rec = {"method": method.name, "kind": method.kind, **method.info, "status": "ok"}
    calls = [method.make(c) for c in copies]
    with method.context():
        out = calls[0]()
        synchronize()
    err = rel_error(out, ref)
    del out
    rec["rel_err"] = err
    if not math.isfinite(err) or err >= tol:
        rec.update(status="failed", reason=f"relative error {err:.3g} >= tolerance {tol:g}; not timed")
        return rec
    if settings.get("eager", True) or not settings["graphs"]:
        rec["eager_us"] = time_eager(calls[0], settings["warmup_ms"], settings["rep_ms"], settings["cpu_runs"],
                                     context=method.context)
    if settings["graphs"]:
        try:
            rec["graph_us"] = time_graph(Rotating(calls), settings["graph_rep_ms"], context=method.context)
            rec["graph_copies"] = len(calls)
        except Exception as e:  # noqa: BLE001 - a capture failure costs the graph column only
            rec["graph_us"] = None
            rec["graph_error"] = _short(e)
            free_memory()
    return rec


def _copies(base: M.Inputs, n: int, layout: str) -> list[M.Inputs]:
    first = M.to_layout(base, layout)
    out = [first]
    for _ in range(n - 1):
        out.append(M.Inputs(first.q.clone(), first.k.clone(), first.v.clone(),
                            None if first.lens is None else first.lens.clone(), kv8.clone(first.k_scale),
                            kv8.clone(first.v_scale)))
    return out


def quantized_inputs(base: M.Inputs, shape: dict) -> tuple[M.Inputs, M.Inputs]:
    """(fdlib's inputs, the 16-bit ones for the reference and the peers) of a shape: the same for a 16-bit cache; for
    an 8-bit one (:mod:`fdlib.bench.kv8`) the stored cache with its scales, and the 16-bit cache it stands for."""
    if kv8.fmt(shape) is None:
        return base, base
    k8, v8, ks, vs, kd, vd = kv8.quantize(base.k, base.v, shape)
    return M.Inputs(base.q, k8, v8, base.lens, ks, vs), M.Inputs(base.q, kd, vd, base.lens)


def _run_methods(shape, built, settings, seed):
    """Records of every method on one shape (fdlib layout first, then the peers' layout)."""
    nb = kv_bytes(shape)
    tol = tolerance(shape["dtype"])
    n_copies = copies_for_l2(nb) if settings["graphs"] else 1
    fd_base, base = quantized_inputs(make_inputs(shape, seed), shape)
    ref = reference(base)
    records = []
    for layout in ("fdlib", "bhld"):
        todo = [(name, m) for name, m in built if not isinstance(m, str) and m.layout == layout]
        if not todo:
            continue
        try:
            copies = _copies(fd_base if layout == "fdlib" else base, n_copies, layout)
        except Exception as e:  # noqa: BLE001 - e.g. no memory for the peers' copy of a huge cache
            for name, m in todo:
                records.append({"method": name, "kind": m.kind, "status": "unavailable",
                                "reason": f"could not build inputs: {_short(e)}"})
            free_memory()
            continue
        for name, m in todo:
            try:
                rec = _measure(m, copies, ref, tol, settings)
                if m.kind == "fdlib":
                    rec.update(M.fdlib_splits(fd_base.q, fd_base.k, fd_base.v, m.info["fdlib_method"],
                                               m.info["num_splits"], m.info.get("batch_invariant", False),
                                               fd_base.k_scale, fd_base.v_scale, fd_base.lens))
            except Exception as e:  # noqa: BLE001 - a method that raises is recorded, the run goes on
                status = "unavailable" if (m.kind == "peer" or _is_oom(e)) else "error"
                rec = {"method": name, "kind": m.kind, **m.info, "status": status, "reason": _short(e)}
                free_memory()
            records.append(rec)
            settings["progress"].update(f"{name} {shape['dtype']} B={shape['B']} L={shape['L']}")
        del copies
        free_memory()
    for name, m in built:
        if isinstance(m, str):   # could not even be built (e.g. torch without torch.nn.attention)
            records.append({"method": name, "kind": "peer", "status": "unavailable", "reason": m})
            settings["progress"].update(name)
    del base, fd_base, ref
    free_memory()
    for rec in records:
        rec.update(shape)
        rec["kv_bytes"] = nb if rec.get("kind") != "peer" else kv16_bytes(shape)   # the bytes each one reads
        rec["kv_mb"] = nb / 1e6
        rec["l2_copies"] = n_copies
    return records


def _derive(records, ceiling_tbs):
    """Add TB/s, % of ceiling and ratio to cuDNN (eager and graph) to every timed record."""
    key = lambda r: (r["dtype"], r["B"], r["H_q"], r["H_kv"], r["L"], r["D"])  # noqa: E731
    base = {key(r): r for r in records if r["method"] == M.BASELINE and r["status"] == "ok"}
    for r in records:
        for mode in ("eager", "graph"):
            us = r.get(f"{mode}_us")
            if not us:
                continue
            tbs = r["kv_bytes"] / us / 1e6
            r[f"{mode}_tbs"] = tbs
            r[f"{mode}_pct_ceiling"] = 100 * tbs / ceiling_tbs if ceiling_tbs else None
            b = base.get(key(r), {}).get(f"{mode}_us")
            r[f"{mode}_ratio_cudnn"] = us / b if b else None


def _build_methods(names):
    built = []
    for name in names:
        try:
            built.append((name, M.build(name)))
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a peer this torch lacks
            built.append((name, _short(e)))
    return built


def _grid(quick, B, L, heads, D, dtypes):
    """The shape lists asked for, or the full (or quick) grid's."""
    grid = QUICK_GRID if quick else DEFAULT_GRID
    return tuple(x if x is not None else grid[k] for x, k in
                 ((B, "B"), (L, "L"), (heads, "heads"), (D, "D"), (dtypes, "dtypes")))


def _settings(gpu, quick, graphs, warmup_ms, rep_ms, graph_rep_ms, cpu_runs, default_cpu_runs):
    """Timing settings: what was asked for, else the defaults (smaller in quick mode)."""
    return {
        "graphs": (gpu and not quick) if graphs is None else (bool(graphs) and gpu),
        "warmup_ms": warmup_ms if warmup_ms is not None else (5 if quick else 25),
        "rep_ms": rep_ms if rep_ms is not None else (10 if quick else 100),
        "graph_rep_ms": graph_rep_ms if graph_rep_ms is not None else (5 if quick else 20),
        "cpu_runs": cpu_runs if cpu_runs is not None else default_cpu_runs,
    }


def run_benchmark(B=None, L=None, heads=None, D=None, dtypes=None, methods=None, splits=None, max_kv_gb=20.0,
                  quick=False, graphs=None, warmup_ms=None, rep_ms=None, graph_rep_ms=None, cpu_runs=None,
                  ceiling_gib=None, ceiling=True, seed=0, progress=True, command=None, kv_dtype=None,
                  kv_scale=None) -> dict:
    """Run the benchmark and return the results dict (the JSON file's content; see :func:`write_results`).

    ``quick=True`` picks interpreter-sized defaults (B=2, H 4:2, L 64/200, D 32, fp16, a few methods, no
    graphs, tiny repetitions); any argument given explicitly wins over the defaults.
    ``splits`` (a list) forces fdlib's split counts: ``split`` and ``unified`` run once per value.
    ``graphs=None`` means: CUDA graphs on a GPU unless ``quick``. ``kv_dtype`` (``"float8_e4m3fn"`` or ``"int8"``)
    and ``kv_scale`` (``"tensor"``, ``"head"``, ``"token"``): fdlib's methods read an 8-bit cache
    (:mod:`fdlib.bench.kv8`; its bytes are the bandwidth's).
    """
    kv8.check(kv_dtype, kv_scale)
    kv = kv8.shape_fields(kv_dtype, kv_scale)
    B, L, heads, D, dtypes = _grid(quick, B, L, heads, D, dtypes)
    names = M.expand_methods(methods or (M.QUICK_METHODS if quick else M.DEFAULT_METHODS), splits)
    gpu = runtime.MODE == "gpu"
    settings = _settings(gpu, quick, graphs, warmup_ms, rep_ms, graph_rep_ms, cpu_runs, default_cpu_runs=2)
    shapes, skipped = shape_grid(B, L, heads, D, dtypes, max_kv_gb, kv)
    built = _build_methods(names)
    prov = provenance(command)
    ceil = measure_ceiling_or_none(ceiling, ceiling_gib if ceiling_gib is not None else (0.001 if quick else 4.0),
                                   settings)
    bar = Progress(len(shapes) * len(built), "fdlib.bench", progress)
    settings["progress"] = bar
    records = []
    try:
        for i, shape in enumerate(shapes):
            try:
                records.extend(_run_methods(shape, built, settings, seed + i))
            except Exception as e:  # noqa: BLE001 - e.g. no memory for the inputs themselves
                if not _is_oom(e):
                    raise
                for name, m in built:
                    records.append(dict(shape, method=name, status="unavailable", kv_bytes=kv_bytes(shape),
                                        kv_mb=kv_bytes(shape) / 1e6, reason=f"inputs: {_short(e)}"))
                free_memory()
    finally:
        bar.close()
    _derive(records, ceil.get("tbs") if ceil else None)
    settings.pop("progress")
    return {
        "schema": SCHEMA,
        "kind": "bench",
        "provenance": prov,
        "ceiling": ceil,
        "settings": dict(settings, quick=quick, max_kv_gb=max_kv_gb, seed=seed, methods=names,
                         splits=list(splits) if splits else None, tolerance={d: tolerance(d) for d in dtypes},
                         l2_handling=l2_note(settings["graphs"]),
                         fdlib_call="decode_attention(q, k_cache, v_cache, cache_seqlens=<int32, all L>, "
                                    "method=..., num_splits=...)" + (", k_scale=..., v_scale=..." if kv else ""),
                         kv_bytes="2*B*H_kv*L*D*elem_size" + (" with elem_size 1, plus 4*B*H_kv*L for each of K and V "
                                                                "scaled per token (fdlib's methods; SDPA's peers read "
                                                                "the 16-bit cache, 2*B*H_kv*L*D*2)" if kv else ""),
                         kv_cache=kv8.describe(kv) if kv else None),
        "shapes": shapes,
        "skipped": skipped,
        "records": records,
    }


def l2_note(graphs: bool) -> str:
    note = "eager: triton.testing.do_bench clears the L2 (256 MB buffer zero-filled) before every run"
    if graphs:
        note += (f"; graph: triton.testing.do_bench_cudagraph does not flush, so each call rotates among copies "
                 f"of q/K/V totalling >= {L2_FACTOR}x L2 ({l2_bytes() / 2**20:.0f} MiB); 'l2_copies' per record")
    if runtime.MODE != "gpu":
        note = "interpreter: wall-clock median on the CPU, no L2 handling, no graphs"
    return note


def measure_ceiling_or_none(enabled, gib, settings):
    if not enabled:
        return None
    return measure_ceiling(gib, warmup_ms=settings["warmup_ms"], rep_ms=settings["rep_ms"],
                           cpu_runs=settings["cpu_runs"])


# ----------------------------------------------------------------------------------------------- splits sweep

COSTMODEL_CALL = "choose(B=..., H_q=..., H_kv=..., L=..., D=..., dtype_bytes=..., gpu=..., method=...)"
"""How :func:`_costmodel_choice` calls the cost model (recorded with its split count)."""


def _costmodel_choice(shape) -> dict:
    """The split count :func:`fdlib.costmodel.choose` picks for the unified kernel on a shape, on the GPU the
    sweep runs on (the H200 preset without one)."""
    s = costmodel.choose(B=shape["B"], H_q=shape["H_q"], H_kv=shape["H_kv"], L=shape["L"], D=shape["D"],
                         dtype_bytes=elem_bytes(shape), gpu=live_gpu(), method="unified")
    return {"splits": int(s), "call": COSTMODEL_CALL}


def _fa2_rule_choice(shape) -> dict:
    """FlashAttention-2's split heuristic (:func:`fdlib.costmodel.fa2_rule`) for comparison; 132 SMs (the
    H200's) without a GPU."""
    sms = runtime.sm_count() or 132
    return {"splits": int(costmodel.fa2_rule(shape["B"], shape["H_q"], shape["H_kv"], shape["L"], shape["D"],
                                             sms=sms))}


def run_sweep(B=None, L=None, heads=None, D=None, dtypes=None, candidates=None, max_kv_gb=20.0, quick=False,
              graphs=None, warmup_ms=None, rep_ms=None, graph_rep_ms=None, cpu_runs=None, seed=0, progress=True,
              command=None) -> dict:
    """Time ``method="unified"`` at every candidate split count per shape (graph timings on a GPU), plus the
    split counts fdlib (``method="auto"``), ``fdlib.costmodel.choose`` and FlashAttention-2's heuristic
    (``fdlib.costmodel.fa2_rule``) pick; record best vs chosen."""
    B, L, heads, D, dtypes = _grid(quick, B, L, heads, D, dtypes)
    gpu = runtime.MODE == "gpu"
    settings = _settings(gpu, quick, graphs, warmup_ms, rep_ms, graph_rep_ms, cpu_runs, default_cpu_runs=1)
    settings["eager"] = False   # with graphs on, the sweep times graphs only (eager only when graphs are off)
    cands = sorted({int(c) for c in (candidates or SWEEP_CANDIDATES) if 1 <= int(c) <= MAX_SPLITS})
    shapes, skipped = shape_grid(B, L, heads, D, dtypes, max_kv_gb)
    prov = provenance(command)
    bar = Progress(len(shapes), "fdlib.bench sweep", progress)
    settings["progress"] = bar
    rows = []
    timing = "graph" if settings["graphs"] else "eager"
    try:
        for i, shape in enumerate(shapes):
            block_n = M.block_n(shape["D"], shape["L"], shape["B"] * shape["H_kv"], elem_bytes(shape))
            rows.append(_sweep_shape(shape, cands, settings, seed + i, block_n, timing))
            bar.update(f"{shape['dtype']} B={shape['B']} H={shape['H_q']}:{shape['H_kv']} L={shape['L']}")
    finally:
        bar.close()
    settings.pop("progress")
    return {
        "schema": SCHEMA,
        "kind": "sweep",
        "provenance": prov,
        "ceiling": None,
        "settings": dict(settings, quick=quick, max_kv_gb=max_kv_gb, seed=seed, candidates=cands, timing=timing,
                         method="unified", l2_handling=l2_note(settings["graphs"])),
        "shapes": shapes,
        "skipped": skipped,
        "sweep": rows,
    }


def _sweep_shape(shape, cands, settings, seed, block_n, timing):
    nb = kv_bytes(shape)
    row = dict(shape, kv_bytes=nb, kv_mb=nb / 1e6, points=[], chosen={})
    try:
        base = make_inputs(shape, seed)
        ref = reference(base)
        n_copies = copies_for_l2(nb) if settings["graphs"] else 1
        copies = _copies(base, n_copies, "fdlib")
    except Exception as e:  # noqa: BLE001
        if not _is_oom(e):
            raise
        free_memory()
        row["error"] = _short(e)
        return row
    row["l2_copies"] = n_copies
    tol = tolerance(shape["dtype"])
    L = shape["L"]
    auto = M.fdlib_splits(base.q, base.k, base.v, "auto", None, lens=base.lens)
    cm = _costmodel_choice(shape)
    chosen = {"fdlib_auto": {"splits": auto.get("splits"), "requested": auto.get("splits_requested")},
              "costmodel": cm, "fa2_rule": _fa2_rule_choice(shape)}
    by_eff = {}

    def point(requested):
        _, eff = chunk_for(L, requested, block_n)
        if eff in by_eff:
            return by_eff[eff]
        m = M.build(f"unified@{requested}")
        try:
            rec = _measure(m, copies, ref, tol, settings)
        except Exception as e:  # noqa: BLE001
            rec = {"status": "unavailable" if _is_oom(e) else "error", "reason": _short(e)}
            free_memory()
        us = rec.get("graph_us") if timing == "graph" else rec.get("eager_us")
        p = {"splits": eff, "requested": requested, "status": rec["status"], "rel_err": rec.get("rel_err"),
             "us": us, "eager_us": rec.get("eager_us"), "graph_us": rec.get("graph_us"),
             "tbs": nb / us / 1e6 if us else None}
        for k in ("reason", "graph_error"):
            if k in rec:
                p[k] = rec[k]
        by_eff[eff] = p
        row["points"].append(p)
        return p

    try:
        for c in cands:             # a count above the tile count launches one split per tile: timed once
            point(c)
            if c >= triton.cdiv(L, block_n):
                break
        for name, ch in chosen.items():
            if ch.get("splits"):
                p = point(int(ch["splits"]))
                ch["splits"] = p["splits"]
                ch["us"] = p["us"]
    finally:
        del copies, base, ref
        free_memory()
    good = [p for p in row["points"] if p["us"]]
    if good:
        best = min(good, key=lambda p: p["us"])
        row["best"] = {"splits": best["splits"], "us": best["us"], "tbs": best["tbs"]}
        for ch in chosen.values():
            ch["ratio_to_best"] = ch["us"] / best["us"] if ch.get("us") else None
    row["points"].sort(key=lambda p: p["splits"])
    row["chosen"] = chosen
    return row
