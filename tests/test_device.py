"""The device choice has one owner: importing ``reference`` sets TRITON_INTERPRET without CUDA."""
import os
import subprocess
import sys

import torch


def _interpret_flag_after_import(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra)
    code = "import os, reference; print(os.environ.get('TRITON_INTERPRET', 'unset'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_import_sets_interpreter_exactly_when_no_cuda():
    expected = "unset" if torch.cuda.is_available() else "1"
    assert _interpret_flag_after_import({}) == expected


def test_hidden_cuda_device_means_interpreter():
    assert _interpret_flag_after_import({"CUDA_VISIBLE_DEVICES": ""}) == "1"


def test_an_explicit_setting_is_kept():
    assert _interpret_flag_after_import({"TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}) == "0"
