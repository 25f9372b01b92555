"""An 8-bit fdlib.hf.DecodeCache (kv_dtype=, granularity=): every token quantized as it is written, by one fused
kernel, exactly as fdlib.quantize_kv (or its fixed scale) quantizes it, pads skipped, pages or not; a decode step
reads it through fdlib's 8-bit path and matches float64 attention on the dequantized cache. A compiled step
(torch.compile does not take an 8-bit cache yet) raises the documented NotImplementedError and moves nothing."""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import fdlib  # noqa: E402
from fdlib.hf import DecodeCache  # noqa: E402
from fdlib.hf.attention import decode  # noqa: E402
from fdlib.quant import QMAX, dequantize_kv, quantize_kv  # noqa: E402
from helpers import OUT_RTOL, row_rel_err  # noqa: E402
from test_hf import tiny_config  # noqa: E402

H_KV, D, LAYERS = 2, 16, 2


def ref_quant(x, s, dtype):
    """x [..., H, D] on the grid of scale s ([H] or a float): quantize_kv's rounding with a given scale."""
    y = x.double().float() / (s[:, None] if isinstance(s, torch.Tensor) else s)
    if dtype == torch.int8:
        return y.round().clamp(-127, 127).to(dtype)
    return y.clamp(-448, 448).to(dtype)


def raw(cache, layer, which):
    """(stored [B_max, L_max, H, D], scale: [B_max, L_max, H] per token, else [H]) of a layer, pages gathered."""
    lay = cache.layers[layer]
    t, s = (lay.keys, lay.k_scale) if which == "keys" else (lay.values, lay.v_scale)
    if cache.page_size is not None:
        rows = cache.block_table.long()
        t = t[rows].reshape(cache.max_batch_size, cache.max_cache_len, H_KV, D)
        if cache.kv8.token:
            s = s[rows].reshape(cache.max_batch_size, cache.max_cache_len, H_KV)
    return t.cpu(), s.cpu()


def step(cache, k, v, mask=None):
    """One step of every layer (layer i's K/V: k·(i + 1)), as the "fdlib" attention runs it."""
    B, _, T, _ = k.shape
    k, v = k.to(cache.device), v.to(cache.device)             # the cache's device (the GPU where there is one)
    mask = None if mask is None else mask.to(cache.device)
    for i in range(LAYERS):
        cache.update(k * (i + 1), v * (i + 1), i)
        cache._awaiting = None
        if i == 0:
            cache.begin_step(B, T, mask)
        cache.write(i, k * (i + 1), v * (i + 1))


