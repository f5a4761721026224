// Command podrun plays kubelet for one pod on a node, for the guest suite: it serves
// kubelet's device-plugin registration in a directory of its own, waits for the device
// plugin to register a resource (removing the sockets in the directory first, as kubelet
// does when it starts, so that a plugin already running registers again), takes one unit of it from the plugin's ListAndWatch and
// asks the plugin to Allocate it, then starts a pod through a CRI runtime's socket
// (containerd) with one container given what Allocate answered (device nodes, mounts,
// environment, annotations), as kubelet does, waits for the container to exit, prints its
// log, and removes the pod. Its exit status is the container's.
//
//	podrun --kubelet-dir DIR --runtime SOCKET --resource NAME --image REF
//	       --namespace NS --pod NAME --uid UID [--env K=V]... [--mount HOST:CONTAINER]...
//	       [--runtime-handler NAME] [--pod-logs-dir DIR] [--timeout D] -- CMD ARGS...
//
// The pod runs in the node's network namespace (no CNI) under the cgroupfs parent
// /kubepods/besteffort/pod<UID>, kubelet's path for a best-effort pod with the cgroupfs
// driver, its logs in DIR/<NS>_<NAME>_<UID> as kubelet keeps them (default /var/log/pods).
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type envList []string

func (l *envList) String() string     { return strings.Join(*l, " ") }
func (l *envList) Set(v string) error { *l = append(*l, v); return nil }

// registrar is kubelet's registration service: it hands on each registration.
type registrar struct {
	pluginapi.UnimplementedRegistrationServer
	got chan *pluginapi.RegisterRequest
}

func (r *registrar) Register(_ context.Context, req *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	select {
	case r.got <- req:
	default: // a registration nobody waits for any more
	}
	return &pluginapi.Empty{}, nil
}

