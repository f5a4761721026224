package main

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// checkRepo checks deploy/kubernetes, its configuration copy and deploy/Dockerfile under
// root, running the install step and justitiad's own configuration check with the
// binaries in binDir (justitia, justitiad), and returns one line per check.
func checkRepo(root, binDir string) (string, error) {
	var report strings.Builder
	objects, err := buildKustomization(filepath.Join(root, "deploy", "kubernetes"))
	if err != nil {
		return "", err
	}
	fmt.Fprintf(&report, "kustomize build deploy/kubernetes: %d objects, each decoded strictly\n", len(objects.daemonSets)+len(objects.configMaps))
	scratch, err := os.MkdirTemp("", "deploy-validate")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(scratch)
	specPath, err := checkDeployment(objects, binDir, scratch)
	if err != nil {
		return "", fmt.Errorf("deploy/kubernetes: %w", err)
	}
	fmt.Fprintf(&report, "deploy/kubernetes: the DaemonSet's mounts, probes, ports, security settings and RDMA resource agree with its configuration; justitiad --check accepts the ConfigMap\n")
	fmt.Fprintf(&report, "deploy/kubernetes: the install step runs, writes %s, and every file the spec binds is on the host\n", specPath)
	packaged, err := os.ReadFile(filepath.Join(root, "packaging", "justitiad.toml"))
	if err != nil {
		return "", err
	}
	copied, err := os.ReadFile(filepath.Join(root, "deploy", "kubernetes", "justitiad.toml"))
	if err != nil {
		return "", err
	}
	if err := checkConfigCopy(string(packaged), string(copied)); err != nil {
		return "", fmt.Errorf("deploy/kubernetes/justitiad.toml: %w", err)
	}
	fmt.Fprintf(&report, "deploy/kubernetes/justitiad.toml: packaging/justitiad.toml with only the pod's keys changed\n")
	dockerfile, err := os.ReadFile(filepath.Join(root, "deploy", "Dockerfile"))
	if err != nil {
		return "", err
	}
	summary, err := checkDockerfile(dockerfile, objects)
	if err != nil {
		return "", fmt.Errorf("deploy/Dockerfile: %w", err)
	}
	fmt.Fprintf(&report, "deploy/Dockerfile: %s\n", summary)
	return report.String(), nil
}

// The objects a kustomize build gave, by kind.
type builtObjects struct {
	daemonSets []appsv1.DaemonSet
	configMaps []corev1.ConfigMap
}

// buildKustomization runs kustomize (the library kubectl apply -k uses) on dir and decodes
// every object it gives strictly into its API type. Kinds the deployment does not use are
// errors too.
func buildKustomization(dir string) (*builtObjects, error) {
	kustomizer := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	resources, err := kustomizer.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	out := &builtObjects{}
	for _, r := range resources.Resources() {
		data, err := r.AsYAML()
		if err != nil {
			return nil, err
		}
		id := fmt.Sprintf("%s %s", r.GetKind(), r.GetName())
		switch r.GetKind() {
		case "DaemonSet":
			var ds appsv1.DaemonSet
			if err := strictDecode(data, &ds, r.GetApiVersion(), "apps/v1"); err != nil {
				return nil, fmt.Errorf("%s: %w", id, err)
			}
			out.daemonSets = append(out.daemonSets, ds)
		case "ConfigMap":
			var cm corev1.ConfigMap
			if err := strictDecode(data, &cm, r.GetApiVersion(), "v1"); err != nil {
				return nil, fmt.Errorf("%s: %w", id, err)
			}
			out.configMaps = append(out.configMaps, cm)
		default:
			return nil, fmt.Errorf("%s: a kind this check does not know (add its API type here)", id)
		}
	}
	return out, nil
}

// strictDecode decodes YAML into an API type, refusing unknown and duplicate fields.
func strictDecode(data []byte, into any, apiVersion, want string) error {
	if apiVersion != want {
		return fmt.Errorf("apiVersion %q, expected %q", apiVersion, want)
	}
	return yaml.UnmarshalStrict(data, into)
}

