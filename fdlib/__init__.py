"""fdlib: decode attention (Flash-Decoding) in Triton, and the course built on it.

Importing fdlib decides the runtime first (see :mod:`fdlib.runtime`), before any kernel is defined.

Glossary of the short names in the code, docstrings and labs (shapes: B sequences, H_q query heads, H_kv KV
heads, head dim D, sequence b holds L_b keys):

* ``group`` = H_q / H_kv: the query heads that share one KV head; one program serves all of them.
* ``q_len``: query tokens per sequence (1 for plain decoding; a few for speculative decoding, q
  ``[B, q_len, H_q, D]``): query t sees keys 0 … L_b − q_len + t. A program holds the group × q_len query rows
  r = t·group + g of its KV head in one tile.
* ``m``, ``ℓ``, ``Õ`` (``l``, ``acc``/``o_tilde`` in code): the online-softmax state of a set of keys, with
  scores s_j: running max m = max_j s_j, denominator ℓ = Σ_j e^(s_j − m), unnormalised output
  Õ = Σ_j e^(s_j − m) v_j. The kernels keep m and the scores in base 2 (qk_scale = scale·log₂e, ``exp2``).
* ``lse`` = m + log ℓ (natural log): the log of the softmax denominator, returned per (b, h) beside
  out = Õ/ℓ; a split's partial is (O_i, lse_i), and the merge weighs O_i by e^(lse_i − lse).
* ``splits``: programs per (b, h_kv) row; split i covers keys [i·chunk, (i+1)·chunk) of the row.
* ``chunk``: keys per split, a whole number of BLOCK_N-key tiles: BLOCK_N·⌈⌈L_cap/splits⌉/BLOCK_N⌉
  (:func:`fdlib.kernels.config.chunk_for`).
* ``L_cap``: the longest length a launch's splits and chunk are chosen for (the host lengths' maximum,
  ``max_seqlen``, or the cache capacity L_max); a longer row is still covered, only slower.
* ``eff``: the splits actually launched after :func:`~fdlib.kernels.config.chunk_for`, ⌈L_cap/chunk⌉: at
  most the splits asked for and at most one per tile.
* ``r``: programs resident on one SM at a time (registers, shared memory, warps:
  :func:`fdlib.occupancy.programs_per_sm`).
* ``w`` (W in the labs): waves, ⌈P/(r·SMs)⌉ for a launch of P programs (:func:`fdlib.occupancy.waves`).
* ``ρ`` (``rho_tbs``): one program's streaming rate, the bytes it keeps in flight over the memory latency
  (TB/s = MB/µs); BW (``bw_tbs``) is the whole GPU's (:mod:`fdlib.costmodel`).
"""
from . import runtime  # noqa: F401  (must come first)
from .runtime import describe  # noqa: F401
from .api import clamped, decode_attention  # noqa: F401
from . import distributed  # noqa: F401  (context-parallel decode: fdlib.distributed)
from .plan import DecodePlan, plan  # noqa: F401
from .reference import reference_attention  # noqa: F401
from .quant import dequantize_kv, quantize_kv  # noqa: F401  (8-bit KV caches: fdlib.quant)

__version__ = "0.1.0"
__all__ = ["decode_attention", "clamped", "plan", "DecodePlan", "reference_attention", "describe", "runtime", "distributed",
           "quantize_kv", "dequantize_kv"]


def __getattr__(name):
    """``fdlib.hf`` is imported on first use (it needs the optional transformers: ``pip install -e '.[hf]'``)."""
    if name == "hf":
        import importlib
        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'fdlib' has no attribute {name!r}")
