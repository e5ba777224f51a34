"""The registry's pure logic, no Ray: attaching to a registered model, where the default goes, and what a config
changes in a state that already knows its models."""

from __future__ import annotations

from typing import Any

import pytest

from rayrunner.errors import AliasConflictError, ModelExistsError, ModelNotFoundError
from rayrunner.registry.config import RegistryConfig
from rayrunner.registry.state import ConfigChanges, ModelEntry, RegistryState

TEXT = {"type": "plain", "model_id": "smollm2-135m-instruct"}
EMBEDDING = {"type": "embedding", "model_id": "all-minilm-l6-v2"}


def entry(model_id: str, which: dict[str, Any] = TEXT, aliases: tuple[str, ...] = (), **spec: Any) -> ModelEntry:
    return ModelEntry.model_validate({"spec": {"model_id": model_id, "which": which, **spec},
                                      "aliases": list(aliases)})


def config(*entries: ModelEntry, default: str | None = None) -> RegistryConfig:
    return RegistryConfig(models=list(entries), default_model=default)


def test_attach_with_the_same_spec_adds_only_missing_aliases() -> None:
    state = RegistryState()
    state.add(entry("m", aliases=("a",)).spec, ["a"])
    record = state.attach(entry("m").spec, ["a", "b"])
    assert record is state.models["m"] and record.aliases == ["a", "b"]
    state.add(entry("other").spec, [])
    with pytest.raises(AliasConflictError):
        state.attach(entry("m").spec, ["other"])
    assert record.aliases == ["a", "b"]


def test_attach_with_another_spec_names_each_difference() -> None:
    state = RegistryState()
    state.add(entry("m", in_situ_quant="Q4K").spec, [])
    changed = entry("m", in_situ_quant="Q8_0", engine={"default_max_tokens": 9}).spec
    with pytest.raises(ModelExistsError) as raised:
        state.attach(changed, [])
    message = raised.value.message
    assert "already exists with a different spec" in message
    assert "in_situ_quant: 'Q4K' -> 'Q8_0'" in message and "engine.default_max_tokens: 256 -> 9" in message
    assert raised.value.code == "model_exists" and raised.value.status == 409


def test_attach_ignores_replica_settings_and_keeps_the_registered_ones() -> None:
    state = RegistryState()
    state.add(entry("m", engine={"num_replicas": 3, "routing": "prefix"}).spec, [])
    record = state.attach(entry("m").spec, [])
    assert record.spec.engine.num_replicas == 3 and record.spec.engine.routing == "prefix"


def test_add_alias_to_the_same_model_is_a_no_op() -> None:
    state = RegistryState()
    state.add(entry("m").spec, ["a"])
    state.add(entry("n").spec, [])
    assert state.add_alias("m", "a") is False and state.models["m"].aliases == ["a"]
    assert state.add_alias("m", "b") is True
    with pytest.raises(AliasConflictError):
        state.add_alias("n", "a")


def test_removing_the_default_picks_a_model_of_the_same_kind_loaded_first() -> None:
    state = RegistryState()
    for model_id, which in (("t1", TEXT), ("emb", EMBEDDING), ("t2", TEXT), ("t3", TEXT)):
        state.add(entry(model_id, which).spec, [])
    state.models["t3"].status = "loaded"
    state.models["emb"].status = "loaded"
    assert state.default_id == "t1"
    state.remove("t1")
    assert state.default_id == "t3"
    state.remove("t3")
    assert state.default_id == "t2"
    state.remove("t2")
    assert state.default_id is None  # never the embedding model
    with pytest.raises(ModelNotFoundError, match="no default model is set"):
        state.resolve("default")