// checkDeployment checks what the API types cannot: that the DaemonSet's parts agree with
// each other and with the configuration it mounts, that its security settings are those
// the README promises, and, by running them in scratch, that its install step writes a
// spec runtimes read whose files are on the host and that justitiad accepts its
// configuration. It returns where the spec lands on the host.
func checkDeployment(o *builtObjects, binDir, scratch string) (string, error) {
	if len(o.daemonSets) != 1 {
		return "", fmt.Errorf("%d DaemonSets, expected 1", len(o.daemonSets))
	}
	ds := o.daemonSets[0]
	pod := ds.Spec.Template.Spec
	if !pod.HostNetwork || !pod.HostPID {
		return "", fmt.Errorf("hostNetwork and hostPID must be true (the probe uses the node's port; shapers' pids are the host's)")
	}
	if pod.PriorityClassName == "" {
		return "", fmt.Errorf("no priorityClassName: the daemon could be evicted before the pods it protects")
	}
	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = v
	}
	configMaps := map[string]corev1.ConfigMap{}
	for _, cm := range o.configMaps {
		configMaps[cm.Name] = cm
	}
	all := append(append([]corev1.Container(nil), pod.InitContainers...), pod.Containers...)
	for _, c := range all {
		for _, m := range c.VolumeMounts {
			if _, ok := volumes[m.Name]; !ok {
				return "", fmt.Errorf("container %s mounts volume %q, which the pod does not have", c.Name, m.Name)
			}
		}
		for _, e := range c.Env {
			if ref := e.ValueFrom; ref != nil && ref.ConfigMapKeyRef != nil {
				cm, ok := configMaps[ref.ConfigMapKeyRef.Name]
				if !ok {
					return "", fmt.Errorf("container %s: env %s names ConfigMap %q, which the build does not make", c.Name, e.Name, ref.ConfigMapKeyRef.Name)
				}
				if _, ok := cm.Data[ref.ConfigMapKeyRef.Key]; !ok {
					return "", fmt.Errorf("container %s: env %s names key %q, which ConfigMap %s lacks", c.Name, e.Name, ref.ConfigMapKeyRef.Key, cm.Name)
				}
			}
		}
		if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
			return "", fmt.Errorf("container %s: CPU and memory requests and a memory limit are required", c.Name)
		}
		sc := c.SecurityContext
		if sc == nil || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
			return "", fmt.Errorf("container %s: capabilities must drop ALL", c.Name)
		}
		if sc.Privileged != nil && *sc.Privileged {
			return "", fmt.Errorf("container %s: privileged", c.Name)
		}
		for _, add := range sc.Capabilities.Add {
			if add != "IPC_LOCK" || c.Name != "justitiad" {
				return "", fmt.Errorf("container %s adds capability %s: only justitiad adds one, IPC_LOCK", c.Name, add)
			}
		}
	}
	daemon := findContainer(pod.Containers, "justitiad")
	if daemon == nil {
		return "", fmt.Errorf("no container named justitiad")
	}
	// The configuration: a ConfigMap volume mounted as a directory (a subPath mount would
	// never see an update), at the directory of --config.
	configPath := argAfter(daemon.Command, "--config")
	if configPath == "" {
		return "", fmt.Errorf("justitiad has no --config argument")
	}
	var config map[string]string
	var configText string
	for _, m := range daemon.VolumeMounts {
		v := volumes[m.Name]
		if v.ConfigMap == nil {
			continue
		}
		if m.SubPath != "" || m.SubPathExpr != "" {
			return "", fmt.Errorf("the configuration is mounted with subPath: the daemon would never see it change")
		}
		if m.MountPath != path.Dir(configPath) {
			return "", fmt.Errorf("the configuration is mounted at %s, but --config is %s", m.MountPath, configPath)
		}
		cm, ok := configMaps[v.ConfigMap.Name]
		if !ok {
			return "", fmt.Errorf("volume %s names ConfigMap %q, which the build does not make", v.Name, v.ConfigMap.Name)
		}
		text, ok := cm.Data[path.Base(configPath)]
		if !ok {
			return "", fmt.Errorf("ConfigMap %s has no key %s", cm.Name, path.Base(configPath))
		}
		config = topLevelKeys(text)
		configText = text
	}
	if config == nil {
		return "", fmt.Errorf("justitiad mounts no ConfigMap")
	}
	socket, admin, metrics := config["socket"], config["admin_socket"], config["metrics"]
	if socket == "" || admin == "" || metrics == "" {
		return "", fmt.Errorf("the configuration must set socket, admin_socket and metrics")
	}
	if path.Dir(socket) == path.Dir(admin) {
		return "", fmt.Errorf("admin_socket %s is in the registration socket's directory, which the CDI spec binds into containers", admin)
	}
	for _, dir := range []string{path.Dir(socket), path.Dir(admin)} {
		if !hostPathMountedAt(*daemon, volumes, dir) {
			return "", fmt.Errorf("justitiad does not mount a host directory at %s, where its configuration puts a socket", dir)
		}
	}
	for _, probe := range []*corev1.Probe{daemon.LivenessProbe, daemon.StartupProbe} {
		if probe == nil || probe.Exec == nil {
			return "", fmt.Errorf("justitiad needs a startup and a liveness probe, each asking the daemon (exec)")
		}
		if got := argAfter(probe.Exec.Command, "--socket"); got != admin {
			return "", fmt.Errorf("a probe asks %q, but admin_socket is %s", got, admin)
		}
	}
	_, port, ok := strings.Cut(metrics, ":")
	if !ok {
		return "", fmt.Errorf("metrics %q has no port", metrics)
	}
	if ds.Spec.Template.Annotations["prometheus.io/port"] != port {
		return "", fmt.Errorf("prometheus.io/port is %q, the metrics port %s", ds.Spec.Template.Annotations["prometheus.io/port"], port)
	}
	if !slices.ContainsFunc(daemon.Ports, func(p corev1.ContainerPort) bool { return strconv.Itoa(int(p.ContainerPort)) == port }) {
		return "", fmt.Errorf("justitiad declares no containerPort %s (metrics)", port)
	}
	if err := checkSecurity(pod); err != nil {
		return "", err
	}
	if err := checkRDMAResource(*daemon); err != nil {
		return "", err
	}
	if err := checkDaemonConfig(configText, binDir, scratch); err != nil {
		return "", err
	}
	install := findContainer(pod.InitContainers, "install")
	if install == nil {
		return "", fmt.Errorf("no init container named install (it puts the shaper and the CDI spec on the host)")
	}
	hostRoot, err := runInstall(*install, volumes, configMaps, binDir, scratch)
	if err != nil {
		return "", err
	}
	specPath, spec, err := cdiSpecOnHost(hostRoot)
	if err != nil {
		return "", err
	}
	if err := checkSpecAgainstHost(spec, hostRoot, socket); err != nil {
		return "", fmt.Errorf("%s: %w", specPath, err)
	}
	return specPath, nil
}

