r"""``DecodeCache``: a Hugging Face ``Cache`` laid out for fdlib, written in place, with lengths on the device.

Each layer's K and V are allocated once, in fdlib's token-major layout ``[B_max, L_max, H_kv, D]`` (or pages
``[n_pages, page_size, H_kv, D]`` behind a block table), and every step writes its new keys where they belong
with ``index_copy_``: nothing is concatenated and nothing is allocated per step (``DynamicCache`` concatenates,
so it copies the whole cache at every step).

**The rule for where keys go.** Sequence b's cache holds only its real tokens (``attention_mask`` 1), in the
order fed, from position 0: keys :math:`0 \ldots L_b - 1`, with :math:`L_b` its own length (``lengths[b]``,
int32 on the device). Every step follows it, whatever its size, path or turn: real token t of a step goes to
:math:`L_b + r_{bt}`, :math:`r_{bt}` the real tokens before it in the step; the step's pad tokens go after its
real ones (zeroed; the next tokens overwrite them, and nothing past a length is read); then
:math:`L_b \mathrel{+}= n_b`, the step's real tokens. A pad token is never a key, wherever it is (left padding
of a prompt, a chunk of it, padding between one turn's tokens and the next's), so every query sees exactly the
keys HF's mask leaves it. A decode step appends at :math:`L_b` and attends keys :math:`0 \ldots L_b` (fdlib's
``cache_seqlens``): no mask is read.

HF's own bookkeeping counts *columns* (tokens fed, padding included): :meth:`DecodeCache.get_seq_length`
returns that count as a 0-d device tensor, like ``StaticCache``, so positions HF derives from it stay HF's.

**Checked before anything moves.** :meth:`DecodeCache.begin_step` checks a step in full (capacity, the mask's
shape) before it writes a key or moves a length or a count, so a refused step leaves the cache as it was.

A step is a *decode step* when it has at most :data:`DECODE_MAX_Q_LEN` tokens a sequence, all real, and the
cache holds tokens (or the step is traced): fdlib's plan, with no host sync and no branch on a device value,
so it compiles with ``torch.compile`` and captures as a CUDA graph. Every other step is a *prefill chunk*,
attended through HF's SDPA with its causal and padding mask (:mod:`fdlib.hf.attention`). The ``"fdlib"``
attention function, which HF calls with the padding mask, starts each step at layer 0 and writes every layer;
:meth:`DecodeCache.update` only checks the new K/V and hands them on.

**A second ``generate()``** on the same cache continues it, as HF's caches do: give it the whole conversation
so far (the first call's output and the new tokens, with their mask) and HF feeds only the columns the cache
lacks. :meth:`DecodeCache.reset` empties it for a new prompt; a padded new prompt on a used cache is refused
(its mask does not cover the cached columns).
"""
from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..compiled import refuse
from ..plan import check_device, plan as make_plan
from ..validate import DTYPES, MAX_Q_LEN, check_page_size
from .append import append_kv8
from .write import write_kv
from .kv8 import ALL_FINITE, KV8

DECODE_MAX_Q_LEN = MAX_Q_LEN
"""Steps with at most this many new tokens a sequence (decode, speculative verify) run fdlib's plan."""

KV8_NOT_COMPILED = ("DecodeCache: an 8-bit cache (kv_dtype=...) runs eagerly or captured in a CUDA graph; "
                    "torch.compile does not take it yet")
"""The NotImplementedError of a traced step on an 8-bit cache (:meth:`DecodeCache.refused_step`)."""

CACHES: "weakref.WeakValueDictionary[int, DecodeCache]" = weakref.WeakValueDictionary()
"""Live caches by key: the compiled decode op names its cache by this int (:mod:`fdlib.hf.ops`)."""


@torch.compiler.disable
def _refuse_kv8():
    """NotImplementedError(:data:`KV8_NOT_COMPILED`), raised outside the trace: a step begun directly
    (:meth:`DecodeCache.begin_step`) under ``torch.compile`` is refused when the compiled code reaches it (a raise
    while tracing would be run again eagerly, where it does not raise)."""
    raise NotImplementedError(KV8_NOT_COMPILED)


