"""The methods the benchmark times: fdlib's, through the public ``fdlib.decode_attention``, and the peers.

Each method turns one set of inputs into a zero-argument callable that returns ``out`` as ``[B, H_q, D]``;
the callable is built once per shape (and per input copy) and then called many times.

fdlib methods (KV cache token-major ``[B, L, H_kv, D]``):

=============  ===============================================================================
``naive``      ``method="naive"``: PyTorch matmul, softmax, matmul
``split1``     ``method="split", num_splits=1``: one program per (b, h_kv), no split ("standard
               FlashAttention in decode")
``split``      ``method="split"``: stage 1 + stage 2 with the splits fdlib chooses
``unified``    ``method="unified"``: one launch, splits fdlib chooses
``persistent`` ``method="persistent"``: one launch of a few programs per SM over all rows, no split
``balanced``   ``method="balanced"``: ragged batches cut into near-equal work items on the device (not in
               the default list)
``streamk``    ``method="streamk"``: a few programs per SM, as many for every KV head, take equal shares of
               their head's tiles, rows cut wherever the shares fall (not in the default list)
``invariant``  ``batch_invariant=True``: chunks by each row's own length, fixed tiles and merge order (not in
               the default list)
``auto``       ``method="auto"``
``split@S``    forced ``num_splits=S`` (also ``unified@S``, ``auto@S``)
``auto:bhld``  any fdlib method above reading the peers' cache (K/V memory ``[B, H_kv, L, D]``, contiguous),
               passed as the ``[B, L, H_kv, D]`` view of it: the same kernel on the peers' memory layout
=============  ===============================================================================

The timed call passes a prebuilt int32 ``cache_seqlens`` (all = L) on the device, the way a model calls it
(no device-to-host copy; the plan is made once per shape and cached). Peers (``q`` as ``[B, H_q, 1, D]``, K/V as contiguous
``[B, H_kv, L, D]``, ``enable_gqa=True`` when H_q != H_kv; every length = L):

=============  ===============================================================================
``cudnn``      ``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``
``fa2``        the same under ``SDPBackend.FLASH_ATTENTION`` (FlashAttention-2)
``memeff``     the same under ``SDPBackend.EFFICIENT_ATTENTION`` (not in the default list)
=============  ===============================================================================

A peer that raises (backend missing, shape refused) is recorded as unavailable with the reason.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import runtime
from ..api import decode_attention, plan_for
from ..kernels.config import MAX_SPLITS, tile_config

FDLIB_METHODS = {
    "naive": ("naive", None),
    "split1": ("split", 1),
    "split": ("split", None),
    "unified": ("unified", None),
    "persistent": ("persistent", None),
    "balanced": ("balanced", None),
    "streamk": ("streamk", None),
    "worklist": ("worklist", None),
    "invariant": ("auto", None),
    "auto": ("auto", None),
}
PEERS = {
    "cudnn": "CUDNN_ATTENTION",
    "fa2": "FLASH_ATTENTION",
    "memeff": "EFFICIENT_ATTENTION",
}
DEFAULT_METHODS = ("naive", "split1", "split", "unified", "persistent", "auto", "cudnn", "fa2")
QUICK_METHODS = ("unified", "naive", "cudnn", "fa2")
FORCEABLE = ("split", "unified", "auto")
BASELINE = "cudnn"


@dataclass
class Inputs:
    """One copy of a shape's inputs, in the layout its method reads."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor | None = None
    k_scale: object = None          # an 8-bit cache's scales (fdlib.bench.kv8); None for a 16-bit cache
    v_scale: object = None


@dataclass
class Method:
    name: str
    kind: str                       # "fdlib" or "peer"
    layout: str                     # "fdlib": K/V [B, L, H_kv, D]; "bhld": K/V [B, H_kv, L, D]
    make: Callable[[Inputs], Callable[[], torch.Tensor]]
    context: Callable = nullcontext  # entered around correctness and timing calls
    info: dict = field(default_factory=dict)


def _fdlib_method(name: str, fd_method: str, num_splits: int | None, layout: str = "fdlib") -> Method:
    """An fdlib method reading the ``layout`` its inputs come in: "fdlib" (K/V ``[B, L, H_kv, D]``), or "bhld"
    (the peers' inputs: q ``[B, H_q, 1, D]`` and K/V ``[B, H_kv, L, D]``, passed as views)."""
    invariant = name.split(":")[0] == "invariant"

    def make(inp: Inputs):
        q, k, v, lens = inp.q, inp.k, inp.v, inp.lens
        if layout == "bhld":
            q, k, v = q[:, :, 0], k.transpose(1, 2), v.transpose(1, 2)

        ks, vs = (inp.k_scale, inp.v_scale) if layout == "fdlib" else (None, None)

        def call():
            return decode_attention(q, k, v, lens, method=fd_method, num_splits=num_splits, batch_invariant=invariant,
                                    k_scale=ks, v_scale=vs)
        return call
    info = {"fdlib_method": fd_method, "num_splits": num_splits}
    if invariant:
        info["batch_invariant"] = True
    if layout == "bhld":
        info["kv_layout"] = "[B, H_kv, L, D] memory, read as a [B, L, H_kv, D] view"
    return Method(name, "fdlib", layout, make, info=info)


