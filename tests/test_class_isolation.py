"""Issue #31, the second round of attacks on grading, each as a kind: one student must not reach
another student, the host, or the whole class's grading run. Every attack is bounded (files of a
few MB, no process left running) and each test checks its effect, not the mechanism: the scores
equal the honest ones, nothing was reached, the run completes for every other student."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import torch

import graders.course.jobs as course_mod
from graders.course.mutation import solution_answers
from graders.machine import forkserver, sandbox
from graders.machine.core import grade_source

ROOT = Path(__file__).resolve().parents[1]
needs_bwrap = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap (bwrap) cannot run here")

# ---------------------------------------------------------------------------------------------
# Hole 4: whatever a child returns is data; a malformed result costs its answer, never the run

#: Answers to ch01.1 that replace a piece of the graders in their own child (at the cell's top
#: level, as a chapter-11 cell replaced the capstone's driver), so the files the comparer reads are
#: not what graders.machine.runner writes.
MALFORMED_RESULTS = {
    "results are a JSON list": "import graders.machine.runner as r\nr.write_json = lambda obj, path: open(path, 'w').write('[1, 2]')\n",
    "results are not JSON": "import graders.machine.runner as r\nr.write_json = lambda obj, path: open(path, 'w').write('{')\n",
    "a tensor that is not there": "import graders.machine.runner as r\nr.encode = lambda *a: {'tensor': 'nowhere', 'device': 'cpu'}\n",
    "a returned value of the wrong type": (
        "import graders.machine.runner as r\nwrite = r.write_json\n"
        "r.write_json = lambda obj, path: write({**obj, 'returned': {'tensor': ['x']}} if isinstance(obj, dict) else obj, path)\n"),
    "tensors that are not safetensors": (
        "import graders.machine.runner as r\nr.save_tensors = lambda t, path: open(path, 'wb').write(b'not safetensors at all')\n"),
    # the unchanged-inputs check zips the case's arguments with these: an empty list skipped it
    "no arguments after the call": (
        "import graders.machine.runner as r\nwrite = r.write_json\n"
        "r.write_json = lambda obj, path: write({**obj, 'args_after': []} if isinstance(obj, dict) else obj, path)\n"),
    "a load error that is not text": (
        "import graders.machine.runner as r\nr.write_json = lambda obj, path: open(path, 'w').write('{\"error\": 5}')\n"
        "raise ValueError('so that load.json is written')\n"),
}


@pytest.mark.parametrize("kind", list(MALFORMED_RESULTS))
def test_a_malformed_result_fails_its_answer_with_a_report(kind):
    answer = MALFORMED_RESULTS[kind] + solution_answers()["ch01.1"]
    result = grade_source("ch01.1", answer)
    assert result.score == 0, result.report
    assert "could not read what your function's process returned" in result.report, result.report


def test_the_regrade_records_an_answer_it_cannot_grade_as_0_and_grades_the_rest(tmp_path, monkeypatch):
    """Any exception in the comparing process while grading one answer (here: a TypeError, as the
    chapter-11 attack raised) is that answer's 0 and a finding; every other answer is recorded."""
    course = tmp_path / "course"
    chapter = "01_lora_basics"
    cells = {ex: src for ex, src in solution_answers().items() if ex.startswith("ch01.")}
    for student in ("honest", "attacker"):
        nb = course / "autograded" / student / chapter
        nb.mkdir(parents=True)
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
            ("BROKEN " if student == "attacker" and ex == "ch01.3" else "") + src,
            metadata={"nbgrader": {"grade_id": ex.replace(".", "_") + "_answer", "solution": True}})
            for ex, src in cells.items()]),
            nb / f"{chapter}.ipynb")

    def fake_grade(ex, source):
        if source.startswith("BROKEN"):
            raise TypeError("'NoneType' object is not subscriptable")
        return SimpleNamespace(score=3.0)

    monkeypatch.setattr(course_mod, "_course_settings", lambda c, a: {
        "source": course / "source", "autograded": course / "autograded", "course_id": "c",
        "db_url": f"sqlite:///{course / 'gradebook.db'}"})
    monkeypatch.setattr(course_mod, "_recorded_fingerprint", lambda c: {})
    monkeypatch.setattr(course_mod, "check_fingerprint", lambda recorded: [])
    monkeypatch.setattr(course_mod, "_source_graded_cells", lambda s: {})
    monkeypatch.setattr(course_mod, "grade_source", fake_grade)
    monkeypatch.setattr(forkserver, "hide", lambda folder: None)
    seen = {}

    class Book:  # the gradebook: an assignment with no submissions, so only the findings matter
        def __init__(self, *a, **k):
            self.db = SimpleNamespace(commit=lambda: None)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def find_assignment(self, name):
            return SimpleNamespace(notebooks=[])

        def assignment_submissions(self, name):
            return []

    import nbgrader.api

    monkeypatch.setattr(nbgrader.api, "Gradebook", Book)
    scores, findings = course_mod.trusted_regrade(course, chapter, "s")
    seen = [str(f) for f in findings if isinstance(f, course_mod.Ungraded)]
    assert len(seen) == 1 and seen[0].startswith("attacker ch01.3: grading this answer failed (TypeError"), seen
    assert scores["honest"] == {ex: 3.0 for ex in cells}
    assert scores["attacker"] == {ex: (0.0 if ex == "ch01.3" else 3.0) for ex in cells}


# ---------------------------------------------------------------------------------------------
# Hole 1: no state passes between two students' checks through the fork servers

_PLANT = textwrap.dedent('''
    import ctypes, os, sys
    def lora_forward(x, W, A, B, scaling):
        planted = []
        for folder in [os.getcwd(), "/tmp", "/dev/shm", *[p for p in sys.path if p]]:
            try:  # a module a later check (another student's) would import, and a plain file
                open(os.path.join(folder, "lora_book_planted.py"), "w").write("PLANTED = True\\n")
                planted.append(folder)
            except OSError:
                pass
        os.makedirs("/tmp/left-behind/locked", exist_ok=True)
        open("/tmp/left-behind/locked/note", "w").write("x")
        os.chmod("/tmp/left-behind/locked", 0)
        libc = ctypes.CDLL(None)
        libc.shmget(0x10B0, 4096, 0o1666)  # a System V segment: IPC_CREAT | 0666
        raise RuntimeError("PLANTED " + repr(planted) + " END")
''')
_LOOK = textwrap.dedent('''
    import os, sys
    def lora_forward(x, W, A, B, scaling):
        seen = []
        try:
            import lora_book_planted
            seen.append("imported " + lora_book_planted.__file__)
        except ImportError:
            pass
        for folder in ("/tmp", "/dev/shm"):  # (mount points of hidden folders are the same for every server)
            seen += [os.path.join(d, n) for d, dirs, files in os.walk(folder) for n in dirs + files
                     if n.startswith("lora_book_planted") or n == "left-behind"]
        seen += ["writable path " + p for p in sys.path if os.path.isdir(p or ".") and os.access(p or ".", os.W_OK)]
        seen += [line.split()[0] for line in open("/proc/sysvipc/shm").read().splitlines()[1:]]
        raise RuntimeError("SEEN " + repr(seen) + " END")
''')


