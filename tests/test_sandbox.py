"""The sandbox (graders.machine.sandbox), the fork server (graders.machine.forkserver), the sandboxed nbgrader kernel
(graders.machine.kernel_sandbox) and the parallel autograde (graders.course.autograde), tried as a malicious
learner would: every attack is bounded (background processes sleep, files of a few tens of MB)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from graders.course.mutation import solution_answers
from graders.machine import forkserver, sandbox
from graders.machine.core import SECRET_ENV, grade_source

ROOT = Path(__file__).resolve().parents[1]
needs_bwrap = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap (bwrap) cannot run here")
#: Unique sleeps, one per test (tests run side by side under xdist): `pgrep -f '^sleep N$'` finds
#: a test's own and never the shell that asks, nor another test's.
SLEEP = "31.4159"
KERNEL_SLEEP = "27.1828"


def _sleepers(marker: str = SLEEP) -> int:
    out = subprocess.run(["pgrep", "-f", f"^sleep {marker}$"], capture_output=True, text=True).stdout
    return len(out.split())


def _probe(course: Path) -> str:
    """An answer to ch01.1 that tries every attack and raises with what it saw."""
    return textwrap.dedent(f'''
        import os, socket, subprocess
        def lora_forward(x, W, A, B, scaling):
            seen = ["secret=" + str(os.environ.get({SECRET_ENV!r}))]
            try:
                open({str(ROOT / "graders" / "tolerances.py")!r}, "a").close()
                seen.append("repo writable")
            except OSError:
                seen.append("repo read-only")
            seen.append("gradebook visible" if os.path.exists({str(course / "gradebook.db")!r}) else "gradebook hidden")
            try:
                socket.create_connection(("1.1.1.1", 53), timeout=2).close()
                seen.append("network")
            except OSError:
                seen.append("no network")
            subprocess.Popen(["sleep", "{SLEEP}"], start_new_session=True)
            try:
                with open("/tmp/big", "wb") as f:
                    f.write(b"0" * (80 << 20))
                seen.append("80 MB written")
            except OSError:
                seen.append("file size bounded")
            raise RuntimeError("SEEN " + ", ".join(seen) + " END")
    ''')


@needs_bwrap
def test_a_sandboxed_check_blocks_every_attack(tmp_path, monkeypatch):
    course = tmp_path / "course"
    course.mkdir()
    (course / "gradebook.db").write_text("grades")
    monkeypatch.setenv(SECRET_ENV, "the-instructors-secret")
    monkeypatch.setenv(sandbox.MODE_ENV, "required")
    forkserver.hide(course)
    before = _sleepers()
    report = grade_source("ch01.1", _probe(course)).report
    seen = re.search(r"SEEN (.*?) END", report).group(1).split(", ")
    assert seen == ["secret=None", "repo read-only", "gradebook hidden", "no network", "file size bounded"], report
    time.sleep(0.5)
    assert _sleepers() == before, "a process started by learner code outlived its check"
    assert (course / "gradebook.db").read_text() == "grades"


def test_unsandboxed_runs_say_so_and_required_refuses(monkeypatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "off")
    assert not sandbox.enabled()
    assert "UNSANDBOXED" in sandbox.describe()
    monkeypatch.setenv(sandbox.MODE_ENV, "required")
    monkeypatch.setattr(sandbox, "available", lambda: False)
    with pytest.raises(sandbox.SandboxUnavailable, match="--unsandboxed"):
        sandbox.enabled()
    monkeypatch.setenv(sandbox.MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="LORA_BOOK_SANDBOX"):
        sandbox.mode()


def test_the_secret_never_reaches_a_child_even_unsandboxed(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "the-instructors-secret")
    monkeypatch.setenv(sandbox.MODE_ENV, "off")
    forkserver.kill_all()  # a server started before the policy changed keeps its sandbox
    answer = textwrap.dedent(f'''
        import os
        def lora_forward(x, W, A, B, scaling):
            raise RuntimeError("SEEN " + str(os.environ.get({SECRET_ENV!r})) + " END")
    ''')
    assert "SEEN None END" in grade_source("ch01.1", answer).report
    forkserver.kill_all()


_HANGING_CHECK = textwrap.dedent('''
    import sys
    from graders.machine import forkserver
    import torch
    from graders.machine.core import grade_source
    # the kind of server the check below uses (a GPU machine grades ch01.1 on CUDA)
    cuda = torch.cuda.is_available() and forkserver.usable("cuda")
    srv = forkserver.server("cuda" if cuda else "cpu")
    srv.start()
    forkserver._release(srv)  # idle again: the check below takes this one
    print(srv.proc.pid, flush=True)
    grade_source("ch01.1", "def lora_forward(x, W, A, B, scaling):\\n    while True:\\n        pass\\n")
''')


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["interrupt", "kill"])
@pytest.mark.parametrize("policy", ["auto", "off"])
@pytest.mark.parametrize("server", ["fork", "spawn"])
def test_a_kernel_interrupted_or_killed_during_a_hanging_check_leaves_no_process(how, policy, server):
    """JupyterLab's interrupt (SIGINT: KeyboardInterrupt in the kernel) and a restart or shutdown
    (the kernel killed) during a check whose answer loops forever: nothing may keep spinning.
    ``spawn``: a fresh child per check (servers switched off, or a GPU that refuses a CUDA context
    in a forked child)."""
    env = dict(os.environ, **{sandbox.MODE_ENV: policy})
    if server == "spawn":
        env[forkserver.SWITCH_ENV] = "off"
    kernel = subprocess.Popen([sys.executable, "-c", _HANGING_CHECK], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, env=env, text=True)
    server = int(kernel.stdout.readline())
    # everything under the kernel: the fork server and its job, or (spawn) also the check's own
    # child process. Polled: on a busy 16-core GPU machine the kernel's CUDA start and the cases
    # took past a fixed 3 s before the check's child existed.
    deadline = time.monotonic() + 120
    spinning = _descendants(kernel.pid)
    while len(spinning) < 2 and time.monotonic() < deadline and kernel.poll() is None:
        time.sleep(0.2)
        spinning = _descendants(kernel.pid)
    assert server in spinning
    assert len(spinning) >= 2, "the check's child never started"
    time.sleep(2)  # the answer is spinning now
    spinning = _descendants(kernel.pid)
    kernel.send_signal(signal.SIGINT if how == "interrupt" else signal.SIGKILL)
    kernel.wait(timeout=120)  # a loaded CI machine (2 cores) once took past 30 s here
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in spinning):
        time.sleep(0.2)
    assert not [p for p in spinning if _alive(p)], f"left running after the kernel was {how}ed"


@needs_bwrap
def test_the_sandboxed_kernel_hides_the_course_and_the_secret(tmp_path):
    from nbclient import NotebookClient
    from traitlets.config import Config
    import nbformat

    from graders.machine.kernel_sandbox import KERNEL_NAME, install_kernelspec, ipc_folder

    course = tmp_path / "course"
    own = course / "autograded" / "student-a" / "01_lora_basics"
    other = course / "submitted" / "student-b"
    own.mkdir(parents=True)
    other.mkdir(parents=True)
    (course / "nbgrader_config.py").write_text("")
    (course / "gradebook.db").write_text("grades")
    (other / "answers.ipynb").write_text("{}")
    install_kernelspec(tmp_path / "jupyter")
    cell = textwrap.dedent(f'''
        import os
        print("secret", os.environ.get({SECRET_ENV!r}))
        print("gradebook", os.path.exists({str(course / "gradebook.db")!r}))
        print("other student", os.path.exists({str(other / "answers.ipynb")!r}))
        open("own-file.txt", "w").write("mine")
        import subprocess
        subprocess.Popen(["sleep", "{KERNEL_SLEEP}"], start_new_session=True)  # a process meant to outlive autograde
        try:
            open({str(ROOT / "README.md")!r}, "a").close()
            print("repo writable")
        except OSError:
            print("repo read-only")
        try:  # issue #31: the notebook folder has a total, not only a per-file cap
            for k in range(3):
                with open(f"big-{{k}}.bin", "wb") as f:
                    f.write(b"0" * (60 << 20))
            print("180 MB written")
        except OSError:
            print("notebook folder bounded")
    ''')
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    before = _sleepers(KERNEL_SLEEP)
    config = Config()
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = str(ipc_folder(tmp_path) / "kernel")
    env_before = dict(os.environ)
    os.environ["JUPYTER_PATH"] = str(tmp_path / "jupyter")
    os.environ[SECRET_ENV] = "the-instructors-secret"
    try:
        NotebookClient(nb, kernel_name=KERNEL_NAME, config=config, timeout=120,
                       resources={"metadata": {"path": str(own)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert text.split("\n")[:6] == ["secret None", "gradebook False", "other student False", "repo read-only",
                                     "notebook folder bounded", ""], text
    assert not (own / "own-file.txt").exists() and not list(own.glob("big-*")), "the kernel's writes reach no disk"
    time.sleep(1)
    assert _sleepers(KERNEL_SLEEP) == before, "a process started in the kernel outlived it"


@needs_bwrap
def test_the_kernel_wrapper_refuses_an_ipc_folder_not_made_for_it(tmp_path):
    conn = tmp_path / "kernel-1.json"
    conn.write_text('{"transport": "ipc", "ip": "%s", "shell_port": 1}' % (tmp_path / "kernel"))
    proc = subprocess.run([sys.executable, "-m", "graders.machine.kernel_sandbox", "-f", str(conn)],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **{sandbox.MODE_ENV: "required"}))
    assert proc.returncode != 0 and "was not made for it" in proc.stderr


def _small_course(tmp_path: Path, config_lines: str = "") -> tuple[Path, str]:
    """A chapter-01 course with two students: one right, one with ch01's plausible mistakes."""
    from graders.course import jobs as course_jobs
    from graders.course.mutation import sample_learner

    course = tmp_path / "course"
    course_jobs._new_course(course)
    if config_lines:
        with open(course / "nbgrader_config.py", "a") as f:
            f.write(config_lines)
    chapter = "01_lora_basics"
    course_jobs._nbgrader(course, "generate_assignment", chapter, "--force")
    release = course / "release" / chapter / f"{chapter}.ipynb"
    answers = {"right": {e: s for e, s in solution_answers().items() if e.startswith("ch01")},
               "wrong": {e: s for e, s in sample_learner("plausible_mistakes").items() if e.startswith("ch01")}}
    for student, cells in answers.items():
        course_jobs.build_submission(release, cells, course / "submitted" / student / chapter / f"{chapter}.ipynb")
    return course, chapter


