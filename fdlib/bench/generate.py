r"""``python -m fdlib.bench --generate``: one decode step of a whole model, Hugging Face's caches against fdlib.hf.

The model is the Llama-3-8B shape (32 layers, hidden 4096, 32:8 heads of 128, MLP 14336, vocabulary 128256)
with random weights in bf16; ``--quick`` takes a tiny one (2 layers, hidden 64) that runs on a CPU too. Every
sequence of the batch holds ``context`` keys. Variants of the same step (``input_ids`` ``[B, 1]``, the
last-token logits):

* ``hf_dynamic``: HF's default, ``DynamicCache`` + ``"sdpa"``: the cache grows by ``torch.cat`` every step;
* ``hf_static``: ``StaticCache`` + ``"sdpa"``, eager (its mask and SDPA span the cache's capacity);
* ``hf_static_compiled``: the same under ``model.get_compiled_call`` (``torch.compile``, mode
  ``"reduce-overhead"``: CUDA graphs), what ``generate()`` runs with a static cache on a GPU;
* ``fdlib_eager``: :class:`fdlib.hf.DecodeCache` + ``"fdlib"``, eager;
* ``fdlib_graph``: that step captured once as a CUDA graph and replayed (each replay appends a token);
* ``fdlib_compiled`` (not in the default set): the fdlib step under ``torch.compile(mode="reduce-overhead",
  fullgraph=True)``.

Each cache starts from the same state without a prefill: layer l's K/V are random, drawn from a generator seeded
by (seed, l) (a step's cost does not depend on the values, and a 128k-token prefill would cost more than all
the steps). The capacity is context + the steps run + a margin. Each variant's first step's logits are checked
against the reference variant's (``hf_dynamic``, else the first that ran): ``logits_err`` = max |Δ| / max |ref|.

Timing: ``warmup`` steps, then ``steps`` steps back to back between two CUDA events (ms per step = elapsed /
steps; each step appends a token, so the context grows by at most warmup + steps). No L2 flush is needed: a step
reads ≥ 15 GB of weights. Without a GPU (``--quick`` only) the times are CPU wall clock of the tiny model:
they show the code path runs and say nothing about a GPU.

The bound of a step is the bytes it must read, weights (every parameter but the input embedding table, of
which a step reads B rows) + the context's K/V (2 · layers · B · context · H_kv · D · elem), divided by the
read ceiling measured in the same run (:mod:`fdlib.bench.ceiling`).
"""
from __future__ import annotations

import sys
import time
import traceback
import warnings

import torch

from .. import runtime
from .harness import Progress, provenance
from .timing import free_memory, synchronize

SCHEMA = "fdlib.bench.generate/1"
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072 + 4096)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
BATCHES, CONTEXTS = (1, 8), (8192, 32768, 131072)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 2), (24, 40)
VARIANTS = ("hf_dynamic", "hf_static", "hf_static_compiled", "fdlib_eager", "fdlib_graph")
ALL_VARIANTS = VARIANTS + ("fdlib_compiled",)
GPU_ONLY = ("hf_static_compiled", "fdlib_graph", "fdlib_compiled")
REFERENCE = "hf_dynamic"
MARGIN = 64
"""Capacity beyond context + warmup + steps (StaticCache and DecodeCache are made this much larger)."""
TARGETS = dict(vs_hf_default=7.0, vs_hf_default_cases=((1, 131072), (8, 32768)), vs_hf_best=1.3,
               vs_hf_best_context=131072, of_bound=0.85)
"""The issue's targets for fdlib_graph: ≥ 7× hf_dynamic's tokens/s at (B, context) = (1, 128k) and (8, 32k);
≥ 1.3× hf_static_compiled's at 128k; ≥ 85% of the bound everywhere."""


# ----------------------------------------------------------------------------------------------- the model
def build_model(quick: bool, dtype, device, seed: int):
    """A random ``LlamaForCausalLM`` of the Llama-3-8B shape (``quick``: :data:`TINY`), in ``dtype`` on
    ``device``, in eval mode, with ``"sdpa"`` attention."""
    import transformers
    cfg = transformers.LlamaConfig(**(TINY if quick else LLAMA3_8B), attn_implementation="sdpa")
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()   # parameters made in dtype; rotary's inv_freq stays float32 as HF makes it


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every parameter but the input embedding table."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)


