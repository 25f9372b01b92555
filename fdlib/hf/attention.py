r"""The ``"fdlib"`` attention implementation of transformers' ``AttentionInterface``.

HF calls ``attention(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)`` with
``query`` ``[B, H_q, T, D]`` and the states ``[B, H_kv, T, D]`` that :meth:`DecodeCache.update` returned; it must
return ``([B, T, H_q, D], None)``. At layer 0 it starts the step (:meth:`DecodeCache.begin_step`: checks, the
slots of the step's real tokens by the cache's one rule, lengths moved); every layer writes its K/V there, then
takes one of two paths, chosen at layer 0 from T (a shape), from whether a padding mask came, and, eagerly,
from whether the cache is empty (never from a device value on a traced step):

* **decode and short verify steps** (T <= 16, all real, a cache that holds tokens): fdlib's plan (made once per
  q_len) runs q ``[B, T, H_q, D]`` (a transposed view of HF's query, no copy) against the cache with the device
  lengths: query t of sequence b sees keys :math:`0 \ldots L_b - T + t`. No mask is read and nothing syncs, so
  the step compiles (``torch.ops.fdlib.hf_decode``) and captures as a CUDA graph.
* **prefill** (T > 16, any padding, or an eager first chunk): the queries attend through HF's own SDPA function
  with the causal and padding mask: over the chunk's own keys when the cache was empty (exactly HF's
  computation), over the cached keys otherwise (real query t sees the keys before it and itself: exactly what
  HF's mask leaves it). Traced, over all L_max cached keys with the mask built on the device.

HF builds no 4D mask for ``"fdlib"``: the mask hook registered for it (:func:`padding_mask`) hands the 2D
padding mask to steps that need it, and None to decode steps. Without a ``DecodeCache`` (``use_cache=False``) a
call is attention of its T tokens among themselves, causal with padding, through SDPA.
"""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .cache import ACTIVE, DECODE_MAX_Q_LEN, traced
from . import ops  # noqa: F401  (registers torch.ops.fdlib.hf_decode)

NAME = "fdlib"


def padding_mask(*args, attention_mask=None, q_length=None, cache_position=None, q_offset=None, **kwargs):
    """HF's mask hook for ``"fdlib"``: the 2D padding mask ``[B, columns]`` (bool) as HF passes it where a
    step needs it, else None. Eagerly it is handed on for a prefill chunk (more than 16 tokens, or a mask that
    covers only this chunk: a first chunk), for any step whose new columns hold padding, and for a mask whose
    columns are not the cache's (``q_offset``) plus the step's (the cache then says what is wrong): one sync. A
    step of real tokens that continues the cache gets None: a decode step reads the device lengths, and a None
    keeps a compiled step's inputs the same shape from step to step (``generate()`` runs this hook eagerly and
    feeds its result to the compiled forward). Traced (torch.compile, CUDA-graph capture), whatever mask came
    is handed on unread. (transformers < 5.1x passes the chunk's ``cache_position`` instead of ``q_length``.)"""
    if attention_mask is None:
        return None
    T = q_length if q_length is not None else None if cache_position is None else cache_position.shape[0]
    cols = attention_mask.shape[-1]
    if T is None or T > DECODE_MAX_Q_LEN or cols == T or traced():
        return attention_mask
    fine = attention_mask[:, -T:].all()
    if isinstance(q_offset, torch.Tensor):
        fine = fine & (q_offset.to(fine.device) == cols - T)
    elif isinstance(q_offset, int) and q_offset != cols - T:
        return attention_mask
    return None if bool(fine) else attention_mask


def causal_padding_mask(T: int, real: torch.Tensor | None, before: torch.Tensor | None = None,
                        n_keys: int | None = None) -> torch.Tensor | None:
    r"""Bool ``[B, 1, T, n_keys]`` of what query t may see. A first chunk (``before`` None): key j <= t whose
    column is real (``real`` ``[B, T]``), HF's causal-and-padding mask; None when there is no padding (SDPA's
    ``is_causal``). A later chunk, against the cached keys (the chunk's real tokens already stored after the
    :math:`L_b` = ``before[b]`` keys held before it): key :math:`j < L_b + c_{bt}`, :math:`c_{bt}` the real
    tokens among the chunk's first t + 1 (t + 1 without padding): a real query sees the keys before it and
    itself, exactly what HF's mask leaves it; a pad query sees the keys before it, at least one (a row that
    sees none would be NaN in some SDPA backends; a pad query's output is never stored or read)."""
    if before is None:
        if real is None:
            return None
        t = torch.arange(T, device=real.device)
        return (t[None, :] <= t[:, None])[None, None] & real[:, None, None, :]
    j = torch.arange(n_keys, device=before.device)
    if real is None:
        seen = before[:, None].long() + torch.arange(1, T + 1, device=before.device)[None, :]
    else:
        seen = (before[:, None].long() + real.cumsum(-1)).clamp_min(1)
    return (j[None, None, :] < seen[:, :, None])[:, None]


