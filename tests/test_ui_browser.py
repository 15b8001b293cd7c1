"""`mlx-fun ui` in a real headless Chromium: the real `mlx-fun serve` (bundled chat model, with an API key) and the
real `mlx-fun ui` run as subprocesses on loopback ports, and Playwright's Python package drives Debian's Chromium
(/usr/bin/chromium; no browser download). Skipped, with the reason, when Chromium or Playwright is missing.

Screenshots of every tab go to the test's tmp dir; with MLXFUN_SCREENSHOTS=docs/images they also go there (the
README's pictures: `MLXFUN_SCREENSHOTS=docs/images python -m pytest tests/test_ui_browser.py`).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.model.io import bundled_model_dir

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[1]
CHAT_MODEL = bundled_model_dir().parent / "tiny-moe-chat"
MLX_FUN = Path(sys.executable).parent / "mlx-fun"
KEY = "browser-test-key"
SHOTS_ENV = "MLXFUN_SCREENSHOTS"
TIMEOUT = 30.0

pytestmark = pytest.mark.browser


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found (Debian: apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright's Python package is not installed (pip install -e '.[dev]')"
    return None


class Proc:
    """An `mlx-fun` command in the background, ready once its stderr says "Serving ... on <url>"; stopped with
    Ctrl+C (SIGINT) as a user would."""

    def __init__(self, *args: str, cwd: Path):
        self.args = args
        self.proc = subprocess.Popen([str(MLX_FUN), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.err: list[str] = []
        self.url: str | None = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.err.append(line)
                m = re.search(r"^Serving .* on (http://[\d.]+:\d+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        assert ready.wait(120) and self.url, f"mlx-fun {' '.join(args)}:\n{''.join(self.err)}"

    def stop(self) -> str:
        """Ctrl+C; the command must exit 0 without a traceback."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        out = self.proc.stdout.read()
        rc, err = self.proc.wait(60), "".join(self.err)
        self.proc.stdout.close()
        assert "Traceback" not in err, err
        assert rc == 0, f"mlx-fun {' '.join(self.args)}: exit {rc}\n{out}\n{err}"
        return out


def rest(url: str, method: str = "GET", body: dict | None = None) -> dict:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def wait_text(page, selector: str, pred, what: str, timeout: float = TIMEOUT) -> str:
    """The inner text of ``selector`` once ``pred(text)`` holds."""
    end, text = time.monotonic() + timeout, ""
    while time.monotonic() < end:
        text = page.locator(selector).inner_text()
        if pred(text):
            return text
        time.sleep(0.1)
    raise AssertionError(f"{what}: {selector} still shows {text!r}")


def fill(page, elem_id: str, value: str) -> None:
    """Type ``value`` into a textbox and leave it (gradio keeps what was typed once the box loses focus)."""
    box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
    box.fill(value)
    box.press("Tab")
    wait_until(lambda: box.input_value() == value, f"{elem_id} to hold {value!r}")


def pick(page, elem_id: str, *values: str) -> None:
    """Choose ``values`` in a gradio dropdown (typed, then Enter)."""
    box = page.locator(f"#{elem_id} input")
    for v in values:
        box.click()
        box.fill(v)
        page.keyboard.press("Enter")


@pytest.fixture()
def shots(tmp_path):
    """``shot(page, name)``: a full-page screenshot in tmp_path/screens (and in $MLXFUN_SCREENSHOTS if set)."""
    dirs = [tmp_path / "screens"] + ([Path(os.environ[SHOTS_ENV])] if os.environ.get(SHOTS_ENV) else [])
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    taken = []

    def shot(page, name: str) -> None:
        page.wait_for_timeout(300)  # let the last update paint
        path = dirs[0] / f"ui-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        for d in dirs[1:]:
            shutil.copyfile(path, d / path.name)
        taken.append(name)

    shot.taken = taken
    return shot


def rendered_heatmap(page, selector: str) -> np.ndarray:
    """The RGB pixels of the PNG a gr.Plot shows (its <img> data URL, exactly what matplotlib wrote)."""
    from PIL import Image

    src = page.locator(f"{selector} img").first.get_attribute("src")
    assert src and src.startswith("data:image/png;base64,"), (src or "")[:60]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB")).astype(int)


