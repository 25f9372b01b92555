"""Reference solutions of the course's exercises, one module per lab (``labNN_topic.py``).

Each function is registered with ``@solution("labNN.name")`` under the exercise's name. ``pytest`` grades
these by default; the notebooks fall back to them (``fdlib.course.grading.use``) when an exercise is not done yet.
"""
