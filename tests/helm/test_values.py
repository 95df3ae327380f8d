"""values.yaml is documented and matches values.schema.json; the schema rejects bad values clearly."""

from __future__ import annotations

import json
import re
import subprocess

import helm_python
import pytest
import redis
import yaml

from tests.helm.conftest import objects_for
from tests.support.chart import CHART_DIR, render
from tests.support.servers import free_port, redis_binary, wait_for_port

VALUES = CHART_DIR / "values.yaml"
SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())


@pytest.fixture(scope="module")
def chart():
    with helm_python.Chart.load(str(CHART_DIR)) as c:
        yield c


@pytest.mark.parametrize("values, where, reason", [
    ({"api": {"replicas": -1}}, "/api/replicas", "minimum: got -1, want 0"),
    ({"tokenizer": {"replicas": -3}}, "/tokenizer/replicas", "minimum"),
    ({"generation": {"engine": "sglang"}}, "/generation/engine", "must be one of 'transformers', 'openai'"),
    ({"trainer": {"targetMode": "remote"}}, "/trainer/targetMode", "must be one of"),
    ({"trainer": {"gpus": 1.5}}, "/trainer/gpus", "want integer"),
    ({"tokenizer": {"processes": "all"}}, "/tokenizer/processes", "oneOf"),
    ({"redis": {"enabled": False}}, "/redis/external/url", "minLength"),
    ({"generation": {"engine": "openai"}}, "/generation/openai/baseUrl", "minLength"),
    ({"storage": {"url": "gs://bucket"}}, "/storage/url", "does not match pattern"),
    ({"api": {"replica": 3}}, "/api", "additional properties 'replica' not allowed"),
    ({"tokenizer": {"keda": {"maxReplicas": 0}}}, "/tokenizer/keda/maxReplicas", "minimum"),
])
def test_schema_rejects_bad_values_clearly(chart, values, where, reason):
    with pytest.raises(helm_python.HelmError) as err:
        chart.render(values, name="dflash", namespace="dflash")
    message = str(err.value)
    assert f"at '{where}'" in message, message
    assert reason in message, message


def test_defaults_and_profiles_satisfy_the_schema(chart):
    chart.validate_schema(chart.values)
    from tests.helm.profiles import PROFILES

    for values in PROFILES.values():
        chart.validate_schema(chart.merge_values(values))


def _leaf_paths(node, prefix=()):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaf_paths(v, (*prefix, k))
    else:
        yield prefix


def _schema_at(path):
    node = SCHEMA
    for key in path:
        if "$ref" in node:
            node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]]
        props = node.get("properties", {})
        if key in props:
            node = props[key]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def test_every_value_is_in_the_schema():
    values = yaml.safe_load(VALUES.read_text())
    missing = [".".join(p) for p in _leaf_paths(values) if _schema_at(p) is None]
    assert not missing, f"values without a schema entry: {missing}"


def test_every_value_has_a_comment():
    """Each setting in values.yaml has a comment line above it.

    A key without a comment may only be a section grouping documented settings; below a documented
    key, nested lines (a default list or map such as resources) belong to its value.
    """
    lines = [ln for ln in VALUES.read_text().splitlines() if ln.strip()]
    undocumented = []
    value_block_indent = None  # indent of a documented key whose nested lines are its default value
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if value_block_indent is not None:
            if indent > value_block_indent:
                continue
            value_block_indent = None
        m = re.match(r"^\s*([A-Za-z0-9_.-]+):(.*)$", line)
        if not m:
            continue
        key, rest = m.groups()
        has_children = rest.strip() == "" and i + 1 < len(lines) and (
            len(lines[i + 1]) - len(lines[i + 1].lstrip()) > indent or lines[i + 1].lstrip().startswith("-"))
        documented = i > 0 and lines[i - 1].strip().startswith("#")
        if documented and has_children and not lines[i + 1].strip().startswith("#"):
            value_block_indent = indent  # nested lines are its default value
        elif not documented and not has_children:
            undocumented.append(f"line {i + 1}: {key}")
    assert not undocumented, undocumented