def kv_bytes(cfg, B: int, context: int, elem: int) -> int:
    """Bytes of K and V of ``context`` keys per sequence, every layer."""
    return 2 * cfg.num_hidden_layers * B * context * cfg.num_key_value_heads * _head_dim(cfg) * elem


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_kv(cfg, layer: int, B: int, context: int, dtype, device, seed: int):
    """Layer ``layer``'s random K and V ``[B, H_kv, context, D]``, the same for every variant of a run."""
    g = torch.Generator(device=device).manual_seed(seed * 1009 + layer)
    shape = (B, cfg.num_key_value_heads, context, _head_dim(cfg))
    return (torch.randn(shape, generator=g, device=device, dtype=dtype),
            torch.randn(shape, generator=g, device=device, dtype=dtype))


# ----------------------------------------------------------------------------------------------- caches
def make_cache(variant: str, model, B: int, context: int, capacity: int, seed: int):
    """The variant's cache, holding ``context`` random keys per sequence in every layer."""
    import transformers
    cfg, dtype, device = model.config, model.dtype, model.device
    if variant.startswith("fdlib"):
        from ..hf import DecodeCache
        cache = DecodeCache(cfg, B, capacity, device=device, dtype=dtype)
        for i, layer in enumerate(cache.layers):
            k, v = layer_kv(cfg, i, B, context, dtype, device, seed)
            layer.keys[:B, :context].copy_(k.transpose(1, 2))
            layer.values[:B, :context].copy_(v.transpose(1, 2))
            del k, v
        cache.set_lengths([context] * B)
        return cache
    if variant == "hf_dynamic":
        try:
            cache = transformers.DynamicCache(config=cfg)
        except TypeError:
            cache = transformers.DynamicCache()
    else:
        cache = transformers.StaticCache(config=cfg, max_cache_len=capacity)
    for i in range(cfg.num_hidden_layers):
        k, v = layer_kv(cfg, i, B, context, dtype, device, seed)
        cache.update(k, v, i)
        del k, v
    return cache


def need_bytes(model, B: int, context: int, capacity: int, elem: int) -> int:
    """Memory a case needs beyond the weights: the largest variant cache (capacity keys), one layer's K/V for
    the fill and a DynamicCache's cat, and a GiB of slack (activations, logits, graph pools)."""
    cfg = model.config
    per_layer = kv_bytes(cfg, B, capacity, elem) // cfg.num_hidden_layers
    return kv_bytes(cfg, B, capacity, elem) + 3 * per_layer + 2**30


# ----------------------------------------------------------------------------------------------- one variant
class Step:
    """One decode step of ``model`` on ``cache``: fixed ``input_ids`` and positions ``[B, 1]``, last-token logits."""

    def __init__(self, model, cache, B: int, context: int, call=None):
        from ..hf import cache_kwarg
        self.model, self.call = model, call or model
        g = torch.Generator().manual_seed(B * 7919 + context)
        self.tok = torch.randint(3, model.config.vocab_size, (B, 1), generator=g).to(model.device)
        self.pos = torch.full((B, 1), context, dtype=torch.long, device=model.device)
        self.kw = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}

    def __call__(self):
        return self.call(input_ids=self.tok, position_ids=self.pos, **self.kw).logits


def _elapsed_ms(fn, n: int, gpu: bool) -> float:
    """Mean ms of ``n`` calls of ``fn`` back to back (CUDA events on a GPU, wall clock on a CPU)."""
    if gpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1e3 / n


