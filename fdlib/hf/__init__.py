"""fdlib inside a Hugging Face model's ``generate()``: an in-place KV cache and the ``"fdlib"`` attention.

Two lines a user writes::

    fdlib.hf.register()                                              # once: attn_implementation="fdlib"
    model.generate(**inputs, attn_implementation... )                # see README

* :func:`register` adds ``"fdlib"`` to transformers' ``AttentionInterface`` (:mod:`fdlib.hf.attention`).
* :class:`DecodeCache` preallocates K/V in fdlib's layout, writes each step in place at each sequence's
  length (device lengths, left padding dropped: :mod:`fdlib.hf.cache`), and keeps one fdlib plan per q_len.

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

__all__ = ["register", "DecodeCache", "fdlib_attention_forward", "NAME"]
