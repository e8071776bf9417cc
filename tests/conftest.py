"""Shared test fixtures: paths to the real third-party data beside the checkout."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"shared data folder {SHARED} is missing: the tests need ../shared/data beside the checkout")
    return SHARED
