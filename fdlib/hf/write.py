r"""``torch.ops.fdlib.hf_write``: a step's new K and V written into a :class:`~fdlib.hf.DecodeCache` layer's
buffers, in place; one function, which a compiled step calls as an op and an eager step calls directly.

Token row r = b·T + t of the step (HF's ``[B, H_kv, T, D]``, taken as rows ``[B·T, H_kv, D]``) goes to row
``slots[r]`` of the flattened buffer ``keys.view(-1, H_kv, D)`` (token-major ``[B_max, L_max, H_kv, D]`` or
pages ``[n_pages, page_size, H_kv, D]``: :meth:`DecodeCache.begin_step` computes the slots), and the same for
V: B·T·H_kv·D elements written, whatever the cache holds.

Why an op: ``torch.compile`` turns an in-place write into a functional one (a new buffer) and a copy back into
the cache, and leaves it to Inductor to write in place again. An ``index_copy_`` through a view of the cache
(``keys.view(-1, H_kv, D)``) is one that Inductor of torch 2.11 does not write in place (newer ones can): it
copied every layer's whole K and V, and copied them back, at every step. The op declares that it mutates ``keys`` and
``values`` themselves (the step's inputs, never a view of them) and its fake implementation returns nothing,
so Inductor calls it on the cache's own buffers and makes no buffer of the cache's size.
"""
from __future__ import annotations

import torch


def write_rows(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> None:
    """Write ``k``/``v`` (``[B, H_kv, T, D]``, any strides) at rows ``slots`` (int64 ``[B·T]``) of
    ``keys``/``values`` (``[..., H_kv, D]``, contiguous), in place: the op's body."""
    for buf, new in ((keys, k), (values, v)):
        H, D = buf.shape[-2:]
        buf.view(-1, H, D).index_copy_(0, slots, new.transpose(1, 2).reshape(-1, H, D))


hf_write = torch.library.custom_op("fdlib::hf_write", mutates_args=("keys", "values"))(write_rows)


@hf_write.register_fake
def _(k, v, slots, keys, values):
    """Nothing to return: the op's only effect is on ``keys`` and ``values``."""
    return None


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """:func:`write_rows`: through the op while ``torch.compile`` traces, called directly otherwise (eagerly
    and under CUDA-graph capture; the op's dispatch would cost more than the write itself there)."""
    (hf_write if torch.compiler.is_compiling() else write_rows)(k, v, slots, keys, values)
