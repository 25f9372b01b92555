"""Grade lab10: every check of fdlib/course/grading/lab10.py, on labsolutions/ (or the notebook with --grade-notebooks)."""
import pytest

from fdlib.course.grading.core import exercises, load_checks

CASES = [(name, c.name) for name in exercises("lab10") for c in load_checks(name)]


@pytest.mark.parametrize("name,check_name", CASES, ids=[f"{n}:{c}" for n, c in CASES])
def test_check(grade, name, check_name):
    grade(name, check_name)
