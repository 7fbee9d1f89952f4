"""Shared test set-up: a fixed hidden-case secret, so asserted scores hold on every device."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["LORA_BOOK_SECRET"] = "tests-fixed-secret"

import reference  # noqa: E402,F401  (device choice before anything imports triton)
import torch  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_configure(config):
    """Run as root, the controller scans the host for the sandbox's masks once and shares the scan
    (``graders.machine.sandbox.share_masks``, as a grading run does) with every process the run
    starts: xdist workers, notebook kernels, fork servers. Each would otherwise scan on its own: 5 s
    of CPU each on an H100 host (49 masks; /usr with CUDA, /sys), and under ``-n 14`` those scans
    were part of the load that pushed correct answers past the grader's budget. A test that needs a
    fresh scan scans a folder of its own (tmp_path), which the shared scan does not hold.

    Under ``--dist loadgroup`` the scheduler takes the work units in the order the collection gives
    (:func:`_slow_first`) instead of sorting them by test count (pytest-xdist's ``--loadscope-reorder``,
    its default, overridden here even when given), which left a single slow test behind every group
    and every single test collected before it."""
    if getattr(config.option, "dist", None) == "loadgroup":
        config.option.loadscopereorder = False
    if os.geteuid() != 0 or hasattr(config, "workerinput"):
        return
    from graders.machine import sandbox

    if sandbox.MASKS_ENV in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="lora-book-masks-")  # 0700: only root reads or replaces the scan
    os.environ.update(sandbox.share_masks(Path(folder)))
    config._lora_book_masks = folder


def pytest_unconfigure(config):
    folder = getattr(config, "_lora_book_masks", None)
    if folder:
        from graders.machine import sandbox

        os.environ.pop(sandbox.MASKS_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


# Resuming a suite that a time limit stopped (.ci/h200 on a lent GPU, 10 minutes a call): with
# LORA_BOOK_DONE=path, the controller appends each finished test as "outcome<TAB>nodeid" to path, and
# the tests already listed there are deselected, so the next call runs only what the last one left.
_DONE = os.environ.get("LORA_BOOK_DONE")


def _done_ids() -> set[str]:
    if not _DONE or not Path(_DONE).exists():
        return set()
    return {_split_group(line.split("\t", 1)[1])[0] for line in Path(_DONE).read_text().splitlines() if "\t" in line}


def _split_group(nodeid: str) -> tuple[str, str]:
    """``(test id, work unit)`` of a node id: under ``--dist loadgroup`` a grouped test's id ends in
    ``@<group>``, its unit; any other test is a unit of its own. xdist's own rule
    (``LoadGroupScheduling._split_scope``): the suffix is the last "@" after the last "]", since a
    parameter id may hold "@" itself."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        test, group = nodeid.rsplit("@", 1)
        return test, group
    return nodeid, nodeid


#: Modules whose module-scoped fixtures cost many seconds (a course, an engine, a PEFT model): under
#: ``--dist loadgroup`` their tests share one pytest-xdist worker; every other test goes to whichever
#: worker is free, one by one (``loadscope`` kept whole modules, test_graders.py or test_sandbox.py,
#: on one worker of CI's two).
_SHARED_SETUP = {"test_capstone.py", "test_verify.py", "test_engine.py", "test_engine_server.py",
                 "test_benchmark_tp.py", "test_engine_lifecycle.py", "test_engine_cuda_graph.py"}


def _xdist_group(item) -> str | None:
    """The group whose tests must share a worker: a class of test_course (one course per class), one
    exercise of test_mutants on the CPU (its solution and mutants are graded together in one child,
    then read from a cache; on CUDA each test grades its own), or a module of ``_SHARED_SETUP``."""
    module = item.path.name
    if module == "test_course.py" and item.cls is not None:
        return f"course-{item.cls.__name__}"
    if module == "test_mutants.py" and hasattr(item, "callspec") and not torch.cuda.is_available():
        params = item.callspec.params
        exercise = params.get("exercise_id") or getattr(params.get("mutant"), "exercise", None)
        return f"mutants-{exercise}" if exercise else None
    return f"module-{module}" if module in _SHARED_SETUP else None


