package main

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"slices"
	"strings"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	admissionv1 "k8s.io/api/admissionregistration/v1"
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
	fmt.Fprintf(&report, "kustomize build deploy/kubernetes: %d objects, each decoded strictly\n", len(objects.daemonSets)+len(objects.configMaps)+len(objects.serviceAccounts)+len(objects.policies)+len(objects.bindings))
	scratch, err := os.MkdirTemp("", "deploy-validate")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(scratch)
	specPath, err := checkDeployment(objects, root, binDir, scratch)
	if err != nil {
		return "", fmt.Errorf("deploy/kubernetes: %w", err)
	}
	fmt.Fprintf(&report, "deploy/kubernetes: the DaemonSet's mounts, probes, ports, security settings and RDMA resource agree with its configuration; justitiad --check accepts the ConfigMap\n")
	fmt.Fprintf(&report, "deploy/kubernetes: the install step runs, writes %s, and every file the spec binds is on the host\n", specPath)
	fmt.Fprintf(&report, "deploy/kubernetes: justitiad runs its pod's command line: metrics on the node's address alone; the peer channel's key made on the node (mode 0600, a host path), the list %s renders read from members_file and naming the node (--peer-node $(HOST_IP)) with its key, its UDP port declared\n", membersScript)
	if len(objects.podMonitors) != 0 {
		return "", fmt.Errorf("deploy/kubernetes: a PodMonitor in the base, which clusters without the Prometheus operator refuse")
	}
	monitored, err := buildKustomization(filepath.Join(root, "deploy", "with-monitoring"))
	if err != nil {
		return "", err
	}
	if err := checkPodMonitor(monitored); err != nil {
		return "", fmt.Errorf("deploy/with-monitoring: %w", err)
	}
	fmt.Fprintf(&report, "deploy/with-monitoring: the base and a PodMonitor selecting justitiad's pods and scraping its metrics port\n")
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
	daemonSets      []appsv1.DaemonSet
	configMaps      []corev1.ConfigMap
	serviceAccounts []corev1.ServiceAccount
	policies        []admissionv1.ValidatingAdmissionPolicy
	bindings        []admissionv1.ValidatingAdmissionPolicyBinding
	podMonitors     []monitoringv1.PodMonitor
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
		case "ServiceAccount":
			var sa corev1.ServiceAccount
			if err := strictDecode(data, &sa, r.GetApiVersion(), "v1"); err != nil {
				return nil, fmt.Errorf("%s: %w", id, err)
			}
			out.serviceAccounts = append(out.serviceAccounts, sa)
		case "ValidatingAdmissionPolicy":
			var p admissionv1.ValidatingAdmissionPolicy
			if err := strictDecode(data, &p, r.GetApiVersion(), "admissionregistration.k8s.io/v1"); err != nil {
				return nil, fmt.Errorf("%s: %w", id, err)
			}
			out.policies = append(out.policies, p)
		case "ValidatingAdmissionPolicyBinding":
			var b admissionv1.ValidatingAdmissionPolicyBinding
			if err := strictDecode(data, &b, r.GetApiVersion(), "admissionregistration.k8s.io/v1"); err != nil {
				return nil, fmt.Errorf("%s: %w", id, err)
			}
			out.bindings = append(out.bindings, b)
		case "PodMonitor":
			var pm monitoringv1.PodMonitor
			if err := strictDecode(data, &pm, r.GetApiVersion(), "monitoring.coreos.com/v1"); err != nil {
				return nil, fmt.Errorf("%s: %w", id, err)
			}
			out.podMonitors = append(out.podMonitors, pm)
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

