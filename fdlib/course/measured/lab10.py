r"""Lab 10's "what the GPU shows": a whole model's decode step, Hugging Face's caches against fdlib's.

One results file, ``generate.json`` (``python -m fdlib.bench --generate --profile --name generate``; schema
:data:`fdlib.bench.generate.SCHEMA`): for every batch B and context (keys a sequence) and every variant of the
step, ms per step, tokens/s = B / (s per step), and the step's bandwidth bound

    bound = (weight bytes + K/V bytes of the context) / read ceiling,

with ``of bound`` = bound / time (1 is as fast as the bytes allow); the profiles of single steps
(:mod:`fdlib.bench.stepprofile`) split a step's time into the cat, attention, GEMMs, cache writes, small
elementwise kernels and the gaps between launches. Three views:

* ``"step_profile"``: where one step's time goes, per profiled step;
* ``"moves"``: the gain of each move from HF's default to fdlib's captured step (:data:`MOVES`);
* ``"generate"``: tokens/s of every variant against the bound.

The file is looked for in ``results_dir`` and, for the default folder, in any device folder beside it (a run
on another GPU is committed under its own name); :func:`show` prints a note instead of failing where no run
was recorded.
"""
from __future__ import annotations

from pathlib import Path

from . import RESULTS, Shown, load, provenance, show_measured, shown_path, view, wrap_caption

GENERATE = "generate.json"
LABELS = {"hf_dynamic": "HF default (DynamicCache + sdpa)", "hf_static": "HF static (StaticCache + sdpa)",
          "hf_static_compiled": "HF static + torch.compile", "fdlib_eager": "fdlib, eager",
          "fdlib_graph": "fdlib, one CUDA graph", "fdlib_compiled": "fdlib, compiled + one CUDA graph",
          "fdlib_graph_kv8": "fdlib, one CUDA graph, 8-bit cache"}
MOVES = (("the cache in place", "hf_dynamic", "hf_static"),
         ("the kernel with lengths", "hf_static", "fdlib_eager"),
         ("one captured graph", "fdlib_eager", "fdlib_graph"),
         ("fused small kernels", "fdlib_graph", "fdlib_compiled"))
"""(move, from variant, to variant): each move's gain is the ratio of the two steps' times."""
CATEGORY_COLORS = {"cat": "tab:red", "attention": "tab:blue", "gemm": "tab:green", "cache write": "tab:purple",
                   "elementwise": "tab:orange", "gaps": "0.75"}


def find(results_dir: Path, name: str = GENERATE) -> Path:
    """``results_dir / name``; for the default folder, else the newest such file in a device folder beside it."""
    path = Path(results_dir) / name
    if path.exists() or Path(results_dir).resolve() != RESULTS.resolve():
        return path
    found = sorted(RESULTS.parent.glob(f"*/{name}"), key=lambda p: load(p)["provenance"]["date_utc"])
    return found[-1] if found else path


def _case(r) -> str:
    return f"B={r['B']}, {r['context'] // 1024}k" if r["context"] >= 1024 else f"B={r['B']}, {r['context']}"


def ok_records(res: dict) -> list[dict]:
    """The records that ran, in the file's order."""
    return [r for r in res["records"] if r["status"] == "ok"]


def cases(res: dict) -> list[tuple]:
    """(B, context) of every case with a record that ran, in the file's order."""
    return list(dict.fromkeys((r["B"], r["context"]) for r in ok_records(res)))


def move_gains(res: dict) -> list[dict]:
    """Per case and move (:data:`MOVES`) both of whose variants ran: gain = time(from) / time(to)."""
    by = {(r["B"], r["context"], r["variant"]): r for r in ok_records(res)}
    out = []
    for B, ctx in cases(res):
        for move, a, b in MOVES:
            if (B, ctx, a) in by and (B, ctx, b) in by:
                out.append(dict(B=B, context=ctx, move=move, frm=a, to=b, gain=by[(B, ctx, a)]["ms_per_step"]
                                / by[(B, ctx, b)]["ms_per_step"]))
    return out


