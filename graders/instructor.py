"""The instructor's whole grading run of one assignment (``python -m graders.course grade``).

In order, and refusing to start when learner code would run unsandboxed (unless ``unsandboxed``):

1. record the fingerprint of the graders' own files (``graders.integrity``) in the course folder;
2. autograde every submission in ``jobs`` parallel sandboxed workers (``graders.autograde``);
3. confirm that no process of the autograde run is left (every kernel and everything it started
   lived in a sandbox that dies with its nbgrader worker; this checks it);
4. the trusted re-grade (``graders.course.trusted_regrade``: every answer cell re-run in a sandboxed
   child whose cases were built here from the secret; the graders' fingerprint compared before
   and after; every gradebook field learner code could have touched checked and corrected);
5. feedback and export (nbgrader), so the recorded grades are the ones printed.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from graders import sandbox

__all__ = ["grade_assignment", "leftover_processes"]


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


def grade_assignment(course: Path, assignment: str, jobs: int = 1, db_url: Optional[str] = None,
                     unsandboxed: bool = False, secret: Optional[str] = None) -> dict:
    """Steps 1-5 of the module docstring for ``assignment`` of ``course``.

    Returns:
        {"scores": {student: {exercise: points}}, "findings": [...], "autograde": AutogradeRun,
         "sandbox": one line, "seconds": {step: seconds}}.
    Raises:
        graders.sandbox.SandboxUnavailable: bubblewrap cannot run and ``unsandboxed`` is False.
        graders.course.CourseError: not a course folder, unknown assignment, no submissions, a
            learner process left running, or the graders' files changed during grading.
    """
    from graders import course as jobs_mod
    from graders import forkserver
    from graders.autograde import autograde

    os.environ[sandbox.MODE_ENV] = "auto" if unsandboxed else "required"
    sandbox.enabled()  # refuse now, before anything is written
    course = Path(course).resolve()
    if not (course / "nbgrader_config.py").exists():
        raise jobs_mod.CourseError(f"{course} is not an nbgrader course folder (no nbgrader_config.py)")
    secret = secret or os.environ.get(jobs_mod.SECRET_ENV)
    forkserver.hide(course)
    seconds = {}
    start = time.perf_counter()
    jobs_mod.write_fingerprint(course)
    env = dict(os.environ)
    run = autograde(course, assignment, jobs=jobs, db_url=db_url, env=env)
    seconds["autograde"] = time.perf_counter() - start
    failed = {s: e for s, e in run.errors.items() if e}
    if failed:
        raise jobs_mod.CourseError(f"nbgrader autograde failed for {', '.join(sorted(failed))}: "
                                   + next(iter(failed.values()))[-600:])
    left = leftover_processes(run.work_folder)
    if left:
        raise jobs_mod.CourseError("processes of the autograde run are still running (grades not "
                                   "recorded): " + "; ".join(left[:5]))
    start = time.perf_counter()
    scores, findings = jobs_mod.trusted_regrade(course, assignment, secret)
    seconds["re-grade"] = time.perf_counter() - start
    start = time.perf_counter()
    jobs_mod._nbgrader(course, "generate_feedback", assignment, "--force")
    jobs_mod._nbgrader(course, "export")
    seconds["feedback and export"] = time.perf_counter() - start
    return {"scores": scores, "findings": findings, "autograde": run, "sandbox": sandbox.describe(),
            "seconds": seconds}
