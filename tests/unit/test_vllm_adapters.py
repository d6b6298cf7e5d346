"""A LoRA adapter's chain root (``connectors/vllm/adapters.py``): named by the files vLLM loads, kept
for an engine's life, hashed again only where vLLM reloads an adapter in place. No vLLM needed: a
``LoRARequest`` is read for its name, path and ``load_inplace`` only."""

from __future__ import annotations

import os
from types import SimpleNamespace

from kvdepot.connectors.vllm.adapters import AdapterRoots, adapter_digest


def make_adapter(path, config: bytes = b'{"r": 8}', weights: bytes = b"w" * 64, weights_file: str = "adapter_model.safetensors") -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_bytes(config)
    (path / weights_file).write_bytes(weights)
    return str(path)


def lora(name: str, path: str, load_inplace: bool = False):
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path, load_inplace=load_inplace)


def test_the_digest_is_the_files_content_whatever_the_directory(tmp_path):
    a = make_adapter(tmp_path / "a")
    b = make_adapter(tmp_path / "b")
    assert adapter_digest(a) == adapter_digest(b)
    (tmp_path / "a" / "README.md").write_text("not read by vLLM")
    assert adapter_digest(a) == adapter_digest(b)
    assert adapter_digest(make_adapter(tmp_path / "c", weights=b"w" * 63 + b"v")) != adapter_digest(b)


def test_bytes_moved_between_the_config_and_the_weights_change_the_digest(tmp_path):
    one = make_adapter(tmp_path / "one", config=b"{}x", weights=b"yz")
    two = make_adapter(tmp_path / "two", config=b"{}", weights=b"xyz")
    assert adapter_digest(one) != adapter_digest(two)


def test_the_weights_file_vllm_would_load_is_the_one_hashed(tmp_path):
    pt = make_adapter(tmp_path / "pt", weights_file="adapter_model.bin")
    assert adapter_digest(pt) is not None
    (tmp_path / "pt" / "adapter_model.safetensors").write_bytes(b"preferred by vLLM")
    assert adapter_digest(pt) != adapter_digest(make_adapter(tmp_path / "bin-only", weights_file="adapter_model.bin"))


def test_an_adapter_without_its_config_or_weights_has_no_digest(tmp_path):
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text("{}")
    assert adapter_digest(str(no_weights)) is None
    no_config = make_adapter(tmp_path / "no-config")
    os.unlink(os.path.join(no_config, "adapter_config.json"))
    assert adapter_digest(no_config) is None
    roots = AdapterRoots()
    assert roots.root(lora("x", no_config)) is None
    assert roots.root(lora("hub", "org/adapter-on-the-hub")) is None


def test_a_root_is_kept_for_the_engines_life_unless_vllm_reloads_the_adapter_in_place(tmp_path):
    path = make_adapter(tmp_path / "a")
    roots = AdapterRoots()
    first = roots.root(lora("a", path))
    assert first is not None and len(first) == 32
    assert roots.root(lora("other-name", path)) == first  # same files
    make_adapter(tmp_path / "a", weights=b"new weights, another size")
    assert roots.root(lora("a", path)) == first  # vLLM computes with what it loaded first
    reloaded = roots.root(lora("a", path, load_inplace=True))
    assert reloaded is not None and reloaded != first  # vLLM reads the files again
    assert AdapterRoots().root(lora("a", path)) == reloaded  # a restarted engine reads them too


def test_a_hub_adapter_is_read_from_the_local_cache_once_vllm_downloaded_it(tmp_path, monkeypatch):
    """vLLM's workers download a hub adapter when they first serve it, after the scheduler saw its
    first request: until then it has no root, and it is looked for again every RETRY_S, never
    downloaded by the scheduler."""
    from huggingface_hub import constants  # installed with vLLM, which the suite needs

    from kvdepot.connectors.vllm.adapters import RETRY_S

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a download attempt would fail loudly, not hang
    now = [100.0]
    roots = AdapterRoots(clock=lambda: now[0])
    request = lora("sql", "some-org/sql-adapter")
    assert roots.root(request) is None  # not downloaded yet

    repo = tmp_path / "hub" / "models--some-org--sql-adapter"
    make_adapter(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    now[0] += RETRY_S / 2
    assert roots.root(request) is None  # not looked for again yet
    now[0] += RETRY_S
    found = roots.root(request)
    assert found is not None and found == AdapterRoots().root(lora("local", make_adapter(tmp_path / "local")))
    assert roots.root(lora("abs", str(tmp_path / "missing"))) is None  # an absolute path is never a hub id