def run_variant(variant: str, model, B: int, context: int, capacity: int, settings: dict):
    """(ms per step, first-step logits [B, vocab] float32 on the CPU, notes) of one variant on one case."""
    gpu = settings["gpu"]
    impl = "fdlib" if variant.startswith("fdlib") else "sdpa"
    model.set_attn_implementation(impl)
    cache = make_cache(variant, model, B, context, capacity, settings["seed"])
    notes = {}
    compiled = variant.endswith("_compiled")
    if compiled:
        torch._dynamo.reset()
        if variant == "hf_static_compiled" and hasattr(model, "get_compiled_call"):
            call = model.get_compiled_call(None)   # what generate() compiles: HF's default CompileConfig
            notes["compile"] = "model.get_compiled_call(None) (HF's default CompileConfig)"
        else:
            call = torch.compile(model.__call__, mode="reduce-overhead", fullgraph=True)
            notes["compile"] = "torch.compile(model.__call__, mode='reduce-overhead', fullgraph=True)"
    else:
        call = model
    step = Step(model, cache, B, context, call)

    def one():
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        return step()

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        t0 = time.perf_counter()
        first = one()[:, -1].float().cpu()   # from the filled state: the logits every variant must agree on
        notes["first_step_s"] = round(time.perf_counter() - t0, 3)
        if variant == "fdlib_graph":
            fn, notes["replay_vs_eager_err"] = _captured(step, cache, B, context, settings["warmup"], first)
        else:
            for _ in range(settings["warmup"]):
                one()
            fn = one
        ms = _elapsed_ms(fn, settings["steps"], gpu)
        if hasattr(cache, "lengths"):
            notes["lengths_after"] = int(cache.lengths[0])
    return ms, first, notes   # the caller frees the cache, graphs and compiled code (they die with this frame)


def _captured(step, cache, B: int, context: int, warmup: int, first: torch.Tensor):
    """(graph.replay, its first replay's logits error against ``first``): ``warmup`` eager steps on a side
    stream (kernels compiled, plans made), the cache put back to ``context`` keys a sequence, one step captured
    as a CUDA graph (capture runs no kernel), then replayed once from that state."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    synchronize()
    cache.set_lengths([context] * B)   # back to the filled state (the next step rewrites slot `context`)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    cache.set_lengths([context] * B)
    graph.replay()
    return graph.replay, _rel_err(captured[:, -1].float().cpu(), first)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max over rows of max |got - want| / max |want| (logits [B, vocab])."""
    scale = want.abs().amax(-1).clamp_min(1e-30)
    return float(((got - want).abs().amax(-1) / scale).max())


# ----------------------------------------------------------------------------------------------- the run
def check_variants(variants) -> tuple:
    variants = tuple(variants or VARIANTS)
    bad = [v for v in variants if v not in ALL_VARIANTS]
    if bad:
        raise ValueError(f"variants: unknown {bad}; expected some of {', '.join(ALL_VARIANTS)}")
    return variants


