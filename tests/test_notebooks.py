"""Every chapter notebook: built from its source, metadata agreeing with the points table,
committed without outputs, and executing top to bottom on this machine with full marks."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from graders.course import chapters, exercise_of
from graders.points import POINTS, total_points

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


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_executes_top_to_bottom_with_full_marks(chapter):
    nb = _nb(chapter)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks" / chapter)}}).execute()
    stderr = [(i, o.text[:200]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "stream" and o.name == "stderr"]
    assert not stderr, stderr
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and cell.cell_type == "code":
            results = [o for o in cell.outputs if o.output_type == "execute_result"]
            printed = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
            assert results and float(results[0].data["text/plain"]) == meta["points"], printed


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
