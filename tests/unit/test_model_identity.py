"""A model's identity is what produced the state (issue #51): the bytes of its files
and the engine's facts, not its directory's name. The same directory name with
changed weights gets a new identity, and with it new index keys, store keys and a
new actor namespace; equal files elsewhere keep theirs; the bundled model works."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import hybridpd
from hybridpd.config import load_config
from hybridpd.engine.factory import resolve_model
from hybridpd.index.schema import IndexKeys
from hybridpd.model_identity import STATE_FORMAT_VERSION, engine_identity, file_digest, model_identity
from launch.actors import namespace

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def bundled() -> Path:
    path = resolve_model(load_config(env={}))
    assert isinstance(path, Path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_equal_files_anywhere_are_one_identity(bundled: Path, tmp_path: Path) -> None:
    cfg = load_config(env={})
    here = engine_identity(cfg, bundled)
    there = engine_identity(cfg, _copy(bundled, tmp_path / "a" / bundled.name))
    assert here == there and here.startswith(bundled.name + "@")
    assert engine_identity(cfg, _copy(bundled, tmp_path / "renamed")) != here  # the name is part of it


def test_changed_weights_under_the_same_name_are_a_new_identity(bundled: Path, tmp_path: Path) -> None:
    cfg = load_config(env={})
    before = engine_identity(cfg, bundled)
    changed = _copy(bundled, tmp_path / bundled.name)
    weights = load_file(changed / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, changed / "model.safetensors")
    after = engine_identity(cfg, changed)
    assert after != before and after.split("@")[0] == before.split("@")[0]
    # so nothing keyed by the old identity is found under the new one
    assert IndexKeys(before).kv(b"h" * 32) != IndexKeys(after).kv(b"h" * 32)
    assert namespace(before) != namespace(after)


def test_every_file_and_fact_counts(bundled: Path, tmp_path: Path) -> None:
    cfg = load_config(env={})
    base = engine_identity(cfg, bundled)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "draft.safetensors"):
        d = _copy(bundled, tmp_path / name / bundled.name)
        with open(d / name, "ab") as f:
            f.write(b" ")
        assert engine_identity(cfg, d) != base, name
    for overrides in ({"dtype": "bfloat16"}, {"prefix_match_unit": 32}, {"checkpoint_alignment": 32}):
        other = load_config(env={}, overrides=overrides)
        assert engine_identity(other, bundled) != base, overrides
    facts = {"engine": "native"}
    assert model_identity(bundled, facts) == model_identity(bundled, dict(facts))
    assert STATE_FORMAT_VERSION >= 1


def test_hidden_files_do_not_count(bundled: Path, tmp_path: Path) -> None:
    cfg = load_config(env={})
    d = _copy(bundled, tmp_path / bundled.name)
    (d / ".lock").write_text("written by a downloader")
    assert engine_identity(cfg, d) == engine_identity(cfg, bundled)


def test_file_digest_is_the_sha256_and_a_hub_blob_is_its_name(tmp_path: Path) -> None:
    data = b"weights" * 1000
    f = tmp_path / "w.bin"
    f.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert file_digest(f) == want
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    blob = blobs / want
    blob.write_bytes(data)
    link = tmp_path / "hub" / "model.safetensors"
    link.symlink_to(blob)
    assert file_digest(link) == want
    f.write_bytes(data + b"!")  # a rewrite (new size) is hashed again, not remembered
    assert file_digest(f) == hashlib.sha256(data + b"!").hexdigest()


def test_the_namespace_carries_release_and_identity() -> None:
    assert namespace("tiny@0123456789abcdef") == "hybridpd-%s-tiny_0123456789abcdef" % hybridpd.__version__
    assert namespace(None) == "hybridpd-%s" % hybridpd.__version__