func findContainer(cs []corev1.Container, name string) *corev1.Container {
	for i := range cs {
		if cs[i].Name == name {
			return &cs[i]
		}
	}
	return nil
}

// argAfter is the argument after flag in args, or "".
func argAfter(args []string, flag string) string {
	for i, a := range args {
		if a == flag && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

func hostPathMountedAt(c corev1.Container, volumes map[string]corev1.Volume, dir string) bool {
	for _, m := range c.VolumeMounts {
		if v := volumes[m.Name]; v.HostPath != nil && m.MountPath == dir && v.HostPath.Path == dir {
			return true
		}
	}
	return false
}

// topLevelKeys reads the `key = value` lines of a TOML text before its first table, the
// quotes taken off string values. justitiad's configuration is flat apart from [weights].
func topLevelKeys(text string) map[string]string {
	keys := map[string]string{}
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "[") {
			break
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if ok {
			keys[strings.TrimSpace(k)] = strings.Trim(strings.TrimSpace(v), `"`)
		}
	}
	return keys
}

// The keys the Kubernetes copy changes, and those an operator sets there.
var podKeys = []string{"admin_socket", "metrics", "tenant"}
var operatorKeys = []string{"target", "ref_period_us"}

const copyMarker = "# ---"

// checkConfigCopy: below its marker line the copy is the packaged file, line for line,
// except the lines of podKeys and operatorKeys, up to [weights] (whose entries are the
// operator's).
func checkConfigCopy(packaged, copied string) error {
	_, body, ok := strings.Cut(copied, "\n"+copyMarker+"\n")
	if !ok {
		return fmt.Errorf("no %q line between the header and the packaged file", copyMarker)
	}
	comparable := func(text string) []string {
		var lines []string
		for _, line := range strings.Split(text, "\n") {
			k, _, _ := strings.Cut(line, "=")
			k = strings.TrimSpace(k)
			if strings.Contains(line, "=") && !strings.HasPrefix(line, "#") && (slices.Contains(podKeys, k) || slices.Contains(operatorKeys, k)) {
				lines = append(lines, k+" = (set here)")
				continue
			}
			lines = append(lines, line)
			if strings.TrimSpace(line) == "[weights]" {
				break
			}
		}
		return lines
	}
	want, got := comparable(packaged), comparable(body)
	for i := 0; i < len(want) || i < len(got); i++ {
		var w, g string
		if i < len(want) {
			w = want[i]
		}
		if i < len(got) {
			g = got[i]
		}
		if w != g {
			return fmt.Errorf("differs from packaging/justitiad.toml at its line %d: %q here, %q there (only %s may differ, and [weights])",
				i+1, g, w, strings.Join(append(append([]string(nil), podKeys...), operatorKeys...), ", "))
		}
	}
	keys := topLevelKeys(body)
	if keys["tenant"] != "cgroup" {
		return fmt.Errorf("tenant = %q: in a cluster most containers run as uid 0, so tenants must be cgroups", keys["tenant"])
	}
	return nil
}
