"""Grading for the course's exercises.

In a notebook::

    from fdlib.grading import *

    @exercise("lab01.naive_attention")
    def naive_attention(q, k_cache, v_cache, cache_seqlens, scale):
        todo("lab01.naive_attention")

    check("lab01.naive_attention")        # ✅/❌ per check, or a TODO line for a stub
    attn = use("lab01.naive_attention")   # yours if it passes, else the reference
    show_solution("lab01.naive_attention")     # print the reference solution
    reveal_solution("lab01.naive_attention")   # put it into the exercise cell (after a backup), in JupyterLab
    restore_backup()                           # and back: the backups are listed with their times

From a terminal, ``./course grade`` grades the exercise cells of the saved notebooks (``python -m fdlib.grading``).

The checks of lab NN live in ``fdlib/course/grading/labNN.py``, with the stub of each of its exercises (the exercise cell
as shipped); pytest runs the same checks (``tests/test_graders_*.py``). What the Triton exercises of Labs 03-05
share (recognising an untouched stub, requiring a Triton function, launching the learner's code) is in
``fdlib/course/grading/triton_exercise.py``.
"""
from .core import (  # noqa: F401
    CheckFailure, GuardedBuffer, Result, TodoError, check, exercise, exercises, reference, run_checks,
    show_solution, solution, solution_source, todo, use,
)
from .live import list_backups, reset_exercise, restore_backup, reveal_solution  # noqa: F401

__all__ = ["exercise", "check", "use", "todo", "show_solution", "solution_source", "Result",
           "reveal_solution", "reset_exercise", "restore_backup", "list_backups"]
