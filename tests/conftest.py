"""Suite-wide fixtures."""

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_structlog():
    """Commands run in-process (`moemesh generate`, services) configure structlog globally, e.g.
    with a warning-level filter; restore the defaults so no test sees another test's configuration."""
    yield
    structlog.reset_defaults()
