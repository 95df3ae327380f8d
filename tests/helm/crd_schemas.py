"""JSON schemas of the custom resources the chart renders, written from their projects' docs.

kubernetes-validate carries only the built-in kinds, so the chart's KEDA ScaledObjects and
Prometheus Operator monitors are checked against these: the fields KEDA documents for
``keda.sh/v1alpha1`` ScaledObject (scaledobject-spec) and its ``redis-streams`` trigger, and the
fields the chart uses of ``monitoring.coreos.com/v1`` ServiceMonitor / PodMonitor. Unknown fields
are errors, as the API server's structural schema would prune or reject them.
"""

from __future__ import annotations

_STR = {"type": "string"}
_STR_MAP = {"type": "object", "additionalProperties": _STR}
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253},
                   "namespace": _STR, "labels": _STR_MAP, "annotations": _STR_MAP},
    "additionalProperties": False,
}

# HPA behaviour as KEDA passes it through (autoscaling/v2 HorizontalPodAutoscalerBehavior)
_SCALING_RULES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "tolerance": {"type": ["string", "number"]},
        "policies": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["type", "value", "periodSeconds"],
            "properties": {"type": {"enum": ["Pods", "Percent"]}, "value": {"type": "integer", "minimum": 1},
                           "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800}}}},
    },
}

# redis-streams trigger metadata (keda.sh/docs/scalers/redis-streams): every value is a string
REDIS_STREAMS_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "address": {"type": "string", "pattern": "^[^:/\\s]+:[0-9]{1,5}$"},
        "addressFromEnv": _STR, "host": _STR, "hostFromEnv": _STR, "port": {"type": "string", "pattern": "^[0-9]+$"},
        "portFromEnv": _STR, "username": _STR, "usernameFromEnv": _STR, "passwordFromEnv": _STR,
        "stream": {"type": "string", "minLength": 1},
        "consumerGroup": {"type": "string", "minLength": 1},
        "pendingEntriesCount": {"type": "string", "pattern": "^[0-9]+$"},
        "streamLength": {"type": "string", "pattern": "^[0-9]+$"},
        "lagCount": {"type": "string", "pattern": "^[0-9]+$"},
        "activationLagCount": {"type": "string", "pattern": "^[0-9]+$"},
        "activationStreamLength": {"type": "string", "pattern": "^[0-9]+$"},
        "enableTLS": {"enum": ["true", "false"]},
        "unsafeSsl": {"enum": ["true", "false"]},
        "databaseIndex": {"type": "string", "pattern": "^[0-9]+$"},
    },
    "required": ["stream"],
    "allOf": [
        # where Redis is: address, addressFromEnv, or host (+ port)
        {"oneOf": [{"required": ["address"]}, {"required": ["addressFromEnv"]},
                   {"anyOf": [{"required": ["host"]}, {"required": ["hostFromEnv"]}]}]},
        # lag-based scaling needs the consumer group and an activation threshold
        {"if": {"required": ["lagCount"]}, "then": {"required": ["consumerGroup", "activationLagCount"]}},
        {"if": {"required": ["pendingEntriesCount"]}, "then": {"required": ["consumerGroup"]}},
        # one scaling mode at a time
        {"not": {"required": ["lagCount", "pendingEntriesCount"]}},
        {"not": {"required": ["lagCount", "streamLength"]}},
    ],
}

SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"apiVersion": _STR, "kind": _STR, "name": _STR,
                                                  "envSourceContainerName": _STR}},
                "pollingInterval": _INT32, "cooldownPeriod": _INT32, "initialCooldownPeriod": _INT32,
                "idleReplicaCount": _INT32, "minReplicaCount": _INT32, "maxReplicaCount": _INT32,
                "fallback": {"type": "object", "required": ["failureThreshold", "replicas"], "additionalProperties": False,
                             "properties": {"failureThreshold": _INT32, "replicas": _INT32,
                                            "behavior": {"enum": ["static", "currentReplicas",
                                                                  "currentReplicasIfHigher", "currentReplicasIfLower"]}}},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                        "name": _STR,
                        "behavior": {"type": "object", "additionalProperties": False,
                                     "properties": {"scaleUp": _SCALING_RULES, "scaleDown": _SCALING_RULES}}}},
                    "scalingModifiers": {"type": "object", "additionalProperties": False, "properties": {
                        "formula": _STR, "target": _STR, "activationTarget": _STR,
                        "metricType": {"enum": ["AverageValue", "Value"]}}},
                }},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {
                        "type": _STR, "name": _STR, "useCachedMetrics": {"type": "boolean"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "metadata": _STR_MAP,
                        "authenticationRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                              "properties": {"name": _STR,
                                                             "kind": {"enum": ["TriggerAuthentication",
                                                                               "ClusterTriggerAuthentication"]}}},
                    },
                    "if": {"properties": {"type": {"const": "redis-streams"}}},
                    "then": {"properties": {"metadata": REDIS_STREAMS_METADATA}},
                }},
            },
        },
    },
}

_ENDPOINT = {
    "type": "object", "additionalProperties": False,
    "properties": {"port": _STR, "targetPort": {"type": ["string", "integer"]}, "path": {"type": "string", "pattern": "^/"},
                   "interval": {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                   "scheme": {"enum": ["http", "https"]}, "scrapeTimeout": _STR},
}
_LABEL_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {"matchLabels": _STR_MAP, "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": _STR, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": _STR}}}}},
}


def _monitor(kind: str, endpoints_key: str) -> dict:
    return {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind}, "metadata": _METADATA,
            "spec": {"type": "object", "required": ["selector", endpoints_key], "additionalProperties": False,
                     "properties": {"selector": _LABEL_SELECTOR, "jobLabel": _STR,
                                    "namespaceSelector": {"type": "object"},
                                    endpoints_key: {"type": "array", "minItems": 1, "items": _ENDPOINT}}},
        },
    }


SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _monitor("ServiceMonitor", "endpoints"),
    ("monitoring.coreos.com/v1", "PodMonitor"): _monitor("PodMonitor", "podMetricsEndpoints"),
}
