package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// The values the downward API gives a pod's fields here: a node at 192.0.2.10 (a
// host-network pod's own address is the node's).
var sampleFields = map[string]string{
	"status.hostIP":      "192.0.2.10",
	"status.podIP":       "192.0.2.10",
	"spec.nodeName":      "node-a",
	"metadata.name":      "justitiad-abcde",
	"metadata.namespace": "kube-system",
}

// The render script of the peer channel's member list, beside the manifests.
const membersScript = "deploy/kubernetes/peer-members.sh"

// A scratch node: each host path a container mounts is a directory under host, each
// ConfigMap volume a directory holding its keys, each emptyDir one of its own.
type scratchNode struct {
	root       string
	configMaps map[string]map[string]string // by name: what the build (or the render script) makes
}

// dirFor is the scratch directory of volume v.
func (n *scratchNode) dirFor(v corev1.Volume) (string, error) {
	switch {
	case v.HostPath != nil:
		return filepath.Join(n.root, "host", v.HostPath.Path), nil
	case v.ConfigMap != nil:
		return filepath.Join(n.root, "configmap", v.Name), nil
	case v.EmptyDir != nil:
		return filepath.Join(n.root, "empty", v.Name), nil
	}
	return "", fmt.Errorf("volume %s: a kind this check does not map", v.Name)
}

// mount makes the scratch directories of c's mounts (a ConfigMap's keys written as files)
// and returns the replacements of each mount path by its directory, longest first.
func (n *scratchNode) mount(c corev1.Container, volumes map[string]corev1.Volume) ([]string, error) {
	mounts := append([]corev1.VolumeMount(nil), c.VolumeMounts...)
	slices.SortFunc(mounts, func(a, b corev1.VolumeMount) int { return len(b.MountPath) - len(a.MountPath) })
	var pairs []string
	for _, m := range mounts {
		v := volumes[m.Name]
		dir, err := n.dirFor(v)
		if err != nil {
			return nil, err
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		if v.ConfigMap != nil {
			for key, text := range n.configMaps[v.ConfigMap.Name] {
				if err := os.WriteFile(filepath.Join(dir, key), []byte(text), 0o644); err != nil {
					return nil, err
				}
			}
		}
		pairs = append(pairs, m.MountPath, dir)
	}
	return pairs, nil
}

// containerArgs is c's command line after its program, $(VAR) expanded as kubelet does
// (fields of the downward API as sampleFields).
func containerArgs(c corev1.Container, configMaps map[string]corev1.ConfigMap) []string {
	env := append([]corev1.EnvVar(nil), c.Env...)
	for i, e := range env {
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			env[i] = corev1.EnvVar{Name: e.Name, Value: sampleFields[e.ValueFrom.FieldRef.FieldPath]}
		}
	}
	return expandEnv(append(append([]string(nil), c.Command[1:]...), c.Args...), env, configMaps)
}

// daemonCheck is what justitiad --check reports of the configuration and command line the
// pod gives it.
type daemonCheck map[string]string

