"""A cap on the output bytes of every code cell of an autograded notebook, across all output types.

nbgrader's own limit (``LimitOutput``) counts stream lines only: one 20 MB line, or a 20 MB HTML
display, reached the feedback whole. Here every output counts by its bytes: stream text,
``display_data`` and ``execute_result`` of every MIME type, and errors (name, value, traceback).
A cell keeps its outputs in order until :data:`MAX_CELL_OUTPUT_BYTES`; the output that crosses it
keeps what fits of its text (rich data that does not fit is left out), a visible note follows it
saying what was cut, and later outputs of that cell are left out (counted in the note).

``python -m graders.course grade`` applies it to every autograded notebook before the re-grade and
the feedback (:func:`cap_notebook_file`). An instructor who runs ``nbgrader autograde`` alone can add
:class:`CapOutput` to ``c.Autograde.autograde_preprocessors`` in nbgrader_config.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MAX_CELL_OUTPUT_BYTES", "cap_cell", "cap_notebook", "cap_notebook_file", "CapOutput", "CUT_NOTE"]

#: Output bytes a code cell keeps (the chapters' own figures are a few hundred kB at most).
MAX_CELL_OUTPUT_BYTES = 1 << 20
#: The start of the note that marks a cut.
CUT_NOTE = "[output cut by the grader"


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else json.dumps(value)


def _size(output: dict) -> int:
    kind = output.get("output_type")
    if kind == "stream":
        return len(_text(output.get("text", "")).encode())
    if kind == "error":
        parts = [_text(output.get("ename", "")), _text(output.get("evalue", "")), *map(_text, output.get("traceback", []))]
        return sum(len(p.encode()) for p in parts)
    return sum(len(_text(v).encode()) for v in (output.get("data") or {}).values())


def _clip(text: str, budget: int) -> str:
    return text.encode()[:max(0, budget)].decode(errors="ignore")


def _shortened(output: dict, budget: int) -> dict | None:
    """What of ``output`` fits in ``budget`` bytes (text only), or None."""
    kind = output.get("output_type")
    if budget <= 0:
        return None
    if kind == "stream":
        return {**output, "text": _clip(_text(output.get("text", "")), budget)}
    if kind == "error":
        evalue = _clip(_text(output.get("evalue", "")), budget)
        return {**output, "evalue": evalue, "traceback": []}
    plain = (output.get("data") or {}).get("text/plain")
    if plain is None:
        return None
    return {**output, "data": {"text/plain": _clip(_text(plain), budget)}, "metadata": {}}


def cap_cell(cell: dict, limit: int = MAX_CELL_OUTPUT_BYTES) -> bool:
    """Cap ``cell``'s outputs in place (see the module docstring). Returns whether it cut anything."""
    outputs = cell.get("outputs") or []
    sizes = [_size(o) for o in outputs]
    if cell.get("cell_type") != "code" or sum(sizes) <= limit:
        return False
    kept, budget = [], limit
    for k, (output, size) in enumerate(zip(outputs, sizes)):
        if size <= budget:
            kept.append(output)
            budget -= size
            continue
        short = _shortened(output, budget)
        if short is not None:
            kept.append(short)
        left = outputs[k + 1:]
        what = sorted({o.get("output_type", "?") for o in [output, *left]})
        note = (f"\n{CUT_NOTE}: this cell's outputs came to {sum(sizes):,} bytes, over the "
                f"{limit:,} bytes a cell keeps; {sum(sizes) - sum(map(_size, kept)):,} bytes of "
                f"{', '.join(what)} output left out{f', with the {len(left)} output(s) after it' if left else ''}]\n")
        kept.append({"output_type": "stream", "name": "stderr", "text": note})
        break
    cell["outputs"] = kept
    return True


def cap_notebook(nb: dict, limit: int = MAX_CELL_OUTPUT_BYTES) -> int:
    """Cap every code cell of the notebook ``nb`` (a dict or NotebookNode); returns how many were cut."""
    return sum(cap_cell(cell, limit) for cell in nb.get("cells", []))


def cap_notebook_file(path: Path, limit: int = MAX_CELL_OUTPUT_BYTES) -> int:
    """:func:`cap_notebook` on the notebook file ``path``, rewritten only when something was cut."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    cut = cap_notebook(nb, limit)
    if cut:
        nbformat.write(nbformat.from_dict(nb), str(path))
    return cut


try:
    from nbgrader.preprocessors.base import NbGraderPreprocessor
except ImportError:  # nbgrader is the course extra; the cap itself needs nothing of it
    NbGraderPreprocessor = None

if NbGraderPreprocessor is not None:
    from traitlets import Integer

    class CapOutput(NbGraderPreprocessor):
        """nbgrader preprocessor: :func:`cap_cell` on every cell (add it to
        ``c.Autograde.autograde_preprocessors`` after ``Execute``)."""

        max_bytes = Integer(MAX_CELL_OUTPUT_BYTES, help="output bytes a code cell keeps").tag(config=True)

        def preprocess_cell(self, cell, resources, index):
            cap_cell(cell, self.max_bytes)
            return cell, resources
else:
    CapOutput = None
