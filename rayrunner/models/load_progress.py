"""Load progress: the phase a model's replica is in while it loads, pushed to the cluster for the registry's card.

A replica cannot answer calls while its constructor loads the model, so the load path pushes instead: each phase
(resolving, downloading with bytes done/total, converting, reading, quantizing, warming up, ready) is logged in the
replica's log and written to Ray's internal KV under the model's app name, where the registry reads it into the card
of a model that is `reloading`. The key is deleted when the load ends: by the replica at `ready`, by the registry when
the load fails. Writes within one phase are throttled (a download reports many times a second). Only the model's own
replica publishes (`for_model`): an engine built in another process (a test, a benchmark) just logs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, ClassVar

from tqdm.auto import tqdm

from rayrunner.runtime import ray_private

# Under Serve's logger, as Serve asks of replica code: its lines then land in the replica's log file (a plain module
# logger's INFO lines go nowhere in a replica), and a Runner's `log_level` (set on "ray.serve") governs them elsewhere.
logger = logging.getLogger("ray.serve").getChild(__name__)

PHASES = ("resolving", "downloading", "converting", "reading", "quantizing", "warming up", "ready")
KV_NAMESPACE = "rayrunner"
WRITE_INTERVAL_S = 0.5  # at most two KV writes a second within one phase
LOG_INTERVAL_S = 5.0  # and one log line every few seconds


def _key(app: str) -> str:
    return f"load_progress:{app}"


def read(app: str) -> dict[str, Any] | None:
    """The load progress published for the model app `app`, or None when nothing is loading there."""
    value = ray_private.kv_get(_key(app), KV_NAMESPACE)
    return json.loads(value) if value else None


def _put(app: str, value: dict[str, Any]) -> None:
    ray_private.kv_put(_key(app), json.dumps(value), KV_NAMESPACE)


def clear(app: str) -> None:
    ray_private.kv_delete(_key(app), KV_NAMESPACE)


def for_model(app: str, model_id: str) -> LoadProgress:
    """The reporter for a load of the model app `app`: it publishes when it runs in that app's replica."""
    from ray import serve

    try:
        in_replica = serve.get_replica_context().app_name == app
    except Exception:  # not a Serve replica
        in_replica = False
    return LoadProgress(app, model_id, publish=in_replica)


class LoadProgress:
    """Reports one model's load: `phase(name, **detail)` logs and (with `publish`) publishes
    `{"phase", "detail", "since"}` for `read`."""

    def __init__(self, app: str, model_id: str, publish: bool = True) -> None:
        self.app = app
        self.model_id = model_id
        self.publish = publish
        self.current: str | None = None
        self._since = 0.0
        self._written_at = 0.0
        self._logged_at = 0.0
        self._lock = threading.Lock()  # downloads report from several threads

    def phase(self, name: str, **detail: Any) -> None:
        """Enter phase `name` (or update its detail). A new phase is always published; updates within a phase
        at most every WRITE_INTERVAL_S, and logged at most every LOG_INTERVAL_S."""
        if name not in PHASES:
            raise ValueError(f"unknown load phase `{name}` (one of {', '.join(PHASES)})")
        now = time.time()
        with self._lock:
            changed = name != self.current
            if changed:
                self.current, self._since = name, now
            elif now - self._written_at < WRITE_INTERVAL_S:
                return
            self._written_at = now
            if changed or now - self._logged_at >= LOG_INTERVAL_S:
                self._logged_at = now
                logger.info("loading `%s`: %s", self.model_id, describe(name, detail))
            if self.publish:
                self._safely(_put, self.app, {"phase": name, "detail": detail, "since": self._since})

    def ready(self) -> None:
        """The load is done: logged, and the published progress is deleted."""
        with self._lock:
            self.current = "ready"
            logger.info("loading `%s`: ready", self.model_id)
            if self.publish:
                self._safely(clear, self.app)

    def tqdm_class(self) -> type[tqdm]:
        """A tqdm class for huggingface_hub's downloads that reports their bytes as the `downloading` phase."""
        return type("DownloadBytes", (DownloadBytes,), {"progress": self, "byte_bars": []})

    def _safely(self, fn: Any, *args: Any) -> None:
        # Progress is informative: a cluster store that cannot be written never fails the load itself.
        try:
            fn(*args)
        except Exception:
            logger.warning("could not publish the load progress of `%s`", self.model_id, exc_info=True)


def describe(phase: str, detail: dict[str, Any]) -> str:
    """One line for a phase: "downloading 120/480 MB", "quantizing (in_situ_quant=Q8_0)", "warming up"."""
    if "bytes_done" in detail:
        total = detail.get("bytes_total")
        done_mb = detail["bytes_done"] / 1e6
        return f"{phase} {done_mb:.0f}/{total / 1e6:.0f} MB" if total else f"{phase} {done_mb:.0f} MB"
    if not detail:
        return phase
    return f"{phase} ({', '.join(f'{key}={value}' for key, value in detail.items())})"


class DownloadBytes(tqdm):
    """huggingface_hub's progress bars, silenced, with the bytes of every byte-counting bar of one download
    reported to `progress`. huggingface_hub may keep two byte bars of the same files (bytes received, bytes
    written), so the furthest one counts, never their sum; a bar's total grows as each file starts downloading.
    Subclasses bind `progress` and their own list of bars (`LoadProgress.tqdm_class`)."""

    progress: ClassVar[LoadProgress]
    byte_bars: ClassVar[list[DownloadBytes]]
    monitor_interval = 0  # no tqdm monitor thread

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # huggingface_hub's own tqdm takes a name; plain tqdm refuses it
        kwargs.update(disable=False, file=_Discard(), mininterval=3600)
        super().__init__(*args, **kwargs)
        if self.unit == "B":
            self.byte_bars.append(self)

    def update(self, n: float | None = 1) -> bool | None:
        shown = super().update(n)
        if self.unit == "B" and n:
            done = max(bar.n for bar in self.byte_bars)
            total = max(bar.total or 0 for bar in self.byte_bars)
            self.progress.phase("downloading", bytes_done=int(done), bytes_total=int(total))
        return shown


class _Discard:
    """A text stream that drops what tqdm draws."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
