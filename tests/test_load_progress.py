"""The load-progress reporter: phases published to (and read from) a real cluster's KV, throttling within a phase,
and the download bytes that huggingface_hub's progress bars report through `LoadProgress.tqdm_class`."""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rayrunner.models import load_progress, sources
from rayrunner.models.load_progress import PHASES, LoadProgress


@pytest.fixture
def progress(cluster: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[LoadProgress]:
    reporter = LoadProgress(f"unit-{request.node.name}", "m")
    yield reporter
    load_progress.clear(reporter.app)


def test_each_phase_is_published_in_order_and_ready_clears_it(progress: LoadProgress) -> None:
    assert load_progress.read(progress.app) is None
    seen = []
    for phase in PHASES[:-1]:
        progress.phase(phase, step=phase)
        published = load_progress.read(progress.app)
        assert published is not None
        seen.append(published["phase"])
        assert published["detail"] == {"step": phase} and published["since"] <= time.time()
    assert seen == list(PHASES[:-1])
    progress.ready()
    assert load_progress.read(progress.app) is None


def test_updates_within_a_phase_are_throttled_but_a_new_phase_is_not(progress: LoadProgress) -> None:
    progress.phase("downloading", bytes_done=1, bytes_total=10)
    started = load_progress.read(progress.app)
    progress.phase("downloading", bytes_done=2, bytes_total=10)  # within WRITE_INTERVAL_S: not written
    assert load_progress.read(progress.app) == started
    time.sleep(load_progress.WRITE_INTERVAL_S)
    progress.phase("downloading", bytes_done=3, bytes_total=10)
    later = load_progress.read(progress.app)
    assert later is not None and started is not None
    assert later["detail"]["bytes_done"] == 3 and later["since"] == started["since"]  # same phase, same start
    progress.phase("reading")  # at once, whatever the interval
    assert (load_progress.read(progress.app) or {}).get("phase") == "reading"


def test_an_unknown_phase_is_refused(progress: LoadProgress) -> None:
    with pytest.raises(ValueError, match="unknown load phase `loading`"):
        progress.phase("loading")


def test_only_the_models_own_replica_publishes(cluster: dict[str, Any]) -> None:
    reporter = load_progress.for_model("unit-driver", "m")  # this test process is no Serve replica
    reporter.phase("resolving")
    assert not reporter.publish and load_progress.read("unit-driver") is None


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_phases_are_logged_as_one_line_each() -> None:
    """On the logger Serve writes a replica's log file from (it does not propagate to the root logger)."""
    reporter = LoadProgress("unit-log", "m", publish=False)
    lines = Lines()
    load_progress.logger.addHandler(lines)
    load_progress.logger.setLevel(logging.INFO)  # as Serve sets its logger in a replica
    try:
        reporter.phase("downloading", bytes_done=120_000_000, bytes_total=480_000_000)
        reporter.phase("downloading", bytes_done=130_000_000, bytes_total=480_000_000)  # throttled: no line
        reporter.phase("quantizing", in_situ_quant="Q8_0")
        reporter.ready()
    finally:
        load_progress.logger.removeHandler(lines)
        load_progress.logger.setLevel(logging.NOTSET)
    assert load_progress.logger.name.startswith("ray.serve.")
    assert lines.lines == ["loading `m`: downloading 120/480 MB", "loading `m`: quantizing (in_situ_quant=Q8_0)",
                           "loading `m`: ready"]


class Recorder(LoadProgress):
    """A reporter that keeps every downloading update it would publish (unthrottled)."""

    def __init__(self) -> None:
        super().__init__("unit-tqdm", "m", publish=False)
        self.updates: list[dict[str, Any]] = []

    def phase(self, name: str, **detail: Any) -> None:
        self.updates.append({"phase": name, **detail})


def test_download_bytes_count_the_furthest_byte_bar_and_ignore_file_counts() -> None:
    """The bars huggingface_hub's snapshot_download makes: bytes received and bytes written (same files, grown
    per file) and a count of files; each file adds its size to both byte bars' totals."""
    recorder = Recorder()
    bar_class = recorder.tqdm_class()
    received = bar_class(total=0, unit="B", desc="Downloading bytes")
    written = bar_class(total=0, unit="B", desc="Reconstructing")
    files = bar_class(total=2, desc="Fetching 2 files")
    for bar in (received, written):
        bar.total += 300
    written.update(100)
    received.update(60)
    for bar in (received, written):
        bar.total += 200
    written.update(400)
    files.update(1)
    assert recorder.updates == [
        {"phase": "downloading", "bytes_done": 100, "bytes_total": 300},
        {"phase": "downloading", "bytes_done": 100, "bytes_total": 300},
        {"phase": "downloading", "bytes_done": 500, "bytes_total": 500},
    ]
    assert recorder.tqdm_class().byte_bars == []  # every download starts from zero


SHA = "a" * 40
HUB_FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": bytes(25_000_000),
             "tokenizer.json": bytes(3_000_000), "model.gguf": bytes(2_000_000)}


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The few Hugging Face hub endpoints snapshot_download calls for the repo `org/repo` (model info, file tree,
    and each file), so its real download path runs here without a network."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        path = self.path.split("?")[0]
        file = re.fullmatch(r"/org/repo/resolve/\w+/(.+)", path)
        if re.fullmatch(r"/api/models/org/repo(/revision/\w+)?", path):
            body = json.dumps({"id": "org/repo", "sha": SHA, "siblings": [{"rfilename": f} for f in HUB_FILES]})
            self._send(200, body.encode(), {"Content-Type": "application/json"}, send_body)
        elif re.fullmatch(r"/api/models/org/repo/tree/\w+", path):
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in HUB_FILES.items()]
            self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, send_body)
        elif file and file.group(1) in HUB_FILES:
            data = HUB_FILES[file.group(1)]
            etag = f'"{hashlib.sha1(data).hexdigest()}"'
            self._send(200, data, {"X-Repo-Commit": SHA, "ETag": etag}, send_body)
        else:
            self._send(404, b"{}", {}, send_body)

    def _send(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from huggingface_hub import constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the hub is local
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    yield url
    server.shutdown()


def test_a_hub_download_reports_its_bytes(fake_hub: str, tmp_path: Path) -> None:
    """`resolve` of a hub id runs huggingface_hub's snapshot_download with the reporter's bar class: its bytes go
    up to the size of every file (a total grows as each file starts)."""
    recorder = Recorder()
    source = sources.resolve("org/repo", hf_cache_path=str(tmp_path), progress=recorder)
    fetched = sorted(p.name for p in Path(source.path).iterdir())
    assert fetched == ["config.json", "model.safetensors", "tokenizer.json"]  # no .gguf: not in _HUB_PATTERNS
    size = sum(len(HUB_FILES[name]) for name in fetched)
    assert recorder.updates[-1] == {"phase": "downloading", "bytes_done": size, "bytes_total": size}
    done = [update["bytes_done"] for update in recorder.updates]
    assert done == sorted(done) and all(u["bytes_done"] <= u["bytes_total"] for u in recorder.updates)


def test_a_hub_gguf_download_reports_its_bytes(fake_hub: str, tmp_path: Path) -> None:
    recorder = Recorder()
    source = sources.resolve("org/repo", "model.gguf", hf_cache_path=str(tmp_path), progress=recorder)
    assert source.gguf_file == "model.gguf"
    size = len(HUB_FILES["model.gguf"])
    assert recorder.updates[-1] == {"phase": "downloading", "bytes_done": size, "bytes_total": size}


def test_converting_the_builtin_gguf_is_reported_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion itself (~17 s of transformers work) is replaced: only when the phase is reported matters."""
    recorder = Recorder()
    phases_during: list[str] = []

    def convert(folder: Path, filename: str, target: Path) -> None:
        phases_during.extend(update["phase"] for update in recorder.updates)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setenv("RAYRUNNER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sources, "_convert_gguf", convert)
    sources.resolve(sources.SMOLLM2, progress=recorder)
    assert phases_during == ["converting"]
    sources.resolve(sources.SMOLLM2, progress=recorder)  # converted once: nothing more to report
    assert [update["phase"] for update in recorder.updates] == ["converting"]
