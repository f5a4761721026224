// Command justitia-device-plugin advertises the node's RDMA devices to kubelet through the
// device-plugin API (v1beta1) and answers each container's Allocate with the devices and
// Justitia's shaper, so that a pod gets an RDMA device only shaped. It replaces the RDMA
// shared device plugin on the nodes it runs on and takes over its pool's resource name,
// so pods that ask for that resource get the shaper without a change.
//
// It serves two pools: the shaped one (--resource, by default the NVIDIA network
// operator's rdma/rdma_shared_device_a), and device nodes without the shaper
// (--unshaped-resource), for justitiad itself and for the namespaces an operator allows
// (deploy/kubernetes's admission policy refuses it to every other pod).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"path"
	"slices"
	"strings"
	"syscall"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// stringList is a repeatable flag.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// options are the command line's settings.
type options struct {
	resource, unshapedResource string
	slots, unshapedSlots       int
	devices                    stringList
	inject, cdiKind            string
	library, muslLibrary       string
	preloadList, socket, class string
	kubeletDir, sysfs          string
	cdiSpec, justitia          string
	rescan, timeout            time.Duration
	checkOnly                  bool
}

func parse(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("justitia-device-plugin", flag.ContinueOnError)
	fs.StringVar(&o.resource, "resource", "rdma/rdma_shared_device_a", "the shaped pool's extended resource (the NVIDIA network operator's default pool name)")
	fs.IntVar(&o.slots, "slots", 1000, "containers that may hold the shaped pool at once on a node (1..10000)")
	fs.StringVar(&o.unshapedResource, "unshaped-resource", "justitia.io/rdma-unshaped", "the pool of device nodes without the shaper")
	fs.IntVar(&o.unshapedSlots, "unshaped-slots", 8, "containers that may hold the unshaped pool at once (justitiad needs 1; 0 serves no unshaped pool)")
	fs.Var(&o.devices, "device", "an RDMA device to hand out (repeatable; default: every device in sysfs)")
	fs.StringVar(&o.inject, "inject", injectNative, "how containers get the devices and the shaper: native (device nodes, mounts and environment in the Allocate response, any runtime) or cdi (CDI device names, resolved by the runtime from `justitia cdi`'s spec)")
	fs.StringVar(&o.cdiKind, "cdi-kind", "justitia.io/rdma", "the CDI spec's kind, with --inject cdi")
	fs.StringVar(&o.library, "library", "/var/lib/justitia/libjustitia.so", "the shaper's glibc build on the host")
	fs.StringVar(&o.muslLibrary, "musl-library", "", "the shaper's musl build on the host (default: musl/libjustitia.so beside --library)")
	fs.StringVar(&o.preloadList, "preload-list", "", "the preload list on the host (default: ld.so.preload beside --library)")
	fs.StringVar(&o.socket, "socket", defaultSocket, "justitiad's registration socket on the host")
	fs.StringVar(&o.class, "class", "auto", "JUSTITIA_DEFAULT_CLASS of shaped containers: latency, throughput, bandwidth or auto")
	fs.StringVar(&o.kubeletDir, "kubelet-dir", path.Dir(pluginapi.KubeletSocket), "kubelet's device-plugin directory")
	fs.StringVar(&o.sysfs, "sysfs", "/sys", "root of the sysfs tree the devices are read from")
	fs.StringVar(&o.cdiSpec, "cdi-spec", "", "keep a CDI spec of the selected devices here, rewritten with `justitia cdi` when they change and removed when the plugin ends (empty: none)")
	fs.StringVar(&o.justitia, "justitia", "justitia", "the justitia command that writes the CDI spec")
	fs.DurationVar(&o.rescan, "rescan", 5*time.Second, "how often sysfs and the plugin's sockets are looked at")
	fs.DurationVar(&o.timeout, "register-timeout", 10*time.Second, "deadline of a registration with kubelet")
	fs.BoolVar(&o.checkOnly, "check", false, "check the settings, print them one per line (name=value) and exit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if o.muslLibrary == "" {
		o.muslLibrary = path.Join(path.Dir(o.library), "musl", "libjustitia.so")
	}
	if o.preloadList == "" {
		o.preloadList = path.Join(path.Dir(o.library), "ld.so.preload")
	}
	return o, o.check()
}

