"""How many replicas a loaded model runs: a fixed `num_replicas`, or Serve's autoscaling between a minimum and a
maximum by ongoing requests. Names and meanings are Serve's (`ray.serve.config.AutoscalingConfig`), so a config
reads as a Serve user expects; scaling to zero stays the registry's job (unload, keep_alive, eviction), so a
model's status always says whether it is loaded.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ROUTER_CLASS = "rayrunner.router.replica_choice.LoadAwareRouter"  # by path: models/ does not import the router
ROUTING_STATS_PERIOD_S = 1.0
_ZERO = ("0 is not allowed: a model scales to zero only by unloading (`unload`, keep_alive or eviction), so that "
         "its status stays true")


class Autoscaling(BaseModel):
    """Serve's autoscaling between `min_replicas` and `max_replicas`, by ongoing requests per replica."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, description="Replicas kept while loaded (at least 1).")
    max_replicas: int = Field(1, ge=1, description="Most replicas under load.")
    initial_replicas: int | None = Field(None, description="Replicas a load starts (default `min_replicas`).")
    target_ongoing_requests: float = Field(2.0, gt=0, description="Ongoing requests per replica Serve aims at.")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long load must stay high before scaling up.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long load must stay low before scaling down.")
    look_back_period_s: float = Field(30.0, gt=0, description="Window the ongoing requests are averaged over.")
    upscaling_factor: float | None = Field(None, gt=0, description="Multiplier on each upscaling decision.")
    downscaling_factor: float | None = Field(None, gt=0, description="Multiplier on each downscaling decision.")

    @field_validator("min_replicas", "initial_replicas")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(_ZERO)
        return value

    @model_validator(mode="after")
    def _in_order(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"initial_replicas ({initial}) is outside [min_replicas, max_replicas]")
        return self


class Replicas(BaseModel):
    """The replica settings of a model's `engine`: `num_replicas` or `autoscaling_config`."""

    num_replicas: int = Field(1, description="Replicas while loaded (at least 1); with `autoscaling_config`, unset.")
    autoscaling_config: Autoscaling | None = Field(
        None, description="Serve's autoscaling between `min_replicas` (>= 1) and `max_replicas`."
    )

    routing: Literal["least_loaded", "prefix"] = Field(
        "least_loaded", description="Which replica takes a request: the one with the fewest sequences, or "
        "(`prefix`) the one that took the same prompt start or OpenAI `user` before, unless it is much busier."
    )

    @field_validator("num_replicas")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(_ZERO)
        return value

    @model_validator(mode="after")
    def _one_way(self) -> Replicas:
        if self.autoscaling_config is not None and self.num_replicas != 1:
            raise ValueError("autoscaling_config replaces num_replicas: set one of them, not both")
        return self

    def serve_options(self) -> dict[str, Any]:
        """The deployment options Serve takes for them."""
        router = {"request_router_class": ROUTER_CLASS, "request_router_kwargs": {"routing": self.routing},
                  "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}
        if self.autoscaling_config is None:
            return {"num_replicas": self.num_replicas, "request_router_config": router}
        return {"autoscaling_config": self.autoscaling_config.model_dump(exclude_none=True),
                "request_router_config": router}

    @property
    def max_replicas(self) -> int:
        """The most replicas the model may run: what capacity plans for."""
        return self.num_replicas if self.autoscaling_config is None else self.autoscaling_config.max_replicas
