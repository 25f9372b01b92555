"""fdlib.hf: a tiny random Llama generates with attn_implementation="fdlib" + DecodeCache exactly what HF's sdpa
(default cache) generates: one prompt, a left-padded batch, pages crossed; writes in place, one plan, a compiled
decode step (Inductor's too, writing only the new rows), clear errors. GPU tests (bf16 logits, the Inductor step,
a captured step replayed as lengths grow) at the end."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import fdlib  # noqa: E402
import fdlib.hf  # noqa: E402
from fdlib import runtime  # noqa: E402
from fdlib.hf import DecodeCache, cache_kwarg  # noqa: E402

VOCAB, LAYERS = 128, 2
interpreter = pytest.mark.skipif(runtime.MODE == "gpu", reason="the float32 token-for-token tests run the tiny model "
                                 "on the CPU (Triton's interpreter); on a GPU the bf16 tests at the end run")


def tiny_config(**kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(kw)
    return transformers.LlamaConfig(**cfg)


@pytest.fixture(scope="module")
def model():
    fdlib.hf.register()
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(tiny_config()).eval()
    return m


def left_padded(lengths, seed):
    """input_ids and attention_mask of prompts of these lengths, padded on the left (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[b, T - n:] = 1
    return ids, mask


def generate(model, impl, ids, mask, n, cache=None):
    """Greedy generation of exactly n tokens; (tokens, scores [n, B, vocab])."""
    model.set_attn_implementation(impl)
    kw = {} if cache is None else {cache_kwarg(model): cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             return_dict_in_generate=True, output_scores=True, **kw)
    return out.sequences, torch.stack(out.scores)


def assert_same_generation(model, ids, mask, n, **cache_kw):
    want, want_scores = generate(model, "sdpa", ids, mask, n)
    cache = DecodeCache(model.config, max_batch_size=ids.shape[0], dtype=torch.float32, **cache_kw)
    got, got_scores = generate(model, "fdlib", ids, mask, n, cache)
    assert torch.equal(got, want), f"fdlib generated {got.tolist()}, sdpa {want.tolist()}"
    torch.testing.assert_close(got_scores, want_scores, atol=1e-4, rtol=1e-4)
    return cache


# ---------------------------------------------------------------------------------------------- registration
def test_fdlib_hf_is_reachable_from_a_plain_import_fdlib():
    import subprocess, sys
    code = "import fdlib; fdlib.hf.register(); print(type(fdlib.hf.DecodeCache).__name__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "type", proc.stdout + proc.stderr


def test_register_twice_is_fine(model):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    fdlib.hf.register()
    fdlib.hf.register()
    assert AttentionInterface._global_mapping["fdlib"] is fdlib.hf.fdlib_attention_forward
    assert AttentionMaskInterface._global_mapping["fdlib"] is fdlib.hf.attention.padding_mask
    model.set_attn_implementation("fdlib")
    assert model.config._attn_implementation == "fdlib"


# ---------------------------------------------------------------------------------------------- generation
@interpreter
def test_one_prompt_generates_what_sdpa_generates(model):
    """A 20-token prompt (prefill through SDPA) then 6 greedy tokens through fdlib's plan."""
    ids, mask = left_padded([20], seed=1)
    cache = assert_same_generation(model, ids, mask, 6, max_cache_len=40)
    assert cache.lengths.tolist() == [20 + 5] and int(cache.columns) == 25   # the last token is not fed back


@interpreter
def test_left_padded_batch_generates_what_sdpa_generates(model):
    """Prompts of 19, 5 and 11 tokens padded on the left: the cache holds each one's real tokens from 0."""
    ids, mask = left_padded([19, 5, 11], seed=2)
    cache = assert_same_generation(model, ids, mask, 5, max_cache_len=32)
    assert cache.lengths.tolist() == [19 + 4, 5 + 4, 11 + 4] and int(cache.columns) == 19 + 4


@interpreter
def test_short_left_padded_prompts_take_the_prefill_path(model):
    """Prompts of at most 16 tokens (a q_len fdlib could take) are still a first chunk: their padding is read."""
    ids, mask = left_padded([3, 7], seed=3)
    cache = assert_same_generation(model, ids, mask, 4, max_cache_len=16)
    assert cache.lengths.tolist() == [3 + 3, 7 + 3]


@interpreter
def test_generation_longer_than_a_page(model):
    """Pages of 4 tokens (a row's pages not adjacent in the pool): 10 new tokens cross several pages."""
    ids, mask = left_padded([6, 3], seed=4)
    cache = assert_same_generation(model, ids, mask, 10, max_cache_len=24, page_size=4)
    assert cache.lengths.tolist() == [6 + 9, 3 + 9]
    table = cache.block_table.tolist()
    assert table[0][:2] == [0, 2] and table[1][:2] == [1, 3]


@interpreter
def test_verify_step_and_second_chunk_match_hf(model):
    """A cache that already holds tokens takes a 4-token verify step (fdlib's q_len = 4 plan) and then a
    20-token chunk (SDPA over the cached keys): logits as HF's sdpa with its default cache."""
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randint(3, VOCAB, (2, n), generator=g) for n in (9, 4, 20, 1)]
    logits = {}
    for impl in ("sdpa", "fdlib"):
        model.set_attn_implementation(impl)
        cache = DecodeCache(model.config, 2, 40, dtype=torch.float32) if impl == "fdlib" else \
            transformers.DynamicCache(config=model.config)
        outs, seen = [], 0
        with torch.no_grad():
            for c in chunks:
                pos = torch.arange(seen, seen + c.shape[1])[None].expand(2, -1)
                outs.append(model(input_ids=c, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache}).logits)
                seen += c.shape[1]
        logits[impl] = outs
    for i, (got, want) in enumerate(zip(logits["fdlib"], logits["sdpa"])):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"chunk {i}: {m}")


