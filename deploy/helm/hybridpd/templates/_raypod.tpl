{{/* A Ray pod template: .root, .component, .containerName, .resources, .gpus, .ports, .securityContext, .nodeSelector, .tolerations, .drain (worker groups: their actors drain before the pod stops) */}}
{{- define "hybridpd.rayPod" -}}
metadata:
  labels:
    {{- include "hybridpd.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  automountServiceAccountToken: false
  {{- with .drain }}
  # the actors' drain, and time for Ray to stop
  terminationGracePeriodSeconds: {{ add .graceSeconds 30 }}
  {{- end }}
  securityContext:
    {{- toYaml .root.Values.podSecurityContext | nindent 4 }}
  {{- with .root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  containers:
    - name: {{ .containerName }}
      image: {{ include "hybridpd.image" .root }}
      imagePullPolicy: {{ .root.Values.image.pullPolicy }}
      env:
        {{- include "hybridpd.rayAuthEnv" .root | nindent 8 }}
        - name: RAY_USAGE_STATS_ENABLED
          value: "0"
        # Ray runs actor calls on a thread pool; fewer glibc arenas keep RSS from creeping
        - name: MALLOC_ARENA_MAX
          value: "2"
      {{- with .drain }}
      # the node's actors take no new request and finish theirs before Ray stops (hybridpd drain-actors)
      lifecycle:
        preStop:
          exec:
            command: ["hybridpd", "drain-actors", "--grace-s", "{{ .graceSeconds }}"]
      {{- end }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      {{- $res := deepCopy .resources }}
      {{- if gt (int .gpus) 0 }}
      {{- $limits := merge (dict .root.Values.ray.gpuResourceName (int .gpus)) (default dict $res.limits) }}
      {{- $_ := set $res "limits" $limits }}
      {{- end }}
      resources:
        {{- toYaml $res | nindent 8 }}
      # KubeRay gives the init container it adds to workers (wait-gcs-ready) this securityContext and these mounts
      securityContext:
        {{- include "hybridpd.securityContext" (dict "root" .root "override" .securityContext) | nindent 8 }}
      volumeMounts:
        - name: shm
          mountPath: /dev/shm
        {{- include "hybridpd.writableMounts" .root | nindent 8 }}
        {{- include "hybridpd.integrityMount" .root | nindent 8 }}
        {{- if include "hybridpd.redisCaSecret" .root }}
        # the actors connect to Redis with the router's URL, whose ssl_ca_certs names this file
        - name: redis-ca
          mountPath: {{ include "hybridpd.redisCaDir" .root }}
          readOnly: true
        {{- end }}
  volumes:
    # Ray's object store lives in shared memory
    - name: shm
      emptyDir:
        medium: Memory
    {{- include "hybridpd.writableVolumes" .root | nindent 4 }}
    {{- include "hybridpd.integrityVolume" .root | nindent 4 }}
    {{- with include "hybridpd.redisCaVolume" .root }}
    {{- . | nindent 4 }}
    {{- end }}
  {{- with .nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
