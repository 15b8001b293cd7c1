"""`mlx-fun ui` without a browser: the HTTP client against a real `serve` on loopback (and a closed port, a server
that is not mlx-fun's), the chat and dashboard handlers on real traffic, the figures' cells, the Merge / Diff
analysis against the CLI's own `stats-merge`, `stats-diff` and `prune --expert-list`, the one-line errors, and the
page served by the real job. The browser test is tests/test_ui_browser.py."""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.errors import UserError
from mlx_fun.observe.saliency import SaliencyAccumulator
from mlx_fun.serve.options import ServerOptions
from mlx_fun.ui import analysis, plots
from mlx_fun.ui.client import ServerClient, ServerError, check_url
from mlx_fun.ui.common import guarded, problem
from mlx_fun.ui.tabs import chat, dashboard, steering
from mlx_fun.ui.tabs import merge as merge_tab

from .cli_helpers import expect_error
from .cli_helpers import run as cli

ROOT = Path(__file__).resolve().parents[1]
KEY = "ui-test-key"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ui-data")


@pytest.fixture(scope="module")
def server(qwen_model, data_dir):
    s = jobs.serve.start(model=qwen_model, mode="full", server=ServerOptions(port=0, data_dir=data_dir, api_key=KEY))
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    c = ServerClient(server.url, api_key=KEY, timeout=60)
    c.reset()
    c.unsteer()
    return c


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_one_line(message: str, *needles: str) -> None:
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, message


# ---------------------------------------------------------------------------------------------- the HTTP client
def test_client_drives_a_real_server_with_its_key(client, server, data_dir):
    info = client.info()
    assert info["model_type"] == "qwen3_moe" and info["api_key_required"] is True
    pieces = list(client.chat([{"role": "user", "content": "def add(a, b):"}], max_tokens=6))
    assert pieces and all(isinstance(p, str) for p in pieces)
    st = client.stats()
    assert st["request_count"] == 1 and st["token_count"] > len(pieces)
    np.testing.assert_array_equal(np.sum(st["freq"], axis=1), st["top_k"] * st["token_count"])

    answer = client.steer({"deactivate": {"0": [1, 2]}})
    assert answer["active"] is True and client.steering()["steering"]["deactivate"] == {"0": [1, 2]}
    assert client.unsteer()["active"] is False and client.steering()["active"] is False

    saved = client.save("traffic.npz")
    acc = SaliencyAccumulator.load(data_dir / "traffic.npz")
    assert saved["token_count"] == acc.total_tokens == st["token_count"]
    assert client.reset()["before"]["token_count"] == st["token_count"] and client.stats()["token_count"] == 0
    assert client.health() == {"status": "ok"}


def test_server_errors_are_one_line(client, server):
    with pytest.raises(ServerError) as e:
        client.save("../outside.npz")
    assert_one_line(str(e.value), "403", "POST /v1/reap/save", "--data-dir")
    with pytest.raises(ServerError) as e:
        client.steer({"deactivate": {"0": [99]}})
    assert_one_line(str(e.value), "400")
    with pytest.raises(ServerError) as e:
        ServerClient(server.url).info()
    assert_one_line(str(e.value), "requires an API key", "--api-key")
    with pytest.raises(ServerError) as e:
        ServerClient(server.url, api_key="wrong").stats()
    assert_one_line(str(e.value), "does not match")


def test_a_closed_port_is_one_friendly_line():
    port = closed_port()
    c = ServerClient(f"http://127.0.0.1:{port}", timeout=5)
    for call in (c.info, c.stats, c.reset, lambda: list(c.chat([{"role": "user", "content": "hi"}]))):
        with pytest.raises(ServerError) as e:
            call()
        assert_one_line(str(e.value), f"cannot reach the server at http://127.0.0.1:{port} (connection refused)",
                        "mlx-fun serve")


class _NotMlxFun(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body, status = (b"<html>hello</html>", 200) if self.path == "/v1/reap/info" else (b"nope", 404)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_server_that_is_not_mlx_fun_is_named_so():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotMlxFun)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        c = ServerClient(f"http://127.0.0.1:{httpd.server_address[1]}/", timeout=5)
        with pytest.raises(ServerError) as e:
            c.info()
        assert_one_line(str(e.value), "is not JSON", "mlx-fun serve")
        with pytest.raises(ServerError) as e:
            c.stats()
        assert_one_line(str(e.value), "answered 404 to GET /v1/reap/stats")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_server_urls_are_checked():
    assert check_url(" http://127.0.0.1:8080/ ") == "http://127.0.0.1:8080"
    for bad in ("127.0.0.1:8080", "ftp://host", "http://", "http://host:99999"):
        with pytest.raises(UserError, match="server_url="):
            check_url(bad)