class _Active:
    """The cache whose ``update`` ran last: the ``"fdlib"`` attention function reads it (HF hands the cache to
    ``update``, not to the attention function) and clears it, so that nothing here keeps a cache alive."""
    cache = None


ACTIVE = _Active()


def traced(device: torch.device | None = None) -> bool:
    """Under torch.compile or CUDA-graph capture (on ``device``, default: any CUDA), where the host can neither
    read nor count device state."""
    cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
    return torch.compiler.is_compiling() or (cuda and torch.cuda.is_current_stream_capturing())


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _dtype_of(config, dtype):
    if dtype is None:
        name = "dtype" if hasattr(config, "dtype") else "torch_dtype"   # the old name warns in 5.x
        dtype = getattr(config, name, None) or torch.get_default_dtype()
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
    if dtype not in DTYPES:
        raise TypeError(f"dtype: DecodeCache holds float16, bfloat16 or float32, got {dtype}")
    return dtype


def _check_full_attention(text) -> None:
    """Refuse a config with sliding-window layers (Mistral, Gemma 2/3, Cohere 2, ...): a sliding layer attends
    only the last ``sliding_window`` keys, and DecodeCache keeps and attends every key of every layer."""
    types = sorted(set(getattr(text, "layer_types", None) or []))
    window = getattr(text, "sliding_window", None)
    if window is None and all(t == "full_attention" for t in types):
        return
    what = ", ".join(f"{k}={v}" for k, v in (("sliding_window", window), ("layer_types", types or None)) if v)
    raise NotImplementedError(f"config: DecodeCache holds full-attention layers only; this "
                              f"{getattr(text, 'model_type', None) or type(text).__name__} config has sliding-window "
                              f"attention ({what}): generate with transformers' own caches for this model")


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return v


class DecodeLayer(CacheLayerMixin):
    """One model layer's K and V, preallocated: ``keys``/``values`` ``[B_max, L_max, H_kv, D]`` or pages
    ``[n_pages, page_size, H_kv, D]``. Lengths and write positions are its cache's (every layer of a step writes
    the same positions)."""

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: "DecodeCache", keys: torch.Tensor, values: torch.Tensor, scales=(None, None),
                 nonfinite_from: torch.Tensor | None = None):
        super().__init__()
        self._owner = weakref.ref(owner)
        self.keys, self.values = keys, values
        self.k_scale, self.v_scale = scales   # an 8-bit cache's (fdlib.hf.kv8); None for 16 bits
        self.nonfinite_from = nonfinite_from  # an int8 cache's with fixed scales (fdlib.hf.kv8); else None
        # generate() compiles the steps of a compileable cache by itself; an 8-bit cache's steps run eagerly
        # (or captured in a CUDA graph), so it says it is not compileable rather than be refused there
        self.is_compileable = scales[0] is None
        self.k_host = self.v_host = None      # per-tensor scales as floats
        self.device, self.dtype = keys.device, keys.dtype
        self.batch_size, self.max_cache_len = owner.max_batch_size, owner.max_cache_len
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:   # allocated up front
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("DecodeLayer.update: write through DecodeCache.update(key_states, value_states, layer_idx)")

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        return self._owner().get_mask_sizes(query_length)

    def get_seq_length(self, *args, **kwargs):
        return self._owner().columns

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self._owner().reset()


