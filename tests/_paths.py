"""Paths the tests need, computed once from this file's place, so a test file can move without its paths changing."""

from __future__ import annotations

from pathlib import Path

__all__ = ["REPO", "SCRIPTS"]

REPO = Path(__file__).resolve().parents[1]  # the checkout: tests/ sits at its root
SCRIPTS = REPO / "tests" / "scripts"  # scripts the tests run as subprocesses