@interpreter
def test_without_a_cache_fdlib_is_causal_attention_with_padding(model):
    ids, mask = left_padded([12, 7], seed=6)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("fdlib")
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- in place
@interpreter
def test_decode_steps_write_in_place_with_one_plan(model, monkeypatch):
    """K/V keep their storage across steps; no step makes an fdlib plan (the q_len = 1 plan is made once, at
    construction); each step moves every sequence's device length by one."""
    ids, mask = left_padded([18, 9], seed=7)
    model.set_attn_implementation("fdlib")
    cache = DecodeCache(model.config, 2, 32, dtype=torch.float32)
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    lengths_ptr = cache.lengths.data_ptr()
    assert list(cache._plans) == [(1, cache.scale)]
    made = []
    real_plan = fdlib.hf.cache.make_plan
    monkeypatch.setattr(fdlib.hf.cache, "make_plan", lambda *a, **k: made.append(k) or real_plan(*a, **k))
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **kw)
        tok = out.logits[:, -1:].argmax(-1)
        for step in range(3):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            pos = (mask.sum(1, keepdim=True) - 1)
            tok = model(input_ids=tok, attention_mask=mask, position_ids=pos, use_cache=True, **kw).logits.argmax(-1)
            assert cache.lengths.tolist() == [18 + step + 1, 9 + step + 1]
    assert made == [], "a decode step made an fdlib plan"
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == ptrs
    assert cache.lengths.data_ptr() == lengths_ptr


def test_a_dropped_cache_is_freed(request):
    """After its steps, nothing in fdlib.hf keeps a DecodeCache alive: once the caller drops it, its K/V
    buffers (a whole model's cache: 34 GB for Llama-3-8B at B=8 and 32768 keys) are freed. The attention
    function found the step's cache through a module global that held the last one until another cache ran.
    The tiny float32 model in the interpreter, the bf16 one on a GPU."""
    import gc
    import weakref
    model = request.getfixturevalue("gpu_model" if runtime.MODE == "gpu" else "model")
    dev, dtype = model.device, model.dtype
    ids, mask = (t.to(dev) for t in left_padded([7, 3], seed=11))
    model.set_attn_implementation("fdlib")
    cache = DecodeCache(model.config, 2, 16, device=dev, dtype=dtype)
    with torch.no_grad():
        tok = model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache}).logits
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device=dev)], 1)
        model(input_ids=tok[:, -1:].argmax(-1), attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1,
              use_cache=True, **{cache_kwarg(model): cache})
    alive = weakref.ref(cache.layers[0].keys)
    del cache, tok
    gc.collect()
    assert alive() is None, "a DecodeCache's K/V outlived every reference the caller held"


