"""Build the nbgrader source notebooks from their text sources (jupytext percent format).

    python tools/build_notebooks.py            # write notebooks/NN_topic/NN_topic.ipynb
    python tools/build_notebooks.py --check    # exit 1 if a committed notebook is out of date

Sources live in tools/chapters/NN_topic.py, outside notebooks/ because nbgrader ships every file of
an assignment folder to learners. A code cell marked ``# %% exercise="chNN.M" role="answer"`` (or
``role="test"``) gets its nbgrader metadata here, with the points from ``graders.machine.points``: the one
place points are written. Notebooks are written without outputs.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "tools" / "chapters"
NOTEBOOKS = ROOT / "notebooks"
sys.path.insert(0, str(ROOT))

from graders.machine.points import total_points  # noqa: E402

KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def grade_id(exercise_id: str, role: str) -> str:
    """``ch02.3`` + ``answer`` -> ``ch02_3_answer`` (nbgrader ids allow no dots)."""
    return exercise_id.replace(".", "_") + "_" + role


def _nbgrader_meta(exercise_id: str, role: str) -> dict:
    meta = {"grade_id": grade_id(exercise_id, role), "schema_version": 3, "task": False}
    if role == "answer":
        return {**meta, "grade": False, "locked": False, "solution": True}
    if role == "test":
        return {**meta, "grade": True, "locked": True, "solution": False, "points": total_points(exercise_id)}
    raise ValueError(f"role must be 'answer' or 'test', got {role!r}")


def build(source: Path) -> nbformat.NotebookNode:
    nb = jupytext.read(source, fmt="py:percent")
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}}
    for i, cell in enumerate(nb.cells):
        meta = dict(cell.metadata)
        cell.metadata = {}
        if "exercise" in meta:
            cell.metadata["nbgrader"] = _nbgrader_meta(meta["exercise"], meta["role"])
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell["id"] = f"c{i:03d}"
    return nb


def target(source: Path) -> Path:
    return NOTEBOOKS / source.stem / f"{source.stem}.ipynb"


def main(check: bool) -> int:
    stale = []
    for source in sorted(SOURCES.glob("[0-9][0-9]_*.py")):
        text = nbformat.writes(build(source)) + "\n"
        out = target(source)
        if check:
            if not out.exists() or out.read_text() != text:
                stale.append(str(out.relative_to(ROOT)))
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out.relative_to(ROOT)}")
    if stale:
        print("out of date (run: python tools/build_notebooks.py):", *stale, sep="\n  ")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv))
