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
