"""Cross-checks between the rendered chart and the code it runs.

Every container command is a real subcommand of the project's CLI; every setting a service
requires is set, and every DFLASH_* variable the chart sets is one the service reads; Service
ports and probes point at ports the containers open; GPU workloads request GPUs, CPU ones don't.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import pytest

from tests.helm.conftest import objects_for
from tests.helm.profiles import PROFILES
from tests.support.chart import workloads_from_objects
from tests.support.cli import cli_cmd, cli_env
from tests.support.servers import free_port

SERVICES = ("api", "generation", "tokenizer", "target", "trainer", "capture")
GPU_COMPONENTS = {"generation", "target", "trainer"}
# DFLASH_* variables read outside the service settings classes
SHARED_VARS = {
    "DFLASH_REDIS_PASSWORD",  # only expanded into DFLASH_REDIS_URL by the kubelet
    "DFLASH_CACHE_DIR",  # dfp_shared.models.tokenizer_assets.default_cache_dir
}


def project_containers(workloads):
    """(workload, container) pairs that run the project's CLI."""
    for w in workloads:
        for c in w["containers"]:
            if c["command"] == ["dflash-pipeline"]:
                yield w, c


@cache
def settings_class(service: str):
    """The service's settings class, or None while ``dfp_<service>/settings.py`` does not exist yet."""
    from dfp_shared.config import CommonSettings

    try:
        module = importlib.import_module(f"dfp_{service}.settings")
    except ModuleNotFoundError as exc:
        if exc.name in (f"dfp_{service}.settings",):
            return None
        raise
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if issubclass(c, CommonSettings) and c is not CommonSettings and c.__module__ == module.__name__]
    assert len(classes) == 1, f"dfp_{service}.settings should define one settings class, found {classes}"
    return classes[0]


def env_names(cls) -> dict[str, bool]:
    """DFLASH_* variable -> required, for every field of a settings class."""
    prefix = cls.model_config.get("env_prefix", "")
    out = {}
    for name, field in cls.model_fields.items():
        alias = field.validation_alias if isinstance(field.validation_alias, str) else None
        out[(alias or f"{prefix}{name}").upper()] = field.is_required()
    return out


