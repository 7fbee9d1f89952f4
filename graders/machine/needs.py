"""Exercises that run other exercises' answers too: chapter 11's capstone (ch11.5) runs the learner's
ch11.1 ``block_hashes``, ch11.2 ``admit_requests`` and ch11.3 ``choose_drain`` inside the engine
beside its own answer (``Exercise.needs``).

Such an exercise is graded from an **answer bundle**: its answer cell and the answer cells it needs,
in the submission files' format (``submissions/<learner>/<chapter>.py``), one ``# %% chNN.M`` line
before each cell::

    # %% ch11.1
    <the ch11.1 answer cell>
    # %% ch11.2
    ...
    # %% ch11.5
    <the ch11.5 answer cell>

The grader's child runs each needed cell on its own, as every answer is run (its own namespace, its
own ``<answer cell chNN.M>`` file name for tracebacks), then the exercise's own cell; a needed cell
that fails, or is missing, is reported by the exercise's driver under its id, never as a crash. How
the bundle is made:

- in the learner's kernel, ``graders.check("ch11.5", engine_step, uses=(block_hashes,
  admit_requests, choose_drain))`` takes the answer cell of each function of ``uses``
  (``graders.answer_source``) and calls :func:`bundle`;
- in the trusted re-grade (``graders.course.jobs.trusted_regrade``), which grades every answer cell of a
  notebook as a job ``(student, notebook, exercise, source)``, :func:`with_needed` adds the same
  notebook's cells of the needed exercises to the job's source (an exercise without needs keeps its
  source as it is).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["bundle", "split_bundle", "with_needed", "needs_of", "PieceUnavailable"]

#: A bundle's cell marker: the submission files' ``# %% chNN.M`` line (graders.course.jobs.parse_answers).
_MARKER = re.compile(r"^# %% (ch\d\d\.\d+)[ \t]*$", re.M)


@dataclass(frozen=True)
class PieceUnavailable:
    """Stands, in the grader's child, for a needed answer that has no function to call: its cell was
    not given, raised when run, or defines no function of the exercise's name. ``message`` says which
    in the learner's terms."""

    exercise_id: str
    message: str


def needs_of(exercise_id: str) -> tuple[str, ...]:
    """The ids of the exercises whose answers ``exercise_id`` runs too (``()`` for most exercises).

    Raises:
        KeyError: unknown exercise id.
    """
    from graders.machine.registry import EXERCISES

    return EXERCISES[exercise_id].needs


def bundle(exercise_id: str, own_source: str, needed: Mapping[str, str]) -> str:
    """The answer bundle of ``exercise_id``: each needed cell of ``needed`` (id -> cell source) in the
    order of the exercise's ``needs``, then its own cell, each after its ``# %% chNN.M`` line. A
    needed id absent from ``needed`` is left out (its driver reports it missing).

    Raises:
        KeyError: unknown exercise id.
    """
    parts = [(ex, needed[ex]) for ex in needs_of(exercise_id) if ex in needed] + [(exercise_id, own_source)]
    return "".join(f"# %% {ex}\n{src.rstrip(chr(10))}\n" for ex, src in parts)


def split_bundle(exercise_id: str, text: str) -> tuple[str, dict[str, str]]:
    """``(own cell, {needed id: cell})`` of an answer bundle; inverse of :func:`bundle`.

    Text without a ``# %% <exercise_id>`` line is the exercise's own cell alone (nothing needed was
    given). Sections of other ids than the exercise's needs are ignored; of a repeated id, the last.
    Raises:
        KeyError: unknown exercise id.
    """
    needs = needs_of(exercise_id)
    parts = _MARKER.split(text)
    sections = dict(zip(parts[1::2], (body.strip("\n") + "\n" for body in parts[2::2])))
    if exercise_id not in sections:
        return text, {}
    return sections[exercise_id], {ex: sections[ex] for ex in needs if ex in sections}


def with_needed(job: Sequence, jobs: Sequence[Sequence]) -> str:
    """The source to grade for the trusted re-grade's ``job`` = ``(student, notebook, exercise,
    source)``: ``source`` itself, or for an exercise with needs, its bundle with the answer cells of
    the needed exercises from the same student's same notebook among ``jobs`` (the last of a repeated
    id, as the notebook runs them).

    Raises:
        KeyError: unknown exercise id.
    """
    student, notebook, exercise_id, source = job[:4]
    needs = needs_of(exercise_id)
    if not needs:
        return source
    needed: dict[str, str] = {}
    for s, nb, ex, src in (j[:4] for j in jobs):
        if (s, nb) == (student, notebook) and ex in needs:
            needed[ex] = src
    return bundle(exercise_id, source, needed)