// runDaemonCheck runs justitiad's pod on a scratch node as the node would: its peer-key
// step (if the pod has one) writes the node's key into its host directory and the public
// key into its termination message; peer-members.sh, with a kubectl that answers for
// this node and one other, renders the member list into the ConfigMap it names; then
// justitiad runs the container's own command line, its $(VAR)s expanded and every mount
// path (in the arguments and in the configuration) its scratch directory, with --check.
func runDaemonCheck(root string, pod corev1.PodSpec, daemon corev1.Container, configMaps map[string]corev1.ConfigMap, binDir, scratch string) (daemonCheck, error) {
	volumes := podVolumes(pod)
	node := &scratchNode{root: filepath.Join(scratch, "node"), configMaps: map[string]map[string]string{}}
	for name, cm := range configMaps {
		node.configMaps[name] = cm.Data
	}
	bin := filepath.Join(scratch, "node-bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return nil, err
	}
	justitiad, err := filepath.Abs(filepath.Join(binDir, "justitiad"))
	if err != nil {
		return nil, err
	}
	if err := os.Symlink(justitiad, filepath.Join(bin, "justitiad")); err != nil && !os.IsExist(err) {
		return nil, err
	}
	var rendered map[string]string // the render script's ConfigMap: name and members.toml
	if init := findContainer(pod.InitContainers, "peer-key"); init != nil {
		publicKey, err := runKeyStep(*init, volumes, node, bin, scratch)
		if err != nil {
			return nil, err
		}
		rendered, err = renderMembers(root, init.Name, publicKey, bin, scratch)
		if err != nil {
			return nil, err
		}
		v, ok := configMapVolume(volumes, rendered["name"])
		if !ok {
			return nil, fmt.Errorf("%s makes ConfigMap %s, which justitiad's pod does not mount", membersScript, rendered["name"])
		}
		if v.ConfigMap.Optional == nil || !*v.ConfigMap.Optional {
			return nil, fmt.Errorf("volume %s (ConfigMap %s) is not optional: %s makes it from the keys the pods publish, so a pod must start without it", v.Name, rendered["name"], membersScript)
		}
		node.configMaps[rendered["name"]] = map[string]string{"members.toml": rendered["members.toml"]}
	}
	pairs, err := node.mount(daemon, volumes)
	if err != nil {
		return nil, err
	}
	r := strings.NewReplacer(pairs...)
	args := containerArgs(daemon, configMaps)
	for i, a := range args {
		args[i] = r.Replace(a)
	}
	// The configuration's paths (key_file, members_file) are the container's: rewritten.
	configPath := argAfter(args, "--config")
	if text, err := os.ReadFile(configPath); err == nil {
		if err := os.WriteFile(configPath, []byte(r.Replace(string(text))), 0o644); err != nil {
			return nil, err
		}
	}
	out, err := exec.Command(justitiad, append(args, "--check")...).CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("justitiad --check refuses the pod's command line or the ConfigMap's configuration: %s", strings.TrimSpace(string(out)))
	}
	check := daemonCheck{}
	for _, line := range strings.Split(string(out), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			check[k] = v
		}
	}
	if rendered != nil {
		check["rendered"] = rendered["count"]
	}
	// The container's own paths, for the checks that compare them with its mounts.
	unmap := strings.NewReplacer(reversePairs(pairs)...)
	for _, k := range []string{"peer.key_file", "peer.members_file"} {
		if v, ok := check[k]; ok {
			check[k] = unmap.Replace(v)
		}
	}
	return check, nil
}

func reversePairs(pairs []string) []string {
	out := make([]string, 0, len(pairs))
	for i := 0; i+1 < len(pairs); i += 2 {
		out = append(out, pairs[i+1], pairs[i])
	}
	return out
}

func configMapVolume(volumes map[string]corev1.Volume, name string) (corev1.Volume, bool) {
	for _, v := range volumes {
		if v.ConfigMap != nil && v.ConfigMap.Name == name {
			return v, true
		}
	}
	return corev1.Volume{}, false
}

// runKeyStep runs the peer-key init container's script on the scratch node (justitiad on
// PATH, /dev/termination-log a scratch file) and returns the termination message: the
// public key it published. Every file the script writes must be in one of its volumes.
func runKeyStep(c corev1.Container, volumes map[string]corev1.Volume, node *scratchNode, bin, scratch string) (string, error) {
	script, err := initScript(c)
	if err != nil {
		return "", err
	}
	pairs, err := node.mount(c, volumes)
	if err != nil {
		return "", err
	}
	termination := c.TerminationMessagePath
	if termination == "" {
		termination = "/dev/termination-log"
	}
	message := filepath.Join(scratch, "termination-log")
	pairs = append(pairs, termination, message)
	script = strings.NewReplacer(pairs...).Replace(script)
	for _, w := range writtenPaths(script) {
		if !strings.HasPrefix(w, scratch+"/") {
			return "", fmt.Errorf("init container %s: its script writes %s, which is in no volume it mounts (the root file system is read-only)", c.Name, w)
		}
	}
	cmd := exec.Command("/bin/sh", "-ec", script)
	cmd.Env = []string{"PATH=" + bin + ":/usr/bin:/bin"}
	cmd.Dir = scratch
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("init container %s: its script fails (%v): %s", c.Name, err, strings.TrimSpace(string(out)))
	}
	data, err := os.ReadFile(message)
	if err != nil || strings.TrimSpace(string(data)) == "" {
		return "", fmt.Errorf("init container %s publishes no public key in its termination message (%s), where %s reads it", c.Name, termination, membersScript)
	}
	return strings.TrimSpace(string(data)), nil
}

