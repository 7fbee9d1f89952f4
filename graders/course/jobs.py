"""The book's course jobs (``python -m graders.course COMMAND``).

    demo       the main job: generate the learner version of every chapter with nbgrader, build the
               sample learners into the release (all_correct: the solution cells; plausible_mistakes:
               the catalogue's plausible mutants, graders.course.mutation; and every
               submissions/<learner>/<chapter>.py, e.g. broken_code), autograde
               them, re-grade every answer cell outside the learner's kernel (trusted scores go into
               the gradebook; every mismatch is reported), generate feedback, print the score table.
    learner    self-study: write the learner version of every chapter into --out (default learner/);
               notebooks already there are kept, so a learner's work is never overwritten.
    grade      for instructors: the whole grading run of one assignment of a real course
               (graders.course.instructor): fingerprint of the graders, autograde in --jobs parallel
               sandboxed workers, the trusted re-grade, feedback, export. Refuses to run learner
               code unsandboxed unless --unsandboxed.
    verify     for instructors: the trusted re-grade of an autograded assignment (part of grade).
    fingerprint  record the graders' files before an autograde run by other means; verify checks them.

Threat model (README): a test cell's score comes from inside the learner's kernel, where a
top-level patch of ``graders`` can forge it. The re-grade here runs each answer cell in a child
process and compares in this process, which never runs learner code.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import nbformat

from graders.course.integrity import check_fingerprint, fingerprint, package_roots
from graders.course.mutation import SAMPLE_LEARNERS, sample_learner
from graders.course.tamper import suspicious_code
from graders.machine.core import SECRET_ENV, grade_source, triton_cache_scope
from graders.machine.points import POINTS, total_points
from graders.machine.sandbox import FINGERPRINT_NAME

__all__ = ["run_demo", "trusted_regrade", "build_submission", "parse_answers", "answer_cells", "chapters", "CourseError",
           "GradersChanged", "Mismatch", "LookAtThis", "Ungraded", "NotAutograded", "GradebookFix", "write_fingerprint", "FINGERPRINT_FILE"]

ROOT = Path(__file__).resolve().parents[2]
DEMO_SECRET = "demo-hidden-secret"
_ANSWER_ID = re.compile(r"^(ch\d\d_\d+)_answer$")
_MARKER = re.compile(r"^# %% (ch\d\d\.\d+)\s*$", re.M)


def chapters(notebooks: Path = ROOT / "notebooks") -> list[str]:
    """Assignment names: the chapter folders that hold a notebook of the same name."""
    return sorted(p.name for p in notebooks.iterdir() if (p / f"{p.name}.ipynb").exists())


def exercise_of(cell) -> str | None:
    """``ch02.3`` for the answer cell of exercise ch02.3, else None."""
    m = _ANSWER_ID.match(cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", ""))
    return m.group(1).replace("_", ".") if m else None


def answer_cells(nb) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(answers, impostors) of a submitted notebook: ``answers`` is one ``(exercise, source)`` per
    exercise, from the first code cell nbgrader tracks as that exercise's answer (``solution: true``
    and its grade_id: nbgrader's DeduplicateIds keeps one such cell per id); ``impostors`` are the
    other cells that carry an answer's grade_id, ``(exercise, why)``, never graded: a learner could
    otherwise add any number of cells with an answer's id, each costing a full check, the last one's
    score recorded in place of the answer's."""
    answers: dict[str, str] = {}
    impostors: list[tuple[str, str]] = []
    for i, cell in enumerate(nb.cells):
        ex = exercise_of(cell)
        if ex is None:
            continue
        tracked = cell.get("cell_type") == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("solution") is True
        if tracked and ex not in answers:
            answers[ex] = str(cell.source)
        else:
            why = "a second cell" if tracked else "a cell nbgrader does not track as an answer"
            impostors.append((ex, f"cell {i}: {why} carries the grade_id of {ex}'s answer cell; not graded "
                                  "(look at this)"))
    return list(answers.items()), impostors


