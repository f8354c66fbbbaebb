import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


@pytest.fixture(params=["shm", "tcp"])
def transport(request, monkeypatch):
    """Runs a test once over same-host shared memory, once over tcp."""
    if request.param == "shm":
        import ferry

        why = ferry.shm_unavailable()
        if why:
            pytest.skip(f"no same-host path here: {why}")
    monkeypatch.setenv("FERRY_TRANSPORT", request.param)
    monkeypatch.setenv("FERRY_LISTEN_ADDR", "127.0.0.1")
    return request.param
