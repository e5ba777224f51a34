"""Which sources a model added at runtime may load from (checked by the registry, and again by the replica) and which
engine settings it may set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rayrunner.errors import InvalidSpecError, ModelLoadError, PermissionDeniedError
from rayrunner.models.source_policy import TUNING_ENGINE_ARGS, SourcePolicy
from rayrunner.models.sources import is_hub_id, resolve
from rayrunner.models.spec import ModelSpec, build_spec
from rayrunner.models.which import GGUF, Embedding, Lora, Plain

SMOL = {"type": "plain", "model_id": "smollm2-135m-instruct"}


def test_the_default_allows_builtin_models_only(tmp_path: Path) -> None:
    policy = SourcePolicy()
    policy.check(Plain(model_id="smollm2-135m-instruct"))
    policy.check(Embedding(model_id="all-minilm-l6-v2"))
    for which in (Plain(model_id=str(tmp_path)), Plain(model_id="Qwen/Qwen3-0.6B"), Plain(model_id="gpt2")):
        with pytest.raises(PermissionDeniedError) as caught:
            policy.check(which)
        assert caught.value.param == "which.model_id" and "none allowed" in caught.value.message


def test_local_roots_hold_paths_under_them_only(tmp_path: Path) -> None:
    inside, outside = tmp_path / "models" / "m", tmp_path / "other"
    inside.mkdir(parents=True)
    outside.mkdir()
    (inside / "escape").symlink_to(outside)
    policy = SourcePolicy(local_roots=[str(tmp_path / "models")])
    policy.check(Plain(model_id=str(inside)))
    for path in (outside, inside / "escape"):
        with pytest.raises(PermissionDeniedError, match="outside the local folders"):
            policy.check(Plain(model_id=str(path)))
    with pytest.raises(PermissionDeniedError, match="may not contain `..`"):  # even one that ends inside
        policy.check(Plain(model_id=str(tmp_path / "other" / ".." / "models" / "m")))


def test_hub_orgs() -> None:
    policy = SourcePolicy(hub_orgs=["Qwen"])
    policy.check(Plain(model_id="Qwen/Qwen3-0.6B"))
    with pytest.raises(PermissionDeniedError, match="not from an organisation"):
        policy.check(Plain(model_id="evil/Qwen3-0.6B"))
    SourcePolicy(hub_orgs=["*"]).check(Plain(model_id="gpt2"))


def test_every_location_field_is_checked(tmp_path: Path) -> None:
    policy = SourcePolicy(hub_orgs=["Qwen"])
    with pytest.raises(PermissionDeniedError) as caught:
        policy.check(Lora(model_id="Qwen/Qwen3-0.6B", adapter="evil/adapter"))
    assert caught.value.param == "which.adapter"
    with pytest.raises(PermissionDeniedError) as caught:
        policy.check(GGUF(quantized_model_id="Qwen/x-GGUF", tok_model_id=str(tmp_path)))
    assert caught.value.param == "which.tok_model_id"
    with pytest.raises(PermissionDeniedError) as caught:
        policy.check(Plain(model_id="Qwen/Qwen3-0.6B", hf_cache_path=str(tmp_path)))
    assert caught.value.param == "which.hf_cache_path"


def test_allow_all() -> None:
    SourcePolicy.allow_all().check(Plain(model_id="/anything", hf_cache_path="/x"))


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/model.gguf", "..", ".", "", "a\\b.gguf"])
def test_a_gguf_file_name_is_a_plain_name_everywhere(name: str) -> None:
    """Rejected by the spec itself (a 400 naming the field), whatever the source policy, declared models too."""
    with pytest.raises(ValidationError):
        GGUF(quantized_model_id="/models", quantized_filename=name)
    with pytest.raises(InvalidSpecError) as caught:
        build_spec("m", {"type": "gguf", "quantized_model_id": "/models", "quantized_filename": name})
    assert caught.value.param == "which.quantized_filename"
    assert GGUF(quantized_model_id="/models", quantized_filename="m.Q4_0.gguf").quantized_filename == "m.Q4_0.gguf"


def test_the_gguf_file_itself_must_lie_under_a_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "models", tmp_path / "secret.gguf"
    root.mkdir()
    outside.write_bytes(b"GGUF")
    (root / "link.gguf").symlink_to(outside)
    policy = SourcePolicy(local_roots=[str(root)])
    policy.check(GGUF(quantized_model_id=str(root), quantized_filename="m.gguf"))
    with pytest.raises(PermissionDeniedError) as caught:
        policy.check(GGUF(quantized_model_id=str(root), quantized_filename="link.gguf"))
    assert caught.value.param == "which.quantized_filename"


def test_a_refusal_says_nothing_of_what_exists_outside_the_roots(tmp_path: Path) -> None:
    root, outside = tmp_path / "models", tmp_path / "outside"
    root.mkdir()
    (outside / "there").mkdir(parents=True)
    policy = SourcePolicy(local_roots=[str(root)], hub_orgs=["*"])
    messages = []
    for name in ("there", "nowhere"):
        for location in (str(outside / name), str(outside / name / ".." / ".." / "models")):
            with pytest.raises(PermissionDeniedError) as caught:
                policy.check(Plain(model_id=location))
            messages.append(caught.value.message.replace(name, "X"))
    assert messages[:2] == messages[2:]


@pytest.mark.parametrize("location", ["./m", "../m", "m/../n", "a/b/c", "~/m", "/m", ".hidden/m", "-x/m"])
def test_a_relative_looking_path_is_never_a_hub_id(location: str) -> None:
    """`hub_orgs: ["*"]` allows every hub id, and none of these is one: each is a local path, outside every root."""
    assert not is_hub_id(location)
    with pytest.raises(PermissionDeniedError) as caught:
        SourcePolicy(hub_orgs=["*"]).check(Plain(model_id=location))
    assert caught.value.param == "which.model_id" and "hub" not in caught.value.message
    assert is_hub_id("gpt2") and is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/model.v1_b-2")


def test_under_a_policy_a_hub_spelt_location_is_a_hub_id_on_the_node_that_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder `org/model` that happens to exist where the replica runs is not read for the hub id `org/model`
    (the registry, elsewhere, allowed a hub id); without a policy (a declared model) the folder is used as before."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    (tmp_path / "org" / "model" / "config.json").write_text("{}")
    assert resolve("org/model").path == "org/model"
    with pytest.raises(PermissionDeniedError, match="hub repository `org/model`"):
        resolve("org/model", policy=SourcePolicy(local_roots=[str(tmp_path)], hub_orgs=["Qwen"]))


def test_resolve_checks_again_what_it_reads(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "m").mkdir(parents=True)
    (root / "m" / "config.json").write_text("{}")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.json").write_text("{}")
    policy = SourcePolicy(local_roots=[str(root)])
    assert resolve(str(root / "m"), policy=policy).path == str(root / "m")
    for location, kwargs in ((str(tmp_path / "outside"), {}), (str(root / "m"), {"hf_cache_path": str(tmp_path)})):
        with pytest.raises(PermissionDeniedError, match="outside the local folders"):
            resolve(location, policy=policy, **kwargs)
    with pytest.raises(ModelLoadError, match="does not exist"):  # inside a root: whether it exists may be said
        resolve(str(root / "missing"), policy=policy)


def test_the_replica_checks_the_spec_it_was_given(tmp_path: Path) -> None:
    """`resolve_which` (every engine's load) checks the policy a spec carries: the tokenizer too."""
    from rayrunner.engines.loading import resolve_which

    root = tmp_path / "models"
    (root / "m").mkdir(parents=True)
    (root / "m" / "config.json").write_text("{}")
    which = {"type": "plain", "model_id": str(root / "m"), "tokenizer_json": str(tmp_path / "tokenizer.json")}
    spec = build_spec("m", which)
    assert resolve_which(spec)[1] == str(tmp_path / "tokenizer.json")  # no policy: the operator's choice
    confined = spec.carrying(SourcePolicy(local_roots=[str(root)]))
    with pytest.raises(PermissionDeniedError) as caught:
        resolve_which(confined)
    assert caught.value.param == "which.tokenizer_json"


@pytest.mark.parametrize(("engine", "param"), [
    ({"backend": "vllm", "vllm": {"engine_args": {"trust_remote_code": True}}},
     "engine.vllm.engine_args.trust_remote_code"),
    ({"backend": "vllm", "vllm": {"engine_args": {"max_num_seqs": 8, "tokenizer": "/etc"}}},
     "engine.vllm.engine_args.tokenizer"),
    ({"vllm": {"engine_args": {"download_dir": "/tmp"}}}, "engine.vllm.engine_args.download_dir"),
    ({"backend": "vllm", "vllm": {"python": "/bin/sh"}}, "engine.vllm.python"),
    ({"image_url_allowlist": ["http://169.254.169.254/"]}, "engine.image_url_allowlist"),
])
def test_a_model_added_at_runtime_sets_only_vllm_tuning(engine: dict[str, Any], param: str) -> None:
    spec = build_spec("m", SMOL, None, engine)
    with pytest.raises(PermissionDeniedError) as caught:
        spec.confined(SourcePolicy(local_roots=["/"], hub_orgs=["*"]))
    assert caught.value.param == param and caught.value.status == 403
    assert spec.confined(SourcePolicy.allow_all()).engine.vllm == spec.engine.vllm  # a Runner's own service
    assert spec.confined(SourcePolicy.allow_all()).engine.image_url_allowlist == spec.engine.image_url_allowlist


def test_tuning_arguments_pass_and_the_spec_carries_the_policy(tmp_path: Path) -> None:
    tuning = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "enable_chunked_prefill": True, "block_size": 16,
              "swap_space": 1, "enforce_eager": True, "gpu_memory_utilization": 0.5, "max_model_len": 512, "seed": 1}
    assert set(tuning) <= TUNING_ENGINE_ARGS
    caller_policy = SourcePolicy.allow_all().model_dump()  # what a caller puts in `engine.sources` counts for nothing
    spec = build_spec("m", SMOL, None, {"backend": "vllm", "vllm": {"engine_args": tuning}, "sources": caller_policy})
    policy = SourcePolicy(local_roots=[str(tmp_path)], hub_orgs=["Qwen"])
    confined = spec.confined(policy)
    assert confined.engine.sources == policy and confined.engine.vllm.engine_args == tuning
    assert spec.confined(SourcePolicy(local_roots=["/"])).engine.sources is None  # nothing to check again
    replica = ModelSpec.model_validate(confined.replica_args())  # what each replica is built with
    assert replica.engine.sources == policy
    assert confined.rescaled({"num_replicas": 2}).engine.sources == policy  # a scale keeps it