@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("granularity,given", [("token", None), ("head", None), ("tensor", None), ("head", 0.004),
                                               ("tensor", 0.003)])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_append_quantizes_each_token_and_decode_reads_it(kv_dtype, granularity, given, page_size):
    """A left-padded prompt of 7 columns (2 of them pads in sequence 1), then steps of 1, 3 and 1 tokens: the
    cache holds each real token quantized as quantize_kv quantizes it (per token), or on the fixed grid (per head
    or tensor: given, or calibrated from the prompt's real tokens; larger later values saturate); a decode step
    then matches float64 attention on the dequantized cache."""
    g = torch.Generator().manual_seed(51)
    B, B_max, L = 2, 3, 24
    scales = {} if given is None else dict(k_scale=given, v_scale=given * 2)
    cache = DecodeCache(tiny_config(), B_max, L, dtype=torch.float16, page_size=page_size, kv_dtype=kv_dtype,
                        granularity=granularity, **scales)
    mask = torch.ones(B, 7, dtype=torch.long)
    mask[1, :2] = 0
    steps = [(7, mask)] + [(t, None) for t in (1, 3, 1)]
    fed = {i: ([], []) for i in range(B)}   # each sequence's real K and V tokens, in order
    for T, m in steps:
        k = torch.randn(B, H_KV, T, D, generator=g).half() * (1 if T == 7 else 2)
        v = torch.randn(B, H_KV, T, D, generator=g).half()
        step(cache, k, v, m)
        for b in range(B):
            keep = slice(None) if m is None else m[b].bool()
            fed[b][0].append(k[b].transpose(0, 1)[keep])
            fed[b][1].append(v[b].transpose(0, 1)[keep])
    lens = cache.lengths[:B].cpu()
    assert lens.tolist() == [7 + 5, 5 + 5]
    for layer in range(LAYERS):
        deq = []
        for which, w in (("keys", 0), ("values", 1)):
            stored, scale = raw(cache, layer, which)
            x = [torch.cat(fed[b][w]) * (layer + 1) for b in range(B)]   # [n_b, H, D]
            if granularity == "token":
                ref = [quantize_kv(xb, dtype=kv_dtype, granularity="token") for xb in x]
            else:
                if given is None:   # calibrated: quantize_kv's scale of the prompt's real tokens
                    prompt = torch.cat([torch.cat(fed[b][w][:1]) for b in range(B)]) * (layer + 1)
                    s = quantize_kv(prompt, dtype=kv_dtype, granularity=granularity)[1]
                    s = torch.full((H_KV,), s) if granularity == "tensor" else s
                else:
                    s = torch.full((H_KV,), given * (1 + w))
                torch.testing.assert_close(scale, s, rtol=0, atol=0)
                ref = [(ref_quant(xb, s, kv_dtype), s) for xb in x]
            for b in range(B):
                n = int(lens[b])
                got_s = scale[b, :n] if granularity == "token" else scale
                assert torch.equal(stored[b, :n].float(), ref[b][0].float()), f"layer {layer} {which} seq {b}"
                torch.testing.assert_close(got_s, ref[b][1], rtol=0, atol=0)
            full = torch.zeros(B, L, H_KV, D, dtype=torch.float64)
            for b in range(B):
                full[b, :int(lens[b])] = dequantize_kv(*ref[b], dtype=torch.float64)
            deq.append(full)
        if given is not None:
            assert (raw(cache, layer, "keys")[0][:B].float().abs() == QMAX[kv_dtype]).any(), "nothing saturated"
        q = torch.randn(B, 4, 1, D, generator=g).half()
        out = decode(cache, layer, q.to(cache.device)).cpu()             # [B, 1, H_q, D]
        want, _ = fdlib.reference_attention(q.transpose(1, 2), deq[0], deq[1], lens)
        assert row_rel_err(out.float(), want).max().item() <= OUT_RTOL[torch.float16]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_the_fused_append_is_quantize_kv_bit_for_bit_tiny_tokens_too(kv_dtype):
    """The fused append kernel (fdlib.hf.append) and fdlib.quantize_kv on the same device give the same per-token
    scales and stored values bit for bit, over ordinary bfloat16 tokens, tokens of one value, zeros, and tokens so
    tiny that max|x| / q_max lies below float32's normal range, where both keep the scale 2^-126 (the kernel once
    stored the subnormal quotient; on a GPU its division was also an approximate one, 1 ulp off). The tiny values
    are normal numbers: Triton's interpreter converts subnormal bfloat16 values to float32 wrongly."""
    from fdlib.hf.append import append_kv8
    from helpers import DEVICE
    g = torch.Generator().manual_seed(61)
    B, H, T, D = 2, 3, 5, 80
    def tiny(*shape):   # normal bfloat16 values of 1e-37..3e-37 (none subnormal): max|x| / q_max is below 2^-126
        return torch.randn(*shape, generator=g).sign() * (1 + 2 * torch.rand(*shape, generator=g)) * 1e-37

    k = torch.randn(B, H, T, D, generator=g) * torch.logspace(-2, 2, T)[None, None, :, None]
    k[0, :, 1] = tiny(H, D)
    k[1, :, 2] = 0.0
    k[1, 0, 3] = 3.0
    k = k.bfloat16().to(DEVICE)
    v = tiny(B, H, T, D).bfloat16().to(DEVICE)
    slots = torch.arange(B * T, device=DEVICE)
    outs = [torch.empty(B * T, H, D, dtype=kv_dtype, device=DEVICE) for _ in range(2)]
    scales = [torch.empty(B * T, H, device=DEVICE) for _ in range(2)]
    append_kv8(k, v, slots, None, *outs, *scales, token=True)
    for x, out, scale in ((k, outs[0], scales[0]), (v, outs[1], scales[1])):
        want, want_s = quantize_kv(x.transpose(1, 2).reshape(B * T, H, D), dtype=kv_dtype, granularity="token")
        assert torch.equal(scale, want_s), (scale, want_s)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_a_nan_in_one_prompt_does_not_poison_the_calibrated_scales(granularity):
    """Calibrated per-head or per-tensor scales come from the prompt's finite values only: a NaN (or an infinity)
    in sequence 1's K and V leaves the scales those of the same prompt with those values zero, and sequence 0
    stored as it is there; the scales once became NaN or infinite, and every sequence's output NaN with them."""
    g = torch.Generator().manual_seed(71)
    k = torch.randn(2, H_KV, 5, D, generator=g).half()
    v = torch.randn(2, H_KV, 5, D, generator=g).half()
    k[1, 0, 2, 3], v[1, 1, 4, 0] = float("nan"), float("inf")
    k_clean = k.clone()
    k_clean[1, 0, 2, 3], v_clean = 0.0, v.clone()
    v_clean[1, 1, 4, 0] = 0.0
    want = DecodeCache(tiny_config(), 2, 16, dtype=torch.float16, kv_dtype=torch.float8_e4m3fn,
                       granularity=granularity)
    step(want, k_clean, v_clean)
    cache = DecodeCache(tiny_config(), 2, 16, dtype=torch.float16, kv_dtype=torch.float8_e4m3fn,
                        granularity=granularity)
    step(cache, k, v)
    for layer in range(LAYERS):
        got, ref = cache.layers[layer], want.layers[layer]
        assert torch.isfinite(got.k_scale).all() and torch.isfinite(got.v_scale).all(), granularity
        assert torch.equal(got.k_scale, ref.k_scale) and torch.equal(got.v_scale, ref.v_scale)
        assert torch.equal(raw(cache, layer, "keys")[0][0], raw(want, layer, "keys")[0][0])   # sequence 0 as clean