def parse_answers(text: str) -> dict[str, str]:
    """Answers of one submission file, keyed by exercise id: the text under each ``# %% chNN.M``."""
    parts = _MARKER.split(text)
    return {ex: body.strip("\n") + "\n" for ex, body in zip(parts[1::2], parts[2::2])}


def build_submission(release_nb: Path, answers: dict[str, str], dest: Path) -> None:
    """Write the release notebook with its answer cells replaced by ``answers`` (others kept)."""
    nb = nbformat.read(release_nb, as_version=4)
    for cell in nb.cells:
        ex = exercise_of(cell)
        if ex in answers:
            cell.source = answers[ex]
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)


def _nbgrader(course: Path, *args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "nbgrader", *args, "--log-level=ERROR"]
    env = dict(env or os.environ)
    # nbgrader runs `alembic` (and kernels run `python`) from PATH: the environment's bin first
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run(cmd, cwd=course, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _new_course(course: Path) -> None:
    if course.exists():
        shutil.rmtree(course)
    course.mkdir(parents=True)
    shutil.copytree(ROOT / "notebooks", course / "notebooks")
    shutil.copy(ROOT / "nbgrader_config.py", course / "nbgrader_config.py")


# ---------------------------------------------------------------------------------------------
# The trusted re-grade


class CourseError(ValueError):
    """verify (or fingerprint) cannot run on this input; nothing was changed. The message is one line."""


class GradersChanged(CourseError):
    """The graders' files differ from the fingerprint recorded before autograde; nothing was recorded."""

    def __init__(self, differences: list[str], when: str) -> None:
        self.differences = differences
        super().__init__(f"the graders' files changed during grading ({when}): " + "; ".join(differences)
                         + "; nothing was recorded")


#: Written into the course folder by ``python -m graders.course fingerprint`` (before autograde); the
#: sandbox hides it (one name, kept in graders.machine.sandbox, which knows no course job).
FINGERPRINT_FILE = FINGERPRINT_NAME
_TEST_ID = re.compile(r"^(ch\d\d_\d+)_test$")


@dataclass
class Mismatch:
    """A test cell whose score in the learner's kernel differs from the trusted re-grade."""

    student: str
    exercise: str
    kernel: float
    trusted: float

    def __str__(self) -> str:
        # A sandboxed kernel has no secret: its cells draw the hidden group from the public seed, so
        # an answer that fails only the secret's hidden cases scores higher there, honestly.
        why = ("higher than the re-grade: an answer that fails only the secret's hidden cases (the "
               "notebook's cells grade without the secret), or a tampered kernel"
               if self.kernel > self.trusted else "lower than the answer earns on its own (e.g. the kernel died)")
        return (f"{self.student} {self.exercise}: the notebook's test cell reported {self.kernel:g}, "
                f"the re-grade outside the kernel gives {self.trusted:g} ({why}); recorded {self.trusted:g}")


@dataclass
class LookAtThis:
    """An answer cell whose code does something an exercise never needs (``graders.course.tamper``): lines
    for the instructor to read, not proof of tampering (the trusted score is what counts)."""

    student: str
    exercise: str
    lines: list[str]

    def __str__(self) -> str:
        return f"{self.student} {self.exercise}:" + "".join(f"\n      {line}" for line in self.lines)


@dataclass
class Ungraded:
    """An answer whose grading failed in the comparing process (a bug of the graders, or a result
    they could not read): recorded as 0, the rest of the class graded as usual."""

    student: str
    exercise: str
    error: str

    def __str__(self) -> str:
        return (f"{self.student} {self.exercise}: grading this answer failed ({self.error}); recorded 0 "
                "(look at the answer; re-run verify once the cause is fixed)")


@dataclass
class NotAutograded:
    """A submission nbgrader's autograde failed on (a notebook that is not JSON, a cell past the
    execution timeout, output the kernel could not deliver), or that ``grade`` refused before it (a
    link or special file in the submission folder): that student's assignment gets no
    autograded notebook and its test cells are recorded 0; every other submission is graded."""

    student: str
    assignment: str
    error: str

    def __str__(self) -> str:
        lines = [line.strip() for line in self.error.splitlines() if line.strip()]
        # the last exception line of nbgrader's traceback (CellTimeoutError: ..., NotJSONError: ...)
        raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Timeout)\w*:", line)]
        cause = raised[-1] if raised else (lines[-1] if lines else "no output")
        return (f"{self.student} {self.assignment}: this submission was not autograded "
                f"({cause[:300]}); its test cells recorded as 0 (look at the submission; fix it and grade again)")


