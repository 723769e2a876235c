"""The Liger-Kernel our loss calls: the `liger` extra's lower bound has every argument `model/loss.py` passes."""

from __future__ import annotations

import inspect
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests._paths import REPO

ACCUM_DTYPE_SINCE = Version("0.6.2")  # the first Liger-Kernel whose fused linear CE takes accum_dtype=


def test_liger_extra_requires_a_version_with_accum_dtype():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = [Requirement(r) for r in extras["liger"]]
    lower = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    assert requirement.name == "liger-kernel" and lower and min(lower) >= ACCUM_DTYPE_SINCE


def test_installed_liger_takes_accum_dtype():
    functional = pytest.importorskip("liger_kernel.transformers.functional", reason="Liger-Kernel is not installed")
    assert "accum_dtype" in inspect.signature(functional.liger_fused_linear_cross_entropy).parameters