def _join_group(item, group: str) -> None:
    """What pytest-xdist's loadgroup does with an ``xdist_group`` mark, done here: it appends
    "@group" to the worker's node id, which its scheduler reads. xdist 3.8 writes ``item._nodeid``,
    which pytest 9 no longer reads (it keeps a ``NodeId`` in ``item._id``: pytest-xdist issue #1386),
    so the groups were silently ignored."""
    new = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(new)
    else:
        item._nodeid = new


def _slow_first(units: list[tuple[str, bool]], workers: int = 0) -> list[str]:
    """The order in which pytest-xdist's scheduler hands out work units (``(unit, slow)`` pairs in
    collection order, one per test; a unit is a group's name, or a test's own id when it has none) to
    ``workers`` workers: the units holding a ``slow`` test first, then the others, each kind by its
    test count, most first (what xdist's ``--loadscope-reorder`` does), ties in collection order;
    with ``workers`` given, one quick unit of one or two tests placed after the first ``workers``
    units for each of them that holds two tests or fewer.

    Why: the suite's length is its longest worker's. With the units sorted by test count alone, every
    single test, a slow one too, came after every group and every single test collected before it:
    in the H200 run of bf61316 (``.ci/h200``, 14 workers) the end-to-end test of the grade command
    (test_sandbox.py, 94 s) had not finished when the first device call's deadline stopped the run,
    and the whole suite took a second call for it. The quick units after the first round: xdist 3.8
    (``LoadScopeScheduling.schedule``) gives every worker one unit, then at once a second to each
    worker whose first holds two tests or fewer, and a slow single test's worker would otherwise be
    handed the next slow unit or a large group, to run only after it. Slow units past the first
    round go to the first workers that free up. Which slow unit is longest is not known here (no
    durations are kept), so the first round can still hold a short one and queue a long one."""
    count: dict[str, int] = {}
    slow: dict[str, bool] = {}
    for unit, is_slow in units:
        count[unit] = count.get(unit, 0) + 1
        slow[unit] = slow.get(unit, False) or is_slow
    order = sorted(count, key=lambda u: (not slow[u], -count[u]))  # stable: ties keep their order
    if workers <= 0:
        return order
    first = order[:workers]
    fillers = [u for u in order[workers:] if not slow[u] and count[u] <= 2][:sum(count[u] <= 2 for u in first)]
    chosen = set(fillers)
    return first + fillers + [u for u in order[workers:] if u not in chosen]


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):  # set in pytest-xdist's workers under --dist loadgroup
        for item in items:
            group = _xdist_group(item)
            if group:
                _join_group(item, group)
    done = _done_ids()
    if done:
        config.hook.pytest_deselected(items=[i for i in items if _split_group(i.nodeid)[0] in done])
        items[:] = [i for i in items if _split_group(i.nodeid)[0] not in done]
    if getattr(config.option, "loadgroup", False):
        unit = {id(i): _split_group(i.nodeid)[1] for i in items}
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # the same in every worker
        marked = [(unit[id(i)], i.get_closest_marker("slow") is not None) for i in items]
        rank = {u: k for k, u in enumerate(_slow_first(marked, workers))}
        items.sort(key=lambda i: rank[unit[id(i)]])  # a unit's tests stay in their own order


def pytest_runtest_logreport(report):
    if not _DONE or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    finished = (report.when == "call" or (report.when == "setup" and not report.passed))
    if finished:
        with open(_DONE, "a") as f:
            f.write(f"{report.outcome}\t{report.nodeid}\n")


_STARTED = os.environ.get("LORA_BOOK_STARTED")


def pytest_runtest_logstart(nodeid, location):
    """LORA_BOOK_STARTED=FILE: each worker appends the time and id of every test it starts, so a device
    call interrupted at its deadline shows which tests were still running (and for how long)."""
    if _STARTED:
        import time

        with open(_STARTED, "a") as f:
            f.write(f"{time.time():.0f}\t{os.environ.get('PYTEST_XDIST_WORKER', '-')}\t{nodeid}\n")
