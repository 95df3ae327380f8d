"""Run the Helm chart's workloads as local processes: a cluster without Kubernetes.

Each Deployment and StatefulSet of the rendered chart becomes ``replicas`` local processes per
container, with the container's own command, args and environment. What Kubernetes would
provide is provided locally and nothing else is changed:

* **Services** → loopback ports: every Service port gets a free local port; the Service's DNS
  names (``name``, ``name.ns``, ``name.ns.svc[.cluster.local]``) in env values and args become
  ``127.0.0.1:<port>``, and the pod serving it listens there (its port setting, given in env or
  args as the container port, is rewritten to the local port).
* **Volumes** → per-pod directories: every volume mount except ``/dev/shm`` maps to a private
  directory (ConfigMap and Secret volumes get their files), and paths under a mount point are rewritten.
* **Secrets** → values the test supplies (or the Secret rendered by the chart itself).
* Scaling a Deployment (``kubectl scale``) starts more processes of the same rendered spec.
* **StatefulSet pods** are named ``<workload>-<index>``, with their ordinal as the
  ``apps.kubernetes.io/pod-index`` label; the DNS name of pod 0 behind a headless Service
  (``<workload>-0.<service>``) is the Service's loopback port.

With ``containers=Containers(...)`` the project's containers run from their images under podman
instead (host network, so the loopback ports stay the same): as the pod's securityContext says
(user, group, fsGroup, read-only root filesystem, capabilities dropped, no privilege escalation),
with only the chart's environment (nothing of this process's) and every volume bind-mounted at its
mount path (``/dev/shm`` as the container's own shared memory). Other containers (Redis) stay local
processes.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dfp_dev.local.processes import ProcessGroup
from dfp_dev.local.redis_server import free_port

KEEP_MOUNTS = ("/dev/shm",)


@dataclass
class Pod:
    workload: str
    index: int
    containers: list[str] = field(default_factory=list)  # process names
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> local port


@dataclass
class Containers:
    """Run the containers whose image is in ``images`` (the chart's reference -> a local image) with podman."""

    images: dict[str, str]
    podman: str = "podman"
    runtime: str = "runc"  # crun cannot set RLIMIT_NPROC on some hosts and rejects hybrid cgroup layouts
    ulimits: tuple[str, ...] = ("nofile=20000", "nproc=32768")
    shm_size: str = "2g"
    names: list[str] = field(default_factory=list)  # every container started, removed by :meth:`remove_all`

    def argv(self, name: str, pod_spec: dict, container: dict, env: dict[str, str], mounts: dict[str, Path],
             args: list[str], read_only: frozenset[str] = frozenset()) -> list[str]:
        pod_sc, sc = pod_spec.get("securityContext") or {}, container.get("securityContext") or {}
        user, group = sc.get("runAsUser", pod_sc.get("runAsUser")), sc.get("runAsGroup", pod_sc.get("runAsGroup"))
        argv = [self.podman, "--runtime", self.runtime, "run", "--rm", "--replace", "--name", name,
                "--network", "host", "--shm-size", self.shm_size, "--read-only-tmpfs=false", "--pull", "never",
                *[f"--ulimit={u}" for u in self.ulimits]]
        if user is not None:
            argv += ["--user", f"{user}:{group if group is not None else user}"]
        if pod_sc.get("fsGroup") is not None:
            argv += ["--group-add", str(pod_sc["fsGroup"])]
        if sc.get("readOnlyRootFilesystem"):
            argv.append("--read-only")
        for cap in (sc.get("capabilities") or {}).get("drop", []):
            argv += ["--cap-drop", cap.lower()]
        if sc.get("allowPrivilegeEscalation") is False:
            argv += ["--security-opt", "no-new-privileges"]
        read_only = read_only | {m["mountPath"].rstrip("/") for m in container.get("volumeMounts", []) if m.get("readOnly")}
        for path, local in mounts.items():
            argv += ["--volume", f"{local}:{path}:{'ro' if path in read_only else 'rw'}"]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        if container.get("command"):
            argv += ["--entrypoint", json.dumps(container["command"])]
        self.names.append(name)
        return [*argv, self.images[container["image"]], *args]

    def remove_all(self) -> None:
        """Remove every container still there (a SIGKILLed ``podman run`` leaves its container running)."""
        if self.names:
            subprocess.run([self.podman, "rm", "--force", "--ignore", "--time", "5", *set(self.names)],
                           capture_output=True, timeout=120)


class LocalCluster:
    def __init__(self, objects: list[dict], workdir: Path, secrets: dict[str, dict[str, str]] | None = None,
                 python: str | None = None, base_env: dict | None = None, containers: Containers | None = None):
        self.objects = objects
        self.containers = containers
        self.workdir = Path(workdir)
        self.python = python or sys.executable
        self.base_env = dict(base_env or os.environ)
        self.secrets = {name: dict(data) for name, data in (secrets or {}).items()}
        for obj in objects:  # Secrets the chart renders itself
            if obj["kind"] == "Secret":
                data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
                data.update(obj.get("stringData") or {})
                self.secrets.setdefault(obj["metadata"]["name"], {}).update(data)
        self.config_maps = {o["metadata"]["name"]: o.get("data") or {} for o in objects if o["kind"] == "ConfigMap"}
        self.workloads = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
        self.group = ProcessGroup(self.workdir / "logs")
        self.pods: dict[str, list[Pod]] = {}
        self.service_ports: dict[tuple[str, int], int] = {}  # (service name, port) -> local port
        self.target_ports: dict[tuple[str, int], int] = {}  # (workload, containerPort) -> local port
        self._map_services()

    # services

    def _map_services(self) -> None:
        for svc in (o for o in self.objects if o["kind"] == "Service"):
            selector = svc["spec"].get("selector") or {}
            workload = next((name for name, w in self.workloads.items()
                             if selector and all(w["spec"]["template"]["metadata"].get("labels", {}).get(k) == v
                                                 for k, v in selector.items())), None)
            for port in svc["spec"].get("ports", []):
                target = self._container_port(workload, port.get("targetPort", port["port"])) if workload else None
                key = (workload, target)
                local = self.target_ports.get(key) or free_port()
                if workload:
                    self.target_ports[key] = local
                self.service_ports[(svc["metadata"]["name"], port["port"])] = local

    def _container_port(self, workload: str, target) -> int:
        if isinstance(target, int):
            return target
        for c in self.workloads[workload]["spec"]["template"]["spec"]["containers"]:
            for p in c.get("ports", []):
                if p.get("name") == target:
                    return p["containerPort"]
        raise KeyError(f"{workload} has no port named {target}")

    def service_url(self, service: str, port: int, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.service_ports[(service, port)]}"

    def _rewrite_hosts(self, value: str) -> str:
        for (name, port), local in self.service_ports.items():
            pattern = rf"\b([a-z0-9-]+-0\.)?{re.escape(name)}(\.[a-z0-9-]+(\.svc(\.cluster\.local)?)?)?:{port}\b"
            value = re.sub(pattern, f"127.0.0.1:{local}", value)
        return value

    # pods

    def _env(self, container: dict, pod_name: str = "local-pod", index: int = 0) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                env.update({k: str(v) for k, v in self.config_maps[source["configMapRef"]["name"]].items()})
            if "secretRef" in source:
                env.update(self.secrets.get(source["secretRef"]["name"], {}))
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                           lambda m: env.get(m.group(1), m.group(0)), str(item["value"]))
            elif "secretKeyRef" in item.get("valueFrom", {}):
                ref = item["valueFrom"]["secretKeyRef"]
                if ref["name"] in self.secrets and ref["key"] in self.secrets[ref["name"]]:
                    env[item["name"]] = self.secrets[ref["name"]][ref["key"]]
                elif not ref.get("optional"):
                    raise KeyError(f"{container['name']}: secret {ref['name']}/{ref['key']} not provided")
            elif "fieldRef" in item.get("valueFrom", {}):
                env[item["name"]] = {"metadata.name": pod_name, "metadata.namespace": "local",
                                     "metadata.labels['apps.kubernetes.io/pod-index']": str(index),
                                     "status.podIP": "127.0.0.1"}.get(item["valueFrom"]["fieldRef"]["fieldPath"], "")
        return env

    def _mounts(self, pod_spec: dict, container: dict, pod_dir: Path, owner: tuple[int, int] | None = None
                ) -> dict[str, Path]:
        volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        mounts = {}
        for m in container.get("volumeMounts", []):
            if m["mountPath"] in KEEP_MOUNTS:
                continue
            local = pod_dir / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if owner:  # the pod's user (fsGroup) owns its volumes, as the kubelet arranges
                if os.geteuid() == 0:
                    os.chown(local, *owner)
                local.chmod(0o775 if os.geteuid() == 0 else 0o777)
            volume = volumes.get(m["name"], {})
            if "configMap" in volume:
                for key, text in self.config_maps.get(volume["configMap"]["name"], {}).items():
                    (local / key).write_text(text)
            elif "secret" in volume:
                data = self.secrets.get(volume["secret"]["secretName"], {})
                for item in volume["secret"].get("items") or [{"key": k, "path": k} for k in data]:
                    if item["key"] in data:
                        (local / item["path"]).write_text(data[item["key"]])
            mounts[m["mountPath"].rstrip("/")] = local
        return mounts

    def _localise(self, value: str, mounts: dict[str, Path], port_map: dict[int, int]) -> str:
        value = self._rewrite_hosts(value)
        for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if value == mount or value.startswith(mount + "/"):
                return str(local) + value[len(mount):]
        if value.isdigit() and int(value) in port_map:
            return str(port_map[int(value)])
        return value

    def start(self, workload: str, replicas: int | None = None, extra_env: dict | None = None) -> list[Pod]:
        """Start the workload's pods (``replicas`` from the chart unless given)."""
        obj = self.workloads[workload]
        count = replicas if replicas is not None else (obj["spec"].get("replicas") or 1)
        pods = self.pods.setdefault(workload, [])
        while len(pods) < count:
            pods.append(self._start_pod(workload, len(pods), extra_env or {}))
        return pods

    def scale(self, workload: str, replicas: int, extra_env: dict | None = None) -> list[Pod]:
        """``kubectl scale``: more processes of the same spec, or the newest ones stopped."""
        pods = self.pods.setdefault(workload, [])
        while len(pods) > replicas:
            for name in pods.pop().containers:
                self.group.kill(name, 15)
        return self.start(workload, replicas, extra_env)

    def _start_pod(self, workload: str, index: int, extra_env: dict) -> Pod:
        pod_spec = self.workloads[workload]["spec"]["template"]["spec"]
        pod = Pod(workload, index)
        pod_dir = self.workdir / "pods" / f"{workload}-{index}"
        # the first pod serves the Service ports; further replicas get ports of their own
        port_map = {cp: (local if index == 0 else free_port()) for (w, cp), local in self.target_ports.items()
                    if w == workload}
        for c in pod_spec["containers"]:
            for p in c.get("ports", []):
                port_map.setdefault(p["containerPort"], free_port())
        pod.ports = port_map
        for c in pod_spec["containers"]:
            name = f"{workload}-{index}-{c['name']}"
            argv, env = self._command(name, f"{workload}-{index}", pod_spec, c, pod_dir, index, port_map, extra_env)
            self.group.start(name, argv, env, cwd=str(pod_dir))
            pod.containers.append(name)
        return pod

    def _command(self, name: str, pod_name: str, pod_spec: dict, c: dict, pod_dir: Path, index: int,
                 port_map: dict[int, int], extra_env: dict, drop_env: tuple[str, ...] = (),
                 host_folders: dict[str, Path] | None = None) -> tuple[list[str], dict]:
        """The argv and environment that run container ``c`` of a pod (a process, or podman running its image);
        ``host_folders`` (mount path -> folder here) are mounted read-only besides the pod's volumes."""
        rendered = {k: v for k, v in self._env(c, pod_name, index).items() if k not in drop_env}
        host_folders = host_folders or {}
        if self.containers and c["image"] in self.containers.images:
            sc = pod_spec.get("securityContext") or {}
            owner = (sc.get("runAsUser", 0), sc.get("fsGroup", sc.get("runAsGroup", 0)))
            mounts = {**self._mounts(pod_spec, c, pod_dir / c["name"], owner), **host_folders}
            # paths stay as the chart wrote them (the volumes are mounted there); hosts and ports are local
            env = {k: self._localise(v, {}, port_map) for k, v in rendered.items()}
            args = [self._localise(str(a), {}, port_map) for a in c.get("args", [])]
            return self.containers.argv(name, pod_spec, c, {**env, **extra_env}, mounts, args,
                                        read_only=frozenset(host_folders)), dict(os.environ)
        mounts = {**self._mounts(pod_spec, c, pod_dir / c["name"]), **host_folders}
        env = {k: self._localise(v, mounts, port_map) for k, v in rendered.items()}
        argv = [self._localise(str(a), mounts, port_map) for a in [*c.get("command", []), *c.get("args", [])]]
        if argv[:1] == ["dflash-pipeline"]:
            argv = [self.python, "-m", "dfp_cli.main", *argv[1:]]
        if argv[:1] == ["redis-server"]:
            from dfp_dev.local.redis_server import redis_binary

            argv = [redis_binary(), *argv[1:], "--port", str(port_map[6379])]
        return argv, {**{k: v for k, v in self.base_env.items() if k not in drop_env}, **env, **extra_env}

    def run_once(self, workload: str, container: str | None = None, extra_env: dict | None = None,
                 drop_env: tuple[str, ...] = (), timeout: float = 120, command: list[str] | None = None,
                 host_folders: dict[str, Path] | None = None) -> subprocess.CompletedProcess:
        """Run one container of the workload to its exit (own ports and volumes, nothing started
        kept), with ``extra_env`` over and ``drop_env`` taken out of its rendered environment; ``command``
        replaces its command and args (``kubectl run --command``), ``host_folders`` (mount path -> folder
        here) are mounted read-only. Its volumes stay on disk: :meth:`once_volume`."""
        pod_spec = self.workloads[workload]["spec"]["template"]["spec"]
        c = next(c for c in pod_spec["containers"] if container is None or c["name"] == container)
        if command:
            c = {**c, "command": command[:1], "args": command[1:]}
        port_map = {p["containerPort"]: free_port() for c2 in pod_spec["containers"] for p in c2.get("ports", [])}
        name = f"{workload}-once-{c['name']}"
        pod_dir = self.workdir / "pods" / f"{workload}-once"
        argv, env = self._command(name, f"{workload}-once", pod_spec, c, pod_dir, 0, port_map, extra_env or {},
                                  drop_env, host_folders)
        pod_dir.mkdir(parents=True, exist_ok=True)
        return subprocess.run(argv, env=env, cwd=pod_dir, capture_output=True, text=True, timeout=timeout)

    def once_volume(self, workload: str, volume: str, container: str | None = None) -> Path:
        """The folder here that held volume ``volume`` of the workload's :meth:`run_once` container."""
        pod_spec = self.workloads[workload]["spec"]["template"]["spec"]
        c = next(c for c in pod_spec["containers"] if container is None or c["name"] == container)
        return self.workdir / "pods" / f"{workload}-once" / c["name"] / volume

    def process(self, workload: str, index: int = 0, container: str | None = None):
        pod = self.pods[workload][index]
        name = next(n for n in pod.containers if container is None or n.endswith(f"-{container}"))
        return self.group.procs[name]

    def kill(self, workload: str, index: int = 0, container: str | None = None, sig: int = 9) -> None:
        self.group.kill(self.process(workload, index, container).name, sig)

    def lose_pod(self, workload: str, index: int) -> None:
        """A lost pod (its node gone): every process of every container dies at once, children that
        left the container's process group too, as a pod's cgroup would take them."""
        import psutil

        procs = []
        for name in self.pods[workload][index].containers:
            try:
                leader = psutil.Process(self.group.procs[name].proc.pid)
                procs += [leader, *leader.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        for name in self.pods[workload][index].containers:
            self.group.procs[name].proc.wait()

    def restart_pod(self, workload: str, index: int) -> None:
        """The controller replacing a lost pod: the same containers, names and ports."""
        for name in self.pods[workload][index].containers:
            self.group.restart(name)

    def restart(self, workload: str, index: int = 0, container: str | None = None, sig: int = 9) -> None:
        """The kubelet restarting a crashed container: the same command, env and ports."""
        self.group.restart(self.process(workload, index, container).name, sig)

    def stop(self) -> None:
        self.group.stop_all()
        if self.containers:
            self.containers.remove_all()
