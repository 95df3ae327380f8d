"""Value profiles the chart is rendered and checked with (the ways users install it)."""

from __future__ import annotations

PROFILES: dict[str, dict] = {
    # helm install dflash ./helm/dflash-pipeline
    "defaults": {},
    # a laptop cluster (kind, k3d, minikube): no GPUs, one pod each, small requests
    "cpu-small": {
        "gpu": {"enabled": False},
        "api": {"replicas": 1, "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}, "pdb": {"enabled": False}},
        "tokenizer": {"replicas": 1, "processes": 2,
                      "resources": {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}},
        "generation": {"replicas": 1, "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
                       "shmSize": "1Gi", "cacheSize": "5Gi"},
        "target": {"enabled": False},
        "trainer": {"targetMode": "inprocess", "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
                    "shmSize": "1Gi", "cacheSize": "5Gi"},
        "redis": {"maxmemory": "256mb", "persistence": {"size": "1Gi"},
                  "resources": {"requests": {"cpu": "50m", "memory": "320Mi"}, "limits": {"memory": "512Mi"}}},
        "storage": {"url": "s3://dflash-dev/data", "s3": {"endpointUrl": "http://minio.minio.svc:9000",
                                                         "existingSecret": "minio-credentials"}},
    },
    # a GPU cluster with KEDA, Prometheus Operator, an ingress, a vLLM sidecar, the target disaggregated and capture
    "gpu-keda": {
        "tokenizer": {"keda": {"enabled": True, "maxReplicas": 40}},
        "generation": {"engine": "openai", "vllm": {"enabled": True, "extraArgs": ["--max-model-len", "8192"]},
                       "keda": {"enabled": True}},
        "target": {"replicas": 3, "gpus": 2},
        "trainer": {"targetMode": "disaggregated", "gpus": 8, "replicas": 2},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
        "api": {"ingress": {"enabled": True, "className": "nginx", "host": "dflash.internal", "tlsSecret": "dflash-tls"},
                "auth": {"existingSecret": "dflash-api-keys"}},
        "redis": {"auth": {"existingSecret": "dflash-redis"}},
        "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/dflash"}},
        "capture": {"enabled": True, "upstream": "http://vllm.inference.svc:8000", "redact": ["sk-[A-Za-z0-9]{20,}"]},
        # the adaptation loop every six hours on the capture's traffic, with a key of its own
        "adapt": {"enabled": True, "schedule": "0 */6 * * *", "windowHours": 6, "name": "qwen3-8b",
                  "apiKeySecret": "dflash-adapt-key", "apiKeySecretKey": "key",
                  "spec": {"tokenize": {"tokenizer": "s3://dflash-pipeline/models/Qwen3-8B"},
                           "train": {"target": "s3://dflash-pipeline/models/Qwen3-8B", "steps": 2000},
                           "evaluate": {"target": "s3://dflash-pipeline/models/Qwen3-8B"},
                           "generate": {"model": "Qwen/Qwen3-8B", "engine": "openai"}}},
    },
    # a managed Redis (TLS, password from a Secret) and static S3 keys
    "external-redis": {
        "redis": {"enabled": False, "external": {"url": "rediss://redis.cache.example.net:6380/2"},
                  "auth": {"existingSecret": "managed-redis", "secretKey": "password"}},
        "storage": {"s3": {"existingSecret": "s3-keys"}},
        "tokenizer": {"keda": {"enabled": True}},
        "generation": {"engine": "openai", "openai": {"baseUrl": "http://vllm.inference.svc:8000/v1", "model": "Qwen/Qwen3-32B"}},
    },
    # tainted GPU pools, a RuntimeClass, per-service placement
    "tolerations-runtimeclass": {
        "global": {"nodeSelector": {"kubernetes.io/os": "linux"},
                   "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]},
        "gpu": {"runtimeClassName": "nvidia", "nodeSelector": {"nvidia.com/gpu.present": "true"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                {"key": "gpu-pool", "operator": "Equal", "value": "h100", "effect": "NoExecute"}]},
        "trainer": {"runtimeClassName": "nvidia-cdi", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                    {"key": "training", "operator": "Exists", "effect": "NoSchedule"}]},
        "target": {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "target"}}}}]}}},
        "tokenizer": {"tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]},
    },
}