def test_reset_calibrates_again_and_bad_arguments_are_named():
    g = torch.Generator().manual_seed(3)
    cache = DecodeCache(tiny_config(), 1, 16, dtype=torch.float16, kv_dtype=torch.int8, granularity="head")
    k = torch.randn(1, H_KV, 4, D, generator=g).half()
    step(cache, k, k)
    first = cache.layers[0].k_scale.clone()
    cache.reset()
    step(cache, k * 3, k * 3)
    torch.testing.assert_close(cache.layers[0].k_scale, first * 3, rtol=1e-3, atol=0)   # k * 3 rounds in fp16
    cfg = tiny_config()
    for kw, err, what in [(dict(kv_dtype=torch.int8, granularity="token", k_scale=0.1, v_scale=0.1), ValueError,
                           "per-token scales are made as each token is written"),
                          (dict(kv_dtype=torch.int8, granularity="head", k_scale=0.1), ValueError, "give both"),
                          (dict(kv_dtype=torch.int8, granularity="block"), ValueError, "granularity"),
                          (dict(kv_dtype=torch.float16), TypeError, "kv_dtype"),
                          (dict(k_scale=0.1, v_scale=0.1), ValueError, "pass kv_dtype"),
                          (dict(kv_dtype=torch.int8, granularity="head", k_scale=-1.0, v_scale=1.0), ValueError,
                           "finite and positive"),
                          (dict(kv_dtype=torch.int8, granularity="head", k_scale=[0.1, 0.1, 0.1], v_scale=0.1),
                           ValueError, "one a layer"),
                          (dict(kv_dtype=torch.int8, granularity="head", k_scale=0.1, v_scale=10 ** 400), ValueError,
                           "^v_scale: scales must be finite and positive"),
                          (dict(kv_dtype=torch.int8, granularity="head", k_scale=1e-50, v_scale=0.1), ValueError,
                           r"got \[0.0\] \(as float32: a positive value below its smallest")]:
        with pytest.raises(err, match=what):
            DecodeCache(cfg, 1, 16, dtype=torch.float16, **kw)
    with pytest.raises(TypeError, match="float16 or bfloat16 model"):
        DecodeCache(cfg, 1, 16, dtype=torch.float32, kv_dtype=torch.int8)