def check_heatmap_shows(png: np.ndarray, freq: np.ndarray, layers: list[int]) -> None:
    """Every (layer, expert) cell of the rendered heatmap has the colour of the server's count there."""
    from mlx_fun.ui import plots

    fig = plots.heatmap(freq, metric="freq", layer_names=layers)
    width, height = fig.canvas.get_width_height()
    assert png.shape == (height, width, 3)
    image = fig.axes[0].images[0]
    for r in range(freq.shape[0]):
        for c in range(freq.shape[1]):
            x, y = plots.cell_pixel(fig, r, c)
            want = np.array(image.cmap(image.norm(freq[r, c]))[:3]) * 255
            assert np.abs(png[y, x] - want).max() <= 2, (r, c, freq[r, c], png[y, x], want)


def check_cells_shown(png: np.ndarray, fig) -> None:
    """Every cell of the rendered map has the colour ``fig`` (the figure the tab drew) gives it."""
    from mlx_fun.ui import plots

    width, height = fig.canvas.get_width_height()
    assert png.shape == (height, width, 3)
    image = fig.axes[0].images[0]
    for (r, c), value in np.ndenumerate(np.asarray(image.get_array())):
        x, y = plots.cell_pixel(fig, r, c)
        want = np.array(image.cmap(image.norm(value))[:3]) * 255
        assert np.abs(png[y, x] - want).max() <= 2, (r, c, value, png[y, x], want)