// checkDeployment checks what the API types cannot: that the DaemonSets' parts agree with
// each other and with the configuration they mount, that their security settings are
// those the README promises, and, by running them in scratch, that the install step
// writes a spec runtimes read and the files the device plugin hands out, that the plugin
// and justitiad accept their settings, and that the admission policy admits justitiad and
// refuses what it must. It returns where the spec lands on the host.
func checkDeployment(o *builtObjects, root, binDir, scratch string) (string, error) {
	if len(o.daemonSets) != 2 {
		return "", fmt.Errorf("%d DaemonSets, expected 2 (justitiad, justitia-device-plugin)", len(o.daemonSets))
	}
	daemonDS, pluginDS := findDaemonSet(o, "justitiad"), findDaemonSet(o, "justitia-device-plugin")
	if daemonDS == nil || pluginDS == nil {
		return "", fmt.Errorf("expected the DaemonSets justitiad and justitia-device-plugin")
	}
	configMaps := map[string]corev1.ConfigMap{}
	for _, cm := range o.configMaps {
		configMaps[cm.Name] = cm
	}
	for _, ds := range []*appsv1.DaemonSet{daemonDS, pluginDS} {
		if err := checkPodBasics(ds, configMaps); err != nil {
			return "", fmt.Errorf("DaemonSet %s: %w", ds.Name, err)
		}
	}
	if !reflect.DeepEqual(daemonDS.Spec.Template.Spec.NodeSelector, pluginDS.Spec.Template.Spec.NodeSelector) {
		return "", fmt.Errorf("the DaemonSets select different nodes (%v, %v): a node would hand out the shaper without a daemon, or the reverse",
			daemonDS.Spec.Template.Spec.NodeSelector, pluginDS.Spec.Template.Spec.NodeSelector)
	}
	daemon, err := checkDaemon(daemonDS, configMaps, root, binDir, scratch)
	if err != nil {
		return "", fmt.Errorf("DaemonSet justitiad: %w", err)
	}
	plugin, specPath, err := checkPlugin(pluginDS, configMaps, daemon, binDir, scratch)
	if err != nil {
		return "", fmt.Errorf("DaemonSet justitia-device-plugin: %w", err)
	}
	if err := checkDaemonResource(daemonDS, plugin); err != nil {
		return "", fmt.Errorf("DaemonSet justitiad: %w", err)
	}
	if err := checkAdmission(o, daemonDS, plugin); err != nil {
		return "", err
	}
	return specPath, nil
}

func findDaemonSet(o *builtObjects, name string) *appsv1.DaemonSet {
	for i := range o.daemonSets {
		if o.daemonSets[i].Name == name {
			return &o.daemonSets[i]
		}
	}
	return nil
}

// podVolumes indexes a pod's volumes by name.
func podVolumes(pod corev1.PodSpec) map[string]corev1.Volume {
	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = v
	}
	return volumes
}

// checkPodBasics checks what every pod of the deployment needs: a priority class, volumes
// and ConfigMap keys that exist, resources, capabilities dropped, not privileged, and the
// security settings of checkSecurity.
func checkPodBasics(ds *appsv1.DaemonSet, configMaps map[string]corev1.ConfigMap) error {
	pod := ds.Spec.Template.Spec
	if pod.PriorityClassName == "" {
		return fmt.Errorf("no priorityClassName: it could be evicted before the pods it serves")
	}
	volumes := podVolumes(pod)
	for _, c := range append(append([]corev1.Container(nil), pod.InitContainers...), pod.Containers...) {
		for _, m := range c.VolumeMounts {
			if _, ok := volumes[m.Name]; !ok {
				return fmt.Errorf("container %s mounts volume %q, which the pod does not have", c.Name, m.Name)
			}
		}
		for _, e := range c.Env {
			if ref := e.ValueFrom; ref != nil && ref.ConfigMapKeyRef != nil {
				cm, ok := configMaps[ref.ConfigMapKeyRef.Name]
				if !ok {
					return fmt.Errorf("container %s: env %s names ConfigMap %q, which the build does not make", c.Name, e.Name, ref.ConfigMapKeyRef.Name)
				}
				if _, ok := cm.Data[ref.ConfigMapKeyRef.Key]; !ok {
					return fmt.Errorf("container %s: env %s names key %q, which ConfigMap %s lacks", c.Name, e.Name, ref.ConfigMapKeyRef.Key, cm.Name)
				}
			}
		}
		if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
			return fmt.Errorf("container %s: CPU and memory requests and a memory limit are required", c.Name)
		}
		sc := c.SecurityContext
		if sc == nil || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
			return fmt.Errorf("container %s: capabilities must drop ALL", c.Name)
		}
		if sc.Privileged != nil && *sc.Privileged {
			return fmt.Errorf("container %s: privileged", c.Name)
		}
		for _, add := range sc.Capabilities.Add {
			if add != "IPC_LOCK" || c.Name != "justitiad" {
				return fmt.Errorf("container %s adds capability %s: only justitiad adds one, IPC_LOCK", c.Name, add)
			}
		}
	}
	return checkSecurity(pod)
}

