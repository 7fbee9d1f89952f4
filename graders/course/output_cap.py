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
           "LIVE_BYTES", "DECISIVE_BYTES", "OUTPUT_COST", "NOTEBOOK_LIVE_BYTES", "NotebookBudget", "LiveCap",
           "install_live_cap"]

#: Output bytes a code cell keeps (the chapters' own figures are a few hundred kB at most).
MAX_CELL_OUTPUT_BYTES = 1 << 20
#: The start of the note that marks a cut.
CUT_NOTE = "[output cut by the grader"
#: Bytes a deciding output (an error, a stderr stream, an execute_result) keeps past the live cap.
DECISIVE_BYTES = 4096
#: Output bytes a cell keeps while it runs: room left under :data:`MAX_CELL_OUTPUT_BYTES` for one
#: deciding output and the note, so the cap after the run never cuts the same cell again.
LIVE_BYTES = MAX_CELL_OUTPUT_BYTES - DECISIVE_BYTES - 1024
#: What each output costs the live cap beyond its bytes (nbformat's keys and the worker's objects):
#: a flood of empty outputs is bounded too.
OUTPUT_COST = 256
#: Output bytes a whole notebook keeps while it runs (the chapters' own outputs are a few MB at most).
NOTEBOOK_LIVE_BYTES = 32 << 20
#: What each entry of a list or dict in an output costs beyond its strings' bytes.
ITEM_COST = 16


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else json.dumps(value)


def _size(output: dict) -> int:
    """What ``output`` costs: the bytes of its strings (keys too) plus :data:`ITEM_COST` per list or
    dict entry, so that neither many MIME keys, nor thousands of empty JSON objects (each one a
    Python object in the worker), nor a traceback of a million empty lines counts as nothing."""
    kind = output.get("output_type")
    if kind == "stream":
        return _weight(output.get("text", ""))
    if kind == "error":
        return _weight([output.get("ename", ""), output.get("evalue", ""), output.get("traceback", [])])
    return _weight(output.get("data") or {}) + _weight(output.get("metadata") or {})


def _weight(value: Any) -> int:
    total, todo = 0, [value]
    while todo:  # a loop, not recursion: a kernel can nest JSON deeper than Python's stack
        v = todo.pop()
        if isinstance(v, str):
            # surrogatepass: a kernel can send a lone surrogate, which a plain encode() refuses
            total += len(v.encode(errors="surrogatepass"))
        elif isinstance(v, dict):
            total += ITEM_COST * (1 + len(v))
            todo += v.keys()
            todo += v.values()
        elif isinstance(v, (list, tuple)):
            total += ITEM_COST * (1 + len(v))
            todo += v
        else:
            total += ITEM_COST
    return total


def _clip(text: str, budget: int) -> str:
    return text.encode(errors="surrogatepass")[:max(0, budget)].decode(errors="ignore")


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


def _kept_part(output: dict, budget: int) -> dict | None:
    """:func:`_shortened`, where an error also keeps the last three lines of its traceback (each
    clipped to :data:`DECISIVE_BYTES`): what the live cap keeps of an output past its cap."""
    short = _shortened(output, budget)
    if short is not None and output.get("output_type") == "error":
        short["traceback"] = [_clip(_text(t), DECISIVE_BYTES) for t in (output.get("traceback") or [])[-3:]]
    return short


class NotebookBudget:
    """Output bytes left to one notebook's run, shared by its cells' :class:`LiveCap`: a notebook of
    many cells (a learner can add them) keeps at most :data:`NOTEBOOK_LIVE_BYTES` in all."""

    def __init__(self, left: int = None):
        self.left = NOTEBOOK_LIVE_BYTES if left is None else left


