"""The instructor's whole grading run of one or several assignments (``python -m graders.course grade``).

In order, and refusing to start when learner code would run unsandboxed (unless ``unsandboxed``):

1. record the fingerprint of the graders' own files (``graders.course.integrity``) in the course folder;
2. autograde every submission in ``jobs`` parallel sandboxed workers (``graders.course.autograde``), every
   (assignment, student) notebook a job of its own, so one student's whole submission of the book
   spreads over the cores as well as a class's submissions of one chapter;
3. confirm that no process of the autograde run is left (every kernel and everything it started
   lived in a sandbox that dies with its nbgrader worker; this checks it);
4. the trusted re-grade (``graders.course.jobs.trusted_regrade``: every answer cell re-run in a sandboxed
   child whose cases were built here from the secret; the graders' fingerprint compared before
   and after; every gradebook field learner code could have touched checked and corrected);
5. feedback (``jobs`` assignments at a time) and export (nbgrader), so the recorded grades are the
   ones printed; before the re-grade, every cell's output is capped in the autograded notebooks
   (``graders.course.output_cap``: bytes of every output type, with a note where cut), so no feedback
   page carries more than that.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from graders.machine import sandbox

__all__ = ["grade_assignment", "grade_assignments", "leftover_processes", "prune_feedback"]


def leftover_processes(marker: str) -> list[str]:
    """Processes whose command line mentions ``marker`` (an autograde run's work folder, which every
    kernel of that run names in its connection-file path): "pid: command" lines."""
    found = []
    if not os.path.isdir("/proc"):
        return found
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{entry}: {cmd[:160]}")
    return found


def prune_feedback(course: Path, assignments: Sequence[str]) -> int:
    """Keep in ``feedback/<student>/<assignment>/`` only what feedback needs: the HTML pages and the
    files of the assignment's source folder (its figures); nbgrader copies every file of the
    submission there too. Returns the files removed."""
    from graders.course import jobs as jobs_mod

    removed = 0
    for assignment in assignments:
        settings = jobs_mod._course_settings(course, assignment, need_autograded=False)
        source = settings["source"] / assignment
        for folder in settings["feedback"].glob(f"*/{assignment}"):
            for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):
                rel = path.relative_to(folder)
                if path.is_dir() and not path.is_symlink():
                    if not any(path.iterdir()):
                        path.rmdir()
                elif not (path.suffix == ".html" and len(rel.parts) == 1) and not (
                        (source / rel).is_file() and not (source / rel).is_symlink()):
                    path.unlink()
                    removed += 1
    return removed


def grade_assignment(course: Path, assignment: str, jobs: int = 1, db_url: Optional[str] = None,
                     unsandboxed: bool = False, secret: Optional[str] = None) -> dict:
    """:func:`grade_assignments` of one assignment; its "autograde" entry is that assignment's
    :class:`~graders.course.autograde.AutogradeRun`."""
    done = grade_assignments(course, [assignment], jobs, db_url, unsandboxed, secret)
    return {**done, "autograde": done["autograde"][assignment]}


def grade_assignments(course: Path, assignments: Sequence[str], jobs: int = 1, db_url: Optional[str] = None,
                      unsandboxed: bool = False, secret: Optional[str] = None) -> dict:
    """Steps 1-5 of the module docstring for ``assignments`` of ``course``.

    Returns:
        {"scores": {student: {exercise: points}}, "findings": [...], "autograde": {assignment:
         AutogradeRun}, "sandbox": one line, "seconds": {step: seconds}}.
    Raises:
        graders.machine.sandbox.SandboxUnavailable: bubblewrap cannot run and ``unsandboxed`` is False.
        graders.course.jobs.CourseError: not a course folder, no secret (``LORA_BOOK_SECRET``), an
            unknown assignment, no submissions, nbgrader's autograde failing on every submission of
            an assignment (one failing submission is a :class:`~graders.course.jobs.NotAutograded`
            finding, its test cells recorded 0), a
            learner process left running, or the graders' files changed during grading. Unknown
            assignments and missing submissions are refused before anything is written or run.
    """
    from graders.course import jobs as jobs_mod
    from graders.course.autograde import autograde_many, students_of
    from graders.machine import forkserver

    os.environ[sandbox.MODE_ENV] = "auto" if unsandboxed else "required"
    sandbox.enabled()  # refuse now, before anything is written
    course = Path(course).resolve()
    if not (course / "nbgrader_config.py").exists():
        raise jobs_mod.CourseError(f"{course} is not an nbgrader course folder (no nbgrader_config.py)")
    assignments = list(dict.fromkeys(assignments))
    if not assignments:
        raise jobs_mod.CourseError("no assignment given")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise jobs_mod.CourseError(f"--jobs must be an integer >= 1, got {jobs!r}")
    for assignment in assignments:  # the same refusals as verify's, before any kernel starts
        jobs_mod._course_settings(course, assignment, need_autograded=False)
        if not students_of(course, assignment):
            raise jobs_mod.CourseError(f"no submissions of {assignment!r} under {course / 'submitted'} "
                                       "(nbgrader collect, or copy them there)")
    secret = secret or os.environ.get(jobs_mod.SECRET_ENV)
    if not secret:  # the hidden cases would come from the public default seed every learner has
        raise jobs_mod.CourseError(f"{jobs_mod.SECRET_ENV} is not set: the hidden cases would be the public "
                                   f"ones every learner can run (export {jobs_mod.SECRET_ENV}='something only "
                                   "you know')")
    forkserver.hide(course)
    seconds = {}
    start = time.perf_counter()
    jobs_mod.write_fingerprint(course)
    env = dict(os.environ)
    runs = autograde_many(course, assignments, jobs=jobs, db_url=db_url, env=env)
    seconds["autograde"] = time.perf_counter() - start
    # one submission nbgrader cannot autograde (not JSON, a cell past the timeout, a flood of output)
    # costs that student's assignment only: a finding, its test cells recorded 0 by the re-grade
    not_autograded = [jobs_mod.NotAutograded(s, a, e) for a, run in runs.items()
                      for s, e in sorted(run.errors.items()) if e]
    for assignment, run in runs.items():
        if run.errors and all(run.errors.values()):  # nothing to re-grade: the cause is not one learner's
            raise jobs_mod.CourseError(f"nbgrader autograde failed for every submission of {assignment}: "
                                       + next(iter(run.errors.values()))[-600:])
    work_folder = next(iter(runs.values())).work_folder
    left = leftover_processes(work_folder)
    if left:
        raise jobs_mod.CourseError("processes of the autograde run are still running (grades not "
                                   "recorded): " + "; ".join(left[:5]))
    jobs_mod.cap_outputs(course, assignments)
    start = time.perf_counter()
    scores: dict[str, dict[str, float]] = {}
    findings: list = list(not_autograded)
    for assignment in assignments:
        part, found = jobs_mod.trusted_regrade(course, assignment, secret)
        for student, marks in part.items():
            scores.setdefault(student, {}).update(marks)
        findings += found
    seconds["re-grade"] = time.perf_counter() - start
    start = time.perf_counter()
    autograded = jobs_mod._course_settings(course, assignments[0])["autograded"]
    if {p.name for p in autograded.glob("*/*") if p.is_dir()} <= set(assignments):
        # every assignment of the course is in this run: one nbgrader process for all of them (its
        # start, about 2 s, is most of one assignment's feedback); never for a subset, which would
        # rewrite the feedback of assignments this run did not verify
        jobs_mod._nbgrader(course, "generate_feedback", "--assignment=*", "--force")
    else:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(lambda a: jobs_mod._nbgrader(course, "generate_feedback", a, "--force"), assignments))
    prune_feedback(course, assignments)
    jobs_mod._nbgrader(course, "export")
    seconds["feedback and export"] = time.perf_counter() - start
    return {"scores": scores, "findings": findings, "autograde": runs, "sandbox": sandbox.describe(),
            "seconds": seconds}