@needs_bwrap
@pytest.mark.parametrize("students", ["one server reused", "a server per student"])
def test_nothing_passes_between_two_students_checks(tmp_path, monkeypatch, students):
    """A check plants a module in every folder it can write (its working folder, /tmp, /dev/shm,
    every folder on its module search path), a locked folder and a System V segment; the next
    check, through the same server (scope unchanged) or another student's, finds none of them."""
    import re

    from graders.machine.core import triton_cache_scope

    monkeypatch.setenv(sandbox.MODE_ENV, "required")
    forkserver.kill_all()
    scopes = (tmp_path / "a", tmp_path / ("a" if students == "one server reused" else "b"))
    with triton_cache_scope(scopes[0]):
        planted = grade_source("ch01.1", _PLANT).report
    assert "PLANTED [" in planted and "/tmp" in planted, planted  # the attack did write where it could
    with triton_cache_scope(scopes[1]):
        seen = re.search(r"SEEN (.*?) END", grade_source("ch01.1", _LOOK).report).group(1)
    assert seen == "[]", seen
    # the grading device's servers (CUDA ones on a GPU); none where every check is a fresh process
    servers = [s for s in forkserver._ALL if s.alive()]
    if servers or not torch.cuda.is_available():
        assert {s.scope for s in servers} == set(scopes), "servers are keyed by student"
    forkserver.kill_all()


# ---------------------------------------------------------------------------------------------
# Holes 2 and 5: the sandbox sees only what Python, the packages and the checkout need; no host
# service on a Unix socket, and nothing of the grading run's work folder but a kernel's own files

def _listen_everywhere(tmp_path: Path, monkeypatch) -> tuple[list[str], list[str], callable]:
    """Unix sockets listening where host services put theirs (each in a folder of its own, removed
    at the end): the test's temporary folder, /run, /var/run, /var/tmp, the home and runtime
    folders, /srv, /mnt, /opt, and a TMPDIR that is not /tmp (inside the checkout, which every
    sandbox sees). Returns (socket paths, connections accepted so far, cleanup)."""
    import os
    import shutil
    import socket
    import tempfile
    import threading
    import uuid

    tmpdir = ROOT / "build" / f"tmpdir-{uuid.uuid4().hex[:8]}"
    tmpdir.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    places = [tmp_path, tmpdir, Path("/run"), Path("/var/run"), Path("/var/tmp"), Path.home(),
              Path(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"), Path("/srv"), Path("/mnt"),
              Path("/opt")]
    made, paths, accepted, servers = [], [], [], []
    for place in dict.fromkeys(places):
        folder = place / f"lora-book-service-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir()  # only where the place exists: nothing of the host's layout is created
        except OSError:
            continue  # not writable here (not root): that place is not tried
        made.append(folder)
        path = str(folder / "service.sock")
        if len(path.encode()) > 100:
            continue
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        os.chmod(path, 0o777)
        srv.listen(8)
        servers.append(srv)
        paths.append(path)

        def accept(srv=srv, path=path):
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                accepted.append(path)
                conn.close()
        threading.Thread(target=accept, daemon=True).start()

    def cleanup():
        for srv in servers:
            srv.close()
        for folder in [*made, tmpdir]:
            shutil.rmtree(folder, ignore_errors=True)
    return paths, accepted, cleanup


_CONNECT = '''
import os, socket
def reached(paths):
    found = []
    for path in paths:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            found.append(path)
        except OSError:
            pass
        s.close()
    return found
'''


@needs_bwrap
def test_no_host_socket_is_reachable_from_a_grader_child(tmp_path, monkeypatch):
    import re

    paths, accepted, cleanup = _listen_everywhere(tmp_path, monkeypatch)
    try:
        monkeypatch.setenv(sandbox.MODE_ENV, "required")
        forkserver.kill_all()  # servers started before TMPDIR changed
        answer = _CONNECT + textwrap.dedent(f'''
            def lora_forward(x, W, A, B, scaling):
                raise RuntimeError("SEEN " + repr(reached({paths!r})) + " " + repr(sorted(os.listdir("/"))) + " END")
        ''')
        seen = re.search(r"SEEN (.*?) END", grade_source("ch01.1", answer).report).group(1)
        assert len(paths) >= 3, paths  # at least the test's folder, the TMPDIR in the checkout, /var/tmp
        assert seen.startswith("[] "), seen
        assert not accepted, accepted
        # the top folders Python and its packages live in are bound (/opt on the GPU image: torch's venv)
        needed = {Path(p).resolve().parts[1] for p in (sys.prefix, sys.base_prefix, os.path.dirname(torch.__file__))}
        for absent in ("run", "var", "home", "srv", "mnt", "opt"):
            if absent not in needed:
                assert f"'{absent}'" not in seen, seen
    finally:
        forkserver.kill_all()
        cleanup()


@needs_bwrap
def test_a_kernel_sees_only_its_own_files_of_the_run_whatever_tmpdir_is(tmp_path, monkeypatch):
    """TMPDIR inside the checkout (which every sandbox sees read-only): another kernel's
    connection file and ipc socket in the same run's work folder are out of reach, and so is every
    host socket; the kernel runs (its own files show)."""
    import json
    import socket
    import tempfile

    import nbformat
    from nbclient import NotebookClient
    from traitlets.config import Config

    from graders.machine.kernel_sandbox import KERNEL_NAME, install_kernelspec, ipc_folder

    paths, accepted, cleanup = _listen_everywhere(tmp_path, monkeypatch)
    try:
        work = Path(tempfile.mkdtemp(prefix="lora-book-autograde-"))  # inside the new TMPDIR
        assert work.is_relative_to(ROOT)
        install_kernelspec(work / "jupyter")
        (work / "runtime").mkdir()
        other_key = work / "runtime" / "kernel-other-student.json"
        other_key.write_text(json.dumps({"key": "the-other-kernels-key"}))
        other_ipc = ipc_folder(work)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(str(other_ipc / "kernel-1"))
        other.listen(1)
        own = tmp_path / "course" / "autograded" / "me" / "01_lora_basics"
        own.mkdir(parents=True)
        cell = _CONNECT + textwrap.dedent(f'''
            print("reached", reached({[*paths, str(other_ipc / "kernel-1")]!r}))
            print("other key", os.path.exists({str(other_key)!r}))
            print("work folder", os.path.exists({str(work / "jupyter")!r}))
        ''')
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
        config = Config()
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = str(ipc_folder(work) / "kernel")
        monkeypatch.setenv("JUPYTER_PATH", str(work / "jupyter"))
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(work / "runtime"))
        NotebookClient(nb, kernel_name=KERNEL_NAME, config=config, timeout=120,
                       resources={"metadata": {"path": str(own)}}).execute()
        text = "".join(o.get("text", "") for o in nb.cells[0].outputs)
        assert text.splitlines() == ["reached []", "other key False", "work folder False"], text
        assert not accepted
        other.close()
    finally:
        cleanup()


