"""deploy/kubernetes/ checked offline, as `kubectl apply` with strict field validation and the controllers would.

- Every manifest is listed in kustomization.yaml and every listed file exists.
- Each object validates against Kubernetes' published JSON schemas (PyPI kubernetes-validate, strict: an unknown
  field is an error), on the oldest Kubernetes the manifests claim (1.30: `preStop.sleep` is on by default from it)
  and the newest the package ships; custom resources (InferencePool, PodMonitor, HTTPRoute) against their CRDs'
  schemas vendored in tests/crd_schemas/ (pinned releases, SOURCES.md), with unknown fields refused as the API
  server's strict validation does and metadata against Kubernetes' ObjectMeta.
- The pieces fit together: selectors select the model-server pods, ports and names that refer to each other agree,
  the container's `nextn serve` arguments and NEXTN_* variables are real settings with valid values, the probes hit
  /ready and /health, the grace period covers the preStop sleep and the gateway's longest request, the endpoint
  picker reads the model-server protocol under the names nextn exports, and the HPA asks for the metric the
  adapter serves.
- The picker's prefix affinity: a prefix-cache scorer in its profile with a weight, fed by the approximate prefix
  producer on nextn's 256-token grid, and weights that keep affinity below a full pool and a queue.
- The prometheus-adapter rule's PromQL runs under promtool (`promtool test rules`: syntax, and the per-pod value
  the HPA would get from given series).
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml

from config.settings import ENV_PREFIX, env_var, field_names
from engine.cache import PREFILL_GRID
from metrics.prometheus import MODEL_SERVER_PROTOCOL, ServingMetrics
from server.cli import build_parser, settings_from_args
from tests.server_fixtures import DEMO_DIR

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "kubernetes"
CRD_SCHEMAS = Path(__file__).with_name("crd_schemas")
K8S_VERSIONS = ("1.30", kubernetes_validate.utils.major_minor(kubernetes_validate.latest_version()))
NAMESPACE = "nextn"
OBJECT_META = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def kustomization() -> dict:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def objects() -> Iterator[tuple[str, dict]]:
    """(file name, object) of every manifest kustomization.yaml lists, in its order."""
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / name).read_text()):
            if doc:
                yield name, doc


def one(kind: str, name: str) -> dict:
    found = [o for _, o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def literal_env(c: dict) -> dict[str, str]:
    """{name: value} of a container's variables set to a literal value."""
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------------------------------- schemas


