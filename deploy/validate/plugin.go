package main

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// pluginSettings is what the rest of the deployment must agree with in the device
// plugin's, as the plugin itself reports them (`--check`).
type pluginSettings struct {
	resource, unshapedResource string
	unshapedSlots              int
}

// kubeletPluginDir is where kubelet serves the device-plugin API and looks for plugins'
// sockets.
const kubeletPluginDir = "/var/lib/kubelet/device-plugins"

// checkPlugin runs the device plugin's install step on a scratch host, checks the CDI spec
// it writes, has the plugin check its command line (with the pod's $(VAR) references
// expanded as kubelet does), and checks that every host file the plugin hands to
// containers is one the install step put there, that the socket it points shapers at is
// justitiad's, and that kubelet's directory is mounted where the plugin serves.
func checkPlugin(ds *appsv1.DaemonSet, configMaps map[string]corev1.ConfigMap, daemon *daemonSettings, binDir, scratch string) (*pluginSettings, string, error) {
	pod := ds.Spec.Template.Spec
	volumes := podVolumes(pod)
	install := findContainer(pod.InitContainers, "install")
	if install == nil {
		return nil, "", fmt.Errorf("no init container named install (it puts the shaper and the CDI spec on the host)")
	}
	hostRoot, err := runInstall(*install, volumes, configMaps, binDir, scratch)
	if err != nil {
		return nil, "", err
	}
	specPath, spec, err := cdiSpecOnHost(hostRoot)
	if err != nil {
		return nil, "", err
	}
	if err := checkSpecAgainstHost(spec, hostRoot, daemon.socket); err != nil {
		return nil, "", fmt.Errorf("%s: %w", specPath, err)
	}
	c := findContainer(pod.Containers, "device-plugin")
	if c == nil {
		return nil, "", fmt.Errorf("no container named device-plugin")
	}
	if len(c.Command) == 0 || c.Command[0] != "justitia-device-plugin" {
		return nil, "", fmt.Errorf("container device-plugin runs %q, expected justitia-device-plugin", c.Command)
	}
	args := expandEnv(append(append([]string(nil), c.Command[1:]...), c.Args...), c.Env, configMaps)
	out, err := exec.Command(filepath.Join(binDir, "justitia-device-plugin"), append(args, "--check")...).CombinedOutput()
	if err != nil {
		return nil, "", fmt.Errorf("justitia-device-plugin refuses its command line %q: %s", args, strings.TrimSpace(string(out)))
	}
	settings := map[string]string{}
	for _, line := range strings.Split(string(out), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			settings[k] = v
		}
	}
	for _, key := range []string{"library", "musl-library", "preload-list"} {
		if _, err := os.Stat(filepath.Join(hostRoot, settings[key])); err != nil {
			return nil, "", fmt.Errorf("the plugin hands containers --%s %s from the host, but the install step puts no file there", key, settings[key])
		}
	}
	if settings["socket"] != daemon.socket {
		return nil, "", fmt.Errorf("the plugin points shapers at --socket %s, but justitiad's socket is %s", settings["socket"], daemon.socket)
	}
	if settings["sysfs"] != "/sys" {
		return nil, "", fmt.Errorf("the plugin reads devices from --sysfs %s; a container sees the node's sysfs at /sys", settings["sysfs"])
	}
	kubeletDir := settings["kubelet-dir"]
	mounted := false
	for _, m := range c.VolumeMounts {
		if v := volumes[m.Name]; v.HostPath != nil && v.HostPath.Path == kubeletPluginDir && m.MountPath == kubeletDir && !m.ReadOnly {
			mounted = true
		}
	}
	if !mounted {
		return nil, "", fmt.Errorf("the plugin serves in --kubelet-dir %s, where no writable mount of the host's %s is", kubeletDir, kubeletPluginDir)
	}
	// The spec the plugin keeps must be the one the install step wrote (one spec of the
	// kind, not two that runtimes would both read), in a directory mounted from the host.
	if keep := settings["cdi-spec"]; keep != "" {
		onHost := ""
		for _, m := range c.VolumeMounts {
			if v := volumes[m.Name]; v.HostPath != nil && m.MountPath == path.Dir(keep) && !m.ReadOnly {
				onHost = path.Join(v.HostPath.Path, path.Base(keep))
			}
		}
		if onHost != specPath {
			return nil, "", fmt.Errorf("the plugin keeps its CDI spec at --cdi-spec %s (%q on the host), but the install step writes %s", keep, onHost, specPath)
		}
	}
	slots, err := strconv.Atoi(settings["unshaped-slots"])
	if err != nil {
		return nil, "", fmt.Errorf("the plugin's --check gave unshaped-slots %q", settings["unshaped-slots"])
	}
	return &pluginSettings{resource: settings["resource"], unshapedResource: settings["unshaped-resource"], unshapedSlots: slots}, specPath, nil
}

// expandEnv replaces $(NAME) in args with the container's variable NAME, its ConfigMap
// references resolved, as kubelet does; an unknown reference stays as written.
func expandEnv(args []string, env []corev1.EnvVar, configMaps map[string]corev1.ConfigMap) []string {
	var pairs []string
	for _, e := range env {
		value := e.Value
		if ref := e.ValueFrom; ref != nil && ref.ConfigMapKeyRef != nil {
			value = configMaps[ref.ConfigMapKeyRef.Name].Data[ref.ConfigMapKeyRef.Key]
		}
		pairs = append(pairs, "$("+e.Name+")", value)
	}
	r := strings.NewReplacer(pairs...)
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = r.Replace(a)
	}
	return out
}
