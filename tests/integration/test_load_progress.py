"""Load progress on a real cluster: while a model loads, its card shows the phase its replica is in and the replica
logs each phase; a loaded model's card, and a failed load's, show none and leave nothing published."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rayrunner.models import load_progress
from rayrunner.models.load_progress import PHASES
from tests.conftest import Service, model_entry
from tests.tiny_models import build_tiny_llama

QUANTIZED = "tiny-q8"
WRONG_ARCH = "tiny-wrong-arch"


@pytest.fixture(scope="module")
def service(
    cluster: dict[str, Any], tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    # Weights of their own: the quantized model cache is keyed by content and outlives a test session, so a model
    # quantized before (by another test, or an earlier run on this machine) would never show `quantizing` here.
    unique = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-unique"), seed=time.time_ns() % 2**31)
    quantized = model_entry(QUANTIZED, unique, load=False)
    quantized["spec"]["in_situ_quant"] = "Q8_0"
    wrong_arch = model_entry(WRONG_ARCH, tiny_llama_dir, load=False)
    wrong_arch["spec"]["which"]["arch"] = "Qwen2"  # the folder holds a Llama: fails after `resolving`
    config = {"models": [quantized, wrong_arch], "state_path": str(cluster["state_dir"] / "load_progress.json")}
    svc = Service(cluster, config)
    yield svc
    svc.close()


def replica_log_phases(app: str) -> list[str]:
    """What the app's replicas logged as their load progress, from the log files Serve wrote in this session."""
    import ray

    node = ray._private.worker._global_node  # this test process's cluster (several may run on one machine)
    assert node is not None
    logs = Path(node.get_logs_dir_path()) / "serve"
    marker = f"loading `{app}`: "
    lines = [line for path in sorted(logs.glob(f"replica_{app}_*.log")) for line in path.read_text().splitlines()]
    return [line.split(marker, 1)[1] for line in lines if marker in line]


def reload_watching_the_card(service: Service, model: str) -> tuple[Any, list[dict[str, Any]]]:
    """Reload `model` while polling its card; the reload's answer and each new progress the card showed."""
    answer: list[Any] = []
    load = threading.Thread(target=lambda: answer.append(
        service.http.post("/v1/models/reload", json={"model_id": model})))
    load.start()
    seen: list[dict[str, Any]] = []
    while load.is_alive():
        card = service.card(model)
        progress = card.get("load_progress")
        if card["status"] == "reloading" and progress and (not seen or progress != seen[-1]):
            seen.append(progress)
        time.sleep(0.02)
    load.join()
    return answer[0], seen


def test_a_loading_model_shows_its_phase_and_a_loaded_one_none(service: Service) -> None:
    started = time.time()
    answer, seen = reload_watching_the_card(service, QUANTIZED)
    assert answer.status_code == 200, answer.text
    phases = [progress["phase"] for progress in seen]
    # Reading the weights takes a good part of a second even for a tiny model, far longer than one poll.
    assert {"resolving", "reading", "quantizing"} & set(phases), seen
    assert phases == sorted(phases, key=PHASES.index)  # never back to an earlier phase
    for progress in seen:
        assert started <= progress["since"] <= time.time()
        if progress["phase"] == "quantizing":
            assert progress["detail"] == {"in_situ_quant": "Q8_0"}
    card = service.card(QUANTIZED)
    assert card["status"] == "loaded" and card["load_progress"] is None
    assert load_progress.read(QUANTIZED) is None  # the replica cleared it at `ready`
    assert replica_log_phases(QUANTIZED) == [
        "resolving", "reading (device=cpu)", "quantizing (in_situ_quant=Q8_0)", "warming up", "ready"]


def test_a_reload_reads_the_model_quantized_by_the_first_load(service: Service) -> None:
    if service.card(QUANTIZED)["status"] != "loaded":  # loaded once (by the test before, when it ran)
        first = service.http.post("/v1/models/reload", json={"model_id": QUANTIZED})
        assert first.status_code == 200, first.text
    assert service.http.post("/v1/models/unload", json={"model_id": QUANTIZED}).status_code == 200
    answer, seen = reload_watching_the_card(service, QUANTIZED)
    assert answer.status_code == 200, answer.text
    assert "quantizing" not in [progress["phase"] for progress in seen]
    phases = replica_log_phases(QUANTIZED)
    assert "reading (device=cpu, quantized_cache=Q8_0)" in phases
    assert phases.count("quantizing (in_situ_quant=Q8_0)") == 1  # only the first load of this folder quantized
    assert service.chat("hello", model=QUANTIZED).status_code == 200


def test_a_failed_load_leaves_no_progress_behind(service: Service) -> None:
    answer = service.http.post("/v1/models/reload", json={"model_id": WRONG_ARCH})
    assert answer.status_code == 500 and "expects model_type `qwen2`" in answer.json()["error"]["message"]
    assert "resolving" in replica_log_phases(WRONG_ARCH)  # its replica published a phase before failing
    card = service.card(WRONG_ARCH)
    assert card["status"] == "unloaded" and card["load_progress"] is None
    assert load_progress.read(WRONG_ARCH) is None  # cleared by the registry
