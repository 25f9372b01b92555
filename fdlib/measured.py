"""Short name of :mod:`fdlib.course.measured`, where the code lives (``from fdlib.measured import show_measured``)."""
from fdlib.course.measured import provenance, show_measured  # noqa: F401

__all__ = ["show_measured", "provenance"]
