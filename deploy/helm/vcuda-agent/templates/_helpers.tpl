{{/*
Names are fixed, as in deploy/ (one release per cluster): the admission policies, the scheduler
config and make-certs.sh's certificates refer to them.
*/}}

{{/* Helm's labels, added to every object's metadata (not to selectors or pod templates). */}}
{{- define "vcuda.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/* metadata.labels: the chart's own (a dict, may be empty) plus Helm's. */}}
{{- define "vcuda.labels" -}}
labels:
  {{- with .labels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- include "vcuda.helmLabels" .root | nindent 2 }}
{{- end }}

{{/* The agent's ServiceAccount as the API server names its requests. */}}
{{- define "vcuda.agentUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:vcuda-agent
{{- end }}

{{/* The vcuda-agent image (the node agent and the extender). */}}
{{- define "vcuda.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/* The driver root as the agent sees it: under the host's / at /host. */}}
{{- define "vcuda.driverRootInAgent" -}}
{{- if eq (trimSuffix "/" .Values.nvidiaDriverRoot) "" -}}
/host
{{- else -}}
/host{{ .Values.nvidiaDriverRoot }}
{{- end -}}
{{- end }}

{{/* The KubeSchedulerConfiguration that calls the extender (ConfigMap vcuda-scheduler-config). */}}
{{- define "vcuda.schedulerConfig" -}}
# The kube-scheduler configuration that calls the vcuda extender. scheduler.enabled runs a second
# scheduler, vcuda-scheduler, with exactly this file. To use the default scheduler instead, copy
# the `extenders` entry into its configuration; a kube-scheduler on the host network usually
# cannot resolve cluster DNS: give it the Service's ClusterIP in urlPrefix (and in
# extender.tls.extraSANs).
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
# One vcuda-scheduler replica: no leader election needed.
leaderElection:
  leaderElect: false
profiles:
  - schedulerName: vcuda-scheduler
extenders:
  - urlPrefix: https://vcuda-extender.{{ .Release.Namespace }}.svc:3456
    filterVerb: filter
    prioritizeVerb: prioritize
    bindVerb: bind
    # Extender scores (0-10) count weight x 10 against the plugins' 0-100.
    weight: {{ .Values.extender.weight }}
    # HTTPS both ways: the extender's verbs need a client certificate from its own CA (Secret
    # vcuda-extender-client, mounted here by vcuda-scheduler).
    enableHTTPS: true
    tlsConfig:
      certFile: /etc/vcuda-extender-client/tls.crt
      keyFile: /etc/vcuda-extender-client/tls.key
      caFile: /etc/vcuda-extender-client/ca.crt
    # The scheduler sends node names only; the extender has its own node cache.
    nodeCacheCapable: true
    httpTimeout: 30s
    managedResources:
      - name: nvidia.com/vcuda-core
        ignoredByScheduler: false
      - name: nvidia.com/vcuda-memory
        ignoredByScheduler: false
    # Without the extender a GPU pod could land where no single GPU fits it: wait instead.
    ignorable: false
{{- end }}

{{/* Refuse combinations the schema cannot say clearly. */}}
{{- define "vcuda.checks" -}}
{{- if and .Values.scheduler.enabled (not .Values.extender.enabled) -}}
{{- fail "scheduler.enabled needs extender.enabled: vcuda-scheduler calls the extender" -}}
{{- end -}}
{{- if and .Values.dra.enabled (not (semverCompare ">=1.34.0-0" .Capabilities.KubeVersion.Version)) -}}
{{- fail (printf "dra.enabled needs Kubernetes 1.34 or later (resource.k8s.io/v1); this cluster is %s" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- $seen := dict -}}
{{- range .Values.config.nodeConfig -}}
{{- if hasKey $seen .name -}}
{{- fail (printf "config.nodeConfig lists node %q twice" .name) -}}
{{- end -}}
{{- $_ := set $seen .name true -}}
{{- end -}}
{{- if and .Values.extender.tls.extraSANs (not .Values.extender.tls.create) -}}
{{- fail "extender.tls.extraSANs is used only with extender.tls.create: true (else pass them to deploy/extender-tls/make-certs.sh)" -}}
{{- end -}}
{{- end }}
