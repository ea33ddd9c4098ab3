from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from hypothesis import settings

from broker.launcher import BrokerProcess, start_broker


def _have_mosquitto() -> bool:
    return bool(shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin"))


@pytest.fixture
def mosquitto(tmp_path) -> Iterator[BrokerProcess]:
    """A Mosquitto started from broker/mosquitto.conf on a free loopback port."""
    if not _have_mosquitto():
        pytest.fail("Mosquitto is not installed: integration tests need it (apt-get install mosquitto)")
    broker = start_broker(workdir=tmp_path / "broker", embedded=False)
    try:
        yield broker
    finally:
        broker.stop()


# Shared CI machines are noisy: judge property tests by their examples, not their speed.
settings.register_profile("edgeps", deadline=None)
settings.load_profile("edgeps")
