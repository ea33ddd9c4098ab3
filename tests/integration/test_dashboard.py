"""The dashboard in headless Chromium: it loads from the server (which tells it its job and the
broker's WebSockets listener), shows a live job over MQTT on WebSockets (MQTT.js), survives a broker
restart, pauses the job with its button, and shows the job's end."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from broker.client import BrokerAddress
from broker.launcher import start_broker
from edge_client.core import DeviceCore
from edge_client.mqtt import connect_device, run_device
from edge_client.profile import DeviceProfile
from edge_client.trainer import NumpyTrainer
from learning.data import Dataset, load_digits
from learning.model import init_mlp
from learning.prepare import prepare_shards
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator
from ps_service.io.mqtt import connect_server, serve
from ps_service.io.prometheus import MetricsEndpoint
from ps_service.server.core import ServerCore
from tests.helpers import stop_devices, wait_until

webdriver = pytest.importorskip("selenium.webdriver", reason="the test extra installs selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    if os.environ.get("CI"):
        pytest.fail("CI needs Debian's chromium and chromium-driver (.ci/run installs them)")
    pytest.skip("Chromium and chromedriver are not installed", allow_module_level=True)


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1200,820",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def test_the_dashboard_shows_a_live_job_and_pauses_it(mosquitto, tmp_path, browser) -> None:
    from selenium.webdriver.common.by import By

    assert mosquitto.ws_port, "the project's broker config has a websockets listener"
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path, devices=2, alpha=0.5, seed=0)
    holdout = Dataset.load(shards.holdout)
    core = ServerCore(
        ServerConfig(job="dash", pace="bsp", rounds=10**6, min_devices=2, metrics_interval_s=0.5),
        init_mlp([64, 32, 10], seed=0),
        Evaluator(holdout, clock=time.perf_counter),
    )
    endpoint = MetricsEndpoint(0, page={"job": "dash", "broker": f"ws://127.0.0.1:{mosquitto.ws_port}"})
    transport = connect_server(core, address)
    stop = threading.Event()
    server = threading.Thread(target=serve, args=(core, transport, stop), kwargs={"endpoint": endpoint}, daemon=True)
    server.start()
    devices = [
        DeviceCore("dash", f"dev-{i}", Dataset.load(p), NumpyTrainer(), seed=i) for i, p in enumerate(shards.devices)
    ]
    runners = [
        threading.Thread(
            target=run_device, args=(d, connect_device(d, address), DeviceProfile(step_s=0.01)), daemon=True
        )
        for d in devices
    ]
    for runner in runners:
        runner.start()
    try:
        wait_until(lambda: len(endpoint.history) >= 6, timeout=30, what="the job's first metrics")
        before = len(endpoint.history)  # opened mid-job, the page draws the job from its start
        browser.get(f"http://127.0.0.1:{endpoint.port}/")  # no parameters: config.json says where the job is
        text = lambda element_id: browser.find_element(By.ID, element_id).text  # noqa: E731
        wait_until(lambda: "connected" in text("connection"), timeout=15, what="the page's MQTT connection")
        for chart in ("curve", "losses"):
            assert int(browser.find_element(By.ID, chart).get_attribute("data-points")) >= before
        wait_until(
            lambda: text("accuracy") not in ("", "–") and float(text("accuracy")) > 0.5,
            timeout=30,
            what="a live accuracy",
        )
        if os.environ.get("EDGEPS_SCREENSHOT"):  # for docs/dashboard.png: a longer curve
            wait_until(lambda: core.store.version >= 60, timeout=60, what="sixty versions")
        shown = float(text("accuracy"))
        assert abs(shown - core.history[-1].accuracy) < 0.2  # the job's, not a made-up number
        assert text("online") == "2" and "dev-0" in text("devices") and text("job") == "dash"
        assert text("server_step") == "1 (plain average)"  # bsp never extrapolates
        # The broker restarts (same ports, its persistence): the page reconnects by itself and goes on.
        mosquitto.process.terminate()
        mosquitto.process.wait(timeout=10)
        wait_until(lambda: "connected" not in text("connection"), timeout=15, what="the page to see the broker go")
        restarted = start_broker(
            port=mosquitto.port, ws_port=mosquitto.ws_port, workdir=mosquitto.workdir, embedded=False
        )
        mosquitto.process = restarted.process  # the fixture stops this one
        version = int(text("version"))
        wait_until(lambda: text("connection").startswith("connected"), timeout=30, what="the page to reconnect")
        wait_until(lambda: int(text("version")) > version, timeout=30, what="live versions again")
        browser.find_element(By.ID, "pause").click()
        wait_until(lambda: core.paused, timeout=10, what="the job to pause")
        wait_until(lambda: text("state") == "paused", timeout=10, what="the page to show it")
        wait_until(lambda: "ok: pause" in text("reply"), timeout=10, what="the server's reply")
        if os.environ.get("EDGEPS_SCREENSHOT"):
            browser.save_screenshot(os.environ["EDGEPS_SCREENSHOT"])
        browser.find_element(By.ID, "stop").click()  # the end of the job: the page says so, figures stay
        wait_until(lambda: text("state") == "finished", timeout=15, what="the page to show the job finished")
        assert text("accuracy") not in ("", "–") and int(text("version")) >= version
    finally:
        stop.set()
        server.join(timeout=10)
        stop_devices(devices, runners)
        transport.close()
        endpoint.close()


def test_against_a_secure_broker_the_page_asks_for_the_account_and_keeps_it_out_of_the_url(tmp_path, browser) -> None:
    """1.0 took the operator's password in the page's URL (query string, plain HTTP, history). The
    audit of 1.5: a link's ?broker= overrode the served broker, and a fake broker received the
    operator's login over plain ws:// from the genuine page's origin; a device's retained status
    naming another device showed that one offline, and a retained non-JSON status stopped the page."""
    import socket

    from selenium.webdriver.common.by import By

    from broker.client import MqttTransport
    from broker.deploy.secure import init_secure_broker
    from broker.launcher import start_broker
    from schemas.topics import Publish, Topics

    setup = init_secure_broker(tmp_path / "setup", "dash", devices=["dev-0"], operators=["op"])
    broker = start_broker(workdir=tmp_path / "run", embedded=False, template=setup.config)
    served = f"wss://127.0.0.1:{broker.ws_port}"
    endpoint = MetricsEndpoint(0, page={"job": "dash", "broker": served})
    fake = socket.create_server(("127.0.0.1", 0))  # a stranger's broker: it must never hear from the page
    fake.settimeout(0.2)
    browser.execute_cdp_cmd("Security.setIgnoreCertificateErrors", {"ignore": True})  # the job's own CA
    t = Topics("dash")
    device = MqttTransport(
        BrokerAddress("127.0.0.1", broker.port, "dev-0", setup.passwords["dev-0"], tls_ca=str(setup.ca_cert)),
        "dev-0",
        [],
    )
    device.wait_connected(10)
    try:
        link = f"?broker=ws://127.0.0.1:{fake.getsockname()[1]}&job=other"
        browser.get(f"http://127.0.0.1:{endpoint.port}/{link}")
        text = lambda element_id: browser.find_element(By.ID, element_id).text  # noqa: E731
        wait_until(lambda: "refused" in text("connection"), timeout=15, what="the anonymous attempt to be refused")
        assert browser.find_element(By.ID, "login").is_displayed() and text("job") == "dash"
        browser.find_element(By.ID, "username").send_keys("op")
        browser.find_element(By.ID, "password").send_keys(setup.passwords["op"])
        browser.find_element(By.ID, "connect").click()
        wait_until(
            lambda: "connected" in text("connection") and "as op" in text("connection"),
            timeout=15,
            what="the operator's login",
        )
        assert served in text("connection")  # the served broker, not the link's
        with pytest.raises(TimeoutError):
            fake.accept()
        assert (
            setup.passwords["op"] not in browser.current_url and not browser.find_element(By.ID, "login").is_displayed()
        )
        assert browser.find_element(By.ID, "password").get_attribute("value") == ""
        # dev-0's account leaves a status naming dev-9 offline, then a retained status that is not JSON
        device.publish(Publish(t.status("dev-0"), b'{"device":"dev-9","state":"offline"}', qos=1, retain=True))
        device.publish(Publish(t.status("dev-0"), b'{"device":"dev-0","state":"online","incarnation":1}', qos=1))
        device.publish(Publish(t.status("dev-0"), b"\xff not json", qos=1, retain=True))
        device.wait_acknowledged(10)
        wait_until(lambda: "dev-0" in text("devices"), timeout=15, what="dev-0's own status on the page")
        assert "dev-9" not in text("devices") and "connected" in text("connection")
    finally:
        device.close()
        fake.close()
        endpoint.close()
        broker.stop()


def test_the_demo_on_a_broker_of_ones_own_links_the_dashboard_to_its_websocket_port(mosquitto, tmp_path) -> None:
    """Under --broker the demo cannot see the broker's WebSocket listener: --dashboard-broker names it,
    and both the demo's link and the page's config.json carry it (not ws://HOST:9001)."""
    import subprocess
    import sys
    import urllib.parse

    from broker.launcher import free_port

    ws = f"ws://127.0.0.1:{mosquitto.ws_port}"
    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "demo",
        "--broker",
        f"{mosquitto.host}:{mosquitto.port}",
        "--metrics-port",
        str(free_port()),
        "--dashboard-broker",
        ws,
        "--rounds",
        "3",
        "--devices",
        "2",
        "--out",
        str(tmp_path / "out"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    links = [line for line in result.stdout.splitlines() if line.startswith("dashboard: ")]
    assert len(links) == 1 and links[0].endswith(f"&broker={ws}"), links
    server_log = (tmp_path / "out" / "logs" / "demo-ps.log").read_text()
    assert f"broker={urllib.parse.quote(ws, safe='')}" in server_log