# ---------------------------------------------------------------------------------------------
# Hole 7: output bytes per cell, every output type

def test_every_output_type_counts_toward_a_cells_cap_and_the_cut_is_visible():
    from graders.course.output_cap import CUT_NOTE, cap_cell, cap_notebook

    limit = 1000
    big_line = {"output_type": "stream", "name": "stdout", "text": "x" * 5000}  # one line: nbgrader's limit misses it
    html = {"output_type": "display_data", "data": {"text/html": "<b>" + "y" * 5000 + "</b>"}, "metadata": {}}
    image = {"output_type": "display_data", "data": {"image/png": "i" * 5000}, "metadata": {}}
    result = {"output_type": "execute_result", "execution_count": 3, "metadata": {},
              "data": {"text/plain": "z" * 5000, "text/html": "<p>" + "z" * 5000}}
    error = {"output_type": "error", "ename": "ValueError", "evalue": "v" * 5000, "traceback": ["t" * 5000]}
    small = {"output_type": "stream", "name": "stdout", "text": "fine\n"}
    for output in (big_line, html, image, result, error):
        cell = {"cell_type": "code", "source": "", "outputs": [small, output, small]}
        assert cap_cell(cell, limit)
        outs = cell["outputs"]
        assert outs[0] == small and outs[-1]["text"].lstrip().startswith(CUT_NOTE), outs
        assert "with the 1 output(s) after it" in outs[-1]["text"]
        kept = sum(len(json.dumps(o)) for o in outs[:-1])
        assert kept < limit + 300, (output["output_type"], kept)  # the cap, plus each output's JSON keys
    untouched = {"cell_type": "code", "source": "", "outputs": [small, small]}
    assert not cap_cell(untouched, limit) and untouched["outputs"] == [small, small]
    assert cap_notebook({"cells": [{"cell_type": "code", "outputs": [big_line]}, untouched]}, limit) == 1


def test_the_live_cap_bounds_a_running_cell_and_keeps_what_decides_its_score():
    """nbgrader's worker holds a cell's outputs until the run ends: capped as they arrive (bytes,
    metadata and a cost per output, per cell and per notebook), past the cap only the note, the first
    output that decides nbgrader's grade (error, stderr that IgnorePattern keeps, execute_result) and
    the first error stay; clear_output starts the cell's count again."""
    from graders.course.output_cap import CUT_NOTE, DECISIVE_BYTES, OUTPUT_COST, LiveCap, NotebookBudget

    def run(outputs, ignore=None, limit=4000, budget=None):
        cap, outs = LiveCap(limit, ignore, budget=budget), []
        for out in outputs:
            if out == "clear":
                outs.clear()
                continue
            outs.append(dict(out))
            cap.add(outs, outs[-1])
        return outs

    def kept_bytes(outs):
        return sum(len(json.dumps(o)) for o in outs)

    line = {"output_type": "stream", "name": "stdout", "text": "x" * 300}
    flood = run([line] * 1000, limit=4300)
    per = 300 + OUTPUT_COST
    whole = 4300 // per
    assert len(flood) == whole + 2 and [len(o["text"]) for o in flood[:whole]] == [300] * whole, flood
    assert len(flood[whole]["text"]) == 4300 - whole * per - OUTPUT_COST > 0  # what fits of the crossing one
    assert flood[-1]["text"].strip().startswith(CUT_NOTE) and f"{1000 - whole - 1} output(s) whole" in flood[-1]["text"]
    error = {"output_type": "error", "ename": "AssertionError", "evalue": "e" * 9000, "traceback": ["t" * 9000] * 9}
    late = run([line] * 50 + [error, error])
    assert [o["output_type"] for o in late].count("error") == 1 and late[-2]["output_type"] == "error", late
    assert len(late[-2]["evalue"]) == DECISIVE_BYTES and len(late[-2]["traceback"]) == 3
    stderr = {"output_type": "stream", "name": "stderr", "text": "a warning here"}
    assert [o["name"] for o in run([line] * 19 + [stderr])][-2:] == ["stderr", "stdout"]  # it zeroes a grade cell
    assert all(o["name"] == "stdout" for o in run([line] * 19 + [stderr], ignore="warning"))  # IgnorePattern's
    result = {"output_type": "execute_result", "execution_count": 1, "metadata": {}, "data": {"text/plain": "0.5"}}
    assert run([line] * 19 + [result, result])[-2]["data"] == {"text/plain": "0.5"}  # partial credit, once
    assert [o["output_type"] for o in run([line] * 19 + [stderr, result])][-2:] == ["stream", "stream"]
    # the first error stays after a stderr decided the cell (nbgrader would append the reply's, uncut)
    assert [o["output_type"] for o in run([line] * 19 + [stderr, error])][-3:] == ["stream", "error", "stream"]
    cleared = run([line] * 19 + ["clear"] + [line] * 3)
    assert cleared == [line] * 3, cleared
    # red-team review of this cap: what a byte count of data alone missed
    meta = {"output_type": "display_data", "data": {}, "metadata": {"m": "y" * 50_000}}
    empty = {"output_type": "display_data", "data": {}, "metadata": {}}
    keys = {"output_type": "display_data", "data": {f"k{j}" + "x" * 5000: "" for j in range(20)}, "metadata": {}}
    objects = {"output_type": "display_data", "data": {"application/json": [{} for _ in range(20_000)]}, "metadata": {}}
    blank = {"output_type": "error", "ename": "E", "evalue": "", "traceback": [""] * 100_000}
    for flood in ([meta] * 40, [empty] * 40_000, [keys] * 40, [objects] * 40, [blank] * 3):
        outs = run(flood)
        assert kept_bytes(outs) < 4000 + 40 * 64 + DECISIVE_BYTES and outs[-1]["text"].lstrip().startswith(CUT_NOTE), \
            len(outs)
    budget = NotebookBudget(10_000)  # many cells, each under its own cap, stop at the notebook's
    cells = [run([line] * 10, budget=budget) for _ in range(10)]
    assert sum(kept_bytes(c) for c in cells) < 10_000 + 10 * 600 and CUT_NOTE in cells[-1][-1]["text"]
    assert run([{"output_type": "stream", "name": "stdout", "text": "a\ud800b"}]) != []  # a lone surrogate counts