def run_generate(batches=None, contexts=None, variants=None, quick: bool = False, steps: int | None = None,
                 warmup: int | None = None, seed: int = 0, ceiling: bool = True, ceiling_gib: float | None = None,
                 progress: bool = True, command: str | None = None) -> dict:
    """Time every (B, context, variant); a results dict (``kind="generate"``) with provenance, the read ceiling,
    the records, and the targets (:data:`TARGETS`) where the run has their variants."""
    variants = check_variants(variants)
    gpu = torch.cuda.is_available() and runtime.MODE == "gpu"
    if not gpu and not quick:
        raise RuntimeError("--generate times the Llama-3-8B shape in bf16 and needs a CUDA GPU; "
                           "--generate --quick runs the code path on a tiny model (CPU numbers, not a GPU's)")
    from ..hf import register   # ImportError naming the extra .[hf] when transformers is missing
    import transformers
    register()
    batches = tuple(batches or (QUICK_BATCHES if quick else BATCHES))
    contexts = tuple(contexts or (QUICK_CONTEXTS if quick else CONTEXTS))
    for name, xs in (("batches", batches), ("contexts", contexts)):
        if any(x < 1 for x in xs):
            raise ValueError(f"{name}: expected positive ints, got {xs}")
    steps = steps or (2 if quick else 10)
    warmup = warmup if warmup is not None else (1 if quick else 3)
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu and not quick else torch.float32
    settings = dict(gpu=gpu, steps=steps, warmup=warmup, seed=seed, quick=quick)
    prov = provenance(command)
    prov["transformers"] = transformers.__version__
    ceil = None
    if ceiling:
        from .ceiling import measure_ceiling
        ceil = measure_ceiling(ceiling_gib or (0.001 if quick else 4.0))
    tbs = ceil["tbs"] if ceil else None
    model = build_model(quick, dtype, device, seed)
    cfg, elem = model.config, torch.finfo(dtype).bits // 8
    wbytes = weight_bytes(model)
    records, skipped = [], []
    bar = Progress(len(batches) * len(contexts) * len(variants), "generate", progress)
    for B in batches:
        for context in contexts:
            capacity = context + warmup + steps + MARGIN
            if gpu:
                free = torch.cuda.mem_get_info()[0]
                need = need_bytes(model, B, context, capacity, elem)
                if need > free:
                    msg = (f"B={B} context={context}: needs ~{need / 2**30:.1f} GiB beside the weights, "
                           f"{free / 2**30:.1f} GiB free")
                    print(f"skipped: {msg}", file=sys.stderr, flush=True)
                    skipped.append(dict(B=B, context=context, reason=msg))
                    for _ in variants:
                        bar.update("skipped")
                    continue
            nbytes = wbytes + kv_bytes(cfg, B, context, elem)
            bound_ms = nbytes / (tbs * 1e12) * 1e3 if tbs and gpu else None   # an interpreter ceiling bounds nothing
            ref = None
            for variant in sorted(variants, key=lambda v: v != REFERENCE):   # the reference first
                rec = dict(B=B, context=context, variant=variant, bytes_per_step=nbytes, bound_ms=bound_ms)
                if variant in GPU_ONLY and not gpu:
                    rec.update(status="skipped", reason="needs a CUDA GPU (CUDA graphs)")
                else:
                    try:
                        ms, first, notes = run_variant(variant, model, B, context, capacity, settings)
                        rec.update(status="ok", ms_per_step=ms, tokens_per_s=B / ms * 1e3, **notes)
                        if bound_ms:
                            rec["frac_of_bound"] = bound_ms / ms
                        if ref is None:
                            ref = (variant, first)
                        rec["logits_reference"] = ref[0]
                        rec["logits_err"] = _rel_err(first, ref[1])
                        rec["argmax_agree"] = float((first.argmax(-1) == ref[1].argmax(-1)).float().mean())
                    except Exception as e:  # noqa: BLE001 - one variant's failure is recorded, the run goes on
                        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
                        rec.update(status="oom" if oom else "error", reason=f"{type(e).__name__}: {e}"[:500])
                        traceback.print_exc(file=sys.stderr)
                    torch._dynamo.reset()   # compiled code and its CUDA-graph pools
                    free_memory()
                records.append(rec)
                bar.update(f"B={B} ctx={context} {variant}")
    bar.close()
    _speedups(records)
    del model
    free_memory()
    return {
        "kind": "generate",
        "schema": SCHEMA,
        "provenance": prov,
        "model": dict(shape="tiny Llama (--quick)" if quick else "Llama-3-8B shape, random weights",
                      config={k: getattr(cfg, k) for k in (TINY if quick else LLAMA3_8B)},
                      dtype=str(dtype).replace("torch.", ""), weight_bytes_per_step=wbytes),
        "settings": dict(batches=batches, contexts=contexts, variants=variants, steps=steps, warmup=warmup,
                         seed=seed, margin=MARGIN, numbers="GPU" if gpu else
                         "CPU wall clock of a tiny model: the code path runs; nothing about a GPU",
                         timing="CUDA events around `steps` back-to-back steps after `warmup` steps" if gpu
                         else "time.perf_counter around `steps` steps after `warmup` steps"),
        "ceiling": ceil,
        "records": records,
        "skipped": skipped,
        "targets": targets(records),
    }


def _speedups(records) -> None:
    """Each record's tokens/s against hf_dynamic's and hf_static_compiled's of the same (B, context)."""
    by = {(r["B"], r["context"], r["variant"]): r for r in records if r["status"] == "ok"}
    for r in records:
        if r["status"] != "ok":
            continue
        for name, peer in (("vs_hf_default", "hf_dynamic"), ("vs_hf_static_compiled", "hf_static_compiled")):
            p = by.get((r["B"], r["context"], peer))
            if p:
                r[name] = r["tokens_per_s"] / p["tokens_per_s"]


