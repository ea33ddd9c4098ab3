from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="session")
def sdk(tmp_path_factory) -> Path:
    """The C device SDK (edge_client/embedded) built once with AddressSanitizer and UBSan: the folder
    holding its host tools (epsf, epsd) and, where libmosquitto's headers are, edgeps-device."""
    from edgeps.sdk.build import make

    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.fail("the C SDK's tests need make and a C compiler (apt-get install gcc make)")
    build = tmp_path_factory.mktemp("sdk")
    mosquitto = Path("/usr/include/mosquitto.h").exists()
    make(build, "all", *(["edgeps-device"] if mosquitto else []), SAN=1)
    return build


@pytest.fixture
def epsd(sdk) -> Path:
    """The C device core's harness (edge_client/embedded/tools), built with the sanitizers."""
    return sdk / "epsd"


@pytest.fixture(scope="session")
def sdk32(tmp_path_factory) -> Path:
    """The SDK's host tools built for a 32-bit target (``-m32``: size_t of 32 bits, as on a 32-bit
    Linux gateway or a microcontroller), with the sanitizers."""
    from edgeps.sdk.build import make

    build = tmp_path_factory.mktemp("sdk32")
    try:
        make(build, "all", SAN=1, CC=f"{os.environ.get('CC', 'cc')} -m32")
    except RuntimeError as exc:
        pytest.fail(f"the 32-bit build needs gcc-multilib (apt-get install gcc-multilib): {str(exc)[-300:]}")
    return build


#: Fixtures that start real processes: a test that uses one is an integration test.
PROCESS_FIXTURES = {"mosquitto", "secure", "sdk", "sdk32", "epsf", "epsd", "edgeps_device", "toolchain", "browser"}
#: Folders whose tests start brokers, builds or jobs themselves.
PROCESS_FOLDERS = ("integration", "broker")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests that start Mosquitto, build the C SDK, run QEMU or whole jobs as
    ``integration``: ``pytest -m "not integration"`` runs the rest, the fast ones."""
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in PROCESS_FOLDERS or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
            # Under pytest-xdist (`-n 2 --dist loadgroup`, as .ci/run runs them) the integration tests
            # stay one after another on one worker, as without it: jobs, QEMU images and benches that
            # time themselves never share the machine with each other, only with the unit tests.
            item.add_marker(pytest.mark.xdist_group("processes"))
