"""How fast the graders are: one check's fixed cost, one chapter's autograde, a whole submission.

    python benchmarks/benchmark_grading.py [--out benchmarks/results/grading_<machine>.json] [--quick]

1. Per-check cost: the median wall time of ``graders.machine.core.grade_source`` on exercise ch01.2 (a few
   tiny cases, so the time is the fixed cost: process, sandbox, transfer), with the fork server
   (``graders.machine.forkserver``) and with a fresh process per check (``LORA_BOOK_FORKSERVER=off``, the
   design before it), each sandboxed (when bubblewrap works here) and not.
2. A whole submission: one learner's answers (the solution cells) to every chapter through the
   instructor's whole grading run (``python -m graders.course grade CH01 ... CH11 --jobs N``:
   sandboxed nbgrader autograde, trusted re-grade, feedback, export), with 1 worker (one chapter
   after the other) and with one worker per core (chapters side by side); per chapter its
   autograde seconds.
3. (the same run gives each chapter's autograde time)
4. Parallel autograde: 4 submissions of chapter 01 with 1 and with 2+ workers; with the whole
   submission's time this estimates how many whole submissions one machine grades per hour.
Prints a table and writes the results JSON, naming the machine (CPU count, model, GPU if any).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpus": os.cpu_count(), "cpu": cpu, "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__}


def per_check(repeats: int) -> dict:
    """Median seconds of one check of ch01.2 per (fork server on/off, sandbox on/off)."""
    from graders.course.mutation import solution_answers
    from graders.machine import forkserver, sandbox
    from graders.machine.core import grade_source

    source = solution_answers()["ch01.2"]
    rows = {}
    for server in ("on", "off"):
        for box in (("auto", "off") if sandbox.available() else ("off",)):
            os.environ[forkserver.SWITCH_ENV] = server
            os.environ[sandbox.MODE_ENV] = box
            forkserver.kill_all()
            start = time.perf_counter()
            assert grade_source("ch01.2", source).score == 3  # the first check starts the server
            first = time.perf_counter() - start
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                grade_source("ch01.2", source)
                times.append(time.perf_counter() - start)
            rows[f"fork server {server}, sandbox {'on' if box == 'auto' else 'off'}"] = {
                "median_s": statistics.median(times), "first_s": first, "repeats": repeats}
    os.environ.pop(forkserver.SWITCH_ENV)
    os.environ.pop(sandbox.MODE_ENV)
    forkserver.kill_all()
    return rows


def submission(chapters: list[str], jobs_list: tuple[int, ...]) -> dict:
    """Seconds of the instructor's whole grading run (``graders.course.instructor.grade_assignments``:
    fingerprint, sandboxed autograde, trusted re-grade, feedback, export) of one learner's
    submission of ``chapters``, with each number of workers in ``jobs_list`` (a fresh course each)."""
    from graders.course.instructor import grade_assignments
    from graders.course.jobs import jobs as jobs_mod
    from graders.course.mutation import sample_learner
    from graders.machine import sandbox

    answers = sample_learner("all_correct")
    rows = {}
    for jobs in jobs_list:
        course = Path(tempfile.mkdtemp(prefix="bench-course-")) / "course"
        jobs_mod._new_course(course)
        for chapter in chapters:
            jobs_mod._nbgrader(course, "generate_assignment", chapter, "--force")
            release = course / "release" / chapter / f"{chapter}.ipynb"
            mine = {e: s for e, s in answers.items() if e[2:4] == chapter[:2]}
            jobs_mod.build_submission(release, mine, course / "submitted" / "learner" / chapter / f"{chapter}.ipynb")
        start = time.perf_counter()
        done = grade_assignments(course, chapters, jobs=jobs, unsandboxed=not sandbox.available(),
                                 secret="benchmark-secret")
        total = time.perf_counter() - start
        marks = done["scores"]["learner"]
        full = all(marks.get(e) == jobs_mod.total_points(e) for e in answers if e[2:4] in {c[:2] for c in chapters})
        rows[f"jobs {jobs}"] = {
            "total_s": total, "steps_s": done["seconds"], "full_marks": full,
            "sandboxed": next(iter(done["autograde"].values())).sandboxed,
            "autograde_s_per_chapter": {a: run.seconds["learner"] for a, run in done["autograde"].items()}}
        print(f"  {len(chapters)} chapters, {jobs} worker(s): {total:.1f} s "
              + ", ".join(f"{k} {v:.1f} s" for k, v in done["seconds"].items()), flush=True)
    return rows


def throughput(chapter: str, students: int, jobs_list: tuple[int, ...]) -> dict:
    """Seconds to autograde ``students`` submissions of ``chapter`` with each number of workers."""
    from graders.course.autograde import autograde
    from graders.course.jobs import jobs as jobs
    from graders.course.mutation import sample_learner

    answers = {e: s for e, s in sample_learner("all_correct").items() if e[2:4] == chapter[:2]}
    rows = {}
    for n in jobs_list:
        course = Path(tempfile.mkdtemp(prefix="bench-course-")) / "course"
        jobs._new_course(course)
        jobs._nbgrader(course, "generate_assignment", chapter, "--force")
        release = course / "release" / chapter / f"{chapter}.ipynb"
        for i in range(students):
            jobs.build_submission(release, answers, course / "submitted" / f"s{i}" / chapter / f"{chapter}.ipynb")
        run = autograde(course, chapter, jobs=n, progress=False)
        assert not any(run.errors.values())
        rows[f"jobs {n}"] = {"wall_s": run.wall_seconds, "students": students,
                             "per_student_s": run.wall_seconds / students}
        print(f"  {students} x {chapter}, {n} workers: {run.wall_seconds:.1f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="per-check costs and chapter 01 only")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    from graders.course.jobs import chapters

    info = machine()
    print(f"machine: {info}")
    kind = "gpu" if info["gpu"] else f"cpu{info['cpus']}"
    out = args.out or ROOT / "benchmarks" / "results" / f"grading_{kind}{'_quick' if args.quick else ''}.json"
    result: dict = {"machine": info, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def save(**parts) -> None:  # after every stage: a run stopped by a time limit keeps what it measured
        result.update(parts)
        out.write_text(json.dumps(result, indent=1) + "\n")
    checks = per_check(args.repeats)
    save(per_check=checks)
    print("\nper-check cost (ch01.2, median of", args.repeats, "checks after the first)")
    print(f"{'':36}{'median s':>10}{'first s':>10}")
    for name, row in checks.items():
        print(f"{name:36}{row['median_s']:>10.3f}{row['first_s']:>10.2f}")
    names = chapters()[:1] if args.quick else chapters()
    print("\nsubmission of one learner (all answers correct), the whole grading run:")
    workers = (1, max(2, min(4, os.cpu_count() or 1)))
    sub = submission(names, workers)
    save(submission=sub, chapters=names)
    print(f"\n{'chapter':24}" + "".join(f"{'autograde s, ' + k:>22}" for k in sub))
    for ch in names:
        print(f"{ch:24}" + "".join(f"{r['autograde_s_per_chapter'][ch]:>22.1f}" for r in sub.values()))
    for k, r in sub.items():
        print(f"whole submission, {k}: {r['total_s']:.1f} s ("
              + ", ".join(f"{step} {v:.1f} s" for step, v in r["steps_s"].items()) + ")")
    save(submission_total_s={k: r["total_s"] for k, r in sub.items()})
    print("\nparallel autograde:")
    par = throughput(names[0], 4, (1, max(2, min(4, os.cpu_count() or 1))))
    one, many = par["jobs 1"]["wall_s"], list(par.values())[-1]["wall_s"]
    per_hour = 3600 / (sub["jobs 1"]["total_s"] * many / one)
    print(f"speed-up with {list(par)[-1]}: {one / many:.2f}x; whole submissions graded per hour on this "
          f"machine, estimated: {per_hour:.0f}")
    save(parallel=par, speedup=one / many, submissions_per_hour_estimate=per_hour)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