def test_redis_config_is_durable_and_never_evicts(tmp_path):
    """The rendered redis.conf, run by a real redis-server: AOF on, noeviction, the memory cap applied."""
    text = render({"redis": {"maxmemory": "300mb"}})["dflash-pipeline/templates/redis-configmap.yaml"]
    conf = yaml.safe_load(text)["data"]["redis.conf"]
    (tmp_path / "redis.conf").write_text(conf)
    port = free_port()
    proc = subprocess.Popen([redis_binary(), str(tmp_path / "redis.conf"), "--port", str(port), "--dir", str(tmp_path),
                             "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port)
        r = redis.Redis(port=port, decode_responses=True)
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert int(r.config_get("maxmemory")["maxmemory"]) == 300 * 1024 * 1024
        assert r.config_get("save")["save"] == ""
        r.xadd("dfp:tasks:tokenize", {"k": "v"})
        r.close()
    finally:
        proc.terminate()
        proc.wait(10)
    assert any(tmp_path.rglob("appendonly.aof*")), "no append-only file written"


def test_redis_keeps_its_data_on_a_volume_claim():
    sts = next(o for o in objects_for("defaults") if o["kind"] == "StatefulSet")
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "data"
    mounts = sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "data", "mountPath": "/data"} in mounts


def test_api_keys_come_from_a_secret():
    for profile, secret in (("defaults", "dflash-api-keys"), ("gpu-keda", "dflash-api-keys")):
        objects = objects_for(profile)
        api = next(o for o in objects if o["metadata"]["name"] == "dflash-api" and o["kind"] == "Deployment")
        pod = api["spec"]["template"]["spec"]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        # a file of the mounted Secret (re-read when the Secret changes), holding the entries only
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
        volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
        assert volume["secret"]["secretName"] == secret
        assert volume["secret"]["items"] == [{"key": "api-keys", "path": "keys.json"}]
        assert env["DFLASH_API_KEYS"]["value"] == mount["mountPath"] + "/keys.json" and mount["readOnly"]
        made = [o for o in objects if o["kind"] == "Secret"]
        # the chart makes a Secret only when no existing one is named
        assert len(made) == (1 if profile == "defaults" else 0)


def test_generated_api_key_is_accepted_by_the_api():
    """The Secret the chart makes holds an admin key and a DFLASH_API_KEYS value the API parses and accepts."""
    import base64

    auth = pytest.importorskip("dfp_api.auth", reason="the api service's auth module does not exist yet")
    secret = next(o for o in objects_for("defaults") if o["kind"] == "Secret")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    ring = auth.KeyRing(auth.parse_keys(data["api-keys"]))
    principal = ring.authenticate(data["admin-key"])
    assert principal is not None and {"read", "write", "admin"} <= set(principal.scopes)
    assert ring.authenticate(data["admin-key"] + "x") is None



def test_docs_values_reference_lists_every_value():
    """The docs' values reference names every value of values.yaml with its current default."""
    section = (CHART_DIR.parents[1] / "docs" / "chart-values.md").read_text()
    rows = dict(re.findall(r"^\| `([^`]+)` \| `(.*?)` \|", section, flags=re.M))
    values = yaml.safe_load(VALUES.read_text())
    for path in _leaf_paths(values):
        # a row may document a whole default block (resources, tolerations): its nearest listed ancestor
        for cut in range(len(path), 0, -1):
            key = ".".join(path[:cut])
            if key in rows:
                node = values
                for k in path[:cut]:
                    node = node[k]
                assert json.loads(rows[key]) == node, f"README lists {key} = {rows[key]}, values.yaml has {node!r}"
                break
        else:
            raise AssertionError(f"README values reference misses {'.'.join(path)}")


def test_api_limits_are_chart_values_the_api_accepts():
    """Each per-key limit and the header limits are chart values, set on the API container as the settings
    they name, and the API starts with them (defaults and an operator's own)."""
    from dfp_api.settings import ApiSettings

    from tests.support.chart import render_workloads

    limits = {"ratePerSecond": 5, "burst": 20, "eventStreamsPerKey": 2, "eventStreamsPerProcess": 64,
              "activeJobsPerKey": 3, "headerBytes": 8192, "headers": 40}
    for values, want in (({}, {"max_streams_per_key": 8, "max_active_jobs_per_key": 50, "api_docs": False}),
                         ({"api": {"limits": limits, "docs": True}},
                          {"rate_limit_per_s": 5, "rate_limit_burst": 20, "max_streams_per_key": 2,
                           "max_event_streams": 64, "max_active_jobs_per_key": 3, "max_header_bytes": 8192,
                           "max_headers": 40, "api_docs": True})):
        api = next(w for w in render_workloads(values) if w["component"] == "api")
        env = {k[len("DFLASH_"):].lower(): v for k, v in api["containers"][0]["env"].items()
               if k.startswith("DFLASH_") and k[len("DFLASH_"):].lower() in ApiSettings.model_fields
               and k != "DFLASH_API_KEYS"}
        settings = ApiSettings(**env, api_keys=None, auth_disabled=True)
        for name, value in want.items():
            assert getattr(settings, name) == value, name


def test_api_limits_schema_rejects_bad_values():
    with helm_python.Chart.load(str(CHART_DIR)) as chart, pytest.raises(helm_python.HelmError) as err:
        chart.render({"api": {"limits": {"eventStreamsPerKey": -1}}}, name="dflash", namespace="dflash")
    assert "/api/limits/eventStreamsPerKey" in str(err.value)