def _strict(node: Any) -> Any:
    """A CRD's OpenAPI v3 schema as JSON Schema the way the API server applies it with strict field validation:
    unknown fields refused (unless x-kubernetes-preserve-unknown-fields), `nullable`, int-or-string."""
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (_strict(v) if k != "properties" else {p: _strict(s) for p, s in v.items()}) for k, v in node.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validator(api_version: str, kind: str, k8s_version: str) -> jsonschema.Validator:
    """A validator for a custom resource from its vendored CRD schema, metadata checked as Kubernetes' ObjectMeta."""
    for f in CRD_SCHEMAS.glob("*.json"):
        crd = json.loads(f.read_text())
        if crd["apiVersion"] == api_version and crd["kind"] == kind:
            break
    else:
        pytest.fail(f"no vendored CRD schema for {kind} {api_version} in {CRD_SCHEMAS}")
    schema = _strict(crd["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"$ref": OBJECT_META}
    defs = kubernetes_validate.utils.schema_contents(
        f"kubernetes-json-schema/v{k8s_version}.0-local-strict/_definitions.json", k8s_version)
    registry = referencing.Resource.from_contents(defs) @ referencing.Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_every_manifest_validates_against_its_schema(k8s: str):
    checked = []
    for name, obj in objects():
        what = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, k8s, strict=True)
        except kubernetes_validate.utils.SchemaNotFoundError:  # not a built-in kind: a custom resource
            errors = sorted(crd_validator(obj["apiVersion"], obj["kind"], k8s).iter_errors(obj), key=str)
            assert not errors, f"{what}: " + "; ".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{what}: {'.'.join(map(str, e.path))}: {e.message}")
        checked.append(obj["kind"])
    assert {"Deployment", "Service", "PodMonitor", "HorizontalPodAutoscaler", "InferencePool", "HTTPRoute"} \
        <= set(checked)


def test_the_schema_checks_can_fail():
    """A typo'd field and a wrong type are refused, in a built-in kind and in a custom resource."""
    dep = one("Deployment", "nextn")
    bad = json.loads(json.dumps(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    pool = one("InferencePool", "nextn")
    v = crd_validator(pool["apiVersion"], pool["kind"], K8S_VERSIONS[-1])
    for change in ({"targetPort": [{"number": 8000}]}, {"targetPorts": [{"number": "8000"}]}):
        assert list(v.iter_errors({**pool, "spec": {**pool["spec"], **change}})), change
    assert list(v.iter_errors({**pool, "metadata": {**pool["metadata"], "labels": {"a": 1}}}))


def test_kustomization_lists_every_manifest():
    listed = kustomization()["resources"]
    on_disk = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk
    assert kustomization()["namespace"] == NAMESPACE
    for _, obj in objects():  # plain `kubectl apply -f` lands in the same namespace as `apply -k`
        assert obj["kind"] == "Namespace" or obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]


# ------------------------------------------------------------------------------------------ how the pieces fit


def test_model_server_deployment():
    dep = one("Deployment", "nextn")
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(spec["selector"]["matchLabels"], labels)
    assert "replicas" not in spec, "the HPA owns the replica count"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    c = container(dep, "nextn")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
    port = next(p for p in c["ports"] if p["name"] == "http")["containerPort"]

    # the container runs the image's ENTRYPOINT with these args and variables: real settings, valid values
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", (REPO / "Dockerfile").read_text(), re.M)[1])
    assert entrypoint[:2] == ["nextn", "serve"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    model = mounts["model"]
    assert model["readOnly"] and next(v for v in pod["volumes"] if v["name"] == "model")["persistentVolumeClaim"][
        "claimName"] == one("PersistentVolumeClaim", "nextn-model")["metadata"]["name"]
    env = literal_env(c)
    known = {env_var(n) for n in field_names()}
    assert {k for k in env if k.startswith(ENV_PREFIX)} <= known
    args = [str(DEMO_DIR) if a == model["mountPath"] else a for a in c["args"]]  # the mounted checkpoint
    assert args != c["args"], "MODEL_DIR is the model volume's mount path"
    settings = settings_from_args(build_parser().parse_args(entrypoint[1:] + args), environ=env)
    assert settings.host == "0.0.0.0" and settings.port == port and settings.device == "cuda"

    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/health"
    assert all(p["port"] in ("http", port) for p in probes.values())
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 600, "loading a large checkpoint takes minutes"

    # the drain: preStop, then SIGTERM drains every admitted request, bounded by the gateway's request timeout
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    timeout = one("HTTPRoute", "nextn")["spec"]["rules"][0]["timeouts"]["request"]
    assert timeout.endswith("s")
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + int(timeout[:-1]) + 10
    assert c["readinessProbe"]["failureThreshold"] == 1


def test_selectors_and_references_agree():
    dep = one("Deployment", "nextn")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    port = container(dep, "nextn")["ports"][0]
    svc = one("Service", "nextn")
    assert selects(svc["spec"]["selector"], pod_labels) and svc["spec"]["ports"][0]["targetPort"] == port["name"]
    assert selects(one("PodDisruptionBudget", "nextn")["spec"]["selector"]["matchLabels"], pod_labels)
    pm = one("PodMonitor", "nextn")["spec"]
    assert selects(pm["selector"]["matchLabels"], pod_labels)
    assert pm["podMetricsEndpoints"][0]["port"] == port["name"] and pm["podMetricsEndpoints"][0]["path"] == "/metrics"

    pool = one("InferencePool", "nextn")
    assert selects(pool["spec"]["selector"]["matchLabels"], pod_labels)
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port["containerPort"]]
    route = one("HTTPRoute", "nextn")["spec"]["rules"][0]
    assert route["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                     "name": pool["metadata"]["name"]}]
    assert route["matches"][0]["path"]["value"] == "/v1"  # /metrics, /health, /ready stay in the cluster

    # the pool's endpoint picker: its Service, its Deployment's flags, its RBAC and its mounted configuration
    ref = pool["spec"]["endpointPickerRef"]
    epp_svc = one("Service", ref["name"])
    epp = one("Deployment", ref["name"])
    epp_c = container(epp, "epp")
    flags = dict(a.removeprefix("--").split("=", 1) for a in epp_c["args"])
    target = next(p for p in epp_svc["spec"]["ports"] if p["port"] == ref["port"]["number"])["targetPort"]
    assert next(p for p in epp_c["ports"] if p["name"] == target)["containerPort"] == int(flags["grpc-port"])
    assert selects(epp_svc["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])
    assert (flags["pool-name"], flags["pool-namespace"], flags["pool-group"]) == (
        pool["metadata"]["name"], pool["metadata"]["namespace"], pool["apiVersion"].split("/")[0])
    assert epp_c["image"].endswith(":v0.10.0"), "the picker is pinned to a release"
    sa = epp["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one("RoleBinding", sa)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    rules = one("Role", binding["roleRef"]["name"])["rules"]
    for group, resource in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        assert any(group in r["apiGroups"] and resource in r["resources"] and {"get", "list", "watch"} <= set(
            r["verbs"]) for r in rules), (group, resource)
    config_path = Path(flags["config-file"])
    mount = next(m for m in epp_c["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volume = next(v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert config_path.name in one("ConfigMap", volume["configMap"]["name"])["data"]

    hpa = one("HorizontalPodAutoscaler", "nextn")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "nextn"}
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]


def epp_config() -> dict:
    pool = one("InferencePool", "nextn")
    epp = one("Deployment", pool["spec"]["endpointPickerRef"]["name"])
    flags = dict(a.removeprefix("--").split("=", 1) for a in container(epp, "epp")["args"])
    cm = next(v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")["configMap"]["name"]
    return yaml.safe_load(one("ConfigMap", cm)["data"][Path(flags["config-file"]).name])


def test_endpoint_picker_reads_the_protocol_under_nextns_names():
    cfg = epp_config()
    assert (cfg["apiVersion"], cfg["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    # the fields of llm-d-router v0.10.0's EndpointPickerConfig (apix/config/v1alpha1), so a typo is caught here
    assert set(cfg) <= {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer",
                        "flowControl", "requestHandler", "saturationDetector", "parser"}, set(cfg)
    assert all(set(p) <= {"name", "type", "parameters"} for p in cfg["plugins"])
    assert all(set(r) <= {"pluginRef", "weight"} for prof in cfg["schedulingProfiles"] for r in prof["plugins"])
    assert set(cfg["dataLayer"]) <= {"injectDefaults", "sources", "discovery"}
    plugins = {p.get("name", p["type"]): p for p in cfg["plugins"]}
    refs = [r["pluginRef"] for prof in cfg["schedulingProfiles"] for r in prof["plugins"]]
    refs += [s["pluginRef"] for s in cfg["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in cfg["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= set(plugins), set(refs) - set(plugins)

    extractor = plugins["core-metrics-extractor"]["parameters"]
    engine = next(e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"])
    pod_labels = one("Deployment", "nextn")["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["llm-d.ai/engine-type"] == engine["name"]
    specs = {"TotalQueuedRequests": "queuedRequestsSpec", "TotalRunningRequests": "runningRequestsSpec",
             "KVCacheUtilization": "kvUsageSpec"}
    assert set(specs) == set(MODEL_SERVER_PROTOCOL)
    gauges = {f.name for f in ServingMetrics("m", 3).registry.collect() if f.type == "gauge"}
    for metric, key in specs.items():
        assert engine[key] == "nextn_" + MODEL_SERVER_PROTOCOL[metric] and engine[key] in gauges, metric
    scrape = plugins["metrics-data-source"]["parameters"]
    assert scrape["path"] == "/metrics" and scrape["scheme"] == "http"


# the parameters llm-d-router v0.10.0 decodes for the two prefix plugins (dataproducer/approximateprefix `config`,
# scorer/prefix `Config`); its decoder refuses unknown fields, so a typo here would stop the picker at startup
APPROX_PREFIX_PRODUCER = "approx-prefix-cache-producer"
APPROX_PREFIX_PARAMS = {"autoTune", "blockSizeTokens", "blockSize", "maxPrefixBlocksToMatch",
                        "maxPrefixTokensToMatch", "lruCapacityPerServer"}
PREFIX_SCORER_PARAMS = {"prefixMatchInfoProducerName", "matchLengthWeight", "matchLengthScaleTokens"}
MIN_PICKER_BLOCK = 64  # the producer clamps a smaller block size up to this


def profile_weights(cfg: dict, profile: str = "default") -> dict[str, float]:
    """{plugin name: weight} of the scorers the profile lists (a weight the config leaves out is 1.0)."""
    plugins = {p.get("name", p["type"]): p for p in cfg["plugins"]}
    (prof,) = [p for p in cfg["schedulingProfiles"] if p["name"] == profile]
    return {r["pluginRef"]: float(r.get("weight", 1.0)) for r in prof["plugins"]
            if plugins[r["pluginRef"]]["type"].endswith("-scorer")}


def test_endpoint_picker_scores_prefix_affinity():
    """The profile weighs a prefix-cache scorer, fed by an approximate prefix producer hashing nextn's grid blocks
    with the limits of the deployed pods."""
    cfg = epp_config()
    plugins = {p.get("name", p["type"]): p for p in cfg["plugins"]}
    scorers = [n for n, p in plugins.items() if p["type"] == "prefix-cache-scorer"]
    assert len(scorers) == 1, f"one prefix-cache-scorer in the picker's plugins, found {scorers}"
    weights = profile_weights(cfg)
    assert weights.get(scorers[0], 0) > 0, f"the default profile weighs the prefix-cache scorer: {weights}"
    scorer = plugins[scorers[0]].get("parameters", {})
    assert set(scorer) <= PREFIX_SCORER_PARAMS, set(scorer) - PREFIX_SCORER_PARAMS
    producer = plugins.get(scorer.get("prefixMatchInfoProducerName", APPROX_PREFIX_PRODUCER))
    assert producer is not None and producer["type"] == APPROX_PREFIX_PRODUCER, producer
    params = producer["parameters"]
    assert set(params) <= APPROX_PREFIX_PARAMS, set(params) - APPROX_PREFIX_PARAMS
    # nextn exports no block-size or block-count gauge for auto-tuning: the configured values must be used
    engine = plugins["core-metrics-extractor"]["parameters"]["engineConfigs"][0]
    assert not {"cacheInfoSpec", "cacheBlockSizeSpec", "cacheNumBlocksSpec"} & set(engine)
    assert params["autoTune"] is False
    # one picker block (its tokens: ~4 bytes each) per nextn grid block, above the picker's floor
    assert params["blockSizeTokens"] == PREFILL_GRID >= MIN_PICKER_BLOCK
    assert "blockSize" not in params and "maxPrefixBlocksToMatch" not in params  # the deprecated, character forms
    env = literal_env(container(one("Deployment", "nextn"), "nextn"))
    assert params["maxPrefixTokensToMatch"] == int(env[env_var("max_model_len")])
    assert isinstance(params["lruCapacityPerServer"], int) and params["lruCapacityPerServer"] > 0


def test_profile_weights_keep_affinity_below_a_full_pool():
    """The weighted sum the default profile computes (v0.10.0's scorers: queue min-max normalised across pods,
    1 - pool use, share of the prompt's blocks matched; the max-score picker takes the highest, a tie is no win)
    sends a prompt to the pod holding it at equal load and a few slots busier, and away from it once its pool is
    full or it queues."""
    cfg = epp_config()
    weights = profile_weights(cfg)
    types = {p.get("name", p["type"]): p["type"] for p in cfg["plugins"]}
    w = {types[n]: v for n, v in weights.items()}
    assert set(w) == {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"}, w
    env = literal_env(container(one("Deployment", "nextn"), "nextn"))
    slots = int(env[env_var("max_num_seqs")])

    def picked(pods: list[tuple[int, int, float]]) -> int | None:
        """Index of the pod picked among (waiting, slots held, prefix share) pods; None on a tie."""
        lo, hi = min(p[0] for p in pods), max(p[0] for p in pods)
        total = [w["queue-scorer"] * (1.0 if hi == lo else (hi - q) / (hi - lo))
                 + w["kv-cache-utilization-scorer"] * (1 - held / slots) + w["prefix-cache-scorer"] * share
                 for q, held, share in pods]
        best = max(total)
        return total.index(best) if total.count(best) == 1 else None

    holder_wins = {"equal load": [(0, 3, 1.0), (0, 3, 0.0)],
                   "equal load, half the prompt held": [(0, 3, 0.5), (0, 3, 0.0)],
                   "a few slots busier": [(0, 5, 1.0), (0, 1, 0.0)]}
    other_wins = {"its pool full, the other idle": [(0, slots, 1.0), (0, 0, 0.0)],
                  "it queues, the other does not": [(1, slots, 1.0), (0, slots, 0.0)],
                  "it queues, the other has a slot": [(2, slots, 1.0), (0, slots - 1, 0.0)]}
    for case, pods in holder_wins.items():
        assert picked(pods) == 0, (case, w)
    for case, pods in other_wins.items():
        assert picked(pods) == 1, (case, w)


# ------------------------------------------------------------------------------------------- the adapter's rule


def adapter_rule() -> dict:
    values = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    return rule


def test_hpa_asks_for_the_metric_the_adapter_serves():
    rule = adapter_rule()
    (metric,) = one("HorizontalPodAutoscaler", "nextn")["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert re.fullmatch(rule["name"]["matches"], "nextn_num_requests_waiting")
    assert rule["name"]["as"] == "nextn_" + MODEL_SERVER_PROTOCOL["TotalQueuedRequests"]
    # the labels a PodMonitor scrape carries name the pod and namespace the HPA asks about
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}


def test_adapter_promql_under_promtool(tmp_path: Path):
    """The adapter's queries, expanded as it expands them for `GET pods/*/nextn_num_requests_waiting` in the nextn
    namespace, run under `promtool test rules`: the series query finds nextn's pods, the metrics query gives each
    pod its gauge averaged over the last minute and ignores other namespaces."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus); tools/test.sh installs it")
    rule = adapter_rule()
    query = (rule["metricsQuery"].replace("<<.Series>>", "nextn_num_requests_waiting")
             .replace("<<.LabelMatchers>>", 'namespace="nextn",pod=~"nextn-a|nextn-b"')
             .replace("<<.GroupBy>>", "pod"))
    assert "<<" not in query, query
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": [
        {"record": "adapter:series", "expr": rule["seriesQuery"]},
        {"record": "adapter:metric", "expr": query}]}]}))
    series = 'nextn_num_requests_waiting{{namespace="{}",pod="{}",container="nextn"}}'
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": [
            {"series": series.format("nextn", "nextn-a"), "values": "0 2 4 6 8"},  # at 0, 15, 30, 45, 60 s
            {"series": series.format("nextn", "nextn-b"), "values": "1 1 1 1 1"},
            {"series": series.format("other", "nextn-a"), "values": "100 100 100 100 100"}],
            "promql_expr_test": [
                # at 70 s the last minute holds the samples at 15..60 s: a averages (2+4+6+8)/4
                {"expr": query, "eval_time": "70s", "exp_samples": [
                    {"labels": '{pod="nextn-a"}', "value": 5}, {"labels": '{pod="nextn-b"}', "value": 1}]},
                {"expr": "count(adapter:series)", "eval_time": "60s", "exp_samples": [
                    {"labels": "{}", "value": 3}]}]}]}))
    r = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, f"{shlex.join(r.args)}:\n{r.stdout}{r.stderr}"