@pytest.mark.parametrize("bad,got", [("0.1", "str"), (True, "bool"), ({"k": 0.1}, "dict"), (1 + 1j, "complex"),
                                     (torch.ones(2, dtype=torch.bool), "a bool tensor"), ([0.1, "x"], "str")])
def test_fixed_scales_of_a_wrong_type_are_named(bad, got):
    """A fixed scale (or one of a per-layer list) that is no float or float tensor raises TypeError naming the
    argument and what came (once torch's own "must be real number, not dict" or "invalid data type 'str'", and
    True was taken as 1.0, which fdlib.decode_attention refuses)."""
    with pytest.raises(TypeError, match=rf"^k_scale: expected a float or a float32 tensor \[H_kv\] \(or a list of "
                                        rf"those, one a layer\), got {got}$"):
        DecodeCache(tiny_config(), 1, 16, dtype=torch.float16, kv_dtype=torch.int8, granularity="head",
                    k_scale=bad, v_scale=0.1)


def snapshot(cache):
    """Every attribute of the cache, of its layers and of its 8-bit format (tensors cloned), and its plans' keys."""
    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        return type(x)(copy(v) for v in x) if isinstance(x, (list, tuple)) else x
    def attrs(obj, skip=()):
        return {k: copy(v) for k, v in vars(obj).items() if k not in skip}
    return dict(cache=attrs(cache, ("layers", "kv8", "_plans")), plans=sorted(cache._plans), kv8=attrs(cache.kv8),
                layers=[attrs(layer, ("_owner",)) for layer in cache.layers])


def assert_same(got, want, where="cache"):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


class _Module:   # what HF's SDPA reads of an attention module
    num_key_value_groups, is_causal, training = 2, True, False


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_a_later_prefill_chunk_reads_small_values_at_float16_precision(kv_dtype):
    """A prefill chunk on a cache that holds tokens attends the cache dequantized to the model's dtype: in
    float16, values of 5e-4 (scales below float16's normal range) must come out as precise as float16 allows,
    as the decode kernels read them (the scale was once cast to float16 before the product: several times the
    tolerance off)."""
    from fdlib.hf.attention import fdlib_attention_forward
    g = torch.Generator().manual_seed(1)
    cache = DecodeCache(tiny_config(num_hidden_layers=1), 1, 64, dtype=torch.float16, kv_dtype=kv_dtype,
                        granularity="token")
    for T in (5, 20):   # a first chunk, then one of more than 16 tokens: the prefill path over the cache
        q = torch.randn(1, 4, T, D, generator=g).half()
        k, v = ((torch.randn(1, H_KV, T, D, generator=g) * 5e-4).half().to(cache.device) for _ in range(2))
        out = fdlib_attention_forward(_Module(), q.to(cache.device), *cache.update(k, v, 0), None)[0].cpu()
    layer = cache.layers[0]
    kd, vd = (dequantize_kv(t[:1, :25].cpu(), s[:1, :25].cpu(), torch.float64)
              for t, s in ((layer.keys, layer.k_scale), (layer.values, layer.v_scale)))
    for t in range(20):   # query t of the chunk sees keys 0 .. 5 + t
        want, _ = fdlib.reference_attention(q[:, :, t], kd, vd, torch.tensor([6 + t], dtype=torch.int32))
        assert row_rel_err(out[:, t].float(), want).max().item() <= OUT_RTOL[torch.float16], t


