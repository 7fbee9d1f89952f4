"""``python -m graders.course COMMAND``: the course jobs' command line (the commands are listed in
:mod:`graders.course.jobs`, whose docstring is the ``--help`` text)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from graders.course import jobs
from graders.course.instructor import grade_assignments
from graders.course.jobs import (FINGERPRINT_FILE, ROOT, SECRET_ENV, CourseError, print_table, run_demo, trusted_regrade,
                                 write_fingerprint, write_learner_version)
from graders.machine import sandbox


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graders.course", description=jobs.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job: autograde the bundled submissions")
    demo.add_argument("--course-dir", type=Path, default=ROOT / "build" / "demo-course")
    learner = sub.add_parser("learner", help="write the learner version of every chapter")
    learner.add_argument("--out", type=Path, default=ROOT / "learner")
    grade = sub.add_parser("grade", help="the whole grading run of one or more assignments: fingerprint, "
                           "sandboxed parallel autograde, trusted re-grade, feedback, export")
    grade.add_argument("assignment", nargs="+", help="assignment names; every (assignment, student) "
                       "notebook is one autograde job")
    grade.add_argument("--course-dir", type=Path, default=Path.cwd())
    grade.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1),
                       help="parallel autograde workers (default: one per CPU core)")
    grade.add_argument("--unsandboxed", action="store_true",
                       help="grade even where bubblewrap cannot run (learner code can then read and write what you can)")
    verify = sub.add_parser("verify", help="trusted re-grade of an autograded assignment")
    verify.add_argument("assignment")
    verify.add_argument("--course-dir", type=Path, default=Path.cwd())
    verify.add_argument("--unsandboxed", action="store_true",
                        help="re-grade even where bubblewrap cannot run")
    fprint = sub.add_parser("fingerprint", help=f"record the graders' files in COURSE_DIR/{FINGERPRINT_FILE} "
                            "(before autograde; verify checks them)")
    fprint.add_argument("--course-dir", type=Path, default=Path.cwd())
    args = parser.parse_args(argv)
    if args.command == "demo":
        run_demo(args.course_dir)
    elif args.command == "learner":
        write_learner_version(args.out)
    else:
        try:
            if args.command == "fingerprint":
                print(f"wrote {write_fingerprint(args.course_dir)}")
                return 0
            if args.command == "grade":
                done = grade_assignments(args.course_dir, args.assignment, jobs=args.jobs,
                                         unsandboxed=args.unsandboxed)
                scores, mismatches = done["scores"], done["findings"]
                times = ", ".join(f"{k} {v:.0f} s" for k, v in done["seconds"].items())
                print(f"{len(scores)} students graded with {args.jobs} workers: {times}")
            else:
                os.environ[sandbox.MODE_ENV] = "auto" if args.unsandboxed else "required"
                sandbox.enabled()
                if not os.environ.get(SECRET_ENV):
                    raise CourseError(f"{SECRET_ENV} is not set: the hidden cases would be the public ones "
                                      f"every learner can run (export {SECRET_ENV}='something only you know')")
                scores, mismatches = trusted_regrade(args.course_dir, args.assignment, os.environ.get(SECRET_ENV))
        except (CourseError, sandbox.SandboxUnavailable) as e:
            print(f"{args.command}: {e}", file=sys.stderr)
            return 2
        print_table(scores, mismatches, args.course_dir)
        print(sandbox.describe())
    return 0



if __name__ == "__main__":
    sys.exit(main())
