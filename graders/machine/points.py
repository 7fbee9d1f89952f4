"""The one points table of the book. Notebook nbgrader metadata is generated from it
(``tools/build_notebooks.py``) and a test checks that they agree.

Each exercise's points are split over named case groups that are the same on every device:
``edge`` (fixed edge cases), ``random`` (seeded random cases) and ``hidden`` (cases drawn from the
instructor's secret; all-or-nothing, details never shown). A group scores only if all its cases pass.
"""
from __future__ import annotations

__all__ = ["POINTS", "GROUPS", "total_points"]

GROUPS = ("edge", "random", "hidden")

_STANDARD = {"edge": 1.0, "random": 1.0, "hidden": 1.0}

#: exercise id -> {group: points}
POINTS: dict[str, dict[str, float]] = {
    "ch01.1": dict(_STANDARD),
    "ch01.2": dict(_STANDARD),
    "ch01.3": dict(_STANDARD),
    "ch01.4": dict(_STANDARD),
    "ch01.5": dict(_STANDARD),
    "ch01.6": dict(_STANDARD),
    "ch02.1": dict(_STANDARD),
    "ch02.2": dict(_STANDARD),
    "ch02.3": dict(_STANDARD),
    "ch02.4": dict(_STANDARD),
    "ch02.5": dict(_STANDARD),
    "ch02.6": dict(_STANDARD),
    "ch02.7": dict(_STANDARD),
    "ch02.8": dict(_STANDARD),
    "ch02.9": dict(_STANDARD),
    "ch03.1": dict(_STANDARD),
    "ch03.2": dict(_STANDARD),
    "ch03.3": dict(_STANDARD),
    "ch04.1": dict(_STANDARD),
    "ch04.2": dict(_STANDARD),
    "ch04.3": dict(_STANDARD),
    "ch04.4": dict(_STANDARD),
    "ch05.1": dict(_STANDARD),
    "ch05.2": dict(_STANDARD),
    "ch05.3": dict(_STANDARD),
    "ch05.4": dict(_STANDARD),
    "ch05.5": dict(_STANDARD),
    "ch06.1": dict(_STANDARD),
    "ch06.2": dict(_STANDARD),
    "ch06.3": dict(_STANDARD),
    "ch06.4": dict(_STANDARD),
    "ch07.1": dict(_STANDARD),
    "ch07.2": dict(_STANDARD),
    "ch07.3": dict(_STANDARD),
    "ch08.1": dict(_STANDARD),
    "ch08.2": dict(_STANDARD),
    "ch08.3": dict(_STANDARD),
    "ch08.4": dict(_STANDARD),
    "ch09.1": dict(_STANDARD),
    "ch09.2": dict(_STANDARD),
    "ch09.3": dict(_STANDARD),
    "ch09.4": dict(_STANDARD),
    "ch09.5": dict(_STANDARD),
    "ch10.1": dict(_STANDARD),
    "ch10.2": dict(_STANDARD),
    "ch10.3": dict(_STANDARD),
    "ch10.4": dict(_STANDARD),
    "ch11.1": dict(_STANDARD),
    "ch11.2": dict(_STANDARD),
    "ch11.3": dict(_STANDARD),
    "ch11.4": dict(_STANDARD),
    "ch11.5": dict(_STANDARD),
}


def total_points(exercise_id: str) -> float:
    """Points of one exercise (the nbgrader test cell's ``points``)."""
    return float(sum(POINTS[exercise_id].values()))