@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("kv_dtype,granularity", [(torch.int8, "head"), (torch.float8_e4m3fn, "token")])
def test_a_query_that_does_not_fit_is_refused_before_anything_moves(kv_dtype, granularity, page_size):
    """The "fdlib" attention checks the query (heads and head dim of the cache's config, the keys' batch and
    tokens, the cache's dtype) before a step begins: a query that does not fit once moved the lengths and wrote
    K/V before the plan refused it, or (a batch or token count other than the keys') ran on silently, the 8-bit
    append writing one sequence's token into another's slot."""
    from fdlib.hf.attention import fdlib_attention_forward
    g = torch.Generator().manual_seed(8)
    cache = DecodeCache(tiny_config(), 2, 16, dtype=torch.float16, page_size=page_size, kv_dtype=kv_dtype,
                        granularity=granularity)

    def layers(q, k, v):
        for i in range(LAYERS):
            fdlib_attention_forward(_Module(), q, *cache.update(k, v, i), None)

    def r(*shape):
        return torch.randn(*shape, generator=g).half().to(cache.device)

    layers(r(2, 4, 5, D), r(2, H_KV, 5, D), r(2, H_KV, 5, D))   # a prompt
    for q, what in ((r(2, 8, 1, D), r"\[2, 8, 1, 16\]"), (r(2, 4, 1, 32), r"\[2, 4, 1, 32\]"),
                    (r(1, 4, 1, D), r"\[1, 4, 1, 16\]"), (r(2, 4, 2, D), r"\[2, 4, 2, 16\]"),
                    (r(2, 4, 1, D).float(), "torch.float32")):
        before = snapshot(cache)
        with pytest.raises((ValueError, TypeError), match=rf"^query: expected .*got {what}"):
            layers(q, r(2, H_KV, 1, D), r(2, H_KV, 1, D))
        cache._awaiting = None   # the refused layer's update (HF raises out of the forward)
        assert_same(snapshot(cache), before)
    layers(r(2, 4, 1, D), r(2, H_KV, 1, D), r(2, H_KV, 1, D))
    assert cache.lengths.tolist() == [6, 6]


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_compiled_step_on_an_8bit_cache_is_refused_before_anything_moves(fullgraph):
    """torch.compile does not take an 8-bit cache yet: a compiled decode step raises the documented
    NotImplementedError (the same type and message with fullgraph=True or not) and leaves every attribute and
    tensor of the cache as it was; an eager step then goes on from there."""
    from fdlib.hf import cache_kwarg
    from fdlib.hf.cache import KV8_NOT_COMPILED
    fdlib.hf.register()
    torch.manual_seed(0)
    cache = DecodeCache(tiny_config(), 2, 24, dtype=torch.float16, kv_dtype=torch.int8, granularity="token")
    model = transformers.LlamaForCausalLM(tiny_config()).eval().to(device=cache.device, dtype=torch.float16)
    model.set_attn_implementation("fdlib")
    key = cache_kwarg(model)
    g = torch.Generator().manual_seed(61)
    ids = torch.randint(3, tiny_config().vocab_size, (2, 17), generator=g).to(cache.device)

    def step(tok, pos):
        return model(input_ids=tok, position_ids=pos, use_cache=True, **{key: cache}).logits

    tok, pos = torch.tensor([[5], [9]], device=cache.device), torch.full((2, 1), 17, device=cache.device)
    with torch.no_grad():
        step(ids, torch.arange(17, device=cache.device).expand(2, 17))   # the prompt, eagerly
        before = snapshot(cache)
        torch._dynamo.reset()
        try:
            with pytest.raises(NotImplementedError) as err:
                torch.compile(step, fullgraph=fullgraph, backend="aot_eager")(tok, pos)
        finally:
            torch._dynamo.reset()
        assert type(err.value) is NotImplementedError and str(err.value) == KV8_NOT_COMPILED
        assert_same(snapshot(cache), before)
        step(tok, pos)
    assert cache.lengths.tolist() == [18, 18] and int(cache.columns) == 18


def test_an_8bit_cache_is_not_offered_to_generates_compilation():
    """transformers' generate() compiles the decode steps of a cache whose layers say is_compileable; an 8-bit
    cache's steps are refused under torch.compile, so it must say False (a 16-bit one True)."""
    assert not DecodeCache(tiny_config(), 1, 8, dtype=torch.float16, kv_dtype=torch.int8,
                           granularity="token").is_compileable
    assert DecodeCache(tiny_config(), 1, 8, dtype=torch.float16).is_compileable