def _skipped(res: dict) -> str:
    """' Not run: <case> (<variants> or every variant): <reason>; ...' for the records that did not run (the
    CPU-only reason, a --quick file's GPU rows, left out)."""
    groups: dict = {}
    for r in res["records"]:
        if r["status"] != "ok" and "needs a CUDA GPU" not in r.get("reason", ""):
            groups.setdefault((_case(r), r.get("reason", r["status"])), []).append(r["variant"])
    n = len(res["settings"]["variants"])
    notes = [f"{case} ({'every variant' if len(vs) == n else ', '.join(vs)}): {why.rstrip('.')}"
             for (case, why), vs in groups.items()]
    return (" Not run: " + "; ".join(notes) + ".") if notes else ""


def _head(path: Path, res: dict) -> str:
    ceil = (res.get("ceiling") or {}).get("tbs")
    m = res["model"]
    return (f"{shown_path(path)}: recorded on {provenance(res['provenance'])}; {m['shape']}, {m['dtype']}, "
            f"{m['weight_bytes_per_step'] / 1e9:.2f} GB of weights read a step; read ceiling "
            + (f"{ceil:.2f} TB/s measured in the same run" if ceil else "not measured") + f"; numbers: "
            f"{res['settings']['numbers']}.")


@view("generate")
def generate(results_dir: Path) -> Shown:
    import matplotlib.pyplot as plt

    path = find(results_dir)
    res = load(path)
    recs = ok_records(res)
    cs = cases(res)
    variants = [v for v in LABELS if any(r["variant"] == v for r in recs)]
    by = {(r["B"], r["context"], r["variant"]): r for r in recs}
    fig, ax = plt.subplots(figsize=(11, 4.4))
    bound = [(c, max((by[(B, ctx, v)] for v in variants if (B, ctx, v) in by), key=lambda r: r["tokens_per_s"]))
             for c, (B, ctx) in enumerate(cs)]
    bx = [(c, r["B"] / r["bound_ms"] * 1e3) for c, r in bound if r.get("bound_ms")]
    if bx:
        ax.hlines([y for _, y in bx], [c - 0.45 for c, _ in bx], [c + 0.45 for c, _ in bx], color="black", lw=2,
                  label="bandwidth bound (16-bit cache)")
    _grouped_bars(ax, cs, [(LABELS[v], [by[(B, ctx, v)]["tokens_per_s"] if (B, ctx, v) in by else 0
                                        for B, ctx in cs]) for v in variants], "tokens/s", "decode step")
    p = res["provenance"]
    ax.set_title(f"Decode tokens/s of a whole model, {res['model']['shape']}: recorded on {p['device']} "
                 f"{p['date_utc'][:10]} ({shown_path(path)})", fontsize=10)
    table = [["case", "variant", "ms / step", "tokens/s", "bound ms", "of bound", "× HF default"]]
    for r in recs:
        table.append([_case(r), r["variant"], f"{r['ms_per_step']:.2f}", f"{r['tokens_per_s']:.1f}",
                      "—" if r.get("bound_ms") is None else f"{r['bound_ms']:.2f}",
                      "—" if r.get("frac_of_bound") is None else f"{r['frac_of_bound']:.0%}",
                      "—" if r.get("vs_hf_default") is None else f"{r['vs_hf_default']:.2f}"])
    best = best_rows(res)
    summary = "; ".join(f"{_case(r)}: {r['variant']} {r['vs_hf_default']:.2f}× HF default"
                        + (f", {r['frac_of_bound']:.0%} of the bound" if r.get("frac_of_bound") else "")
                        for r in best if r.get("vs_hf_default"))
    caption = (_head(path, res) + " Bars: tokens/s of each variant; black line: B / bound, the tokens/s the "
               "bytes allow." + (f" fdlib's best step per case: {summary}." if summary else "") + _skipped(res))
    return Shown(figure=fig, table=table, caption=caption, sources=[shown_path(path)])