@dataclass
class GradebookFix:
    """A gradebook field the graders did not write (learner code can edit gradebook.db), as found
    and as verify corrected it."""

    student: str
    exercise: str
    what: str

    def __str__(self) -> str:
        who = "every student" if self.student == ALL_STUDENTS else f"student {self.student}"
        return f"{who} {self.exercise}: {self.what}"


#: GradebookFix.student of a field every submission shares (a cell's max_score).
ALL_STUDENTS = "*"


def _course_settings(course: Path, assignment: str, need_autograded: bool = True) -> dict:
    """The course's nbgrader settings verify needs, after checking the course can be verified
    (``need_autograded`` False: can be graded, before autograde).

    Raises:
        CourseError: no nbgrader_config.py or gradebook, an assignment unknown to the gradebook or
            without a source folder, no autograded submissions of it (when ``need_autograded``).
            Nothing is written.
    """
    config_file = course / "nbgrader_config.py"
    if not config_file.is_file():
        raise CourseError(f"{course} is not an nbgrader course folder (no nbgrader_config.py); "
                          f"pass the course root with --course-dir")
    from traitlets.config.loader import PyFileConfigLoader

    try:
        cd = PyFileConfigLoader(config_file.name, path=str(course)).load_config().CourseDirectory
    except Exception as e:  # a broken config file: say so in one line
        raise CourseError(f"cannot read {config_file}: {type(e).__name__}: {e}".splitlines()[0]) from None
    get = lambda key, default: cd[key] if key in cd else default  # noqa: E731
    settings = {"source": course / get("source_directory", "source"),
                "autograded": course / get("autograded_directory", "autograded"),
                "feedback": course / get("feedback_directory", "feedback"),
                "course_id": get("course_id", "default_course"),
                "db_url": get("db_url", "") or f"sqlite:///{(course / 'gradebook.db').resolve()}"}
    db_url = settings["db_url"]
    if db_url.startswith("sqlite:///"):
        db = Path(db_url[len("sqlite:///"):])
        db = db if db.is_absolute() else (course / db).resolve()  # nbgrader runs in the course root
        settings["db_url"] = f"sqlite:///{db}"
        if not db.is_file():
            raise CourseError(f"no gradebook at {db} (run nbgrader autograde {assignment} in {course} first)")
        import sqlite3

        try:
            with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)) as conn:
                known = conn.execute("SELECT 1 FROM assignment WHERE name = ?", (assignment,)).fetchone()
        except sqlite3.DatabaseError as e:
            raise CourseError(f"{db} is not an nbgrader gradebook ({e})") from None
        if known is None:
            raise CourseError(f"assignment {assignment!r} is unknown to the gradebook {db} "
                              f"(a typo, or not released yet: nbgrader generate_assignment {assignment})")
    if not (settings["source"] / assignment).is_dir():
        raise CourseError(f"assignment {assignment!r} has no source folder {settings['source'] / assignment}")
    if need_autograded and not any(settings["autograded"].glob(f"*/{assignment}/*.ipynb")):
        raise CourseError(f"no autograded submissions of {assignment!r} "
                          f"({settings['autograded']}/*/{assignment}/*.ipynb): run nbgrader autograde first")
    return settings


def _recorded_fingerprint(course: Path) -> dict | None:
    """The fingerprint recorded in the course folder, or None when there is none.

    Raises:
        CourseError: the file is there but unreadable.
    """
    path = course / FINGERPRINT_FILE
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CourseError(f"cannot read the recorded fingerprint {path}: {e}") from None
    return files