def fdlib_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            **kwargs):
    """``attn_implementation="fdlib"``: see the module doc. Returns ``(out [B, T, H_q, D], None)``."""
    if dropout:
        raise NotImplementedError(f"dropout: the fdlib attention is for inference (got dropout={dropout}); call "
                                  f"model.eval()")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name}: the fdlib attention does not implement it (got {kwargs[name]!r})")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        raise ValueError("attention_mask: the fdlib attention takes HF's 2D padding mask [B, columns] (or None), "
                         f"got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}; custom 4D masks "
                         "are not supported")
    cache = ACTIVE.cache
    T = query.shape[2]
    if cache is None or cache._awaiting is None:   # no DecodeCache updated this layer: attention within the chunk
        if key.shape[2] != T:
            raise RuntimeError("attn_implementation='fdlib' runs with past_key_values=fdlib.hf.DecodeCache(...); "
                               f"got {key.shape[2]} keys for {T} queries from another cache")
        real = None if attention_mask is None else attention_mask[:, -T:].to(device=query.device, dtype=torch.bool)
        if real is not None and bool(real.all()):
            real = None
        return _sdpa(module, query, key, value, causal_padding_mask(T, real), scaling, kwargs), None
    layer_idx, cache._awaiting = cache._awaiting, None
    ACTIVE.cache = None   # taken: the next layer's update hands it again, and a dropped cache is freed
    if cache.kv8 is not None and torch.compiler.is_compiling():   # refused when it runs, before anything moves
        return cache.refused_step(query), None
    cache.check_query(query, key)   # before the step begins: a refused query moves nothing
    B = key.shape[0]
    if layer_idx == 0:
        step = cache.begin_step(B, T, attention_mask)
    elif cache._step is None:
        raise RuntimeError("DecodeCache: a step must start at layer 0")
    else:
        step = cache._step
    cache.write(layer_idx, key, value)
    if not step["prefill"]:
        return decode(cache, layer_idx, query, scaling), None
    return prefill(module, cache, layer_idx, step, query, key, value, scaling, kwargs), None


def decode(cache, layer_idx: int, query: torch.Tensor, scaling=None) -> torch.Tensor:
    """fdlib attention of ``query`` ``[B, H_q, T, D]`` against layer ``layer_idx`` of ``cache`` (its new keys
    already written), with the cache's device lengths; ``[B, T, H_q, D]``."""
    B, _, T, _ = query.shape
    q = query.transpose(1, 2)
    if q.shape[-1] > 1 and q.stride(-1) != 1:   # the kernels read a head's D values at stride 1 (SDPA takes any)
        q = q.contiguous()
    layer = cache.layers[layer_idx]
    if cache.page_size is None:
        k, v, table = layer.keys[:B], layer.values[:B], None
    else:
        k, v, table = layer.keys, layer.values, cache.block_table[:B]
    lens = cache.lengths[:B]
    scale = cache.scale if scaling is None else float(scaling)
    if torch.compiler.is_compiling():
        return torch.ops.fdlib.hf_decode(q, k, v, lens, table, cache.key, scale)
    if cache.kv8 is not None:
        ks, vs = cache.kv8.run_scales(layer, B, cache.page_size is not None)
        out = cache.plan(T, scale).run(q, k, v, lens, block_table=table, k_scale=ks, v_scale=vs)
        cache.kv8.nonfinite_output(layer, out, lens)   # int8 with fixed scales: fdlib.hf.kv8
        return out
    return cache.plan(T, scale).run(q, k, v, lens, block_table=table)


def prefill(module, cache, layer_idx, step, query, key, value, scaling, kwargs) -> torch.Tensor:
    """A prefill chunk (already written into ``cache``) attended through SDPA with the causal and padding mask;
    ``[B, T, H_q, D]``."""
    B, _, T, _ = key.shape
    if step["first"]:   # the chunk's own keys and HF's mask: HF's computation exactly
        return _sdpa(module, query, key, value, causal_padding_mask(T, step["real"]), scaling, kwargs)
    n = step["n_keys"]
    keys = cache.token_view(layer_idx, "keys", B, n).transpose(1, 2)
    values = cache.token_view(layer_idx, "values", B, n).transpose(1, 2)
    mask = causal_padding_mask(T, step["real"], step["before"], n)
    return _sdpa(module, query, keys, values, mask, scaling, kwargs)


def _sdpa(module, query, key, value, mask, scaling, kwargs) -> torch.Tensor:
    """HF's own SDPA attention (GQA, backends and all) with ``mask`` (None: causal via ``is_causal``)."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("dropout", "scaling")}
    out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)
    return out


def register() -> None:
    """Register ``"fdlib"`` with transformers' ``AttentionInterface`` (and its mask hook with
    ``AttentionMaskInterface``). Idempotent: calling it again re-registers the same functions."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, fdlib_attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)