# ------------------------------------------------------------------------------------ values that are not finite
NAN, INF = float("nan"), float("inf")
G = 2   # query heads a KV head (tiny_config: 4 of them over 2 KV heads)
STEPS = (5, 1, 3, 1, 17)
"""A conversation: a prompt of 5 columns (sequence 0's first a pad), a decode step, a verify step of 3 tokens, a
decode step, a prefill chunk of 17 tokens over the cache (SDPA over the dequantized cache; not over pages, to
save the interpreter's time: the pages are gathered before the same dequantization)."""
BAD = {"prompt": (0, 2), "decode": (1, 0), "verify": (2, 1)}
"""Where a bad value goes: (step, token of the step), in sequence 1."""


@functools.lru_cache(maxsize=None)
def conversation16(bad):
    """:func:`conversation` on a 16-bit cache (the same for every 8-bit format: made once)."""
    return conversation(None, bad=bad)


def conversation(kv_dtype, granularity=None, given=None, page_size=None, bad=None):
    """The outputs ``[B, T, H_q, D]`` of every step of :data:`STEPS` through the "fdlib" attention, on a 1-layer
    cache of 2 sequences (``kv_dtype`` None: 16 bits). ``bad`` = (where, "K" or "V", KV head, value): that value
    at d = 3 of sequence 1's token :data:`BAD` [where]; without it the same run with 0 there. Sequence 0's pad
    column holds a NaN in K and V in every run (a pad is zeroed, never a key)."""
    from fdlib.hf.attention import fdlib_attention_forward
    g = torch.Generator().manual_seed(17)
    q8 = {} if kv_dtype is None else dict(kv_dtype=kv_dtype, granularity=granularity)
    if given is not None:
        q8.update(k_scale=given, v_scale=given)
    cache = DecodeCache(tiny_config(num_hidden_layers=1), 2, 32, dtype=torch.float16, page_size=page_size, **q8)
    outs = []
    for i, T in enumerate(STEPS if page_size is None else STEPS[:-1]):
        q = torch.randn(2, 4, T, D, generator=g).half()
        k, v = (torch.randn(2, H_KV, T, D, generator=g).half() for _ in range(2))
        mask = None
        if i == 0:
            mask = torch.ones(2, T, dtype=torch.long)
            mask[0, 0] = 0
            k[0, :, 0], v[0, :, 0] = NAN, NAN
        if bad is not None and BAD[bad[0]][0] == i:
            (k if bad[1] == "K" else v)[1, bad[2], BAD[bad[0]][1], 3] = bad[3]
        dev = cache.device
        out = fdlib_attention_forward(_Module(), q.to(dev), *cache.update(k.to(dev), v.to(dev), 0),
                                      None if mask is None else mask.to(dev))[0]
        outs.append(out.cpu())
    return outs


def nonfinite_heads(out):
    """[T, H_q]: which query heads of which query have an output that is not finite."""
    return (~torch.isfinite(out)).any(-1)


def check_nonfinite(got, clean, ref, where, h_kv):
    """``got``: the 8-bit outputs with the bad value, ``clean``: the same run with 0 there, ``ref``: a 16-bit
    cache's with the bad value (the prompt's own outputs, HF's SDPA over its 16-bit chunk, are not checked). From
    the step that writes it on, every query of sequence 1 that reads it is NaN in KV head h_kv's query heads, and
    every output the 16-bit cache makes non-finite is non-finite here too; nothing else is (sequence 0, the other
    heads, earlier steps), and every output that stays finite is bit for bit the clean run's."""
    step, t_bad = BAD[where]
    group = torch.arange(4) // G == h_kv
    for i, (o, c, r) in enumerate(zip(got, clean, ref)):
        if i == 0:   # the prompt: SDPA over its own 16-bit K/V, HF's computation (NaN where a pad's V is: 0·NaN)
            continue
        if i >= step:
            bad = nonfinite_heads(o[1])
            reads = torch.arange(o.shape[1]) >= (t_bad if i == step else 0)
            assert bad[reads][:, group].all(), f"step {i}: a query that reads the bad token is finite: {bad.int()}"
            assert not bad[:, ~group].any(), f"step {i}: another KV head's query heads are not finite"
            assert not (nonfinite_heads(r[1]) & ~bad).any(), f"step {i}: finite where a 16-bit cache is not"
        else:
            assert torch.isfinite(o[1]).all(), f"step {i}: not finite before the bad token is written"
        fin = torch.isfinite(o).all(-1)
        assert torch.isfinite(o[0]).all(), f"step {i}: sequence 0 not finite"
        assert torch.equal(o.view(torch.int16)[fin], c.view(torch.int16)[fin]), f"step {i}: a finite output changed"


