"""fdlib.hf.DecodeCache's one rule for where a sequence's keys go (its real tokens, in order, from position 0;
padding never), on every path: chunks of at most 16 tokens and of more, first and later turns, eager and
compiled; a refused step that leaves the cache exactly as it was; what a second generate() does; the refusal of
sliding-window configs. Generation is compared token for token and logit for logit with HF's sdpa attention and
its own DynamicCache, fed the same way, on the tiny float32 Llama of tests/test_hf.py (Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from hypothesis import given, strategies as st  # noqa: E402

import fdlib.hf  # noqa: E402
from fdlib.hf import DecodeCache, cache_kwarg  # noqa: E402
from helpers import hyp_settings  # noqa: E402
from test_hf import VOCAB, interpreter, model, tiny_config  # noqa: E402,F401  (model: the module's fixture)


def run_generate(model, impl, cache, ids, mask, n, chunk=None):
    """Greedy generation of exactly n tokens with ``cache`` (None: HF's default); (sequences, scores [n, B, V])."""
    model.set_attn_implementation(impl)
    kw = {} if cache is None else {cache_kwarg(model): cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             prefill_chunk_size=chunk, return_dict_in_generate=True, output_scores=True, **kw)
    return out.sequences, torch.stack(out.scores)


def turns_of(rows, seed):
    """Each turn's new tokens of every sequence, left-padded within the turn (pad id 0): (ids, mask) a turn.
    ``rows[b]`` lists (pads, tokens) a turn for sequence b; a later turn's padding lands between the sequence's
    tokens once the turns are joined, as a batch of follow-up prompts padded on the left does."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for turn in range(len(rows[0])):
        width = max(p + n for r in rows for p, n in [r[turn]])
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            p, n = r[turn]
            ids[b, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
            mask[b, width - n:] = 1
        out.append((ids, mask))
    return out


def converse(model, impl, cache, turns, n, chunk):
    """generate() once a turn on the same cache, each call given the whole conversation so far (HF's way of
    continuing a cache); the new tokens and scores of every turn."""
    seqs, mask, got = None, None, []
    for ids, m in turns:
        if seqs is not None:
            ids = torch.cat([seqs, ids], 1)
            m = torch.cat([mask, torch.ones(mask.shape[0], n, dtype=mask.dtype), m], 1)
        seqs, scores = run_generate(model, impl, cache, ids, m, n, chunk)
        got.append((seqs[:, ids.shape[1]:], scores))
        mask = m
    return got


def assert_same_turns(got, want):
    for i, ((gt, gs), (wt, ws)) in enumerate(zip(got, want)):
        assert torch.equal(gt, wt), f"turn {i}: fdlib generated {gt.tolist()}, sdpa {wt.tolist()}"
        torch.testing.assert_close(gs, ws, atol=1e-4, rtol=1e-4, msg=lambda m: f"turn {i} scores: {m}")


# ---------------------------------------------------------------------------------------------- one rule
@interpreter
@pytest.mark.parametrize("chunk", [4, 8, 16, 20])
def test_chunked_prefill_skips_the_left_padding_of_every_chunk(model, chunk):
    """A 12-column batch whose first sequence is 9 pads and 3 tokens, prefilled in chunks: chunks of at most
    16 tokens and of more store the same keys (the 3 real ones) and generate sdpa's tokens."""
    torch.manual_seed(47)
    ids = torch.randint(3, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :9], ids[0, :9] = 0, 0
    want = run_generate(model, "sdpa", transformers.DynamicCache(config=model.config), ids, mask, 5, chunk)
    cache = DecodeCache(model.config, 2, 17, dtype=torch.float32)
    got = run_generate(model, "fdlib", cache, ids, mask, 5, chunk)
    assert_same_turns([got], [want])
    assert cache.lengths.tolist() == [3 + 4, 12 + 4]


@interpreter
@hyp_settings(10)
@given(data=st.data())
def test_any_padding_chunking_and_turns_generate_what_sdpa_generates(model, data):
    """Random batches (1-3 sequences of 1-20 tokens, 0-3 extra pads), chunk sizes 1-32 (or none), 1-2 turns
    (a second turn's 1-6 new tokens left-padded within it, so its padding lies between tokens): the same
    tokens and scores as sdpa with its DynamicCache, and each sequence holds exactly its real tokens."""
    B = data.draw(st.integers(1, 3), label="B")
    n_turns = data.draw(st.integers(1, 2), label="turns")
    chunk = data.draw(st.one_of(st.none(), st.integers(1, 32)), label="prefill_chunk_size")
    rows = [[(data.draw(st.integers(0, 3)), data.draw(st.integers(1, 20 if t == 0 else 6))) for t in range(n_turns)]
            for _ in range(B)]
    n = 3
    turns = turns_of(rows, seed=data.draw(st.integers(0, 2**16), label="seed"))
    capacity = sum(ids.shape[1] for ids, _ in turns) + n * n_turns
    want = converse(model, "sdpa", transformers.DynamicCache(config=model.config), turns, n, chunk)
    cache = DecodeCache(model.config, B, capacity, dtype=torch.float32)
    got = converse(model, "fdlib", cache, turns, n, chunk)
    assert_same_turns(got, want)
    real = sum(m.sum(1) for _, m in turns) + n * n_turns - 1   # the last token is not fed back
    assert cache.lengths.tolist() == real.tolist()


@interpreter
def test_compiled_chunked_prefill_skips_padding_too(model):
    """generate() compiling every forward (as it does on a GPU; forced onto the CPU with aot_eager, fullgraph):
    prefill chunks of 17 and of 3 tokens with left padding compile too (their mask read on the device, no
    sync: SDPA over the whole cache) and give sdpa's tokens."""
    from transformers.generation.configuration_utils import CompileConfig
    ids, mask = turns_of([[(0, 10)], [(0, 20)]], seed=3)[0]
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True
    for chunk in (17,):   # a chunk of 17 tokens, then one of 3
        want = run_generate(model, "sdpa", transformers.DynamicCache(config=model.config), ids, mask, 4, chunk)
        cache = DecodeCache(model.config, 2, 28, dtype=torch.float32)
        model.set_attn_implementation("fdlib")
        torch._dynamo.reset()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                 prefill_chunk_size=chunk, compile_config=config, return_dict_in_generate=True,
                                 output_scores=True, **{cache_kwarg(model): cache})
        torch._dynamo.reset()
        assert_same_turns([(out.sequences, torch.stack(out.scores))], [want])
        assert cache.lengths.tolist() == [10 + 3, 20 + 3]


