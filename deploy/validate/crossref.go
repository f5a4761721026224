package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// The directories container runtimes read CDI specs from (the CDI library's defaults).
var cdiSpecDirs = []string{"/etc/cdi", "/var/run/cdi"}

// The smallest memory each container is given. justitiad holds its control blocks (one
// page per slot, 1024 slots: 4 MiB), the probe's buffers and its binary; the install step
// runs cp and `justitia cdi`.
var memoryFloor = map[string]string{"justitiad": "32Mi", "install": "16Mi", "device-plugin": "16Mi", "peer-key": "16Mi"}

// checkSecurity checks the settings deploy/kubernetes/README.md promises for every
// container: no privilege escalation, a read-only root file system, the runtime's seccomp
// profile, and memory requests and limits that the API server accepts and the process can
// run in.
func checkSecurity(pod corev1.PodSpec) error {
	// Writing host paths on an SELinux-enforcing node needs spc_t (README, untested).
	if pod.SecurityContext == nil || pod.SecurityContext.SELinuxOptions == nil || pod.SecurityContext.SELinuxOptions.Type != "spc_t" {
		return fmt.Errorf("the pod's seLinuxOptions must be type spc_t: container_t may not write the host paths it keeps on an enforcing node")
	}
	podSeccomp := pod.SecurityContext != nil && pod.SecurityContext.SeccompProfile != nil &&
		pod.SecurityContext.SeccompProfile.Type == corev1.SeccompProfileTypeRuntimeDefault
	for _, c := range append(append([]corev1.Container(nil), pod.InitContainers...), pod.Containers...) {
		sc := c.SecurityContext
		if sc == nil {
			return fmt.Errorf("container %s: no securityContext", c.Name)
		}
		if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			return fmt.Errorf("container %s: allowPrivilegeEscalation must be false", c.Name)
		}
		if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			return fmt.Errorf("container %s: readOnlyRootFilesystem must be true", c.Name)
		}
		seccomp := podSeccomp
		if sc.SeccompProfile != nil {
			seccomp = sc.SeccompProfile.Type == corev1.SeccompProfileTypeRuntimeDefault
		}
		if !seccomp {
			return fmt.Errorf("container %s: seccompProfile must be RuntimeDefault (on the container or the pod)", c.Name)
		}
		floor, ok := memoryFloor[c.Name]
		if !ok {
			return fmt.Errorf("container %s: a container this check does not know (give it a memory floor here)", c.Name)
		}
		min := resource.MustParse(floor)
		request, limit := c.Resources.Requests.Memory(), c.Resources.Limits.Memory()
		if request.Cmp(min) < 0 {
			return fmt.Errorf("container %s: memory request %s is below its floor %s", c.Name, request, floor)
		}
		if limit.Cmp(*request) < 0 {
			return fmt.Errorf("container %s: memory limit %s is below its request %s (the API server refuses it)", c.Name, limit, request)
		}
	}
	return nil
}

// checkDaemonResource checks that justitiad asks for the node's RDMA devices from the
// device plugin's unshaped pool (its own queue pairs must not go through the shaper): one
// unit, in limits and, if there, requests alike (the API server wants them equal), and no
// other RDMA resource.
func checkDaemonResource(ds *appsv1.DaemonSet, plugin *pluginSettings) error {
	daemon := findContainer(ds.Spec.Template.Spec.Containers, "justitiad")
	q, ok := daemon.Resources.Limits[corev1.ResourceName(plugin.unshapedResource)]
	if !ok {
		return fmt.Errorf("justitiad does not limit %s, the device plugin's unshaped pool: without it the node's RDMA device nodes are not in its container", plugin.unshapedResource)
	}
	if q.Value() != 1 {
		return fmt.Errorf("justitiad asks for %s units of %s, expected 1", q.String(), plugin.unshapedResource)
	}
	if r, ok := daemon.Resources.Requests[corev1.ResourceName(plugin.unshapedResource)]; ok && !r.Equal(q) {
		return fmt.Errorf("justitiad requests %s of %s but limits %s (extended resources must be equal)", r.String(), plugin.unshapedResource, q.String())
	}
	for _, list := range []corev1.ResourceList{daemon.Resources.Limits, daemon.Resources.Requests} {
		for name := range list {
			if string(name) == plugin.resource || (strings.HasPrefix(string(name), "rdma/") && string(name) != plugin.unshapedResource) {
				return fmt.Errorf("justitiad asks for %s: its own queue pairs would go through the shaper, or come from another plugin", name)
			}
		}
	}
	if plugin.unshapedSlots < 1 {
		return fmt.Errorf("the device plugin serves no unshaped pool (--unshaped-slots 0), which justitiad asks for")
	}
	return nil
}

