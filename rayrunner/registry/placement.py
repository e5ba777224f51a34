"""Whether a model's replica could ever be placed on the cluster, checked before its app is deployed.

Serve leaves a replica that no node can hold PENDING without end, so its load would only fail at `load_timeout_s`.
Before each deploy, `check_placeable` compares what one replica reserves (the Ray resources of its actor options:
`CPU`, `GPU`, `memory`, `accelerator_type:<T>`, custom ones) with each alive node's total resources. When none
could ever hold it, the load fails at once with an `UnplaceableModelError` (400) naming what is missing and what
the nodes have.

Autoscaling: a cluster whose autoscaler publishes its node types (the cluster config in the GCS that Ray's
autoscaler and KubeRay write, the same source Ray Train checks before it waits for workers) is also allowed what a
node of any type it may still add (`max_count` not 0) would hold. A node type that lists GPUs but no
`accelerator_type:` resource is taken to match any accelerator type, since its type is unknown until it starts.
For an autoscaler that publishes no node types, set `RAYRUNNER_PLACEMENT_CHECK=0` in the environment of the
cluster's processes (the `ray start` environment or the cluster's `runtime_env.env_vars`) to skip the check.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from rayrunner.errors import UnplaceableModelError
from rayrunner.models.spec import EngineSettings, ModelSpec
from rayrunner.runtime import ray_private

SKIP_ENV = "RAYRUNNER_PLACEMENT_CHECK"
ACCELERATOR_PREFIX = "accelerator_type:"
# What Ray reserves of `accelerator_type:<T>` for `accelerator_type=T` (ray._common.utils.resources_from_ray_options).
_ACCELERATOR_AMOUNT = 0.001
_EPSILON = 1e-6  # Ray counts resources in units of 1e-4
_GIB = 1024**3

Resources = Mapping[str, float]


def replica_demand(settings: EngineSettings) -> dict[str, float]:
    """The Ray resources one replica reserves, named as nodes report them (`CPU`, `GPU`, `memory`, ...)."""
    options = settings.ray_actor_options()
    demand: dict[str, float] = dict(options.get("resources", {}))
    demand["CPU"] = options["num_cpus"]
    demand["GPU"] = options["num_gpus"]
    if "memory" in options:
        demand["memory"] = float(options["memory"])
    if "accelerator_type" in options:
        demand[ACCELERATOR_PREFIX + options["accelerator_type"]] = _ACCELERATOR_AMOUNT
    return {name: amount for name, amount in demand.items() if amount > 0}


def missing(demand: Resources, node: Resources, node_type: bool = False) -> list[str]:
    """The demanded resources `node` lacks (for a `node_type` with GPUs but no known accelerator type, any
    accelerator type counts as present)."""
    unknown_accelerator = node_type and node.get("GPU", 0) > 0 and not any(map(_is_accelerator, node))
    return [
        name for name, amount in demand.items()
        if node.get(name, 0) + _EPSILON < amount and not (unknown_accelerator and _is_accelerator(name))
    ]


def unplaceable_reason(
    demand: Resources, nodes: Sequence[Resources], node_types: Sequence[Resources] = ()
) -> str | None:
    """Why no alive node (nor autoscaler node type) could hold `demand`; None when one could."""
    if any(not missing(demand, node) for node in nodes) or any(not missing(demand, t, True) for t in node_types):
        return None
    lacking = [name for name in demand if all(name in missing(demand, node) for node in nodes)]
    if lacking:
        cause = "no node has " + ", ".join(_amount(name, demand[name]) for name in lacking)
    else:
        cause = "no single node has all of it"
    described = "; ".join(_describe(node, demand) for node in nodes) or "none"
    extra = f" (nor any of the {len(node_types)} node types its autoscaler may add)" if node_types else ""
    return (f"one replica needs {_listing(demand)} but {cause}{extra}; "
            f"the cluster's {len(nodes)} alive nodes have: {described}")


def check_placeable(spec: ModelSpec) -> None:
    """Raise `UnplaceableModelError` when no node of the live cluster could ever hold the model's replica."""
    if os.environ.get(SKIP_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    reason = unplaceable_reason(replica_demand(spec.engine), nodes, autoscaler_node_types())
    if reason is not None:
        raise UnplaceableModelError(f"model `{spec.model_id}` cannot be placed: {reason}", param="engine")


def autoscaler_node_types() -> list[dict[str, float]]:
    """The per-node resources of each node type the autoscaler may still add; empty without an autoscaler."""
    try:
        config = ray_private.cluster_config()
    except Exception:  # an older Ray, or no GCS access: judge by the alive nodes alone
        return []
    if config is None:
        return []
    return [{k: float(v) for k, v in group.resources.items()} for group in config.node_group_configs
            if group.max_count != 0]


def _is_accelerator(name: str) -> bool:
    return name.startswith(ACCELERATOR_PREFIX)


def _describe(node: Resources, demand: Resources) -> str:
    """A node's resources that matter here: those demanded, and its accelerator type."""
    shown = {name: node.get(name, 0.0) for name in ("CPU", "GPU")}
    shown.update({name: node.get(name, 0.0) for name in demand if not _is_accelerator(name)})
    shown.update({name: amount for name, amount in node.items() if _is_accelerator(name)})
    return "{" + _listing(shown) + "}"


def _listing(resources: Resources) -> str:
    return ", ".join(_amount(name, amount) for name, amount in resources.items())


def _amount(name: str, amount: float) -> str:
    if _is_accelerator(name):
        return name
    if name == "memory":
        return f"memory {amount / _GIB:.3g} GiB"
    return f"{name} {amount:g}"
