"""``erase-tune dashboard`` as a person sees it: the real optuna-dashboard (0.21) in headless Chromium.

The API answering (tests/tune/test_dashboard.py) does not prove the page renders. Here a
finished study (tests/tune/studies.py) is served by ``python -m erase_tune dashboard``, the
study's page is opened in Chromium and the test waits for the Pareto-front plot, then checks:

- the objectives carry their names (``qps_gain``, ``ne_gap``) on the page;
- the Pareto-front plot (the plotly graph in ``#graph-pareto-front``) drew a point per complete
  trial, and split them by the NE budget the way optuna-dashboard does: it reads the
  ``constraints`` *system attr* (a list; Optuna 5's per-constraint ``constraints:<name>`` keys
  are not read), and a trial with any value > 0 goes to its "Infeasible Trial" trace. The
  "Best Trial" trace is the front of the feasible trials;
- the timeline's legend names infeasible trials, and a trial's page lists its ``feasible``,
  ``ne_gap`` and ``max_ne_gap`` user attrs: the budget is visible per trial.

Screenshots are kept in ``$ERASE_TUNE_TEST_ARTIFACTS`` when set. Chromium comes from
scripts/install-browser.sh; without it the test fails and says so (it never skips).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from PIL import Image

from tests.tune.conftest import ROOT
from tests.tune.studies import FRONT, MAX_NE_GAP, STUDY_NAME, write_finished_study

# Headless in a closed network: no sandbox (root in a container), no GPU, and none of the
# background connections (updates, sync, QUIC) a closed network refuses.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
RENDER_TIMEOUT_MS = 30_000


def _chromium() -> str:
    path = os.environ.get("ERASE_TUNE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("Chromium is not installed: run scripts/install-browser.sh (as root; it installs Debian's "
                    "chromium), or point ERASE_TUNE_CHROMIUM at a Chromium binary", pytrace=False)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def study_url(tmp_path_factory) -> str:
    return write_finished_study(tmp_path_factory.mktemp("browser") / "dash.db")


@pytest.fixture(scope="module")
def dashboard(study_url) -> Iterator[tuple[int, int]]:
    """(port, study_id) of ``erase-tune dashboard`` serving the study, in its own process."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "erase_tune", "dashboard", "--storage", study_url,
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"dashboard exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                summaries = _get(port, "/api/studies")["study_summaries"]
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail("dashboard did not answer within 30 s")
                time.sleep(0.3)
        (study_id,) = [s["study_id"] for s in summaries if s["study_name"] == STUDY_NAME]
        yield port, study_id
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright Python package is missing: install erase-tune's test extra "
                    "(it drives the system Chromium; no browser download)", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def artifacts(tmp_path) -> Path:
    where = os.environ.get("ERASE_TUNE_TEST_ARTIFACTS")
    path = Path(where) if where else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


def _screenshot(page, path: Path, *, full_page: bool = True) -> None:
    page.screenshot(path=str(path), full_page=full_page)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    with Image.open(path) as im:
        assert im.width >= 800 and im.height >= 600, im.size
        im.verify()


def _expected(study_url: str) -> dict[str, set[tuple[float, float]]]:
    """(qps_gain, ne_gap) of the complete trials, by the trace optuna-dashboard should put them in."""
    study = optuna.load_study(study_name=STUDY_NAME, storage=study_url)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    key = lambda t: (round(t.values[0], 12), round(t.values[1], 12))  # noqa: E731
    return {
        "infeasible": {key(t) for t in complete if t.values[1] > MAX_NE_GAP},
        "feasible": {key(t) for t in complete if t.values[1] <= MAX_NE_GAP},
        "best": {key(t) for t in complete if t.number in FRONT},
        "count": {(len(complete), 0.0)},
    }


# plotly keeps each drawn trace on the graph's div (gd.data); the dashboard names its Pareto-front
# traces in the hover template: "<extra>Infeasible Trial</extra>", "...Feasible Trial...", "...Best Trial..."
_TRACES = """() => Array.from(document.getElementById('graph-pareto-front').data || []).map(t => ({
    name: ((t.hovertemplate || '').match(/<extra>(.*)<\\/extra>/) || [null, ''])[1],
    points: (t.x || []).map((x, i) => [x, t.y[i]]).filter(p => p[0] !== null && p[1] !== null)}))"""


def test_the_study_page_draws_the_pareto_front_with_named_objectives_and_the_budget(
        dashboard, browser, study_url, artifacts):
    port, study_id = dashboard
    expected = _expected(study_url)
    (n_complete, _), = expected["count"]
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"http://127.0.0.1:{port}/dashboard/studies/{study_id}")
        # rendered: plotly has drawn a marker for every complete trial
        page.wait_for_function(
            "n => document.querySelectorAll('#graph-pareto-front .scatterlayer path.point').length >= n",
            arg=n_complete, timeout=RENDER_TIMEOUT_MS)
        page.wait_for_function("() => document.querySelector('#graph-timeline .legendtext') !== null",
                               timeout=RENDER_TIMEOUT_MS)
        _screenshot(page, artifacts / "dashboard_study.png")

        text = page.inner_text("body")
        assert "Pareto Front" in text
        assert "qps_gain" in text and "ne_gap" in text  # the objective pickers and axes use the metric names
        traces = {t["name"]: {(round(x, 12), round(y, 12)) for x, y in t["points"]} for t in page.evaluate(_TRACES)}
        assert traces["Infeasible Trial"] == expected["infeasible"]
        assert traces["Feasible Trial"] | traces["Best Trial"] == expected["feasible"]
        assert traces["Best Trial"] == expected["best"]  # the front within the budget (a repeat shares its point)
        assert page.locator("#graph-pareto-front .scatterlayer path.point").count() == n_complete

        legend = page.locator("#graph-timeline .legendtext").all_text_contents()  # SVG text: no innerText
        assert "Infeasible" in legend and "Complete" in legend, legend
    finally:
        page.close()


_SCROLL_PANE = """e => {
    let pane = e.parentElement;
    while (pane && !(pane.scrollHeight > pane.clientHeight && getComputedStyle(pane).overflowY !== 'visible')) {
        pane = pane.parentElement;
    }
    if (pane) pane.scrollTop += e.getBoundingClientRect().top - pane.getBoundingClientRect().top - 40;
}"""


def test_a_trial_page_shows_its_ne_gap_against_the_budget(dashboard, browser, artifacts):
    port, study_id = dashboard
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        # trial 5 is over the budget: NE gap 3.1% against 2%
        page.goto(f"http://127.0.0.1:{port}/dashboard/studies/{study_id}/trials?numbers=5")
        page.get_by_text("User Attributes").wait_for(timeout=RENDER_TIMEOUT_MS)
        budget = page.get_by_text("max_ne_gap").first
        budget.wait_for(timeout=RENDER_TIMEOUT_MS)
        # the attributes scroll inside their own pane: scroll that pane (only; scrollIntoView slides
        # the whole page sideways) so the budget shows, and take the window
        budget.evaluate(_SCROLL_PANE)
        _screenshot(page, artifacts / "dashboard_trial_5.png", full_page=False)
        text = page.inner_text("body")
        assert "Trial 5 (trial_id=" in text
        assert re.search(r"\bfeasible\s+False\b", text), text
        assert re.search(r"\bmax_ne_gap\s+0\.02\b", text), text
        assert re.search(r"\bne_gap\s+0\.031\b", text), text
    finally:
        page.close()
