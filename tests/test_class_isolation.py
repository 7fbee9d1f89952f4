"""Issue #31, the second round of attacks on grading, each as a kind: one student must not reach
another student, the host, or the whole class's grading run. Every attack is bounded (files of a
few MB, no process left running) and each test checks its effect, not the mechanism: the scores
equal the honest ones, nothing was reached, the run completes for every other student."""
from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

import graders.course as course_mod
from graders import forkserver, sandbox
from graders.core import grade_source
from graders.mutation import solution_answers

ROOT = Path(__file__).resolve().parents[1]
needs_bwrap = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap (bwrap) cannot run here")

# ---------------------------------------------------------------------------------------------
# Hole 4: whatever a child returns is data; a malformed result costs its answer, never the run

#: Answers to ch01.1 that replace a piece of the graders in their own child (at the cell's top
#: level, as a chapter-11 cell replaced the capstone's driver), so the files the comparer reads are
#: not what graders.runner writes.
MALFORMED_RESULTS = {
    "results are a JSON list": "import graders.runner as r\nr.write_json = lambda obj, path: open(path, 'w').write('[1, 2]')\n",
    "results are not JSON": "import graders.runner as r\nr.write_json = lambda obj, path: open(path, 'w').write('{')\n",
    "a tensor that is not there": "import graders.runner as r\nr.encode = lambda *a: {'tensor': 'nowhere', 'device': 'cpu'}\n",
    "a returned value of the wrong type": (
        "import graders.runner as r\nwrite = r.write_json\n"
        "r.write_json = lambda obj, path: write({**obj, 'returned': {'tensor': ['x']}} if isinstance(obj, dict) else obj, path)\n"),
    "tensors that are not safetensors": (
        "import graders.runner as r\nr.save_tensors = lambda t, path: open(path, 'wb').write(b'not safetensors at all')\n"),
    "a load error that is not text": (
        "import graders.runner as r\nr.write_json = lambda obj, path: open(path, 'w').write('{\"error\": 5}')\n"
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
            metadata={"nbgrader": {"grade_id": ex.replace(".", "_") + "_answer"}}) for ex, src in cells.items()]),
            nb / f"{chapter}.ipynb")

    def fake_grade(ex, source):
        if source.startswith("BROKEN"):
            raise TypeError("'NoneType' object is not subscriptable")
        return SimpleNamespace(score=3.0)

    monkeypatch.setattr(course_mod, "_course_settings", lambda c, a: {
        "source": course / "source", "autograded": course / "autograded", "course_id": "c",
        "db_url": f"sqlite:///{course / 'gradebook.db'}"})
    monkeypatch.setattr(course_mod, "_recorded_fingerprint", lambda c: None)
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
        for folder in ("/tmp", "/dev/shm"):
            seen += [os.path.join(folder, n) for n in os.listdir(folder) if not n.startswith("lora-book-jobs-")]
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

    from graders.core import triton_cache_scope

    monkeypatch.setenv(sandbox.MODE_ENV, "required")
    forkserver.kill_all()
    scopes = (tmp_path / "a", tmp_path / ("a" if students == "one server reused" else "b"))
    with triton_cache_scope(scopes[0]):
        planted = grade_source("ch01.1", _PLANT).report
    assert "PLANTED [" in planted and "/tmp" in planted, planted  # the attack did write where it could
    with triton_cache_scope(scopes[1]):
        seen = re.search(r"SEEN (.*?) END", grade_source("ch01.1", _LOOK).report).group(1)
    assert seen == "[]", seen
    servers = [s for s in forkserver._ALL if s.kind == "cpu"]
    assert {s.scope for s in servers} == set(scopes), "servers are keyed by student"
    forkserver.kill_all()