@needs_bwrap
@pytest.mark.slow
def test_the_grade_command_runs_the_whole_sequence(tmp_path):
    """Two assignments in one run (every (assignment, student) notebook one job over 2 workers);
    one student submitted only the first. The gradebook is at the URL of the course's
    nbgrader_config.py (``c.CourseDirectory.db_url``: a large course gives a PostgreSQL URL the same
    way, tests/test_postgres.py), which the parallel autograde, the re-grade and the export honour
    (it was a test of its own, an autograde of the same chapter-01 course: 37-61 s of CI's 2-core
    machine for what this run grades anyway)."""
    from nbgrader.api import Gradebook

    from graders.course import jobs as course_jobs

    db_url = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    course, chapter = _small_course(tmp_path, f"\nc.CourseDirectory.db_url = {db_url!r}\n")
    second = "02_batching_adapters"
    course_jobs._nbgrader(course, "generate_assignment", second, "--force")
    course_jobs.build_submission(course / "release" / second / f"{second}.ipynb",
                                 {e: s for e, s in solution_answers().items() if e.startswith("ch02")},
                                 course / "submitted" / "right" / second / f"{second}.ipynb")
    env = dict(os.environ, **{SECRET_ENV: "the-instructors-secret"})
    proc = subprocess.run([sys.executable, "-m", "graders.course", "grade", chapter, second, "--course-dir",
                           str(course), "--jobs", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "learner code ran sandboxed" in proc.stdout
    import csv

    with open(course / "grades.csv") as f:
        scores = {(r["assignment"], r["student_id"]): float(r["raw_score"]) for r in csv.DictReader(f)}
    full_02 = sum(course_jobs.total_points(e) for e in solution_answers() if e.startswith("ch02"))
    assert scores == {(chapter, "right"): 18.0, (chapter, "wrong"): 0.0, (second, "right"): full_02,
                      (second, "wrong"): 0.0}, scores
    assert not (course / "gradebook.db").exists(), "everything went to the database at the URL"
    with Gradebook(db_url) as gb:
        recorded = {(a, s): gb.find_submission(a, s).score
                    for a, s in ((chapter, "right"), (chapter, "wrong"), (second, "right"))}
    assert recorded == {(chapter, "right"): 18.0, (chapter, "wrong"): 0.0, (second, "right"): full_02}, recorded
    feedback = {a: course / "feedback" / "right" / a / f"{a}.html" for a in (chapter, second)}
    assert all(f.exists() for f in feedback.values())
    assert not (course / "autograded" / "wrong" / second).exists()
    assert (course / ".lora_book_fingerprint.json").exists()
    # a later run of one assignment writes that assignment's feedback only
    before = {a: f.stat().st_mtime_ns for a, f in feedback.items()}
    proc = subprocess.run([sys.executable, "-m", "graders.course", "grade", second, "--course-dir", str(course)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert feedback[chapter].stat().st_mtime_ns == before[chapter]
    assert feedback[second].stat().st_mtime_ns != before[second]


@needs_bwrap
def test_the_grade_command_refuses_an_unknown_assignment_or_no_secret_before_grading_any(tmp_path):
    course, chapter = _small_course(tmp_path)
    before = sorted(p.relative_to(course) for p in course.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "graders.course", "grade", chapter, "01_lora_basic",
                           "--course-dir", str(course)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "'01_lora_basic' is unknown to the gradebook" in proc.stderr, proc.stderr
    assert sorted(p.relative_to(course) for p in course.rglob("*")) == before
    # no secret: the hidden cases would be the public ones; grade and verify refuse, touching nothing
    no_secret = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    for command in (["grade", chapter], ["verify", chapter]):
        proc = subprocess.run([sys.executable, "-m", "graders.course", *command, "--course-dir", str(course)],
                              capture_output=True, text=True, timeout=120, env=no_secret)
        assert proc.returncode == 2 and f"{SECRET_ENV} is not set" in proc.stderr, (command, proc.stderr)
        assert sorted(p.relative_to(course) for p in course.rglob("*")) == before


def test_the_grade_command_refuses_without_the_sandbox(tmp_path):
    course = tmp_path / "course"
    course.mkdir()
    (course / "nbgrader_config.py").write_text("")
    proc = subprocess.run([sys.executable, "-m", "graders.course", "grade", "01_lora_basics", "--course-dir",
                           str(course)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PATH="/nonexistent"))
    assert proc.returncode == 2 and "--unsandboxed" in proc.stderr, proc.stderr
    assert sorted(p.name for p in course.iterdir()) == ["nbgrader_config.py"]


@pytest.mark.parametrize("policy", ["auto", "off"])
def test_a_students_checks_share_one_triton_cache_on_a_gpu(tmp_path, monkeypatch, policy):
    """On a GPU (a fresh child per check, as here with CUDA faked in this process) the trusted
    re-grade's checks of one student share a Triton cache folder, writable in the sandbox; the
    checks of another student see another folder."""
    from graders.machine.core import triton_cache_scope

    monkeypatch.setenv(sandbox.MODE_ENV, policy)
    monkeypatch.setattr("graders.machine.core._cuda_here", lambda: True)
    monkeypatch.setattr(forkserver, "usable", lambda *a, **k: False)
    answer = textwrap.dedent('''
        import os
        def lora_forward(x, W, A, B, scaling):
            cache = os.environ.get("TRITON_CACHE_DIR")
            open(os.path.join(cache, "compiled.txt"), "a").write("x")
            raise RuntimeError("SEEN " + cache + " " + str(sorted(os.listdir(cache))) + " END")
    ''')
    seen = []
    for student in ("a", "a", "b"):
        with triton_cache_scope(tmp_path / student):
            seen.append(re.search(r"SEEN (.*?) END", grade_source("ch01.1", answer).report).group(1))
    assert seen == [f"{tmp_path / 'a'} ['compiled.txt']", f"{tmp_path / 'a'} ['compiled.txt']",
                    f"{tmp_path / 'b'} ['compiled.txt']"], seen
    calls = len((tmp_path / "b" / "compiled.txt").read_text())  # one write per case
    assert calls > 0 and len((tmp_path / "a" / "compiled.txt").read_text()) == 2 * calls


_REPORT_WHERE = textwrap.dedent('''
    import os
    def lora_forward(x, W, A, B, scaling):
        raise RuntimeError("SEEN " + str(x.device) + " " + os.environ.get("LORA_BOOK_FORKSERVER_KIND", "-")
                           + " " + os.environ.get("TRITON_CACHE_DIR", "-") + " END")
''')


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork servers need fork")
def test_fork_servers_are_pooled_by_kind_and_triton_cache(tmp_path):
    """A server of one student's scope (a cuda server's Triton cache) is never handed to another
    student's check, of either kind (issue #31: state left by one student's check); a cpu server
    binds no cache; the idle pool stays bounded (each server holds torch imported)."""
    forkserver.kill_all()
    a, b = forkserver.server("cuda", tmp_path / "a"), forkserver.server("cuda", tmp_path / "b")
    cpu = forkserver.server("cpu", tmp_path / "a")
    assert len({id(a), id(b), id(cpu)}) == 3 and cpu.cache is None and a.cache == tmp_path / "a"
    forkserver._release(a)
    forkserver._release(b)  # at most two idle at once here: the pool keeps at least two
    assert forkserver.server("cuda", tmp_path / "b") is b
    assert forkserver.server("cuda", tmp_path / "a") is a
    forkserver._release(cpu)
    assert forkserver.server("cpu") is not cpu and forkserver.server("cpu", tmp_path / "b") is not cpu
    assert forkserver.server("cpu", tmp_path / "a") is cpu and cpu.scope == tmp_path / "a"
    with pytest.raises(ValueError, match="kind"):
        forkserver.ForkServer("gpu")
    for k in range(forkserver._max_idle() + 3):
        forkserver._release(forkserver.server("cuda", tmp_path / f"s{k}"))
    assert len(forkserver._IDLE) == forkserver._max_idle()
    assert {s.cache for s in forkserver._IDLE} == {tmp_path / f"s{k}" for k in range(3, forkserver._max_idle() + 3)}
    forkserver.kill_all()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork servers need fork")
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without a GPU")
@pytest.mark.parametrize("policy", ["auto", "off"])
def test_a_cuda_server_that_cannot_create_a_context_falls_back_to_spawning(monkeypatch, policy):
    """Here (no GPU) a cuda server's probe child cannot create a CUDA context: the server says so
    before its first job, the client records it, and this process's CUDA checks spawn instead."""
    monkeypatch.setenv(sandbox.MODE_ENV, policy)
    monkeypatch.setattr(forkserver, "_CUDA_UNSAFE", [])
    forkserver.kill_all()
    assert forkserver.usable("cuda") and forkserver.usable("cpu")
    srv = forkserver.server("cuda")
    with pytest.raises(forkserver.CudaForkUnsafe, match="CUDA context"):
        srv.start()
    assert not srv.alive() and not forkserver.usable("cuda") and forkserver.usable("cpu")
    forkserver._release(srv)
    forkserver.kill_all()


def test_the_switch_decides_which_jobs_use_a_server(monkeypatch):
    monkeypatch.setattr(forkserver, "_CUDA_UNSAFE", [])
    for switch, cpu, cuda in (("on", True, True), ("cpu", True, False), ("off", False, False)):
        monkeypatch.setenv(forkserver.SWITCH_ENV, switch)
        assert (forkserver.usable("cpu"), forkserver.usable("cuda:0")) == (cpu, cuda), switch


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="a GPU")
@pytest.mark.parametrize("policy", ["auto", "off"])
def test_on_a_gpu_cuda_checks_go_through_a_cuda_server_with_the_students_cache(tmp_path, monkeypatch, policy):
    """On a GPU machine a check graded on CUDA runs in a child of a cuda fork server (no fresh
    process importing torch per check) that sees the device and the student's Triton cache; a
    check graded on the CPU (ch08's) runs in a cpu server's child, which sees no GPU."""
    from graders.machine.core import triton_cache_scope

    monkeypatch.setenv(sandbox.MODE_ENV, policy)
    forkserver.kill_all()
    with triton_cache_scope(tmp_path / "a"):
        report = grade_source("ch01.1", _REPORT_WHERE).report
    assert f"SEEN cuda:0 cuda {tmp_path / 'a'} END" in report, report
    assert not forkserver._CUDA_UNSAFE
    assert [s.cache for s in forkserver._ALL if s.kind == "cuda" and s.alive()] == [tmp_path / "a"]
    cpu_answer = textwrap.dedent('''
        import torch
        def bucket_for(n, buckets):
            raise RuntimeError("SEEN cuda " + str(torch.cuda.is_available()) + " END")
    ''')
    assert "SEEN cuda False END" in grade_source("ch08.1", cpu_answer).report
    forkserver.kill_all()


RANK_SLEEP = "23.0259"


@needs_bwrap
def test_per_rank_answers_run_sandboxed_and_a_hanging_rank_leaves_nothing(monkeypatch):
    """Chapter 10's ranks fork inside the sandboxed grader child: a rank that starts a detached
    process and never joins the collective its peer waits in costs its exercise a named hang, and
    nothing it started outlives the check; an answer on the default group is named at once."""
    monkeypatch.setenv(sandbox.MODE_ENV, "required")
    hanging = textwrap.dedent(f'''
        import subprocess, time
        import torch.distributed as dist
        def row_parallel_lora(x_local, W_local, A_local, B, token_slots, lora_ranks, scalings, variant, group=None):
            if dist.get_rank(group) == 1:
                subprocess.Popen(["sleep", "{RANK_SLEEP}"], start_new_session=True)
                while True:
                    time.sleep(1)
            y = x_local @ W_local.T
            dist.all_reduce(y, group=group)
            return y
    ''')
    before = _sleepers(RANK_SLEEP)
    start = time.monotonic()
    result = grade_source("ch10.3", hanging)
    assert result.score == 0 and "did not finish within" in result.report, result.report
    assert time.monotonic() - start < 60, "a hanging rank must not use the whole budget of every case"
    time.sleep(0.5)
    assert _sleepers(RANK_SLEEP) == before, "a process started in a rank outlived its check"
    default_group = solution_answers()["ch10.4"].replace("dist.all_gather(pieces, t_local, group=group)",
                                                        "dist.all_gather(pieces, t_local)")
    report = grade_source("ch10.4", default_group).report
    assert "the default group" in report and "pass group=group" in report, report


# ---------------------------------------------------------------------------------------------
# Red-team review 41 (H5, H6): a course's data stays hidden wherever the course folder is (the
# checkout itself: the README's layout; a folder holding it; a folder inside it), markers a
# submission ships decide nothing, and a link in the notebook's folder shows nothing of the host

_LAYOUTS = ("the checkout", "holds the checkout", "inside the checkout")
_DATA = ("gradebook.db", "gradebook.db-journal", "grades.csv", ".lora_book_fingerprint.json", "nbgrader_config.py",
         "submitted/other/01_lora_basics/01_lora_basics.ipynb", "autograded/other/01_lora_basics/01_lora_basics.ipynb",
         "feedback/other/01_lora_basics/01_lora_basics.html", "release/01_lora_basics/01_lora_basics.ipynb")


def _course_in(tmp_path: Path, layout: str, monkeypatch) -> tuple[Path, Path]:
    """(course, checkout): a course with every kind of data of another student, laid out against a
    stand-in checkout that every sandbox binds for the code (``sandbox._needed_paths``)."""
    checkout = tmp_path / ("course" if layout == "the checkout" else "book")
    course = {"the checkout": checkout, "holds the checkout": tmp_path / "course",
              "inside the checkout": checkout / "build" / "course"}[layout]
    if layout == "holds the checkout":
        checkout = course / "book"
    (checkout / "graders").mkdir(parents=True)
    (checkout / "graders" / "code.py").write_text("CODE\n")
    for rel in _DATA:
        (course / rel).parent.mkdir(parents=True, exist_ok=True)
        (course / rel).write_text("COURSE DATA\n")
    (course / "nbgrader_config.py").write_text("c = get_config()\n")
    needed = sandbox._needed_paths
    monkeypatch.setattr(sandbox, "_needed_paths", lambda: [*needed(), checkout])
    return course, checkout


_READ = textwrap.dedent('''
    import json, os, sys
    seen = {}
    for path in sys.argv[1:]:
        try:
            seen[path] = open(path).read()
        except OSError:
            seen[path] = None
    print("SEEN " + json.dumps(seen) + " END")
''')


@needs_bwrap
@pytest.mark.parametrize("told", ["by the grading command", "found above the notebook"])
@pytest.mark.parametrize("layout", _LAYOUTS)
def test_a_kernel_sees_no_course_data_wherever_the_course_is(tmp_path, monkeypatch, layout, told):
    """The kernel's own notebook and the checkout's code show; another student's submission,
    autograded notebook and feedback, the gradebook (and its journal), grades.csv, the fingerprint,
    the config do not, though the submission planted nbgrader_config.py and gradebook.db markers in
    the notebook's folder; a link there to a host file shows nothing."""
    import json

    from graders.machine.kernel_sandbox import kernel_argv

    course, checkout = _course_in(tmp_path, layout, monkeypatch)
    own = course / "autograded" / "spy" / "01_lora_basics"
    own.mkdir(parents=True)
    (own / "01_lora_basics.ipynb").write_text("MY NOTEBOOK\n")
    (own / "nbgrader_config.py").write_text("c = get_config()\n")  # markers: this is a course root
    (own / "gradebook.db").write_text("")
    secret = tmp_path.parent / f"{tmp_path.name}-host-secret.txt"  # outside the course
    secret.write_text("HOST SECRET\n")
    (own / "leak.txt").symlink_to(secret)
    if told == "by the grading command":
        monkeypatch.setenv(sandbox.COURSE_ENV, str(course))
    else:
        monkeypatch.delenv(sandbox.COURSE_ENV, raising=False)
    (tmp_path / "run").mkdir()
    conn = tmp_path / "run" / "kernel-1.json"
    conn.write_text("{}")
    paths = [str(course / rel) for rel in _DATA] + [str(own / "01_lora_basics.ipynb"), str(own / "leak.txt"),
                                                     str(checkout / "graders" / "code.py")]
    try:
        argv, _ = kernel_argv([sys.executable, "-I", "-c", _READ, *paths], conn, own, {"transport": "tcp"})
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    finally:
        secret.unlink()
    seen = json.loads(re.search(r"SEEN (.*) END", proc.stdout).group(1))
    shown = {p: v for p, v in seen.items() if v}
    assert shown == {str(own / "01_lora_basics.ipynb"): "MY NOTEBOOK\n",
                     str(checkout / "graders" / "code.py"): "CODE\n"}, (shown, proc.stderr[-500:])


_SPY_CHILD = textwrap.dedent('''
    import os
    def lora_forward(x, W, A, B, scaling):
        seen = {}
        for path in PATHS:
            try:
                seen[path] = open(path).read()
            except OSError:
                pass
        raise RuntimeError("SEEN " + repr(seen) + " END")
''')


@needs_bwrap
@pytest.mark.parametrize("layout", _LAYOUTS)
def test_a_grader_child_sees_no_course_data_wherever_the_course_is(tmp_path, monkeypatch, layout):
    """The trusted re-grade's children (fork servers started after ``forkserver.hide(course)``)
    read none of the course's data; the checkout's code still shows."""
    course, checkout = _course_in(tmp_path, layout, monkeypatch)
    monkeypatch.setenv(sandbox.MODE_ENV, "required")
    monkeypatch.setattr(forkserver, "_HIDDEN", [])
    monkeypatch.setattr(forkserver, "_HIDDEN_DATA", [])
    forkserver.kill_all()
    try:
        forkserver.hide(course)
        paths = [str(course / rel) for rel in _DATA] + [str(checkout / "graders" / "code.py")]
        report = grade_source("ch01.1", _SPY_CHILD.replace("PATHS", repr(paths))).report
    finally:
        forkserver.kill_all()
    seen = re.search(r"SEEN (.*?) END", report).group(1)
    assert seen == repr({str(checkout / "graders" / "code.py"): "CODE\n"}), report


def test_course_data_names_the_fingerprint_and_the_configured_folders(tmp_path):
    from graders.course.jobs import FINGERPRINT_FILE

    (tmp_path / "nbgrader_config.py").write_text(
        "c = get_config()\nc.CourseDirectory.submitted_directory = 'in'\n"
        "c.CourseDirectory.db_url = 'sqlite:///data/book.db'\nc.Exchange.root = '/srv/elsewhere'\n")
    data = sandbox.course_data(tmp_path)
    for rel in ("in", "autograded", "feedback", "release", "source", "data/book.db", "data/book.db-wal",
                "gradebook.db", FINGERPRINT_FILE, "grades.csv", "nbgrader_config.py"):
        assert tmp_path.resolve() / rel in data, rel
    assert Path("/srv/elsewhere") in data and tmp_path.resolve() / "submitted" not in data


def test_a_submission_holding_a_link_is_refused_before_autograde(tmp_path):
    """nbgrader copies a submission following links, as the instructor: a link (or fifo) in it is
    named and the submission is not autograded; regular files and folders pass."""
    from graders.course.autograde import unsafe_entries

    chapter = "01_lora_basics"
    folder = tmp_path / "submitted" / "linker" / chapter
    (folder / "data").mkdir(parents=True)
    (folder / f"{chapter}.ipynb").write_text("{}")
    (folder / "data" / "ok.txt").write_text("ok")
    assert unsafe_entries(tmp_path, "linker", chapter) == []
    (folder / "data" / "leak.txt").symlink_to("/etc/hostname")
    os.mkfifo(folder / "pipe")
    assert sorted(unsafe_entries(tmp_path, "linker", chapter)) == [
        f"submitted/linker/{chapter}/data/leak.txt (a symbolic link)", f"submitted/linker/{chapter}/pipe (a fifo)"]
    (tmp_path / "submitted" / "other").mkdir()
    (tmp_path / "submitted" / "other" / chapter).symlink_to(folder)
    assert unsafe_entries(tmp_path, "other", chapter) == [f"submitted/other/{chapter} (a symbolic link)"]


_DEV_WRITES = textwrap.dedent('''
    import glob, os
    seen = []
    for path in ["/dev/fill", "/dev/shm/fill", "/dev/null", "/tmp/fill", *sorted(glob.glob("/dev/nvidia[0-9]*"))[:1]]:
        try:
            with open(path, "wb") as f:
                f.write(b"0" * 4096) if not path.startswith("/dev/nvidia") else None
            seen.append(path + " written")
        except OSError as e:
            seen.append(path + " " + os.strerror(e.errno))
    print("SEEN " + ", ".join(seen) + " END")
''')


@needs_bwrap
@pytest.mark.parametrize("gpu", [False, True])
def test_the_sandboxs_own_dev_is_read_only_but_its_devices_and_shm_work(gpu):
    """bwrap's ``--dev`` makes /dev a RAM tmpfs with no size bound (issue #31: as root, learner code
    could fill host memory through it); it is remounted read-only after its device nodes are made,
    while /dev/null, the bounded /dev/shm, /tmp and the GPU's device nodes stay usable."""
    argv = sandbox.bwrap_argv([sys.executable, "-c", _DEV_WRITES], gpu=gpu)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    seen = re.search(r"SEEN (.*?) END", out.stdout).group(1).split(", ")
    assert seen[:4] == ["/dev/fill Read-only file system", "/dev/shm/fill written", "/dev/null written",
                        "/tmp/fill written"], (seen, out.stderr)
    assert all(s.endswith(" written") for s in seen[4:]), seen  # a GPU's node opens for writing
