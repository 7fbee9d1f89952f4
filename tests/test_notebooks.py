"""Every chapter notebook: built from its source, metadata agreeing with the points table,
committed without outputs. That each executes top to bottom with full marks and nothing on stderr is
tests/test_course.py's ``test_the_solutions_execute_top_to_bottom_with_full_marks``: the demo's
``all_correct`` learner is every chapter's solution cells, autograded by nbgrader (executing them
here as well ran every chapter twice in CI)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from graders.course.jobs import chapters, exercise_of
from graders.machine.points import POINTS, total_points

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = chapters(ROOT / "notebooks")


def _nb(chapter: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "notebooks" / chapter / f"{chapter}.ipynb", as_version=4)


def test_notebooks_are_built_from_their_sources():
    proc = subprocess.run([sys.executable, "tools/build_notebooks.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_committed_without_outputs(chapter):
    assert not [c for c in _nb(chapter).cells if c.cell_type == "code" and (c.outputs or c.execution_count)]


def test_every_exercise_has_one_answer_and_one_test_cell_with_the_table_points():
    seen_answers, seen_tests = [], {}
    for chapter in CHAPTERS:
        for cell in _nb(chapter).cells:
            meta = cell.metadata.get("nbgrader", {})
            if exercise_of(cell):
                seen_answers.append(exercise_of(cell))
            m = re.match(r"^(ch\d\d_\d+)_test$", meta.get("grade_id", ""))
            if m:
                ex = m.group(1).replace("_", ".")
                seen_tests[ex] = meta["points"]
                assert cell.source.strip().startswith(f'graders.check("{ex}", '), cell.source
    assert sorted(seen_answers) == sorted(POINTS)
    assert seen_tests == {ex: total_points(ex) for ex in POINTS}


def test_nbgrader_validator_passes_the_solutions_and_fails_the_stubs(tmp_path):
    from nbgrader.preprocessors import ClearSolutions
    from nbgrader.validator import Validator

    chapter = CHAPTERS[0]
    path = ROOT / "notebooks" / chapter / f"{chapter}.ipynb"
    validator = Validator()
    assert not validator.validate(str(path)).get("failed"), "the source notebook fails nbgrader validate"
    nb = _nb(chapter)
    nb, _ = ClearSolutions(code_stub={"python": "raise NotImplementedError()"}).preprocess(nb, {})
    stub = tmp_path / chapter / f"{chapter}.ipynb"
    stub.parent.mkdir()
    nbformat.write(nb, stub)
    failed = Validator().validate(str(stub)).get("failed", [])
    assert failed, "the learner version (stubs) passed nbgrader validate"


def test_no_chapter_prints_a_solution_itself():
    """Solutions are printed only through graders.show_reference, which waits for the learner's own
    passing check (or an explicit reveal=True): "Run All" on an unsolved notebook spoils nothing."""
    import importlib

    from graders.chapters.shown import SHOWN

    for exercise_id, names in SHOWN.items():
        for name in names:
            module, _, qualname = name.partition(":")
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)  # every entry resolves
    shown = {name.partition(":")[2] for names in SHOWN.values() for name in names}
    printed = re.compile(r"inspect\.getsource\(\s*([\w.]+?)(?:\.fn)?\s*\)")
    for source in sorted((ROOT / "tools" / "chapters").glob("[0-9][0-9]_*.py")):
        for m in printed.finditer(source.read_text()):
            target = m.group(1)
            spoiled = [q for q in shown if target == q or target.endswith("." + q)]
            assert not spoiled, f"{source.name} prints the solution {target} itself: use graders.show_reference"
    for exercise_id in POINTS:
        chapter = next(c for c in CHAPTERS if c[:2] == exercise_id[2:4])
        assert f'graders.show_reference("{exercise_id}")' in (ROOT / "tools" / "chapters" / f"{chapter}.py").read_text() \
            or not SHOWN[exercise_id], f"{exercise_id}: no graders.show_reference cell"


def test_show_reference_waits_for_a_passing_check(capsys):
    import graders

    graders._PASSED.discard("ch01.4")
    graders.show_reference("ch01.4")
    assert "def lora_scaling" not in capsys.readouterr().out
    graders.show_reference("ch01.4", reveal=True)
    assert "def lora_scaling" in capsys.readouterr().out