# ---------------------------------------------------------------------------------------------- tab handlers
def test_chat_streams_into_the_conversation(client):
    steps = list(chat.stream_reply(client, "def add(a, b):", [], "You write Python.", 0.0, 5))
    first, last = steps[0], steps[-1]
    assert first[0] == [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": ""}]
    assert first[1] == "" and last[2] == "" and last[0][1]["content"]
    replies = [s[0][-1]["content"] for s in steps[1:-1]]
    assert all(b.startswith(a) for a, b in zip(replies, replies[1:]))  # the reply only grows
    assert client.stats()["request_count"] == 1
    # the next turn sends the whole conversation, gradio's content parts included
    history = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "yo"}]
    assert chat.messages_for(history, "", "again") == [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "yo"},
                                                      {"role": "user", "content": "again"}]


def test_chat_with_the_server_down_gives_the_message_back():
    down = ServerClient(f"http://127.0.0.1:{closed_port()}", timeout=5)
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    *_, (conversation, box, status) = chat.stream_reply(down, "hello", history)
    assert conversation == history and box == "hello"
    assert_one_line(status, "cannot reach the server")


def test_dashboard_shows_the_servers_counts(client):
    list(client.chat([{"role": "user", "content": "import os"}], max_tokens=4))
    st = client.stats()
    text, hfig, bfig, layers, shown = dashboard.draw(st, "freq", None)
    freq = np.asarray(st["freq"])
    assert layers == st["moe_layer_indices"] and shown == layers[0]
    assert f"**{st['token_count']:,} tokens**" in text
    assert f"{int((freq == 0).sum())} of {freq.size} (layer, expert) pairs received no traffic" in text
    np.testing.assert_array_equal(hfig.axes[0].images[0].get_array(), freq)
    assert [p.get_height() for p in bfig.axes[0].patches] == freq[0].tolist()
    assert dashboard.traffic(client.info()) == (st["token_count"], st["request_count"])
    _, heat, *_ = dashboard.draw(st, "reap", layers[-1])
    np.testing.assert_allclose(heat.axes[0].images[0].get_array(), st["computed_scores"]["reap"])


def test_steering_bodies_and_state(client, data_dir):
    assert steering.report_body("safety", " s.json ", "unsafe", "rank") == {"safety_map": "s.json", "mode": "unsafe",
                                                                             "scheme": "rank"}
    for args, needle in ((("safety", "s.json", "boost", "additive"), "unsafe or safe"),
                         (("domain", "", "boost", "additive"), "domain report's path"),
                         (("other", "x", "safe", "additive"), "safety or domain")):
        with pytest.raises(UserError, match=needle):
            steering.report_body(*args)
    with pytest.raises(UserError, match="not valid JSON"):
        steering.custom_body("{deactivate")
    with pytest.raises(UserError, match="JSON object"):
        steering.custom_body("[1]")
    assert steering.describe(client.steering()).startswith("**No steering is active**")
    (data_dir / "safety_report.json").write_text(json.dumps({"hcdg": {"0": [1, 2], "1": [3]}}))
    state = client.steer(steering.report_body("safety", "safety_report.json", "unsafe", "additive"))
    text = steering.describe(state)
    assert "3 experts masked in 2 layers" in text and "safety report" in text and "(unsafe)" in text
    # the map of the affected experts (issue 44: the tab showed the server's JSON alone)
    info = client.info()
    codes, layers = steering.effects(state, info)
    assert layers == info["moe_layer_indices"] and codes.shape == (len(layers), info["num_experts"])
    assert {(int(r), int(c)) for r, c in zip(*np.nonzero(codes == 1))} == {(0, 1), (0, 2), (1, 3)}
    assert (codes == 2).sum() == 0
    state = client.steer({"deactivate": {"0": [1]}, "activate": {"1": [5, 6]}})
    codes, _ = steering.effects(state, info)
    assert codes[0, 1] == 1 and list(codes[1, 5:7]) == [2, 2] and (codes > 0).sum() == 3
    fig = steering.effects_map(state, info)
    image = fig.axes[0].images[0]
    assert (image.get_array() == codes).all()
    assert fig.axes[0].get_title() == "Steering: 1 masked and 2 boosted experts, per layer"
    assert [t.get_text() for t in fig.axes[1].get_yticklabels()] == [name for name, _ in steering.EFFECTS]
    assert steering.effects_map(client.unsteer(), info) is None


