"""The edge's status page in a real headless browser (Debian's Chromium through Selenium and
chromedriver), over a live hierarchy: devices and their last frames, exit shares, health reasons.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import urllib.request

import pytest

from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
from ddnn.tools.broker import free_port
from tests.support.hierarchy import Edge
from tests.support.polling import wait_for

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FRAMES = 30


def browser():
    """Headless Chromium, as root needs it (no sandbox) and with no network of its own."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        message = "chromium and chromium-driver are not installed (`make setup` does, as root)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the browser test, not skip it
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-quic"):
        options.add_argument(arg)
    # The driver named explicitly: Selenium never looks for (or downloads) one of its own.
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def _text(driver, element_id: str) -> str | None:
    """An element's text on a page that reloads itself every 2 s: None when the element is not
    there, or was replaced by a reload between finding it and reading it (poll again)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    try:
        return driver.find_element(By.ID, element_id).text
    except WebDriverException:
        # Not found, stale, or (Chromium's word for a reload caught mid-read) "Node with given
        # id does not belong to the document": all mean poll again.
        return None


def test_the_status_page_shows_devices_exits_and_health(mosquitto, tiny_bundle, tiny_data,
                                                        cloud_tiny_url):
    from selenium.webdriver.common.by import By

    port = free_port()
    edge = Edge(tiny_bundle, mosquitto.url, cloud_tiny_url, deployment="page", http_port=port,
                local_threshold=0.3, edge_threshold=0.5)
    page = f"http://127.0.0.1:{port}/status"
    with contextlib.ExitStack() as stack:
        stack.callback(edge.stop)
        driver = browser()
        stack.callback(driver.quit)
        devices = stack.enter_context(contextlib.ExitStack())  # closed in the middle
        services = [devices.enter_context(DeviceService.from_settings(DeviceSettings(
            bundle=tiny_bundle, view=v, broker=mosquitto.url, deployment="page",
            data=tiny_data.test, limit=FRAMES, fps=0, grace=0.5, drain_timeout=30, keepalive=5,
            reconnect_max=1, peers=("cam0", "cam1", "cam2"), wait_peers=20)))
            for v in range(3)]
        threads = [threading.Thread(target=d.run) for d in services]
        for t in threads:
            t.start()
        wait_for(lambda: edge.agg.answered >= FRAMES, 60, f"{FRAMES} frames answered")

        driver.get(page)
        assert driver.title == "ddnn edge: tiny 1"
        rows = driver.find_elements(By.CSS_SELECTOR, "#devices tr")[1:]
        cells = [[td.text for td in r.find_elements(By.TAG_NAME, "td")] for r in rows]
        assert [c[0] for c in cells] == ["cam0", "cam1", "cam2"]
        assert all(c[3] != "—" for c in cells), f"every device was fused in a frame: {cells}"
        exit_rows = driver.find_elements(By.CSS_SELECTOR, "#exits tr")[1:]
        exits = {tds[0].text: tds for tds in (r.find_elements(By.TAG_NAME, "td")
                                              for r in exit_rows)}
        assert sum(int(tds[1].text) for tds in exits.values()) == FRAMES
        assert exits["local"][3].text == "0.3" and exits["edge"][3].text == "0.5"
        recent = driver.find_elements(By.CSS_SELECTOR, "#recent tr")[1:]
        assert len(recent) == 20
        assert recent[0].find_element(By.TAG_NAME, "td").text == str(FRAMES - 1)

        # The devices end their replay and say they are offline: the page, refreshing itself,
        # turns unhealthy and says why.
        for t in threads:
            t.join(60)
        devices.close()
        wait_for(lambda: _text(driver, "health") == "unhealthy", 30,
                 "the page to show the edge unhealthy")
        reasons = wait_for(lambda: _text(driver, "reasons"), 10, "the reasons shown")
        assert "every device is offline" in reasons, reasons
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=5) as r:
            data = json.loads(r.read())
        assert data["healthy"] is False
        assert [d["state"] for d in data["devices"]] == ["offline"] * 3
