"""The course's own machinery, apart from the library a user calls: the checks of the exercises (:mod:`.grading`),
each lab's recorded figure and table (:mod:`.measured`), the explorer widgets (:mod:`.explorer`, :mod:`.explorer_model`),
Lab 06's per-SM timelines (:mod:`.timeline`) and work-list pictures (:mod:`.worklist_view`), and the course's figure
style (:mod:`.figures`).

The names a learner types stay short: ``from fdlib.grading import *``, ``python -m fdlib.grading`` and
``from fdlib.measured import show_measured`` are small aliases of :mod:`fdlib.course.grading` and
:mod:`fdlib.course.measured`.
"""
