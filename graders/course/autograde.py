"""nbgrader autograde of one assignment, student by student, in N parallel sandboxed workers.

Each worker is an ``nbgrader autograde ASSIGNMENT --student S`` process of its own, so a course
spreads over a machine's cores, and over several machines by giving each its own share of the
students (each worker needs only the course folder and the gradebook's database URL). The notebooks
run in the sandboxed kernel (``graders.machine.kernel_sandbox``) when the sandbox is enabled, with a kernel
ipc folder of their own per worker.

The gradebook is nbgrader's: SQLite in the course folder by default, or any SQLAlchemy URL
(``db_url``, e.g. ``postgresql://user@host/course`` for a large course: SQLite takes one writer at a
time, so its workers wait on each other's commits, which ``?timeout=`` lets them do).

Before a submission is autograded, every entry of its folder is checked (:func:`unsafe_entries`):
nbgrader copies ``submitted/<student>/<assignment>/`` into ``autograded/`` as the instructor,
following links, so a link there would put any file the instructor can read into the kernel's view.
A submission holding anything but regular files and folders (a link, a fifo, a socket, a device) is
not autograded: its error says why (a ``NotAutograded`` finding of the grading run, its test cells
recorded 0) and nothing of it is copied.

Source: nbgrader's ``autograde --student`` and ``CourseDirectory.db_url`` options.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from graders.course import output_cap
from graders.machine import sandbox
from graders.machine.kernel_sandbox import KERNEL_NAME, install_kernelspec, ipc_folder

__all__ = ["AutogradeRun", "UNSAFE_ENTRY", "unsafe_entries", "autograde", "autograde_many", "configured_db_url", "default_db_url", "students_of"]

#: SQLite waits this long (seconds) for another worker's commit before "database is locked".
SQLITE_TIMEOUT_S = 120


@dataclass
class AutogradeRun:
    """What :func:`autograde` did: per student the seconds and the error (None when it worked)."""

    assignment: str
    seconds: dict[str, float]
    errors: dict[str, Optional[str]]
    sandboxed: bool
    wall_seconds: float
    jobs: int
    work_folder: str  # this run's kernelspec, ipc and runtime folders (removed when the run ends); every
    # kernel's argv names it, so leftover processes can still be found by it


def default_db_url(course: Path) -> str:
    """The course's SQLite gradebook, with a lock timeout long enough for parallel workers."""
    return f"sqlite:///{course / 'gradebook.db'}?timeout={SQLITE_TIMEOUT_S}"


def configured_db_url(course: Path) -> str:
    """The gradebook URL of the course's nbgrader_config.py (``c.CourseDirectory.db_url``, also what
    verify, feedback and export use), else :func:`default_db_url`."""
    from traitlets.config.loader import PyFileConfigLoader

    try:
        cd = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config().CourseDirectory
        url = cd["db_url"] if "db_url" in cd else ""
    except Exception:  # noqa: BLE001 (no or broken config: nbgrader itself will say so)
        url = ""
    return url or default_db_url(course)


def students_of(course: Path, assignment: str) -> list[str]:
    """Students with a submission of ``assignment`` (``submitted/<student>/<assignment>/``)."""
    return sorted(p.parent.name for p in (course / "submitted").glob(f"*/{assignment}") if p.is_dir())


#: The error of a submission refused before autograde (:func:`unsafe_entries`); the grading run's
#: finding quotes it.
UNSAFE_ENTRY = "UnsafeSubmissionError"


