"""fdlib inside a Hugging Face model's ``generate()``: an in-place KV cache and the ``"fdlib"`` attention.

The two lines a user writes (any transformers 5.x; from 5.2x on, ``cache=`` is the new name of
``past_key_values=``, which still works with a deprecation warning)::

    fdlib.hf.register(); model.set_attn_implementation("fdlib")   # or from_pretrained(..., attn_implementation="fdlib")
    out = model.generate(**inputs, max_new_tokens=n, past_key_values=fdlib.hf.DecodeCache(
        model.config, max_batch_size=inputs["input_ids"].shape[0], max_cache_len=inputs["input_ids"].shape[1] + n))

* :func:`register` adds ``"fdlib"`` to transformers' ``AttentionInterface`` (:mod:`fdlib.hf.attention`).
* :class:`DecodeCache` preallocates K/V in fdlib's layout, writes each step in place at each sequence's
  length (device lengths; padding is never stored: :mod:`fdlib.hf.cache`), and keeps one fdlib plan per q_len.

Needs transformers 5 (``pip install -e '.[hf]'``).
"""
from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:   # pragma: no cover - the message is the point
    raise ImportError("fdlib.hf needs transformers 5.x: pip install -e '.[hf]' (or pip install "
                      "'transformers>=5,<6')") from e

from .cache import DecodeCache  # noqa: E402
from .attention import NAME, fdlib_attention_forward, register  # noqa: E402
from .compat import cache_kwarg  # noqa: E402

__all__ = ["register", "DecodeCache", "fdlib_attention_forward", "NAME", "cache_kwarg"]