def prompted_pair(model, max_cache_len, page_size, seed, device="cpu", dtype=torch.float32):
    """Two DecodeCaches (B = 2) that hold the same two 17-token prompts, and ``step(cache, tok, pos)``: the
    logits of one decode step through ``"fdlib"``."""
    ids = left_padded([17, 17], seed=seed)[0].to(device)
    model.set_attn_implementation("fdlib")
    key = cache_kwarg(model)
    caches = [DecodeCache(model.config, 2, max_cache_len, device=device, dtype=dtype, page_size=page_size)
              for _ in range(2)]

    def step(cache, tok, pos):
        return model(input_ids=tok, position_ids=pos, use_cache=True, **{key: cache}).logits

    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids, use_cache=True, **{key: cache})
    return caches, step


@interpreter
def test_compiled_decode_step_outside_no_grad_runs_as_eagerly(model):
    """A decode step run outside ``torch.no_grad()`` (its q requires grad, from the weights) compiles and gives
    the eager step's logits; it once failed in AOT autograd ("no autograd formula was registered" for the
    decode op), where the eager step runs."""
    caches, step = prompted_pair(model, 24, None, seed=9)
    torch._dynamo.reset()
    tok, pos = torch.tensor([[5], [9]]), torch.full((2, 1), 17)
    want = step(caches[0], tok, pos)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(caches[1], tok, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0].lengths, caches[1].lengths)


@interpreter
@pytest.mark.parametrize("page_size", [None, 4])
def test_compiled_decode_step_matches_eager_without_recompiling(model, page_size):
    """The decode step compiles with fullgraph=True (no graph break; aot_eager keeps the CPU test quick and runs
    the op's fake implementation while tracing), gives the eager step's logits, and does not recompile as
    the lengths grow; contiguous and paged."""
    caches, step = prompted_pair(model, 24, page_size, seed=8)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    toks = []
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        tok = torch.tensor([[5], [9]])
        for i in range(3):
            pos = torch.full((2, 1), 17 + i)
            want = step(caches[0], tok, pos)
            got = compiled(caches[1], tok, pos)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            tok = want.argmax(-1)
            toks.append(tok)
    assert caches[1].lengths.tolist() == caches[0].lengths.tolist() == [20, 20]
    torch._dynamo.reset()


def _largest_buffer(code: str) -> int:
    """The most elements any buffer that Inductor's generated ``code`` allocates holds (its ``empty_strided_*``
    calls): a copy of a cache buffer needs one as large as it."""
    sizes = re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", code)
    return max((math.prod(int(x) for x in s.split(",") if x.strip()) for s in sizes), default=0)


