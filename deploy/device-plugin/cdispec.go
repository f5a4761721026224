package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"strings"
	"time"
)

// specWriter keeps a CDI spec of the node's selected devices up to date, for runtimes
// given CDI names (--inject cdi, podman): it runs `justitia cdi`, the one generator of the
// spec, with the plugin's settings, whenever the devices change.
type specWriter struct {
	justitia string // the justitia binary
	output   string // the spec's path, in a directory runtimes read
	args     []string
}

// specWriteTimeout bounds one run of `justitia cdi`.
const specWriteTimeout = 10 * time.Second

// newSpecWriter is nil when no spec is asked for.
func newSpecWriter(o *options) *specWriter {
	if o.cdiSpec == "" {
		return nil
	}
	return &specWriter{
		justitia: o.justitia,
		output:   o.cdiSpec,
		args: []string{"cdi", "--sysfs", o.sysfs, "--kind", o.cdiKind, "--library", o.library,
			"--musl-library", o.muslLibrary, "--preload-list", o.preloadList, "--socket", o.socket,
			"--class", o.class},
	}
}

// write writes the spec for devices (written whole: `justitia cdi` renames a new file over
// the old one).
func (w *specWriter) write(devices []rdmaDevice) error {
	if len(devices) == 0 {
		// `justitia cdi` refuses a spec without devices; the last one stays, its device
		// nodes gone, until a device comes back.
		return nil
	}
	args := append([]string(nil), w.args...)
	for _, d := range devices {
		args = append(args, "--device", d.name+"="+d.uverbs)
	}
	args = append(args, "--output", w.output)
	ctx, cancel := context.WithTimeout(context.Background(), specWriteTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, w.justitia, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("writing the CDI spec %s: %s %s: %v: %s", w.output, w.justitia, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// remove deletes the spec when the plugin ends (SIGTERM: the DaemonSet deleted, or a pod
// replaced in a rolling update, whose install step writes the spec again before the new
// plugin starts), so that an uninstalled node keeps no spec naming files of a shaper that
// is gone. A container created while no plugin runs would have failed Allocate anyway;
// one allocated just before waits for the new spec (kubelet retries its creation).
func (w *specWriter) remove() error {
	if err := os.Remove(w.output); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing the CDI spec %s: %v", w.output, err)
	}
	return nil
}
