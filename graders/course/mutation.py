"""Mutation testing of the graders: realistic wrong answers, written as small edits of the chapters'
own solution cells.

A grader is only as good as the wrong answers it rejects. Each exercise keeps a catalogue of
mutants in ``tests/mutants/chNN.py`` (a list ``MUTANTS`` of :class:`Mutant`): the chapter's solution
cell with one realistic change, given as find/replace pairs applied at test time, so the catalogue
never repeats a solution and never goes stale when one changes (an edit whose text is no longer in
the solution fails loudly). ``tests/test_mutants.py`` grades every mutant under three secrets (two
on a machine without CUDA) and requires that it loses points under each, the same points under
each, and that the visible report names the mistake. The sample learners of ``make demo`` are
built the same way: ``all_correct`` is the solution cells, ``plausible_mistakes`` the mutants marked
``plausible``.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import nbformat

__all__ = ["Mutant", "apply_edits", "solution_answers", "load_catalogue", "sample_learner", "graded_source",
           "CATALOGUE_DIR", "SAMPLE_LEARNERS"]

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE_DIR = ROOT / "tests" / "mutants"
SAMPLE_LEARNERS = ("all_correct", "plausible_mistakes")
_ANSWER_ID = re.compile(r"^(ch\d\d_\d+)_answer$")
_MARKER_LINE = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*(\n|\Z)", re.M)


@dataclass(frozen=True)
class Mutant:
    """One wrong answer: the solution cell of ``exercise`` with ``edits`` applied.

    Attributes:
        exercise: exercise id, e.g. ``"ch03.1"``.
        name: short slug, unique within the exercise (``"no-k-loop"``).
        edits: ``(old, new)`` pairs; each ``old`` must occur exactly once in the solution cell.
        expect: a phrase the grader's visible report must contain (the hint, the differing field, the
            error): proof that the report names this mistake and not a wrong cause.
        kind: the contract clause or case family that should catch it: ``tiling``, ``layout``,
            ``poison``, ``error``, ``clause``, ``dtype``, ``device`` (a tensor made off the inputs'
            device), ``device-read``, ``state``, ``math``.
        plausible: part of the ``plausible_mistakes`` sample learner (at most one per exercise, and
            only an edit of the exercise's own cell).
        part: for an exercise that runs other exercises' answers too (``Exercise.needs``, chapter 11's
            capstone), the needed exercise whose solution cell ``edits`` change (its own cell stays
            the solution); None: the exercise's own cell.
    """

    exercise: str
    name: str
    edits: tuple[tuple[str, str], ...]
    expect: str
    kind: str
    plausible: bool = False
    part: Optional[str] = None

    @property
    def id(self) -> str:
        return f"{self.exercise}-{self.name}"


def apply_edits(source: str, edits, label: str = "") -> str:
    """``source`` with every ``(old, new)`` replaced once.

    Raises:
        ValueError: an ``old`` occurs zero times or more than once (the solution changed: update the
            mutant).
    """
    for old, new in edits:
        count = source.count(old)
        if count != 1:
            raise ValueError(f"{label}: edit target occurs {count} times in the solution cell "
                             f"(expected once): {old!r}")
        source = source.replace(old, new)
    return source


def graded_source(exercise_id: str, solutions: dict[str, str], mutant: Optional[Mutant] = None) -> str:
    """What the grader takes for ``exercise_id`` from the solution cells ``solutions`` (with
    ``mutant``'s edits applied to the cell it names): the exercise's cell, or for an exercise with
    needs its answer bundle (``graders.machine.needs``).

    Raises:
        ValueError: an edit whose target is not in its cell exactly once; a ``part`` the exercise
            does not need.
    """
    from graders.machine.needs import bundle, needs_of

    cells = {ex: solutions[ex] for ex in (*needs_of(exercise_id), exercise_id)}
    if mutant is not None:
        target = mutant.part or exercise_id
        if target not in cells:
            raise ValueError(f"{mutant.id}: part {target!r} is not a cell {exercise_id} runs")
        cells[target] = apply_edits(cells[target], mutant.edits, mutant.id)
    own = cells.pop(exercise_id)
    return bundle(exercise_id, own, cells) if cells else own


def solution_answers(notebooks: Path = ROOT / "notebooks") -> dict[str, str]:
    """Every exercise's solution cell, keyed by id: the source notebook's answer cell with the
    ``### BEGIN/END SOLUTION`` marker lines removed (what a learner who solved it would have)."""
    answers: dict[str, str] = {}
    for path in sorted(notebooks.glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            m = _ANSWER_ID.match(cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", ""))
            if m:
                answers[m.group(1).replace("_", ".")] = _MARKER_LINE.sub("", cell.source) + "\n"
    return answers


def load_catalogue(folder: Path = CATALOGUE_DIR) -> list[Mutant]:
    """Every mutant of ``folder/ch*.py`` (each module defines ``MUTANTS``), in file order."""
    mutants: list[Mutant] = []
    for path in sorted(folder.glob("ch[0-9][0-9].py")):
        spec = importlib.util.spec_from_file_location(f"_mutants_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        mutants += module.MUTANTS
    ids = [m.id for m in mutants]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise ValueError(f"mutant ids must be unique: {duplicated}")
    return mutants


def sample_learner(name: str, notebooks: Path = ROOT / "notebooks", folder: Path = CATALOGUE_DIR) -> dict[str, str]:
    """The answers of a built-in sample learner, keyed by exercise id.

    ``all_correct``: every solution cell. ``plausible_mistakes``: the solution cells with each
    ``plausible`` mutant applied (other exercises left as the stub would be: not answered).

    Raises:
        ValueError: unknown learner, or two plausible mutants for one exercise.
    """
    solutions = solution_answers(notebooks)
    if name == "all_correct":
        return solutions
    if name != "plausible_mistakes":
        raise ValueError(f"unknown sample learner {name!r}; known: {SAMPLE_LEARNERS}")
    answers: dict[str, str] = {}
    for m in load_catalogue(folder):
        if not m.plausible:
            continue
        if m.exercise in answers:
            raise ValueError(f"two plausible mutants for {m.exercise}")
        if m.part is not None:
            raise ValueError(f"{m.id}: a plausible mutant edits its exercise's own cell (this one edits {m.part})")
        answers[m.exercise] = apply_edits(solutions[m.exercise], m.edits, m.id)
    # exercises without a plausible mistake are answered correctly, as a real learner would
    return {ex: answers.get(ex, src) for ex, src in solutions.items()}
