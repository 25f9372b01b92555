"""What differs between transformers 5.x releases that fdlib.hf's callers meet: the name under which a model
takes its cache (``past_key_values`` up to 5.2x; ``cache`` after, with ``past_key_values`` deprecated)."""
from __future__ import annotations

import inspect


def cache_kwarg(model) -> str:
    """The keyword ``model(...)`` and ``model.generate(...)`` take the cache under: ``"cache"`` where the model's
    forward names it so, else ``"past_key_values"`` (older releases ignore an unknown ``cache=`` silently)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