def unsafe_entries(course: Path, student: str, assignment: str) -> list[str]:
    """What in ``submitted/<student>/<assignment>/`` (the folders on the way included) is not a
    regular file or folder, each as "path (what it is)", relative to the course; links are never
    followed (``lstat``)."""
    import stat

    kinds = [(stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    submitted = course / _course_directory(course, "submitted")
    found = []

    def check(path: Path) -> bool:
        mode = path.lstat().st_mode
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return True
        what = next((name for test, name in kinds if test(mode)), "not a regular file or folder")
        found.append(f"{path.relative_to(course) if path.is_relative_to(course) else path} ({what})")
        return False

    top = submitted / student / assignment
    if not all(check(p) for p in (submitted / student, top)):
        return found
    for folder, dirs, files in os.walk(top):  # never follows links (followlinks=False)
        for name in sorted(dirs + files):
            check(Path(folder) / name)
    return found


def _course_directory(course: Path, key: str) -> str:
    """``c.CourseDirectory.<key>_directory`` of the course's nbgrader_config.py, else ``key``."""
    return str(sandbox.course_config(course)[0].get(f"{key}_directory") or key)


def _nbgrader_env(env: Optional[dict], jupyter_dir: Optional[Path]) -> dict:
    env = dict(env if env is not None else os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if jupyter_dir is not None:
        env["JUPYTER_PATH"] = os.pathsep.join([str(jupyter_dir), *filter(None, [env.get("JUPYTER_PATH")])])
    return env


def _ensure_students(db_url: str, students: Sequence[str]) -> None:
    """Create missing student records once, before the workers start (two workers creating rows
    at the same time would race)."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(db_url) as gb:
        for s in students:
            try:
                gb.find_student(s)
            except MissingEntry:
                gb.add_student(s)


def autograde(course: Path, assignment: str, students: Optional[Sequence[str]] = None, jobs: int = 1,
              db_url: Optional[str] = None, env: Optional[dict] = None, progress: bool = True) -> AutogradeRun:
    """Autograde ``assignment``'s submissions in ``course`` with ``jobs`` parallel workers.

    Args:
        course: the nbgrader course folder (nbgrader_config.py, source/ or the configured sources).
        students: whom to grade (default: every student with a submission).
        jobs: parallel nbgrader processes (each runs one student's notebooks, one kernel at a time).
        db_url: the gradebook (default: :func:`configured_db_url`).
        env: the environment of nbgrader (default: ours); the sandboxed kernels never get the secret.
        progress: a tqdm bar on stderr.
    Returns:
        An :class:`AutogradeRun`; a student whose autograde failed has its error text there.
    Raises:
        graders.machine.sandbox.SandboxUnavailable: the sandbox is required (``LORA_BOOK_SANDBOX=required``)
            and cannot run here.
        ValueError: no submissions of ``assignment``, or ``jobs`` < 1.
    """
    return autograde_many(course, [assignment], students, jobs, db_url, env, progress)[assignment]


def autograde_many(course: Path, assignments: Sequence[str], students: Optional[Sequence[str]] = None,
                   jobs: int = 1, db_url: Optional[str] = None, env: Optional[dict] = None,
                   progress: bool = True) -> dict[str, AutogradeRun]:
    """Autograde several assignments at once: every (assignment, student) submission is one
    ``nbgrader autograde ASSIGNMENT --student S`` job, ``jobs`` of them running at a time.

    Why pairs and not assignments one after the other: one student's whole submission of the book
    is 11 notebooks that each spend most of their 11-30 s starting a sandboxed kernel, importing
    torch and running the chapter's own demonstration cells, one core at a time; the notebooks are
    independent (each has its own ``autograded/<student>/<assignment>/`` folder and gradebook rows),
    so a 2-core machine grades two of them side by side. SQLite serialises the workers' commits
    (``SQLITE_TIMEOUT_S``); PostgreSQL runs them concurrently.

    Args:
        assignments: assignment names, each with a ``submitted/<student>/<assignment>/`` folder.
        students: whom to grade (default: every student with a submission of each assignment); a
            student without a submission of one assignment is skipped for that one.
        other arguments: as :func:`autograde`.
    Returns:
        {assignment: :class:`AutogradeRun`} in the given order; every run's ``wall_seconds`` is the
        whole call's (the assignments overlap in time) and its ``work_folder`` is shared.
    Raises:
        graders.machine.sandbox.SandboxUnavailable: as :func:`autograde`.
        ValueError: ``jobs`` < 1, no assignment given, or an assignment with no submissions (of
            ``students``); nothing is run.
    """
    from tqdm import tqdm

    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    assignments = list(dict.fromkeys(assignments))
    if not assignments:
        raise ValueError("no assignment to autograde")
    pairs: list[tuple[str, str]] = []
    for assignment in assignments:
        have = students_of(course, assignment)
        chosen = [s for s in students if s in have] if students is not None else have
        if not chosen:
            raise ValueError(f"no submissions of {assignment!r} under {course / 'submitted'}"
                             + (f" for {', '.join(students)}" if students is not None else ""))
        pairs += [(assignment, s) for s in chosen]
    db_url = db_url or configured_db_url(course)
    sandboxed = sandbox.enabled()
    work = Path(tempfile.mkdtemp(prefix="lora-book-autograde-"))
    jupyter_dir = work / "jupyter" if sandboxed else None
    if jupyter_dir is not None:
        install_kernelspec(jupyter_dir)
    run_env = _nbgrader_env(env, jupyter_dir)
    run_env["JUPYTER_RUNTIME_DIR"] = str(work / "runtime")  # connection files: named in kernels' argv
    # what every kernel hides: this course (its data even inside the checkout), never what a
    # kernel would find in the folders a submission fills
    run_env[sandbox.COURSE_ENV] = str(Path(course).resolve())
    if sandboxed:  # graded as root: the folders every kernel binds, scanned once for all kernels
        run_env.update(sandbox.share_masks(work))
    _ensure_students(db_url, sorted({s for _, s in pairs}))
    seconds: dict[str, dict[str, float]] = {a: {} for a in assignments}
    errors: dict[str, dict[str, Optional[str]]] = {a: {} for a in assignments}

    def one(assignment: str, student: str) -> None:
        unsafe = unsafe_entries(course, student, assignment)
        if unsafe:  # nbgrader would copy what a link names into autograded/: refused, nothing copied
            stale = course / _course_directory(course, "autograded") / student / assignment
            if stale.is_dir() and not stale.is_symlink():  # an earlier run's: never re-graded as this one
                shutil.rmtree(stale)
            seconds[assignment][student] = 0.0
            errors[assignment][student] = (f"{UNSAFE_ENTRY}: the submission holds what is not a regular file or "
                                           f"folder, not autograded: {'; '.join(unsafe[:5])}"
                                           + (f" and {len(unsafe) - 5} more" if len(unsafe) > 5 else ""))
            return
        # nbgrader's command with each cell's outputs capped while it runs (graders.course.output_cap:
        # run by path with -P, so the worker imports neither this package nor torch)
        cmd = [sys.executable, "-P", str(Path(output_cap.__file__)), "autograde", assignment, "--student", student,
               "--create", "--force", "--log-level=ERROR", f"--CourseDirectory.db_url={db_url}"]
        if sandboxed:
            ipc = ipc_folder(work)
            cmd += [f"--Execute.kernel_name={KERNEL_NAME}", "--KernelManager.transport=ipc",
                    f"--KernelManager.ip={ipc / 'kernel'}"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=course, env=run_env, capture_output=True, text=True)
        seconds[assignment][student] = time.perf_counter() - start
        errors[assignment][student] = None if proc.returncode == 0 else (proc.stdout[-2000:] + proc.stderr[-2000:])

    desc = f"autograde {assignments[0]}" if len(assignments) == 1 else f"autograde {len(assignments)} assignments"
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool, \
                tqdm(total=len(pairs), desc=desc, unit="notebook" if len(assignments) > 1 else "student",
                     disable=not progress, file=sys.stderr) as bar:
            for future in as_completed([pool.submit(one, a, s) for a, s in pairs]):
                future.result()
                bar.update()
    finally:  # kernelspec, connection files, sockets: nothing of the run stays in TMPDIR
        shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - start
    return {a: AutogradeRun(a, seconds[a], errors[a], sandboxed, wall, jobs, str(work)) for a in assignments}
