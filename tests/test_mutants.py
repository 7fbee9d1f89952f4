"""Mutation testing of the graders (graders.course.mutation): every exercise's solution cell gets full marks,
and every mutant of its catalogue (tests/mutants/chNN.py) loses points, the same points under any
instructor's secret (three on a GPU machine, two on the CPU: ``SECRETS``), with a visible report that
names the mistake.

Tests are grouped in one class per chapter; under ``--dist loadgroup`` (tests/conftest.py) an
exercise's tests share a worker on the CPU, where the first grades them all.
"""
from __future__ import annotations

import collections

import pytest

from graders.course.mutation import graded_source, load_catalogue, solution_answers
from graders.machine.core import grade_many_under_secrets
from graders.machine.points import total_points
from graders.machine.registry import EXERCISES
from reference.device import default_device

CATALOGUE = load_catalogue()
SOLUTIONS = solution_answers()
#: Instructors' secrets: a mistake must cost the same under each. The edge and random groups are the same
#: for every secret and each secret draws its own hidden group, so equal scores say that the hidden
#: group's verdict on the mutant did not depend on which draw it got (an unlucky draw that misses it
#: shows as a difference between two secrets); the visible groups' part is asserted separately.
#: Three on a CUDA machine (the GPU run, .ci/h200, grades every mutant: on CUDA, or on the CPU for the
#: exercises graded there, with the same three); two on a machine without CUDA (CI): the hidden groups
#: are each a sixth of the case time of the costly exercises (Triton's interpreter, ranks, the capstone:
#: 1540 of the file's 1813 s on the 2-core CI machine), so the third secret cost about 200 s of CI's
#: test work, and the check stays one of independent draws. Measured per group with every mutant of an
#: exercise: ch04.2 edge 64 s, random 38 s, each hidden group 33-41 s; ch03.3 38 / 19 / 19-22 s.
_ALL_SECRETS = ("mutants-secret-one", "mutants-secret-two", "mutants-secret-three")
SECRETS = _ALL_SECRETS if default_device().type != "cpu" else _ALL_SECRETS[:2]
#: Kernel exercises (a @triton.jit answer): their catalogues must include tiling mutants (a loop or
#: a grid axis that only one tile exercised).
KERNEL_EXERCISES = sorted(e for e, ex in EXERCISES.items() if ex.requires and "triton.jit" in ex.requires[0])
KINDS = {"tiling", "layout", "poison", "error", "clause", "dtype", "device", "device-read", "state", "math"}
MIN_MUTANTS, MIN_KINDS, MIN_TILING = 4, 2, 3


def test_every_exercise_has_a_catalogue_of_different_kinds():
    by_exercise = collections.defaultdict(list)
    for m in CATALOGUE:
        assert m.exercise in EXERCISES, f"{m.id}: unknown exercise"
        assert m.part is None or m.part in EXERCISES[m.exercise].needs, f"{m.id}: part {m.part!r} is not needed"
        assert m.kind in KINDS, f"{m.id}: kind {m.kind!r} not in {sorted(KINDS)}"
        assert m.expect.strip(), f"{m.id}: name the phrase the report must contain"
        by_exercise[m.exercise].append(m)
    thin = {e: len(by_exercise[e]) for e in EXERCISES if len(by_exercise[e]) < MIN_MUTANTS}
    assert not thin, f"exercises with fewer than {MIN_MUTANTS} mutants: {thin}"
    narrow = {e: sorted({m.kind for m in ms}) for e, ms in by_exercise.items() if len({m.kind for m in ms}) < MIN_KINDS}
    assert not narrow, f"exercises whose mutants are all of one kind: {narrow}"
    for e in KERNEL_EXERCISES:
        tiling = [m.name for m in by_exercise[e] if m.kind == "tiling"]
        assert len(tiling) >= MIN_TILING, f"{e}: kernel exercise with tiling mutants {tiling}"
    plausible = collections.Counter(m.exercise for m in CATALOGUE if m.plausible)
    assert all(n == 1 for n in plausible.values()), plausible


_GRADED: dict[str, dict[str, dict]] = {}  # exercise -> source -> {secret: GradeResult}


def _grade(exercise_id: str, source: str) -> dict:
    """Results for ``source`` under every secret.

    On the CPU the first call for an exercise grades its solution and every mutant in one child
    process that forks one grandchild per source (graders.machine.core.grade_many_under_secrets), and the
    rest read the cache. On CUDA each source needs its own child anyway (a CUDA context does not
    survive a fork) and compiles its own kernels, so each test grades only its own source: batching
    there would put a whole exercise's mutants (minutes of compilation on an H200) into whichever
    test comes first and take them away from the other pytest-xdist workers.
    """
    graded = _GRADED.setdefault(exercise_id, {})
    if source not in graded:
        if default_device().type == "cpu":
            sources = [graded_source(exercise_id, SOLUTIONS)] + [graded_source(exercise_id, SOLUTIONS, m)
                                                                 for m in CATALOGUE if m.exercise == exercise_id]
        else:
            sources = [source]
        sources = list(dict.fromkeys(sources))
        graded.update(zip(sources, grade_many_under_secrets(exercise_id, sources, SECRETS)))
    return graded[source]


def _check_solution(exercise_id: str) -> None:
    results = _grade(exercise_id, graded_source(exercise_id, SOLUTIONS))
    for secret, r in results.items():
        assert r.score == total_points(exercise_id), f"secret {secret!r}:\n{r.report}"


def _check_mutant(mutant) -> None:
    source = graded_source(mutant.exercise, SOLUTIONS, mutant)
    assert source != graded_source(mutant.exercise, SOLUTIONS)
    results = _grade(mutant.exercise, source)
    scores = {secret: r.score for secret, r in results.items()}
    report = results[SECRETS[0]].report
    assert all(s < total_points(mutant.exercise) for s in scores.values()), f"{mutant.id} passed: {scores}\n{report}"
    assert len(set(scores.values())) == 1, (f"{mutant.id}: what the mistake costs depends on the secret "
                                             f"{scores}\n" + "\n---\n".join(r.report for r in results.values()))
    groups = results[SECRETS[0]].groups
    assert not (groups["edge"] and groups["random"]), f"{mutant.id}: only the hidden group catches it\n{report}"
    assert mutant.expect in report, f"{mutant.id}: the report does not name the mistake ({mutant.expect!r})\n{report}"


def _chapter_class(chapter: str) -> type:
    exercises = sorted(e for e in EXERCISES if e.startswith(chapter))
    mutants = [m for m in CATALOGUE if m.exercise.startswith(chapter)]

    @pytest.mark.parametrize("exercise_id", exercises)
    def test_solution_cell_gets_full_marks_under_every_secret(self, exercise_id):
        _check_solution(exercise_id)

    @pytest.mark.parametrize("mutant", mutants, ids=[m.id for m in mutants])
    def test_mutant_loses_the_same_points_under_every_secret_and_is_named(self, mutant):
        _check_mutant(mutant)

    return type(f"TestMutants{chapter.capitalize()}", (), {
        "test_solution_cell_gets_full_marks_under_every_secret": test_solution_cell_gets_full_marks_under_every_secret,
        "test_mutant_loses_the_same_points_under_every_secret_and_is_named": test_mutant_loses_the_same_points_under_every_secret_and_is_named,
    })


for _chapter in sorted({e[:4] for e in EXERCISES}):
    globals()[f"TestMutants{_chapter.capitalize()}"] = _chapter_class(_chapter)