class DecodeCache(Cache):
    r"""A transformers ``Cache`` that a model takes as ``past_key_values`` with ``attn_implementation="fdlib"``
    (:func:`fdlib.hf.register` first).

    Args:
        config: the model's config (a multimodal model's text config is taken): layers, heads, head dim, dtype.
        max_batch_size: the most sequences a call may hold (B_max); a call may hold fewer (the first B rows).
        max_cache_len: the most tokens a sequence may hold (L_max), its prompt's padding included.
        device: where K/V live (default: fdlib's device, ``cuda`` on a GPU). dtype: of K/V (default: the
            config's dtype, else torch's default dtype).
        page_size: store K/V in pages of this many tokens (a power of two from 1 to 256 dividing L_max) behind a
            block table ``[B_max, L_max / page_size]``; default: token-major ``[B_max, L_max, H_kv, D]``.
        kv_dtype: ``torch.float8_e4m3fn`` or ``torch.int8`` to store K/V in 8 bits, each token quantized as it is
            written (:mod:`fdlib.hf.append`); granularity: its scales' (``"token"``, ``"head"``, ``"tensor"``);
            k_scale, v_scale: fixed per-head or per-tensor scales, else calibrated from the prefill
            (:mod:`fdlib.hf.kv8` states the rule).

    Attributes: ``lengths`` (int32 ``[B_max]`` on the device: the keys each sequence holds), ``columns`` (0-d
    int64: the tokens HF has fed, padding included), ``block_table`` (int32, paged only; page j of sequence b is
    pool page j·B_max + b), ``layers[i].keys/values``.

    The rule for where keys go, and what a second ``generate()`` does, are in the module doc
    (:mod:`fdlib.hf.cache`). Sliding-window configs (Mistral, Gemma 2/3, ...) are refused with
    NotImplementedError. One fdlib plan per (q_len, scale) is made
    once: q_len = 1 at construction, others on their first eager step (run one before capturing a CUDA graph of
    it). Plans are made for the capacity L_max, so growing lengths never re-plan.
    """

    def __init__(self, config, max_batch_size: int, max_cache_len: int, device=None, dtype=None,
                 page_size: int | None = None, kv_dtype=None, granularity: str = "token", k_scale=None,
                 v_scale=None):
        text = _text_config(config)
        self._B_max = _positive_int("max_batch_size", max_batch_size)
        self._L_max = _positive_int("max_cache_len", max_cache_len)
        _check_full_attention(text)
        self.H_q = int(text.num_attention_heads)
        self.H_kv = int(getattr(text, "num_key_value_heads", None) or self.H_q)
        self.D = int(getattr(text, "head_dim", None) or text.hidden_size // self.H_q)
        self.scale = self.D ** -0.5   # HF's attention scaling (module.scaling): the plan made below is the one used
        self.dtype = _dtype_of(text, dtype)
        self.device = check_device(device)   # fdlib's for None; "cuda": the current one (ValueError where none)
        if page_size is not None:
            check_page_size(page_size)
            if self.max_cache_len % page_size:
                raise ValueError(f"page_size: max_cache_len={self.max_cache_len} must be a multiple of "
                                 f"page_size={page_size}")
        self.page_size = page_size
        B, L, dev = self.max_batch_size, self.max_cache_len, self.device
        if page_size is None:
            shape, self.block_table = (B, L, self.H_kv, self.D), None
        else:
            pages = L // page_size
            shape = (B * pages, page_size, self.H_kv, self.D)
            self.block_table = (torch.arange(pages, dtype=torch.int32, device=dev)[None, :] * B
                                + torch.arange(B, dtype=torch.int32, device=dev)[:, None]).contiguous()
        n_layers = int(text.num_hidden_layers)
        self.kv8 = None if kv_dtype is None and k_scale is None and v_scale is None else \
            KV8(kv_dtype, granularity, k_scale, v_scale, self.dtype, n_layers, self.H_kv)
        kv = dict(dtype=self.dtype if self.kv8 is None else self.kv8.dtype, device=dev)
        scales = [(None, None)] * n_layers if self.kv8 is None else self.kv8.scales(shape, n_layers, dev)
        marks = [None] * n_layers if self.kv8 is None else self.kv8.nonfinite_from(B, self.H_kv, n_layers, dev)
        layers = [DecodeLayer(self, torch.zeros(shape, **kv), torch.zeros(shape, **kv), scales[i], marks[i])
                  for i in range(n_layers)]
        super().__init__(layers=layers)
        if self.kv8 is not None and self.kv8.fixed is not None:
            for layer in layers:
                self.kv8.host_scales(layer)
        self.lengths = torch.zeros(B, dtype=torch.int32, device=dev)
        self.columns = torch.zeros((), dtype=torch.int64, device=dev)
        self._rows = torch.arange(B, dtype=torch.int64, device=dev)
        self._steps = torch.arange(DECODE_MAX_Q_LEN, dtype=torch.int64, device=dev)
        self._slots = None          # [B·T] rows of the flattened K/V this step writes (made at layer 0)
        self._positions = None      # [B·T] their places in their sequences
        self._awaiting = None       # the layer whose attention has not run yet (the attention function clears it)
        self._seen = 0              # host copy of `columns` (eager bounds checks); None when not known
        self._step = None           # the layer-0 facts of the current step, shared by its layers (begin_step)
        self.prefilling = False     # whether the current step is a prefill chunk (decided at layer 0)
        self._plans = {}
        self.key = id(self)
        CACHES[self.key] = self
        statics = [t for layer in layers for t in (layer.keys, layer.values, layer.k_scale, layer.v_scale,
                                                   layer.nonfinite_from) if t is not None] + [self.lengths, self.columns]
        for t in statics + ([self.block_table] if self.block_table is not None else []):
            torch._dynamo.mark_static_address(t)   # a compiled step's CUDA graph reads them where they are
        self.plan(1, self.scale)

    # ------------------------------------------------------------------------------------------ HF's API
    @property
    def max_batch_size(self) -> int:
        return self._B_max

    @property
    def max_cache_len(self) -> int:
        return self._L_max

    @property
    def batch_size(self) -> int:
        return self._B_max

    def get_seq_length(self, layer_idx: int = 0):
        """Columns HF has fed (padding included), as a 0-d device tensor (no sync), like ``StaticCache``."""
        return self.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        """(query_length, 0): :meth:`update` returns only the step's new keys (the fdlib attention reads the cache
        itself and builds no mask from these sizes). transformers < 5.1x passes the step's ``cache_position``
        tensor instead of its length."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return query_length, 0

    def reset(self) -> None:
        """Empty every sequence (K/V stay as they are: nothing past a length is read)."""
        self.lengths.zero_()
        self.columns.zero_()
        self._seen, self._slots, self._step, self._awaiting, self.prefilling = 0, None, None, None, False
        self._positions = None
        if self.kv8 is not None:
            self.kv8.calibrated = False   # calibrated scales belong to the prompt they came from
            self._forget_nonfinite(self.lengths)

    def crop(self, *args, **kwargs):
        raise NotImplementedError("DecodeCache.crop: not supported (assisted decoding needs a cache whose rows can be "
                                  "cut back; use HF's caches for it)")

    def reorder_cache(self, *args, **kwargs):
        raise NotImplementedError("DecodeCache: beam search (reordering or repeating rows) is not supported")

    batch_repeat_interleave = batch_select_indices = reorder_cache

    # ------------------------------------------------------------------------------------------ fdlib
    def plan(self, q_len: int, scale: float | None = None):
        """The fdlib plan of steps of ``q_len`` new tokens (made once, then reused; never re-planned per step)."""
        key = (q_len, self.scale if scale is None else scale)
        p = self._plans.get(key)
        if p is None:
            q8 = {} if self.kv8 is None else dict(kv_dtype=self.kv8.dtype, k_scale=self.kv8.granularity,
                                                  v_scale=self.kv8.granularity)
            p = make_plan(self.max_batch_size, self.H_q, self.H_kv, self.D, self.max_cache_len, dtype=self.dtype,
                          device=self.device, scale=key[1], q_len=q_len, page_size=self.page_size, **q8)
            self._plans[key] = p
        return p

    def set_lengths(self, lengths) -> None:
        """Declare that sequence b holds ``lengths[b]`` keys, already written in ``layers[i].keys/values``
        (host ints; rows past the list are emptied), and that HF has fed max(lengths) columns: for tests and
        benchmarks that fill the cache directly instead of running a prefill. A token that is not finite, recorded
        past a new length (an int8 cache with fixed scales: :mod:`fdlib.hf.kv8`), is no longer held."""
        lengths = [int(x) for x in lengths]
        if not 1 <= len(lengths) <= self.max_batch_size or any(not 0 <= x <= self.max_cache_len for x in lengths):
            raise ValueError(f"lengths: expected 1..{self.max_batch_size} values in 0..{self.max_cache_len}, got "
                             f"{lengths}")
        full = lengths + [0] * (self.max_batch_size - len(lengths))
        self.lengths.copy_(torch.tensor(full, dtype=torch.int32))
        self.columns.fill_(max(lengths))
        self._seen = max(lengths)
        self._forget_nonfinite(self.lengths)

    def _forget_nonfinite(self, lengths: torch.Tensor) -> None:
        """Forget the non-finite tokens recorded at or past ``lengths`` (int32 ``[B_max]``), no longer held."""
        for layer in self.layers:
            if layer.nonfinite_from is not None:
                layer.nonfinite_from.masked_fill_(layer.nonfinite_from >= lengths[:, None], ALL_FINITE)

    def token_view(self, layer_idx: int, which: str = "keys", B: int | None = None, n: int | None = None):
        """Layer ``layer_idx``'s keys or values, the first ``n`` (default L_max) of the first B sequences, as
        ``[B, n, H_kv, D]``: a view; a gathered copy when paged; dequantized to the model's dtype (a copy of
        those keys) when 8-bit."""
        layer = self.layers[layer_idx]
        t = getattr(layer, which)
        B = self.max_batch_size if B is None else B
        n = self.max_cache_len if n is None else n
        s = None if self.kv8 is None else layer.k_scale if which == "keys" else layer.v_scale
        if self.page_size is None:
            t = t[:B, :n]
            s = s if s is None or not self.kv8.token else s[:B, :n]
        else:
            pages = self.block_table[:B, :-(-n // self.page_size)].long()
            t = t[pages].reshape(B, -1, self.H_kv, self.D)[:, :n]
            s = s if s is None or not self.kv8.token else s[pages].reshape(B, -1, self.H_kv)[:, :n]
        if s is None:
            return t
        nf = layer.nonfinite_from
        return self.kv8.dequantized(t, s, self.dtype, None if nf is None else nf[:B])

    # ------------------------------------------------------------------------------------------ steps
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Check the new K/V of ``layer_idx`` (HF's ``[B, H_kv, T, D]``) and return them unchanged: nothing is
        written and no state moves here. The ``"fdlib"`` attention function, which HF calls next with these
        states and the padding mask, starts the step at layer 0 (:meth:`begin_step`) and writes every layer."""
        if layer_idx != 0 and self._awaiting is not None:
            awaiting, self._awaiting = self._awaiting, None
            raise RuntimeError(f"DecodeCache: layer {awaiting} ran its attention without fdlib; load the model "
                               "with attn_implementation='fdlib' (call fdlib.hf.register() first) or call "
                               "model.set_attn_implementation('fdlib')")
        self._check_states(key_states, value_states, layer_idx)
        self._awaiting = layer_idx
        ACTIVE.cache = self
        return key_states, value_states

    def _traced(self) -> bool:
        return traced(self.device)

    def _host_columns(self) -> int:
        """HF's columns on the host (eager only): counted by eager steps, re-read (one sync) after traced ones."""
        if self._seen is None:
            self._seen = int(self.columns)
        return self._seen

    def _check_states(self, k, v, layer_idx):
        """Shapes, dtype and device of a step's new K/V (host metadata only: free under torch.compile)."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx: this cache holds {len(self.layers)} layers, got {layer_idx}")
        for name, t in (("key_states", k), ("value_states", v)):
            if t.dim() != 4 or t.shape[1] != self.H_kv or t.shape[3] != self.D:
                raise ValueError(f"{name}: expected [B, H_kv={self.H_kv}, T, D={self.D}], got {list(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name}: the cache holds {self.dtype}, got {t.dtype}; make it with "
                                f"DecodeCache(..., dtype={t.dtype})")
            if t.device != self.device:
                raise ValueError(f"{name}: the cache lives on {self.device}, got a tensor on {t.device}; make it "
                                 f"with DecodeCache(..., device='{t.device}')")
        if k.shape != v.shape:
            raise ValueError(f"value_states: expected the keys' shape {list(k.shape)}, got {list(v.shape)}")
        if k.shape[0] > self.max_batch_size:
            raise ValueError(f"max_batch_size: this cache holds at most {self.max_batch_size} sequences, the batch "
                             f"has {k.shape[0]}")

    def check_query(self, query: torch.Tensor, key: torch.Tensor) -> None:
        """A step's query ``[B, H_q, T, D]`` against the cache (H_q, D, dtype, device) and the keys it came with
        (B, T), by metadata only: checked before the step begins, since decode would refuse it (or, a batch or a
        token count other than the keys', run on it) only after the step has moved the lengths and written K/V."""
        want = [key.shape[0], self.H_q, key.shape[2], self.D]
        if query.dim() != 4 or list(query.shape) != want:
            raise ValueError(f"query: expected [B={want[0]}, H_q={self.H_q}, T={want[2]}, D={self.D}] (the keys' "
                             f"batch and tokens, the cache's heads and head dim), got {list(query.shape)}")
        if query.dtype != self.dtype:
            raise TypeError(f"query: expected {self.dtype} (the cache's dtype), got {query.dtype}")
        if query.device != self.device:
            raise ValueError(f"query: expected a tensor on the cache's device ({self.device}), got one on "
                             f"{query.device}")

    def _real_tokens(self, B: int, T: int, padding_mask, seen: int | None) -> torch.Tensor | None:
        """Which of the step's T tokens are real (bool ``[B, T]``: the last T columns of HF's 2D mask), or None
        when all are. Eagerly (``seen``: HF's columns before the step) the mask must have ``seen + T`` columns,
        and one sync tells whether any new token is padding; traced, the mask is taken unread."""
        if padding_mask is None:
            return None
        if not isinstance(padding_mask, torch.Tensor) or padding_mask.dim() != 2 or padding_mask.shape[0] != B \
                or (seen is not None and padding_mask.shape[1] != seen + T):
            cols = "columns" if seen is None else f"{seen} cached + {T} new columns"
            got = list(padding_mask.shape) if isinstance(padding_mask, torch.Tensor) else type(padding_mask).__name__
            raise ValueError(f"attention_mask: expected HF's 2D padding mask [B={B}, {cols}], got {got}"
                             + ("" if not seen else "; a second generate() continues the cache (pass the whole "
                                "conversation so far): call cache.reset() before a new prompt"))
        chunk = padding_mask[:, -T:].to(device=self.device, dtype=torch.bool)
        if seen is not None and bool(chunk.all()):
            return None
        return chunk

    def begin_step(self, B: int, T: int, padding_mask: torch.Tensor | None = None) -> dict:
        r"""Layer 0 of a step of T tokens a sequence (the ``"fdlib"`` attention calls it): check it in full, then
        decide where its keys go and move the lengths. Nothing changes before every check has passed, so a
        refused step leaves the cache as it was.

        The rule, the same for every step (module doc): real token t of sequence b (``attention_mask`` 1) goes
        to :math:`L_b + r_{bt}`, :math:`r_{bt}` the real tokens before it in the step; its pad tokens go after
        them (zeroed, never read: the next tokens overwrite them); then :math:`L_b \mathrel{+}= n_b`, the step's
        real tokens, and columns += T.

        The path: a step of at most :data:`DECODE_MAX_Q_LEN` tokens, all real, on a cache that holds tokens (or
        traced) is a *decode step*: fdlib's plan, no host sync. Any other step is a *prefill chunk*, attended
        through SDPA with HF's causal and padding mask: over its own keys when the cache is empty (eager), else
        over the cached keys (eager: up to the longest length, one sync; traced: all L_max, nothing read back).

        Returns the facts every layer of the step uses: ``prefill``, ``real`` (bool [B, T]; None: all real),
        ``before`` (a prefill chunk's lengths before it), ``first`` (an empty cache, eager), ``n_keys`` (the
        cached keys a prefill chunk attends; None for a first chunk)."""
        traced = self._traced()
        seen = None if traced else self._host_columns()
        if seen is not None and seen + T > self.max_cache_len:
            raise ValueError(f"max_cache_len: {T} new tokens after {seen} do not fit the cache's "
                             f"{self.max_cache_len} (make the DecodeCache with a larger max_cache_len)")
        real = self._real_tokens(B, T, padding_mask, seen)
        first = seen == 0
        if self.kv8 is not None:
            self._check_kv8_step(first)
        prefill = T > DECODE_MAX_Q_LEN or real is not None or first
        before = self.lengths[:B].clone() if prefill else self.lengths[:B]   # a decode step reads it before the add
        t = self._steps[:T] if T <= DECODE_MAX_Q_LEN else torch.arange(T, device=self.device)
        if real is None:
            pos, kept = before[:, None].long() + t[None, :], T
        else:
            n = real.sum(-1, keepdim=True)
            pos = before[:, None].long() + torch.where(real, real.cumsum(-1) - 1, n + (~real).cumsum(-1) - 1)
            kept = n[:, 0].to(torch.int32)
        slots = self._flat_slots(B, pos)
        # ---- every check passed: commit
        self.lengths[:B].add_(kept)
        self.columns.add_(T)
        self._seen = None if traced else seen + T
        self._slots, self._positions, self.prefilling = slots, pos.reshape(-1), prefill
        n_keys = None
        if prefill and not first:
            n_keys = self.max_cache_len if traced else max(1, int(self.lengths[:B].max()))
        self._step = dict(prefill=prefill, real=real, before=before if prefill else None, first=first, n_keys=n_keys)
        return self._step

    def _check_kv8_step(self, first: bool) -> None:
        """An 8-bit step: eager or CUDA-graph captured (fdlib's 8-bit decode does not compile yet: a traced step
        is refused by :meth:`refused_step` before it reaches here), and fixed scales known (given, or calibrated
        by an eager first step)."""
        if torch.compiler.is_compiling():
            _refuse_kv8()
        if self.kv8.calibrating and not self.kv8.calibrated and not first:
            raise ValueError(f"k_scale/v_scale: this cache calibrates its per-{self.kv8.granularity} scales from "
                             "the first step written into it when empty, eagerly (the prompt); pass k_scale= and "
                             "v_scale= to DecodeCache, or run the prompt eagerly first")

    def refused_step(self, query: torch.Tensor) -> torch.Tensor:
        """A traced (``torch.compile``) step of every layer on an 8-bit cache: no step begins, nothing is written,
        and the layer's output ``[B, T, H_q, D]`` is that of ``torch.ops.fdlib.refuse``, which raises
        NotImplementedError(:data:`KV8_NOT_COMPILED`) when the compiled code runs, the same with
        ``fullgraph=True`` or not, on every backend. Raising while tracing would not do: dynamo reports it as
        its own ``Unsupported`` under ``fullgraph=True``, and without it runs the code again eagerly, where
        nothing is traced and the step would go on. The graph then mutates nothing, and every layer's output
        depends on the refusal, so it raises before anything reads or writes the cache: the cache stays as it
        was."""
        return refuse(query.transpose(1, 2), "NotImplementedError", KV8_NOT_COMPILED)[0]

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's K/V ``[B, H_kv, T, D]`` of ``layer_idx`` at the slots of :meth:`begin_step`, in
        place (pad tokens zeroed first), eagerly and compiled by the same function (:mod:`fdlib.hf.write`: a
        compiled step writes only the new rows too, never a copy of the cache); an 8-bit cache quantizes them as
        it writes (:mod:`fdlib.hf.append`)."""
        real = self._step["real"]
        if self.kv8 is not None:
            layer = self.layers[layer_idx]
            if self.kv8.calibrating and self._step["first"]:
                self.kv8.calibrate(layer, k, v, real)
                self.kv8.calibrated = layer_idx == len(self.layers) - 1
            append_kv8(k, v, self._slots, real, layer.keys, layer.values, layer.k_scale, layer.v_scale,
                       self.kv8.token, self._positions, layer.nonfinite_from)
            return
        if real is not None:
            pad = ~real[:, None, :, None]
            k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
        layer = self.layers[layer_idx]
        write_kv(k, v, self._slots, layer.keys, layer.values)

    def _flat_slots(self, B: int, pos: torch.Tensor) -> torch.Tensor:
        """Rows of the flattened K/V (``keys.view(-1, H_kv, D)``) that positions ``pos`` [B, T] of sequences
        0..B-1 go to; a position past L_max is clamped to the last one (its length is then flagged by fdlib)."""
        pos = pos.clamp(max=self.max_cache_len - 1)
        if self.page_size is None:
            return (self._rows[:B, None] * self.max_cache_len + pos).reshape(-1)
        page = self.block_table[:B].long().gather(1, torch.div(pos, self.page_size, rounding_mode="floor"))
        return (page * self.page_size + pos % self.page_size).reshape(-1)