// initScript is the install container's script: its command must be a shell running one
// script (`/bin/sh -ec SCRIPT`).
func initScript(c corev1.Container) (string, error) {
	if len(c.Command) != 3 || c.Command[0] != "/bin/sh" || c.Command[1] != "-ec" {
		return "", fmt.Errorf("init container %s: command must be [/bin/sh, -ec, SCRIPT], got %q", c.Name, c.Command)
	}
	return c.Command[2], nil
}

// runInstall runs the install container's script as the container would, with its
// environment (ConfigMap keys resolved), on a scratch copy of the host: each volume
// mount's path in the script is rewritten to the scratch directory of its volume's host
// path, the image's /usr/lib/justitia to a scratch copy of what the image installs, and
// `justitia` is the binary in binDir, reading a fake sysfs with one device, rxe0. It
// returns the scratch host root; the script's failure (a misspelt command, a flag or value
// `justitia cdi` refuses) is an error with its output.
func runInstall(c corev1.Container, volumes map[string]corev1.Volume, configMaps map[string]corev1.ConfigMap, binDir, scratch string) (string, error) {
	script, err := initScript(c)
	if err != nil {
		return "", err
	}
	hostRoot := filepath.Join(scratch, "host")
	// Longer mount paths first, so that a mount inside another is rewritten as itself.
	mounts := append([]corev1.VolumeMount(nil), c.VolumeMounts...)
	slices.SortFunc(mounts, func(a, b corev1.VolumeMount) int { return len(b.MountPath) - len(a.MountPath) })
	var pairs []string
	for _, m := range mounts {
		v := volumes[m.Name]
		if v.HostPath == nil {
			return "", fmt.Errorf("init container %s mounts %s, which is not a host path", c.Name, m.Name)
		}
		dir := filepath.Join(hostRoot, v.HostPath.Path)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return "", err
		}
		pairs = append(pairs, m.MountPath, dir)
	}
	image := filepath.Join(scratch, "image")
	for _, f := range []string{"libjustitia.so", "musl/libjustitia.so", "ld.so.preload"} {
		p := filepath.Join(image, "usr/lib/justitia", f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return "", err
		}
		if err := os.WriteFile(p, []byte(f+"\n"), 0o644); err != nil {
			return "", err
		}
	}
	pairs = append(pairs, "/usr/lib/justitia", filepath.Join(image, "usr/lib/justitia"))
	script = strings.NewReplacer(pairs...).Replace(script)
	// The container's root file system is read-only: every file the script writes must be
	// in a volume (and here, in the scratch directory).
	for _, w := range writtenPaths(script) {
		if !strings.HasPrefix(w, scratch+"/") {
			return "", fmt.Errorf("init container %s: its script writes %s, which is in no volume it mounts (the root file system is read-only)", c.Name, w)
		}
	}

	sysfs := filepath.Join(scratch, "sys")
	if err := os.MkdirAll(filepath.Join(sysfs, "class/infiniband_verbs/uverbs0"), 0o755); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(sysfs, "class/infiniband_verbs/uverbs0/ibdev"), []byte("rxe0\n"), 0o644); err != nil {
		return "", err
	}
	// `justitia` on PATH: the real binary, its --sysfs replaced by the fake tree.
	bin := filepath.Join(scratch, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return "", err
	}
	real, err := filepath.Abs(filepath.Join(binDir, "justitia"))
	if err != nil {
		return "", err
	}
	wrapper := fmt.Sprintf(`#!/bin/sh
skip=0
for a do
  shift
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  case "$a" in
    --sysfs) skip=1; continue ;;
    --sysfs=*) continue ;;
  esac
  set -- "$@" "$a"
done
exec %q "$@" --sysfs %q
`, real, sysfs)
	if err := os.WriteFile(filepath.Join(bin, "justitia"), []byte(wrapper), 0o755); err != nil {
		return "", err
	}
	env := []string{"PATH=" + bin + ":/usr/bin:/bin"}
	for _, e := range c.Env {
		value := e.Value
		if ref := e.ValueFrom; ref != nil && ref.ConfigMapKeyRef != nil {
			value = configMaps[ref.ConfigMapKeyRef.Name].Data[ref.ConfigMapKeyRef.Key]
		}
		env = append(env, e.Name+"="+value)
	}
	cmd := exec.Command("/bin/sh", "-ec", script)
	cmd.Env = env
	cmd.Dir = scratch
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("init container %s: its script fails (%v): %s", c.Name, err, strings.TrimSpace(string(out)))
	}
	return hostRoot, nil
}

