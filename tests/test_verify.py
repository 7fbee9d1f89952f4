"""``python -m graders.course verify`` on a small real course (chapter 01, two students): it refuses
input it cannot verify without changing anything, finds and corrects grade fields written into
gradebook.db behind the graders' back, compares the graders' files with a recorded fingerprint,
and points at answer cells by what their code does (graders.course.tamper), never by what they say."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

import graders.course.jobs as course_mod
from graders.course.__main__ import main
from graders.course.jobs import (FINGERPRINT_FILE, CourseError, GradebookFix, GradersChanged, LookAtThis, Mismatch,
                                 _nbgrader, _new_course, build_submission, exercise_of, parse_answers, trusted_regrade)
from graders.course.integrity import check_fingerprint, fingerprint
from graders.course.mutation import apply_edits, load_catalogue, sample_learner, solution_answers
from graders.course.tamper import suspicious_code
from graders.machine.core import SECRET_ENV

ROOT = Path(__file__).resolve().parents[1]
A = "01_lora_basics"
SECRET = "tests-fixed-secret"
HONEST_COMMENT = "# the tolerances are the ones in graders/machine/tolerances.py, as the exercise says\n"


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    """generate_assignment 01_lora_basics; ``honest`` (the solution cells) and ``mistaken`` (the
    plausible mistakes of ch01), both autograded; nothing verified yet."""
    root = tmp_path_factory.mktemp("verify") / "course"
    _new_course(root)
    env = dict(os.environ, **{SECRET_ENV: SECRET})
    _nbgrader(root, "generate_assignment", A, "--force", env=env)
    release = root / "release" / A / f"{A}.ipynb"
    honest = {ex: src for ex, src in sample_learner("all_correct").items() if ex.startswith("ch01.")}
    honest["ch01.2"] = HONEST_COMMENT + honest["ch01.2"]  # a comment that cites the graders
    mistaken = {ex: src for ex, src in sample_learner("plausible_mistakes").items() if ex.startswith("ch01.")}
    build_submission(release, honest, root / "submitted" / "honest" / A / f"{A}.ipynb")
    build_submission(release, mistaken, root / "submitted" / "mistaken" / A / f"{A}.ipynb")
    course_mod.write_fingerprint(root)  # before autograde, as the README's standalone path says
    _nbgrader(root, "autograde", A, "--create", "--force", env=env)
    return root


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _copy(course: Path, dest: Path) -> Path:
    shutil.copytree(course, dest)
    return dest


def _grade_id(db: sqlite3.Connection, student: str, cell: str) -> str:
    return db.execute(
        "SELECT grade.id FROM grade JOIN base_cell ON grade.cell_id = base_cell.id "
        "JOIN submitted_notebook ON grade.notebook_id = submitted_notebook.id "
        "JOIN submitted_assignment ON submitted_notebook.assignment_id = submitted_assignment.id "
        "WHERE submitted_assignment.student_id = ? AND base_cell.name = ?", (student, cell)).fetchone()[0]


def _scores(course: Path) -> dict[tuple[str, str], tuple]:
    with sqlite3.connect(course / "gradebook.db") as db:
        rows = db.execute(
            "SELECT submitted_assignment.student_id, base_cell.name, grade.auto_score, grade.manual_score, "
            "grade.extra_credit FROM grade JOIN base_cell ON grade.cell_id = base_cell.id "
            "JOIN submitted_notebook ON grade.notebook_id = submitted_notebook.id "
            "JOIN submitted_assignment ON submitted_notebook.assignment_id = submitted_assignment.id").fetchall()
    return {(s, c): tuple(rest) for s, c, *rest in rows}


# ---------------------------------------------------------------------------------------------
# Refusals: exit 2, one line, nothing written


def test_refuses_a_folder_that_is_not_a_course_and_creates_no_gradebook(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "graders.course", "verify", A, "--course-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"verify: {tmp_path} is not an nbgrader course folder (no nbgrader_config.py); "
        "pass the course root with --course-dir"]
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_course_without_a_gradebook(tmp_path, capsys):
    shutil.copy(ROOT / "nbgrader_config.py", tmp_path / "nbgrader_config.py")
    assert main(["verify", A, "--course-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verify: no gradebook at ") and "run nbgrader autograde" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "gradebook.db").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown assignment", "no source folder", "no autograded submissions"])
def test_refuses_what_it_cannot_verify_and_changes_nothing(course, tmp_path, capsys, case):
    root = _copy(course, tmp_path / "course")
    assignment = "01_lora_basic" if case == "unknown assignment" else A  # a typo
    if case == "no source folder":
        shutil.rmtree(root / "notebooks" / A)
    if case == "no autograded submissions":
        shutil.rmtree(root / "autograded")
    before = _sha(root / "gradebook.db")
    assert main(["verify", assignment, "--course-dir", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert {"unknown assignment": "is unknown to the gradebook", "no source folder": "has no source folder",
            "no autograded submissions": "no autograded submissions of"}[case] in err
    assert _sha(root / "gradebook.db") == before
    with pytest.raises(CourseError):
        trusted_regrade(root, assignment, SECRET)


# ---------------------------------------------------------------------------------------------
# The instructor sequence: fingerprint, autograde (the fixture), verify


@pytest.mark.slow
def test_honest_course_verifies_cleanly_against_its_fingerprint(course, capsys):
    assert main(["fingerprint", "--course-dir", str(course)]) == 0
    recorded = json.loads((course / FINGERPRINT_FILE).read_text())["files"]
    assert "graders/machine/core.py" in recorded and "reference/lora_math.py" in recorded
    assert main(["verify", A, "--course-dir", str(course)]) == 0  # conftest: LORA_BOOK_SECRET=SECRET
    out = capsys.readouterr().out
    assert "matched the fingerprint" in out
    assert "Every notebook test cell agreed with the trusted re-grade." in out
    assert "Answer cells to look at" not in out  # the comment citing graders/machine/tolerances.py is no finding
    assert "Gradebook fields" not in out
    scores = _scores(course)
    for ex in range(1, 7):
        assert scores[("honest", f"ch01_{ex}_test")] == (3.0, 3.0, 0.0)
        assert scores[("mistaken", f"ch01_{ex}_test")] == (0.0, 0.0, 0.0)


@pytest.mark.slow
def test_forged_gradebook_fields_are_found_and_corrected(course, tmp_path):
    root = _copy(course, tmp_path / "course")
    with sqlite3.connect(root / "gradebook.db") as db:  # what learner code can do during autograde
        db.execute("UPDATE grade SET extra_credit = 5 WHERE id = ?", (_grade_id(db, "mistaken", "ch01_3_test"),))
        db.execute("UPDATE grade SET extra_credit = -2 WHERE id = ?", (_grade_id(db, "honest", "ch01_5_test"),))
        db.execute("UPDATE grade SET manual_score = 3 WHERE id = ?", (_grade_id(db, "mistaken", "ch01_1_test"),))
        db.execute("UPDATE grade SET auto_score = 3, needs_manual_grade = 1 WHERE id = ?",
                   (_grade_id(db, "mistaken", "ch01_2_test"),))
        db.execute("UPDATE grade_cells SET max_score = 30 WHERE id = "
                   "(SELECT id FROM base_cell WHERE name = 'ch01_4_test')")
        notebook = db.execute("SELECT notebook_id FROM grade WHERE id = ?",
                              (_grade_id(db, "mistaken", "ch01_1_test"),)).fetchone()[0]
        answer_cell = db.execute("SELECT id FROM base_cell WHERE name = 'ch01_1_answer'").fetchone()[0]
        db.execute("INSERT INTO grade (id, notebook_id, cell_id, auto_score, needs_manual_grade) "
                   "VALUES (?, ?, ?, 10, 0)", (uuid.uuid4().hex, notebook, answer_cell))
        db.execute("UPDATE submitted_notebook SET late_submission_penalty = -4 WHERE id = ?", (notebook,))
        bonus = uuid.uuid4().hex  # a graded cell of its own, worth 100
        db.execute("INSERT INTO base_cell (id, name, notebook_id, type) SELECT ?, 'bonus', notebook_id, "
                   "'GradeCell' FROM base_cell WHERE id = ?", (bonus, answer_cell))
        db.execute("INSERT INTO grade_cells (id, max_score, cell_type) VALUES (?, 100, 'code')", (bonus,))
        db.execute("INSERT INTO grade (id, notebook_id, cell_id, auto_score, needs_manual_grade) "
                   "VALUES (?, ?, ?, 100, 0)", (uuid.uuid4().hex, notebook, bonus))
    scores, findings = trusted_regrade(root, A, SECRET)
    assert scores == {"honest": {f"ch01.{i}": 3.0 for i in range(1, 7)},
                      "mistaken": {f"ch01.{i}": 0.0 for i in range(1, 7)}}
    fixes = sorted(str(f) for f in findings if isinstance(f, GradebookFix))
    assert fixes == sorted([
        "every student ch01.4: max_score 30 in the gradebook, graders/machine/points.py gives 3; corrected",
        "student honest ch01.5: extra_credit -2 in the gradebook, not given by the graders; reset to 0",
        "student mistaken ch01.3: extra_credit 5 in the gradebook, not given by the graders; reset to 0",
        "student mistaken ch01.1: manual_score 3 in the gradebook, not given by the graders; recorded 0",
        "student mistaken ch01.2: marked as needing manual grading in the gradebook; the trusted score is "
        "recorded instead",
        f"student mistaken {A}: late_submission_penalty -4 (a bonus) in the gradebook; reset to 0",
        f"student mistaken {A}/ch01_1_answer: a grade of a cell that is not a graded cell of the source "
        "notebook (score 10); removed",
        f"every student {A}/bonus: a graded cell that is not in the source notebook, max_score 100; set to 0",
        f"student mistaken {A}/bonus: a grade of a cell that is not a graded cell of the source notebook "
        "(score 100); removed",
    ])
    assert [(m.student, m.exercise, m.kernel, m.trusted) for m in findings if isinstance(m, Mismatch)] == [
        ("mistaken", "ch01.2", 3.0, 0.0)]
    assert not [f for f in findings if isinstance(f, LookAtThis)]
    # what nbgrader's export and feedback read: the trusted totals
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", course_id="multi-lora-serving") as gb:
        honest, mistaken = gb.find_submission(A, "honest"), gb.find_submission(A, "mistaken")
        assert (honest.score, mistaken.score, mistaken.late_submission_penalty) == (18.0, 0.0, 0.0)
        assert gb.find_assignment(A).max_score == 18.0
    # a second verify finds nothing left to correct
    _, again = trusted_regrade(root, A, SECRET)
    assert not [f for f in again if isinstance(f, GradebookFix)]


@pytest.mark.slow
def test_without_a_recorded_fingerprint_verify_refuses_and_changes_nothing(course, tmp_path, capsys):
    """Issue #31 hole 8: after an autograde that ran learner code unsandboxed (a plain nbgrader
    autograde), the graders on disk may have been rewritten; without a fingerprint recorded before
    it, nothing shows they were not, so verify re-grades nothing."""
    root = _copy(course, tmp_path / "course")
    (root / FINGERPRINT_FILE).unlink()
    before = _sha(root / "gradebook.db")
    assert main(["verify", A, "--course-dir", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("verify: no fingerprint of the graders recorded"), err
    assert "python -m graders.course fingerprint" in err
    assert _sha(root / "gradebook.db") == before
    with pytest.raises(CourseError, match="no fingerprint"):
        trusted_regrade(root, A, SECRET)


@pytest.mark.slow
def test_a_changed_grader_file_before_the_regrade_is_refused(course, tmp_path, capsys):
    root = _copy(course, tmp_path / "course")
    assert main(["fingerprint", "--course-dir", str(root)]) == 0
    data = json.loads((root / FINGERPRINT_FILE).read_text())
    data["files"]["graders/machine/core.py"] = "0" * 64  # as if core.py was rewritten after the fingerprint
    (root / FINGERPRINT_FILE).write_text(json.dumps(data))
    before = _sha(root / "gradebook.db")
    assert main(["verify", A, "--course-dir", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("verify: the graders' files changed during grading (found before verify's re-grade): "
                          "graders/machine/core.py changed (sha256 000000000000... recorded")
    assert len(err.splitlines()) == 1
    assert _sha(root / "gradebook.db") == before


@pytest.mark.slow
def test_a_grader_file_changed_during_the_regrade_is_refused(course, tmp_path, monkeypatch):
    root = _copy(course, tmp_path / "course")
    course_mod.write_fingerprint(root)
    calls = []

    def changed_on_second_call(recorded):  # a detached learner process rewrote a file mid-grade
        calls.append(1)
        return [] if len(calls) == 1 else ["graders/machine/tolerances.py changed"]

    monkeypatch.setattr(course_mod, "check_fingerprint", changed_on_second_call)
    monkeypatch.setattr(course_mod, "grade_source", lambda ex, source: SimpleNamespace(score=3.0))
    before = _sha(root / "gradebook.db")
    with pytest.raises(GradersChanged, match=r"found after verify's re-grade\): graders/machine/tolerances.py changed"):
        trusted_regrade(root, A, SECRET)
    assert _sha(root / "gradebook.db") == before


@pytest.mark.slow
def test_answer_cells_are_pointed_at_by_what_their_code_does(course, tmp_path, monkeypatch):
    root = _copy(course, tmp_path / "course")
    path = root / "autograded" / "mistaken" / A / f"{A}.ipynb"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if exercise_of(cell) == "ch01.4":
            cell.source = 'import sys\n\nsys.modules["grad" + "ers"].check = lambda *a: 3.0\n' + cell.source
    nbformat.write(nb, path)
    monkeypatch.setattr(course_mod, "grade_source", lambda ex, source: SimpleNamespace(score=0.0))
    _, findings = trusted_regrade(root, A, SECRET)
    look = [f for f in findings if isinstance(f, LookAtThis)]
    assert [(f.student, f.exercise) for f in look] == [("mistaken", "ch01.4")]  # honest's comment: nothing
    assert any("line 3: reads or changes sys.modules" in line for line in look[0].lines)
    assert all(line.endswith("(look at this)") for line in look[0].lines)


@pytest.mark.slow
def test_an_answer_importing_its_own_reference_keeps_its_score_and_is_pointed_at(course, tmp_path, monkeypatch):
    """Issue #31: ``from reference.lora_math import lora_scaling`` as ch01.4's answer scores full
    marks (it is the reference); the re-grade keeps that score and lists the cell for the instructor."""
    root = _copy(course, tmp_path / "course")
    path = root / "autograded" / "mistaken" / A / f"{A}.ipynb"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if exercise_of(cell) == "ch01.4":
            cell.source = "from reference.lora_math import lora_scaling\n"
    nbformat.write(nb, path)
    monkeypatch.setattr(course_mod, "grade_source", lambda ex, source: SimpleNamespace(score=3.0))
    scores, findings = trusted_regrade(root, A, SECRET)
    assert scores["mistaken"]["ch01.4"] == 3.0
    look = [f for f in findings if isinstance(f, LookAtThis)]
    assert [(f.student, f.exercise) for f in look] == [("mistaken", "ch01.4")]
    assert look[0].lines == ["line 1: imports reference.lora_math.lora_scaling, the reference's own answer to ch01.4 "
                             "(the score stands: yours to judge) (look at this)"]


@pytest.mark.slow
def test_cells_posing_as_an_answer_are_not_graded_and_a_deep_cell_stops_nothing(course, tmp_path, monkeypatch):
    """Red-team review 41 (issue #31): extra cells carrying an answer's grade_id were each re-graded
    (a full check apiece, the last one's score recorded), and an answer of a valid expression a
    thousand terms deep made the trusted tamper scan raise RecursionError after every answer was
    graded, so nothing was recorded for anybody."""
    root = _copy(course, tmp_path / "course")
    path = root / "autograded" / "mistaken" / A / f"{A}.ipynb"
    nb = nbformat.read(path, as_version=4)
    index = next(i for i, cell in enumerate(nb.cells) if exercise_of(cell) == "ch01.4")
    nb.cells[index].source = "REAL = 1\n_pad = " + "+".join(["0"] * 1200) + "\n" + nb.cells[index].source
    for n in range(3):  # impostors: after the answer (the last one used to count) and before it
        impostor = nbformat.v4.new_code_cell(f"IMPOSTOR = {n}\n")
        impostor.metadata["nbgrader"] = {"grade": False, "grade_id": "ch01_4_answer", "locked": False,
                                         "schema_version": 3, "solution": False, "task": False}
        nb.cells.insert(index + 1 if n else index, impostor)
    nbformat.write(nb, path)
    graded = []

    def fake_grade(ex, source):
        graded.append((ex, source.split("\n")[0]))
        return SimpleNamespace(score=3.0 if source.startswith("REAL") else 0.0)

    monkeypatch.setattr(course_mod, "grade_source", fake_grade)
    scores, findings = trusted_regrade(root, A, SECRET)
    assert [first for ex, first in graded if ex == "ch01.4"].count("REAL = 1") == 1
    assert not any(first.startswith("IMPOSTOR") for _, first in graded)
    assert scores["mistaken"]["ch01.4"] == 3.0
    look = [str(f) for f in findings if isinstance(f, LookAtThis) and f.student == "mistaken"]
    assert sum(f.count("carries the grade_id of ch01.4's answer cell; not graded") for f in look) == 3
    assert sum("carries the grade_id" in f for f in look) == 1  # one finding for the three cells
    assert any("nested too deeply to check" in f for f in look)


def test_the_tamper_scan_never_raises_on_deep_code():
    for terms in (1200, 100_000):  # the first compiles and runs; the second does not parse
        lines = suspicious_code("def f(x):\n    return x\n_pad = " + "+".join(["0"] * terms) + "\n")
        assert len(lines) == 1 and "nested too deeply" in lines[0] and lines[0].endswith("(look at this)")


# ---------------------------------------------------------------------------------------------
# graders.course.integrity and graders.course.tamper on their own


def test_check_fingerprint_names_every_difference():
    recorded = fingerprint()
    assert check_fingerprint(recorded) == []
    recorded["graders/machine/core.py"] = "f" * 64
    recorded["graders/chapters/gone.py"] = "e" * 64
    del recorded["reference/lora_math.py"]
    lines = check_fingerprint(recorded)
    assert [line.split(" ")[0] for line in lines] == ["graders/chapters/gone.py", "graders/machine/core.py", "reference/lora_math.py"]
    assert "missing" in lines[0] and "changed" in lines[1] and "new" in lines[2]


def test_no_solution_cell_and_no_mutant_is_flagged():
    """Also as the answer to its own exercise: 14 solution cells import from ``reference``
    (``LoRABatchInfo``, ``torch_ref``, ch08.2 subclasses the given ``StaticLoRABatch``), never the
    exercise's own reference."""
    solutions = solution_answers()
    flagged = {ex: lines for ex, src in solutions.items() if (lines := suspicious_code(src) + suspicious_code(src, ex))}
    for m in load_catalogue():
        source = apply_edits(solutions[m.part or m.exercise], m.edits, m.id)
        if lines := suspicious_code(source) + suspicious_code(source, m.part or m.exercise):
            flagged[m.id] = lines
    assert flagged == {}
    assert sum("from reference" in src or "import reference" in src for src in solutions.values()) >= 10


def test_no_released_answer_cell_is_flagged():
    """The answer cells a learner starts from (nbgrader's ClearSolutions on every chapter's source
    notebook), as the answer to their own exercise: the given imports of ``reference`` are no finding."""
    from nbgrader.preprocessors import ClearSolutions

    clear, flagged, seen = ClearSolutions(), {}, 0
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if (ex := exercise_of(cell)) is not None and cell.metadata["nbgrader"].get("solution"):
                stub, _ = clear.preprocess_cell(nbformat.from_dict(dict(cell)), {"language": "python"}, i)
                seen += 1
                if lines := suspicious_code(stub.source, ex):
                    flagged[ex] = lines
    assert seen >= 52 and flagged == {}


def test_the_bundled_tampering_answers_are_found():
    found = {}
    for path in sorted((ROOT / "submissions").glob("*/*.py")):
        for ex, src in parse_answers(path.read_text()).items():
            if lines := suspicious_code(src):
                found[(path.parent.name, ex)] = lines
    assert set(found) == {("broken_code", "ch02.6"), ("broken_code", "ch02.7"), ("broken_code", "ch02.8")}
    assert "line 2: assigns torch.allclose on the imported module torch (a patch) (look at this)" in found[
        ("broken_code", "ch02.6")]
    assert "line 4: assigns graders.check on the imported module graders (a patch) (look at this)" in found[
        ("broken_code", "ch02.8")]
    assert any("imports graders.machine.core" in line for line in found[("broken_code", "ch02.7")])


HONEST = [
    HONEST_COMMENT + "import graders\n\ndef f(x):\n    return x  # not graders.machine.core._compare\n\n"
    's = "graders.check is a string"\ngraders.check("ch01.1", f)\n',
    "import torch\nfrom torch import nn\nfrom reference.batch_info import LoRABatchInfo\n\n"
    "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.w = torch.zeros(2)\n",
    "def f(reference, os):\n    reference.shape = os\n    return open('x').read()\n",
    "",
    # a device named as an argument is what the default-device case asks for, not a finding
    "def f(x):\n    return torch.zeros(3, device=torch.device(x.device.type)) + x.new_ones(3)\n",
]


@pytest.mark.parametrize("source", HONEST)
def test_honest_code_is_not_flagged(source):
    assert suspicious_code(source) == []


SUSPICIOUS = {
    'import sys\nsys.modules["grad" + "ers"].check = None\n': "line 2: reads or changes sys.modules",
    "import sys as s\nm = s.modules\n": "line 2: reads or changes sys.modules",
    "import sys\ngetattr(sys, 'mod' + 'ules')\n": "line 2: getattr() on sys with a name computed at run time",
    "g = __import__('grad' + 'ers')\n": "line 1: uses __import__",
    "import importlib\n": "line 1: imports importlib",
    "from graders import machine\n": "line 1: imports graders.machine",
    "import graders.machine.core\n": "line 1: imports graders.machine.core",
    "from graders.machine.core import _compare\n": "line 1: imports graders.machine.core._compare",
    "from graders import check\n": "line 1: imports graders.check",
    "\ng = graders\ng.check = print\n": "line 3: assigns g.check on the imported module graders",
    "setattr(graders, 'check', print)\n": "line 1: calls setattr() on the imported module graders",
    "import torch\ndelattr(torch, 'allclose')\n": "line 2: calls delattr() on the imported module torch",
    "import triton\ntriton.jit = None\n": "line 2: assigns triton.jit on the imported module triton",
    "import numpy as np\nnp.allclose = None\n": "line 2: assigns np.allclose on the imported module numpy",
    "vars(graders)['check'] = print\n": "line 1: assigns vars(graders)['check'] on the imported module graders",
    "globals()['x'] = 1\n": "line 1: writes into globals()",
    "import builtins\n": "line 1: imports builtins",
    "__builtins__['len'] = None\n": "line 1: uses __builtins__",
    "import sqlite3\n": "line 1: imports sqlite3",
    "from subprocess import Popen\n": "line 1: imports subprocess",
    "import multiprocessing\n": "line 1: imports multiprocessing",
    "import ctypes\n": "line 1: imports ctypes",
    "import signal\n": "line 1: imports signal",
    "import socket\n": "line 1: imports socket",
    "import os\nos.system('x')\n": "line 2: uses os.system",
    "import os\nos.fork()\n": "line 2: uses os.fork",
    "import os\nos.spawnl(0, 'a')\n": "line 2: uses os.spawnl",
    "import os\nos.execv('a', [])\n": "line 2: uses os.execv",
    "import os\nos.kill(1, 9)\n": "line 2: uses os.kill",
    "import os\nos.setsid()\n": "line 2: uses os.setsid",
    "import os\nos.popen('ls')\n": "line 2: uses os.popen",
    "import os\nos.utime('f')\n": "line 2: uses os.utime",
    "from os import remove\n": "line 1: uses os.remove",
    "import os\nos.unlink('f')\n": "line 2: uses os.unlink",
    "import os\nos.rename('a', 'b')\n": "line 2: uses os.rename",
    "import os\nos.replace('a', 'b')\n": "line 2: uses os.replace",
    "import shutil\nshutil.copy('a', 'b')\n": "line 2: uses shutil.copy",
    "open('f', 'w')\n": "line 1: opens a file for writing (mode 'w')",
    "open('f', mode='ab')\n": "line 1: opens a file for writing (mode 'ab')",
    "def f(:\n": "line 1: the cell does not parse",
    # what the default-device and host-read checks are built on (graders.machine.runner)
    "torch.set_default_device('cpu')\n": "line 1: uses torch.set_default_device",
    "d = torch.get_default_device()\n": "line 1: uses torch.get_default_device",
    "torch._C._pop_torch_function_stack()\n": "line 1: uses torch._C",
    "from torch.overrides import _get_current_function_mode_stack\n": "line 1: uses torch.overrides",
    "import torch.utils._python_dispatch\n": "line 1: uses torch.utils._python_dispatch",
    "with torch.device('cpu'):\n    pass\n": "line 1: enters torch.device(...) as a context",
    "getattr(torch, 'set_' + 'default_device')('cpu')\n": "line 1: getattr() on torch with a name computed",
}


@pytest.mark.parametrize("source", list(SUSPICIOUS))
def test_suspicious_code_is_flagged(source):
    lines = suspicious_code(source)
    assert any(line.startswith(SUSPICIOUS[source]) for line in lines), lines
    assert all(line.endswith(" (look at this)") for line in lines)


#: Answers that are the exercise's own reference (issue #31): (exercise, cell) -> the finding's start.
OWN_REFERENCE = {
    ("ch01.1", "from reference.lora_math import lora_forward\n"):
        "line 1: imports reference.lora_math.lora_forward, the reference's own answer to ch01.1",
    ("ch01.1", "from reference.lora_math import lora_forward as mine\n\n\ndef lora_forward(x, W, A, B, scaling):\n"
               "    return mine(x, W, A, B, scaling)\n"): "line 1: imports reference.lora_math.lora_forward",
    ("ch01.1", "import reference\n\n\ndef lora_forward(*args):\n    return reference.lora_math.lora_forward(*args)\n"):
        "line 5: uses reference.lora_math.lora_forward",
    ("ch01.1", "import reference.lora_math as lm\n\nlora_forward = lm.lora_forward\n"):
        "line 3: uses reference.lora_math.lora_forward",
    ("ch01.1", "from reference import lora_math\n\nlora_forward = lora_math.lora_forward\n"):
        "line 3: uses reference.lora_math.lora_forward",
    ("ch01.1", "import importlib\n\nlm = importlib.import_module('reference.lora_math')\n"
               "lora_forward = lm.lora_forward\n"):
        "line 4: uses reference.lora_math.lora_forward",
    ("ch01.1", "import importlib\n\nlora_forward = importlib.import_module('reference.lora_math').lora_forward\n"):
        "line 3: uses reference.lora_math.lora_forward",
    ("ch01.1", "from importlib import import_module\n\n"
               "lora_forward = getattr(import_module('reference.lora_math'), 'lora_forward')\n"):
        "line 3: uses reference.lora_math.lora_forward",
    ("ch01.1", "lora_forward = __import__('reference.lora_math', fromlist=['lora_forward']).lora_forward\n"):
        "line 1: imports reference.lora_math.lora_forward",
    ("ch01.1", "ref = __import__('reference')\nlora_forward = ref.lora_math.lora_forward\n"):
        "line 2: uses reference.lora_math.lora_forward",
    ("ch01.1", "import reference.lora_math as lm\n\nlora_forward = getattr(lm, 'lora_forward')\n"):
        "line 3: uses reference.lora_math.lora_forward",
    ("ch01.1", "import reference.lora_math as lm\n\nlora_forward = getattr(lm, 'lora_' + 'forward')\n"):
        "line 3: getattr() on reference.lora_math with a name computed at run time",
    ("ch01.1", "import reference.lora_math as lm\n\nlora_forward = vars(lm)['lora_forward']\n"):
        "line 3: uses reference.lora_math.lora_forward",
    ("ch01.1", "from reference import lora_math\n\nlora_forward = lora_math.__dict__['lora_forward']\n"):
        "line 3: uses reference.lora_math.lora_forward",
    ("ch01.1", "from reference.lora_math import *\n\n\ndef mine(*args):\n    return lora_forward(*args)\n"):
        "line 5: uses reference.lora_math.lora_forward",
    # another module's op of the same name: the Triton op answers the torch exercise
    ("ch02.6", "from reference.ops import sgmv_shrink\n"):
        "line 1: imports reference.ops.sgmv_shrink (as reference.ops.torch_ref.sgmv_shrink), the reference's own",
    ("ch02.6", "from reference.ops import torch_ref\n\nsgmv_shrink = torch_ref.sgmv_shrink\n"):
        "line 3: uses reference.ops.torch_ref.sgmv_shrink",
    ("ch03.1", "from reference.ops.sgmv_shrink import _sgmv_shrink_kernel\n"):
        "line 1: imports reference.ops.sgmv_shrink._sgmv_shrink_kernel",
    ("ch11.5", "from reference.engine.llm import engine_step\n"): "line 1: imports reference.engine.llm.engine_step",
    # a method: inherited, called through super() or the class, or the class under the answer's name
    ("ch08.2", "from reference.cuda_graph import StaticLoRABatch as Given\n\n\nclass StaticLoRABatch(Given):\n"
               "    pass\n"): "line 4: class StaticLoRABatch inherits update from reference.cuda_graph.StaticLoRABatch",
    ("ch08.2", "from reference.cuda_graph import StaticLoRABatch as Given\n\n\nclass StaticLoRABatch(Given):\n"
               "    def update(self, *args):\n        return super().update(*args)\n"):
        "line 6: calls super().update, that is reference.cuda_graph.StaticLoRABatch.update",
    ("ch08.2", "from reference.cuda_graph import StaticLoRABatch as Given\n\n\nclass StaticLoRABatch(Given):\n"
               "    def update(self, *args):\n        return Given.update(self, *args)\n"):
        "line 6: uses reference.cuda_graph.StaticLoRABatch.update",
    ("ch08.2", "from reference.cuda_graph import StaticLoRABatch as Given\n\nStaticLoRABatch = Given\n"):
        "line 3: binds StaticLoRABatch to reference.cuda_graph.StaticLoRABatch, whose update is the reference's own",
    ("ch05.1", "from reference import eviction\n\nLRUEvictionPolicy = eviction.LRUEvictionPolicy\n"):
        "line 3: uses reference.eviction.LRUEvictionPolicy",
}


@pytest.mark.parametrize("exercise, source", list(OWN_REFERENCE))
def test_an_answer_that_is_the_exercises_own_reference_is_flagged(exercise, source):
    lines = suspicious_code(source, exercise)
    assert any(line.startswith(OWN_REFERENCE[exercise, source]) for line in lines), lines
    assert all(line.endswith(" (look at this)") for line in lines)
    own = [line for line in lines if f"the reference's own answer to {exercise}" in line]
    assert all("(the score stands: yours to judge)" in line for line in own), lines
    assert own or "computed at run time" in OWN_REFERENCE[exercise, source]  # a name built at run time


def test_another_exercises_reference_or_no_exercise_is_no_finding():
    """Using a reference helper that is not the exercise's own answer is what solutions do."""
    assert suspicious_code("from reference.lora_math import lora_forward\n", "ch01.2") == []
    assert suspicious_code("from reference.lora_math import lora_forward\n") == []
    assert suspicious_code("from reference.ops import torch_ref\n\nx = torch_ref.sgmv_expand\n", "ch02.6") == []
    assert suspicious_code("from reference.cuda_graph import StaticLoRABatch as G\n\n\nclass StaticLoRABatch(G):\n"
                           "    def update(self, *args):\n        return self.batch_info\n", "ch08.2") == []
