"""Registry of every graded exercise, by id."""
from __future__ import annotations

from graders import ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11, ch11_capstone
from graders.core import Exercise
from graders.points import POINTS

__all__ = ["EXERCISES"]

EXERCISES: dict[str, Exercise] = {ex.id: ex for ex in (*ch01.EXERCISES, *ch02.EXERCISES, *ch03.EXERCISES, *ch04.EXERCISES, *ch05.EXERCISES,
                                                        *ch06.EXERCISES, *ch07.EXERCISES, *ch08.EXERCISES,
                                                        *ch09.EXERCISES, *ch10.EXERCISES, *ch11.EXERCISES,
                                                        *ch11_capstone.EXERCISES)}

assert set(EXERCISES) == set(POINTS), "graders.points and the exercise registry disagree"