def write_fingerprint(course: Path) -> Path:
    """Record the graders' fingerprint (``graders.course.integrity``) in ``course/FINGERPRINT_FILE``.

    Returns the file written. Raises CourseError when ``course`` has no nbgrader_config.py.
    """
    if not (course / "nbgrader_config.py").is_file():
        raise CourseError(f"{course} is not an nbgrader course folder (no nbgrader_config.py)")
    path = course / FINGERPRINT_FILE
    roots = {name: str(p) for name, p in package_roots().items()}
    path.write_text(json.dumps({"roots": roots, "files": fingerprint()}, indent=1) + "\n")
    return path


def _source_graded_cells(source: Path) -> dict[str, dict[str, tuple[str | None, float]]]:
    """{notebook: {grade_id: (exercise id, points)}} of the graded cells of a source folder; the
    exercise id is None for a graded cell that is not one of the book's test cells (e.g. a manually
    graded cell an instructor added)."""
    cells: dict[str, dict[str, tuple[str | None, float]]] = {}
    for path in sorted(source.glob("*.ipynb")):
        found = cells.setdefault(path.stem, {})
        for cell in nbformat.read(path, as_version=4).cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if (meta.get("grade") or meta.get("task")) and meta.get("grade_id"):
                m = _TEST_ID.match(meta["grade_id"]) if not meta.get("solution") else None
                ex = m.group(1).replace("_", ".") if m else None
                found[meta["grade_id"]] = (ex if ex in POINTS else None, float(meta.get("points", 0.0)))
    return cells


def _look_at(source: str, exercise_id: str | None = None) -> list[str]:
    """``suspicious_code(source, exercise_id)`` (the exercise's own reference used is a finding too),
    and a finding instead of an exception: the scan reads learner text in the trusted process after
    every answer was graded, so it must never stop the run."""
    try:
        return suspicious_code(source, exercise_id)
    except Exception as exc:  # noqa: BLE001
        return [f"line 1: the cell could not be checked ({type(exc).__name__}) (look at this)"]


