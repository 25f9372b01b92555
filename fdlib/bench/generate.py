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
* ``fdlib_compiled``: ``model.forward`` under ``torch.compile(fullgraph=True)`` (mode ``compile_mode``, default
  ``"default"``: no CUDA graphs of its own), so Inductor fuses the model's small kernels (norms, rotary,
  activations, residual adds) around fdlib's attention op; that compiled step is then captured as one CUDA
  graph as ``fdlib_graph`` is;
* ``fdlib_graph_kv8`` (with ``kv_dtype``): ``fdlib_graph`` over ``DecodeCache(kv_dtype=...)``, an 8-bit cache;
  recorded as skipped where this fdlib's ``DecodeCache`` takes no ``kv_dtype``.

Each cache starts from the same state without a prefill: layer l's K/V are random, drawn from a generator seeded
by (seed, l) (a step's cost does not depend on the values, and a 128k-token prefill would cost more than all
the steps). The capacity is context + the steps run + a margin. Each variant's first step's logits are checked
against the reference variant's (``hf_dynamic``, else the first that ran): ``logits_err`` = max |Δ| / max |ref|.

``profile``: one step of ``hf_dynamic`` and of each captured fdlib variant (on a CPU, ``fdlib_eager``) is run
again under ``torch.profiler`` and its time split into the cat, attention, GEMMs, cache writes, small elementwise
kernels and the gaps between launches (:mod:`fdlib.bench.stepprofile`): ``results["profiles"]``.

Timing: ``warmup`` steps, then ``steps`` steps back to back between two CUDA events (ms per step = elapsed /
steps; each step appends a token, so the context grows by at most warmup + steps). No L2 flush is needed: a step
reads ≥ 15 GB of weights. Without a GPU (``--quick`` only) the times are CPU wall clock of the tiny model:
they show the code path runs and say nothing about a GPU.

The bound of a step is the bytes it must read, weights (every parameter but the input embedding table, of
which a step reads B rows) + the context's K/V (2 · layers · B · context · H_kv · D · elem), divided by the
read ceiling measured in the same run (:mod:`fdlib.bench.ceiling`).
"""
from __future__ import annotations

import os
import sys
import time
import traceback
import warnings

import torch

from .. import runtime
from .harness import provenance
from .timing import free_memory, synchronize

SCHEMA = "fdlib.bench.generate/1"
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072 + 4096)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
            tie_word_embeddings=False)
BATCHES, CONTEXTS = (1, 8), (8192, 32768, 131072)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 2), (24, 40)
VARIANTS = ("hf_dynamic", "hf_static", "hf_static_compiled", "fdlib_eager", "fdlib_graph", "fdlib_compiled")
KV8_VARIANT = "fdlib_graph_kv8"
ALL_VARIANTS = VARIANTS + (KV8_VARIANT,)
GPU_ONLY = ("hf_static_compiled", "fdlib_graph", "fdlib_compiled", KV8_VARIANT)
CAPTURED = ("fdlib_graph", "fdlib_compiled", KV8_VARIANT)
"""Variants whose timed step is one CUDA graph's replay."""
PROFILED = ("hf_dynamic",) + CAPTURED
"""Variants profiled with ``profile`` (on a CPU, where nothing is captured: ``fdlib_eager`` instead)."""
REFERENCE = "hf_dynamic"
MARGIN = 64
"""Capacity beyond context + warmup + steps (StaticCache and DecodeCache are made this much larger)."""
TARGETS = dict(vs_hf_default=7.0, vs_hf_default_cases=((1, 131072), (8, 32768)), vs_hf_best=1.3,
               vs_hf_best_context=131072, of_bound=0.85)
"""The issue's targets for fdlib's best step (``fdlib_graph`` or ``fdlib_compiled``): ≥ 7× hf_dynamic's tokens/s
at (B, context) = (1, 128k) and (8, 32k); ≥ 1.3× hf_static_compiled's at 128k; ≥ 85% of the bound everywhere."""


# ----------------------------------------------------------------------------------------------- the model
def llama_config(quick: bool):
    """The ``LlamaConfig`` of :data:`LLAMA3_8B` (``quick``: :data:`TINY`), ``"sdpa"`` attention. transformers 5.x
    keeps the rotary base in ``rope_parameters``: it is passed there where the config takes that argument."""
    import inspect

    import transformers
    kw = dict(TINY if quick else LLAMA3_8B)
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        kw["rope_parameters"] = dict(rope_type="default", rope_theta=kw.pop("rope_theta"))
    return transformers.LlamaConfig(**kw, attn_implementation="sdpa")