// renderMembers runs peer-members.sh with a kubectl that answers the pod list for this
// node (sampleFields' status.hostIP, publishing publicKey), another node and one whose key
// is not published yet, answering only a query that reads the termination message of the
// init container initName, and returns the ConfigMap it applies: its name, its
// members.toml and the count of members expected (2).
func renderMembers(root, initName, publicKey, bin, scratch string) (map[string]string, error) {
	dir := filepath.Join(scratch, "render")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	other, err := exec.Command("/bin/sh", "-ec", `"$1" genkey | "$1" pubkey`, "sh", filepath.Join(bin, "justitiad")).Output()
	if err != nil {
		return nil, fmt.Errorf("justitiad genkey | pubkey: %v", err)
	}
	pods := fmt.Sprintf("%s %s\n192.0.2.11 %s\n192.0.2.12 \n", sampleFields["status.hostIP"], publicKey, strings.TrimSpace(string(other)))
	if err := os.WriteFile(filepath.Join(dir, "pods"), []byte(pods), 0o644); err != nil {
		return nil, err
	}
	fake := `#!/bin/sh
dir=` + shellQuote(dir) + `
case " $* " in
  *" get pods "*)
    case "$*" in *'@.name=="` + initName + `"'*'.state.terminated.message'*) cat "$dir/pods" ;; esac ;;
  *" create configmap "*)
    prev=
    for a do
      [ "$prev" = configmap ] && printf '%s' "$a" > "$dir/name"
      case "$a" in --from-file=members.toml=*) cp "${a#--from-file=members.toml=}" "$dir/members.toml" ;; esac
      prev=$a
    done
    echo "kind: ConfigMap" ;;
  *" apply "*) cat > /dev/null ;;
  *) echo "kubectl (fake): unexpected call: $*" >&2; exit 1 ;;
esac
`
	kubectlBin := filepath.Join(scratch, "kubectl-bin")
	if err := os.MkdirAll(kubectlBin, 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(kubectlBin, "kubectl"), []byte(fake), 0o755); err != nil {
		return nil, err
	}
	cmd := exec.Command("/bin/sh", filepath.Join(root, membersScript))
	cmd.Env = []string{"PATH=" + kubectlBin + ":/usr/bin:/bin", "TMPDIR=" + dir}
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("%s fails (%v): %s", membersScript, err, strings.TrimSpace(string(out)))
	}
	name, err := os.ReadFile(filepath.Join(dir, "name"))
	if err != nil {
		return nil, fmt.Errorf("%s applied no ConfigMap", membersScript)
	}
	members, err := os.ReadFile(filepath.Join(dir, "members.toml"))
	if err != nil {
		return nil, fmt.Errorf("%s applied ConfigMap %s without a members.toml key", membersScript, name)
	}
	return map[string]string{"name": string(name), "members.toml": string(members), "count": "2"}, nil
}