def trusted_regrade(course: Path, assignment: str, secret: str | None = None) -> tuple[dict, list]:
    """Re-grade every answer cell of ``assignment``'s autograded submissions outside the kernel and
    check every grade of it in the gradebook.

    For every grade of the assignment (all students, notebooks and test cells) it records the
    trusted score as ``manual_score`` (which nbgrader prefers over the autograde score), resets
    ``extra_credit`` to 0, ``needs_manual_grade`` to False, a negative late penalty to 0 and an
    ``auto_comment`` nbgrader never writes to None, corrects a test cell's ``max_score`` that differs
    from graders/machine/points.py (another graded cell's: from the source notebook), removes grades of
    cells that are not graded cells of the source notebook and sets to 0 the max_score of such a
    cell; each correction is a finding. Grades
    of graded cells that are not the book's test cells (an instructor's manually graded cells) are
    left as they are. The graders' files are compared with ``course/FINGERPRINT_FILE`` (recorded
    before autograde) before and after the re-grade.

    Returns:
        ({student: {exercise: trusted score}}, findings): LookAtThis (answer cells whose code does
        something an exercise never needs), GradebookFix (fields the graders did not write, as
        corrected), then Mismatch (kernel score != trusted score).

    Raises:
        CourseError: not a course folder, no gradebook, an unknown assignment, no source folder,
            no autograded submissions, or no recorded fingerprint; nothing is written.
        GradersChanged: the graders' files differ from the recorded fingerprint before or after
            the re-grade; nothing is written.
    """
    from nbgrader.api import Gradebook, MissingEntry

    course = Path(course)
    settings = _course_settings(course, assignment)
    recorded = _recorded_fingerprint(course)
    if recorded is None:
        # without it, learner code that ran unsandboxed (a plain nbgrader autograde) could have
        # rewritten the graders on disk, and the re-grade would run the rewritten ones
        raise CourseError(f"no fingerprint of the graders recorded in {course / FINGERPRINT_FILE}: nothing "
                          "shows the graders were not changed during autograde; run `python -m graders.course "
                          "fingerprint` before autograde (then autograde and verify), or `python -m graders.course "
                          "grade`, which does both")
    if diff := check_fingerprint(recorded):
        raise GradersChanged(diff, "found before verify's re-grade")
    graded_cells = _source_graded_cells(settings["source"] / assignment)
    from graders.machine import forkserver
    from graders.machine.needs import with_needed

    forkserver.hide(course)  # the re-grade's children (sandboxed) see no gradebook, no submission

    jobs = []
    unreadable: list[Ungraded] = []
    impostors: list[LookAtThis] = []
    for nb_path in sorted(settings["autograded"].glob(f"*/{assignment}/*.ipynb")):
        student = nb_path.parts[-3]
        try:
            nb = nbformat.read(nb_path, as_version=4)
            answers, extra = answer_cells(nb)
            jobs += [(student, nb_path.stem, ex, source) for ex, source in answers]
            grouped: dict[str, list[str]] = {}
            for ex, why in extra:  # one finding per exercise, however many cells pose as its answer
                grouped.setdefault(ex, []).append(why)
            impostors += [LookAtThis(student, ex, whys[:5] + ([f"... and {len(whys) - 5} more such cells "
                                                              "(look at this)"] if len(whys) > 5 else []))
                          for ex, whys in grouped.items()]
        except Exception as exc:  # noqa: BLE001 (its test cells are recorded 0 below)
            unreadable.append(Ungraded(student, nb_path.stem, f"the autograded notebook cannot be read: "
                                       f"{type(exc).__name__}: {str(exc)[:200]}"))
    env_secret = {SECRET_ENV: secret} if secret else {}
    old = {k: os.environ.get(k) for k in env_secret}
    os.environ.update(env_secret)
    try:
        caches = Path(tempfile.mkdtemp(prefix="lora-book-regrade-triton-"))

        def grade(job):
            try:
                with triton_cache_scope(caches / f"s{students.index(job[0])}"):
                    # an exercise that runs other answers too (ch11.5) gets them from the same notebook
                    return grade_source(job[2], with_needed(job, jobs)).score
            except Exception as exc:  # noqa: BLE001 (one answer never stops the class's grading)
                ungraded.append(Ungraded(job[0], job[2], f"{type(exc).__name__}: {str(exc)[:300]}"))
                return 0.0

        students = sorted({j[0] for j in jobs})
        ungraded: list[Ungraded] = list(unreadable)
        try:
            # one worker per core: on a GPU each check is a fresh process that waits on imports and
            # Triton compiles more than on the device
            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                results = list(pool.map(grade, jobs))
        finally:
            shutil.rmtree(caches, ignore_errors=True)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    if diff := check_fingerprint(recorded):
        raise GradersChanged(diff, "found after verify's re-grade")

    look = impostors + [LookAtThis(student, ex, lines) for student, _, ex, source in jobs
                        if (lines := _look_at(source, ex))]
    trusted = {(student, notebook, ex): score for (student, notebook, ex, _), score in zip(jobs, results)}
    autograded = {(student, notebook) for student, notebook, _, _ in jobs}
    scores: dict[str, dict[str, float]] = {}
    fixes: list[GradebookFix] = []
    mismatches: list[Mismatch] = []
    with Gradebook(settings["db_url"], course_id=settings["course_id"]) as gb:
        try:
            db_assignment = gb.find_assignment(assignment)
        except MissingEntry:
            raise CourseError(f"assignment {assignment!r} is unknown to the gradebook") from None
        # the cells every submission is graded on (max_score lives on the cell, shared by all students)
        for nb in db_assignment.notebooks:
            source_cells = graded_cells.get(nb.name, {})
            for cell in [*nb.grade_cells, *nb.task_cells]:
                if cell.name not in source_cells:
                    if cell.max_score:
                        fixes.append(GradebookFix(ALL_STUDENTS, f"{nb.name}/{cell.name}",
                                                  "a graded cell that is not in the source notebook, "
                                                  f"max_score {cell.max_score:g}; set to 0"))
                        cell.max_score = 0.0
                    continue
                ex, points = source_cells[cell.name]
                want = total_points(ex) if ex is not None else points
                if cell.max_score != want:
                    fixes.append(GradebookFix(ALL_STUDENTS, ex or f"{nb.name}/{cell.name}",
                                              f"max_score {cell.max_score:g} in the gradebook, "
                                              f"{'graders/machine/points.py' if ex else 'the source notebook'} gives "
                                              f"{want:g}; corrected"))
                    cell.max_score = want
        submitted = set()
        for sub in gb.assignment_submissions(assignment):
            student = sub.student.id
            for snb in sub.notebooks:
                submitted.add((student, snb.name))
                source_cells = graded_cells.get(snb.name, {})
                expected = {name: ex for name, (ex, _) in source_cells.items() if ex is not None}
                if (student, snb.name) not in autograded:
                    fixes.append(GradebookFix(student, snb.name, "in the gradebook but no autograded notebook "
                                              "to re-grade; its test cells recorded as 0 (re-run autograde)"))
                if snb.late_submission_penalty is not None and snb.late_submission_penalty < 0:
                    fixes.append(GradebookFix(student, snb.name, f"late_submission_penalty "
                                              f"{snb.late_submission_penalty:g} (a bonus) in the gradebook; reset to 0"))
                    snb.late_submission_penalty = 0.0
                seen = set()
                for grade in list(snb.grades):
                    name = grade.cell.name
                    if name not in source_cells or grade.cell.type not in ("GradeCell", "TaskCell"):
                        fixes.append(GradebookFix(student, f"{snb.name}/{name}", "a grade of a cell that is not a "
                                                  f"graded cell of the source notebook (score {grade.score or 0:g}); "
                                                  "removed"))
                        gb.db.delete(grade)
                        continue
                    ex = expected.get(name)
                    if ex is None:
                        continue  # an instructor's own manually graded cell: not the graders' to judge
                    seen.add(name)
                    score = trusted.get((student, snb.name, ex), 0.0)
                    scores.setdefault(student, {})[ex] = score
                    if grade.auto_score != score:
                        mismatches.append(Mismatch(student, ex, float(grade.auto_score or 0.0), score))
                    if grade.manual_score is not None and grade.manual_score != score:
                        fixes.append(GradebookFix(student, ex, f"manual_score {grade.manual_score:g} in the gradebook, "
                                                  f"not given by the graders; recorded {score:g}"))
                    if grade.extra_credit:
                        fixes.append(GradebookFix(student, ex, f"extra_credit {grade.extra_credit:g} in the "
                                                  "gradebook, not given by the graders; reset to 0"))
                    if grade.needs_manual_grade:
                        fixes.append(GradebookFix(student, ex, "marked as needing manual grading in the "
                                                  "gradebook; the trusted score is recorded instead"))
                    grade.manual_score, grade.extra_credit, grade.needs_manual_grade = score, 0.0, False
                for name in sorted(set(expected) - seen):
                    fixes.append(GradebookFix(student, expected[name] or name, "no grade in the gradebook for this "
                                              "test cell (re-run autograde)"))
                for comment in snb.comments:
                    if comment.auto_comment not in (None, "", "No response."):
                        fixes.append(GradebookFix(student, f"{snb.name}/{comment.cell.name}",
                                                  f"auto_comment {comment.auto_comment[:60]!r} that nbgrader "
                                                  "never writes; cleared"))
                        comment.auto_comment = None
        for student, notebook in sorted(autograded - submitted):
            fixes.append(GradebookFix(student, notebook, "autograded notebook with no submission in the "
                                      "gradebook; nothing recorded (re-run autograde)"))
            for (s, nb_name, ex), score in trusted.items():
                if (s, nb_name) == (student, notebook):
                    scores.setdefault(student, {})[ex] = score
        gb.db.commit()
    return scores, [*look, *sorted(ungraded, key=lambda u: (u.student, u.exercise)), *fixes, *mismatches]


