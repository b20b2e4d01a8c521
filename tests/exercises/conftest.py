"""Every test here runs exercise cases, each in a child forked from the test process."""
import pytest


@pytest.fixture(scope="session", autouse=True)
def _references_imported(references_imported):
    """tests/conftest.py's ``references_imported`` for every test here."""
