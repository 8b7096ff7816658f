"""Validate custom resources against their CustomResourceDefinition, as the API server does on create.

A CRD's ``openAPIV3Schema`` is OpenAPI v3 with Kubernetes extensions, not plain JSON Schema. `crd_schema`
takes one version's schema from a CRD file and rewrites it into a JSON Schema (draft 4, the dialect of
OpenAPI 3.0) that `validate` checks with jsonschema, with the API server's semantics:

* unknown fields are errors (``kubectl apply --validate=strict``): every object schema that lists
  ``properties`` gets ``additionalProperties: false``, unless it sets ``x-kubernetes-preserve-unknown-fields:
  true``; as in the API server's pruning, the flag opens that object only, and the schemas of the properties it
  does list stay strict unless they set the flag too;
* ``x-kubernetes-int-or-string: true`` and ``format: int-or-string``: an integer or a string;
  ``nullable: true``: null is allowed too;
* ``x-kubernetes-list-type``: ``set`` items are unique, ``map`` items are unique by their
  ``x-kubernetes-list-map-keys`` (a missing key counts as its default, as after defaulting);
* a ``required`` property that has a ``default`` may be missing (the API server defaults it before it validates);
* ``x-kubernetes-validations`` (CEL): transition rules (on ``oldSelf``) do not apply to a create and are
  skipped; ``self in [...]`` becomes an enum; any other rule raises `NotImplementedError`, so a CRD update
  with new rules is noticed rather than silently unchecked;
* other ``x-kubernetes-*`` keys (``map-type``, ``list-type: atomic``) do not validate and are ignored, as are
  ``format`` annotations (``int32``, ``date-time``); ``default`` stays, an annotation to jsonschema.

The root ``metadata`` stays a free-form object: the API server checks it as ObjectMeta, not by the CRD schema.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

_SELF_IN = re.compile(r"^\s*self\s+in\s+(\[.*\])\s*$", re.S)


def crd_schema(path: Path, version: str = "v1") -> dict[str, Any]:
    """The JSON Schema of ``version`` of the CRD in the YAML file ``path``."""
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 17k lines
    found = [v for v in crd["spec"]["versions"] if v["name"] == version]
    if len(found) != 1:
        raise KeyError("%s: no single version %r in %s" % (path, version, [v["name"] for v in crd["spec"]["versions"]]))
    schema = to_json_schema(found[0]["schema"]["openAPIV3Schema"])
    Validator.check_schema(schema)
    return schema


def to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one OpenAPI v3 (structural) CRD schema node, and everything below it, into JSON Schema."""
    out: dict[str, Any] = {}
    all_of: list[dict[str, Any]] = []
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key == "format" and value == "int-or-string":
            all_of.append(_INT_OR_STRING)
        elif key == "x-kubernetes-int-or-string" and value is True:
            all_of.append(_INT_OR_STRING)
        elif key == "x-kubernetes-validations":
            all_of.extend(s for s in (_cel_rule(r) for r in value) if s)
        elif key in ("x-kubernetes-list-type", "x-kubernetes-list-map-keys"):
            out[key] = value  # checked by the keyword added in `validator`
        elif key in ("nullable", "format", "description") or key.startswith("x-kubernetes-"):
            continue
        else:
            out[key] = value
    if "properties" in node and "additionalProperties" not in node:
        if node.get("x-kubernetes-preserve-unknown-fields") is not True:
            out["additionalProperties"] = False
    if "required" in node:
        props = node.get("properties", {})
        required = [r for r in node["required"] if "default" not in props.get(r, {})]
        if required:
            out["required"] = required
        else:
            del out["required"]
    if all_of:
        out["allOf"] = out.get("allOf", []) + all_of
        if any(s is _INT_OR_STRING for s in all_of):
            out.pop("type", None)  # int-or-string nodes carry no type (or a wrong one) in some generators
    if node.get("nullable") is True:
        return {"anyOf": [{"type": "null"}, out]}
    return out


_INT_OR_STRING: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "string"}]}


def _cel_rule(rule: dict[str, Any]) -> dict[str, Any] | None:
    expr = rule["rule"]
    if re.search(r"\boldSelf\b", expr):
        return None  # a transition rule: only checked on update
    m = _SELF_IN.match(expr)
    if m:
        return {"enum": list(ast.literal_eval(m.group(1)))}
    raise NotImplementedError("CEL rule not translated to JSON Schema: %r" % expr)


def _list_type(validator: Any, list_type: str, instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
    if not validator.is_type(instance, "array") or list_type not in ("set", "map"):
        return
    if list_type == "set":
        keys = [yaml.safe_dump(item, sort_keys=True) for item in instance]
    else:
        names = schema.get("x-kubernetes-list-map-keys", [])
        props = schema.get("items", {}).get("properties", {})
        keys = [
            repr(tuple(item.get(k, props.get(k, {}).get("default")) if isinstance(item, dict) else item for k in names))
            for item in instance
        ]
    seen: set[str] = set()
    for i, key in enumerate(keys):
        if key in seen:
            yield jsonschema.ValidationError("duplicate entry %d in a list of type %s: %s" % (i, list_type, key))
        seen.add(key)


Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-type": _list_type})


def validate(instance: Any, schema: dict[str, Any]) -> None:
    """Raise the most relevant `jsonschema.ValidationError` if ``instance`` does not match ``schema``."""
    error = jsonschema.exceptions.best_match(Validator(schema).iter_errors(instance))
    if error is not None:
        raise error