# ---------------------------------------------------------------------------------------------
# Commands


def run_demo(course: Path, submissions: Path = ROOT / "submissions", secret: str = DEMO_SECRET,
             jobs: int | None = None, only_chapters: Sequence[str] | None = None) -> dict:
    """The main job; returns {"scores": {student: {exercise: points}}, "findings": [...], ...}.

    ``jobs`` parallel autograde workers (default: one per CPU core). ``only_chapters``: chapter
    numbers ("01", "08") to run, default all (a GPU machine's test run splits the demo this way).
    Learner code runs sandboxed when bubblewrap works here (``graders.machine.sandbox``); the table says
    which.
    """
    from graders.course.autograde import autograde
    from graders.machine import forkserver, sandbox

    jobs = jobs or max(1, os.cpu_count() or 1)
    _new_course(course)
    forkserver.hide(course)
    write_fingerprint(course)
    timings: list = []
    env = dict(os.environ, **{SECRET_ENV: secret})
    built = {name: sample_learner(name) for name in SAMPLE_LEARNERS}  # edits of the solution cells
    learners = sorted([*built, *(p.name for p in submissions.iterdir() if p.is_dir())])
    scores: dict[str, dict[str, float]] = {s: {} for s in learners}
    mismatches: list[Mismatch] = []
    for chapter in chapters(course / "notebooks"):
        if only_chapters and chapter[:2] not in only_chapters:
            continue
        print(f"[{chapter}] generate_assignment", flush=True)
        _nbgrader(course, "generate_assignment", chapter, "--force", env=env)
        release = course / "release" / chapter / f"{chapter}.ipynb"
        for learner in learners:
            answers_file = submissions / learner / f"{chapter}.py"
            if learner in built:
                answers = {ex: src for ex, src in built[learner].items() if ex[2:4] == chapter[:2]}
            else:
                answers = parse_answers(answers_file.read_text()) if answers_file.exists() else {}
            build_submission(release, answers, course / "submitted" / learner / chapter / f"{chapter}.ipynb")
        print(f"[{chapter}] autograde {len(learners)} submissions ({jobs} in parallel)", flush=True)
        run = autograde(course, chapter, jobs=jobs, env=env, progress=False)
        failed = {s: e for s, e in run.errors.items() if e}
        if failed:
            raise RuntimeError(f"autograde {chapter} failed for {', '.join(failed)}:\n" + next(iter(failed.values())))
        timings.append(run)

        cap_outputs(course, [chapter])
        print(f"[{chapter}] trusted re-grade outside the learners' kernels", flush=True)
        chapter_scores, chapter_mismatches = trusted_regrade(course, chapter, secret)
        for s, d in chapter_scores.items():
            scores[s].update(d)
        mismatches += chapter_mismatches
        _nbgrader(course, "generate_feedback", chapter, "--force", env=env)
    _nbgrader(course, "export", env=env)
    summary = {"scores": scores, "findings": [{"kind": type(m).__name__, **vars(m)} for m in mismatches],
               "course": str(course), "sandbox": sandbox.describe(),
               "autograde_seconds": {t.assignment: round(t.wall_seconds, 1) for t in timings}, "jobs": jobs}
    (course / "scores.json").write_text(json.dumps(summary, indent=1))
    print_table(scores, mismatches, course)
    print(sandbox.describe())
    return summary