def _grouped_bars(ax, cs, series, ylabel: str, legend_title: str) -> None:
    """Bars of each ``(label, values)`` of ``series``, grouped by case ``cs``, on a log y axis."""
    import matplotlib.pyplot as plt

    from fdlib.course.figures import legend_outside, plain_ticks
    width = 0.8 / max(len(series), 1)
    for i, (label, ys) in enumerate(series):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(cs))]
        ax.bar(xs, ys, width * 0.92, color=plt.get_cmap("tab10")(i), label=label)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cs)), [_case(dict(B=B, context=ctx)) for B, ctx in cs])
    ax.set_xlabel("batch B and context (keys a sequence)")
    ax.set_ylabel(f"{ylabel} (log scale)")
    plain_ticks(ax, "y")                       # 20, 30, 50, not 2×10¹
    legend_outside(ax, title=legend_title)


def best_rows(res: dict) -> list[dict]:
    """Per case, fdlib's fastest 16-bit step (``fdlib_graph`` or ``fdlib_compiled``; else ``fdlib_eager``)."""
    out = []
    for B, ctx in cases(res):
        mine = [r for r in ok_records(res) if (r["B"], r["context"]) == (B, ctx)
                and r["variant"] in ("fdlib_graph", "fdlib_compiled", "fdlib_eager")]
        if mine:
            out.append(max(mine, key=lambda r: r["tokens_per_s"]))
    return out


@view("moves")
def moves(results_dir: Path) -> Shown:
    import matplotlib.pyplot as plt

    path = find(results_dir)
    res = load(path)
    gains = move_gains(res)
    cs = list(dict.fromkeys((g["B"], g["context"]) for g in gains))
    names = [m for m, _, _ in MOVES if any(g["move"] == m for g in gains)]
    fig, ax = plt.subplots(figsize=(10, 4))
    by = {(g["B"], g["context"], g["move"]): g["gain"] for g in gains}
    ax.axhline(1, color="black", lw=0.8)
    _grouped_bars(ax, cs, [(m, [by.get((B, ctx, m), 0) for B, ctx in cs]) for m in names],
                  "speed-up of the move", "move")
    for fmt, set_fmt in ((ax.yaxis.get_major_formatter(), ax.yaxis.set_major_formatter),
                         (ax.yaxis.get_minor_formatter(), ax.yaxis.set_minor_formatter)):
        set_fmt(plt.FuncFormatter(lambda v, pos, fmt=fmt: f"{fmt(v, pos)}×" if fmt(v, pos) else ""))
    p = res["provenance"]
    ax.set_title(f"What each move gains, step time before / after: recorded on {p['device']} {p['date_utc'][:10]} "
                 f"({shown_path(path)})", fontsize=10)
    table = [["case", "move", "from", "to", "speed-up"]]
    for g in gains:
        table.append([_case(g), g["move"], g["frm"], g["to"], f"{g['gain']:.2f}×"])
    caption = (_head(path, res) + " Each move's speed-up is the time of the step before it over the time after "
               "it (above 1: faster). " + "; ".join(f"{m}: {a} → {b}" for m, a, b in MOVES) + ".")
    return Shown(figure=fig, table=table, caption=caption, sources=[shown_path(path)])


