"""The book's course jobs (``python -m graders.course COMMAND``).

    demo       the main job: generate the learner version of every chapter with nbgrader, build the
               sample learners into the release (all_correct: the solution cells; plausible_mistakes:
               the catalogue's plausible mutants, graders.mutation; and every
               submissions/<learner>/<chapter>.py, e.g. broken_code), autograde
               them, re-grade every answer cell outside the learner's kernel (trusted scores go into
               the gradebook; every mismatch is reported), generate feedback, print the score table.
    learner    self-study: write the learner version of every chapter into --out (default learner/);
               notebooks already there are kept, so a learner's work is never overwritten.
    verify     for instructors: the trusted re-grade of an autograded assignment in a real course.

Threat model (README): a test cell's score comes from inside the learner's kernel, where a
top-level patch of ``graders`` can forge it. The re-grade here runs each answer cell in a child
process and compares in this process, which never runs learner code.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nbformat

from graders.core import SECRET_ENV, grade_source
from graders.mutation import SAMPLE_LEARNERS, sample_learner
from graders.points import POINTS, total_points

__all__ = ["run_demo", "trusted_regrade", "build_submission", "parse_answers", "chapters"]

ROOT = Path(__file__).resolve().parents[1]
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


@dataclass
class Mismatch:
    student: str
    exercise: str
    kernel: float
    trusted: float

    def __str__(self) -> str:
        why = ("higher than the answer earns on its own: tampering suspected"
               if self.kernel > self.trusted else "lower than the answer earns on its own (e.g. the kernel died)")
        return (f"{self.student} {self.exercise}: the notebook's test cell reported {self.kernel:g}, "
                f"the re-grade outside the kernel gives {self.trusted:g} ({why}); recorded {self.trusted:g}")


@dataclass
class Attempt:
    """An answer cell that refers to the graders: an attempt to tamper, whatever it achieved."""

    student: str
    exercise: str

    def __str__(self) -> str:
        return f"{self.student} {self.exercise}: the answer cell refers to the graders (a tampering attempt)"


_GRADERS_REF = re.compile(r"\bgraders\b")
#: What an honest answer cell may say about the graders: import them and check itself.
_HONEST_GRADERS_LINE = re.compile(r"^[ \t]*(import graders|graders\.check\(\s*[\"']ch\d\d\.\d+[\"']\s*,\s*\w+\s*\))[ \t]*$", re.M)


def refers_to_graders(source: str) -> bool:
    """True when an answer cell mentions the graders beyond importing them and checking itself."""
    return bool(_GRADERS_REF.search(_HONEST_GRADERS_LINE.sub("", source)))


def trusted_regrade(course: Path, assignment: str, secret: str | None = None) -> tuple[dict, list]:
    """Re-grade every answer cell of ``assignment``'s autograded submissions outside the kernel.

    Writes the trusted score of every exercise into the gradebook (``manual_score``, which nbgrader
    prefers over the autograde score) and returns ({student: {exercise: score}}, findings): the
    answer cells that refer to the graders, then every score that differs from the kernel's.
    """
    from nbgrader.api import Gradebook

    jobs = []
    for nb_path in sorted((course / "autograded").glob(f"*/{assignment}/*.ipynb")):
        student = nb_path.parts[-3]
        nb = nbformat.read(nb_path, as_version=4)
        jobs += [(student, nb_path.stem, ex, c.source) for c in nb.cells if (ex := exercise_of(c))]
    env_secret = {SECRET_ENV: secret} if secret else {}
    old = {k: os.environ.get(k) for k in env_secret}
    os.environ.update(env_secret)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            results = list(pool.map(lambda j: grade_source(j[2], j[3]).score, jobs))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    scores: dict[str, dict[str, float]] = {}
    mismatches = [Attempt(student, ex) for student, _, ex, source in jobs if refers_to_graders(source)]
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for (student, notebook, ex, _), trusted in zip(jobs, results):
            scores.setdefault(student, {})[ex] = trusted
            grade = gb.find_grade(ex.replace(".", "_") + "_test", notebook, assignment, student)
            if grade.auto_score != trusted:
                mismatches.append(Mismatch(student, ex, float(grade.auto_score or 0.0), trusted))
            grade.manual_score = trusted
        gb.db.commit()
    return scores, mismatches


# ---------------------------------------------------------------------------------------------
# Commands


def run_demo(course: Path, submissions: Path = ROOT / "submissions", secret: str = DEMO_SECRET) -> dict:
    """The main job; returns {"scores": {student: {exercise: points}}, "mismatches": [...], ...}."""
    _new_course(course)
    env = dict(os.environ, **{SECRET_ENV: secret})
    built = {name: sample_learner(name) for name in SAMPLE_LEARNERS}  # edits of the solution cells
    learners = sorted([*built, *(p.name for p in submissions.iterdir() if p.is_dir())])
    scores: dict[str, dict[str, float]] = {s: {} for s in learners}
    mismatches: list[Mismatch] = []
    for chapter in chapters(course / "notebooks"):
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
        print(f"[{chapter}] autograde {len(learners)} submissions", flush=True)
        _nbgrader(course, "autograde", chapter, "--create", "--force", env=env)
        print(f"[{chapter}] trusted re-grade outside the learners' kernels", flush=True)
        chapter_scores, chapter_mismatches = trusted_regrade(course, chapter, secret)
        for s, d in chapter_scores.items():
            scores[s].update(d)
        mismatches += chapter_mismatches
        _nbgrader(course, "generate_feedback", chapter, "--force", env=env)
    _nbgrader(course, "export", env=env)
    summary = {"scores": scores, "findings": [{"kind": type(m).__name__, **vars(m)} for m in mismatches],
               "course": str(course)}
    (course / "scores.json").write_text(json.dumps(summary, indent=1))
    print_table(scores, mismatches, course)
    return summary


def print_table(scores: dict, mismatches: list[Mismatch], course: Path) -> None:
    exercises = sorted(POINTS, key=lambda e: tuple(int(p) for p in e[2:].split(".")))
    width = max(len(s) for s in scores) if scores else 8
    print("\nPoints per exercise (trusted re-grade); max in the header row")
    print(" " * width + "".join(f"{e[2:]:>6}" for e in exercises) + f"{'total':>9}")
    print(" " * width + "".join(f"{total_points(e):>6g}" for e in exercises) + f"{sum(map(total_points, exercises)):>9g}")
    for s, d in scores.items():
        cells = "".join(f"{d.get(e, 0.0):>6g}" for e in exercises)
        print(f"{s:<{width}}{cells}{sum(d.values()):>9g}")
    print()
    if mismatches:
        print("Tampering attempts, and scores that differed from the notebooks' own test cells "
              "(the trusted score is what is recorded):")
        for m in mismatches:
            print("  " + str(m))
    else:
        print("Every notebook test cell agreed with the trusted re-grade.")
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
        print(f"wrote {dest}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graders.course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job: autograde the bundled submissions")
    demo.add_argument("--course-dir", type=Path, default=ROOT / "build" / "demo-course")
    learner = sub.add_parser("learner", help="write the learner version of every chapter")
    learner.add_argument("--out", type=Path, default=ROOT / "learner")
    verify = sub.add_parser("verify", help="trusted re-grade of an autograded assignment")
    verify.add_argument("assignment")
    verify.add_argument("--course-dir", type=Path, default=Path.cwd())
    args = parser.parse_args(argv)
    if args.command == "demo":
        run_demo(args.course_dir)
    elif args.command == "learner":
        write_learner_version(args.out)
    else:
        scores, mismatches = trusted_regrade(args.course_dir, args.assignment, os.environ.get(SECRET_ENV))
        print_table(scores, mismatches, args.course_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
