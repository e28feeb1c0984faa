"""Jobs started without pluribus-run: PLURIBUS_SECRET guards them, and a job without a secret
on an address other hosts can reach is warned about once."""

from __future__ import annotations

import socket
import warnings

import numpy as np
import pluribus as pb
import pytest
from pluribus import distributed
from pluribus.store import AUTH_TOKEN_ENV


@pytest.fixture
def fresh(monkeypatch):
    for name in (AUTH_TOKEN_ENV, distributed.SECRET_ENV):  # restored afterwards, set or not
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(distributed, "_warned_no_secret", False)
    return monkeypatch


def test_no_secret_on_a_reachable_address_warns_once(fresh):
    with pytest.warns(UserWarning, match="PLURIBUS_SECRET"):
        distributed._take_secret("10.20.30.40")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distributed._take_secret("10.20.30.40")  # once per process


def test_no_warning_on_loopback_or_with_a_secret(fresh):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distributed._take_secret("127.0.0.1")
        distributed._take_secret("localhost")
        fresh.setenv(distributed.SECRET_ENV, "s3cret")
        distributed._take_secret("10.20.30.40")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(30)
def test_env_jobs_take_their_secret_from_PLURIBUS_SECRET(fresh):
    port = _free_port()
    fresh.setenv("MASTER_ADDR", "127.0.0.1")
    fresh.setenv("MASTER_PORT", str(port))
    fresh.setenv(distributed.SECRET_ENV, "s3cret")
    pb.init_process_group("gloo", rank=0, world_size=1, timeout=10)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as outsider:
            hello = outsider.recv(9)
        assert hello == b"PLRBSTR1\x01", "the store served a client that had no secret"
        x = np.ones(3, np.float32)
        pb.all_reduce(x)
        assert x.tolist() == [1, 1, 1]
    finally:
        pb.destroy_process_group()