@view("step_profile")
def step_profile(results_dir: Path) -> Shown:
    import matplotlib.pyplot as plt

    from fdlib.bench.stepprofile import ORDER
    from fdlib.course.figures import legend_outside

    path = find(results_dir)
    res = load(path)
    profs = res.get("profiles") or []
    if not profs:
        raise FileNotFoundError(f"{path}: no profiles in this file (run the benchmark with --profile)")
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(profs) + 1.6))
    labels = [f"{_case(p)}: {p['variant']}" for p in profs]
    for i, p in enumerate(profs):
        left = 0.0
        for c in ORDER:
            w = p["summary"]["ms"][c]
            ax.barh(i, w, left=left, color=CATEGORY_COLORS[c], label=c if i == 0 else None)
            left += w
    ax.set_yticks(range(len(profs)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms of one step")
    legend_outside(ax, title="where the time goes")
    prov = res["provenance"]
    ax.set_title(f"One decode step, profiled: recorded on {prov['device']} {prov['date_utc'][:10]} "
                 f"({shown_path(path)})", fontsize=10)
    table = [["step", "span ms"] + list(ORDER)]
    for label, p in zip(labels, profs):
        s = p["summary"]
        span = s["span_ms"] or 1.0
        table.append([label, f"{s['span_ms']:.2f}"] + [f"{s['ms'][c]:.2f} ({s['ms'][c] / span:.0%})" for c in ORDER])
    caption = (_head(path, res) + " Each step was run once more under torch.profiler ("
               + profs[0]["summary"].get("source", "") + "); its span runs from the first kernel's start to the "
               "last kernel's end; gaps: the time no kernel runs.")
    return Shown(figure=fig, table=table, caption=caption, sources=[shown_path(path)])


def show(name: str, results_dir=None):
    """:func:`~fdlib.course.measured.show_measured` of a Lab 10 view, or (no recorded run) a note that says which file
    is missing and which command writes it; returns the Shown or None."""
    path = find(Path(results_dir) if results_dir is not None else RESULTS)
    if not path.exists():
        print(wrap_caption(f"No recorded GPU run to show yet: {shown_path(path)} is not there. On a GPU, "
                           f"the course's benchmark records one (results/notes/10_end_to_end.md says how); the "
                           f"notebook shows it once it is committed as results/<device>/{GENERATE}."))
        return None
    try:
        return show_measured(name, results_dir=path.parent)
    except FileNotFoundError as e:   # a file without profiles
        print(wrap_caption(str(e).replace(str(path), shown_path(path))))
        return None


def findings(results_dir=None) -> dict:
    """What the lesson says of the recorded run, each computed from the file (:func:`find`):

    * ``file``, ``device``; ``cases``: [(B, context)] that ran;
    * ``steps``: {(B, context): {variant: record}} (ms_per_step, bound_ms, frac_of_bound, vs_hf_default);
    * ``gains``: {(B, context): {move: gain}} (:func:`move_gains`);
    * ``shares``: {(B, context): {variant: {category: share of the profiled step's span}}};
    * ``kernels``: {(B, context): {variant: kernels in the profiled step}};
    * ``top``: {(B, context): {variant: the profiled step's longest kernel (name, ms, count, category)}};
    * ``largest``: {(B, context): {variant: the category with the largest share}}.
    """
    path = find(Path(results_dir) if results_dir is not None else RESULTS)
    res = load(path)
    steps: dict = {}
    for r in ok_records(res):
        steps.setdefault((r["B"], r["context"]), {})[r["variant"]] = r
    gains: dict = {}
    for g in move_gains(res):
        gains.setdefault((g["B"], g["context"]), {})[g["move"]] = g["gain"]
    shares: dict = {}
    kernels: dict = {}
    top: dict = {}
    for p in res.get("profiles") or []:
        key, s = (p["B"], p["context"]), p["summary"]
        shares.setdefault(key, {})[p["variant"]] = {c: ms / s["span_ms"] for c, ms in s["ms"].items()}
        kernels.setdefault(key, {})[p["variant"]] = s["kernels"]
        top.setdefault(key, {})[p["variant"]] = s["top"][0] if s.get("top") else None
    largest = {k: {v: max(sh, key=sh.get) for v, sh in per.items()} for k, per in shares.items()}
    return {"file": shown_path(path), "device": res["provenance"]["device"], "cases": cases(res), "steps": steps,
            "gains": gains, "shares": shares, "kernels": kernels, "top": top, "largest": largest}
