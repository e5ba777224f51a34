"""Placement logic: a replica's Ray resources from its engine settings, and why no node could hold it."""

from __future__ import annotations

import pytest

from rayrunner.errors import InvalidSpecError
from rayrunner.models.spec import EngineSettings, build_spec
from rayrunner.registry.placement import missing, replica_demand, unplaceable_reason

GIB = 1024**3
HEAD = {"CPU": 4.0, "memory": 8.0 * GIB, "node:__internal_head__": 1.0}
A10G = {"CPU": 8.0, "GPU": 1.0, "memory": 16.0 * GIB, "accelerator_type:A10G": 1.0, "nvme": 1.0}


def settings(**engine: object) -> EngineSettings:
    return EngineSettings.model_validate(engine)


def test_actor_options_carry_every_placement_setting_by_rays_names() -> None:
    engine = settings(num_gpus=1, num_cpus=2, accelerator_type="A10G", memory=GIB, resources={"nvme": 1})
    assert engine.ray_actor_options() == {
        "num_cpus": 2, "num_gpus": 1, "accelerator_type": "A10G", "memory": GIB, "resources": {"nvme": 1}}
    assert settings().ray_actor_options() == {"num_cpus": 0.125, "num_gpus": 0.0}
    assert replica_demand(engine) == {"nvme": 1, "CPU": 2, "GPU": 1, "memory": GIB, "accelerator_type:A10G": 0.001}
    assert replica_demand(settings(num_cpus=0)) == {}


def test_by_default_a_two_core_node_holds_eight_models_loaded_or_asleep_beside_the_router() -> None:
    """`serve run` starts Ray with the node's cores as its CPUs, and a sleeping replica keeps its reservation:
    with room for 3 of 8 models the other 5 sleep on the node instead of being stopped for their CPUs."""
    from rayrunner.router.app import ROUTER_NUM_CPUS

    assert ROUTER_NUM_CPUS + 8 * replica_demand(settings())["CPU"] <= 2


@pytest.mark.parametrize("name", ["CPU", "GPU", "memory", "accelerator_type:A10G"])
def test_builtin_resources_are_refused_in_custom_resources(name: str) -> None:
    with pytest.raises(InvalidSpecError, match=f"`{name}` is not a custom resource"):
        build_spec("m", {"type": "plain", "model_id": "x"}, engine={"resources": {name: 1}})


def test_a_node_that_has_everything_places_the_replica() -> None:
    demand = replica_demand(settings(num_gpus=1, accelerator_type="A10G", memory=GIB, resources={"nvme": 1}))
    assert missing(demand, A10G) == []
    assert unplaceable_reason(demand, [HEAD, A10G]) is None


@pytest.mark.parametrize(
    ("engine", "named"),
    [
        ({"accelerator_type": "H100", "num_gpus": 1}, "no node has accelerator_type:H100"),
        ({"num_gpus": 2}, "no node has GPU 2"),
        ({"num_cpus": 16}, "no node has CPU 16"),
        ({"memory": 32 * GIB}, "no node has memory 32 GiB"),
        ({"resources": {"tpu": 1}}, "no node has tpu 1"),
    ],
)
def test_the_missing_resource_and_the_nodes_are_named(engine: dict[str, object], named: str) -> None:
    reason = unplaceable_reason(replica_demand(settings(**engine)), [HEAD, A10G])
    assert reason is not None and named in reason
    assert "2 alive nodes have: {CPU 4, GPU 0" in reason and "accelerator_type:A10G}" in reason


def test_resources_spread_over_two_nodes_do_not_add_up() -> None:
    demand = replica_demand(settings(num_cpus=1, memory=4 * GIB, resources={"head_only": 1}))
    reason = unplaceable_reason(demand, [{**HEAD, "head_only": 1.0, "memory": 2.0 * GIB}, A10G])
    assert reason is not None and "no single node has all of it" in reason


def test_a_node_type_the_autoscaler_may_add_counts() -> None:
    demand = replica_demand(settings(num_gpus=1, accelerator_type="H100"))
    assert unplaceable_reason(demand, [HEAD], [{"CPU": 8.0, "GPU": 8.0, "accelerator_type:H100": 1.0}]) is None
    # A GPU node type whose accelerator type is unknown until it starts may be any type.
    assert unplaceable_reason(demand, [HEAD], [{"CPU": 8.0, "GPU": 8.0}]) is None
    reason = unplaceable_reason(demand, [HEAD], [{"CPU": 8.0, "GPU": 1.0, "accelerator_type:L4": 1.0}])
    assert reason is not None and "nor any of the 1 node types its autoscaler may add" in reason
    assert unplaceable_reason(demand, [HEAD], [{"CPU": 8.0}]) is not None
