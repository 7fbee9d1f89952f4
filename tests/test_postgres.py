"""The course-scale path for real (issue #31): the gradebook in a PostgreSQL server, as the README
tells a large course to do. The test starts a server of its own on a Unix socket outside /tmp (in
/var/tmp), grades a few students with ``grade --jobs 2`` into it, re-runs ``verify``, and checks the
feedback and the export; one student's code tries to reach the server's socket from its kernel and
from its grader checks (hole 2: it must not). Skipped, with the reason, where no server can start."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from graders.course.mutation import sample_learner, solution_answers
from graders.machine import sandbox
from graders.machine.core import SECRET_ENV

PG_BIN = Path(os.environ.get("LORA_BOOK_PG_BIN", "/usr/local/bin"))


def _as_server_user() -> list[str]:
    """The command prefix that runs PostgreSQL's programs (initdb refuses root) as an unprivileged
    user; [] when we are not root."""
    if os.getuid() != 0:
        return []
    if shutil.which("setpriv"):
        return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--"]
    pytest.skip("running as root and neither setpriv nor runuser is here: initdb refuses root")


@pytest.fixture
def postgres():
    """A PostgreSQL server listening only on a Unix socket in a folder under /var/tmp; yields the
    SQLAlchemy URL of an empty database ``course`` and the socket's path."""
    if not sandbox.available():
        pytest.skip("bubblewrap (bwrap) cannot run here: grade refuses to run unsandboxed")
    if not all((PG_BIN / p).exists() for p in ("initdb", "pg_ctl", "postgres")):
        pytest.skip(f"no PostgreSQL server programs in {PG_BIN} (Debian: apt-get install postgresql)")
    psycopg = pytest.importorskip("psycopg", reason="no PostgreSQL driver (requirements.txt pins psycopg)")
    prefix = _as_server_user()
    base = Path(tempfile.mkdtemp(prefix="lora-book-pg-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    base.chmod(0o755)
    data, sockets = base / "data", base / "sockets"
    sockets.mkdir()
    if prefix:
        shutil.chown(base, "nobody", "nogroup")
        shutil.chown(sockets, "nobody", "nogroup")
    run = lambda *cmd: subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)  # noqa: E731
    try:
        init = run(str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync")
        if init.returncode != 0:
            pytest.skip(f"initdb could not make a cluster here: {init.stderr.strip()[-300:]}")
        start = run(str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(base / "log"), "-w", "-t", "60", "-o",
                    f"-k {sockets} -c listen_addresses='' -c fsync=off", "start")
        if start.returncode != 0:
            log = (base / "log").read_text()[-300:] if (base / "log").exists() else ""
            pytest.skip(f"the PostgreSQL server did not start: {start.stderr.strip()[-300:]} {log}")
        with psycopg.connect(dbname="postgres", user="postgres", host=str(sockets), autocommit=True) as conn:
            conn.execute("CREATE DATABASE course")
        yield f"postgresql://postgres@/course?host={sockets}", sockets / ".s.PGSQL.5432"
    finally:
        run(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


def _spy(socket_path: Path) -> str:
    """ch01.1's solution, whose cell and function both try the server's socket: reached, the cell
    says so in the notebook and the function returns junk (its score drops)."""
    reach = textwrap.dedent(f'''
        import socket as _socket
        def _reached():
            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            try:
                s.connect({str(socket_path)!r})
                return True
            except OSError:
                return False
            finally:
                s.close()
        # one string, one write (print's separate writes of "PG", " ", ... may be flushed apart under load and
        # show as two outputs); the word split so that the source, which the feedback shows, never contains it
        print("PG " + (("RE" "ACHED") if _reached() else "unreachable"))
    ''')
    return reach + solution_answers()["ch01.1"] + textwrap.dedent('''
        _solution = lora_forward
        def lora_forward(x, W, A, B, scaling):
            if _reached():
                return None
            return _solution(x, W, A, B, scaling)
    ''')


@pytest.mark.slow
def test_grade_verify_feedback_and_export_against_a_postgresql_gradebook(tmp_path, postgres):
    from nbgrader.api import Gradebook

    from graders.course import jobs as course_jobs

    db_url, socket_path = postgres
    assert socket_path.exists() and not str(socket_path).startswith("/tmp/")
    course = tmp_path / "course"
    course_jobs._new_course(course)
    with open(course / "nbgrader_config.py", "a") as f:
        f.write(f"\nc.CourseDirectory.db_url = {db_url!r}\n")
    chapter = "01_lora_basics"
    course_jobs._nbgrader(course, "generate_assignment", chapter, "--force")
    release = course / "release" / chapter / f"{chapter}.ipynb"
    right = {e: s for e, s in solution_answers().items() if e.startswith("ch01.")}
    students = {"right": right, "spy": {**right, "ch01.1": _spy(socket_path)},
                "wrong": {e: s for e, s in sample_learner("plausible_mistakes").items() if e.startswith("ch01.")}}
    for student, cells in students.items():
        course_jobs.build_submission(release, cells, course / "submitted" / student / chapter / f"{chapter}.ipynb")
    env = dict(os.environ, **{SECRET_ENV: "the-instructors-secret"})
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "graders.course", "grade", chapter, "--course-dir", str(course),
                           "--jobs", "2"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seconds = time.perf_counter() - start
    assert not (course / "gradebook.db").exists(), "everything went to PostgreSQL"
    proc = subprocess.run([sys.executable, "-m", "graders.course", "verify", chapter, "--course-dir", str(course)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Every notebook test cell agreed with the trusted re-grade." in proc.stdout
    # the same scores as the SQLite run of the same answers (tests/test_sandbox.py's grade test)
    expected = {"right": 18.0, "spy": 18.0, "wrong": 0.0}
    with open(course / "grades.csv") as f:
        assert {r["student_id"]: float(r["raw_score"]) for r in csv.DictReader(f)} == expected
    with Gradebook(db_url, course_id="multi-lora-serving") as gb:
        assert {s: gb.find_submission(chapter, s).score for s in students} == expected
    spy = (course / "feedback" / "spy" / chapter / f"{chapter}.html").read_text()
    assert "PG unreachable" in spy and "REACHED" not in spy
    print(f"grade --jobs 2 of 3 students into PostgreSQL: {seconds:.0f} s")
