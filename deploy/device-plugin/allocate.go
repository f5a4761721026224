package main

import (
	"path"
	"strings"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// Where the shaper's files are in a container, as `justitia cdi` binds them (its
// crates/cli/src/cdi.rs constants): glibc's dynamic linker loads what /etc/ld.so.preload
// lists into every dynamically linked program, so no LD_PRELOAD is set and the image's
// own is kept.
const (
	containerLibrary     = "/opt/justitia/libjustitia.so"
	containerMuslLibrary = "/opt/justitia/musl/libjustitia.so"
	containerPreloadList = "/etc/ld.so.preload"
	// The shaper looks for justitiad here unless JUSTITIA_SOCKET says otherwise.
	defaultSocket = "/run/justitia/justitiad.sock"
	devDir        = "/dev/infiniband"
)

// How the plugin hands a container its devices.
const (
	// injectNative: device nodes, mounts and environment in the Allocate response, which
	// kubelet passes to every CRI runtime (as HAMi does).
	injectNative = "native"
	// injectCDI: CDI device names (the response's CDI devices, which kubelet 1.31 and
	// later pass through CRI, and the cdi.k8s.io annotation that containerd 1.7 and
	// CRI-O read), resolved by the runtime from `justitia cdi`'s spec.
	injectCDI = "cdi"
)

// shaper is what a shaped container gets besides its device nodes.
type shaper struct {
	library, muslLibrary, preloadList string // host paths
	socket                            string // justitiad's registration socket
	class                             string // JUSTITIA_DEFAULT_CLASS
}

// allocation is how one pool answers Allocate.
type allocation struct {
	inject  string
	cdiKind string  // the CDI spec's kind, e.g. justitia.io/rdma
	shaper  *shaper // nil: device nodes only (the unshaped pool)
}

// containerResponse is one container's answer: every selected device of the node (a
// shared resource gives all of them), rdma_cm when the node has it, and, for a shaped
// pool, the shaper.
func (a allocation) containerResponse(devices []rdmaDevice, rdmaCM bool) *pluginapi.ContainerAllocateResponse {
	r := &pluginapi.ContainerAllocateResponse{}
	if a.inject == injectCDI {
		suffix := ""
		if a.shaper == nil {
			suffix = "-unshaped"
		}
		var names []string
		for _, d := range devices {
			name := a.cdiKind + "=" + d.name + suffix
			names = append(names, name)
			r.CdiDevices = append(r.CdiDevices, &pluginapi.CDIDevice{Name: name})
		}
		if len(names) > 0 {
			r.Annotations = map[string]string{cdiAnnotation: strings.Join(names, ",")}
		}
		return r
	}
	for _, d := range devices {
		p := path.Join(devDir, d.uverbs)
		r.Devices = append(r.Devices, &pluginapi.DeviceSpec{ContainerPath: p, HostPath: p, Permissions: "rw"})
	}
	if rdmaCM {
		p := path.Join(devDir, "rdma_cm")
		r.Devices = append(r.Devices, &pluginapi.DeviceSpec{ContainerPath: p, HostPath: p, Permissions: "rw"})
	}
	s := a.shaper
	if s == nil {
		return r
	}
	socketDir := path.Dir(s.socket)
	r.Mounts = []*pluginapi.Mount{
		{HostPath: s.library, ContainerPath: containerLibrary, ReadOnly: true},
		{HostPath: s.muslLibrary, ContainerPath: containerMuslLibrary, ReadOnly: true},
		{HostPath: s.preloadList, ContainerPath: containerPreloadList, ReadOnly: true},
		// Read-only is enough: connecting to a Unix socket needs write permission on the
		// socket, which a read-only mount does not take away.
		{HostPath: socketDir, ContainerPath: socketDir, ReadOnly: true},
	}
	r.Envs = map[string]string{"JUSTITIA_DEFAULT_CLASS": s.class}
	if s.socket != defaultSocket {
		r.Envs["JUSTITIA_SOCKET"] = s.socket
	}
	return r
}

// The annotation key under which CDI device names reach runtimes that read them from
// annotations (the CDI project's convention: cdi.k8s.io/<plugin>).
const cdiAnnotation = "cdi.k8s.io/justitia-device-plugin"