func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// checkMetricsAddress checks the endpoint justitiad serves its metrics on (the file's
// value, and the one in effect with the command line's) against the pod: not every
// address of the node, reachable by Prometheus when the pod asks to be scraped, and on the
// port the pod declares and its annotation names.
func checkMetricsAddress(ds *appsv1.DaemonSet, daemon corev1.Container, fileValue string, check daemonCheck) error {
	everyAddress := func(v string) bool {
		host, _, err := net.SplitHostPort(v)
		if err != nil {
			return false
		}
		ip := net.ParseIP(host)
		return host == "" || (ip != nil && ip.IsUnspecified())
	}
	if everyAddress(fileValue) {
		return fmt.Errorf("metrics = %q in the ConfigMap: on every address of the node (the pod has the host's network); give the node's own with --metrics $(HOST_IP):PORT", fileValue)
	}
	metrics := check["metrics"]
	if metrics == "" || strings.HasPrefix(metrics, "unix:") {
		return fmt.Errorf("justitiad serves no TCP metrics endpoint (%q), which the pod's prometheus.io annotations promise", metrics)
	}
	if everyAddress(metrics) {
		return fmt.Errorf("justitiad's metrics on %s: on every address of the node (the pod has the host's network); give the node's own with --metrics $(HOST_IP):PORT", metrics)
	}
	host, port, err := net.SplitHostPort(metrics)
	if err != nil {
		return fmt.Errorf("metrics %q has no port", metrics)
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() && ds.Spec.Template.Annotations["prometheus.io/scrape"] == "true" {
		return fmt.Errorf("justitiad's metrics on %s, the loopback address, which Prometheus cannot reach from off the node (give --metrics $(HOST_IP):%s)", metrics, port)
	}
	if ds.Spec.Template.Annotations["prometheus.io/port"] != port {
		return fmt.Errorf("prometheus.io/port is %q, the metrics port %s", ds.Spec.Template.Annotations["prometheus.io/port"], port)
	}
	if !slices.ContainsFunc(daemon.Ports, func(p corev1.ContainerPort) bool {
		return strconv.Itoa(int(p.ContainerPort)) == port && (p.Protocol == "" || p.Protocol == corev1.ProtocolTCP)
	}) {
		return fmt.Errorf("justitiad declares no TCP containerPort %s (metrics)", port)
	}
	return nil
}

// checkPeer checks the peer channel's settings in effect against the pod: the UDP port
// declared, the key on a host path kept across restarts and only read by the daemon, and
// the member list peer-members.sh renders read by justitiad, naming this node with its key.
func checkPeer(pod corev1.PodSpec, daemon corev1.Container, check daemonCheck) error {
	if _, on := check["peer.node"]; !on {
		return nil
	}
	volumes := podVolumes(pod)
	port := check["peer.port"]
	_, listenPort, err := net.SplitHostPort(check["peer.listen"])
	if err != nil || listenPort != port {
		return fmt.Errorf("the peer channel listens on %s, but peers send to peer.port %s", check["peer.listen"], port)
	}
	if !slices.ContainsFunc(daemon.Ports, func(p corev1.ContainerPort) bool {
		return strconv.Itoa(int(p.ContainerPort)) == port && p.Protocol == corev1.ProtocolUDP
	}) {
		return fmt.Errorf("justitiad declares no UDP containerPort %s, the peer channel's peer.port", port)
	}
	key, ok := check["peer.key_file"]
	if !ok {
		return fmt.Errorf("the peer channel's key is a systemd credential (no key_file), which a pod does not have")
	}
	m := mountOf(daemon, path.Dir(key))
	if m == nil {
		return fmt.Errorf("justitiad mounts nothing at %s, the directory of key_file %s", path.Dir(key), key)
	}
	if v := volumes[m.Name]; v.HostPath == nil {
		return fmt.Errorf("key_file %s is in volume %s, not a host path: a new key at every restart, which the other nodes do not list", key, m.Name)
	}
	if !m.ReadOnly {
		return fmt.Errorf("justitiad mounts its key's directory %s writable: it only reads the key (readOnly: true)", m.MountPath)
	}
	members, ok := check["peer.members_file"]
	if !ok {
		return fmt.Errorf("the configuration lists [peer.members] itself, by hand per cluster: set members_file to the ConfigMap %s renders", membersScript)
	}
	if check["peer.members"] != check["rendered"] {
		return fmt.Errorf("justitiad reads %s member(s) from members_file %s after %s rendered %s: the file is not where its ConfigMap is mounted", check["peer.members"], members, membersScript, check["rendered"])
	}
	if check["peer.self_listed"] != "yes" {
		return fmt.Errorf("the rendered list names nodes by status.hostIP (%s here) with the key each published, but justitiad's node id is %s (listed: %s): --peer-node must be $(HOST_IP), from status.hostIP",
			sampleFields["status.hostIP"], check["peer.node"], check["peer.self_listed"])
	}
	return nil
}

func mountOf(c corev1.Container, dir string) *corev1.VolumeMount {
	for i := range c.VolumeMounts {
		if c.VolumeMounts[i].MountPath == dir {
			return &c.VolumeMounts[i]
		}
	}
	return nil
}
