"""The jobs page in a real headless Chromium (Debian's, driven through chromedriver): the key is entered
in the page and sent as a header, the list shows a running job, its page draws the curve and updates
as points arrive. A screenshot of the job page is kept under the session's temporary directory."""

from __future__ import annotations

import shutil

import pytest
from dfp_shared.jobs.store import JobStore

from .conftest import WRITE_KEY, served

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                                                  "(apt-get install -y chromium chromium-driver)")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--window-size=1400,1600")


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_the_page_shows_a_running_job_and_its_curve_growing(make_app, redis_client, browser, tmp_path_factory):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    jobs = JobStore(redis_client)
    job, _ = jobs.create("train", {"target": "file:///models/tiny", "block_size": 8}, owner="writer",
                         primary_unit="steps", totals={"steps": 40})
    jobs.start(job.id)
    jobs.set_counters(job.id, steps=2)
    for step in (1, 2):
        jobs.add_metrics(job.id, {"step": step, "loss": 9.0 - step, "accuracy": 0.1 * step})
    wait = WebDriverWait(browser, 30)
    with served(make_app()) as port:
        browser.get(f"http://127.0.0.1:{port}/ui/")
        browser.find_element(By.ID, "key").send_keys(WRITE_KEY)
        browser.find_element(By.CSS_SELECTOR, "#login button").click()
        wait.until(lambda d: job.id in d.find_element(By.ID, "job-rows").text)
        listed = browser.find_element(By.ID, "job-rows").text
        assert "running" in listed and "writer" in listed and "5% steps" in listed
        browser.find_element(By.LINK_TEXT, job.id).click()
        wait.until(lambda d: d.find_element(By.ID, "job-id").text == job.id)
        loss = browser.find_element(By.ID, "chart-loss")
        wait.until(lambda d: loss.get_attribute("data-points") == "2")
        for step in (3, 4):  # the trainer logs more points while the page is open
            jobs.add_metrics(job.id, {"step": step, "loss": 9.0 - step, "accuracy": 0.1 * step, "tau": 1.0 + step / 10})
        wait.until(lambda d: loss.get_attribute("data-points") == "4")
        wait.until(lambda d: browser.find_element(By.ID, "chart-tau").get_attribute("data-points") == "2")
        assert "step 4" in browser.find_element(By.ID, "latest").text
        drawn = browser.execute_script(  # the canvas really has the curve's pixels
            "const c = document.getElementById('chart-loss'); const d = c.getContext('2d')"
            ".getImageData(0, 0, c.width, c.height).data; let n = 0;"
            "for (let i = 0; i < d.length; i += 4) if (d[i + 2] > 200 && d[i] < 80) n++; return n;")
        assert drawn > 50
        assert WRITE_KEY not in browser.current_url
        assert browser.execute_script("return sessionStorage.getItem('dflash-api-key')") == WRITE_KEY
        artifacts = tmp_path_factory.getbasetemp() / "artifacts"
        artifacts.mkdir(exist_ok=True)
        assert browser.save_screenshot(str(artifacts / "job-page.png"))


def test_page_files_carry_a_same_origin_policy_and_nothing_else_is_served(api):
    page = api.get("/ui/", headers={"Authorization": ""})
    assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
    assert api.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert api.get("/ui/web.py").status_code == 404
    assert api.get("/ui/..%2Fweb.py").status_code == 404
