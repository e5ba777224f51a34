"""The method names the router sends across Ray (typed as Literals in `router.service`) name real methods: of the
model replica (`ModelServer`) and of the registry actor (`Registry`)."""

from __future__ import annotations

import inspect
import typing

import pytest

from rayrunner.registry.actor import Registry
from rayrunner.replica.model_server import ModelServer
from rayrunner.router.service import ModelCall, ModelStream, RegistryCall


@pytest.mark.parametrize("name", typing.get_args(ModelCall) + typing.get_args(ModelStream))
def test_model_calls_name_replica_methods(name: str) -> None:
    assert inspect.iscoroutinefunction(getattr(ModelServer, name)) or inspect.isasyncgenfunction(
        getattr(ModelServer, name))


@pytest.mark.parametrize("name", typing.get_args(RegistryCall))
def test_registry_calls_name_registry_methods(name: str) -> None:
    assert inspect.iscoroutinefunction(getattr(Registry, name))
