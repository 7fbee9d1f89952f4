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

That cap comes after the notebook has run: until then nbgrader's worker (the instructor's process,
outside every sandbox) kept every output a cell sent, about 3 GiB of its memory for 1 GiB printed
(red-team review 41). ``grade`` therefore runs ``nbgrader autograde`` through this file
(``python -P output_cap.py autograde ...``: :func:`install_live_cap`), which caps each cell while it
runs: past :data:`LIVE_BYTES` a cell's outputs are left out as they arrive (one message at a time is
all the worker holds of them), with a note that counts them, but for the one output that decides a
grade cell's score in nbgrader (``determine_grade``: its first error, stderr stream that
``IgnorePattern`` would not remove, or ``execute_result``), which is kept, shortened to
:data:`DECISIVE_BYTES`: a score never changes because outputs were cut.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

__all__ = ["MAX_CELL_OUTPUT_BYTES", "cap_cell", "cap_notebook", "cap_notebook_file", "CapOutput", "CUT_NOTE",
           "LIVE_BYTES", "DECISIVE_BYTES", "LiveCap", "install_live_cap"]

#: Output bytes a code cell keeps (the chapters' own figures are a few hundred kB at most).
MAX_CELL_OUTPUT_BYTES = 1 << 20
#: The start of the note that marks a cut.
CUT_NOTE = "[output cut by the grader"
#: Bytes a deciding output (an error, a stderr stream, an execute_result) keeps past the live cap.
DECISIVE_BYTES = 4096
#: Output bytes a cell keeps while it runs: room left under :data:`MAX_CELL_OUTPUT_BYTES` for one
#: deciding output and the note, so the cap after the run never cuts the same cell again.
LIVE_BYTES = MAX_CELL_OUTPUT_BYTES - DECISIVE_BYTES - 1024


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


class LiveCap:
    """The live cap's bookkeeping for one cell of one notebook run (see the module docstring).

    ``add(outs, out)`` is called right after ``out`` was appended to ``outs`` (the cell's outputs, a
    list nbclient keeps per cell) and returns what stays there: ``out``, a shortened copy, or None
    (``out`` removed, counted in the note). ``ignore`` is nbgrader's ``IgnorePattern.pattern`` when it
    is enabled (its stderr outputs decide nothing: that preprocessor removes them after the run)."""

    def __init__(self, limit: int = LIVE_BYTES, ignore: Optional[str] = None, node=dict):
        self.limit, self.ignore, self.node = limit, ignore, node  # node: nbformat.from_dict in nbclient
        self._reset()

    def _reset(self) -> None:
        self.kept = self.count = self.cut_bytes = self.cut_outputs = 0
        self.decided = False  # the output that decides the score is among the kept ones
        self.note: Optional[dict] = None
        self.kinds: set[str] = set()

    def _decides(self, out: dict) -> bool:
        kind = out.get("output_type")
        if kind == "stream":
            return out.get("name") == "stderr" and not (
                self.ignore and re.search(self.ignore, _text(out.get("text", ""))))
        return kind in ("error", "execute_result")

    def add(self, outs: list, out: dict) -> Optional[dict]:
        if len(outs) != self.count + 1:  # cleared (clear_output) since the last output: a fresh start
            self._reset()
        size, decides = _size(out), self._decides(out)
        if self.note is None and self.kept + size <= self.limit:
            self.kept += size
            self.decided |= decides
            self.count = len(outs)
            return out
        outs.pop()
        kept = None
        ignored = out.get("output_type") == "stream" and out.get("name") == "stderr" and not decides
        if self.note is None and not ignored:  # the output that crosses the cap: what fits of it (a
            # stderr output IgnorePattern removes is left out whole: its match may lie past the cut)
            kept = _shortened(out, max(self.limit - self.kept, DECISIVE_BYTES if decides else 0))
        elif decides and not self.decided:
            kept = _shortened(out, DECISIVE_BYTES)
        if kept is not None and kept.get("output_type") == "error":
            kept["traceback"] = [_clip(_text(t), DECISIVE_BYTES) for t in out.get("traceback", [])[-3:]]
        if decides and not self.decided and kept is None:  # a deciding output that kept no text
            kept = {**out, "data": {"text/plain": ""}, "metadata": {}} if out.get("output_type") == "execute_result" \
                else {**out, "text": ""}
        kept = self.node(kept) if kept is not None else None
        self.decided |= decides and kept is not None
        self.cut_bytes += size - (_size(kept) if kept is not None else 0)
        self.cut_outputs += kept is None
        self.kinds.add(out.get("output_type", "?"))
        if self.note is None:
            self.note = self.node({"output_type": "stream", "name": "stdout", "text": ""})
            outs.append(self.note)
        if kept is not None:
            outs.insert(len(outs) - 1, kept)  # before the note
        self.note["text"] = (f"\n{CUT_NOTE} while the cell ran: over the {self.limit:,} bytes a cell keeps; "
                             f"{self.cut_bytes:,} bytes of {', '.join(sorted(self.kinds))} output left out, "
                             f"{self.cut_outputs} output(s) whole]\n")
        self.count = len(outs)
        return kept


def install_live_cap(limit: int = LIVE_BYTES) -> None:
    """Make nbgrader's ``Execute`` preprocessor (an nbclient ``NotebookClient``) cap each cell's
    outputs as they arrive (:class:`LiveCap`). Idempotent; raises ImportError without nbgrader."""
    from nbformat import from_dict
    from nbgrader.preprocessors.execute import Execute

    if getattr(Execute.output, "_lora_book_live_cap", False):
        return
    original = Execute.output

    def output(self, outs, msg, display_id, cell_index):
        out = original(self, outs, msg, display_id, cell_index)
        if out is None or not outs or outs[-1] is not out:
            return out
        caps = self.__dict__.setdefault("_lora_book_live_caps", {})
        if cell_index not in caps:
            ignore = self.config.IgnorePattern
            caps[cell_index] = LiveCap(limit, ignore.get("pattern") or None if ignore.get("enabled") else None, from_dict)
        position = len(outs) - 1
        kept = caps[cell_index].add(outs, out)
        if kept is not out and display_id:  # nbclient recorded the index of an output no longer there
            indices = self._display_id_map.get(display_id, {}).get(cell_index, [])
            if position in indices:
                indices.remove(position)
        return kept

    output._lora_book_live_cap = True
    Execute.output = output


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


if __name__ == "__main__":  # python -P output_cap.py autograde ...: nbgrader's command with the live cap
    import sys

    install_live_cap()
    from nbgrader.apps.nbgraderapp import main

    sys.exit(main())
