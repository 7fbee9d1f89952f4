"""Registry of every graded exercise, by id: the machine finds a chapter's case library from the id
alone, without importing any chapter at import time.

An id ``chNN.M`` belongs to chapter ``chNN``; the chapter's exercises are the ``EXERCISES`` tuples of
the modules of :data:`CHAPTERS_PACKAGE` named ``chNN`` or ``chNN_<anything>`` (``ch11`` and
``ch11_capstone``), imported on the first lookup of one of its ids. So imports run one way: the
course jobs and the chapters import the machine, and the machine reaches a chapter only by name. The
points table (:mod:`graders.machine.points`) is the list of ids: a chapter module that declares
another set of ids than the table gives a clear error on its first lookup.
"""
from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import Iterator, Mapping

from graders.machine.exercise import Exercise
from graders.machine.points import POINTS

__all__ = ["EXERCISES", "CHAPTERS_PACKAGE", "chapter_of", "load_all", "shown_reference"]

#: Where the case libraries live: one or more modules per chapter, ``chNN`` / ``chNN_*``.
CHAPTERS_PACKAGE = "graders.chapters"


def chapter_of(exercise_id: str) -> str:
    """``"ch11"`` for ``"ch11.5"``."""
    return exercise_id.partition(".")[0]


class _Registry(Mapping[str, Exercise]):
    """A read-only ``{id: Exercise}`` whose chapters load on first use (thread-safe: the course jobs
    grade from worker threads)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Exercise] = {}
        self._loaded: set[str] = set()
        self._lock = threading.Lock()

    def _load(self, chapter: str) -> None:
        with self._lock:
            if chapter in self._loaded:
                return
            package = importlib.import_module(CHAPTERS_PACKAGE)
            names = sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                           if m.name == chapter or m.name.startswith(chapter + "_"))
            found: dict[str, Exercise] = {}
            for name in names:
                for ex in getattr(importlib.import_module(f"{CHAPTERS_PACKAGE}.{name}"), "EXERCISES", ()):
                    found[ex.id] = ex
            table = {i for i in POINTS if chapter_of(i) == chapter}
            if set(found) != table:
                raise RuntimeError(f"graders.machine.points and {CHAPTERS_PACKAGE} disagree on chapter {chapter}: "
                                   f"points for {sorted(table - set(found))} without an exercise, "
                                   f"exercises {sorted(set(found) - table)} without points")
            self._by_id.update(found)
            self._loaded.add(chapter)

    def __getitem__(self, exercise_id: str) -> Exercise:
        if exercise_id not in POINTS:
            raise KeyError(exercise_id)
        self._load(chapter_of(exercise_id))
        return self._by_id[exercise_id]

    def __iter__(self) -> Iterator[str]:
        return iter(POINTS)

    def __len__(self) -> int:
        return len(POINTS)

    def __contains__(self, exercise_id: object) -> bool:
        return exercise_id in POINTS


#: exercise id -> :class:`~graders.machine.exercise.Exercise`, in the points table's order.
EXERCISES: Mapping[str, Exercise] = _Registry()


def load_all() -> None:
    """Import every chapter's case library now (the fork server does, so its children inherit them)."""
    for chapter in dict.fromkeys(chapter_of(i) for i in POINTS):
        EXERCISES._load(chapter)  # type: ignore[attr-defined]


def shown_reference(exercise_id: str) -> tuple[str, ...]:
    """The reference objects of ``exercise_id`` as ``"module:qualname"``: what ``show_reference``
    prints (the chapters' ``shown`` table, reached by name); () for an id it does not list."""
    return tuple(importlib.import_module(f"{CHAPTERS_PACKAGE}.shown").SHOWN.get(exercise_id, ()))