def test_the_live_cap_through_nbclients_own_handlers():
    """The paths around ``output``: a display update replaces a kept output's data in place (cut past
    DECISIVE_BYTES), comm messages keep no widget state, and a cut display's id is forgotten."""
    from nbgrader.preprocessors import Execute

    from graders.course.output_cap import CUT_NOTE, DECISIVE_BYTES, NOTEBOOK_LIVE_BYTES, install_live_cap

    install_live_cap(limit=4000)
    try:
        ex = Execute()
        ex.reset_execution_trackers()
        ex.clear_before_next_output = False  # set by nbclient when a cell starts
        ex.nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("")])
        outs = ex.nb.cells[0].outputs

        def msg(kind, content):
            return {"msg_type": kind, "header": {"msg_type": kind}, "parent_header": {"msg_id": "m"}, "content": content}

        for i in range(40):
            data = {"data": {"text/plain": "d" * 1000}, "metadata": {}, "transient": {"display_id": f"id{i}"}}
            ex.output(outs, msg("display_data", data), f"id{i}", 0)
        assert sum(1 for o in outs if o["output_type"] == "display_data") < 5
        assert len(ex._display_id_map) == sum(1 for o in outs if o["output_type"] == "display_data"), ex._display_id_map
        big = {"data": {"text/plain": "z" * 5_000_000}, "metadata": {}, "transient": {"display_id": "id0"}}
        ex._update_display_id("id0", msg("update_display_data", big))
        assert outs[0]["data"]["text/plain"].startswith(CUT_NOTE) and len(json.dumps(outs)) < 4000 + DECISIVE_BYTES + 2000
        ex.handle_comm_msg(outs, msg("comm_msg", {"comm_id": "c", "data": {"state": {"k": "w" * 1_000_000}}}), 0)
        assert ex.widget_state == {}
        ex._update_display_id("zz", msg("update_display_data", {"data": [1], "metadata": {}}))  # an unknown id: ignored
        # nbgrader appends the reply's error when no error output of its name is there: shortened
        cell = ex.nb.cells[0]
        reply = {"content": {"status": "error", "ename": "ValueError", "evalue": "v" * 5_000_000, "traceback": ["t"] * 10}}
        ex.on_cell_executed(cell=cell, cell_index=0, execute_reply=reply)
        assert cell.outputs[-1]["output_type"] == "error" and len(cell.outputs[-1]["evalue"]) == DECISIVE_BYTES
        # nbclient resets before each notebook: the next one an Execute runs starts with a whole budget
        assert ex._lora_book_budget.left < NOTEBOOK_LIVE_BYTES and ex._lora_book_live_caps
        ex.reset_execution_trackers()
        assert ex._lora_book_budget.left == NOTEBOOK_LIVE_BYTES and ex._lora_book_live_caps == {}
    finally:
        install_live_cap()


_GRADE_CELL = {"grade": True, "grade_id": "t", "points": 1, "solution": False, "locked": True, "schema_version": 3}


@pytest.mark.slow
def test_nbgraders_execute_with_the_live_cap_holds_a_flood_to_the_cap(tmp_path):
    """A real kernel through nbgrader's Execute preprocessor (what ``grade`` runs): 8 MB printed in
    many messages and a failing grade cell after it; the cell keeps about the cap, and the grade
    cell's error (so its score of 0) survives the cut."""
    import nbformat

    from nbgrader.preprocessors import Execute
    from nbgrader.utils import determine_grade

    from graders.course.output_cap import CUT_NOTE, MAX_CELL_OUTPUT_BYTES, install_live_cap

    install_live_cap()
    flood = "import sys\nfor _ in range(400):\n    print('x' * 20000, flush=True)\n"
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(flood),
        nbformat.v4.new_code_cell(flood + "assert False, 'the answer is wrong'", metadata={"nbgrader": _GRADE_CELL}),
        nbformat.v4.new_code_cell("print('fine')", metadata={"nbgrader": {**_GRADE_CELL, "grade_id": "u"}})])
    nb, _ = Execute(timeout=120).preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    sizes = [len(json.dumps(c.outputs)) for c in nb.cells]
    assert all(s < MAX_CELL_OUTPUT_BYTES + 20_000 for s in sizes), sizes
    assert all(CUT_NOTE in c.outputs[-1].get("text", "") for c in nb.cells[:2]), [c.outputs[-1] for c in nb.cells[:2]]
    assert [o.output_type for o in nb.cells[1].outputs][-2] == "error"
    assert determine_grade(nb.cells[1])[0] == 0 and determine_grade(nb.cells[2])[0] == 1


# ---------------------------------------------------------------------------------------------
# The attacks through the README's command: `grade --jobs 2` of a class with attackers in it, with
# a TMPDIR that is not /tmp (inside the checkout, which every sandbox sees)

_FLOOD = ('print("x" * 3_000_000)\nfrom IPython.display import HTML, display\n'
          'display(HTML("<p>" + "y" * 3_000_000 + "</p>"))\n')
_SPY = textwrap.dedent('''
    import json, os, sys
    if "-f" in sys.argv:  # in the kernel (not in a grader child): every file of the run it can find
        _own = sys.argv[sys.argv.index("-f") + 1]  # its connection file (nbgrader's, in TMPDIR)
        _ipc = os.path.dirname(json.load(open(_own))["ip"])  # its ipc folder, in the run's work folder
        _seen = []
        for _top in {os.path.dirname(_own), os.path.dirname(_ipc), os.path.dirname(os.path.dirname(_ipc))}:
            for _d, _dirs, _files in os.walk(_top):
                if not _d.startswith(_ipc):
                    _seen += [os.path.join(_d, n) for n in _files if os.path.join(_d, n) != _own]
        print("SPY saw", sorted(set(_seen)))
''')
#: Red-team review 41 (H5): what of the course a spy's kernel and re-grade child can read (COURSE is
#: the course folder); its submission also ships nbgrader_config.py and gradebook.db markers. In the
#: child, reading anything fails the answer (so its score shows it).
_SPY_COURSE = textwrap.dedent('''
    _read = []
    for _p in ("gradebook.db", "nbgrader_config.py", "submitted/honest/01_lora_basics/01_lora_basics.ipynb",
               "autograded/honest/01_lora_basics/01_lora_basics.ipynb", ".lora_book_fingerprint.json"):
        try:
            open(os.path.join(COURSE, _p), "rb").close()
            _read.append(_p)
        except OSError:
            pass
    if "-f" in sys.argv:
        print("SPY read", _read)
    elif _read:
        raise RuntimeError("SPY read " + repr(_read))
''')