def print_table(scores: dict, mismatches: list, course: Path) -> None:
    """The scores of the graded chapters only (an exercise column appears when someone's notebook of
    its chapter was graded); "-" where a learner submitted no notebook of that chapter, which is not a
    scored 0 (nbgrader's export still counts it as 0 for that assignment)."""
    graded = {e for d in scores.values() for e in d}
    exercises = sorted(graded, key=lambda e: tuple(int(p) for p in e[2:].split(".")))
    width = max([len(s) for s in scores] + [8])
    print("\nPoints per exercise (trusted re-grade); max in the header row; - = no submission of that chapter")
    print(" " * width + "".join(f"{e[2:]:>6}" for e in exercises) + f"{'total':>9}")
    print(" " * width + "".join(f"{total_points(e):>6g}" for e in exercises) + f"{sum(map(total_points, exercises)):>9g}")
    for s, d in scores.items():
        cells = "".join(f"{d[e]:>6g}" if e in d else f"{'-':>6}" for e in exercises)
        print(f"{s:<{width}}{cells}{sum(d.values()):>9g}")
    print()
    look = [m for m in mismatches if isinstance(m, LookAtThis)]
    ungraded = [m for m in mismatches if isinstance(m, Ungraded)]
    failed = [m for m in mismatches if isinstance(m, NotAutograded)]
    fixes = [m for m in mismatches if isinstance(m, GradebookFix)]
    differ = [m for m in mismatches if isinstance(m, Mismatch)]
    for heading, found in (
            ("Submissions nbgrader could not autograde (recorded 0; every other submission was graded):", failed),
            ("Answer cells to look at (what the code does, not proof of tampering):", look),
            ("Answers the re-grade could not grade (recorded 0; every other answer was graded):", ungraded),
            ("Gradebook fields the graders did not write (learner code can edit gradebook.db); corrected:", fixes),
            ("Scores that differed from the notebooks' own test cells (the trusted score is what is recorded):",
             differ)):
        if found:
            print(heading)
            for m in found:
                print("  " + str(m))
    if not differ:
        print("Every notebook test cell agreed with the trusted re-grade.")
    print(f"The graders' files matched the fingerprint recorded in {course / FINGERPRINT_FILE}, "
          "before and after the re-grade.")
    print(f"\nFeedback (HTML, one per learner and chapter): {course / 'feedback'}/<learner>/<chapter>/")
    print(f"Grades exported by nbgrader: {course / 'grades.csv'}; gradebook: {course / 'gradebook.db'}")