def _peer_method(name: str, backend_name: str) -> Method:
    """SDPA under one backend. Raises at build time if this torch has no ``torch.nn.attention``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def make(inp: Inputs):
        q4, k, v = inp.q, inp.k, inp.v
        gqa = q4.shape[1] != k.shape[1]
        kwargs = {"enable_gqa": True} if gqa else {}

        def call():
            return F.scaled_dot_product_attention(q4, k, v, **kwargs)[:, :, 0]
        return call

    info = {"backend": f"SDPBackend.{backend_name}", "torch": torch.__version__}
    if runtime.MODE != "gpu":
        info["note"] = "no GPU: torch's CPU implementation behind this backend flag, not the CUDA kernel"
    return Method(name, "peer", "bhld", make, context=lambda: sdpa_kernel(backend), info=info)


def parse_method(spec: str) -> tuple[str, int | None]:
    """``"unified@8"`` -> ("unified", 8); ``"split1"`` -> ("split1", None); a ``:bhld`` suffix is left out
    (:func:`build`). Raises ValueError if unknown."""
    head, sep, layout = spec.partition(":")
    if sep and (layout != "bhld" or head.partition("@")[0] in PEERS):
        raise ValueError(f"method {spec!r}: the only layout suffix is ':bhld', on an fdlib method")
    base, _, forced = head.partition("@")
    if base not in FDLIB_METHODS and base not in PEERS:
        raise ValueError(f"unknown method {spec!r}: expected one of {', '.join(list(FDLIB_METHODS) + list(PEERS))}"
                         f" (fdlib methods {', '.join(FORCEABLE)} also take '@SPLITS', e.g. unified@8)")
    if not forced:
        return base, None
    if base not in FORCEABLE:
        raise ValueError(f"method {spec!r}: only {', '.join(FORCEABLE)} take a forced split count")
    s = int(forced)
    if not 1 <= s <= MAX_SPLITS:
        raise ValueError(f"method {spec!r}: splits must be in 1..{MAX_SPLITS}")
    return base, s


def expand_methods(names, splits=None) -> list[str]:
    """The method names to run: with ``splits`` given, ``split`` and ``unified`` become one entry per split
    count (``split@1``, ``split@2``, ...); everything else is kept as given. Order kept, duplicates dropped."""
    out = []
    for name in names:
        base, forced = parse_method(name)
        if splits and forced is None and base in ("split", "unified"):
            out.extend(f"{base}@{s}" for s in splits)
        else:
            out.append(name)
    seen = set()
    return [m for m in out if not (m in seen or seen.add(m))]


def build(spec: str) -> Method:
    """The :class:`Method` for a name from :func:`expand_methods` (peers may raise: unavailable)."""
    base, forced = parse_method(spec)
    if base in PEERS:
        return _peer_method(spec, PEERS[base])
    fd_method, num_splits = FDLIB_METHODS[base]
    return _fdlib_method(spec, fd_method, forced if forced is not None else num_splits,
                         "bhld" if spec.endswith(":bhld") else "fdlib")


def to_layout(inp: Inputs, layout: str) -> Inputs:
    """The same numbers in the layout a method reads (a contiguous copy for the peers)."""
    if layout == "fdlib":
        return inp
    return Inputs(inp.q.unsqueeze(2), inp.k.transpose(1, 2).contiguous(), inp.v.transpose(1, 2).contiguous())


def fdlib_splits(q, k, v, fd_method: str, num_splits: int | None, batch_invariant: bool = False, k_scale=None,
                 v_scale=None, lens=None) -> dict:
    """The split count fdlib asks for and the one it launches for a full-length cache, and auto's kernel:
    the plan ``decode_attention`` runs for these inputs (None if unknowable); ``lens``: the lengths the timed call
    passes (a call without them is planned for rows the host knows are equal, one with them on the device is
    not: :func:`fdlib.api.plan_for`)."""
    if fd_method == "naive":
        return {"splits_requested": None, "splits": None}
    try:
        d = plan_for(q, k, v, lens, method=fd_method, num_splits=num_splits, batch_invariant=batch_invariant,
                     k_scale=k_scale, v_scale=v_scale).decision
        rec = {"splits_requested": num_splits if num_splits is not None else d.splits, "splits": d.splits}
        if fd_method == "auto":
            rec["kernel"] = d.kernel
        return rec
    except Exception as e:  # noqa: BLE001 - bookkeeping only, never fatal
        return {"splits_requested": num_splits, "splits": None, "splits_error": f"{type(e).__name__}: {e}"[:200]}


def block_n(D: int, L: int, rows: int | None = None, elem_bytes: int = 2) -> int:
    """Keys per tile fdlib's kernels use for head dim D, length L, B·H_kv rows and element size (as
    ``decode_attention`` picks it)."""
    return tile_config(D, L, elem_bytes, rows=rows).BLOCK_N
