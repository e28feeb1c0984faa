"""The conformance suite's device plumbing, checked without a GPU: the checks place their
numpy inputs where ``$PLURIBUS_CONFORMANCE_DEVICE`` says, and a cupy run that cannot see a GPU
fails instead of skipping."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from pluribus.testing import checks
from pluribus.testing.plugin import _require_cupy_device


def test_cpu_mode_keeps_numpy_arrays(monkeypatch):
    monkeypatch.delenv(checks.DEVICE_ENV, raising=False)
    x = np.arange(3)
    assert checks.on_device(x) is x
    assert type(checks.xp.zeros(2)) is np.ndarray


def test_cuda_mode_asks_cupy_for_every_array(monkeypatch):
    made = []

    class FakeCupy:
        @staticmethod
        def asarray(array):
            made.append(array)
            return ("on gpu", array)

        @staticmethod
        def zeros(*args, **kwargs):
            return ("zeros on gpu", args)

    monkeypatch.setenv(checks.DEVICE_ENV, "cuda")
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    x = np.arange(3)
    assert checks.on_device(x) == ("on gpu", x) and made == [x]
    assert checks.xp.zeros(4) == ("zeros on gpu", (4,))


def test_a_cuda_run_without_cupy_fails_rather_than_skips(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(pytest.fail.Exception, match="--pluribus-device cuda needs cupy"):
        _require_cupy_device()
