"""Fixtures for the operator tests."""

import pytest
from op_helpers import make_report


@pytest.fixture
def report_factory():
    return make_report