def _help(args: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(cli_cmd(*args, "--help"), env=cli_env(), capture_output=True, text=True, timeout=120)


def _split_args(args: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """Subcommand path and the option names that follow it."""
    path = []
    for a in args:
        if a.startswith("-"):
            break
        path.append(a)
    return tuple(path), [a.split("=")[0] for a in args[len(path):] if a.startswith("--")]


def _all_commands():
    found = {}
    for p in PROFILES:
        for _, c in project_containers(workloads_from_objects(objects_for(p))):
            path, options = _split_args(c["args"])
            found.setdefault(path, set()).update(options)
    return found


def test_container_commands_are_real_cli_subcommands():
    commands = _all_commands()
    assert {p[0] for p in commands} == set(SERVICES), commands
    landed = {p: opts for p, opts in commands.items() if settings_class(p[0]) is not None}
    pending = sorted(set(commands) - set(landed))
    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(landed, pool.map(_help, landed), strict=True))
    for path, result in results.items():
        assert result.returncode == 0, f"`dflash-pipeline {' '.join(path)} --help` failed:\n{result.stderr[-2000:]}"
        assert "unavailable" not in result.stdout, result.stdout
        assert "Usage:" in result.stdout and " ".join(path) in result.stdout, result.stdout
        for option in landed[path]:
            assert option in result.stdout, f"`dflash-pipeline {' '.join(path)}` has no option {option}"
    if pending:
        pytest.skip(f"services whose settings module does not exist yet: {pending}")


def test_settings_the_services_require_are_set(workloads):
    checked = 0
    for w, c in project_containers(workloads):
        cls = settings_class(c["args"][0])
        if cls is None:
            continue
        given = set(c["env"]) | set(c["env_refs"])
        missing = [name for name, required in env_names(cls).items() if required and name not in given]
        assert not missing, f"{w['name']}/{c['name']} lacks required settings {missing}"
        checked += 1
    if not checked:
        pytest.skip("no service settings module exists yet")


def test_every_dflash_variable_the_chart_sets_is_read(workloads):
    checked = 0
    for w, c in project_containers(workloads):
        cls = settings_class(c["args"][0])
        if cls is None:
            continue
        known = set(env_names(cls)) | SHARED_VARS
        unknown = sorted(v for v in set(c["env"]) | set(c["env_refs"]) if v.startswith("DFLASH_") and v not in known)
        assert not unknown, f"{w['name']}/{c['name']} sets {unknown}, which {cls.__name__} does not read"
        checked += 1
    if not checked:
        pytest.skip("no service settings module exists yet")


def test_common_settings_are_set_for_every_service(workloads):
    for w, c in project_containers(workloads):
        for name in ("DFLASH_REDIS_URL", "DFLASH_STORAGE_URL", "DFLASH_LOG_LEVEL"):
            assert name in c["env"], (w["name"], c["name"], name)
        assert c["env"]["DFLASH_REDIS_URL"].startswith(("redis://", "rediss://"))
        if c["args"][:2] not in (["api", "serve"], ["capture", "serve"]):  # /metrics on their own HTTP port
            port = int(c["env"]["DFLASH_METRICS_PORT"])
            assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"], (w["name"], c)


def _pods(objects):
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o, o["spec"]["template"]
        elif o["kind"] == "Pod":
            yield o, o


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_service_ports_match_container_ports(objects):
    for svc in (o for o in objects if o["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        backends = [t for o, t in _pods(objects) if o["kind"] != "Pod" and _matches(selector, t["metadata"]["labels"])]
        assert backends, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for tmpl in backends:
                ports = [p for c in tmpl["spec"]["containers"] for p in c.get("ports", [])]
                assert any(p.get("name") == target or p["containerPort"] == target for p in ports), (
                    f"Service {svc['metadata']['name']} port {port['name']} -> {target} is not a container port")


def _probe_port(probe: dict, container: dict) -> int:
    kind = next(k for k in ("httpGet", "grpc", "tcpSocket", "exec") if k in probe)
    if kind == "exec":
        return -1
    port = probe[kind]["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
    assert port in [p["containerPort"] for p in container["ports"]], (container["name"], probe)
    return port


def test_probes_point_at_real_endpoints(objects):
    for o, tmpl in _pods(objects):
        if o["kind"] == "Pod":
            continue
        for c in tmpl["spec"]["containers"]:
            for kind in ("livenessProbe", "readinessProbe"):
                assert kind in c, f"{o['metadata']['name']}/{c['name']} has no {kind}"
            args = c.get("args", [])
            probes = [c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c]
            if c.get("command") == ["dflash-pipeline"] and args[:2] == ["api", "serve"]:
                assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
                assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
                port = _probe_port(c["readinessProbe"], c)
                assert str(port) == next(e["value"] for e in c["env"] if e["name"] == "DFLASH_PORT")
            elif c.get("command") == ["dflash-pipeline"] and args[:2] == ["capture", "serve"]:
                assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
                assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
                port = _probe_port(c["readinessProbe"], c)
                assert str(port) == next(e["value"] for e in c["env"] if e["name"] == "DFLASH_CAPTURE_PORT")
            elif c.get("command") == ["dflash-pipeline"] and args[:2] == ["target", "serve"]:
                for p in probes:
                    assert "grpc" in p and _probe_port(p, c) == next(
                        x["containerPort"] for x in c["ports"] if x["name"] == "grpc")
            elif c.get("command") == ["dflash-pipeline"]:
                metrics_port = int(next(e["value"] for e in c["env"] if e["name"] == "DFLASH_METRICS_PORT"))
                for p in probes:
                    assert p["httpGet"]["path"] == "/metrics" and _probe_port(p, c) == metrics_port
            else:  # redis, vLLM
                for p in probes:
                    _probe_port(p, c)


def test_api_probe_paths_are_routes():
    routes = pytest.importorskip("dfp_api.routes", reason="the api service's routes do not exist yet")
    paths = {r.path for r in routes.health.routes}
    assert {"/healthz", "/readyz", "/metrics"} <= paths, paths


def test_target_serves_the_standard_grpc_health_service():
    """Kubernetes' grpc probe calls grpc.health.v1.Health/Check with an empty service name."""
    server = pytest.importorskip("dfp_target.server", reason="the target service does not exist yet")
    source = inspect.getsource(server)
    assert "add_HealthServicer_to_server" in source and '"", SERVICE' in source


def test_worker_probe_path_is_served():
    """The workers' probes GET /metrics on DFLASH_METRICS_PORT: the shared metrics server answers it."""
    from dfp_shared.metrics import start_metrics_server

    port = start_metrics_server(free_port(), addr="127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert b"# HELP" in resp.read()


def _gpu_counts(tmpl: dict) -> dict[str, int]:
    out = {}
    for c in tmpl["spec"]["containers"]:
        res = c.get("resources", {})
        req = res.get("requests", {}).get("nvidia.com/gpu")
        lim = res.get("limits", {}).get("nvidia.com/gpu")
        assert req == lim, f"{c['name']}: GPU requests {req} != limits {lim}"
        out[c["name"]] = int(req or 0)
    return out


def _needs_gpu(values: dict, component: str) -> bool:
    """Whether the values put this component on GPUs (generation against an external server does not)."""
    if not values.get("gpu", {}).get("enabled", True) or component not in GPU_COMPONENTS:
        return False
    if component == "generation":
        gen = values.get("generation", {})
        return gen.get("engine", "transformers") == "transformers" or gen.get("vllm", {}).get("enabled", False)
    return True


def test_gpu_workloads_request_gpus_and_cpu_ones_do_not(profile, objects):
    for o, tmpl in _pods(objects):
        component = o["metadata"]["labels"].get("app.kubernetes.io/component")
        gpus = _gpu_counts(tmpl)
        spec = tmpl["spec"]
        if _needs_gpu(PROFILES[profile], component):
            assert sum(gpus.values()) >= 1, f"{o['metadata']['name']} requests no GPU"
            assert any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])), o["metadata"]["name"]
            assert "cuda" in spec["containers"][0]["image"]
        else:
            assert sum(gpus.values()) == 0, f"{o['metadata']['name']} ({component}) requests GPUs: {gpus}"
            assert "runtimeClassName" not in spec
            assert "cuda" not in " ".join(c["image"] for c in spec["containers"])


def test_gpu_counts_follow_the_values():
    by_name = {o["metadata"]["name"]: _gpu_counts(o["spec"]["template"])
               for o in objects_for("gpu-keda") if o["kind"] == "Deployment"}
    assert by_name["dflash-trainer"] == {"trainer": 8}  # disaggregated: no sidecar
    assert by_name["dflash-target"] == {"target": 2}
    assert by_name["dflash-generation"] == {"generation": 0, "vllm": 1}  # the sidecar holds the GPU
    defaults = {o["metadata"]["name"]: _gpu_counts(o["spec"]["template"])
                for o in objects_for("defaults") if o["kind"] == "Deployment"}
    assert defaults["dflash-trainer"] == {"trainer": 7, "target": 1}  # colocated target sidecar
    assert defaults["dflash-generation"] == {"generation": 1}


def test_trainer_reaches_its_target():
    for profile, expect in (("defaults", "127.0.0.1:50051"), ("cpu-small", "inprocess"),
                            ("gpu-keda", "dns:///dflash-target-headless.dflash.svc:50051")):
        objects = objects_for(profile)
        trainer = next(w for w in workloads_from_objects(objects) if w["component"] == "trainer")
        env = trainer["containers"][0]["env"]
        assert env["DFLASH_TARGET_URL"] == expect, profile
        assert int(env["DFLASH_NPROC_PER_NODE"]) == max(
            1, PROFILES[profile].get("trainer", {}).get("gpus", 7) if PROFILES[profile].get("gpu", {}).get("enabled", True) else 1)
        if profile == "defaults":  # the sidecar serves on the port the trainer dials, sharing /dev/shm
            sidecar = trainer["containers"][1]
            assert sidecar["args"] == ["target", "serve"]
            assert {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in sidecar["ports"]
            assert sidecar["env"]["DFLASH_METRICS_PORT"] != env["DFLASH_METRICS_PORT"]
            pod = next(o for o in objects if o["metadata"]["name"] == "dflash-trainer")["spec"]["template"]["spec"]
            shm = next(v for v in pod["volumes"] if v["name"] == "shm")
            assert shm["emptyDir"]["medium"] == "Memory"
            for c in pod["containers"]:
                assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        if profile == "gpu-keda":
            headless = next(o for o in objects if o["metadata"]["name"] == "dflash-target-headless")
            assert headless["spec"]["clusterIP"] == "None"


def test_scheduling_values_reach_the_pods():
    objects = {o["metadata"]["name"]: o for o in objects_for("tolerations-runtimeclass") if o["kind"] in ("Deployment", "StatefulSet")}
    spec = {n: o["spec"]["template"]["spec"] for n, o in objects.items()}
    assert spec["dflash-generation"]["runtimeClassName"] == "nvidia"
    assert spec["dflash-target"]["runtimeClassName"] == "nvidia"
    assert spec["dflash-trainer"]["runtimeClassName"] == "nvidia-cdi"
    assert "runtimeClassName" not in spec["dflash-api"]
    assert spec["dflash-generation"]["nodeSelector"] == {"kubernetes.io/os": "linux", "nvidia.com/gpu.present": "true"}
    assert spec["dflash-trainer"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert spec["dflash-api"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert [t["key"] for t in spec["dflash-generation"]["tolerations"]] == ["nvidia.com/gpu", "gpu-pool"]
    assert [t["key"] for t in spec["dflash-trainer"]["tolerations"]] == ["nvidia.com/gpu", "training"]
    assert [t["key"] for t in spec["dflash-tokenizer"]["tolerations"]] == ["spot"]
    assert [t["key"] for t in spec["dflash-api"]["tolerations"]] == ["dedicated"]
    assert "podAntiAffinity" in spec["dflash-target"]["affinity"]


def test_pods_run_hardened(objects):
    for o, tmpl in _pods(objects):
        spec = tmpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, o["metadata"]["name"]
        assert spec.get("automountServiceAccountToken") is False
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            if c.get("command") == ["dflash-pipeline"]:
                assert {"/tmp", "/cache"} <= mounts, (o["metadata"]["name"], c["name"])


def test_disruption_budgets_and_grace_periods(objects):
    workloads = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
        assert any(_matches(pdb["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
                   for w in workloads.values()), pdb["metadata"]["name"]
    assert workloads["dflash-tokenizer"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 300
    assert workloads["dflash-trainer"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 300


def test_network_policies_admit_only_the_release(objects):
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    release = {"app.kubernetes.io/name": "dflash-pipeline", "app.kubernetes.io/instance": "dflash"}
    for name, port in (("dflash-redis", 6379), ("dflash-target", 50051)):
        if name not in policies:
            continue
        rule = next(r for r in policies[name]["spec"]["ingress"] if any(p["port"] == port for p in r["ports"]))
        assert rule["from"][0] == {"podSelector": {"matchLabels": release}}
        # every project pod carries the release labels the policy admits
        for o, tmpl in _pods(objects):
            assert _matches(release, tmpl["metadata"]["labels"]), o["metadata"]["name"]


def test_scaled_objects_read_the_workers_stream(objects):
    from dfp_shared.jobs.queue import GROUP, stream_name

    scaled = [o for o in objects if o["kind"] == "ScaledObject"]
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    workloads = {w["name"]: w for w in workloads_from_objects(objects)}
    for so in scaled:
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target in deployments
        assert "replicas" not in deployments[target]["spec"], "KEDA owns the replica count"
        container = next(c for c in workloads[target]["containers"] if c["name"] == so["spec"]["scaleTargetRef"]["envSourceContainerName"])
        meta = so["spec"]["triggers"][0]["metadata"]
        kind = {"tokenizer": "tokenize", "generation": "generate"}[workloads[target]["component"]]
        assert meta["stream"] == stream_name(kind) and meta["consumerGroup"] == GROUP
        # the scaler dials the same Redis the workers use
        url = container["env"]["DFLASH_REDIS_URL"]
        assert url.split("@")[-1].split("://")[-1].split("/")[0] == meta["address"]
        assert meta["databaseIndex"] == url.rsplit("/", 1)[1]
        assert meta["enableTLS"] == ("true" if url.startswith("rediss://") else "false")
        if "passwordFromEnv" in meta:
            assert meta["passwordFromEnv"] in container["env_refs"]


@pytest.mark.parametrize("tokenizer, expect", [
    ({}, "4"),  # the default request: 4 CPUs
    ({"resources": {"requests": {"cpu": "3500m"}, "limits": {"cpu": "4"}}}, "4"),
    ({"resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "1"}}}, "1"),
    ({"resources": {"requests": {"cpu": "2.5"}, "limits": {"cpu": "3"}}}, "3"),
    ({"processes": 6}, "6"),
])
def test_tokenizer_runs_one_process_per_requested_cpu(tokenizer, expect):
    """A container sees all of its node's cores, so "auto" becomes the pod's CPU request, rounded up."""
    from tests.support.chart import render_workloads

    pool = next(w for w in render_workloads({"tokenizer": tokenizer}) if w["component"] == "tokenizer")
    args = pool["containers"][0]["args"]
    assert args[:3] == ["tokenizer", "worker", "--processes"] and args[3] == expect


def test_helm_test_pod_checks_readyz():
    """The `helm test` pod's script, run here against a real HTTP server: passes on 200, fails when nothing answers."""
    import http.server
    import sys
    import threading

    pod = next(o for o in objects_for("defaults") if o["kind"] == "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    script, url, timeout = container["args"]
    assert container["command"] == ["python", "-c"]
    assert url == "http://dflash-api.dflash.svc:80/readyz" and float(timeout) > 0

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/readyz" else 404)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        ok = subprocess.run([sys.executable, "-c", script, f"http://127.0.0.1:{port}/readyz", "10"],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        missing = subprocess.run([sys.executable, "-c", script, f"http://127.0.0.1:{port}/nope", "1"],
                                 capture_output=True, text=True, timeout=60)
        assert missing.returncode == 1, missing.stdout
    finally:
        server.shutdown()
    closed = subprocess.run([sys.executable, "-c", script, f"http://127.0.0.1:{free_port()}/readyz", "1"],
                            capture_output=True, text=True, timeout=60)
    assert closed.returncode == 1 and "not ready" in closed.stdout