def test_guarded_handlers_keep_the_page_and_show_one_line():
    import gradio as gr

    @guarded(3, 2)
    def broken():
        raise ServerError("cannot reach the server at http://x (connection refused); start it.")

    out = broken()
    assert out[2] == "⚠️ cannot reach the server at http://x (connection refused); start it."
    assert all(isinstance(o, dict) and o == gr.update() for o in out[:2])
    assert problem(KeyError("k\nline two")).count("\n") == 0


# ---------------------------------------------------------------------------------------------- figures
def test_heatmap_cells_axes_and_labels():
    scores = np.zeros((3, 5))
    scores[1, 3] = 7.0
    scores[2, 0] = 3.5
    fig = plots.heatmap(scores, metric="freq", layer_names=[1, 3, 5])
    ax, cbar = fig.axes
    image = ax.images[0]
    assert image.get_array().shape == (3, 5) and image.get_array()[1, 3] == 7.0
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("Expert", "Layer", "Frequency per layer and expert")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "3", "5"]
    assert cbar.get_ylabel() == "Frequency" and image.get_clim() == (0.0, 7.0)
    # the PNG the page shows: cell (1, 3) has the top colour of the scale, an unused cell the bottom one
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    png = np.asarray(Image.open(buf).convert("RGB")).astype(int)
    for (r, c), value in (((1, 3), 7.0), ((0, 0), 0.0), ((2, 0), 3.5)):
        x, y = plots.cell_pixel(fig, r, c)
        want = np.array(image.cmap(image.norm(value))[:3]) * 255
        assert np.abs(png[y, x] - want).max() <= 2, (r, c, png[y, x], want)


def test_layer_bars_and_diff_heatmap():
    bars = plots.layer_bars([0, 2, 5, 1], metric="reap", layer=7)
    ax = bars.axes[0]
    assert [p.get_height() for p in ax.patches] == [0, 2, 5, 1]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("Expert", "REAP", "Layer 7: REAP per expert")
    d = np.array([[1.0, -4.0], [0.0, 2.0]])
    fig = plots.diff_heatmap(d, metric="freq", layer_names=[0, 2], labels=("code", "prose"), percentile=100)
    ax, cbar = fig.axes
    image = ax.images[0]
    assert image.get_clim() == (-4.0, 4.0) and image.get_array()[0, 1] == -4.0
    assert ax.get_title() == "Frequency difference (red: code higher, blue: prose higher)"  # nothing clipped
    assert cbar.get_ylabel() == "Frequency: code − prose"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "2"]
    red, blue, white = (image.cmap(image.norm(v))[:3] for v in (1.0, -4.0, 0.0))
    assert red[0] > red[2] and blue[2] > blue[0] and min(white) > 0.95
    with pytest.raises(ValueError, match="non-empty"):
        plots.heatmap(np.zeros((0, 3)), metric="freq")


def test_one_outlier_does_not_wash_out_the_diff_heatmap():
    """Issue 44: the colour scale ran to the largest |difference|, so one outlier left every other cell white; it
    now ends at the 99th percentile, and the title says how many cells lie beyond."""
    d = np.tile([[-1.0, 0.5, 1.0, -0.5]], (4, 25))  # 400 cells of ±0.5 and ±1
    d[2, 7] = 500.0
    fig = plots.diff_heatmap(d, metric="reap")
    image = fig.axes[0].images[0]
    assert image.get_clim() == (-1.0, 1.0)
    assert fig.axes[0].get_title().endswith(
        "\ncolours clipped at ±1, the 99th percentile of |difference|: 1 cell beyond it show the end colours")
    full_red = image.cmap(image.norm(500.0))
    assert image.cmap(image.norm(1.0)) == full_red and min(image.cmap(image.norm(0.5))[:3]) < 0.8  # not washed out
    assert plots.clip_limit(np.zeros((2, 2))) == (1.0, 0) and plots.clip_limit([[0, 0, 0, 3]] * 50) == (3.0, 0)