# ---------------------------------------------------------------------------------------------- refused steps
def snapshot(cache):
    """Every attribute of the cache and its layers, tensors cloned (plans by key)."""
    def copy(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, dict):
            return {k: copy(x) for k, x in v.items()} if all(isinstance(k, str) for k in v) else sorted(v, key=str)
        return v
    state = {k: copy(v) for k, v in vars(cache).items() if k not in ("layers",)}
    state["layers"] = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return state


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for k in before:
        a, b = before[k], after[k]
        if k == "layers":
            for (ka, va), (kb, vb) in zip(a, b):
                assert torch.equal(ka, kb) and torch.equal(va, vb), f"{k}: K/V changed"
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), k
            for x in a:
                assert (torch.equal(a[x], b[x]) if isinstance(a[x], torch.Tensor) else a[x] is b[x] or a[x] == b[x]), \
                    f"{k}[{x}] changed"
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"{k}: {a.tolist()} became {b.tolist()}"
        else:
            assert a == b, f"{k}: {a!r} became {b!r}"


@interpreter
@pytest.mark.parametrize("page_size", [None, 4])
def test_a_refused_step_leaves_the_cache_as_it_was(model, page_size):
    """Steps refused at their start (a mask that is not [B, cached + new columns], a step that does not fit, a
    layer that ran without fdlib) change no attribute, length, count or stored key; the same cache then
    generates exactly what sdpa generates."""
    cfg, key = model.config, cache_kwarg(model)
    (ids, mask), = turns_of([[(2, 18)], [(0, 20)]], seed=5)
    cache = DecodeCache(cfg, 2, 40, dtype=torch.float32, page_size=page_size)
    model.set_attn_implementation("fdlib")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{key: cache})   # 20 columns held
        state = snapshot(cache)
        with pytest.raises(ValueError, match=r"attention_mask: expected HF's 2D padding mask \[B=2, 20 cached \+ 4"):
            model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True, **{key: cache})
        assert_same_state(state, snapshot(cache))
        with pytest.raises(ValueError, match=r"attention_mask: expected HF's 2D padding mask \[B=2, 20 cached \+ 18"):
            model(input_ids=ids[:, :18], attention_mask=mask[:, :10], use_cache=True, **{key: cache})
        assert_same_state(state, snapshot(cache))
        with pytest.raises(ValueError, match="max_cache_len: 21 new tokens after 20"):
            model(input_ids=torch.cat([ids, ids[:, :1]], 1), use_cache=True, **{key: cache})
        assert_same_state(state, snapshot(cache))
        model.set_attn_implementation("sdpa")
        with pytest.raises(RuntimeError, match="ran its attention without fdlib"):
            model(input_ids=ids[:, :1], use_cache=True, **{key: cache})
        assert_same_state(state, snapshot(cache))
    cache.reset()
    want = run_generate(model, "sdpa", None, ids, mask, 4)
    assert_same_turns([run_generate(model, "fdlib", cache, ids, mask, 4)], [want])


