"""The test session refuses to start beside Hugging Face's ``kernels`` distribution (required by transformers >= 5.25),
whose import name is this project's ``kernels/`` package, and says why."""
from __future__ import annotations

import importlib.metadata

import conftest
import pytest


def test_a_foreign_kernels_distribution_stops_the_session_with_the_reason(monkeypatch):
    real_version = importlib.metadata.version

    def version(name):
        return "0.19.1" if name == "kernels" else real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert conftest._foreign_kernels_distribution() == "0.19.1"
    with pytest.raises(pytest.UsageError, match=r"`kernels` 0\.19\.1 .*collides with this project's kernels/"):
        conftest.pytest_configure(None)


def test_this_environment_has_no_foreign_kernels_distribution():
    assert conftest._foreign_kernels_distribution() is None
    import kernels
    assert hasattr(kernels, "get_backend")          # the project's own package