func main() {
	log.SetFlags(0)
	log.SetPrefix("podrun: ")
	var (
		kubeletDir, runtime, handler, resource, image, ns, pod, uid, podLogs string
		env, mounts                                                          envList
		timeout                                                              time.Duration
	)
	flag.StringVar(&kubeletDir, "kubelet-dir", "", "the device-plugin directory to serve registration in")
	flag.StringVar(&runtime, "runtime", "/run/containerd/containerd.sock", "the CRI runtime's socket")
	flag.StringVar(&handler, "runtime-handler", "", "the runtime handler the pod's RuntimeClass names (empty: the runtime's default)")
	flag.StringVar(&resource, "resource", "rdma/rdma_shared_device_a", "the extended resource the container asks for")
	flag.StringVar(&image, "image", "", "the container's image (present in the runtime)")
	flag.StringVar(&ns, "namespace", "default", "the pod's namespace")
	flag.StringVar(&pod, "pod", "podrun", "the pod's name")
	flag.StringVar(&uid, "uid", "", "the pod's UID")
	flag.Var(&env, "env", "K=V set in the container (repeatable), as the pod spec's env")
	flag.Var(&mounts, "mount", "HOST:CONTAINER bound read-write into the container (repeatable), as a hostPath volume")
	flag.StringVar(&podLogs, "pod-logs-dir", "/var/log/pods", "kubelet's pod log directory")
	flag.DurationVar(&timeout, "timeout", 120*time.Second, "the whole run's deadline")
	flag.Parse()
	if kubeletDir == "" || image == "" || uid == "" || flag.NArg() == 0 {
		log.Fatal("usage: podrun --kubelet-dir DIR --image REF --uid UID [options] -- CMD ARGS...")
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	code, err := run(ctx, kubeletDir, runtime, handler, resource, image, ns, pod, uid, podLogs, env, mounts, flag.Args())
	if err != nil {
		log.Fatal(err)
	}
	os.Exit(code)
}

func run(ctx context.Context, kubeletDir, runtime, handler, resource, image, ns, pod, uid, podLogs string, env, mounts, command []string) (int, error) {
	alloc, err := allocate(ctx, kubeletDir, resource)
	if err != nil {
		return 0, err
	}
	log.Printf("%s allocated: %d devices, %d mounts, envs %v, %d CDI devices", resource, len(alloc.Devices), len(alloc.Mounts), alloc.Envs, len(alloc.CdiDevices))
	conn, err := grpc.NewClient("unix://"+runtime, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	rt := cri.NewRuntimeServiceClient(conn)
	// kubelet's BuildPodLogsDirectory: <namespace>_<name>_<uid>.
	logDir := filepath.Join(podLogs, ns+"_"+pod+"_"+uid)
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return 0, err
	}
	defer os.RemoveAll(logDir)
	sandbox := &cri.PodSandboxConfig{
		Metadata: &cri.PodSandboxMetadata{Name: pod, Uid: uid, Namespace: ns},
		// The node's network namespace is the node's UTS one too: no hostname of its own.
		LogDirectory: logDir,
		Linux: &cri.LinuxPodSandboxConfig{
			CgroupParent: "/kubepods/besteffort/pod" + uid,
			SecurityContext: &cri.LinuxSandboxSecurityContext{
				NamespaceOptions: &cri.NamespaceOption{Network: cri.NamespaceMode_NODE, Pid: cri.NamespaceMode_CONTAINER, Ipc: cri.NamespaceMode_POD},
			},
		},
	}
	sb, err := rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: sandbox, RuntimeHandler: handler})
	if err != nil {
		return 0, fmt.Errorf("RunPodSandbox: %w", err)
	}
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = rt.StopPodSandbox(c, &cri.StopPodSandboxRequest{PodSandboxId: sb.PodSandboxId})
		_, _ = rt.RemovePodSandbox(c, &cri.RemovePodSandboxRequest{PodSandboxId: sb.PodSandboxId})
	}()
	cfg := &cri.ContainerConfig{
		Metadata:    &cri.ContainerMetadata{Name: "app"},
		Image:       &cri.ImageSpec{Image: image},
		Command:     command,
		LogPath:     "app.log",
		Annotations: alloc.Annotations,
		Linux:       &cri.LinuxContainerConfig{SecurityContext: &cri.LinuxContainerSecurityContext{}},
	}
	for k, v := range alloc.Envs {
		cfg.Envs = append(cfg.Envs, &cri.KeyValue{Key: k, Value: []byte(v)})
	}
	// The pod's own variables come after the plugin's, as kubelet orders them.
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		cfg.Envs = append(cfg.Envs, &cri.KeyValue{Key: k, Value: []byte(v)})
	}
	for _, m := range alloc.Mounts {
		cfg.Mounts = append(cfg.Mounts, &cri.Mount{HostPath: m.HostPath, ContainerPath: m.ContainerPath, Readonly: m.ReadOnly})
	}
	for _, m := range mounts {
		host, container, ok := strings.Cut(m, ":")
		if !ok {
			return 0, fmt.Errorf("--mount %q: expected HOST:CONTAINER", m)
		}
		cfg.Mounts = append(cfg.Mounts, &cri.Mount{HostPath: host, ContainerPath: container})
	}
	for _, d := range alloc.Devices {
		cfg.Devices = append(cfg.Devices, &cri.Device{HostPath: d.HostPath, ContainerPath: d.ContainerPath, Permissions: d.Permissions})
	}
	for _, d := range alloc.CdiDevices {
		cfg.CDIDevices = append(cfg.CDIDevices, &cri.CDIDevice{Name: d.Name})
	}
	created, err := rt.CreateContainer(ctx, &cri.CreateContainerRequest{PodSandboxId: sb.PodSandboxId, Config: cfg, SandboxConfig: sandbox})
	if err != nil {
		return 0, fmt.Errorf("CreateContainer: %w", err)
	}
	if _, err := rt.StartContainer(ctx, &cri.StartContainerRequest{ContainerId: created.ContainerId}); err != nil {
		return 0, fmt.Errorf("StartContainer: %w", err)
	}
	log.Printf("pod %s/%s (uid %s) started: sandbox %.12s, container %.12s", ns, pod, uid, sb.PodSandboxId, created.ContainerId)
	for {
		st, err := rt.ContainerStatus(ctx, &cri.ContainerStatusRequest{ContainerId: created.ContainerId})
		if err != nil {
			return 0, fmt.Errorf("ContainerStatus: %w", err)
		}
		if st.Status.State == cri.ContainerState_CONTAINER_EXITED {
			printLog(filepath.Join(logDir, "app.log"))
			return int(st.Status.ExitCode), nil
		}
		select {
		case <-ctx.Done():
			printLog(filepath.Join(logDir, "app.log"))
			return 0, fmt.Errorf("the container did not exit in time")
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// allocate waits for the plugin of resource to register in kubeletDir, takes its first
// healthy unit and has the plugin allocate it.
func allocate(ctx context.Context, kubeletDir, resource string) (*pluginapi.ContainerAllocateResponse, error) {
	// As kubelet does when it starts: every socket in its directory is removed, so that the
	// plugins serve and register again (they watch their sockets).
	old, _ := filepath.Glob(filepath.Join(kubeletDir, "*.sock"))
	for _, f := range old {
		_ = os.Remove(f)
	}
	sock := filepath.Join(kubeletDir, "kubelet.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	reg := &registrar{got: make(chan *pluginapi.RegisterRequest, 8)}
	srv := grpc.NewServer()
	pluginapi.RegisterRegistrationServer(srv, reg)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	var endpoint string
	for endpoint == "" {
		select {
		case r := <-reg.got:
			if r.ResourceName == resource {
				endpoint = r.Endpoint
			}
		case <-ctx.Done():
			return nil, fmt.Errorf("no device plugin registered %s in %s", resource, kubeletDir)
		}
	}
	conn, err := grpc.NewClient("unix://"+filepath.Join(kubeletDir, endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	plugin := pluginapi.NewDevicePluginClient(conn)
	stream, err := plugin.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		return nil, fmt.Errorf("ListAndWatch: %w", err)
	}
	list, err := stream.Recv()
	if err != nil {
		return nil, fmt.Errorf("ListAndWatch: %w", err)
	}
	unit := ""
	for _, d := range list.Devices {
		if d.Health == pluginapi.Healthy {
			unit = d.ID
			break
		}
	}
	if unit == "" {
		return nil, fmt.Errorf("%s: no healthy unit of %d", resource, len(list.Devices))
	}
	resp, err := plugin.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{unit}}}})
	if err != nil {
		return nil, fmt.Errorf("Allocate %s: %w", unit, err)
	}
	if len(resp.ContainerResponses) != 1 {
		return nil, fmt.Errorf("Allocate gave %d container responses for 1", len(resp.ContainerResponses))
	}
	return resp.ContainerResponses[0], nil
}

// printLog prints a CRI log file's messages (each line is "TIME STREAM TAG MESSAGE").
func printLog(path string) {
	f, err := os.Open(path)
	if err != nil {
		log.Printf("no container log: %v", err)
		return
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), " ", 4)
		if len(parts) == 4 {
			fmt.Println(parts[3])
		}
	}
}