def test_dashboard_in_a_real_browser(tmp_path, shots):
    reason = _missing()
    if reason:
        print(f"\nbrowser test skipped: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    t0 = time.monotonic()
    data = tmp_path / "data"
    data.mkdir()
    jobs.safety_scan.run(model=CHAT_MODEL, harmful_dataset=ROOT / "data/safety/harmful_test.jsonl",
                         benign_dataset=ROOT / "data/safety/benign_test.jsonl", output=data / "safety_report.json",
                         max_samples=16, seed=0)
    serve_args = ("serve", "--model", str(CHAT_MODEL), "--mode", "full", "--data-dir", str(data), "--api-key", KEY)
    procs = [Proc(*serve_args, "--port", "0", cwd=tmp_path)]
    try:
        ui = Proc("ui", "--server-url", procs[0].url, "--port", "0", "--data-dir", str(data), "--api-key", KEY,
                  cwd=tmp_path)
        procs.append(ui)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                        args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.set_default_timeout(TIMEOUT * 1000)
                page.goto(ui.url)
                _walk_the_tabs(page, shots, procs, data, serve_args, tmp_path)
            finally:
                browser.close()
        assert "Dashboard on" in ui.stop()  # Ctrl+C: exit 0, no traceback
        procs[-1].stop()  # the restarted server
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait()
    assert sorted(shots.taken) == ["chat", "controls", "dashboard", "diff", "merge", "server-down", "steering"]
    print(f"\nbrowser test: {time.monotonic() - t0:.1f} s")


def wait_until(fn, what: str, timeout: float = TIMEOUT):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if fn():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Run:
    """What the steps share: the page, the screenshot taker, the processes (``procs[0]``: the server; a restarted
    server is appended), the data directory, the serve arguments and the test's tmp dir."""

    def __init__(self, page, shot, procs, data, serve_args, tmp_path):
        self.page, self.shot, self.procs, self.data, self.serve_args, self.tmp = (page, shot, procs, data, serve_args,
                                                                                  tmp_path)

    @property
    def server(self) -> Proc:
        return self.procs[0]

    def tab(self, name: str) -> None:
        """Open a tab and wait until its panel is shown (gradio renders a tab's content when it is first opened)."""
        self.page.get_by_role("tab", name=name).click()
        ident = {"Merge Mode Comparison": "merge", "Diff Analysis": "diff"}.get(name, name.lower())
        self.page.locator(f"#tab-{ident}").wait_for(state="visible")
        self.page.wait_for_timeout(200)


def _walk_the_tabs(page, shot, procs, data, serve_args, tmp_path):
    run = Run(page, shot, procs, data, serve_args, tmp_path)
    for step in (_chat_then_dashboard, _steering, _controls, _merge_then_prune, _diff, _server_down_and_back):
        step(run)


def _chat_then_dashboard(run: Run) -> None:
    page, server = run.page, run.server
    # Dashboard before any traffic: nothing counted
    run.tab("Dashboard")
    wait_text(page, "#dashboard-summary", lambda t: t.startswith("0 tokens"), "the empty dashboard")

    # Chat: the reply streams in (the bot message grows step by step) and stays
    run.tab("Chat")
    page.evaluate("""() => { window.__replies = []; const root = document.querySelector('#chatbot');
        new MutationObserver(() => { const bots = root.querySelectorAll('[data-testid="bot"]');
          if (bots.length) window.__replies.push(bots[bots.length - 1].innerText); })
        .observe(root, {subtree: true, childList: true, characterData: true}); }""")
    fill(page, "chat-input", "What does os.path.join do?")
    page.locator("#chat-send").click()
    bots = page.locator('#chatbot [data-testid="bot"]')
    wait_until(lambda: bots.count() > 0 and page.locator("#chat-status").inner_text().strip() == "", "the reply",
               timeout=60)
    reply = bots.last.inner_text().strip()
    grown = {len(r.strip()) for r in page.evaluate("window.__replies") if r.strip()}
    assert reply and len(grown) >= 3 and max(grown) == len(reply), (reply, sorted(grown))
    run.shot(page, "chat")

    # Dashboard: the heatmap the browser shows has, cell by cell, the colours of the server's counts after the chat
    stats = rest(f"{server.url}/v1/reap/stats")
    freq = np.asarray(stats["freq"], dtype=np.float64)
    assert stats["request_count"] == 1 and stats["token_count"] > 0
    np.testing.assert_array_equal(freq.sum(axis=1), stats["top_k"] * stats["token_count"])
    run.tab("Dashboard")
    summary = wait_text(page, "#dashboard-summary", lambda t: t.startswith(f"{stats['token_count']:,} tokens"),
                        "the dashboard after the chat")
    assert f"{int((freq == 0).sum())} of {freq.size} (layer, expert) pairs received no traffic" in summary
    page.locator("#dashboard-heatmap img").first.wait_for()
    check_heatmap_shows(rendered_heatmap(page, "#dashboard-heatmap"), freq, stats["moe_layer_indices"])
    assert page.locator("#dashboard-bars img").count() == 1
    run.shot(page, "dashboard")


def _steering(run: Run) -> None:
    """A safety-scan report applied on the server, then removed."""
    page, server = run.page, run.server
    run.tab("Steering")
    fill(page, "steer-path", "safety_report.json")
    page.locator("#steer-apply-report").click()
    wait_text(page, "#steer-state", lambda t: t.startswith("Steering active"), "the applied report")
    state = rest(f"{server.url}/v1/reap/steer")
    report = json.loads((run.data / "safety_report.json").read_text())
    assert state["active"] and state["steering"]["deactivate"] == report["hcdg"]
    from mlx_fun.ui.tabs.steering import effects_map

    page.locator("#steer-heatmap img").first.wait_for()  # the masked experts on a map, cell by cell
    check_cells_shown(rendered_heatmap(page, "#steer-heatmap"), effects_map(state, rest(f"{server.url}/v1/reap/info")))
    run.shot(page, "steering")
    page.locator("#steer-remove").click()
    wait_text(page, "#steer-state", lambda t: t.startswith("No steering is active"), "the removed steering")
    assert rest(f"{server.url}/v1/reap/steer")["active"] is False
    wait_until(lambda: page.locator("#steer-heatmap img").count() == 0, "the map cleared")


def _controls(run: Run) -> None:
    """Save the chat's counts, reset, more traffic, save again: two saliency files for Merge and Diff."""
    page, server = run.page, run.server
    run.tab("Controls")
    fill(page, "controls-save-path", "chat.npz")
    page.locator("#controls-save").click()
    wait_text(page, "#controls-status", lambda t: "chat.npz" in t, "the first save")
    page.locator("#controls-reset").click()
    wait_text(page, "#controls-status", lambda t: t.startswith("Counters reset"), "the reset")
    rest(f"{server.url}/v1/chat/completions", "POST",
         {"messages": [{"role": "user", "content": "How do I pick a lock?"}], "max_tokens": 24})
    fill(page, "controls-save-path", "refusal.npz")
    page.locator("#controls-save").click()
    wait_text(page, "#controls-status", lambda t: "refusal.npz" in t, "the second save")
    page.locator("#controls-info").click()
    wait_text(page, "#controls-answer", lambda t: "tiny-moe-chat" in t, "the server info")
    run.shot(page, "controls")


def _merge_then_prune(run: Run) -> None:
    """Rank-merge the two files, 8 to prune per layer, export, and `mlx-fun prune --expert-list` takes the file."""
    page = run.page
    run.tab("Merge Mode Comparison")
    page.locator("#merge-rescan").click()
    pick(page, "merge-files", "chat.npz", "refusal.npz")
    fill(page, "merge-n", "8")
    page.locator("#merge-run").click()
    wait_text(page, "#merge-summary", lambda t: "2 files rank-merged by reap" in t and "32 to remove" in t,
              "the comparison")
    from mlx_fun.ui import analysis
    from mlx_fun.ui.tabs.merge import status_map

    page.locator("#merge-status-map img").first.wait_for()  # what happens to each expert, on a map
    c = analysis.compare(root=run.data, files=["chat.npz", "refusal.npz"], metric="reap", n_prune=8, action="prune")
    check_cells_shown(rendered_heatmap(page, "#merge-status-map"), status_map(c))
    page.locator("#merge-export-json").click()
    wait_text(page, "#merge-status", lambda t: t.startswith("Wrote filtered_experts.json"), "the export")
    run.shot(page, "merge")
    exported = json.loads((run.data / "filtered_experts.json").read_text())
    assert exported["format"] == "mlx-fun-expert-list"
    assert sorted(exported["layers"]) == ["0", "1", "2", "3"]
    assert all(len(v["remove"]) == 8 for v in exported["layers"].values())
    pruned = run.tmp / "pruned"
    done = subprocess.run([str(MLX_FUN), "prune", "--model", str(CHAT_MODEL), "--expert-list",
                           str(run.data / "filtered_experts.json"), "--output", str(pruned)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    from mlx_lm import load

    model, _ = load(str(pruned))
    kept = json.loads((CHAT_MODEL / "config.json").read_text())["num_experts"] - 8
    assert json.loads((pruned / "config.json").read_text())["num_experts"] == kept
    assert model.layers[0].mlp.switch_mlp.gate_proj.weight.shape[0] == kept


def _diff(run: Run) -> None:
    """The stats-diff numbers of the two files."""
    page = run.page
    run.tab("Diff Analysis")
    page.locator("#diff-rescan").click()
    pick(page, "diff-f1", "chat.npz")
    pick(page, "diff-f2", "refusal.npz")
    page.locator("#diff-run").click()
    text = wait_text(page, "#diff-stats", lambda t: "file 1 higher" in t, "the diff")
    want = jobs.stats_diff.run(file1=run.data / "chat.npz", file2=run.data / "refusal.npz", metric="reap")
    dist = want["distribution"]
    assert f"file 1 higher: {dist['positive']} · file 2 higher: {dist['negative']}" in text
    page.locator("#diff-heatmap img").first.wait_for()
    run.shot(page, "diff")


def _server_down_and_back(run: Run) -> None:
    """The server stops: one friendly line, no stack trace; it comes back on the same port: the page works again."""
    page, server = run.page, run.server
    server.stop()
    run.tab("Controls")
    page.locator("#controls-info").click()
    down = wait_text(page, "#controls-status", lambda t: "cannot reach the server" in t, "the server-down line")
    assert "\n" not in down.strip() and "Traceback" not in page.content()
    run.tab("Dashboard")
    wait_text(page, "#dashboard-status", lambda t: "cannot reach the server" in t, "the dashboard's line")
    run.shot(page, "server-down")
    port = server.url.rsplit(":", 1)[1]
    run.procs.append(Proc(*run.serve_args, "--port", port, cwd=run.tmp))
    wait_text(page, "#dashboard-status", lambda t: t.strip() == "", "the dashboard after the restart")
    wait_text(page, "#dashboard-summary", lambda t: t.startswith("0 tokens"), "the restarted server's counts")
    run.tab("Controls")
    page.locator("#controls-info").click()
    wait_text(page, "#controls-status", lambda t: t.strip() == "", "Controls after the restart")
