{{/* Names ------------------------------------------------------------------------------------ */}}

{{- define "dflash.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource-name prefix: the release name (release "dflash" -> dflash-api, dflash-target-headless, ...). */}}
{{- define "dflash.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of one component's objects: dflash.component (dict "root" $ "component" "api") */}}
{{- define "dflash.component" -}}
{{- printf "%s-%s" (include "dflash.fullname" .root) .component -}}
{{- end -}}

{{- define "dflash.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dflash.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------------- */}}

{{- define "dflash.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "dflash.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dflash-pipeline
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pods of the whole release (used by NetworkPolicies). */}}
{{- define "dflash.releaseSelector" -}}
app.kubernetes.io/name: {{ include "dflash.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* dflash.selectorLabels (dict "root" $ "component" "api") */}}
{{- define "dflash.selectorLabels" -}}
{{ include "dflash.releaseSelector" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* dflash.componentLabels (dict "root" $ "component" "api") */}}
{{- define "dflash.componentLabels" -}}
{{ include "dflash.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Images ----------------------------------------------------------------------------------- */}}

{{/* dflash.image (dict "root" $ "flavor" "cpu"|"cuda"); the CPU image replaces CUDA when gpu.enabled is false. */}}
{{- define "dflash.image" -}}
{{- $flavor := .flavor -}}
{{- if not .root.Values.gpu.enabled }}{{ $flavor = "cpu" }}{{ end -}}
{{- $img := index .root.Values.image $flavor -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* Redis ------------------------------------------------------------------------------------ */}}

{{/* host:port of Redis (what KEDA's scaler dials). */}}
{{- define "dflash.redisAddress" -}}
{{- if .Values.redis.enabled -}}
{{- printf "%s.%s.svc:6379" (include "dflash.component" (dict "root" . "component" "redis")) .Release.Namespace -}}
{{- else -}}
{{- (urlParse .Values.redis.external.url).host -}}
{{- end -}}
{{- end -}}

{{- define "dflash.redisDatabase" -}}
{{- if .Values.redis.enabled -}}0{{- else -}}
{{- $path := trimPrefix "/" (urlParse .Values.redis.external.url).path -}}
{{- default "0" $path -}}
{{- end -}}
{{- end -}}

{{- define "dflash.redisTLS" -}}
{{- if and (not .Values.redis.enabled) (hasPrefix "rediss://" .Values.redis.external.url) -}}true{{- else -}}false{{- end -}}
{{- end -}}

{{/* The Redis URL services get; $(DFLASH_REDIS_PASSWORD) is expanded by the kubelet from the Secret. */}}
{{- define "dflash.redisUrl" -}}
{{- $scheme := ternary "rediss" "redis" (eq (include "dflash.redisTLS" .) "true") -}}
{{- $auth := ternary ":$(DFLASH_REDIS_PASSWORD)@" "" (ne .Values.redis.auth.existingSecret "") -}}
{{- printf "%s://%s%s/%s" $scheme $auth (include "dflash.redisAddress" .) (include "dflash.redisDatabase" .) -}}
{{- end -}}

{{/* Shared pod pieces ------------------------------------------------------------------------ */}}

{{/* Env every project container gets besides the shared ConfigMap (secrets first: later values refer to them). */}}
{{- define "dflash.secretEnv" -}}
{{- if .Values.redis.auth.existingSecret }}
- name: DFLASH_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.auth.existingSecret }}
      key: {{ .Values.redis.auth.secretKey }}
{{- end }}
- name: DFLASH_REDIS_URL
  value: {{ include "dflash.redisUrl" . | quote }}
{{- include "dflash.storageSecretEnv" . }}
{{- end -}}

{{/* dflash.storageSecretEnv: the object store's credentials alone (a pod that never talks to Redis). */}}
{{- define "dflash.storageSecretEnv" -}}
{{- if .Values.storage.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .Values.storage.s3.existingSecret }}
      key: {{ .Values.storage.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.storage.s3.existingSecret }}
      key: {{ .Values.storage.s3.secretAccessKeyKey }}
{{- end }}
{{- end -}}

{{/* dflash.extraEnv <map>: name -> value pairs as an env list. */}}
{{- define "dflash.extraEnv" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{- define "dflash.envFrom" -}}
- configMapRef:
    name: {{ include "dflash.component" (dict "root" . "component" "config") }}
{{- end -}}

{{- define "dflash.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "dflash.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Writable scratch space under a read-only root filesystem. */}}
{{- define "dflash.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end -}}

{{/* dflash.scratchVolumes (dict "cacheSize" "10Gi") */}}
{{- define "dflash.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir:
    {{- if .cacheSize }}
    sizeLimit: {{ .cacheSize }}
    {{- end }}
{{- end -}}

{{/* Scheduling ------------------------------------------------------------------------------- */}}

{{/* dflash.scheduling (dict "root" $ "svc" .Values.api "gpu" false): nodeSelector, tolerations, affinity, runtimeClassName. */}}
{{- define "dflash.scheduling" -}}
{{- $v := .root.Values -}}
{{- $useGpu := and .gpu $v.gpu.enabled -}}
{{- $nodeSelector := merge (deepCopy (default dict .svc.nodeSelector)) (ternary $v.gpu.nodeSelector dict $useGpu) (deepCopy $v.global.nodeSelector) -}}
{{- $tolerations := $v.global.tolerations -}}
{{- if and $useGpu $v.gpu.tolerations }}{{ $tolerations = $v.gpu.tolerations }}{{ end -}}
{{- if .svc.tolerations }}{{ $tolerations = .svc.tolerations }}{{ end -}}
{{- $affinity := $v.global.affinity -}}
{{- if and $useGpu $v.gpu.affinity }}{{ $affinity = $v.gpu.affinity }}{{ end -}}
{{- if .svc.affinity }}{{ $affinity = .svc.affinity }}{{ end -}}
{{- $runtimeClass := "" -}}
{{- if $useGpu }}{{ $runtimeClass = default $v.gpu.runtimeClassName .svc.runtimeClassName }}{{ end -}}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $runtimeClass }}
runtimeClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* dflash.gpuResources (dict "root" $ "resources" .Values.x.resources "gpus" 1): resources with GPU requests and limits added. */}}
{{- define "dflash.gpuResources" -}}
{{- $res := deepCopy (default dict .resources) -}}
{{- if and .root.Values.gpu.enabled (gt (int .gpus) 0) -}}
{{- $gpuName := .root.Values.gpu.resourceName -}}
{{- $requests := default dict (get $res "requests") -}}
{{- $limits := default dict (get $res "limits") -}}
{{- $_ := set $requests $gpuName (int .gpus) -}}
{{- $_ := set $limits $gpuName (int .gpus) -}}
{{- $_ := set $res "requests" $requests -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Effective GPU count of a workload: 0 when gpu.enabled is false. */}}
{{- define "dflash.gpus" -}}
{{- if .root.Values.gpu.enabled }}{{ int .gpus }}{{ else }}0{{ end -}}
{{- end -}}

{{- define "dflash.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- with .root.Values.global.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Named OpenAI-compatible endpoints jobs may choose (DFLASH_OPENAI_ENDPOINTS), each token from its own
Secret through a variable of its own; nothing when the map is empty. */}}
{{- define "dflash.openaiEndpointsEnv" -}}
{{- if . }}
{{- $endpoints := . }}
{{- $names := keys $endpoints | sortAlpha }}
{{- $config := dict }}
{{- range $i, $name := $names }}
{{- $e := get $endpoints $name }}
{{- $entry := dict "url" $e.baseUrl }}
{{- with $e.model }}{{ $_ := set $entry "model" . }}{{ end }}
{{- if $e.existingSecret }}{{ $_ := set $entry "api_key_env" (printf "DFLASH_OPENAI_ENDPOINT_KEY_%d" $i) }}{{ end }}
{{- $_ := set $config $name $entry }}
{{- end }}
- name: DFLASH_OPENAI_ENDPOINTS
  value: {{ toJson $config | quote }}
{{- range $i, $name := $names }}
{{- $e := get $endpoints $name }}
{{- if $e.existingSecret }}
- name: {{ printf "DFLASH_OPENAI_ENDPOINT_KEY_%d" $i }}
  valueFrom:
    secretKeyRef:
      name: {{ $e.existingSecret }}
      key: {{ $e.secretKey | default "api-key" }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Headless Service of a trainer group (trainer.nodes > 1). */}}
{{- define "dflash.trainerGroupService" -}}
{{ include "dflash.component" (dict "root" . "component" "trainer") }}-group
{{- end -}}

{{/* Target address the trainer dials (DFLASH_TARGET_URL). */}}
{{- define "dflash.trainerTargetUrl" -}}
{{- if eq .Values.trainer.targetMode "colocated" -}}
{{- printf "127.0.0.1:%d" (int .Values.target.port) -}}
{{- else if eq .Values.trainer.targetMode "disaggregated" -}}
{{- printf "dns:///%s.%s.svc:%d" (include "dflash.component" (dict "root" . "component" "target-headless")) .Release.Namespace (int .Values.target.port) -}}
{{- else -}}
inprocess
{{- end -}}
{{- end -}}

{{/* Metrics port, liveness and readiness of a queue worker: /metrics answers while the process lives. */}}
{{- define "dflash.workerProbes" -}}
ports:
{{- include "dflash.metricsPortItem" . | nindent 2 }}
{{ include "dflash.workerChecks" . }}
{{- end -}}

{{- define "dflash.metricsPortItem" -}}
- name: metrics
  containerPort: {{ .Values.config.metricsPort }}
  protocol: TCP
{{- end -}}

{{/* Startup, liveness and readiness checks of a queue worker, on its /metrics. */}}
{{- define "dflash.workerChecks" -}}
startupProbe:
  httpGet:
    path: /metrics
    port: metrics
  periodSeconds: 5
  failureThreshold: 120
livenessProbe:
  httpGet:
    path: /metrics
    port: metrics
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 4
readinessProbe:
  httpGet:
    path: /metrics
    port: metrics
  periodSeconds: 10
  timeoutSeconds: 5
{{- end -}}

{{/* dflash.scaledObject (dict "root" $ "component" "tokenizer" "kind" "tokenize" "keda" .Values.tokenizer.keda) */}}
{{- define "dflash.scaledObject" -}}
{{- $c := dict "root" .root "component" .component -}}
{{- $root := .root -}}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ include "dflash.component" $c }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "dflash.componentLabels" $c | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "dflash.component" $c }}
    envSourceContainerName: {{ .component }}
  pollingInterval: {{ .keda.pollingInterval }}
  cooldownPeriod: {{ .keda.cooldownPeriod }}
  minReplicaCount: {{ .keda.minReplicas }}
  maxReplicaCount: {{ .keda.maxReplicas }}
  fallback:
    failureThreshold: 3
    replicas: {{ .keda.fallbackReplicas }}
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        scaleDown:
          stabilizationWindowSeconds: {{ .keda.cooldownPeriod }}
          policies:
            - type: Pods
              value: 1
              periodSeconds: 60
  triggers:
    - type: redis-streams
      metadata:
        address: {{ include "dflash.redisAddress" $root | quote }}
        stream: {{ printf "dfp:tasks:%s" .kind | quote }}
        consumerGroup: "workers"
        lagCount: {{ .keda.lagCount | toString | quote }}
        activationLagCount: {{ .keda.activationLagCount | toString | quote }}
        databaseIndex: {{ include "dflash.redisDatabase" $root | quote }}
        enableTLS: {{ include "dflash.redisTLS" $root | quote }}
        {{- if $root.Values.redis.auth.existingSecret }}
        passwordFromEnv: DFLASH_REDIS_PASSWORD
        {{- end }}
{{- end -}}

{{/* dflash.targetContainer (dict "root" $ "name" "target" "model" "s3://..." "gpus" 1 "resources" {...} "metricsPort" 9090):
     the hidden-state gRPC server, as its own Deployment or as the trainer's colocated sidecar. */}}
{{- define "dflash.targetContainer" -}}
{{- $root := .root -}}
- name: {{ .name }}
  image: {{ include "dflash.image" (dict "root" $root "flavor" "cuda") }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["dflash-pipeline"]
  args: ["target", "serve"]
  envFrom:
    {{- include "dflash.envFrom" $root | nindent 4 }}
  env:
    {{- include "dflash.secretEnv" $root | nindent 4 }}
    - name: DFLASH_MODEL
      value: {{ .model | quote }}
    - name: DFLASH_PORT
      value: {{ $root.Values.target.port | quote }}
    - name: DFLASH_METRICS_PORT
      value: {{ .metricsPort | quote }}
    {{- include "dflash.extraEnv" $root.Values.target.env | nindent 4 }}
  ports:
    - name: grpc
      containerPort: {{ $root.Values.target.port }}
      protocol: TCP
    - name: metrics
      containerPort: {{ .metricsPort }}
      protocol: TCP
  startupProbe:
    grpc:
      port: {{ $root.Values.target.port }}
    periodSeconds: 10
    failureThreshold: {{ div (int $root.Values.target.startupSeconds) 10 | max 1 }}
  livenessProbe:
    grpc:
      port: {{ $root.Values.target.port }}
    periodSeconds: 15
    timeoutSeconds: 5
    failureThreshold: 4
  readinessProbe:
    grpc:
      port: {{ $root.Values.target.port }}
    periodSeconds: 5
    timeoutSeconds: 5
  resources:
    {{- include "dflash.gpuResources" (dict "root" $root "resources" .resources "gpus" .gpus) | nindent 4 }}
  securityContext:
    {{- include "dflash.containerSecurityContext" $root | nindent 4 }}
  volumeMounts:
    {{- include "dflash.scratchMounts" $root | nindent 4 }}
    - name: shm
      mountPath: /dev/shm
{{- end -}}

{{/* Tokenizer processes per pod: a number as given; "auto" = the container's CPU request (or limit)
     rounded up, since a container sees every core of its node while its quota is what it may use. */}}
{{- define "dflash.tokenizerProcesses" -}}
{{- $v := .Values.tokenizer -}}
{{- $cpu := "" -}}
{{- with $v.resources }}{{ $cpu = toString (default (dig "limits" "cpu" "" .) (dig "requests" "cpu" "" .)) }}{{ end -}}
{{- if ne (toString $v.processes) "auto" -}}
{{- $v.processes -}}
{{- else if not $cpu -}}
auto
{{- else if hasSuffix "m" $cpu -}}
{{- max 1 (div (add (trimSuffix "m" $cpu | int) 999) 1000) -}}
{{- else -}}
{{- max 1 (ceil ($cpu | float64)) -}}
{{- end -}}
{{- end -}}

{{/* dflash.reservedPrefixes: DFLASH_RESERVED_PREFIXES, a JSON object of prefix -> principal ("" for no job's), or
     nothing when no prefix is kept: the captured traffic for no job (the loop reads it with its own credentials),
     the served drafters and the loop's runs for the loop's key, and the operator's own. */}}
{{- define "dflash.reservedPrefixes" -}}
{{- $url := trimSuffix "/" .Values.storage.url }}
{{- $kept := dict }}
{{- if .Values.capture.enabled }}
{{- $_ := set $kept (trimSuffix "/" (.Values.capture.prefix | default (printf "%s/capture" $url))) "" }}
{{- end }}
{{- if .Values.adapt.enabled }}
{{- $v := .Values.adapt }}
{{- $_ := set $kept (trimSuffix "/" ($v.capturePrefix | default .Values.capture.prefix | default (printf "%s/capture" $url))) "" }}
{{- $_ := set $kept (trimSuffix "/" ($v.served | default (printf "%s/served" $url))) $v.principal }}
{{- $_ := set $kept (trimSuffix "/" ($v.runs | default (printf "%s/adapt" $url))) $v.principal }}
{{- end }}
{{- range $prefix, $principal := .Values.storage.reservedPrefixes }}
{{- $_ := set $kept (trimSuffix "/" $prefix) ($principal | default "") }}
{{- end }}
{{- if $kept }}{{ toJson $kept }}{{ end }}
{{- end -}}
