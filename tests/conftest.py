"""Fixtures of the repository-level tests. Being a conftest in a folder without
``__init__.py``, it also puts ``tests/`` on ``sys.path`` (pytest's rule), so that the tests in its
subfolders can import ``example_scripts``."""

import pytest


@pytest.fixture
def one_blas_thread():
    """Thread ranks share this process's BLAS pool; one thread keeps them from fighting."""
    try:
        from threadpoolctl import threadpool_limits  # comes with scikit-learn
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1):
        yield