@pytest.mark.parametrize("granularity,given,page_size", [("token", None, None), ("token", None, 4),
                                                         ("head", None, None), ("head", 0.01, 4),
                                                         ("tensor", 0.01, None), ("tensor", None, 4)])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_a_value_that_is_not_finite_makes_the_queries_that_read_it_nan(kv_dtype, granularity, given, page_size):
    """A NaN or an infinity in sequence 1's K or V, in the prompt, at a decode step or inside a verify step, makes
    the outputs of that sequence's queries that read it NaN in the query heads of that KV head, from that step on
    (decode steps, and a prefill chunk over the dequantized cache), as a 16-bit cache makes them NaN or infinite;
    sequence 0 (whose pad holds a NaN) and every output that stays finite are bit for bit those of the same run
    with 0 there. Every granularity contiguous and paged, fixed scales calibrated and given. The append once
    stored a NaN as 384 (e4m3) or 0 (int8) and an infinity saturated: the outputs were finite garbage."""
    clean = conversation(kv_dtype, granularity, given, page_size)
    for where, which, h_kv, value in (("prompt", "K", 0, NAN), ("decode", "V", 1, INF), ("decode", "K", 0, -INF),
                                      ("verify", "V", 1, NAN)):
        bad = (where, which, h_kv, value)
        got = conversation(kv_dtype, granularity, given, page_size, bad)
        ref = conversation16(bad)
        check_nonfinite(got, clean, ref, where, h_kv)


@pytest.mark.parametrize("token", [True, False])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_the_append_stores_a_token_that_is_not_finite_as_nan(kv_dtype, token):
    """What the fused append stores for tokens holding a NaN, +inf or -inf (and a pad holding one): per-token
    scales, the values of the token with those values 0 (quantize_kv's, bit for bit) and the scale NaN; e4m3 with a
    fixed scale, e4m3's NaN byte 0x7F at those values and the grid's values elsewhere; int8 with a fixed scale, the
    grid's values with 0 there, and the token's position recorded (the first one, whatever the order of the
    programs). Every finite token as before, and the same bytes on a second run. The kernel once stored a NaN as
    384 (e4m3) or 0 (int8) with a finite scale, and an infinity saturated."""
    from fdlib.hf.append import append_kv8
    from fdlib.hf.kv8 import ALL_FINITE
    from helpers import DEVICE
    g = torch.Generator().manual_seed(23)
    B, H, T = 2, 2, 4
    x = torch.randn(B, H, T, D, generator=g)
    x[1, 0, 1, 3], x[1, 0, 3, 0], x[1, 1, 2, 5], x[0, 1, 1, 7] = NAN, INF, -INF, NAN
    real = torch.ones(B, T, dtype=torch.bool)
    real[0, 1] = False                                       # sequence 0's token 1 (a NaN in it) is a pad
    x, real = x.half().to(DEVICE), real.to(DEVICE)
    slots = torch.arange(B * T, device=DEVICE)
    positions = torch.tensor([5, 6, 7, 8] * B, device=DEVICE)
    stored = []
    for _ in range(2):
        out = [torch.zeros(B * T, H, D, dtype=kv_dtype, device=DEVICE) for _ in range(2)]
        sc = [torch.zeros(B * T, H, device=DEVICE) if token else torch.full((H,), 0.01, device=DEVICE)
              for _ in range(2)]
        nf = torch.full((B, H), ALL_FINITE, dtype=torch.int32, device=DEVICE)
        append_kv8(x, x, slots, real, *out, *sc, token, positions, nf)
        stored.append([t.cpu() for t in (*out, *sc, nf)])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*stored))   # deterministic
    got, scale, nf = stored[0][0], stored[0][2], stored[0][4]
    xs = x.cpu().masked_fill(~real.cpu()[:, None, :, None], 0).transpose(1, 2).reshape(B * T, H, D)
    finite = torch.isfinite(xs)
    bad = ~finite.all(-1)                                   # [B·T, H]: tokens with a value not finite
    assert bad.sum() == 3 and not bad[:T].any()             # the pad's NaN is gone
    xf = xs.masked_fill(~finite, 0)
    if token:
        want, want_s = quantize_kv(xf, dtype=kv_dtype, granularity="token")
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(scale.isnan(), bad) and torch.equal(scale[~bad], want_s[~bad])
    else:
        want = ref_quant(xf, torch.full((H,), 0.01), kv_dtype)
        if kv_dtype == torch.int8:
            assert torch.equal(got, want)
            assert nf.tolist() == [[ALL_FINITE, ALL_FINITE], [6, 7]]   # KV head 0: tokens 1 and 3; head 1: token 2
        else:
            assert torch.equal(got.view(torch.uint8)[finite], want.view(torch.uint8)[finite])
            assert (got.view(torch.uint8)[~finite] == 0x7F).all()


