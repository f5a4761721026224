package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// nodeState is the node's RDMA devices as last read from sysfs, shared by the pools. A
// change wakes every ListAndWatch stream.
type nodeState struct {
	mu      sync.Mutex
	devices []rdmaDevice
	rdmaCM  bool
	changed chan struct{} // closed and replaced at each change
}

func newNodeState() *nodeState {
	return &nodeState{changed: make(chan struct{})}
}

// set records what a scan found and says whether it differs from before.
func (s *nodeState) set(devices []rdmaDevice, rdmaCM bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if slices.Equal(devices, s.devices) && rdmaCM == s.rdmaCM {
		return false
	}
	s.devices, s.rdmaCM = devices, rdmaCM
	close(s.changed)
	s.changed = make(chan struct{})
	return true
}

// get returns the devices, rdma_cm's presence, and a channel closed at the next change.
func (s *nodeState) get() ([]rdmaDevice, bool, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.devices, s.rdmaCM, s.changed
}

// pool is one extended resource the plugin advertises: `slots` shared units, each giving
// a container every selected RDMA device of the node.
type pool struct {
	pluginapi.UnimplementedDevicePluginServer
	resource string // e.g. rdma/rdma_shared_device_a
	slots    int
	alloc    allocation
	state    *nodeState
}

// slotIDs are the units kubelet sees: <resource's name>-<i>.
func (p *pool) slotIDs() []string {
	name := resourceName(p.resource)
	ids := make([]string, p.slots)
	for i := range ids {
		ids[i] = name + "-" + strconv.Itoa(i)
	}
	return ids
}

// resourceName is the part of an extended resource's name after its domain.
func resourceName(resource string) string {
	return resource[strings.LastIndex(resource, "/")+1:]
}

// GetDevicePluginOptions: no pre-start hook, no preferred allocation.
func (p *pool) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the slots, healthy while the node has a selected device, and again at
// every change of the node's devices.
func (p *pool) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	ids := p.slotIDs()
	for {
		devices, _, changed := p.state.get()
		health := pluginapi.Healthy
		if len(devices) == 0 {
			health = pluginapi.Unhealthy
		}
		resp := &pluginapi.ListAndWatchResponse{Devices: make([]*pluginapi.Device, len(ids))}
		for i, id := range ids {
			resp.Devices[i] = &pluginapi.Device{ID: id, Health: health}
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return nil
		}
	}
}

// Allocate answers each container's request with the node's devices and, for a shaped
// pool, the shaper. Units this pool did not advertise are refused.
func (p *pool) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	ids := p.slotIDs()
	devices, rdmaCM, _ := p.state.get()
	if len(devices) == 0 {
		return nil, status.Errorf(codes.Unavailable, "%s: the node has no RDMA device", p.resource)
	}
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		for _, id := range c.DevicesIds {
			if !slices.Contains(ids, id) {
				return nil, status.Errorf(codes.InvalidArgument, "%s: unknown unit %q", p.resource, id)
			}
		}
		resp.ContainerResponses = append(resp.ContainerResponses, p.alloc.containerResponse(devices, rdmaCM))
	}
	return resp, nil
}

// endpoint is a pool's socket name in kubelet's device-plugin directory.
func (p *pool) endpoint() string {
	return "justitia-" + resourceName(p.resource) + ".sock"
}

// served is one pool's running gRPC server.
type served struct {
	server *grpc.Server
	socket string
}

// serve starts the pool's gRPC server on its socket in kubeletDir and registers it with
// kubelet. The socket is created fresh (a stale one from an earlier run is removed).
func serve(p *pool, kubeletDir string, timeout time.Duration) (*served, error) {
	socket := filepath.Join(kubeletDir, p.endpoint())
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("removing the stale socket %s: %w", socket, err)
	}
	lis, err := net.Listen("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", socket, err)
	}
	s := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(s, p)
	go func() { _ = s.Serve(lis) }()
	if err := register(kubeletDir, p, timeout); err != nil {
		s.Stop()
		_ = os.Remove(socket)
		return nil, err
	}
	return &served{server: s, socket: socket}, nil
}

// register tells kubelet (its socket kubelet.sock in kubeletDir) that the pool serves its
// resource on its endpoint.
func register(kubeletDir string, p *pool, timeout time.Duration) error {
	kubelet := filepath.Join(kubeletDir, filepath.Base(pluginapi.KubeletSocket))
	conn, err := grpc.NewClient("unix://"+kubelet, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("connecting to kubelet at %s: %w", kubelet, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     p.endpoint(),
		ResourceName: p.resource,
		Options:      &pluginapi.DevicePluginOptions{},
	})
	if err != nil {
		return fmt.Errorf("registering %s with kubelet at %s: %w", p.resource, kubelet, err)
	}
	return nil
}

func (s *served) stop() {
	s.server.Stop()
	_ = os.Remove(s.socket)
}

// runConfig is what run needs besides the pools.
type runConfig struct {
	kubeletDir string
	sysfs      string
	devices    []string      // selected device names; empty: all
	rescan     time.Duration // how often sysfs and the sockets are looked at
	timeout    time.Duration // registration's deadline
	spec       *specWriter   // the CDI spec kept up to date, if any
}

// run scans sysfs, serves and registers every pool, and keeps them so until ctx ends: at
// every rescan it reads the node's devices again (a change reaches ListAndWatch streams,
// and the CDI spec, if one is kept, is written again)
// and serves and registers again any pool whose socket is gone, which is what kubelet does
// to every plugin's socket when it restarts. A registration that fails is retried at the
// next rescan; the other pools go on. When ctx ends, the CDI spec it keeps is removed.
func run(ctx context.Context, cfg runConfig, state *nodeState, pools []*pool) error {
	running := make([]*served, len(pools))
	defer func() {
		for _, s := range running {
			if s != nil {
				s.stop()
			}
		}
	}()
	var lastErr string
	tick := time.NewTicker(cfg.rescan)
	defer tick.Stop()
	for {
		all, err := listDevices(cfg.sysfs)
		if err != nil {
			logOnce(&lastErr, err.Error())
		} else if state.set(selectDevices(all, cfg.devices), hasRdmaCM(cfg.sysfs)) {
			devices, _, _ := state.get()
			log.Printf("RDMA devices: %v", names(devices))
			if cfg.spec != nil {
				if err := cfg.spec.write(devices); err != nil {
					logOnce(&lastErr, err.Error())
				}
			}
		}
		for i, p := range pools {
			if running[i] != nil {
				if _, err := os.Stat(running[i].socket); err == nil {
					continue
				}
				log.Printf("%s: socket %s gone (kubelet restarted?): serving and registering again", p.resource, running[i].socket)
				running[i].stop()
				running[i] = nil
			}
			s, err := serve(p, cfg.kubeletDir, cfg.timeout)
			if err != nil {
				logOnce(&lastErr, err.Error())
				continue
			}
			log.Printf("%s: %d units registered with kubelet, served on %s", p.resource, p.slots, s.socket)
			running[i] = s
		}
		select {
		case <-ctx.Done():
			if cfg.spec != nil {
				if err := cfg.spec.remove(); err != nil {
					return err
				}
				log.Printf("removed the CDI spec %s", cfg.spec.output)
			}
			return nil
		case <-tick.C:
		}
	}
}

// logOnce logs msg unless it is the one logged last, so that a failure repeated at every
// rescan is said once.
func logOnce(last *string, msg string) {
	if msg != *last {
		log.Print(msg)
		*last = msg
	}
}

func names(ds []rdmaDevice) []string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = d.name + "(" + d.uverbs + ")"
	}
	return out
}
