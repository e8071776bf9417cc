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


@pytest.fixture(params=["compiled", "numpy"])
def loops(request, monkeypatch):
    """Run a test on the compiled loops (runtime/kernels/jit.py) and on the numpy fast paths."""
    from maceq.runtime.kernels import jit as k_jit

    if request.param == "numpy":
        monkeypatch.setenv("MACEQ_NO_JIT", "1")
        assert not k_jit.available()
    else:
        monkeypatch.delenv("MACEQ_NO_JIT", raising=False)
        monkeypatch.delenv("MACEQ_NO_BLAS_BINDING", raising=False)
        assert k_jit.available(), "numba is a dependency: the compiled loops must be available"
        # numpy's wheels ship OpenBLAS: the compiled convolutions must find its GEMMs, or they would
        # silently test the numpy paths twice
        assert k_jit.gemm_available(), "no CBLAS GEMM found in numpy's BLAS (runtime/kernels/blas.py)"
    return request.param
