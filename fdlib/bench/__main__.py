"""``python -m fdlib.bench``: time fdlib's decode methods and the SDPA peers, or sweep the split count.

Examples::

    python -m fdlib.bench                                   # the full grid, eager + CUDA graph, both dtypes
    python -m fdlib.bench --sweep-splits --dtype float16    # unified kernel at every split count, best vs chosen
    python -m fdlib.bench --B 1 --L 131072 --heads 32:8     # one shape
    python -m fdlib.bench --quick                           # tiny shapes, runs in the interpreter on a CPU
    python -m fdlib.bench --host-overhead                   # µs per call of back-to-back calls (B=1 32:8 L=2048)
    python -m fdlib.bench --heads-sweep                     # groups 1..16, D 64..256: auto vs every kernel
    python -m fdlib.bench --ragged --page-size 16           # ragged batches on a paged cache (--L: mean lengths)
    python -m fdlib.bench --serving --methods unified@captured   # seven serving batches: host plan vs device lengths
    python -m fdlib.bench --qlen                            # q_len 1,2,4,8 query tokens: fdlib vs cuDNN, FA2
    python -m fdlib.bench --generate                        # a Llama-3-8B decode step: HF's caches vs fdlib.hf
    python -m fdlib.bench --generate --quick                # the same code path on a tiny model (CPU numbers)
    python -m fdlib.bench --generate --profile              # and where one step's time goes (torch.profiler)
    python -m fdlib.bench --kv-dtype float8_e4m3fn --kv-scale head   # the grid over an 8-bit KV cache (also --ragged)
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

import fdlib

from . import harness, report
from .host import run_host_overhead
from .methods import expand_methods


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x.strip())


def _heads(text):
    out = []
    for part in text.split(","):
        hq, _, hkv = part.partition(":")
        out.append((int(hq), int(hkv or hq)))
    return tuple(out)


def _names(text):
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fdlib.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("shapes (comma lists; every sequence has length L)")
    g.add_argument("--B", type=_ints, help="batch sizes (default 1,4,16,64)")
    g.add_argument("--L", type=_ints, help="KV lengths (default 512,2048,8192,32768,131072)")
    g.add_argument("--heads", type=_heads, help="H_q:H_kv pairs (default 32:8,32:32)")
    g.add_argument("--D", type=_ints, help="head dims (default 128)")
    g.add_argument("--dtype", type=_names, help="float16,bfloat16,float32 (default float16,bfloat16)")
    g.add_argument("--max-kv-gb", type=float, default=20.0, help="skip shapes whose K+V exceed this (GB, default 20)")
    g.add_argument("--kv-dtype", choices=("float8_e4m3fn", "int8"),
                   help="fdlib's methods read an 8-bit KV cache of this dtype, quantized from each shape's 16-bit one "
                        "(fdlib.quantize_kv; the reference and SDPA's peers read the 16-bit cache it stands for); "
                        "the dense grid and --ragged; with --generate, the fdlib_graph_kv8 row over "
                        "DecodeCache(kv_dtype=...) where DecodeCache takes it")
    g.add_argument("--kv-scale", choices=("tensor", "head", "token"),
                   help="with --kv-dtype: one scale per tensor (default), per KV head, or per token and KV head")
    m = ap.add_argument_group("what to run")
    m.add_argument("--methods", type=_names,
                   help="naive,split1,split,unified,auto,cudnn,fa2 (default) and memeff; 'unified@8' forces splits")
    m.add_argument("--splits", type=_ints, help="force fdlib's split counts: split and unified run once per value; "
                                                "with --sweep-splits, the candidate list")
    m.add_argument("--sweep-splits", action="store_true",
                   help="splits sweep: unified at every candidate split count, best vs the chosen one")
    m.add_argument("--host-overhead", action="store_true",
                   help="wall time per call of back-to-back calls (fdlib, SDPA cuDNN, plan.run, graph replay) on "
                        "one shape (the first of --B/--L/--heads/--D/--dtype; default B=1, 32:8, L=2048, D=128, "
                        "fp16) and a cProfile of decode_attention")
    m.add_argument("--heads-sweep", action="store_true",
                   help="the grid of head layouts: groups 1, 4, 8, 16 (H_q=16, MQA included), D 64, 128, 256, "
                        "B 1 and 8, L 8k, 64k, 256k, fp16; methods split, unified, persistent, auto, cudnn")
    m.add_argument("--ragged", action="store_true",
                   help="ragged batches (constant, uniform and Zipf-like lengths of mean 1k, 8k, 32k; B 8, 32, 128; "
                        "32:8 and 32:32; fp16 and bf16): fdlib's methods, effective bandwidth of the rows' bytes; "
                        "methods 'default' and 'captured' run auto without host lengths (fdlib.bench.ragged)")
    m.add_argument("--page-size", type=int, help="with --ragged: a paged cache of this many keys a page")
    m.add_argument("--page-order", choices=("shuffled", "sequential"), default="shuffled",
                   help="with --page-size: each sequence's pages anywhere in the pool (default) or consecutive")
    m.add_argument("--serving", action="store_true",
                   help="seven serving batches (bf16, pages of 16 shuffled and contiguous): the plan made from host "
                        "lengths against decode_attention with device lengths and a graph captured before the "
                        "lengths are known, plus --methods specs NAME[#S][+invariant][@captured] "
                        "(fdlib.bench.serving)")
    m.add_argument("--qlen", action="store_true",
                   help="several query tokens per sequence (speculative decoding): fdlib vs SDPA cuDNN and "
                        "FlashAttention with the bottom-right causal mask, q_len 1,2,4,8 on (B, L) = (1, 128k), "
                        "(16, 8k), (1|4, 8k|32k), 32:8, D=128, fp16; --B/--L give the product of their lists instead")
    m.add_argument("--q-lens", type=_ints, help="with --qlen: the q_len values (default 1,2,4,8)")
    m.add_argument("--generate", action="store_true",
                   help="one decode step of the Llama-3-8B shape (random weights, bf16): HF's DynamicCache and "
                        "StaticCache (+ torch.compile) with sdpa against fdlib.hf eager and as a CUDA graph; ms per "
                        "step, tokens/s, the bandwidth bound (needs a GPU; --quick: a tiny model, CPU allowed)")
    m.add_argument("--batches", type=_ints, help="with --generate: batch sizes (default 1,8)")
    m.add_argument("--contexts", type=_ints, help="with --generate: keys per sequence (default 8192,32768,131072)")
    m.add_argument("--variants", type=_names,
                   help="with --generate: hf_dynamic,hf_static,hf_static_compiled,fdlib_eager,fdlib_graph,"
                        "fdlib_compiled (default); fdlib_graph_kv8 comes with --kv-dtype")
    m.add_argument("--cases", type=lambda t: tuple(tuple(int(x) for x in c.split(":")) for c in t.split(",") if c),
                   help="with --generate: B:context pairs run in this order (e.g. 1:131072,8:32768), instead of "
                        "every --batches with every --contexts; with --serving: the batches' numbers (e.g. 3,7)")
    m.add_argument("--profile", action="store_true",
                   help="with --generate: profile one step of hf_dynamic and of each captured fdlib variant "
                        "(torch.profiler): time of the cat, attention, GEMMs, cache writes, small kernels and the "
                        "gaps; NAME-profile.json/.md beside the results")
    m.add_argument("--compile-mode", help="with --generate: torch.compile mode of fdlib_compiled (default 'default'; "
                                          "e.g. max-autotune-no-cudagraphs); the step is then captured as a graph")
    m.add_argument("--budget-s", type=float,
                   help="with --generate or --serving: after this many seconds the cases left are recorded as "
                        "skipped; a NAME.partial.json is rewritten after every case until the files are written")
    m.add_argument("--steps", type=int, help="with --generate: timed decode steps per variant (default 10)")
    m.add_argument("--warmup-steps", type=int, help="with --generate: untimed steps first (default 3)")
    m.add_argument("--quick", action="store_true",
                   help="tiny shapes, few methods, no graphs (runs on a CPU in the Triton interpreter)")
    t = ap.add_argument_group("timing")
    t.add_argument("--no-graphs", action="store_true", help="eager timings only")
    t.add_argument("--warmup", type=float, help="do_bench warmup, ms (default 25)")
    t.add_argument("--rep", type=float, help="do_bench repetition time, ms (default 100)")
    t.add_argument("--graph-rep", type=float, help="do_bench_cudagraph repetition time, ms (default 20)")
    t.add_argument("--ceiling-gib", type=float, help="buffer for the read ceiling, GiB (default 4)")
    t.add_argument("--no-ceiling", action="store_true", help="do not measure the read ceiling")
    t.add_argument("--seed", type=int, default=0)
    o = ap.add_argument_group("output")
    o.add_argument("--out", help="output folder (default results/<device-slug>/)")
    o.add_argument("--name", help="file name stem (default <bench|sweep>-<UTC timestamp>)")
    o.add_argument("--force", action="store_true", help="overwrite existing files of the same name")
    o.add_argument("--no-plot", action="store_true", help="skip the PNG")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    print(fdlib.describe(), file=sys.stderr, flush=True)
    argv_list = sys.argv[1:] if argv is None else list(argv)
    command = "python -m fdlib.bench " + " ".join(shlex.quote(a) for a in argv_list)
    common = dict(B=args.B, L=args.L, heads=args.heads, D=args.D, dtypes=args.dtype, max_kv_gb=args.max_kv_gb,
                  quick=args.quick, graphs=False if args.no_graphs else None, warmup_ms=args.warmup,
                  rep_ms=args.rep, graph_rep_ms=args.graph_rep, seed=args.seed, progress=not args.no_progress,
                  command=command)
    if args.dtype:
        bad = [d for d in args.dtype if d not in harness.DTYPES]
        if bad:
            print(f"--dtype: unknown {bad}; expected {', '.join(harness.DTYPES)}", file=sys.stderr)
            return 2
    # Refuse an existing --name before spending GPU time on the run.
    if args.name and not args.force:
        probe = {"provenance": harness.provenance(command), "kind": "sweep" if args.sweep_splits else "bench"}
        out_dir = args.out or report.default_out_dir(probe)
        clash = [f for f in (args.name + ext for ext in (".json", ".md", ".png")) if os.path.exists(os.path.join(out_dir, f))]
        if clash:
            print(f"refusing to overwrite {clash} in {out_dir}: pick another --name/--out or pass --force",
                  file=sys.stderr)
            return 2
    if args.kv_scale and not args.kv_dtype:
        print("--kv-scale: scales are for an 8-bit cache; give --kv-dtype too", file=sys.stderr)
        return 2
    if args.kv_dtype and (args.host_overhead or args.qlen or args.sweep_splits or (args.generate and args.kv_scale)):
        print("--kv-dtype: the dense grid (and --heads-sweep), --ragged and --generate (without --kv-scale) take an "
              "8-bit cache; not --host-overhead, --qlen or --sweep-splits", file=sys.stderr)
        return 2
    kv = dict(kv_dtype=args.kv_dtype, kv_scale=args.kv_scale)
    if args.host_overhead:
        first = lambda xs, d: xs[0] if xs else d   # noqa: E731
        hq, hkv = first(args.heads, (32, 8))
        return _report(lambda: run_host_overhead(B=first(args.B, 1), H_q=hq, H_kv=hkv, L=first(args.L, 2048),
                                                 D=first(args.D, 128), dtype=first(args.dtype, "float16"),
                                                 command=command, progress=not args.no_progress),
                       report.format_table, lambda r: report.write_results(r, args.out, args.name, force=args.force,
                                                                           plot=False), errors=())
    if args.ragged:
        from .ragged import run_ragged
        return _report(lambda: run_ragged(B=args.B, heads=args.heads, D=args.D, dtypes=args.dtype, means=args.L,
                                          methods=args.methods, page_size=args.page_size, page_order=args.page_order,
                                          max_kv_gb=args.max_kv_gb,
                                          quick=args.quick, graphs=False if args.no_graphs else None,
                                          warmup_ms=args.warmup, rep_ms=args.rep, graph_rep_ms=args.graph_rep,
                                          seed=args.seed, ceiling=not args.no_ceiling, ceiling_gib=args.ceiling_gib,
                                          progress=not args.no_progress, command=command, **kv),
                       report.format_table, lambda r: report.write_results(r, args.out, args.name, force=args.force,
                                                                           plot=False), errors=())
    if args.qlen:
        from .qlen import format_qlen_table, run_qlen, write_qlen
        shapes = tuple((b, l) for b in args.B for l in args.L) if args.B and args.L else None
        if bool(args.B) != bool(args.L):
            print("--qlen: give both --B and --L (their product is the shape list) or neither", file=sys.stderr)
            return 2
        return _report(lambda: run_qlen(shapes=shapes, heads=args.heads[0] if args.heads else None,
                                        D=args.D[0] if args.D else None, dtype=args.dtype[0] if args.dtype else None,
                                        qlens=args.q_lens, methods=args.methods, quick=args.quick,
                                        graphs=False if args.no_graphs else None, warmup_ms=args.warmup,
                                        rep_ms=args.rep, graph_rep_ms=args.graph_rep, seed=args.seed,
                                        max_kv_gb=args.max_kv_gb, progress=not args.no_progress, command=command),
                       format_qlen_table, lambda r: write_qlen(r, args.out, args.name, force=args.force))
    if args.serving:
        from .serving import format_serving_table, run_serving
        if args.cases and any(len(c) != 1 for c in args.cases):
            print(f"--cases: with --serving, the batches' numbers (e.g. 1,3), got {args.cases}", file=sys.stderr)
            return 2
        checkpoint, write = _partial(args, command, "serving", format_serving_table,
                                     lambda r: report.write_results(r, args.out, args.name, force=args.force,
                                                                    plot=False, table=format_serving_table))
        return _report(lambda: run_serving(cases=args.cases and tuple(c[0] for c in args.cases), methods=args.methods,
                                           quick=args.quick, graphs=False if args.no_graphs else None,
                                           warmup_ms=args.warmup, rep_ms=args.rep, graph_rep_ms=args.graph_rep,
                                           seed=args.seed, ceiling=not args.no_ceiling, ceiling_gib=args.ceiling_gib,
                                           budget_s=args.budget_s, progress=not args.no_progress, command=command,
                                           checkpoint=checkpoint),
                       format_serving_table, write)
    if args.generate:
        from .generate import format_generate_table, run_generate, write_generate
        checkpoint, write = _partial(args, command, "generate", format_generate_table,
                                     lambda r: write_generate(r, args.out, args.name, force=args.force))
        return _report(lambda: run_generate(batches=args.batches, contexts=args.contexts, variants=args.variants,
                                            quick=args.quick, steps=args.steps, warmup=args.warmup_steps,
                                            seed=args.seed, ceiling=not args.no_ceiling,
                                            ceiling_gib=args.ceiling_gib, progress=not args.no_progress,
                                            command=command, profile=args.profile, kv_dtype=args.kv_dtype,
                                            compile_mode=args.compile_mode, budget_s=args.budget_s,
                                            checkpoint=checkpoint, cases=args.cases),
                       format_generate_table, write, errors=(ValueError, RuntimeError, ImportError))
    if args.heads_sweep:
        for key, val in harness.HEADS_SWEEP.items():
            if common.get(key) is None:
                common[key] = val
        args.methods = args.methods or ("split", "unified", "persistent", "auto", "cudnn")

    def grid():
        if args.sweep_splits:
            return harness.run_sweep(candidates=args.splits, **common)
        expand_methods(args.methods or ("split",), args.splits)   # unknown names fail before any work
        return harness.run_benchmark(methods=args.methods, splits=args.splits, ceiling=not args.no_ceiling,
                                     ceiling_gib=args.ceiling_gib, **common, **kv)
    return _report(grid, report.format_table,
                   lambda r: report.write_results(r, args.out, args.name, force=args.force, plot=not args.no_plot))


def _partial(args, command, kind, table, write):
    """(checkpoint, write) of a mode that takes ``--budget-s``: with a budget, ``checkpoint(results)`` rewrites
    NAME.partial.json/.md after every case and ``write`` removes them once the files are written; without one,
    no checkpoint and ``write`` as given."""
    if args.budget_s is None:
        return None, write
    probe = {"provenance": harness.provenance(command), "kind": kind}
    partial = os.path.join(args.out or report.default_out_dir(probe), (args.name or kind) + ".partial.json")

    def checkpoint(results):
        report.write_results(results, os.path.dirname(partial), os.path.basename(partial)[:-len(".json")],
                             force=True, plot=False, table=table)

    def write_all(results):
        paths = write(results)
        for leftover in (partial, partial[:-len(".json")] + ".md"):
            if os.path.exists(leftover):
                os.remove(leftover)
        return paths
    return checkpoint, write_all


def _report(run, table, write, errors=(ValueError,)) -> int:
    """One mode's tail: ``run()`` (an exception of ``errors``: its message, exit 2), print ``table(results)``,
    ``write(results)`` (a file of that name already there, FileExistsError: its message, exit 3), name the files
    written; 0."""
    try:
        results = run()
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(results), flush=True)
    try:
        paths = write(results)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print("\nwrote " + ", ".join(paths.values()), flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
