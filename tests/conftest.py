"""Shared test set-up: a fixed hidden-case secret, so asserted scores hold on every device."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["LORA_BOOK_SECRET"] = "tests-fixed-secret"

import reference  # noqa: E402,F401  (device choice before anything imports triton)
import torch  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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
    return {line.split("\t", 1)[1] for line in Path(_DONE).read_text().splitlines() if "\t" in line}


def pytest_collection_modifyitems(config, items):
    done = _done_ids()
    if not done:
        return
    keep = [i for i in items if i.nodeid not in done]
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid in done])
    items[:] = keep


def pytest_runtest_logreport(report):
    if not _DONE or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    finished = (report.when == "call" or (report.when == "setup" and not report.passed))
    if finished:
        with open(_DONE, "a") as f:
            f.write(f"{report.outcome}\t{report.nodeid}\n")