def targets(records) -> list[dict]:
    """The issue's targets for ``fdlib_graph`` that this run's records can decide (met: True/False)."""
    t = TARGETS
    out = []
    for r in records:
        if r["variant"] != "fdlib_graph" or r["status"] != "ok":
            continue
        case = (r["B"], r["context"])
        if case in t["vs_hf_default_cases"] and "vs_hf_default" in r:
            out.append(dict(B=case[0], context=case[1], target=f"≥ {t['vs_hf_default']}× hf_dynamic tokens/s",
                            value=r["vs_hf_default"], met=r["vs_hf_default"] >= t["vs_hf_default"]))
        if case[1] == t["vs_hf_best_context"] and "vs_hf_static_compiled" in r:
            out.append(dict(B=case[0], context=case[1], target=f"≥ {t['vs_hf_best']}× hf_static_compiled tokens/s",
                            value=r["vs_hf_static_compiled"],
                            met=r["vs_hf_static_compiled"] >= t["vs_hf_best"]))
        if r.get("frac_of_bound") is not None:
            out.append(dict(B=case[0], context=case[1], target=f"≥ {t['of_bound']:.0%} of the bandwidth bound",
                            value=r["frac_of_bound"], met=r["frac_of_bound"] >= t["of_bound"]))
    return out


# ----------------------------------------------------------------------------------------------- report
def format_generate_table(results) -> str:
    """Markdown: ms per step, tokens/s, the bound, speed-ups and the logits check per (B, context, variant)."""
    prov, st, ceil = results["provenance"], results["settings"], results.get("ceiling") or {}
    tbs = ceil.get("tbs")
    lines = [f"device: {prov['device']} | mode: {prov['mode']} | torch {prov['torch']} | triton {prov['triton']} | "
             f"transformers {prov.get('transformers')} | {prov['date_utc']}",
             f"command: {prov['command']}",
             f"model: {results['model']['shape']}, {results['model']['dtype']}; weights read a step: "
             f"{results['model']['weight_bytes_per_step'] / 1e9:.2f} GB; read ceiling: "
             + (f"{tbs:.2f} TB/s" if tbs else "not measured") + f"; numbers: {st['numbers']}",
             "", "| B | context | variant | ms / step | tokens/s | bound ms | of bound | × HF default | "
             "× HF static+compile | logits err |", "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, spec):
        return "—" if x is None else format(x, spec)

    for r in results["records"]:
        lead = f"| {r['B']} | {r['context']} | {r['variant']} |"
        if r["status"] != "ok":
            lines.append(f"{lead} {r['status']}: {r.get('reason', '')} | | | | | | |")
            continue
        lines.append(f"{lead} {r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | {f(r.get('bound_ms'), '.2f')} | "
                     f"{f(r.get('frac_of_bound'), '.0%')} | {f(r.get('vs_hf_default'), '.2f')} | "
                     f"{f(r.get('vs_hf_static_compiled'), '.2f')} | {r['logits_err']:.1e} |")
    if results.get("targets"):
        lines += ["", "| B | context | target (fdlib_graph) | value | met |", "|---|---|---|---|---|"]
        for t in results["targets"]:
            v = f"{t['value']:.0%}" if "bound" in t["target"] else f"{t['value']:.2f}×"
            lines.append(f"| {t['B']} | {t['context']} | {t['target']} | {v} | {'yes' if t['met'] else 'no'} |")
    for s in results.get("skipped", []):
        lines.append(f"skipped: B={s['B']} context={s['context']} ({s['reason']})")
    return "\n".join(lines)


def write_generate(results, out_dir=None, name=None, force=False) -> dict:
    """NAME.json and NAME.md in ``out_dir`` (default ``results/<device>/``; NAME default ``generate-<stamp>``)."""
    from .report import write_results
    return write_results(results, out_dir, name, force=force, plot=False, table=format_generate_table)

