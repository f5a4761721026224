package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The repository's own files pass.
func TestTheRepositoryPasses(t *testing.T) {
	report, err := checkRepo("../..")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(report, "3 objects") {
		t.Fatalf("unexpected report:\n%s", report)
	}
}

// copyRepo copies the files checkRepo reads into a scratch root.
func copyRepo(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	for _, f := range []string{
		"deploy/kubernetes/kustomization.yaml", "deploy/kubernetes/daemonset.yaml",
		"deploy/kubernetes/justitiad.toml", "deploy/Dockerfile", "packaging/justitiad.toml",
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

// Each broken input, made by one replacement in one file, is refused with an error that
// names what is wrong.
func TestBrokenInputsAreRefused(t *testing.T) {
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
		{"tenants by uid", "deploy/kubernetes/justitiad.toml", `tenant = "cgroup"`, `tenant = "uid"`, "cgroups"},
		{"Dockerfile flag misspelt", "deploy/Dockerfile", "COPY --from=build", "COPY --form=build", "form"},
		{"Dockerfile unknown instruction", "deploy/Dockerfile", "WORKDIR /src", "WORKDIRR /src", "workdirr"},
		{"Dockerfile copies from no stage", "deploy/Dockerfile", "COPY --from=build", "COPY --from=builder", "builder"},
		{"Dockerfile runs as root", "deploy/Dockerfile", "USER 65532:65532", "USER root", "root"},
		{"Dockerfile leaves the shaper out", "deploy/Dockerfile", "/out/usr/lib/justitia/libjustitia.so", "/out/usr/lib/libjustitia.so", "/usr/lib/justitia/libjustitia.so"},
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
			_, err = checkRepo(root)
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