// cdiSpecOnHost finds the spec the install script wrote under the scratch host root, which
// must be in a directory runtimes read, and decodes what this check needs of it.
func cdiSpecOnHost(hostRoot string) (string, *cdiSpecEdits, error) {
	var found []string
	err := filepath.WalkDir(hostRoot, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".json") {
			found = append(found, p)
		}
		return err
	})
	if err != nil {
		return "", nil, err
	}
	if len(found) != 1 {
		return "", nil, fmt.Errorf("the install script wrote %d CDI specs on the host, expected 1", len(found))
	}
	hostPath := "/" + strings.TrimPrefix(filepath.ToSlash(strings.TrimPrefix(found[0], hostRoot)), "/")
	if !slices.Contains(cdiSpecDirs, path.Dir(hostPath)) {
		return "", nil, fmt.Errorf("the CDI spec is written to %s on the host, where no runtime reads specs (%s)", hostPath, strings.Join(cdiSpecDirs, ", "))
	}
	data, err := os.ReadFile(found[0])
	if err != nil {
		return "", nil, err
	}
	var spec cdiSpecEdits
	if err := json.Unmarshal(data, &spec); err != nil {
		return "", nil, fmt.Errorf("%s: %w", hostPath, err)
	}
	return hostPath, &spec, nil
}

// What the cross-references read of a CDI spec.
type cdiSpecEdits struct {
	Devices []struct {
		Name           string `json:"name"`
		ContainerEdits struct {
			Env    []string `json:"env"`
			Mounts []struct {
				HostPath      string `json:"hostPath"`
				ContainerPath string `json:"containerPath"`
			} `json:"mounts"`
		} `json:"containerEdits"`
	} `json:"devices"`
}

// writtenPaths lists the paths a shell script's file commands write (every operand of
// mkdir, cp, mv, install, ln and touch, sources included, the --output of justitia, and
// the target of every > or >> redirection), with continuation lines joined.
func writtenPaths(script string) []string {
	var out []string
	for _, line := range strings.Split(strings.ReplaceAll(script, "\\\n", " "), "\n") {
		words := strings.Fields(line)
		if len(words) == 0 {
			continue
		}
		for i, w := range words {
			target := ""
			if (w == ">" || w == ">>") && i+1 < len(words) {
				target = words[i+1]
			} else if strings.HasPrefix(w, ">") {
				target = strings.TrimLeft(w, ">")
			}
			if target != "" && !strings.HasPrefix(target, "&") {
				out = append(out, target)
			}
		}
		switch words[0] {
		case "mkdir", "cp", "mv", "install", "ln", "touch":
			for _, w := range words[1:] {
				if !strings.HasPrefix(w, "-") {
					out = append(out, w)
				}
			}
		case "justitia":
			if o := argAfter(words, "--output"); o != "" {
				out = append(out, o)
			}
		}
	}
	return out
}

// checkSpecAgainstHost checks that every file the spec binds into containers is on the
// host after the install step, and that the socket directory it binds is where justitiad's
// configuration puts its registration socket and the daemon mounts that host directory.
func checkSpecAgainstHost(spec *cdiSpecEdits, hostRoot, socket string) error {
	for _, d := range spec.Devices {
		unshaped := strings.HasSuffix(d.Name, "-unshaped")
		socketBound := false
		for _, m := range d.ContainerEdits.Mounts {
			if m.ContainerPath == path.Dir(socket) {
				if m.HostPath != path.Dir(socket) {
					return fmt.Errorf("device %s binds the socket directory from %s, but justitiad's socket is %s", d.Name, m.HostPath, socket)
				}
				socketBound = true
			}
		}
		if !unshaped && !socketBound {
			return fmt.Errorf("device %s does not bind %s, the directory of justitiad's socket (is --socket %s?)", d.Name, path.Dir(socket), socket)
		}
		// The shaper connects to JUSTITIA_SOCKET, or to its default path without it.
		shaperSocket := defaultSocket
		for _, e := range d.ContainerEdits.Env {
			if v, ok := strings.CutPrefix(e, "JUSTITIA_SOCKET="); ok {
				shaperSocket = v
			}
		}
		if !unshaped && shaperSocket != socket {
			return fmt.Errorf("device %s points the shaper at socket %s, but justitiad's is %s", d.Name, shaperSocket, socket)
		}
		for _, m := range d.ContainerEdits.Mounts {
			if m.ContainerPath == path.Dir(socket) {
				continue
			}
			if _, err := os.Stat(filepath.Join(hostRoot, m.HostPath)); err != nil {
				return fmt.Errorf("device %s binds %s from the host into %s, but the install step puts no file there", d.Name, m.HostPath, m.ContainerPath)
			}
		}
	}
	return nil
}

// Where the shaper looks for justitiad's socket when JUSTITIA_SOCKET is not set.
const defaultSocket = "/run/justitia/justitiad.sock"