# ---------------------------------------------------------------------------------------------- second call
@interpreter
def test_a_second_generate_continues_the_cache_and_reset_starts_over(model):
    """A second generate() on the same DecodeCache continues it as HF's DynamicCache does (given the whole
    conversation, HF feeds only the tokens the cache lacks); a new padded prompt on the used cache is refused
    with a ValueError that says to reset; after reset() the cache generates what a fresh one does."""
    turns = turns_of([[(0, 6), (0, 3)], [(0, 14), (2, 1)]], seed=7)
    want = converse(model, "sdpa", transformers.DynamicCache(config=model.config), turns, 3, None)
    cache = DecodeCache(model.config, 2, 48, dtype=torch.float32)
    assert_same_turns(converse(model, "fdlib", cache, turns, 3, None), want)
    state = snapshot(cache)
    (ids, mask), = turns_of([[(5, 9)], [(0, 14)]], seed=8)
    with pytest.raises(ValueError, match=r"continues the cache .pass the whole conversation so far.: call "
                       r"cache.reset\(\) before a new prompt"):
        run_generate(model, "fdlib", cache, ids, mask, 3)
    assert_same_state(state, snapshot(cache))
    cache.reset()
    want = run_generate(model, "sdpa", None, ids, mask, 3)
    assert_same_turns([run_generate(model, "fdlib", cache, ids, mask, 3)], [want])


# ---------------------------------------------------------------------------------------------- sliding windows
@pytest.mark.parametrize("name", ["MistralConfig", "Gemma2Config", "Gemma3TextConfig"])
def test_sliding_window_configs_are_refused_by_name(name):
    cfg = getattr(transformers, name)(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(NotImplementedError, match=rf"config: DecodeCache holds full-attention layers only; this "
                       rf"{cfg.model_type} config has sliding-window attention \(sliding_window=4096.*\): generate "
                       "with transformers' own caches"):
        DecodeCache(cfg, 1, 8, dtype=torch.float32)
    DecodeCache(tiny_config(), 1, 8, dtype=torch.float32)   # full attention: fine
