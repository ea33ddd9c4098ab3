"""The README's "Running the parts on real machines", line by line on loopback, as a newcomer follows
it: a broker, the data, the server, a device; then the dashboard address the server logs, opened in
Chromium, shows the job live (issue 17's "done when")."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
webdriver = pytest.importorskip("selenium.webdriver", reason="the test extra installs selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def readme_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Running the parts on real machines") :]
    block = section[section.index("```bash\n") + 8 : section.index("```", section.index("```bash\n") + 8)]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_parts_run_as_written_and_the_dashboard_shows_the_job(tmp_path) -> None:
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("CI needs Debian's chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("Chromium and chromedriver are not installed")
    lines = readme_lines()
    assert [line.split()[1] for line in lines] == ["broker", "data", "ps", "client"]
    mqtt, ws, web = free_port(), free_port(), free_port()  # 1883, 9001 and 8080 may be taken on this machine
    ports = {"1883": str(mqtt), "9001": str(ws), "8080": str(web)}

    def command(line: str) -> list[str]:
        line = line.replace("HOST", "127.0.0.1")
        words = [ports.get(word, word) for word in shlex.split(line)]
        words = [re.sub(r":1883$", f":{mqtt}", w) for w in words]
        return [sys.executable, "-m", "edgeps.cli", *words[1:]]

    broker_cmd = command(lines[0])
    broker_cmd += [] if "--ws-port" in broker_cmd else ["--ws-port", str(ws)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started: list[subprocess.Popen[str]] = []
    try:
        broker = subprocess.Popen(
            broker_cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        started.append(broker)
        assert broker.stdout is not None
        announced = ""
        while "Ctrl-C" not in announced and broker.poll() is None:  # its log lines, then what it says
            announced = broker.stdout.readline()
        assert f"ws://127.0.0.1:{ws}" in announced, announced  # the page's listener, printed
        subprocess.run(command(lines[1]), cwd=tmp_path, check=True, capture_output=True, timeout=120)
        ps_log = (tmp_path / "ps.log").open("w")
        moved = ["--dashboard-broker", f"ws://127.0.0.1:{ws}"]  # the listener is not on 9001 here: say where
        server = subprocess.Popen(
            [*command(lines[2]), *moved], cwd=tmp_path, stdout=ps_log, stderr=subprocess.STDOUT, env=env
        )
        started.append(server)  # type: ignore[arg-type]
        wait_until(lambda: "the dashboard on " in (tmp_path / "ps.log").read_text(), timeout=30, what="its URL")
        url = re.search(r"the dashboard on (\S+)", (tmp_path / "ps.log").read_text()).group(1)
        assert "job=j1" in url and f"%3A{ws}" in url
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
        browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
        try:
            from selenium.webdriver.common.by import By

            browser.get(url)
            text = lambda element_id: browser.find_element(By.ID, element_id).text  # noqa: E731
            wait_until(lambda: text("connection").startswith("connected"), timeout=20, what="the page's connection")
            device = subprocess.Popen(
                command(lines[3]), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
            )
            started.append(device)  # type: ignore[arg-type]
            wait_until(
                lambda: text("version") not in ("", "–") and int(text("version")) >= 5,
                timeout=60,
                what="the job's versions on the page",
            )
            assert text("job") == "j1" and "dev-00" in text("devices") and float(text("accuracy")) > 0.1
            if os.environ.get("EDGEPS_README_SCREENSHOT"):
                browser.save_screenshot(os.environ["EDGEPS_README_SCREENSHOT"])
            assert server.wait(timeout=120) == 0  # the job runs to its end
            wait_until(lambda: text("state") == "finished", timeout=20, what="the page to show the end")
        finally:
            browser.quit()
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        time.sleep(0)  # nothing to wait for: the processes are gone