def config_record(cfg, keys) -> dict:
    """``{key: value}`` of ``cfg`` for every key in ``keys``, read where this transformers keeps it: an attribute,
    else ``rope_parameters`` (5.x moved ``rope_theta`` there), else None; plus ``rope_parameters`` itself."""
    rope = getattr(cfg, "rope_parameters", None)
    rope = dict(rope) if isinstance(rope, dict) else {}
    out = {}
    for k in keys:
        out[k] = getattr(cfg, k) if hasattr(cfg, k) else rope.get(k)
    if rope:
        out["rope_parameters"] = rope
    return out


def build_model(quick: bool, dtype, device, seed: int):
    """A random ``LlamaForCausalLM`` of the Llama-3-8B shape (``quick``: :data:`TINY`), in ``dtype`` on
    ``device``, in eval mode, with ``"sdpa"`` attention."""
    import transformers
    cfg = llama_config(quick)
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
def accepts_kv_dtype() -> bool:
    """Whether this fdlib's :class:`~fdlib.hf.DecodeCache` takes ``kv_dtype`` (an 8-bit cache)."""
    import inspect

    from ..hf import DecodeCache
    return "kv_dtype" in inspect.signature(DecodeCache.__init__).parameters


def kv_elem(variant: str, dtype) -> int:
    """Bytes of one K or V element the variant's cache holds (an 8-bit cache: 1; its scales are not counted)."""
    return 1 if variant == KV8_VARIANT else torch.finfo(dtype).bits // 8


def make_cache(variant: str, model, B: int, context: int, capacity: int, seed: int, kv_dtype=None):
    """The variant's cache, holding ``context`` random keys per sequence in every layer."""
    import transformers
    cfg, dtype, device = model.config, model.dtype, model.device
    if variant.startswith("fdlib"):
        from ..hf import DecodeCache
        kw = dict(kv_dtype=kv_dtype) if variant == KV8_VARIANT else {}
        cache = DecodeCache(cfg, B, capacity, device=device, dtype=dtype, **kw)
        fill_decode_cache(cache, B, context, seed, through_prefill=variant == KV8_VARIANT)
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


def fill_decode_cache(cache, B: int, context: int, seed: int, through_prefill: bool = False) -> None:
    """Put :func:`layer_kv`'s ``context`` keys a sequence into a :class:`~fdlib.hf.DecodeCache`: copied into its
    buffers, or (``through_prefill``, as an 8-bit cache needs: it quantizes on write) written by the cache's own
    step path (:meth:`~fdlib.hf.DecodeCache.begin_step`, then :meth:`~fdlib.hf.DecodeCache.write` layer by layer)."""
    cfg, dtype, device = _Cfg(cache), cache.dtype, cache.device
    if through_prefill:
        cache.begin_step(B, context, None)
    for i, layer in enumerate(cache.layers):
        k, v = layer_kv(cfg, i, B, context, dtype, device, seed)
        if through_prefill:
            cache.write(i, k, v)
        else:
            layer.keys[:B, :context].copy_(k.transpose(1, 2))
            layer.values[:B, :context].copy_(v.transpose(1, 2))
        del k, v
    cache.set_lengths([context] * B)


class _Cfg:
    """The config fields :func:`layer_kv` reads, from a DecodeCache."""

    def __init__(self, cache):
        self.num_key_value_heads, self.head_dim = cache.H_kv, cache.D


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


def compiled_call(variant: str, model, compile_mode: str | None):
    """(the callable a compiled variant steps with, a note saying how it was compiled)."""
    if variant == "hf_static_compiled" and hasattr(model, "get_compiled_call"):
        return model.get_compiled_call(None), "model.get_compiled_call(None) (HF's default CompileConfig)"
    mode = compile_mode or "default"
    return (torch.compile(model.forward, mode=mode, fullgraph=True),
            f"torch.compile(model.forward, mode={mode!r}, fullgraph=True), then captured as one CUDA graph")