def write_learner_version(out: Path) -> None:
    """Generate the learner version of every chapter into ``out``, keeping notebooks already there."""
    course = ROOT / "build" / "learner-course"
    _new_course(course)
    out.mkdir(parents=True, exist_ok=True)
    for chapter in chapters(course / "notebooks"):
        _nbgrader(course, "generate_assignment", chapter, "--force", "--no-db")
        dest = out / chapter
        if (dest / f"{chapter}.ipynb").exists():
            print(f"kept {dest} (your work is never overwritten; delete it to get a fresh copy)")
            continue
        shutil.copytree(course / "release" / chapter, dest, dirs_exist_ok=True)
        _match_local_kernel(dest / f"{chapter}.ipynb")
        print(f"wrote {dest}")


def _match_local_kernel(path: Path) -> None:
    """Give a learner notebook the kernelspec and language_info that this environment's kernel
    reports. JupyterLab rewrites both from the kernel when it opens a notebook, and any difference
    (a display name, the Python patch version) marks an untouched chapter as modified, so closing
    it asks to save (jupyter/notebook#2123). Skipped when ipykernel is not installed here."""
    try:
        from ipykernel.ipkernel import IPythonKernel
        from ipykernel.kernelspec import get_kernel_dict
    except ImportError:
        return
    import nbformat

    nb = nbformat.read(path, as_version=4)
    spec = get_kernel_dict()
    nb.metadata["kernelspec"] = {"display_name": spec["display_name"], "language": spec["language"], "name": "python3"}
    nb.metadata["language_info"] = dict(IPythonKernel.language_info)
    nbformat.write(nb, path)


def cap_outputs(course: Path, assignments: Sequence[str]) -> int:
    """Cap the output bytes of every cell of the autograded notebooks of ``assignments``
    (``graders.course.output_cap``), before anything reads them for feedback; returns the cells cut."""
    from graders.course.output_cap import cap_notebook_file

    cut = 0
    for assignment in assignments:
        autograded = _course_settings(course, assignment, need_autograded=False)["autograded"]
        for path in sorted(autograded.glob(f"*/{assignment}/*.ipynb")):
            try:
                cut += cap_notebook_file(path)
            except Exception:  # noqa: BLE001 (an unreadable notebook: the re-grade reports it)
                pass
    return cut
