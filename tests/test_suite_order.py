"""The order in which the suite's work reaches pytest-xdist's workers (tests/conftest.py): the units
holding a slow test first, so the suite's longest tests run beside the rest, not after them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import conftest
from conftest import _slow_first, _split_group

ROOT = Path(__file__).resolve().parents[1]


def test_a_node_id_splits_into_its_test_and_unit_by_xdists_rule():
    """The last "@" after the last "]" starts the group (xdist's LoadGroupScheduling._split_scope)."""
    assert _split_group("tests/t.py::f@module-t.py") == ("tests/t.py::f", "module-t.py")
    assert _split_group("tests/t.py::f") == ("tests/t.py::f", "tests/t.py::f")
    assert _split_group("tests/t.py::f[a@b]") == ("tests/t.py::f[a@b]", "tests/t.py::f[a@b]")
    assert _split_group("tests/t.py::f[a@b]@course-X") == ("tests/t.py::f[a@b]", "course-X")


def test_the_done_list_names_each_test_by_its_whole_id(tmp_path, monkeypatch):
    """A finished test with "@" in its parameter id marks only itself done, grouped or not."""
    done = tmp_path / "done.txt"
    done.write_text("passed\ttests/t.py::f[a@b]@module-t.py\nfailed\ttests/t.py::g[x@y]\nnot a record\n")
    monkeypatch.setattr(conftest, "_DONE", str(done))
    assert conftest._done_ids() == {"tests/t.py::f[a@b]", "tests/t.py::g[x@y]"}


def test_slow_units_come_first_and_the_rest_by_test_count():
    units = [("a", False), ("g1", False), ("g1", False), ("g1", False), ("b", False),
             ("slow", True), ("g2", False), ("g2", True), ("g3", False), ("g3", False), ("c", False)]
    # g2 holds a slow test: the whole group is slow; then by count, most first; ties (a, b, c) in
    # collection order
    assert _slow_first(units) == ["g2", "slow", "g1", "g3", "a", "b", "c"]


def test_no_slow_test_is_xdists_own_order():
    units = [("x", False), ("big", False), ("big", False), ("y", False), ("mid", False), ("mid", False),
             ("big", False)]
    assert _slow_first(units) == ["big", "mid", "x", "y"]
    assert _slow_first(units, workers=2) == ["big", "mid", "x", "y"]  # mid (2 tests) is followed by x, as before
    assert _slow_first([]) == [] and _slow_first([], workers=4) == []


def _first_handout(order: list[str], count: dict[str, int], workers: int) -> dict[int, list[str]]:
    """What xdist 3.8's LoadScopeScheduling.schedule hands out before any test finishes: one unit to
    every worker in turn, then one more to each worker holding two tests or fewer."""
    queue = list(order)
    held = {w: [queue.pop(0)] for w in range(workers) if queue}
    for w in held:
        if queue and sum(count[u] for u in held[w]) <= 2:
            held[w].append(queue.pop(0))
    return held


def test_no_worker_is_handed_slow_work_or_a_group_behind_a_slow_single_test():
    # the shape of the suite: a slow group of many tests, slow classes of 4, slow single tests, quick
    # groups and many quick single tests; more slow units than workers, and fewer
    units = ([("verify", True)] * 95 + [("capstone", True)] * 20
             + [(f"course{k}", True) for k in range(10) for _ in range(4)]
             + [("attackers", True), ("flood", True), ("postgres", True), ("whole_sequence", True)]
             + [("server", False)] * 41 + [("engine", False)] * 28 + [(f"q{k}", False) for k in range(40)])
    count = {u: sum(1 for v, _ in units if v == u) for u, _ in units}
    slow = {u for u, s in units if s}
    for workers in (2, 4, 14, 16, 20):
        order = _slow_first(units, workers)
        assert sorted(order) == sorted(count)  # every unit once
        held = _first_handout(order, count, workers)
        for w, got in held.items():
            if got[0] in slow and count[got[0]] <= 2 and len(got) > 1:
                assert got[1] not in slow and count[got[1]] <= 2, (workers, got)
        first = [got[0] for got in held.values()]
        assert first == order[:workers]
        assert all(u in slow for u in first[:min(workers, len(slow))]), (workers, first)


def test_a_slow_single_test_collected_last_starts_first_under_loadgroup(tmp_path):
    """A run of this suite's conftest over three files, one worker: the slow test of the last file
    starts first, then a quick single test, then the group (a module of ``_SHARED_SETUP``), then the
    other single tests in their order. pytest-xdist's own order (its ``--loadscope-reorder``) ran
    the slow test last."""
    (tmp_path / "conftest.py").write_text(
        f"exec(compile(open({str(ROOT / 'tests' / 'conftest.py')!r}).read(), 'conftest.py', 'exec'))\n")
    (tmp_path / "test_a.py").write_text("".join(f"def test_a{k}():\n    pass\n\n" for k in range(3)))
    (tmp_path / "test_engine.py").write_text("".join(f"def test_e{k}():\n    pass\n\n" for k in range(3)))
    (tmp_path / "test_z.py").write_text(textwrap.dedent("""\
        import pytest

        @pytest.mark.slow
        def test_slow():
            pass
        """))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: end-to-end\n")
    started = tmp_path / "started.txt"
    # not this run's xdist worker (PYTEST_XDIST_WORKER would name the inner controller's records) nor
    # its resume list
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "LORA_BOOK_DONE"}
    env.update(LORA_BOOK_STARTED=str(started), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "--dist", "loadgroup",
                          "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    # the worker's record (the controller logs every start too, as worker "-")
    order = [nodeid.split("::")[1].split("@")[0]
             for worker, nodeid in (line.split("\t")[1:] for line in started.read_text().splitlines())
             if worker != "-"]
    # one worker: the slow single test, the quick single test queued behind it at once (not the
    # group), then the group, then the rest
    assert order == ["test_slow", "test_a0", "test_e0", "test_e1", "test_e2", "test_a1", "test_a2"], order
