"""Short name of :mod:`fdlib.course.grading`, where the code lives (``from fdlib.grading import *``, ``python -m fdlib.grading``)."""
from fdlib.course.grading import *  # noqa: F401,F403
from fdlib.course.grading import __all__, solution  # noqa: F401

if __name__ == "__main__":
    import sys

    from fdlib.course.grading.scorecard import main
    sys.exit(main())