@needs_bwrap
@pytest.mark.slow
def test_the_grade_command_holds_against_a_class_of_attackers(tmp_path):
    import csv
    import os
    import shutil
    import subprocess
    import sys
    import uuid

    from graders.course.output_cap import CUT_NOTE, MAX_CELL_OUTPUT_BYTES
    from graders.machine.core import SECRET_ENV

    course = tmp_path / "course"
    course_mod._new_course(course)
    chapter = "01_lora_basics"
    course_mod._nbgrader(course, "generate_assignment", chapter, "--force")
    release = course / "release" / chapter / f"{chapter}.ipynb"
    right = {e: s for e, s in solution_answers().items() if e.startswith("ch01.")}
    students = {
        "honest": right,
        "flood": {**right, "ch01.1": right["ch01.1"] + _FLOOD},  # hole 7
        "malformed": {**right, "ch01.2": MALFORMED_RESULTS["results are a JSON list"] + right["ch01.2"]},  # hole 4
        "spy": {**right, "ch01.3": right["ch01.3"] + _SPY + _SPY_COURSE.replace("COURSE", repr(str(course)))},  # hole 5
        "linker": right,  # red-team review 41 (H6): a link to a host file in the submission
    }
    for student, cells in students.items():
        course_mod.build_submission(release, cells, course / "submitted" / student / chapter / f"{chapter}.ipynb")
    (course / "submitted" / "flood" / chapter / "junk.bin").write_bytes(b"0" * (1 << 20))  # hole 6: not for feedback
    for marker in ("nbgrader_config.py", "gradebook.db"):  # H5: markers of a course root decide nothing
        (course / "submitted" / "spy" / chapter / marker).write_text("c = get_config()\n")
    host_secret = tmp_path / "host-secret.txt"  # outside the course
    host_secret.write_text("HOST-ONLY SECRET " + uuid.uuid4().hex + "\n")
    (course / "submitted" / "linker" / chapter / "leak.txt").symlink_to(host_secret)
    # red-team review 41: a submission nbgrader cannot autograde stopped the whole class's run
    (course / "submitted" / "badnb" / chapter).mkdir(parents=True)
    (course / "submitted" / "badnb" / chapter / f"{chapter}.ipynb").write_text("{ this is not a notebook")
    tmpdir = ROOT / "build" / f"tmpdir-{uuid.uuid4().hex[:8]}"
    tmpdir.mkdir(parents=True)
    try:
        env = dict(os.environ, **{SECRET_ENV: "the-instructors-secret", "TMPDIR": str(tmpdir)})
        proc = subprocess.run([sys.executable, "-m", "graders.course", "grade", chapter, "--course-dir", str(course),
                               "--jobs", "2"], capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        left = sorted(p.name for p in tmpdir.iterdir())
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert not [n for n in left if n.startswith("lora-book-")], left  # hole 8: the run's work folder is gone
    with open(course / "grades.csv") as f:
        scores = {r["student_id"]: float(r["raw_score"]) for r in csv.DictReader(f)}
    assert scores == {"honest": 18.0, "flood": 18.0, "malformed": 15.0, "spy": 18.0, "badnb": 0.0,
                      "linker": 0.0}, scores
    report = proc.stdout[proc.stdout.find("Submissions nbgrader could not autograde"):].splitlines()
    assert report[1].startswith("  badnb 01_lora_basics: this submission was not autograded ("), \
        proc.stdout[-3000:]
    assert "NotJSONError" in report[1]
    assert report[2].startswith("  linker 01_lora_basics: this submission was not autograded ("
                                "UnsafeSubmissionError: "), proc.stdout[-3000:]
    assert f"submitted/linker/{chapter}/leak.txt (a symbolic link)" in report[2]
    assert not (course / "autograded" / "linker").exists()
    secret = host_secret.read_text().strip()
    assert secret not in proc.stdout + proc.stderr
    assert not [p for p in course.rglob("*") if p.is_file() and not p.is_symlink() and secret.encode() in p.read_bytes()]
    feedback = {s: (course / "feedback" / s / chapter / f"{chapter}.html") for s in students if s != "linker"}
    assert all(f.exists() for f in feedback.values()), "every student's feedback was written"
    assert sorted(p.name for p in feedback["flood"].parent.iterdir()) == sorted(
        p.name for p in feedback["honest"].parent.iterdir()), "feedback holds the page and the chapter's figures only"
    assert not (feedback["flood"].parent / "junk.bin").exists()
    flood = feedback["flood"].read_text()
    assert CUT_NOTE in flood
    assert feedback["flood"].stat().st_size < feedback["honest"].stat().st_size + 2 * MAX_CELL_OUTPUT_BYTES
    spy = feedback["spy"].read_text()
    assert "SPY saw []" in spy, spy[spy.find("SPY saw"):][:600]
    assert "SPY read []" in spy, spy[spy.find("SPY read"):][:600]


# ---------------------------------------------------------------------------------------------
# Hole 3: nothing recorded inside a rank (next to learner code) decides a grade

_FORGE = textwrap.dedent('''
    import sys
    def _forge():  # write what a counting wrapper would have recorded, in every frame above
        frame = sys._getframe(1)
        while frame is not None:
            for value in list(frame.f_locals.values()):
                if isinstance(value, dict) and not value:
                    value["all_reduce"] = 10 ** 6
            frame = frame.f_back
''')


@needs_bwrap
def test_a_ranks_own_record_of_its_collectives_decides_nothing(monkeypatch):
    """The same per-rank answer (reduce_with_base that also all-reduces t: its outputs are right,
    its traffic is not the variant's) through the watched collectives, through the unwatched
    primitive, and forging a record of what it carried: one score for all three, the one its
    outputs earn (what the collectives carry is not graded: it could only be recorded in the rank)."""
    monkeypatch.setenv(sandbox.MODE_ENV, "required")
    honest = solution_answers()["ch10.3"].replace(
        '    if variant == "reduce_shrink":\n        dist.all_reduce(y, group=group)\n',
        '    if True:\n        dist.all_reduce(y, group=group)\n').replace(
        '    if variant == "reduce_with_base":\n        dist.all_reduce(y, group=group)\n', '')
    assert honest != solution_answers()["ch10.3"]
    unwatched = honest.replace("dist.all_reduce(", "dist.distributed_c10d.all_reduce(")
    forged = _FORGE + unwatched.replace("    return y\n", "    _forge()\n    return y\n")
    assert forged.count("    _forge()\n") == 1
    scores = {name: grade_source("ch10.3", src).score for name, src in
              (("watched", honest), ("unwatched", unwatched), ("forged", forged))}
    assert scores == {"watched": 3.0, "unwatched": 3.0, "forged": 3.0}, scores


# ---------------------------------------------------------------------------------------------
# Hole 6: processes and memory bounded per sandbox, /dev/shm sized

_GREEDY = textwrap.dedent('''
    import os, subprocess
    def lora_forward(x, W, A, B, scaling):
        seen = []
        try:
            with open("/dev/shm/big", "wb") as f:
                for _ in range(10):
                    f.write(b"0" * (10 << 20))
            seen.append("100 MB in /dev/shm")
        except OSError:
            seen.append("/dev/shm bounded")
        started = []
        try:
            for _ in range(PROCESSES):
                started.append(subprocess.Popen(["sleep", "30"]))
        except OSError:
            pass
        seen.append(f"{len(started)} processes")
        for p in started:
            p.kill()
            p.wait()
        raise RuntimeError("SEEN " + ", ".join(seen) + " END")
''')


@needs_bwrap
def test_a_sandbox_has_its_own_bounds_on_processes_memory_and_shared_memory(monkeypatch):
    """As root an rlimit on processes binds nothing, and it is shared by every sandbox of a user:
    each sandbox gets its own cgroup (processes, memory) where the host allows, and /dev/shm is a
    small tmpfs everywhere."""
    import re

    from graders.machine import cgroups

    if not cgroups.available():
        pytest.skip("no writable cgroup here: processes and memory are bounded by rlimits only (README)")
    monkeypatch.setenv(sandbox.MODE_ENV, "required")
    monkeypatch.setenv(cgroups.MEMORY_ENV, "1536")
    forkserver.kill_all()
    try:
        answer = _GREEDY.replace("PROCESSES", str(cgroups.PIDS_MAX + 40))
        seen = re.search(r"SEEN (.*?) END", grade_source("ch01.1", answer).report).group(1).split(", ")
        assert seen[0] == "/dev/shm bounded", seen
        assert int(seen[1].split()[0]) < cgroups.PIDS_MAX, seen
        hog = "def lora_forward(x, W, A, B, scaling):\n    hold = bytearray(3 << 30)\n    return hold\n"
        result = grade_source("ch01.1", hog)
        assert result.score == 0 and "exit code -9" in result.report, result.report  # the OOM killer, in its cgroup
    finally:
        forkserver.kill_all()


_SPOOF = ("class GraderObservation(Exception):\n    pass\n\n\n"
          "def {name}(*args, **kwargs):\n    raise GraderObservation('the reference failed here: full marks recorded')\n")


@pytest.mark.parametrize("exercise_id, func", [("ch07.1", "batch_info_from_requests"), ("ch10.3", "row_parallel_lora")],
                         ids=["in the child", "in a rank"])
def test_an_answer_cannot_pass_its_own_exception_off_as_the_graders_observation(exercise_id, func):
    """The report says "the grader observed: ..." only for what a driver saw (graders.chapters.tp_ranks'
    GraderObservation, raised outside the answer cell); an answer cell's class of that name, raised in
    the child or in a tensor-parallel rank, is reported as what it raised (helper-26's review)."""
    result = grade_source(exercise_id, _SPOOF.format(name=func))
    assert result.score == 0, result.report
    assert "the grader observed" not in result.report, result.report
    assert "full marks recorded" in result.report and "raised" in result.report, result.report


# ---------------------------------------------------------------------------------------------
# Checks recorded in the child, next to the answer's own code (host reads, a tensor made on the
# default device, a result that aliases an input, inputs changed in a tensor-parallel rank): an
# answer runs in the process that records them, so one written to defeat them can; what holds is
# that every such answer is listed for the instructor (graders.course.tamper, "Answer cells to look
# at" of `grade` and `verify`). The catalogue: each way found to switch a record off, by the record.

_FN = "def batch_info_from_requests(*args, **kwargs):\n    return None\n"
CHILD_RECORD_DEFEATS = {
    # helper-26's: the runner's context manager replaced by one that records nothing
    "host reads: the runner's watcher replaced": (
        "ch07.1", "import contextlib\nimport graders.machine.runner as r\n"
                  "r.watching_host_reads = lambda device, enabled: contextlib.nullcontext([])\n" + _FN),
    "host reads: the runner reached through sys.modules": (
        "ch07.1", "import sys\nsetattr(sys.modules['graders.machine.runner'], 'HOST_READS', frozenset())\n" + _FN),
    "host reads: torch function modes switched off": (
        "ch07.1", "import torch\ndef batch_info_from_requests(t):\n"
                  "    with torch._C.DisableTorchFunction():\n        return t.tolist()\n"),
    "host reads: the mode popped off torch's stack": (
        "ch07.1", "from torch.overrides import _pop_mode_temporarily\ndef batch_info_from_requests(t):\n"
                  "    with _pop_mode_temporarily():\n        return t.tolist()\n"),
    "host reads: through the raw storage": (
        "ch07.1", "def batch_info_from_requests(t):\n    return t.untyped_storage().tolist()\n"),
    "host reads: the code renamed out of the answer cell": (
        "ch07.1", "def _reads(t):\n    return t.tolist()\n"
                  "_reads.__code__ = _reads.__code__.replace(co_filename='/usr/lib/python3/heapq.py')\n" + _FN),
    "host reads: code built at run time under another name": (
        "ch07.1", "_ns = {}\nexec(compile('def f(t): return t.tolist()', '/usr/lib/python3/x.py', 'exec'), _ns)\n" + _FN),
    "host reads: the GPU's synchronization report switched off": (
        "ch07.3", "import torch\ntorch.cuda.set_sync_debug_mode(0)\n"),
    "default device: the recorder's frame walk replaced": (
        "ch07.1", "from graders.machine import runner\nrunner._answer_frame = lambda: None\n" + _FN),
    "default device: read and reset in the answer": (
        "ch07.1", "import torch\ndef batch_info_from_requests(*a):\n    torch.set_default_device('cpu')\n"),
    "aliasing: the record replaced": (
        "ch09.1", "import graders.machine.runner\ngraders.machine.runner._alias_of = lambda returned, args: None\n"),
    "an input changed in a rank: the rank's comparison replaced": (
        "ch10.3", "from graders.chapters import tp_ranks\ntp_ranks._same = lambda a, b: True\n"),
    "any record: the runner's globals reached from a frame": (
        "ch10.3", "import sys\ndef row_parallel_lora(*a):\n    sys._getframe(1).f_globals['encode'] = None\n"),
    "any record: the runner's objects found through the collector": (
        "ch07.1", "import gc\n_mine = [o for o in gc.get_objects() if getattr(o, '__name__', '') == 'run_one']\n"),
    # helper-27's review: each was graded full marks with no finding before the scan learned it
    "host reads: the runner resolved from a string": (
        "ch07.1", "import pkgutil\n_m = pkgutil.resolve_name('graders.machine.runner')\n_m.HOST_READS = frozenset()\n"
                  + _FN),
    "host reads: the runner through vars() of the package": (
        "ch07.1", "import graders\n_m = vars(vars(graders)['machine'])['runner']\n_m.HOST_READS = frozenset()\n" + _FN),
    "host reads: the package passed to a function": (
        "ch07.1", "import graders\ndef _quiet(g):\n    g.machine.runner.HOST_READS = frozenset()\n_quiet(graders)\n" + _FN),
    "host reads: read in another thread (function modes are per thread)": (
        "ch07.1", "from concurrent.futures import ThreadPoolExecutor\ndef batch_info_from_requests(t):\n"
                  "    with ThreadPoolExecutor(1) as pool:\n        return pool.submit(t.tolist).result()\n"),
    "host reads: a tensor's bytes through pickle": (
        "ch07.1", "import pickle\ndef batch_info_from_requests(t):\n    return pickle.dumps(t)\n"),
    "default device: a tensor made in another thread": (
        "ch02.1", "import threading\nimport torch\ndef f(n):\n    out = []\n"
                  "    th = threading.Thread(target=lambda: out.append(torch.zeros(n)))\n    th.start()\n    th.join()\n"
                  "    return out[0]\n"),
    "aliasing: a tensor subclass answering for its own storage": (
        "ch01.2", "import torch\nclass _Weight(torch.Tensor):\n    def untyped_storage(self):\n        return None\n"),
    "an input changed in a rank: Tensor.__eq__ patched through type()": (
        "ch10.3", "def row_parallel_lora(x_local, *a):\n    type(x_local).__eq__ = lambda p, q: p.new_ones(p.shape, dtype=bool)\n"),
    "an input changed in a rank: tp_ranks resolved from a string": (
        "ch10.3", "import pkgutil\n_t = pkgutil.resolve_name('graders.chapters.tp_ranks')\n_t._same = lambda a, b: True\n"),
    # helper-28's review, a second round
    "host reads: torch passed to a function, its modes switched off there": (
        "ch07.1", "def _read(m, t):\n    with m._C.DisableTorchFunction():\n        return int(t.max())\n"
                  "def batch_info_from_requests(t):\n    return _read(torch, t)\n"),
    "host reads: the runner through a function's __globals__ by getattr": (
        "ch07.1", "import graders\n_g = getattr(graders.check, '__globals__')\n" + _FN),
    "host reads: raw storage by getattr": (
        "ch07.1", "def batch_info_from_requests(t):\n    return getattr(t, 'untyped_storage')().tolist()\n"),
    "host reads: the storage a pickle reduction holds": (
        "ch07.1", "def batch_info_from_requests(t):\n    return t.__reduce_ex__(2)[1][0]._untyped_storage.tolist()\n"),
    "host reads: the bytes torch.save writes": (
        "ch07.1", "import io\ndef batch_info_from_requests(t):\n    buf = io.BytesIO()\n    torch.save(t, buf)\n"
                  "    return buf.getvalue()\n"),
    "host reads: a DLPack capsule handed to numpy": (
        "ch07.1", "import numpy as np\ndef batch_info_from_requests(t):\n"
                  "    return torch.utils.dlpack.to_dlpack(t)\n"),
    "host reads: a data pointer behind numpy's array interface": (
        "ch07.1", "def batch_info_from_requests(t):\n    return t.data_ptr()\n"),
    "default device: a legacy constructor (always on the CPU)": (
        "ch02.1", "def f(n):\n    return torch.IntTensor(n).zero_()\n"),
    "aliasing: Tensor.untyped_storage patched through a name bound to type()": (
        "ch01.2", "def merge_lora(W, A, B, scaling):\n    T = type(W)\n    orig = getattr(T, 'numel')\n"
                  "    setattr(T, 'numel', lambda self: 0)\n    return W\n"),
    "an input changed in a rank: torch.equal patched through torch passed as a value": (
        "ch10.3", "def _everywhere(m):\n    m.equal = lambda a, b: True\n"
                  "def row_parallel_lora(x_local, *a):\n    _everywhere(torch)\n"),
}


@pytest.mark.parametrize("exercise_id, source", CHILD_RECORD_DEFEATS.values(), ids=CHILD_RECORD_DEFEATS.keys())
def test_an_answer_written_to_switch_off_a_record_in_its_child_is_listed_for_the_instructor(exercise_id, source):
    """Every way found to defeat a check recorded next to the answer's code is a finding of the scan
    that `grade` and `verify` print under "Answer cells to look at" (the README's threat model)."""
    from graders.course.tamper import suspicious_code

    assert suspicious_code(source, exercise_id), source


def test_a_host_read_made_for_the_answer_by_a_helper_it_calls_is_the_answers():
    """The host-read record walks past every frame that is neither the answer cell's nor the graders'
    or the reference's: a pure-Python helper of the standard library reading a tensor for the answer
    (``statistics.fmean`` calls ``float`` on each element from statistics.py) is recorded; before,
    only the first frame outside torch was looked at and the read went unseen. The reference's own
    reads stay exempt (the learner may call it)."""
    from graders.machine import runner

    namespace: dict = {}
    cell = ("import statistics\nfrom reference.lora_math import lora_forward\n"
            "def through_the_stdlib(t):\n    return statistics.fmean(t)\n"
            "def through_the_reference(x, W, A, B):\n    return lora_forward(x, W, A, B, 1.0)\n")
    exec(compile(cell, "<answer cell test>", "exec"), namespace)
    with runner.watching_host_reads(torch.device("cpu"), True) as reads:
        namespace["through_the_stdlib"](torch.arange(4.0))
    assert reads and all("<answer cell" not in r or "answer cell line 4" in r for r in reads), reads
    assert any("answer cell line 4" in r for r in reads), reads
    x, W, A, B = torch.randn(2, 8), torch.randn(8, 8), torch.randn(2, 8), torch.randn(8, 2)
    with runner.watching_host_reads(torch.device("cpu"), True) as reads:
        namespace["through_the_reference"](x, W, A, B)
    assert reads == [], reads


_HONEST_READS = {  # helper-27's review: host reads torch makes inside a method it runs without the mode
    "np.asarray": "np.asarray(t).tolist()",
    "np.array": "int(np.array(t).max())",
    "np.from_dlpack": "int(np.from_dlpack(t).max())",
    "repr": "repr(t)",
    "str": "str(t)",
    "print": "print(t)",
    "in": "3 in t",
    # helper-28's review: sizes read from the values (a GPU waits for them), complex(t), a Python callback
    "a 0-d tensor as a size": "t.new_empty(2, t.max())",
    "a 0-d tensor as a factory's size": "torch.zeros(t.max())",
    "a 0-d tensor as a slice bound": "t[:t.max()]",
    "a 0-d tensor as a view's size": "t.view(-1, t.min() + 2)",
    "a boolean mask": "t[t > 2]",
    "nonzero": "torch.nonzero(t)",
    "unique": "torch.unique(t)",
    "repeat_interleave by a tensor": "torch.repeat_interleave(t, t)",
    "one-argument where": "torch.where(t > 1)",
    "complex": "complex(t.max())",
    "apply_": "t.clone().apply_(lambda v: v)",
}
#: Code that only looks at shapes, dtypes and devices, or that gathers on the device: no host read.
_NOT_READS = {
    "torch.from_dlpack (a view)": "torch.from_dlpack(t)",
    "a tensor index (a gather)": "t[t]",
    "a 0-d tensor index": "t[t[0]]",
    "a size from the shape": "t.new_zeros(t.shape[0], 3)",
    "three-argument where": "torch.where(t > 1, t, 0)",
    "repeat_interleave with output_size": "torch.repeat_interleave(t, t, output_size=15)",
    "masked_fill": "t.masked_fill(t > 2, 0)",
    "index_select": "t.index_select(0, t[:2])",
    "a 0-d tensor added": "t + t.max()",
    "shape and dtype in an f-string": "f'{t.shape} {t.dtype} {t.device}'",
}


@pytest.mark.parametrize("expression", _NOT_READS.values(), ids=list(_NOT_READS))
def test_code_that_reads_no_value_is_not_charged(expression):
    from graders.machine import runner

    namespace: dict = {"torch": torch}
    exec(compile(f"def read(t):\n    return {expression}\n", "<answer cell test>", "exec"), namespace)
    with runner.watching_host_reads(torch.device("cpu"), True) as reads:
        namespace["read"](torch.arange(6))
    assert reads == [], reads


@pytest.mark.parametrize("source", [
    "from os import getenv\nDEBUG = getenv('LORA_DEBUG')\n",
    "from os.path import join\nWHERE = join('a', 'b')\n",
    "class Counter:\n    calls = 0\n\n    def forward(self, x):\n        type(self).calls += 1\n        return x\n",
    "import torch\ndef f(x):\n    return torch.zeros_like(x, device=x.device)\n",
], ids=["a function imported from os", "os.path.join imported", "a counter on the cell's own class", "torch used"])
def test_honest_code_is_not_listed_by_the_new_rules(source):
    """helper-28's false positives of the scan's second round, each answered."""
    from graders.course.tamper import suspicious_code

    assert suspicious_code(source, "ch07.1") == [], suspicious_code(source, "ch07.1")


@pytest.mark.parametrize("expression", _HONEST_READS.values(), ids=list(_HONEST_READS))
def test_a_host_read_through_numpy_printing_sizes_or_masks_is_recorded(expression):
    """Tensor methods that torch runs with the function modes off (so the reads inside them go
    unseen) are host reads themselves: np.asarray / np.array / np.from_dlpack, repr / str / print,
    `value in tensor`. Each is recorded at the answer cell's line. (Pickling a tensor reads its storage
    without passing through the modes at all: the pickle module is a finding of the review scan.)"""
    import contextlib
    import io

    from graders.machine import runner

    namespace: dict = {}
    cell = f"import torch\nimport numpy as np\ndef read(t):\n    return {expression}\n"
    exec(compile(cell, "<answer cell test>", "exec"), namespace)
    with contextlib.redirect_stdout(io.StringIO()), runner.watching_host_reads(torch.device("cpu"), True) as reads:
        namespace["read"](torch.arange(6))
    assert reads and "answer cell line 4" in reads[0], reads


#: An int subclass whose __int__ reads a tensor, returned in a field the encoder turns into an int
#: after the answer returned (helper-27's review): still inside the record's watch.
_LAZY_INT = textwrap.dedent('''
    class _Later(int):
        def __new__(cls, t):
            self = super().__new__(cls, 0)
            self.t = t
            return self

        def __int__(self):
            return int(self.t.max())
''')


def test_a_read_the_encoder_makes_of_the_answers_own_value_is_recorded():
    honest = solution_answers()["ch07.1"]
    lazy = honest.replace("max_len=max(req_lens, default=0)", "max_len=_Later(torch.tensor([0, *req_lens]))")
    assert lazy != honest
    result = grade_source("ch07.1", lazy + _LAZY_INT)
    assert result.score < 3.0 and "int(tensor)" in result.report, result.report


_SUBCLASS_ALIAS = textwrap.dedent('''
    class _Weight(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            out = super().__torch_function__(func, types, args, kwargs or {})
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out

        def untyped_storage(self):
            return _Nowhere()


    class _Nowhere:
        def data_ptr(self):
            return -1
''')


def test_the_aliasing_and_in_rank_records_read_through_torchs_own_methods():
    """helper-27's review: a returned Tensor subclass whose untyped_storage() answers for itself hid a
    result that is its input (ch01.2's merged weight returned as W when scaling is 0), and a rank's
    `Tensor.__eq__` patched through type(y) made a changed input compare unchanged (ch10.3). The
    records now read storage through torch.Tensor's own methods with subclass overrides off, and
    compare with torch.equal: each answer scores what its honest twin does (and is listed for review)."""
    merged = solution_answers()["ch01.2"]
    honest = merged.replace("    delta = scaling", "    if scaling == 0:\n        return W\n    delta = scaling", 1)
    assert honest != merged
    hidden = honest.replace("        return W\n", "        return W.as_subclass(_Weight)\n", 1) + _SUBCLASS_ALIAS
    scores = {name: grade_source("ch01.2", src).score for name, src in (("honest", honest), ("hidden", hidden))}
    assert scores["honest"] < 3.0 and scores["hidden"] == scores["honest"], scores

    folded = solution_answers()["ch10.3"].replace(
        "    delta = scalings[slots].unsqueeze(1).to(y.dtype) * torch.einsum(\"tr,tor->to\", t, Bt)\n",
        "    A_local.mul_(2.0)\n    delta = scalings[slots].unsqueeze(1).to(y.dtype) * torch.einsum(\"tr,tor->to\", t, Bt)\n")
    assert folded != solution_answers()["ch10.3"]
    patched = folded.replace("    return y\n", "    type(y).__eq__ = lambda a, b: a.new_ones(a.shape, dtype=bool)\n"
                                               "    return y\n")
    assert patched.count("type(y).__eq__") == 1
    results = {name: grade_source("ch10.3", src) for name, src in (("honest", folded), ("patched", patched))}
    assert results["honest"].score == results["patched"].score == 0.0, {k: r.score for k, r in results.items()}
    assert "modified its input 'A_local'" in results["patched"].report, results["patched"].report