class LiveCap:
    """The live cap's bookkeeping for one cell of one notebook run (see the module docstring).

    ``add(outs, out)`` is called right after ``out`` was appended to ``outs`` (the cell's outputs, a
    list nbclient keeps per cell) and returns what stays there: ``out``, a shortened copy, or None
    (``out`` removed, counted in the note). Each output costs its bytes plus :data:`OUTPUT_COST` (so
    many empty outputs count too), against the cell's ``limit`` and the notebook's ``budget``.
    ``ignore`` is nbgrader's ``IgnorePattern.pattern`` when it is enabled (its stderr outputs decide
    nothing: that preprocessor removes them after the run). Past the cap the first output that
    decides the cell's grade is kept, and so is the first error (nbgrader's ``on_cell_executed``
    appends the execute reply's error, uncut, when no error output of its name is there)."""

    def __init__(self, limit: int = LIVE_BYTES, ignore: Optional[str] = None, node=dict,
                 budget: Optional[NotebookBudget] = None):
        self.limit, self.ignore, self.node = limit, ignore, node  # node: nbformat.from_dict in nbclient
        self.budget = budget if budget is not None else NotebookBudget()
        self.kept = 0
        self._reset()

    def _reset(self) -> None:
        self.budget.left += self.kept  # what a clear_output removed is the notebook's again
        self.kept = self.count = self.cut_bytes = self.cut_outputs = 0
        self.decided = self.error_kept = False  # the output that decides the score / an error is kept
        self.note: Optional[dict] = None
        self.kinds: set[str] = set()

    def _decides(self, out: dict) -> bool:
        kind = out.get("output_type")
        if kind == "stream":
            return out.get("name") == "stderr" and not (
                self.ignore and re.search(self.ignore, _text(out.get("text", ""))))
        return kind in ("error", "execute_result")

    def _keep(self, cost: int) -> None:
        self.kept += cost
        self.budget.left -= cost

    def add(self, outs: list, out: dict) -> Optional[dict]:
        if len(outs) != self.count + 1:  # cleared (clear_output) since the last output: a fresh start
            self._reset()
        size, decides = _size(out), self._decides(out)
        is_error = out.get("output_type") == "error"
        room = min(self.limit - self.kept, self.budget.left) - OUTPUT_COST
        if self.note is None and size <= room:
            self._keep(size + OUTPUT_COST)
            self.decided |= decides
            self.error_kept |= is_error
            self.count = len(outs)
            return out
        outs.pop()
        kept = None
        ignored = out.get("output_type") == "stream" and out.get("name") == "stderr" and not decides
        if self.note is None and not ignored and room > 0:  # the output that crosses the cap: what
            # fits of it (a stderr output IgnorePattern removes is left out whole: its match may lie
            # past the cut)
            kept = _kept_part(out, max(room, DECISIVE_BYTES if decides else 0))
        elif (decides and not self.decided) or (is_error and not self.error_kept):
            kept = _kept_part(out, DECISIVE_BYTES)
        if kept is None and ((decides and not self.decided) or (is_error and not self.error_kept)):
            kept = {**out, "data": {"text/plain": ""}, "metadata": {}} if out.get("output_type") == "execute_result" \
                else {**out, "text": ""}  # a deciding output with no text to keep
        if kept is not None:
            kept = self.node(kept)
            self._keep(_size(kept) + OUTPUT_COST)
        self.decided |= decides and kept is not None
        self.error_kept |= is_error and kept is not None
        self.cut_bytes += size - (_size(kept) if kept is not None else 0)
        self.cut_outputs += kept is None
        self.kinds.add(out.get("output_type", "?"))
        if self.note is None:
            self.note = self.node({"output_type": "stream", "name": "stdout", "text": ""})
            outs.append(self.note)
        if kept is not None:
            outs.insert(len(outs) - 1, kept)  # before the note
        self.note["text"] = (f"\n{CUT_NOTE} while the cell ran: over the {self.limit:,} bytes a cell keeps "
                             f"(or what was left of the notebook's {NOTEBOOK_LIVE_BYTES:,}); {self.cut_bytes:,} bytes "
                             f"of {', '.join(sorted(self.kinds))} output left out, {self.cut_outputs} output(s) whole]\n")
        self.count = len(outs)
        return kept