// daemonSettings is what the rest of the deployment must agree with in justitiad's.
type daemonSettings struct {
	socket string // the registration socket
}

// checkDaemon checks justitiad's pod against its configuration, and has justitiad check
// that configuration with the pod's command line (runDaemonCheck), the peer channel's key
// and member list made as the pod and peer-members.sh make them.
func checkDaemon(ds *appsv1.DaemonSet, configMaps map[string]corev1.ConfigMap, root, binDir, scratch string) (*daemonSettings, error) {
	pod := ds.Spec.Template.Spec
	if !pod.HostNetwork || !pod.HostPID {
		return nil, fmt.Errorf("hostNetwork and hostPID must be true (the probe uses the node's port; shapers' pids are the host's)")
	}
	volumes := podVolumes(pod)
	daemon := findContainer(pod.Containers, "justitiad")
	if daemon == nil {
		return nil, fmt.Errorf("no container named justitiad")
	}
	if daemon.SecurityContext.Capabilities == nil || !slices.Contains(daemon.SecurityContext.Capabilities.Add, "IPC_LOCK") {
		return nil, fmt.Errorf("justitiad must add capability IPC_LOCK: it pins the reference flow's memory whatever the node's memlock limit")
	}
	// The configuration: a ConfigMap volume mounted as a directory (a subPath mount would
	// never see an update), at the directory of --config.
	configPath := argAfter(append(append([]string(nil), daemon.Command...), daemon.Args...), "--config")
	if configPath == "" {
		return nil, fmt.Errorf("justitiad has no --config argument")
	}
	var config map[string]string
	for _, m := range daemon.VolumeMounts {
		v := volumes[m.Name]
		if v.ConfigMap == nil {
			continue
		}
		if m.SubPath != "" || m.SubPathExpr != "" {
			return nil, fmt.Errorf("the configuration is mounted with subPath: the daemon would never see it change")
		}
		if m.MountPath != path.Dir(configPath) {
			continue
		}
		cm, ok := configMaps[v.ConfigMap.Name]
		if !ok {
			return nil, fmt.Errorf("volume %s names ConfigMap %q, which the build does not make", v.Name, v.ConfigMap.Name)
		}
		text, ok := cm.Data[path.Base(configPath)]
		if !ok {
			return nil, fmt.Errorf("ConfigMap %s has no key %s", cm.Name, path.Base(configPath))
		}
		config = topLevelKeys(text)
	}
	if config == nil {
		return nil, fmt.Errorf("justitiad mounts no ConfigMap at %s, the directory of --config %s", path.Dir(configPath), configPath)
	}
	socket, admin, metrics := config["socket"], config["admin_socket"], config["metrics"]
	if socket == "" || admin == "" || metrics == "" {
		return nil, fmt.Errorf("the configuration must set socket, admin_socket and metrics")
	}
	if path.Dir(socket) == path.Dir(admin) {
		return nil, fmt.Errorf("admin_socket %s is in the registration socket's directory, which the CDI spec binds into containers", admin)
	}
	for _, dir := range []string{path.Dir(socket), path.Dir(admin)} {
		if !hostPathMountedAt(*daemon, volumes, dir) {
			return nil, fmt.Errorf("justitiad does not mount a host directory at %s, where its configuration puts a socket", dir)
		}
	}
	// Pods are named (tenants and weights by namespace and pod) from kubelet's log
	// directories, which the daemon must see at the configured path.
	podLogs := config["pod_logs_dir"]
	if podLogs == "" {
		podLogs = "/var/log/pods"
	}
	if !hostPathMountedAt(*daemon, volumes, podLogs) {
		return nil, fmt.Errorf("justitiad does not mount the host's %s, where kubelet names the pods (pod_logs_dir)", podLogs)
	}
	for _, probe := range []*corev1.Probe{daemon.LivenessProbe, daemon.StartupProbe} {
		if probe == nil || probe.Exec == nil {
			return nil, fmt.Errorf("justitiad needs a startup and a liveness probe, each asking the daemon (exec)")
		}
		if got := argAfter(probe.Exec.Command, "--socket"); got != admin {
			return nil, fmt.Errorf("a probe asks %q, but admin_socket is %s", got, admin)
		}
	}
	check, err := runDaemonCheck(root, pod, *daemon, configMaps, binDir, scratch)
	if err != nil {
		return nil, err
	}
	if err := checkMetricsAddress(ds, *daemon, metrics, check); err != nil {
		return nil, err
	}
	if err := checkPeer(pod, *daemon, check); err != nil {
		return nil, err
	}
	return &daemonSettings{socket: socket}, nil
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
	if keys["tenant"] != "pod" && keys["tenant"] != "namespace" {
		return fmt.Errorf("tenant = %q: in a cluster most containers run as uid 0, so tenants must be pods or namespaces", keys["tenant"])
	}
	return nil
}