def check_inductor_writes_in_place(model, page_size, monkeypatch, device, dtype, tol):
    """One decode step compiled by Inductor against the same step eager, from the same state: the logits (max
    |Δ| / max |eager|) and every layer's K and V agree within ``tol``, and the generated code allocates no
    buffer as large as a layer's K or V. Inductor of torch 2.11 does not write in place through a view of a
    graph input (``keys.view(...).index_copy_``); newer ones can, so that rule is put back here (on a torch
    without the newer rule the patch changes nothing): the write must be in place under either."""
    from torch._inductor.fx_passes import reinplace
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setattr(reinplace, "_is_layout_preserving_view_copy_back", lambda *a, **k: False, raising=False)
    caches, step = prompted_pair(model, 1024, page_size, seed=9, device=device, dtype=dtype)
    torch._dynamo.reset()
    with torch.no_grad():
        tok, pos = torch.tensor([[5], [9]], device=device), torch.full((2, 1), 17, device=device)
        want = step(caches[0], tok, pos)
        with torch._inductor.config.patch(force_disable_caches=True):   # compiled here, under the rule above
            got, code = run_and_get_code(torch.compile(step, fullgraph=True), caches[1], tok, pos)
    torch._dynamo.reset()
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert err < tol, f"the compiled step's logits differ from the eager step's by {err:.3g} of their max"
    assert caches[1].lengths.tolist() == caches[0].lengths.tolist() == [18, 18]
    for a, b in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(b.keys, a.keys, atol=tol, rtol=tol)
        torch.testing.assert_close(b.values, a.values, atol=tol, rtol=tol)
    numel = caches[1].layers[0].keys.numel()
    largest = _largest_buffer("\n".join(code))
    assert largest < numel, (f"the compiled step allocates a buffer of {largest} elements, a layer's K/V holds "
                             f"{numel}: it copies the cache instead of writing the new rows in place")


@interpreter
@pytest.mark.parametrize("page_size", [None, 8])
def test_inductor_writes_only_the_new_rows_in_place(model, page_size, monkeypatch):
    """Under Inductor a decode step writes its new K/V rows into the cache's buffers in place (an out-of-place
    write copies each layer's whole K and V and copies them back, every step), and matches the eager step
    (:func:`check_inductor_writes_in_place`); contiguous and paged."""
    check_inductor_writes_in_place(model, page_size, monkeypatch, "cpu", torch.float32, 1e-5)


@interpreter
def test_generate_compiles_the_decode_steps_into_one_graph(model):
    """generate() with a compile config (as it compiles a compileable cache's steps on a GPU; forced onto the
    CPU with aot_eager and fullgraph=True): the same tokens as sdpa, one graph, no recompile as the lengths and
    HF's 2D mask grow (the mask hook hands decode steps None)."""
    from transformers.generation.configuration_utils import CompileConfig
    ids, mask = left_padded([20, 13], seed=12)
    want, _ = generate(model, "sdpa", ids, mask, 5)
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True
    model.set_attn_implementation("fdlib")
    cache = DecodeCache(model.config, 2, 32, dtype=torch.float32)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             compile_config=config, **{cache_kwarg(model): cache})
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- errors
@interpreter
def test_bad_input_gets_clear_errors(model):
    cfg = model.config
    key = cache_kwarg(model)
    for kwargs, what in [(dict(max_batch_size=0, max_cache_len=8), "max_batch_size"),
                         (dict(max_batch_size=1, max_cache_len=8, page_size=3), "page_size"),
                         (dict(max_batch_size=1, max_cache_len=12, page_size=8), "page_size"),
                         (dict(max_batch_size=1, max_cache_len=8, dtype=torch.int8), "dtype")]:
        with pytest.raises((ValueError, TypeError), match=what):
            DecodeCache(cfg, **kwargs)
    if not torch.cuda.is_available():   # a GPU asked where none is: the plan's words, before anything is made
        with pytest.raises(ValueError, match="device: 'cuda' asked, but no CUDA GPU is visible"):
            DecodeCache(cfg, 1, 8, device="cuda")
    with pytest.raises(NotImplementedError, match="sliding"):
        DecodeCache(tiny_config(layer_types=["full_attention", "sliding_attention"], sliding_window=4), 1, 8)
    model.set_attn_implementation("fdlib")
    ids, _ = left_padded([20, 20, 20], seed=9)
    with torch.no_grad():
        with pytest.raises(ValueError, match="max_batch_size: this cache holds at most 2 sequences, the batch has 3"):
            model(input_ids=ids, use_cache=True, **{key: DecodeCache(cfg, 2, 32, dtype=torch.float32)})
        with pytest.raises(ValueError, match="max_cache_len"):
            model(input_ids=ids[:1], use_cache=True, **{key: DecodeCache(cfg, 1, 16, dtype=torch.float32)})
        cache = DecodeCache(cfg, 1, 21, dtype=torch.float32)
        model(input_ids=ids[:1], use_cache=True, **{key: cache})
        model(input_ids=ids[:1, :1], use_cache=True, **{key: cache})   # the 21st token fits
        with pytest.raises(ValueError, match="max_cache_len: 1 new tokens after 21"):
            model(input_ids=ids[:1, :1], use_cache=True, **{key: cache})
        with pytest.raises(TypeError, match="dtype"):
            model(input_ids=ids[:1], use_cache=True, **{key: DecodeCache(cfg, 1, 32, dtype=torch.float16)})
        used = DecodeCache(cfg, 1, 48, dtype=torch.float32)
        model(input_ids=ids[:1], use_cache=True, **{key: used})
        with pytest.raises(ValueError, match=r"attention_mask: expected HF's 2D padding mask \[B=1, 20 cached \+ 20 "
                           r"new columns\], got \[1, 20\]; a second generate\(\) continues the cache"):
            model(input_ids=ids[:1], attention_mask=torch.ones(1, 20, dtype=torch.long), use_cache=True,
                  **{key: used})
        hf_cache = transformers.DynamicCache(config=cfg)
        model(input_ids=ids[:1], use_cache=True, **{key: hf_cache})   # a first chunk attends only itself: fine
        with pytest.raises(RuntimeError, match="runs with past_key_values=fdlib.hf.DecodeCache"):
            model(input_ids=ids[:1, :1], use_cache=True, **{key: hf_cache})
        model.set_attn_implementation("sdpa")
        with pytest.raises(RuntimeError, match="attn_implementation='fdlib'"):   # DecodeCache with sdpa
            model(input_ids=ids[:1], use_cache=True, **{key: DecodeCache(cfg, 1, 32, dtype=torch.float32)})