def test_config_is_the_source_of_truth_for_the_models_it_declares() -> None:
    state = RegistryState()
    first = config(entry("smol", aliases=("s",)), entry("emb", EMBEDDING), default="s")
    changes = state.apply_config(first.models, first.default_model)
    assert changes.added == ["smol", "emb"] and state.default_id == "smol"

    # Runtime changes: another model, an alias, the default.
    state.add(entry("extra").spec, [])
    state.add_alias("emb", "e")
    state.set_default("extra")

    # The same config again changes nothing, and keeps the runtime changes.
    again = state.apply_config(first.models, first.default_model)
    assert again.added == [] and again.respecified == [] and again.log == []
    assert state.default_id == "extra" and state.models["emb"].aliases == ["e"] and "extra" in state.models

    # A changed spec and a new alias are taken, and logged.
    edited = config(entry("smol", aliases=("s", "small"), in_situ_quant="Q4K"), entry("emb", EMBEDDING),
                    default="s")
    changes = state.apply_config(edited.models, edited.default_model)
    assert changes.respecified == ["smol"] and state.models["smol"].spec.in_situ_quant == "Q4K"
    assert state.models["smol"].aliases == ["s", "small"]
    assert any("in_situ_quant: None -> 'Q4K'" in line for line in changes.log)
    assert state.default_id == "extra"

    # A config whose own default changed sets it, once.
    moved = config(*edited.models, default="emb")
    assert state.apply_config(moved.models, moved.default_model).log == ["default set to `emb` by the config (`emb`)"]
    state.set_default("smol")
    state.apply_config(moved.models, moved.default_model)
    assert state.default_id == "smol"


def test_a_state_from_before_config_defaults_were_remembered_takes_the_config_default() -> None:
    """The seen failure: the default had moved to the embedding model, and every later start kept it there."""
    state = RegistryState()
    state.add(entry("smol").spec, ["s"])
    state.add(entry("emb", EMBEDDING).spec, [])
    state.default_id = "emb"
    apply(state, config(entry("smol", aliases=("s",)), entry("emb", EMBEDDING), default="s"))
    assert state.default_id == "smol" and state.config_default == "s"


def test_config_sets_pinned_and_keep_alive_and_leaves_what_it_does_not_say() -> None:
    state = RegistryState()
    pinned = ModelEntry.model_validate({"spec": entry("m").spec.model_dump(), "pinned": True, "keep_alive": "5m"})
    apply(state, config(pinned))
    record = state.models["m"]
    assert record.pinned and record.keep_alive == "5m" and record.effective_keep_alive() == "5m"
    record.request_keep_alive = 0  # a request's own keep_alive wins until the model unloads
    assert record.effective_keep_alive() == 0
    apply(state, config(entry("m")))  # says neither: both stay
    assert record.pinned and record.keep_alive == "5m"
    unpinned = ModelEntry.model_validate({"spec": entry("m").spec.model_dump(), "pinned": False})
    apply(state, config(unpinned))
    assert not record.pinned
    assert RegistryState.model_validate_json(state.model_dump_json()).models["m"].keep_alive == "5m"


def test_a_runtime_pin_or_unpin_outlives_restarts_with_the_same_config() -> None:
    """Every router start applies its config again: a config's `pinned` applies only when its value changed."""
    declared = ModelEntry.model_validate({"spec": entry("m").spec.model_dump(), "pinned": True})
    state = RegistryState()
    apply(state, config(declared))
    record = state.models["m"]
    assert record.pinned
    record.pinned = False  # `rayrunner unpin m`
    restarted = RegistryState.model_validate_json(state.model_dump_json())
    apply(restarted, config(declared))
    assert restarted.models["m"].pinned is False
    undeclared = ModelEntry.model_validate({"spec": entry("m").spec.model_dump(), "pinned": False})
    restarted.models["m"].pinned = True  # `rayrunner pin m`
    apply(restarted, config(undeclared))  # the config's own value changed: it wins
    assert restarted.models["m"].pinned is False
    apply(restarted, config(declared))
    assert restarted.models["m"].pinned is True


def apply(state: RegistryState, declared: RegistryConfig) -> ConfigChanges:
    return state.apply_config(declared.models, declared.default_model)