def test_reset_and_set_lengths_forget_an_int8_caches_nonfinite_token():
    """An int8 cache with fixed scales (no NaN to store) records where a token that is not finite lies: its
    sequence's outputs are NaN from then on; after reset() a new prompt decodes as on a fresh cache, and
    set_lengths() that cuts the token off forgets it too (a length that keeps it does not)."""
    g = torch.Generator().manual_seed(29)
    kw = dict(dtype=torch.float16, kv_dtype=torch.int8, granularity="head", k_scale=0.02, v_scale=0.02)
    cache, fresh = (DecodeCache(tiny_config(), 2, 16, **kw) for _ in range(2))
    q = torch.randn(2, 4, 1, D, generator=g).half().to(cache.device)
    prompt = [torch.randn(2, H_KV, 4, D, generator=g).half() for _ in range(2)]
    new = [torch.randn(2, H_KV, 1, D, generator=g).half() for _ in range(2)]
    step(cache, *prompt)
    new[0][1, 1, 0, 2] = NAN
    step(cache, *new)
    assert nonfinite_heads(decode(cache, 0, q)[1]).tolist() == [[False, False, True, True]]
    cache.set_lengths([5, 5])                                   # keeps the token
    assert nonfinite_heads(decode(cache, 0, q)[1]).tolist() == [[False, False, True, True]]
    cache.set_lengths([5, 4])                                   # cuts it off
    assert torch.isfinite(decode(cache, 0, q)).all()
    step(cache, *new)                                           # at position 4 again
    cache.reset()
    new[0][1, 1, 0, 2] = 0.5
    for c in (cache, fresh):
        step(c, *prompt)
        step(c, *new)
    assert torch.equal(decode(cache, 0, q), decode(fresh, 0, q))
    assert torch.isfinite(decode(cache, 0, q)).all()


def test_a_kernel_reads_and_writes_e4m3s_nan_as_nan():
    """e4m3's NaN byte (0x7F, 0xFF) converts to NaN in a kernel, and a NaN to 0x7F, as on a GPU: Triton's
    interpreter converted by bit fields alone (0x7F read as 480, a NaN written as 384), so an 8-bit cache's NaN
    decoded finite on the CPU runtime (fdlib.runtime wraps its converter)."""
    import triton
    import triton.language as tl
    from helpers import DEVICE

    @triton.jit
    def convert(X, Y, F, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(X + i)
        tl.store(Y + i, x.to(tl.float16))
        tl.store(F + i, x.to(tl.float32).to(tl.float8e4nv))

    x = torch.tensor([0x7F, 0xFF, 0x7E, 0x38, 0x00, 0x80, 0x01, 0xC4], dtype=torch.uint8).view(torch.float8_e4m3fn)
    y = torch.empty(8, dtype=torch.float16, device=DEVICE)
    back = torch.empty(8, dtype=torch.float8_e4m3fn, device=DEVICE)
    convert[(1,)](x.to(DEVICE), y, back, N=8)
    torch.testing.assert_close(y.cpu(), x.half(), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(back.cpu().view(torch.uint8) & 0x7F, x.view(torch.uint8) & 0x7F)