// check refuses settings that would make a plugin kubelet or runtimes cannot use.
func (o *options) check() error {
	for _, r := range []struct{ flag, value string }{{"--resource", o.resource}, {"--unshaped-resource", o.unshapedResource}} {
		domain, name, ok := strings.Cut(r.value, "/")
		if !ok || domain == "" || !validDeviceName(name) || strings.Contains(name, "/") || domain == "kubernetes.io" || strings.HasSuffix(domain, ".kubernetes.io") {
			return fmt.Errorf("%s %q: expected DOMAIN/NAME outside kubernetes.io, e.g. rdma/rdma_shared_device_a", r.flag, r.value)
		}
	}
	if o.resource == o.unshapedResource {
		return fmt.Errorf("--resource and --unshaped-resource are both %q", o.resource)
	}
	if o.slots < 1 || o.slots > 10000 {
		return fmt.Errorf("--slots %d: expected 1..10000", o.slots)
	}
	if o.unshapedSlots < 0 || o.unshapedSlots > 10000 {
		return fmt.Errorf("--unshaped-slots %d: expected 0..10000", o.unshapedSlots)
	}
	if o.inject != injectNative && o.inject != injectCDI {
		return fmt.Errorf("--inject %q: expected %s or %s", o.inject, injectNative, injectCDI)
	}
	if !slices.Contains([]string{"latency", "throughput", "bandwidth", "auto"}, o.class) {
		return fmt.Errorf("--class %q: expected latency, throughput, bandwidth or auto", o.class)
	}
	for _, p := range []struct{ flag, value string }{
		{"--library", o.library}, {"--musl-library", o.muslLibrary}, {"--preload-list", o.preloadList},
		{"--socket", o.socket}, {"--kubelet-dir", o.kubeletDir},
	} {
		if !path.IsAbs(p.value) {
			return fmt.Errorf("%s %q: must be an absolute path", p.flag, p.value)
		}
	}
	if o.cdiSpec != "" && !path.IsAbs(o.cdiSpec) {
		return fmt.Errorf("--cdi-spec %q: must be an absolute path", o.cdiSpec)
	}
	if path.Dir(o.socket) == "/" {
		return fmt.Errorf("--socket %s: the socket must be in a directory other than /, which is bound into containers", o.socket)
	}
	for _, d := range o.devices {
		if !validDeviceName(d) {
			return fmt.Errorf("--device %q: not a device name", d)
		}
	}
	if o.rescan < 100*time.Millisecond || o.timeout < time.Second {
		return fmt.Errorf("--rescan must be at least 100ms and --register-timeout at least 1s")
	}
	return nil
}

// print writes the settings as name=value lines, for deployment checks.
func (o *options) print(w io.Writer) {
	fmt.Fprintf(w, "resource=%s\nslots=%d\nunshaped-resource=%s\nunshaped-slots=%d\ninject=%s\ncdi-kind=%s\n",
		o.resource, o.slots, o.unshapedResource, o.unshapedSlots, o.inject, o.cdiKind)
	fmt.Fprintf(w, "library=%s\nmusl-library=%s\npreload-list=%s\nsocket=%s\nclass=%s\nkubelet-dir=%s\nsysfs=%s\ndevices=%s\n",
		o.library, o.muslLibrary, o.preloadList, o.socket, o.class, o.kubeletDir, o.sysfs, o.devices.String())
	fmt.Fprintf(w, "cdi-spec=%s\njustitia=%s\n", o.cdiSpec, o.justitia)
}

// runConfig is what run needs of the options.
func (o *options) runConfig() runConfig {
	return runConfig{kubeletDir: o.kubeletDir, sysfs: o.sysfs, devices: o.devices, rescan: o.rescan, timeout: o.timeout, spec: newSpecWriter(o)}
}

// pools are the resources the options ask for.
func (o *options) pools(state *nodeState) []*pool {
	shaped := &pool{resource: o.resource, slots: o.slots, state: state, alloc: allocation{
		inject: o.inject, cdiKind: o.cdiKind,
		shaper: &shaper{library: o.library, muslLibrary: o.muslLibrary, preloadList: o.preloadList, socket: o.socket, class: o.class},
	}}
	pools := []*pool{shaped}
	if o.unshapedSlots > 0 {
		pools = append(pools, &pool{resource: o.unshapedResource, slots: o.unshapedSlots, state: state,
			alloc: allocation{inject: o.inject, cdiKind: o.cdiKind}})
	}
	return pools
}

func main() {
	log.SetFlags(0)
	log.SetPrefix("justitia-device-plugin: ")
	o, err := parse(os.Args[1:])
	if err != nil {
		if err == flag.ErrHelp {
			os.Exit(0)
		}
		log.Print(err)
		os.Exit(2)
	}
	if o.checkOnly {
		o.print(os.Stdout)
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	state := newNodeState()
	err = run(ctx, o.runConfig(), state, o.pools(state))
	if err != nil {
		log.Print(err)
		os.Exit(1)
	}
}