def run_variant(variant: str, model, B: int, context: int, capacity: int, settings: dict):
    """(ms per step, first-step logits [B, vocab] float32 on the CPU, notes) of one variant on one case; with
    ``settings["profile"]`` and a profiled variant, ``notes["profile"]`` (:func:`fdlib.bench.stepprofile.
    profile_step` of one more step)."""
    gpu = settings["gpu"]
    impl = "fdlib" if variant.startswith("fdlib") else "sdpa"
    model.set_attn_implementation(impl)
    cache = make_cache(variant, model, B, context, capacity, settings["seed"], settings.get("kv_dtype"))
    notes = {}
    torch._dynamo.reset()
    call = model
    if variant.endswith("_compiled"):
        call, notes["compile"] = compiled_call(variant, model, settings.get("compile_mode"))
    step = Step(model, cache, B, context, call)
    mark = variant == "hf_static_compiled"   # CUDA graphs of torch.compile's own (mode "reduce-overhead")

    def one():
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        return step()

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        t0 = time.perf_counter()
        first = one()[:, -1].float().cpu()   # from the filled state: the logits every variant must agree on
        notes["first_step_s"] = round(time.perf_counter() - t0, 3)
        if variant in CAPTURED:
            fn, notes["replay_vs_eager_err"] = _captured(step, cache, B, context, settings["warmup"], first)
        else:
            for _ in range(settings["warmup"]):
                one()
            fn = one
        ms = _elapsed_ms(fn, settings["steps"], gpu)
        if settings.get("profile") and variant in (PROFILED if gpu else ("hf_dynamic", "fdlib_eager")):
            from .stepprofile import annotate_cache, profile_step
            with annotate_cache(cache):   # (a captured step's launches are fixed: nothing to mark there)
                notes["profile"] = profile_step(fn, gpu)
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
        for _ in range(max(warmup, 1)):
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
def check_variants(variants, kv_dtype=None) -> tuple:
    """The variants to run: ``variants`` (default :data:`VARIANTS`), plus :data:`KV8_VARIANT` with ``kv_dtype``."""
    variants = tuple(variants or VARIANTS)
    bad = [v for v in variants if v not in ALL_VARIANTS]
    if bad:
        raise ValueError(f"variants: unknown {bad}; expected some of {', '.join(ALL_VARIANTS)}")
    if kv_dtype is not None and KV8_VARIANT not in variants:
        variants += (KV8_VARIANT,)
    if KV8_VARIANT in variants and kv_dtype is None:
        raise ValueError(f"variants: {KV8_VARIANT} needs kv_dtype (--kv-dtype float8_e4m3fn or int8)")
    return variants


def _kv_dtype(name):
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in ("float8_e4m3fn", "int8"):
        raise ValueError(f"kv_dtype: expected float8_e4m3fn or int8, got {name!r}")
    return getattr(torch, name)