// checkPodMonitor checks the monitoring overlay: the base's objects and one PodMonitor,
// in the base's namespace, whose selector matches justitiad's pods and whose endpoints
// name a port justitiad declares.
func checkPodMonitor(o *builtObjects) error {
	if len(o.podMonitors) != 1 {
		return fmt.Errorf("%d PodMonitors, expected 1", len(o.podMonitors))
	}
	pm := o.podMonitors[0]
	ds := findDaemonSet(o, "justitiad")
	if ds == nil {
		return fmt.Errorf("no DaemonSet justitiad beside the PodMonitor")
	}
	if pm.Namespace != ds.Namespace {
		return fmt.Errorf("the PodMonitor is in namespace %q, justitiad in %q (a PodMonitor selects pods of its own namespace unless told otherwise)", pm.Namespace, ds.Namespace)
	}
	labels := ds.Spec.Template.Labels
	for k, v := range pm.Spec.Selector.MatchLabels {
		if labels[k] != v {
			return fmt.Errorf("the PodMonitor selects %s=%s, which justitiad's pods do not carry", k, v)
		}
	}
	if len(pm.Spec.Selector.MatchLabels) == 0 && len(pm.Spec.Selector.MatchExpressions) == 0 {
		return fmt.Errorf("the PodMonitor selects every pod of the namespace")
	}
	daemon := findContainer(ds.Spec.Template.Spec.Containers, "justitiad")
	if len(pm.Spec.PodMetricsEndpoints) == 0 {
		return fmt.Errorf("the PodMonitor has no endpoint")
	}
	for _, e := range pm.Spec.PodMetricsEndpoints {
		if e.Port == nil || !slices.ContainsFunc(daemon.Ports, func(p corev1.ContainerPort) bool { return p.Name == *e.Port }) {
			return fmt.Errorf("a PodMonitor endpoint scrapes port %v, which justitiad does not name", e.Port)
		}
		if e.Path != "" && e.Path != "/metrics" {
			return fmt.Errorf("a PodMonitor endpoint scrapes %s; justitiad serves /metrics", e.Path)
		}
	}
	return nil
}
