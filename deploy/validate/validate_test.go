package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// binDir is where justitia and justitiad are: check.sh builds them and sets
// JUSTITIA_BIN_DIR.
func binDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("JUSTITIA_BIN_DIR")
	if dir == "" {
		t.Fatal("JUSTITIA_BIN_DIR is not set: run deploy/validate/check.sh, which builds justitia and justitiad and sets it")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		t.Fatal(err)
	}
	return abs
}

// The repository's own files pass.
func TestTheRepositoryPasses(t *testing.T) {
	report, err := checkRepo("../..", binDir(t))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(report, "7 objects") {
		t.Fatalf("unexpected report:\n%s", report)
	}
}

// copyRepo copies the files checkRepo reads into a scratch root.
func copyRepo(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	for _, f := range []string{
		"deploy/kubernetes/kustomization.yaml", "deploy/kubernetes/daemonset.yaml",
		"deploy/kubernetes/device-plugin.yaml", "deploy/kubernetes/admission-policy.yaml",
		"deploy/kubernetes/monitoring/kustomization.yaml", "deploy/kubernetes/monitoring/podmonitor.yaml",
		"deploy/with-monitoring/kustomization.yaml",
		"deploy/kubernetes/justitiad.toml", "deploy/kubernetes/peer-members.sh", "deploy/Dockerfile", "packaging/justitiad.toml",
	} {
		data, err := os.ReadFile(filepath.Join("../..", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(root, f)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, f), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// Each broken input, made by one replacement in one file (most of them one line that
// breaks or weakens a real deployment), is refused with an error that names what is wrong.
func TestBrokenInputsAreRefused(t *testing.T) {
	bins := binDir(t)
	cases := []struct {
		name, file, old, new, want string
	}{
		{"misspelt field", "deploy/kubernetes/daemonset.yaml", "hostNetwork: true", "hostNetwrok: true", `unknown field "hostNetwrok"`},
		{"field at the wrong level", "deploy/kubernetes/daemonset.yaml", "      priorityClassName: system-node-critical", "      template:\n        priorityClassName: system-node-critical", "unknown field"},
		{"wrong type", "deploy/kubernetes/daemonset.yaml", "containerPort: 9464", "containerPort: metrics", "containerPort"},
		{"misspelt kustomization field", "deploy/kubernetes/kustomization.yaml", "resources:", "resorces:", "resorces"},
		{"subPath mount of the configuration", "deploy/kubernetes/daemonset.yaml", "              mountPath: /etc/justitia\n", "              mountPath: /etc/justitia/justitiad.toml\n              subPath: justitiad.toml\n", "subPath"},
		{"a capability too many", "deploy/kubernetes/daemonset.yaml", `add: ["IPC_LOCK"]`, `add: ["IPC_LOCK", "SYS_ADMIN"]`, "SYS_ADMIN"},
		{"privileged", "deploy/kubernetes/daemonset.yaml", "privileged: false", "privileged: true", "privileged"},
		{"no priority class", "deploy/kubernetes/daemonset.yaml", "      priorityClassName: system-node-critical\n", "", "priorityClassName"},
		{"probe on another socket", "deploy/kubernetes/daemonset.yaml", `command: ["justitia", "status", "--socket", "/run/justitia-admin/justitiad-admin.sock"]
            periodSeconds: 10`, `command: ["justitia", "status"]
            periodSeconds: 10`, "a probe asks"},
		{"scrape port not the metrics port", "deploy/kubernetes/daemonset.yaml", `prometheus.io/port: "9464"`, `prometheus.io/port: "9100"`, "prometheus.io/port"},
		{"admin socket beside the registration socket", "deploy/kubernetes/justitiad.toml", `admin_socket = "/run/justitia-admin/justitiad-admin.sock"`, `admin_socket = "/run/justitia/justitiad-admin.sock"`, "binds into containers"},
		{"configuration drifted from the packaged one", "deploy/kubernetes/justitiad.toml", "probe_timeout_ms = 5", "probe_timeout_ms = 50", "probe_timeout_ms = 50"},
		{"tenants by uid", "deploy/kubernetes/justitiad.toml", "\ntenant = \"pod\"\n", "\ntenant = \"uid\"\n", "pods or namespaces"},
		{"pod log directory not mounted", "deploy/kubernetes/daemonset.yaml", "              mountPath: /var/log/pods\n", "              mountPath: /var/log/kubelet-pods\n", "pod_logs_dir"},
		{"tenants by cgroup", "deploy/kubernetes/justitiad.toml", "\ntenant = \"pod\"\n", "\ntenant = \"cgroup\"\n", "pods or namespaces"},
		{"Dockerfile flag misspelt", "deploy/Dockerfile", "COPY --from=build", "COPY --form=build", "form"},
		{"Dockerfile unknown instruction", "deploy/Dockerfile", "WORKDIR /src", "WORKDIRR /src", "workdirr"},
		{"Dockerfile copies from no stage", "deploy/Dockerfile", "COPY --from=build", "COPY --from=builder", "builder"},
		{"Dockerfile runs as root", "deploy/Dockerfile", "USER 65532:65532", "USER root", "root"},
		{"Dockerfile leaves the shaper out", "deploy/Dockerfile", "/out/usr/lib/justitia/libjustitia.so", "/out/usr/lib/libjustitia.so", "/usr/lib/justitia/libjustitia.so"},
		// Cross-references, found by running the install step and justitiad --check.
		{"spec written where no runtime reads", "deploy/kubernetes/device-plugin.yaml", "path: /var/run/cdi\n", "path: /var/lib/cdi\n", "no runtime reads specs"},
		{"library installed away from --library", "deploy/kubernetes/device-plugin.yaml", "--library /var/lib/justitia/libjustitia.so", "--library /var/lib/justitia/lib/libjustitia.so", "puts no file there"},
		{"musl build not installed", "deploy/kubernetes/device-plugin.yaml", "mv /host/var/lib/justitia/musl/.libjustitia.so.new /host/var/lib/justitia/musl/libjustitia.so", "mv /host/var/lib/justitia/musl/.libjustitia.so.new /host/var/lib/justitia/musl/libjustitia.so.1", "musl/libjustitia.so"},
		{"preload list installed under another name", "deploy/kubernetes/device-plugin.yaml", "/host/var/lib/justitia/ld.so.preload\n", "/host/var/lib/justitia/ld.preload\n", "ld.so.preload"},
		{"--socket in another directory than the daemon's", "deploy/kubernetes/device-plugin.yaml", "--socket /run/justitia/justitiad.sock", "--socket /run/justitia-admin/justitiad.sock", "justitiad's socket"},
		{"--socket another file than the daemon's", "deploy/kubernetes/device-plugin.yaml", "--socket /run/justitia/justitiad.sock", "--socket /run/justitia/shaper.sock", "/run/justitia/shaper.sock"},
		{"typo in the install script", "deploy/kubernetes/device-plugin.yaml", "mkdir -p /host", "mkdri -p /host", "script fails"},
		{"misspelt justitia cdi flag", "deploy/kubernetes/device-plugin.yaml", "--class \"$JUSTITIA_DEFAULT_CLASS\"", "--clas \"$JUSTITIA_DEFAULT_CLASS\"", "--clas"},
		{"class value justitia cdi refuses", "deploy/kubernetes/kustomization.yaml", "class=auto", "class=fast", "fast"},
		{"install writes outside its volumes", "deploy/kubernetes/device-plugin.yaml", "mountPath: /host/var/lib/justitia\n", "mountPath: /host/var/lib/justitia-lib\n", "in no volume"},
		{"spec volume not mounted by the install step", "deploy/kubernetes/device-plugin.yaml", "              mountPath: /host/var/run/cdi\n", "              mountPath: /host/run/cdi\n", "in no volume"},
		{"RDMA resource removed", "deploy/kubernetes/daemonset.yaml", "              memory: 128Mi\n              justitia.io/rdma-unshaped: \"1\"\n", "              memory: 128Mi\n", "unshaped pool"},
		{"two RDMA devices asked for", "deploy/kubernetes/daemonset.yaml", "              memory: 128Mi\n              justitia.io/rdma-unshaped: \"1\"\n", "              memory: 128Mi\n              justitia.io/rdma-unshaped: \"2\"\n", "expected 1"},
		{"justitiad asks for the shaped pool", "deploy/kubernetes/daemonset.yaml", "              memory: 128Mi\n              justitia.io/rdma-unshaped: \"1\"\n", "              memory: 128Mi\n              justitia.io/rdma-unshaped: \"1\"\n              rdma/rdma_shared_device_a: \"1\"\n", "through the shaper"},
		// The device plugin against the daemon and the install step.
		{"plugin points shapers at another socket", "deploy/kubernetes/device-plugin.yaml", "            - /run/justitia/justitiad.sock\n", "            - /run/justitia/other.sock\n", "justitiad's socket is"},
		{"plugin hands out a library not installed", "deploy/kubernetes/device-plugin.yaml", "            - /var/lib/justitia/libjustitia.so\n", "            - /var/lib/justitia/lib.so\n", "puts no file there"},
		{"plugin flag misspelt", "deploy/kubernetes/device-plugin.yaml", "            - --resource\n", "            - --resorce\n", "refuses its command line"},
		{"plugin class value refused", "deploy/kubernetes/device-plugin.yaml", "            - $(JUSTITIA_DEFAULT_CLASS)\n", "            - $(JUSTITIA_CLASS)\n", "refuses its command line"},
		{"kubelet's directory not mounted where the plugin serves", "deploy/kubernetes/device-plugin.yaml", "              mountPath: /var/lib/kubelet/device-plugins\n", "              mountPath: /var/lib/kubelet/plugins\n", "--kubelet-dir"},
		{"plugin keeps a second CDI spec", "deploy/kubernetes/device-plugin.yaml", "            - /var/run/cdi/justitia.json\n", "            - /var/run/cdi/justitia-plugin.json\n", "--cdi-spec"},
		{"plugin's spec directory not mounted", "deploy/kubernetes/device-plugin.yaml", "            - name: cdi\n              mountPath: /var/run/cdi\n", "", "--cdi-spec"},
		{"SELinux type dropped", "deploy/kubernetes/daemonset.yaml", "          type: spc_t\n", "          type: container_t\n", "spc_t"},
		{"PodMonitor selects other pods", "deploy/kubernetes/monitoring/podmonitor.yaml", "app.kubernetes.io/name: justitiad", "app.kubernetes.io/name: justitia", "do not carry"},
		{"PodMonitor scrapes an unnamed port", "deploy/kubernetes/monitoring/podmonitor.yaml", "- port: metrics", "- port: http-metrics", "does not name"},
		{"PodMonitor in another namespace", "deploy/with-monitoring/kustomization.yaml", "namespace: kube-system\n", "", "namespace"},
		{"PodMonitor in the base", "deploy/kubernetes/kustomization.yaml", "  - admission-policy.yaml\n", "  - admission-policy.yaml\n  - monitoring/podmonitor.yaml\n", "PodMonitor in the base"},
		{"plugin and daemon on different nodes", "deploy/kubernetes/device-plugin.yaml", "        justitia.io/rdma: \"true\"", "        justitia.io/rdma: \"yes\"", "different nodes"},
		// The admission policy, evaluated on pods.
		{"policy exempts another account", "deploy/kubernetes/admission-policy.yaml", "object.spec.serviceAccountName == 'justitiad'", "object.spec.serviceAccountName == 'justitia'", "refuses justitiad's pod"},
		{"daemon under another account", "deploy/kubernetes/daemonset.yaml", "serviceAccountName: justitiad", "serviceAccountName: default", "refuses justitiad's pod"},
		{"policy guards another resource name", "deploy/kubernetes/admission-policy.yaml", "c.resources.limits.exists(r, r == 'justitia.io/rdma-unshaped')", "c.resources.limits.exists(r, r == 'justitia.io/rdma_unshaped')", "admits a pod asking for justitia.io/rdma-unshaped"},
		{"policy forgets init containers", "deploy/kubernetes/admission-policy.yaml", "object.spec.containers + (has(object.spec.initContainers) ? object.spec.initContainers : [])", "object.spec.containers", "admits an init container"},
		{"policy lets CDI annotations through", "deploy/kubernetes/admission-policy.yaml", "k.startsWith('cdi.k8s.io/') &&", "k.startsWith('cdi.k8s.io/x') &&", "cdi.k8s.io annotation"},
		{"policy fails open", "deploy/kubernetes/admission-policy.yaml", "failurePolicy: Fail", "failurePolicy: Ignore", "failurePolicy"},
		{"binding only warns", "deploy/kubernetes/admission-policy.yaml", `validationActions: ["Deny"]`, `validationActions: ["Warn"]`, "do not deny"},
		{"policy expression does not compile", "deploy/kubernetes/admission-policy.yaml", "variables.allowed || !has", "variables.allowed || !hass", "does not compile"},
		{"seccomp unconfined", "deploy/kubernetes/device-plugin.yaml", "type: RuntimeDefault\n", "type: Unconfined\n", "seccompProfile"},
		{"privilege escalation allowed", "deploy/kubernetes/daemonset.yaml", "allowPrivilegeEscalation: false", "allowPrivilegeEscalation: true", "allowPrivilegeEscalation"},
		{"writable root file system", "deploy/kubernetes/daemonset.yaml", "readOnlyRootFilesystem: true", "readOnlyRootFilesystem: false", "readOnlyRootFilesystem"},
		{"IPC_LOCK removed", "deploy/kubernetes/daemonset.yaml", `add: ["IPC_LOCK"]`, `add: []`, "IPC_LOCK"},
		{"1 MiB memory limit", "deploy/kubernetes/daemonset.yaml", "memory: 128Mi", "memory: 1Mi", "below its request"},
		{"memory request below the floor", "deploy/kubernetes/daemonset.yaml", "memory: 32Mi", "memory: 1Mi", "floor"},
		// The metrics endpoint: the node's own address, not every one.
		{"metrics on every address in the ConfigMap", "deploy/kubernetes/justitiad.toml", `metrics = "127.0.0.1:9464"`, `metrics = "0.0.0.0:9464"`, "every address"},
		{"metrics flag on every address", "deploy/kubernetes/daemonset.yaml", `"--metrics", "$(HOST_IP):9464"`, `"--metrics", "[::]:9464"`, "every address"},
		{"metrics flag dropped (loopback only)", "deploy/kubernetes/daemonset.yaml", `args: ["--metrics", "$(HOST_IP):9464", `, `args: [`, "loopback"},
		// The peer channel: identity, key, members, port.
		{"misspelt justitiad flag", "deploy/kubernetes/daemonset.yaml", `"--peer-node", "$(HOST_IP)"`, `"--peer-nod", "$(HOST_IP)"`, "--peer-nod"},
		{"node id from the node name", "deploy/kubernetes/daemonset.yaml", "fieldPath: status.hostIP", "fieldPath: spec.nodeName", "node-a"},
		{"node id not the node's address", "deploy/kubernetes/daemonset.yaml", `"--peer-node", "$(HOST_IP)"`, `"--peer-node", "10.0.0.1"`, "--peer-node must be $(HOST_IP)"},
		{"peer port declared as TCP", "deploy/kubernetes/daemonset.yaml", "              containerPort: 7471\n              protocol: UDP\n", "              containerPort: 7471\n              protocol: TCP\n", "no UDP containerPort 7471"},
		{"peer port declared apart from peer.port", "deploy/kubernetes/daemonset.yaml", "containerPort: 7471", "containerPort: 7472", "peer.port"},
		{"peer channel listening on another port", "deploy/kubernetes/justitiad.toml", "[peer]\nkey_file", "[peer]\nlisten = \"0.0.0.0:7472\"\nkey_file", "peer.port 7471"},
		{"key written with the default umask", "deploy/kubernetes/daemonset.yaml", "              umask 077\n", "", "mode 0644"},
		{"key in an emptyDir", "deploy/kubernetes/daemonset.yaml", "        - name: peer-key\n          hostPath:\n            path: /var/lib/justitia-peer\n            type: DirectoryOrCreate\n", "        - name: peer-key\n          emptyDir: {}\n", "not a host path"},
		{"daemon's key mount writable", "deploy/kubernetes/daemonset.yaml", "              mountPath: /var/lib/justitia-peer\n              readOnly: true\n", "              mountPath: /var/lib/justitia-peer\n", "readOnly"},
		{"key step keeps the key elsewhere", "deploy/kubernetes/daemonset.yaml", "mv /var/lib/justitia-peer/.peer.key.new /var/lib/justitia-peer/peer.key", "mv /var/lib/justitia-peer/.peer.key.new /var/lib/justitia-peer/node.key", "no such file"},
		{"public key not published", "deploy/kubernetes/daemonset.yaml", " > /dev/termination-log", "", "termination message"},
		{"member list mounted away from members_file", "deploy/kubernetes/daemonset.yaml", "              mountPath: /etc/justitia-peer\n", "              mountPath: /etc/justitia-members\n", "not where its ConfigMap is mounted"},
		{"member list required before the pod starts", "deploy/kubernetes/daemonset.yaml", "            optional: true\n", "            optional: false\n", "not optional"},
		{"members listed by hand", "deploy/kubernetes/justitiad.toml", `members_file = "/etc/justitia-peer/members.toml"`, "[peer.members]", "set members_file"},
		{"render script reads another step's message", "deploy/kubernetes/peer-members.sh", `@.name=="peer-key"`, `@.name=="key"`, "no justitiad pod has published a key"},
		{"render script applies another ConfigMap", "deploy/kubernetes/peer-members.sh", "create configmap justitia-peer-members", "create configmap justitia-members", "does not mount"},
		{"configuration value justitiad refuses", "deploy/kubernetes/justitiad.toml", "ref_period_us = 500", "ref_period_us = 0", "justitiad --check"},
		{"configuration key justitiad does not know", "deploy/kubernetes/justitiad.toml", `target = "2x"`, `target = "2x"
targte = "3x"`, "targte"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := copyRepo(t)
			path := filepath.Join(root, c.file)
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(data), c.old) {
				t.Fatalf("%s no longer contains %q", c.file, c.old)
			}
			if err := os.WriteFile(path, []byte(strings.Replace(string(data), c.old, c.new, 1)), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err = checkRepo(root, bins)
			if err == nil {
				t.Fatalf("accepted")
			}
			if !strings.Contains(strings.ToLower(err.Error()), strings.ToLower(c.want)) {
				t.Fatalf("refused, but the error does not name %q: %v", c.want, err)
			}
		})
	}
}

const goodSpec = `{
  "cdiVersion": "1.1.0",
  "kind": "justitia.io/rdma",
  "containerEdits": {"deviceNodes": [{"path": "/dev/infiniband/rdma_cm"}]},
  "devices": [
    {"name": "rxe0", "containerEdits": {
      "env": ["LD_PRELOAD=/opt/justitia/libjustitia.so", "JUSTITIA_CLASS=auto"],
      "deviceNodes": [{"path": "/dev/infiniband/uverbs0"}],
      "mounts": [{"hostPath": "/var/lib/justitia/libjustitia.so", "containerPath": "/opt/justitia/libjustitia.so", "options": ["ro", "bind"]}]
    }}
  ]
}
`

func TestCDISpecs(t *testing.T) {
	cases := []struct {
		name, old, new, want string
	}{
		{"good", "", "", ""},
		{"misspelt field", `"deviceNodes": [{"path": "/dev/infiniband/uverbs0"}]`, `"deviceNode": [{"path": "/dev/infiniband/uverbs0"}]`, "deviceNode"},
		{"bad device name", `"name": "rxe0"`, `"name": "rxe 0"`, "rxe 0"},
		{"kind without a class", `"kind": "justitia.io/rdma"`, `"kind": "justitia.io"`, "vendor"},
		{"unknown version", `"cdiVersion": "1.1.0"`, `"cdiVersion": "9.0.0"`, "9.0.0"},
		{"env without a value", `"JUSTITIA_CLASS=auto"`, `"JUSTITIA_CLASS"`, "JUSTITIA_CLASS"},
		{"mount without a container path", `"containerPath": "/opt/justitia/libjustitia.so", `, "", "container path"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if !strings.Contains(goodSpec, c.old) {
				t.Fatalf("the good spec no longer contains %q", c.old)
			}
			path := filepath.Join(t.TempDir(), "justitia.json")
			if err := os.WriteFile(path, []byte(strings.Replace(goodSpec, c.old, c.new, 1)), 0o644); err != nil {
				t.Fatal(err)
			}
			summary, err := checkCDISpec(path)
			if c.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(summary, "1 devices") {
					t.Fatalf("unexpected summary %q", summary)
				}
				return
			}
			if err == nil {
				t.Fatalf("accepted")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("refused, but the error does not name %q: %v", c.want, err)
			}
		})
	}
}
