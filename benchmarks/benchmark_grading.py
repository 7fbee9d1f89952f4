"""How fast the graders are: one check's fixed cost, one chapter's autograde, a whole submission.

    python benchmarks/benchmark_grading.py [--out benchmarks/results/grading_<machine>.json] [--quick]

1. Per-check cost: the median wall time of ``graders.core.grade_source`` on exercise ch01.2 (a few
   tiny cases, so the time is the fixed cost: process, sandbox, transfer), with the fork server
   (``graders.forkserver``) and with a fresh process per check (``LORA_BOOK_FORKSERVER=off``, the
   design before it), each sandboxed (when bubblewrap works here) and not.
2. One chapter's autograde (01_lora_basics, one learner: the solution cells), through
   ``graders.autograde`` (nbgrader, the sandboxed kernel), and its trusted re-grade.
3. A whole submission: every chapter autograded and re-graded for that learner.
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
    from graders import forkserver, sandbox
    from graders.core import grade_source
    from graders.mutation import solution_answers

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


def submission(chapters: list[str]) -> dict:
    """Seconds to autograde and re-grade one learner's submission of ``chapters``."""
    from graders import course as jobs
    from graders.autograde import autograde
    from graders.mutation import sample_learner

    answers = sample_learner("all_correct")
    course = Path(tempfile.mkdtemp(prefix="bench-course-")) / "course"
    jobs._new_course(course)
    os.environ[jobs.SECRET_ENV] = "benchmark-secret"
    rows = {}
    for chapter in chapters:
        jobs._nbgrader(course, "generate_assignment", chapter, "--force")
        release = course / "release" / chapter / f"{chapter}.ipynb"
        mine = {e: s for e, s in answers.items() if e[2:4] == chapter[:2]}
        jobs.build_submission(release, mine, course / "submitted" / "learner" / chapter / f"{chapter}.ipynb")
        start = time.perf_counter()
        run = autograde(course, chapter, jobs=1, progress=False)
        graded = time.perf_counter() - start
        assert not run.errors["learner"], run.errors["learner"]
        start = time.perf_counter()
        scores, _ = jobs.trusted_regrade(course, chapter, "benchmark-secret")
        regraded = time.perf_counter() - start
        full = all(scores["learner"][e] == jobs.total_points(e) for e in mine)
        rows[chapter] = {"autograde_s": graded, "regrade_s": regraded, "exercises": len(mine),
                         "full_marks": full, "sandboxed": run.sandboxed}
        print(f"  {chapter}: autograde {graded:.1f} s, re-grade {regraded:.1f} s", flush=True)
    return rows


def throughput(chapter: str, students: int, jobs_list: tuple[int, ...]) -> dict:
    """Seconds to autograde ``students`` submissions of ``chapter`` with each number of workers."""
    from graders import course as jobs
    from graders.autograde import autograde
    from graders.mutation import sample_learner

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
    from graders.course import chapters

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
    print("\nsubmission of one learner (all answers correct):")
    sub = submission(names)
    total = sum(r["autograde_s"] + r["regrade_s"] for r in sub.values())
    save(submission=sub, submission_total_s=total, chapters=names)
    print(f"\n{'chapter':24}{'autograde s':>12}{'re-grade s':>12}")
    for ch, r in sub.items():
        print(f"{ch:24}{r['autograde_s']:>12.1f}{r['regrade_s']:>12.1f}")
    print(f"{'whole submission':24}{total:>24.1f}")
    print("\nparallel autograde:")
    par = throughput(names[0], 4, (1, max(2, min(4, os.cpu_count() or 1))))
    one, many = par["jobs 1"]["wall_s"], list(par.values())[-1]["wall_s"]
    per_hour = 3600 / (total * many / one)
    print(f"speed-up with {list(par)[-1]}: {one / many:.2f}x; whole submissions graded per hour on this "
          f"machine, estimated: {per_hour:.0f}")
    save(parallel=par, speedup=one / many, submissions_per_hour_estimate=per_hour)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