def install_live_cap(limit: int = LIVE_BYTES) -> None:
    """Make nbgrader's ``Execute`` preprocessor (an nbclient ``NotebookClient``) cap each cell's
    outputs as they arrive (:class:`LiveCap` with ``limit``, one :class:`NotebookBudget` per notebook
    run; a later call only sets ``limit``, for the notebooks run after it), cut
    display updates larger than :data:`DECISIVE_BYTES` (they replace a kept output's data in place)
    and keep no widget state (comm messages: a graded notebook needs none, and nbclient would keep
    every state sent, and the outputs of an Output widget past the cap). Idempotent; raises
    ImportError without nbgrader."""
    from nbformat import from_dict
    from nbgrader.preprocessors.execute import Execute

    Execute._lora_book_live_limit = limit
    if getattr(Execute.output, "_lora_book_live_cap", False):
        return
    original_output, original_update = Execute.output, Execute._update_display_id
    original_executed, original_reset = Execute.on_cell_executed, Execute.reset_execution_trackers

    def reset_execution_trackers(self):
        # called by nbclient before each notebook: a fresh budget and fresh caps for its cells
        original_reset(self)
        self._lora_book_live_caps, self._lora_book_budget = {}, NotebookBudget()

    def output(self, outs, msg, display_id, cell_index):
        out = original_output(self, outs, msg, display_id, cell_index)
        if out is None or not outs or outs[-1] is not out:
            return out
        caps = self._lora_book_live_caps
        if cell_index not in caps:
            ignore = self.config.IgnorePattern
            caps[cell_index] = LiveCap(self._lora_book_live_limit,
                                       ignore.get("pattern") or None if ignore.get("enabled") else None, from_dict,
                                       self._lora_book_budget)
        position = len(outs) - 1
        kept = caps[cell_index].add(outs, out)
        if kept is not out and display_id:  # nbclient recorded where ``out`` was: where ``kept`` is now
            cell_map = self._display_id_map.get(display_id, {})
            indices = cell_map.get(cell_index, [])
            if position in indices:
                indices.remove(position)
            if kept is not None:
                indices.append(next(i for i in range(len(outs) - 1, -1, -1) if outs[i] is kept))
            elif not indices:
                cell_map.pop(cell_index, None)
                if not cell_map:
                    self._display_id_map.pop(display_id, None)
        return kept

    def _update_display_id(self, display_id, msg):
        content = msg.get("content") or {}
        if not isinstance(content, dict) or not isinstance(content.get("data"), dict):
            return original_update(self, display_id, msg)  # nbclient's own answer to malformed content
        size = _weight(content["data"]) + _weight(content.get("metadata") or {})
        if size > DECISIVE_BYTES:
            msg = {**msg, "content": {**content, "metadata": {}, "data": {
                "text/plain": f"{CUT_NOTE}: a display update of {size:,} bytes left out]"}}}
        return original_update(self, display_id, msg)

    def handle_comm_msg(self, outs, msg, cell_index):
        return None

    def on_cell_executed(self, **kwargs):
        # nbgrader appends the execute reply's error when no error output of its name is there (a
        # kernel that shows no traceback sends none): shortened like any error past the cap
        cell = kwargs.get("cell")
        before = len(cell.outputs) if cell is not None else 0
        result = original_executed(self, **kwargs)
        if cell is not None:
            for k in range(before, len(cell.outputs)):
                out = cell.outputs[k]
                if out.get("output_type") == "error" and _size(out) > DECISIVE_BYTES:
                    cell.outputs[k] = from_dict(_kept_part(out, DECISIVE_BYTES))
        return result

    output._lora_book_live_cap = True
    Execute.output = output
    Execute._update_display_id = _update_display_id
    Execute.handle_comm_msg = handle_comm_msg
    Execute.on_cell_executed = on_cell_executed
    Execute.reset_execution_trackers = reset_execution_trackers


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