async def test_the_registry_confines_runtime_adds_and_registers_nothing_it_refuses(tmp_path: Path) -> None:
    """A declared model sets what it likes; a refused add registers nothing; an allowed one is saved and deployed
    carrying the policy, and adding it again attaches to it."""
    from rayrunner.registry.actor import Registry
    from tests.fake_model_apps import FakeModelApps

    apps = FakeModelApps()
    declared = {"model_id": "op", "which": SMOL, "engine": {"vllm": {"engine_args": {"trust_remote_code": True}}}}
    reg = Registry(str(tmp_path / "registry.json"), apps=apps)
    await reg.bootstrap({"models": [{"spec": declared, "load": False}],
                         "sources": {"local_roots": [str(tmp_path)], "hub_orgs": ["*"]}})
    refused = [({"vllm": {"python": "/bin/sh"}}, SMOL),
               ({"vllm": {"engine_args": {"trust_remote_code": True}}}, SMOL),
               ({}, {"type": "plain", "model_id": "../m"})]
    for engine, which in refused:
        with pytest.raises(PermissionDeniedError):
            await reg.add({"spec": {"model_id": "new", "which": which, "engine": engine}, "load": True})
    assert set(reg.state.models) == {"op"} and apps.calls == []
    added = {"spec": {"model_id": "new", "which": SMOL, "engine": {"vllm": {"engine_args": {"seed": 3}}}}, "load": True}
    assert (await reg.add(added))["attached"] is False
    assert apps.apps["new"].spec.engine.sources == reg.config.sources
    assert (await reg.add(added))["attached"] is True
    assert (await reg.add({"spec": declared, "load": False}))["attached"] is True  # the same spec: nothing new