def test_status_heatmap_colours_each_category():
    codes = np.array([[0, 1, 2], [2, 0, 0]])
    cats = [("keep", "#dddddd"), ("remove", "#d1495b"), ("boost", "#2a9d8f")]
    fig = plots.status_heatmap(codes, categories=cats, layer_names=[3, 7], title="t")
    ax, bar = fig.axes
    assert [t.get_text() for t in bar.get_yticklabels()] == ["keep", "remove", "boost"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["3", "7"] and ax.get_title() == "t"
    import io

    from matplotlib.colors import to_rgb
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    png = np.asarray(Image.open(buf).convert("RGB")).astype(int)
    for (r, c), code in np.ndenumerate(codes):
        x, y = plots.cell_pixel(fig, r, c)
        assert np.abs(png[y, x] - np.array(to_rgb(cats[code][1])) * 255).max() <= 2, (r, c)
    with pytest.raises(ValueError, match="0..2"):
        plots.status_heatmap(codes + 1, categories=cats, title="t")


# ---------------------------------------------------------------------------------------------- Merge / Diff tabs
@pytest.fixture(scope="module")
def saliency_files(qwen_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-files")
    data = ROOT / "data" / "calibration_sample.jsonl"
    jobs.collect.run(model=qwen_model, dataset=data, output=root / "a.npz", max_samples=3, seed=0)
    jobs.collect.run(model=qwen_model, dataset=data, output=root / "b.npz", max_samples=6, seed=1)
    return root


def test_compare_is_stats_merge_and_its_export_is_what_prune_reads(saliency_files, qwen_model, tmp_path):
    from mlx_fun.experts.expert_files import load_expert_list

    root = saliency_files
    c = analysis.compare(root=root, files=["a.npz", "b.npz"], metric="freq", n_prune=3, action="prune")
    merged = jobs.stats_merge.run(files=[root / "a.npz", root / "b.npz"], output=tmp_path / "m.npz", metric="freq")
    np.testing.assert_array_equal(c.rank_sum, merged.merged.extra["rank_sum_freq"])
    assert all(len(v) == 3 for v in c.removed.values()) and "2 files rank-merged by freq" in c.summary()
    assert len(c.rows()) == 2 * 8 and c.rows()[0][:2] == [0, 0]
    for name in ("filtered_experts.json", "filtered_experts.csv"):
        path = analysis.export(c, root=root, name=name)
        assert load_expert_list(path, 2, 8, [0, 1]) == c.kept
    out = jobs.prune.run(model=qwen_model, expert_list=root / "filtered_experts.json", output=tmp_path / "pruned")
    assert json.loads((Path(out.output) / "config.json").read_text())["num_experts"] == 5
    # the same choice as `prune --saliency <stats-merge output> --n-prune 3 --metric freq`
    from mlx_fun.experts.selection import select_experts

    assert c.kept == select_experts(merged.merged.scores("freq"), 3, top_k=2)


def test_compare_filters_and_refusals(saliency_files):
    root = saliency_files
    c = analysis.compare(root=root, files=["a.npz", "b.npz"], metric="freq", n_prune=2, model_wide=True,
                         protect_max_rank_sum=4, target_min_rank_sum=14, action="merge")
    removed = c.removed
    assert removed[0] == removed[1] and len(removed[0]) == 2
    assert not any(c.protected[p, e] for p in removed for e in removed[p])
    assert all(r[-1].startswith(("keep", "remove")) for r in c.rows())
    # the map of what happens to each expert: the table's status column, cell by cell
    codes = c.statuses()
    assert [analysis.STATUSES[codes[p, e]] for p in range(2) for e in range(8)] == [r[-1] for r in c.rows()]
    assert {analysis.STATUSES[i] for i in np.unique(codes)} >= {"keep", "keep (protected)", "remove"}
    fig = merge_tab.status_map(c)
    assert (fig.axes[0].images[0].get_array() == codes).all()
    assert fig.axes[0].get_title() == "Experts merged away (red): 4 in all"
    assert [t.get_text() for t in fig.axes[1].get_yticklabels()] == list(analysis.STATUSES)
    assert json.loads(analysis.export(c, root=root, name="m.json").read_text())["mode"] == "merge"
    for kwargs, needle in ((dict(files=["a.npz"]), "2 to 4"), (dict(files=["a.npz", "a.npz"]), "same statistics"),
                           (dict(files=["a.npz", "../b.npz"]), "outside the UI's data directory"),
                           (dict(files=["a.npz", "nope.npz"]), "does not exist"),
                           (dict(files=["a.npz", "b.npz"], n_prune=7), "top_k")):
        with pytest.raises(UserError, match=needle):
            analysis.compare(root=root, **{"metric": "freq", **kwargs})
    nothing = analysis.compare(root=root, files=["a.npz", "b.npz"], metric="freq")
    with pytest.raises(UserError, match="removes no expert"):
        analysis.export(nothing, root=root, name="x.json")
    with pytest.raises(UserError, match=r"\.json or \.csv"):
        analysis.export(c, root=root, name="x.txt")


def test_diff_is_the_stats_diff_report(saliency_files, monkeypatch):
    root = saliency_files
    report = analysis.diff(root=root, file1="a.npz", file2="b.npz", metric="freq", output="d.json")
    monkeypatch.chdir(root)
    result = cli("stats-diff", "--file1", "a.npz", "--file2", "b.npz", "--metric", "freq", "--output", "cli.json")
    assert result.exit_code == 0, result.output
    ours, theirs = json.loads((root / "d.json").read_text()), json.loads((root / "cli.json").read_text())
    for key in ("stats", "distribution", "top_positive", "top_negative", "diff", "moe_layer_indices"):
        assert ours[key] == theirs[key] == json.loads(json.dumps(report[key])), key
    from mlx_fun.ui.tabs.diff import stats_text

    d = report["distribution"]
    line = f"file 1 higher: {d['positive']} · file 2 higher: {d['negative']} · equal: {d['zero']}"
    assert line in stats_text(report)


def test_an_export_never_replaces_a_file_of_the_data_dir(saliency_files):
    """Issue 41 row 1 in the dashboard: an export whose name exists is refused in one line (there is no --force
    to click), the file untouched."""
    root = saliency_files
    c = analysis.compare(root=root, files=["a.npz", "b.npz"], metric="freq", n_prune=3, action="prune")
    for name, write in (("keep.json", lambda: analysis.export(c, root=root, name="keep.json")),
                        ("keep.csv", lambda: analysis.export(c, root=root, name="keep.csv")),
                        ("kept-diff.json", lambda: analysis.diff(root=root, file1="a.npz", file2="b.npz",
                                                                 output="kept-diff.json"))):
        (root / name).write_text("mine\n")
        with pytest.raises(UserError, match=r"^export file \S+ already exists; choose another name so it is not "
                                            r"replaced\.$") as err:
            write()
        assert str(err.value).split()[2].endswith(name)
        assert (root / name).read_text() == "mine\n"


# ---------------------------------------------------------------------------------------------- command and page
def test_without_gradio_the_command_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gradio", None)  # `import gradio` now fails as if it were not installed
    expect_error(cli("ui", "--data-dir", tmp_path), "pip install 'mlx-fun[ui]'")


def test_bad_arguments_are_one_line(tmp_path):
    expect_error(cli("ui", "--server-url", "localhost:8080", "--data-dir", tmp_path), "--server-url", "http(s) URL")
    expect_error(cli("ui", "--data-dir", tmp_path / "missing"), "--data-dir", "not a directory")


def test_exposure_warnings():
    assert jobs.ui.exposure_warnings("127.0.0.1", False) == []
    (share,) = jobs.ui.exposure_warnings("127.0.0.1", True)
    assert share.startswith("Warning: --share") and "exposes the server" in share
    assert "0.0.0.0" in jobs.ui.exposure_warnings("0.0.0.0", False)[0]


def test_the_job_serves_the_page_while_the_server_is_down(tmp_path):
    lines = []
    page = jobs.ui.start(server_url=f"http://127.0.0.1:{closed_port()}", port=0, data_dir=tmp_path, log=lines.append)
    try:
        with urllib.request.urlopen(page.local_url, timeout=30) as resp:
            html = resp.read().decode()
        assert resp.status == 200 and "mlx-fun dashboard" in html
        assert page.local_url.startswith("http://127.0.0.1:")
    finally:
        page.close()
    (line,) = lines
    assert line.startswith("Warning: cannot reach the server") and "connects once the server answers" in line
