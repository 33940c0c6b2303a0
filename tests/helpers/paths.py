"""Where things are: the repository root, tests/ and the folders the tests read, named once
(a test file in a tier folder, tests/<tier>/, never counts parents to find them)."""

from pathlib import Path

__all__ = ["REPO", "TESTS", "SCRIPTS"]

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
SCRIPTS = TESTS / "scripts"  # the scripts the multi-process tests run as jobs or processes
