"""fdlib: decode attention (Flash-Decoding) in Triton, and the course built on it.

Importing fdlib decides the runtime first (see :mod:`fdlib.runtime`), before any kernel is defined.
"""
from . import runtime  # noqa: F401  (must come first)
from .runtime import describe  # noqa: F401
from .api import decode_attention  # noqa: F401
from .plan import DecodePlan, plan  # noqa: F401
from .reference import reference_attention  # noqa: F401

__version__ = "0.1.0"
__all__ = ["decode_attention", "plan", "DecodePlan", "reference_attention", "describe", "runtime"]