def test_decode_step_takes_a_query_strided_in_its_head_dim():
    """A decode step's query whose head dim is not at stride 1 (a view HF never makes, but SDPA takes) attends as
    its contiguous copy does: the step, having begun, must not refuse it with the lengths moved and K/V written."""
    from fdlib.hf.attention import fdlib_attention_forward
    cfg = tiny_config(num_attention_heads=4, num_key_value_heads=2, hidden_size=128, head_dim=32)
    outs = []
    for strided in (False, True):
        cache = DecodeCache(cfg, max_batch_size=2, max_cache_len=16, device="cpu", dtype=torch.float32)
        cache.set_lengths([3, 5])
        g = torch.Generator().manual_seed(11)
        for layer in cache.layers:   # keys and values for the cached positions
            layer.keys.normal_(generator=g)
            layer.values.normal_(generator=g)
        k, v = torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g)
        wide = torch.randn(2, 4, 1, 64, generator=g)
        q = wide[..., ::2] if strided else wide[..., ::2].contiguous()
        cache.update(k, v, 0)
        outs.append(fdlib_attention_forward(None, q, k, v, None)[0])
        assert cache.lengths.tolist() == [4, 6]
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and runtime.MODE == "gpu"), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_model():
    fdlib.hf.register()
    torch.manual_seed(10)
    cfg = tiny_config(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=128, vocab_size=512, max_position_embeddings=8192)
    with torch.device("cuda"):
        m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return m


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("positions", ["none", "mask"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_gpu_bf16_logits_match_sdpa(gpu_model, page_size, positions):
    """bf16 on the GPU, a left-padded batch, the same inputs to both: the prompt, then 8 decode steps
    teacher-forced on the same tokens (a near tie cannot send the two down different paths), with the same
    position_ids (none: derived from each cache, as generate() does; or counted over real tokens). fdlib with
    DecodeCache against sdpa with HF's DynamicCache: each step's logits within bf16 tolerance. The cache's plan
    has no host lengths: its decode steps run stream-K, its shares made on the device from the lengths."""
    from hf_steps import max_rel_err, teacher_forced
    ids, mask = left_padded([700, 333, 1000], seed=11)
    ids, mask = ids.cuda(), mask.cuda()
    forced = torch.randint(3, VOCAB, (3, 8), generator=torch.Generator().manual_seed(13)).cuda()
    key = cache_kwarg(gpu_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        want = teacher_forced(gpu_model, "sdpa", transformers.DynamicCache(config=gpu_model.config), ids, mask,
                              forced, positions, key=key)
        cache = DecodeCache(gpu_model.config, 3, 1024, device="cuda", dtype=torch.bfloat16, page_size=page_size)
        got = teacher_forced(gpu_model, "fdlib", cache, ids, mask, forced, positions, key=key)
    for i, err in enumerate(max_rel_err(got, want).tolist()):
        assert err < 3e-2, f"step {i}: logits differ from sdpa's by {err:.3g} of their max (positions={positions})"
    assert cache.plan(1, cache.scale).kernel == "streamk"   # no host lengths: the device schedule's stream-K


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_gpu_inductor_writes_only_the_new_rows_in_place(gpu_model, page_size, monkeypatch):
    """bf16 on the GPU, as :func:`test_inductor_writes_only_the_new_rows_in_place` (Triton kernels: the step
    the generate bench's ``fdlib_compiled`` runs, before its CUDA-graph capture)."""
    check_inductor_writes_in_place(gpu_model, page_size, monkeypatch, "cuda", torch.bfloat16, 3e-2)


@gpu
@pytest.mark.gpu
def test_gpu_captured_step_replays_as_lengths_grow(gpu_model):
    """One decode step captured as a CUDA graph, replayed: each replay appends a token (lengths + 1) and gives
    the logits an eager step gives from the same state."""
    gpu_model.set_attn_implementation("fdlib")
    B, ctx = 2, 600
    caches = [DecodeCache(gpu_model.config, B, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    g = torch.Generator(device="cuda").manual_seed(12)
    for layer_a, layer_b in zip(caches[0].layers, caches[1].layers):
        for which in ("keys", "values"):
            x = torch.randn(getattr(layer_a, which)[:, :ctx].shape, generator=g, device="cuda").bfloat16()
            getattr(layer_a, which)[:, :ctx] = x
            getattr(layer_b, which)[:, :ctx] = x
    for c in caches:
        c.set_lengths([ctx, ctx - 100])
    kw = cache_kwarg(gpu_model)
    tok = torch.tensor([[7], [8]], device="cuda")
    pos = torch.tensor([[ctx], [ctx - 100]], device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()   # warm up on a side stream (kernels compiled, plans made), as capture wants
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gpu_model(input_ids=tok, position_ids=pos, use_cache=True, **{kw: caches[1]})
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        caches[1].set_lengths([ctx, ctx - 100])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gpu_model(input_ids=tok, position_ids=pos, use_cache=True, **{kw: caches[1]}).logits
        assert caches[1].lengths.tolist()[:B] == [ctx, ctx - 100]   # capture runs no kernel
        for i in range(5):
            want = gpu_model(input_ids=tok, position_ids=pos, use_cache=True, **{kw: caches[0]}).logits
            graph.replay()
            torch.testing.assert_close(captured.float(), want.float(), atol=2e-2, rtol=2e-2)
            assert caches[1].lengths.tolist()[:B] == [ctx + i + 1, ctx - 100 + i + 1]
            assert caches[0].lengths.tolist()[:B] == caches[1].lengths.tolist()[:B]
            pos += 1


@interpreter
def test_a_long_cache_runs_stream_k_and_generates_what_sdpa_generates(model):
    """A DecodeCache of 8192 keys for three sequences: its plan has no host lengths, so auto takes stream-K, its
    shares made on the device from the lengths (fdlib.plan.device_schedule_suits); the tokens and scores are
    sdpa's."""
    ids, mask = left_padded([5, 9, 3], 1)
    cache = assert_same_generation(model, ids, mask, 4, max_cache_len=8192)
    assert cache.plan(1, cache.scale).kernel == "streamk"
