"""``python -m fdlib.grading [lab ...]`` (what ``./course grade`` runs): see :mod:`fdlib.course.grading.scorecard`."""
import sys

from .scorecard import main

sys.exit(main())
