"""A model's replica settings without a cluster: Serve's names, zero refused with the reason, what Serve is given,
and capacity counting every replica."""

from __future__ import annotations

from typing import Any

import pytest
from ray._common.utils import import_attr

from rayrunner.errors import InvalidSpecError
from rayrunner.models.footprint import estimate_bytes
from rayrunner.models.replicas import ROUTER_CLASS
from rayrunner.models.spec import build_spec
from rayrunner.router.replica_choice import LoadAwareRouter

SMOL = {"type": "plain", "model_id": "smollm2-135m-instruct"}


@pytest.mark.parametrize(("engine", "param", "words"), [
    ({"num_replicas": 0}, "num_replicas", "scales to zero only by unloading"),
    ({"autoscaling_config": {"min_replicas": 0, "max_replicas": 2}}, "autoscaling_config", "only by unloading"),
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling_config", "below min_replicas"),
    ({"autoscaling_config": {"max_replicas": 2, "initial_replicas": 3}}, "autoscaling_config", "outside"),
    ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}}, "autoscaling_config", "not both"),
    ({"autoscaling_config": {"max_replicas": 2, "target_ongoing_request": 1}}, "autoscaling_config", "Extra"),
    ({"routing": "random"}, "routing", "least_loaded"),
])
def test_bad_replica_settings_are_400s_naming_the_field(engine: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        build_spec("m", SMOL, engine=engine)
    assert caught.value.param == param and words in str(caught.value)


def test_serve_gets_a_count_or_its_autoscaling_config_and_rayrunners_request_router() -> None:
    options = build_spec("m", SMOL).engine.serve_options()
    assert options["num_replicas"] == 1
    router = options["request_router_config"]
    assert router["request_router_class"] == ROUTER_CLASS
    assert router["request_router_kwargs"] == {"routing": "least_loaded"}
    assert import_attr(ROUTER_CLASS) is LoadAwareRouter  # the path Serve imports
    sticky = build_spec("m", SMOL, engine={"num_replicas": 3, "routing": "prefix"}).engine.serve_options()
    assert sticky["request_router_config"]["request_router_kwargs"]["routing"] == "prefix"
    scaled = build_spec("m", SMOL, engine={"autoscaling_config": {"max_replicas": 4, "target_ongoing_requests": 2,
                                                                  "upscale_delay_s": 1}}).engine
    options = scaled.serve_options()["autoscaling_config"]
    assert (options["min_replicas"], options["max_replicas"], options["upscale_delay_s"]) == (1, 4, 1)
    assert "initial_replicas" not in options and scaled.max_replicas == 4


def test_capacity_counts_the_most_replicas_a_model_may_run() -> None:
    one = estimate_bytes(build_spec("m", SMOL))
    assert one > 0
    assert estimate_bytes(build_spec("m", SMOL, engine={"num_replicas": 2})) == 2 * one
    assert estimate_bytes(build_spec("m", SMOL, engine={"autoscaling_config": {"max_replicas": 3}})) == 3 * one


def test_a_replica_takes_a_fraction_of_one_gpu_or_whole_gpus() -> None:
    assert build_spec("m", SMOL, engine={"num_gpus": 0.5}).engine.num_gpus == 0.5
    assert build_spec("m", SMOL, engine={"num_gpus": 2}).engine.ray_actor_options()["num_gpus"] == 2
    with pytest.raises(InvalidSpecError) as caught:
        build_spec("m", SMOL, engine={"num_gpus": 1.5})
    assert caught.value.param == "num_gpus" and "whole number" in str(caught.value)


def test_rescaling_a_spec_changes_only_replica_settings() -> None:
    spec = build_spec("m", SMOL, engine={"autoscaling_config": {"max_replicas": 3}, "max_num_seqs": 4})
    fixed = spec.rescaled({"num_replicas": 2})
    assert fixed.engine.num_replicas == 2 and fixed.engine.autoscaling_config is None
    assert fixed.engine.max_num_seqs == 4 and fixed.replica_args() == spec.replica_args()
    sticky = fixed.rescaled({"routing": "prefix"})
    assert sticky.engine.routing == "prefix" and sticky.engine.num_replicas == 2  # the count stays
    for changes, param in (({"num_replicas": 0}, "num_replicas"), ({"max_num_seqs": 8}, "max_num_seqs"),
                           ({"autoscaling_config": {"min_replicas": 0}}, "autoscaling_config")):
        with pytest.raises(InvalidSpecError) as caught:
            spec.rescaled(changes)
        assert caught.value.param == param