def run_generate(batches=None, contexts=None, variants=None, quick: bool = False, steps: int | None = None,
                 warmup: int | None = None, seed: int = 0, ceiling: bool = True, ceiling_gib: float | None = None,
                 progress: bool = True, command: str | None = None, profile: bool = False, kv_dtype=None,
                 compile_mode: str | None = None, budget_s: float | None = None, checkpoint=None,
                 cases=None) -> dict:
    """Time every (B, context, variant); a results dict (``kind="generate"``) with provenance, the read ceiling,
    the records, the profiles (``profile``) and the targets (:data:`TARGETS`) where the run has their variants.

    ``cases``: (B, context) pairs run in this order (most wanted first where a budget may run out), instead of
    every B of ``batches`` with every context of ``contexts``. A progress line per record goes to stderr. ``budget_s``: once the run has taken this long, the rows left are
    recorded as skipped (the file still comes out). ``checkpoint(results)`` is called after every (B, context)
    with the results so far (e.g. to write a partial file that outlives a killed run)."""
    kv_dtype = _kv_dtype(kv_dtype)
    variants = check_variants(variants, kv_dtype)
    gpu = torch.cuda.is_available() and runtime.MODE == "gpu"
    if not gpu and not quick:
        raise RuntimeError("--generate times the Llama-3-8B shape in bf16 and needs a CUDA GPU; "
                           "--generate --quick runs the code path on a tiny model (CPU numbers, not a GPU's)")
    from ..hf import register   # ImportError naming the extra .[hf] when transformers is missing
    import transformers
    register()
    if cases:
        cases = tuple((int(b), int(c)) for b, c in cases)
        batches, contexts = tuple(dict.fromkeys(b for b, _ in cases)), tuple(dict.fromkeys(c for _, c in cases))
    batches = tuple(batches or (QUICK_BATCHES if quick else BATCHES))
    contexts = tuple(contexts or (QUICK_CONTEXTS if quick else CONTEXTS))
    for name, xs in (("batches", batches), ("contexts", contexts)):
        if any(x < 1 for x in xs):
            raise ValueError(f"{name}: expected positive ints, got {xs}")
    cases = cases or tuple((B, c) for B in batches for c in contexts)
    steps = steps or (2 if quick else 10)
    warmup = warmup if warmup is not None else (1 if quick else 3)
    t_start = time.perf_counter()
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu and not quick else torch.float32
    kv8_ok = kv_dtype is None or accepts_kv_dtype()
    settings = dict(gpu=gpu, steps=steps, warmup=warmup, seed=seed, quick=quick, profile=profile,
                    kv_dtype=kv_dtype, compile_mode=compile_mode)
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
    records, skipped, profiles = [], [], []
    results = {
        "kind": "generate",
        "schema": SCHEMA,
        "provenance": prov,
        "model": dict(shape="tiny Llama (--quick)" if quick else "Llama-3-8B shape, random weights",
                      config=config_record(cfg, TINY if quick else LLAMA3_8B),
                      dtype=str(dtype).replace("torch.", ""), weight_bytes_per_step=wbytes),
        "settings": dict(batches=batches, contexts=contexts, cases=cases, variants=variants, steps=steps, warmup=warmup,
                         seed=seed, margin=MARGIN, kv_dtype=str(kv_dtype).replace("torch.", "") if kv_dtype
                         else None, compile_mode=compile_mode or "default", budget_s=budget_s,
                         numbers="GPU" if gpu else
                         "CPU wall clock of a tiny model: the code path runs; nothing about a GPU",
                         timing="CUDA events around `steps` back-to-back steps after `warmup` steps" if gpu
                         else "time.perf_counter around `steps` steps after `warmup` steps"),
        "ceiling": ceil,
        "records": records,
        "skipped": skipped,
        "profiles": profiles,
    }
    total, done = len(cases) * len(variants), 0
    for B, context in cases:
        capacity = context + warmup + steps + MARGIN
        case_skip = None
        if budget_s is not None and time.perf_counter() - t_start > budget_s:
            case_skip = f"the run's time budget ({budget_s:g} s) was spent"
        elif gpu:
            free = torch.cuda.mem_get_info()[0]
            need = need_bytes(model, B, context, capacity, elem)
            if need > free:
                case_skip = (f"needs ~{need / 2**30:.1f} GiB beside the weights, {free / 2**30:.1f} GiB free")
        if case_skip:
            skipped.append(dict(B=B, context=context, reason=case_skip))
            for variant in variants:
                records.append(dict(B=B, context=context, variant=variant, status="skipped", reason=case_skip))
                done += 1
                _line(progress, done, total, t_start, records[-1])
            continue
        ref = None
        for variant in sorted(variants, key=lambda v: v != REFERENCE):   # the reference first
            nbytes = wbytes + kv_bytes(cfg, B, context, kv_elem(variant, dtype))
            bound_ms = nbytes / (tbs * 1e12) * 1e3 if tbs and gpu else None   # an interpreter ceiling bounds nothing
            rec = dict(B=B, context=context, variant=variant, bytes_per_step=nbytes, bound_ms=bound_ms)
            if variant in GPU_ONLY and not gpu:
                rec.update(status="skipped", reason="needs a CUDA GPU (CUDA graphs)")
            elif variant == KV8_VARIANT and not kv8_ok:
                rec.update(status="skipped", reason="this fdlib's DecodeCache takes no kv_dtype (no 8-bit cache)")
            else:
                try:
                    ms, first, notes = run_variant(variant, model, B, context, capacity, settings)
                    prof = notes.pop("profile", None)
                    if prof is not None:
                        profiles.append(dict(B=B, context=context, variant=variant, ms_per_step=ms,
                                             summary=prof))
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
            _speedups(records)
            done += 1
            _line(progress, done, total, t_start, rec)
        if checkpoint is not None:
            results["targets"] = targets(records)
            checkpoint(results)
    _speedups(records)
    results["targets"] = targets(records)
    results["settings"]["seconds"] = round(time.perf_counter() - t_start, 1)
    del model
    free_memory()
    return results


