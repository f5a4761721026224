package main

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// fakeKubelet is kubelet's registration service on kubelet.sock in a scratch directory:
// it records each registration.
type fakeKubelet struct {
	pluginapi.UnimplementedRegistrationServer
	mu    sync.Mutex
	got   []*pluginapi.RegisterRequest
	dir   string
	srv   *grpc.Server
	added chan struct{}
}

func startKubelet(t *testing.T) *fakeKubelet {
	t.Helper()
	// Unix socket paths are short (108 bytes): not t.TempDir()'s long names.
	dir, err := os.MkdirTemp("", "kubelet")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	k := &fakeKubelet{dir: dir, added: make(chan struct{}, 16)}
	lis, err := net.Listen("unix", filepath.Join(dir, "kubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	k.srv = grpc.NewServer()
	pluginapi.RegisterRegistrationServer(k.srv, k)
	go func() { _ = k.srv.Serve(lis) }()
	t.Cleanup(k.srv.Stop)
	return k
}

func (k *fakeKubelet) Register(_ context.Context, r *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k.mu.Lock()
	k.got = append(k.got, r)
	k.mu.Unlock()
	k.added <- struct{}{}
	return &pluginapi.Empty{}, nil
}

// waitRegistrations waits until n registrations in all were made, and returns them.
func (k *fakeKubelet) waitRegistrations(t *testing.T, n int) []*pluginapi.RegisterRequest {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		k.mu.Lock()
		got := append([]*pluginapi.RegisterRequest(nil), k.got...)
		k.mu.Unlock()
		if len(got) >= n {
			return got
		}
		select {
		case <-k.added:
		case <-deadline:
			t.Fatalf("%d registrations after 10 s, expected %d", len(got), n)
		}
	}
}

// fakeSysfs makes class/infiniband_verbs/<uverbs>/ibdev for each pair, and
// class/misc/rdma_cm when rdmaCM.
func fakeSysfs(t *testing.T, devices map[string]string, rdmaCM bool) string {
	t.Helper()
	root := t.TempDir()
	for uverbs, name := range devices {
		dir := filepath.Join(root, "class/infiniband_verbs", uverbs)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "ibdev"), []byte(name+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "class/infiniband_verbs/abi_version"), []byte("6\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if rdmaCM {
		if err := os.MkdirAll(filepath.Join(root, "class/misc/rdma_cm"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// startPlugin runs the plugin with args (plus the fake kubelet and sysfs) until the test
// ends.
// startPlugin runs the plugin until the test ends, or until the function it returns is
// called (which waits for the plugin to end).
func startPlugin(t *testing.T, k *fakeKubelet, sysfs string, args ...string) func() {
	t.Helper()
	o, err := parse(append([]string{"--kubelet-dir", k.dir, "--sysfs", sysfs, "--rescan", "100ms"}, args...))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	state := newNodeState()
	go func() {
		defer close(done)
		_ = run(ctx, o.runConfig(), state, o.pools(state))
	}()
	stop := func() { cancel(); <-done }
	t.Cleanup(stop)
	return stop
}

func dial(t *testing.T, k *fakeKubelet, endpoint string) pluginapi.DevicePluginClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+filepath.Join(k.dir, endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return pluginapi.NewDevicePluginClient(conn)
}

func allocate(t *testing.T, c pluginapi.DevicePluginClient, ids ...string) (*pluginapi.ContainerAllocateResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		return nil, err
	}
	if len(r.ContainerResponses) != 1 {
		t.Fatalf("%d container responses for 1 request", len(r.ContainerResponses))
	}
	return r.ContainerResponses[0], nil
}

// Both pools register with kubelet under their resource names; the shaped pool gives a
// container every device node, rdma_cm, the shaper's files and its class; the unshaped pool
// the device nodes alone.
func TestPoolsRegisterAndAllocate(t *testing.T) {
	k := startKubelet(t)
	sysfs := fakeSysfs(t, map[string]string{"uverbs0": "mlx5_0", "uverbs1": "mlx5_1"}, true)
	startPlugin(t, k, sysfs, "--slots", "3", "--unshaped-slots", "1", "--class", "bandwidth")
	regs := k.waitRegistrations(t, 2)
	byResource := map[string]string{}
	for _, r := range regs {
		if r.Version != "v1beta1" {
			t.Errorf("registration version %q", r.Version)
		}
		byResource[r.ResourceName] = r.Endpoint
	}
	want := map[string]string{
		"rdma/rdma_shared_device_a": "justitia-rdma_shared_device_a.sock",
		"justitia.io/rdma-unshaped": "justitia-rdma-unshaped.sock",
	}
	if !reflect.DeepEqual(byResource, want) {
		t.Fatalf("registrations %v, expected %v", byResource, want)
	}

	shaped := dial(t, k, want["rdma/rdma_shared_device_a"])
	stream, err := shaped.ListAndWatch(context.Background(), &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	list, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var units []string
	for _, d := range list.Devices {
		if d.Health != pluginapi.Healthy {
			t.Errorf("unit %s is %s", d.ID, d.Health)
		}
		units = append(units, d.ID)
	}
	if strings.Join(units, " ") != "rdma_shared_device_a-0 rdma_shared_device_a-1 rdma_shared_device_a-2" {
		t.Fatalf("units %v", units)
	}

	r, err := allocate(t, shaped, "rdma_shared_device_a-1")
	if err != nil {
		t.Fatal(err)
	}
	var devices []string
	for _, d := range r.Devices {
		if d.HostPath != d.ContainerPath || d.Permissions != "rw" {
			t.Errorf("device %+v", d)
		}
		devices = append(devices, d.ContainerPath)
	}
	if strings.Join(devices, " ") != "/dev/infiniband/uverbs0 /dev/infiniband/uverbs1 /dev/infiniband/rdma_cm" {
		t.Errorf("devices %v", devices)
	}
	var mounts []string
	for _, m := range r.Mounts {
		if !m.ReadOnly {
			t.Errorf("mount %+v is writable", m)
		}
		mounts = append(mounts, m.HostPath+":"+m.ContainerPath)
	}
	wantMounts := []string{
		"/var/lib/justitia/libjustitia.so:/opt/justitia/libjustitia.so",
		"/var/lib/justitia/musl/libjustitia.so:/opt/justitia/musl/libjustitia.so",
		"/var/lib/justitia/ld.so.preload:/etc/ld.so.preload",
		"/run/justitia:/run/justitia",
	}
	if !reflect.DeepEqual(mounts, wantMounts) {
		t.Errorf("mounts %v, expected %v", mounts, wantMounts)
	}
	// The class as a default only, the socket at the shaper's default path: no
	// LD_PRELOAD, no JUSTITIA_CLASS, no JUSTITIA_SOCKET, so the image's own are kept.
	if !reflect.DeepEqual(r.Envs, map[string]string{"JUSTITIA_DEFAULT_CLASS": "bandwidth"}) {
		t.Errorf("envs %v", r.Envs)
	}

	unshaped := dial(t, k, want["justitia.io/rdma-unshaped"])
	r, err = allocate(t, unshaped, "rdma-unshaped-0")
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Devices) != 3 || len(r.Mounts) != 0 || len(r.Envs) != 0 {
		t.Errorf("unshaped: %d devices, %d mounts, envs %v; expected 3, 0, none", len(r.Devices), len(r.Mounts), r.Envs)
	}
	// A unit of the other pool, or one never advertised, is refused.
	if _, err := allocate(t, unshaped, "rdma_shared_device_a-0"); err == nil || !strings.Contains(err.Error(), "unknown unit") {
		t.Errorf("a unit of the shaped pool allocated from the unshaped one: %v", err)
	}
	if _, err := allocate(t, shaped, "rdma_shared_device_a-3"); err == nil {
		t.Errorf("unit 3 of 3 allocated")
	}
}

// With --inject cdi, a container gets the CDI names of the devices (shaped, or their
// -unshaped variants) in the response and in the annotation, and nothing else.
func TestCDIInjection(t *testing.T) {
	k := startKubelet(t)
	sysfs := fakeSysfs(t, map[string]string{"uverbs0": "rxe0", "uverbs3": "rxe1"}, false)
	startPlugin(t, k, sysfs, "--inject", "cdi", "--slots", "1", "--device", "rxe1")
	k.waitRegistrations(t, 2)
	r, err := allocate(t, dial(t, k, "justitia-rdma_shared_device_a.sock"), "rdma_shared_device_a-0")
	if err != nil {
		t.Fatal(err)
	}
	if len(r.CdiDevices) != 1 || r.CdiDevices[0].Name != "justitia.io/rdma=rxe1" {
		t.Errorf("CDI devices %v, expected justitia.io/rdma=rxe1 alone (--device rxe1)", r.CdiDevices)
	}
	if r.Annotations[cdiAnnotation] != "justitia.io/rdma=rxe1" || len(r.Devices)+len(r.Mounts)+len(r.Envs) != 0 {
		t.Errorf("annotations %v, %d devices, %d mounts, %d envs", r.Annotations, len(r.Devices), len(r.Mounts), len(r.Envs))
	}
	r, err = allocate(t, dial(t, k, "justitia-rdma-unshaped.sock"), "rdma-unshaped-0")
	if err != nil {
		t.Fatal(err)
	}
	if len(r.CdiDevices) != 1 || r.CdiDevices[0].Name != "justitia.io/rdma=rxe1-unshaped" {
		t.Errorf("unshaped CDI devices %v", r.CdiDevices)
	}
}

// When the node's last device goes, ListAndWatch reports every unit unhealthy and Allocate
// refuses; when kubelet restarts (it removes every plugin's socket), the plugin serves and
// registers again.
func TestDeviceLossAndKubeletRestart(t *testing.T) {
	k := startKubelet(t)
	sysfs := fakeSysfs(t, map[string]string{"uverbs0": "rxe0"}, false)
	startPlugin(t, k, sysfs, "--slots", "2", "--unshaped-slots", "0")
	if n := len(k.waitRegistrations(t, 1)); n != 1 {
		t.Fatalf("%d registrations with --unshaped-slots 0, expected 1", n)
	}
	shaped := dial(t, k, "justitia-rdma_shared_device_a.sock")
	stream, err := shaped.ListAndWatch(context.Background(), &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(sysfs, "class/infiniband_verbs/uverbs0")); err != nil {
		t.Fatal(err)
	}
	list, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range list.Devices {
		if d.Health != pluginapi.Unhealthy {
			t.Errorf("unit %s %s after the device went", d.ID, d.Health)
		}
	}
	if _, err := allocate(t, shaped, "rdma_shared_device_a-0"); err == nil || !strings.Contains(err.Error(), "no RDMA device") {
		t.Errorf("allocated without a device: %v", err)
	}
	if err := os.Remove(filepath.Join(k.dir, "justitia-rdma_shared_device_a.sock")); err != nil {
		t.Fatal(err)
	}
	regs := k.waitRegistrations(t, 2)
	if regs[1].ResourceName != "rdma/rdma_shared_device_a" {
		t.Errorf("registered again as %q", regs[1].ResourceName)
	}
}

// Settings kubelet or runtimes could not use are refused, naming the flag.
func TestBadOptionsAreRefused(t *testing.T) {
	for _, c := range []struct{ args, want string }{
		{"--resource rdma", "--resource"},
		{"--resource kubernetes.io/rdma", "--resource"},
		{"--unshaped-resource rdma/rdma_shared_device_a", "both"},
		{"--slots 0", "--slots 0"},
		{"--unshaped-slots -1", "--unshaped-slots"},
		{"--inject env", "--inject"},
		{"--class fast", "--class"},
		{"--library libjustitia.so", "--library"},
		{"--socket /justitiad.sock", "--socket"},
		{"--device bad/name", "--device"},
		{"--rescan 1ms", "--rescan"},
		{"extra", "unexpected argument"},
	} {
		_, err := parse(strings.Fields(c.args))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, expected an error naming %q", c.args, err, c.want)
		}
	}
}

// With --cdi-spec, the plugin has `justitia cdi` (the real one, from JUSTITIA_BIN_DIR,
// which deploy/validate/check.sh builds) write the spec of the selected devices at start,
// and again when one goes, and removes it when it ends.
func TestTheCDISpecFollowsTheDevices(t *testing.T) {
	bin := os.Getenv("JUSTITIA_BIN_DIR")
	if bin == "" {
		t.Fatal("JUSTITIA_BIN_DIR is not set: run deploy/validate/check.sh, which builds justitia and sets it")
	}
	k := startKubelet(t)
	sysfs := fakeSysfs(t, map[string]string{"uverbs0": "rxe0", "uverbs1": "rxe1"}, false)
	spec := filepath.Join(t.TempDir(), "justitia.json")
	stop := startPlugin(t, k, sysfs, "--cdi-spec", spec, "--justitia", filepath.Join(bin, "justitia"))
	names := func() string {
		data, err := os.ReadFile(spec)
		if err != nil {
			return ""
		}
		var s struct {
			Devices []struct{ Name string } `json:"devices"`
		}
		if err := json.Unmarshal(data, &s); err != nil {
			t.Fatalf("%s: %v", spec, err)
		}
		var out []string
		for _, d := range s.Devices {
			if !strings.Contains(d.Name, "-") {
				out = append(out, d.Name)
			}
		}
		return strings.Join(out, " ")
	}
	waitFor := func(want string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for names() != want {
			if time.Now().After(deadline) {
				t.Fatalf("spec devices %q, expected %q", names(), want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitFor("rxe0 rxe1 all")
	if err := os.RemoveAll(filepath.Join(sysfs, "class/infiniband_verbs/uverbs1")); err != nil {
		t.Fatal(err)
	}
	waitFor("rxe0 all")
	// The plugin ends (SIGTERM, as when the DaemonSet is deleted): the spec goes with it.
	stop()
	if _, err := os.Stat(spec); !os.IsNotExist(err) {
		t.Fatalf("%s after the plugin ended: %v, expected it removed", spec, err)
	}
}
