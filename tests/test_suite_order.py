"""The suite's start order (tests/conftest.py LONGEST_FIRST): a renamed or deleted slow file
would otherwise drop out of the list silently and start last again."""
from pathlib import Path

from tests.conftest import LONGEST_FIRST

REPO = Path(__file__).resolve().parents[1]


def test_every_file_the_suite_starts_first_exists_once():
    assert [p for p in LONGEST_FIRST if not (REPO / p).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