def _line(enabled: bool, done: int, total: int, t_start: float, r: dict) -> None:
    """One progress line on stderr for record ``r``: its time, tokens/s, share of the bound, speed-up."""
    if not enabled:
        return
    head = f"[{done}/{total} {time.perf_counter() - t_start:6.0f} s] B={r['B']} context={r['context']} {r['variant']}"
    if r["status"] != "ok":
        tail = f"{r['status']}: {r.get('reason', '')}"[:160]
    else:
        tail = f"{r['ms_per_step']:.2f} ms/step, {r['tokens_per_s']:.1f} tokens/s"
        if r.get("frac_of_bound") is not None:
            tail += f", {r['frac_of_bound']:.0%} of bound ({r['bound_ms']:.2f} ms)"
        if r.get("vs_hf_default") is not None:
            tail += f", {r['vs_hf_default']:.2f}x HF default"
        tail += f", logits err {r['logits_err']:.1e}"
    print(f"{head}: {tail}", file=sys.stderr, flush=True)


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


BEST = ("fdlib_graph", "fdlib_compiled")
"""fdlib's 16-bit captured steps; the targets are judged on the faster of the two at each (B, context)."""


def best_fdlib(records) -> dict:
    """{(B, context): the ok record of :data:`BEST` with the most tokens/s}."""
    best = {}
    for r in records:
        if r["variant"] in BEST and r["status"] == "ok":
            case = (r["B"], r["context"])
            if case not in best or r["tokens_per_s"] > best[case]["tokens_per_s"]:
                best[case] = r
    return best


def targets(records) -> list[dict]:
    """The issue's targets for fdlib's best step (:func:`best_fdlib`) that this run's records can decide."""
    t = TARGETS
    out = []
    for case, r in sorted(best_fdlib(records).items()):
        base = dict(B=case[0], context=case[1], variant=r["variant"])
        if case in t["vs_hf_default_cases"] and "vs_hf_default" in r:
            out.append(dict(base, target=f"≥ {t['vs_hf_default']}× hf_dynamic tokens/s",
                            value=r["vs_hf_default"], met=r["vs_hf_default"] >= t["vs_hf_default"]))
        if case[1] == t["vs_hf_best_context"] and "vs_hf_static_compiled" in r:
            out.append(dict(base, target=f"≥ {t['vs_hf_best']}× hf_static_compiled tokens/s",
                            value=r["vs_hf_static_compiled"],
                            met=r["vs_hf_static_compiled"] >= t["vs_hf_best"]))
        if r.get("frac_of_bound") is not None:
            out.append(dict(base, target=f"≥ {t['of_bound']:.0%} of the bandwidth bound",
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
        lines += ["", "| B | context | target (fdlib's best step) | value | met | variant |",
                  "|---|---|---|---|---|---|"]
        for t in results["targets"]:
            v = f"{t['value']:.0%}" if "bound" in t["target"] else f"{t['value']:.2f}×"
            lines.append(f"| {t['B']} | {t['context']} | {t['target']} | {v} | {'yes' if t['met'] else 'no'} | "
                         f"{t.get('variant', 'fdlib_graph')} |")
    for s in results.get("skipped", []):
        lines.append(f"skipped: B={s['B']} context={s['context']} ({s['reason']})")
    return "\n".join(lines)


def write_generate(results, out_dir=None, name=None, force=False) -> dict:
    """NAME.json and NAME.md in ``out_dir`` (default ``results/<device>/``; NAME default ``generate-<stamp>``);
    with profiles, NAME-profile.json (the profiles and the run's provenance) and NAME-profile.md too."""
    import datetime as _dt

    from .report import write_results
    from .stepprofile import format_profiles
    if name is None:
        name = "generate-" + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    paths = write_results(results, out_dir, name, force=force, plot=False, table=format_generate_table)
    if results.get("profiles"):
        prof = dict(kind="generate-profile", schema=SCHEMA, provenance=results["provenance"],
                    model=results["model"], profiles=results["profiles"])
        more = write_results(prof, os.path.dirname(paths["json"]), name + "-profile", force=force, plot=False,
                             table=lambda r: _profile_header(r) + format_profiles(r["profiles"]))
        paths.update(profile_json=more["json"], profile_table=more["table"])
    return paths


def _profile_header(r) -> str:
    p = r["provenance"]
    return (f"device: {p['device']} | torch {p['torch']} | transformers {p.get('transformers')} | {p['date_utc']}\n"
            f"command: {p['command']}\nms per step of one profiled step, by category (share of its span)\n\n")
