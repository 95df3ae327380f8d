"""Render the project's Helm chart offline (real Helm through helm-python-sdk) and read it back.

``render_objects(values)`` gives every rendered Kubernetes object; ``render_workloads(values)``
gives each Deployment / StatefulSet as a plain description of the processes it would start
(name, replicas, and per container its command, args, literal env and ports), which lets a test
run the same commands as local processes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "dflash-pipeline"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def render(values: dict | None = None, *, release: str = "dflash", namespace: str = "dflash") -> dict[str, str]:
    """Template path -> rendered text, as ``helm template`` would produce (schema checked first)."""
    import helm_python

    with helm_python.Chart.load(str(CHART_DIR)) as chart:
        chart.validate_schema(chart.merge_values(values or {}))
        return chart.render(values or {}, name=release, namespace=namespace, is_install=True)


def render_objects(values: dict | None = None, *, release: str = "dflash", namespace: str = "dflash",
                   include_tests: bool = True) -> list[dict]:
    """Every Kubernetes object of the release (NOTES.txt left out), each tagged with its template in
    ``obj["__template__"]`` removed again by :func:`strip_template`."""
    objects = []
    for path, text in sorted(render(values, release=release, namespace=namespace).items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        if not include_tests and "/templates/tests/" in path:
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template__"] = path
                objects.append(doc)
    return objects


def strip_template(obj: dict) -> dict:
    """The object without the ``__template__`` tag."""
    return {k: v for k, v in obj.items() if k != "__template__"}


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known variables are substituted, unknown ones left as written."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def _container(spec: dict, config_maps: dict[str, dict]) -> dict[str, Any]:
    env: dict[str, str] = {}
    env_refs: dict[str, dict] = {}
    for source in spec.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref and ref["name"] in config_maps:
            env.update({k: str(v) for k, v in config_maps[ref["name"]].items()})
        elif ref or source.get("secretRef"):
            env_refs[f"<envFrom:{(ref or source['secretRef'])['name']}>"] = source
    for item in spec.get("env", []):
        if "valueFrom" in item:
            env_refs[item["name"]] = item["valueFrom"]
            env.pop(item["name"], None)
        else:
            env[item["name"]] = _expand(str(item.get("value", "")), env)
    return {
        "name": spec["name"],
        "image": spec.get("image"),
        "command": list(spec.get("command", [])),
        "args": [_expand(str(a), env) for a in spec.get("args", [])],
        "env": env,
        "env_refs": env_refs,
        "ports": [{"name": p.get("name"), "containerPort": p["containerPort"], "protocol": p.get("protocol", "TCP")}
                  for p in spec.get("ports", [])],
    }


def workloads_from_objects(objects: list[dict]) -> list[dict]:
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    out = []
    for obj in objects:
        if obj["kind"] not in WORKLOAD_KINDS:
            continue
        pod = obj["spec"]["template"]["spec"]
        out.append({
            "name": obj["metadata"]["name"],
            "kind": obj["kind"],
            "component": obj["metadata"].get("labels", {}).get("app.kubernetes.io/component"),
            "replicas": obj["spec"].get("replicas"),
            "containers": [_container(c, config_maps) for c in pod.get("containers", [])],
        })
    return out


def render_workloads(values: dict | None = None, *, release: str = "dflash", namespace: str = "dflash") -> list[dict]:
    """Deployments and StatefulSets as ``{name, kind, component, replicas, containers: [{name, image,
    command, args, env, env_refs, ports}]}``.

    ``env`` holds literal values (the shared ConfigMap merged in, ``$(VAR)`` references expanded);
    values that come from Secrets or the downward API are listed in ``env_refs`` instead.
    ``replicas`` is None where an autoscaler (KEDA) owns the count.
    """
    return workloads_from_objects(render_objects(values, release=release, namespace=namespace))


def local_argv(container: dict, python: str | None = None) -> list[str]:
    """The container's command as a local process: ``dflash-pipeline ...`` -> ``python -m dfp_cli.main ...``."""
    import sys

    command = container["command"]
    if command[:1] == ["dflash-pipeline"]:
        command = [python or sys.executable, "-m", "dfp_cli.main", *command[1:]]
    return [*command, *container["args"]]
