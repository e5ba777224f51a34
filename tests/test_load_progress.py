"""The load-progress reporter: phases published to (and read from) a real cluster's KV, throttling within a phase,
and the download bytes that huggingface_hub's progress bars report through `LoadProgress.tqdm_class`."""

from __future__ import annotations

import functools
import http.server
import io
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rayrunner import load_progress
from rayrunner.load_progress import PHASES, LoadProgress


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


@pytest.fixture
def file_server(tmp_path: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_huggingface_hubs_own_download_reports_its_bytes(
    file_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub's file download (what hf_hub_download and snapshot_download run for each file), from a
    local HTTP server, with the bar class it is given."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import http_get

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the server is local
    size = 3_000_000
    (tmp_path / "weights.bin").write_bytes(bytes(size))
    recorder = Recorder()
    http_get(f"{file_server}/weights.bin", io.BytesIO(), expected_size=size, tqdm_class=recorder.tqdm_class())
    assert recorder.updates and recorder.updates[-1] == {"phase": "downloading", "bytes_done": size,
                                                        "bytes_total": size}
