"""Both engines implement the engine boundary (``hybridpd/engine/base.py``):
every member of ``Engine`` exists with the protocol's parameters, so a
protocol or an engine that drifts fails here, not in a worker at run time."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from hybridpd.engine.base import Engine
from hybridpd.engine.native.engine import NativeEngine
from tests.unit.engine_helpers import make_engine

METHODS = sorted(n for n, v in vars(Engine).items() if inspect.isfunction(v) and not n.startswith("_"))
ATTRIBUTES = sorted(n for n in Engine.__annotations__ if not n.startswith("_"))


def _engine_classes() -> list[Any]:
    from hybridpd.engine.vllm.engine import VllmEngine  # vllm itself is imported lazily

    return [NativeEngine, VllmEngine]


def test_the_protocol_is_what_the_workers_call() -> None:
    # guards the introspection below against passing vacuously
    assert {"add_request", "step", "pop_handoff", "fetch_handoff", "add_handoff", "pop_cache_events"} <= set(METHODS)
    assert len(METHODS) == 18
    assert ATTRIBUTES == ["compute_model", "hasher", "imports_checkpoints", "model_id", "spec", "unit"]


def _params(fn: Any) -> list[tuple[str, Any, bool]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize("cls", _engine_classes(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_has_the_protocols_parameters(cls: Any, name: str) -> None:
    impl = getattr(cls, name, None)
    assert impl is not None and callable(impl), "%s lacks %s" % (cls.__name__, name)
    want, got = _params(getattr(Engine, name)), _params(impl)
    assert [(n, k) for n, k, _ in got] == [(n, k) for n, k, _ in want], (cls.__name__, name)
    for (n, _, want_default), (_, _, has_default) in zip(want, got, strict=True):
        assert has_default or not want_default, "%s.%s: %s needs a default" % (cls.__name__, name, n)


def test_a_native_engine_is_an_engine() -> None:
    eng = make_engine()
    try:
        assert isinstance(eng, Engine)
        for name in ATTRIBUTES:
            assert hasattr(eng, name), name
        assert eng.unit == eng.hasher.unit and eng.imports_checkpoints
    finally:
        eng.close()


def test_the_factorys_arguments_are_accepted() -> None:
    sig = inspect.signature(NativeEngine)
    assert list(sig.parameters)[:2] == ["cfg", "model_dir"]  # the caller resolves the model (engine/factory.py)
    for name in ("role", "instance", "export_checkpoints", "num_state_slots", "record_logits"):
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    with pytest.raises(ValueError, match="role"):
        make_engine(role="router")
