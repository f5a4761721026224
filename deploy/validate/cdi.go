package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

// checkCDISpec reads a CDI spec with the CDI project's own reader: a strict decode
// (unknown fields are errors), then its validation of the version against the features
// used, the kind, every device's name and every edit. It also requires the version to be
// one the library knows.
func checkCDISpec(path string) (string, error) {
	spec, err := cdi.ReadSpec(path, 0)
	if err != nil {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	min, err := cdispec.MinimumRequiredVersion(spec.Spec)
	if err != nil {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	return fmt.Sprintf("cdiVersion %s (needs %s), kind %s, %d devices",
		spec.Version, min, spec.Kind, len(spec.Devices)), nil
}

// inject applies DEVICE's edits from the spec at specPath to a container whose own
// environment is env, with the CDI library's cache, as containerd and CRI-O do, and
// returns the container's resulting environment, mounts and device nodes.
func inject(specPath, device string, env []string) ([]string, error) {
	if _, err := checkCDISpec(specPath); err != nil {
		return nil, err
	}
	// The cache reads a directory: give it one holding this spec alone.
	dir, err := os.MkdirTemp("", "cdi-inject")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	data, err := os.ReadFile(specPath)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, filepath.Base(specPath)), data, 0o644); err != nil {
		return nil, err
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if err != nil {
		return nil, err
	}
	for path, errs := range cache.GetErrors() {
		if len(errs) > 0 {
			return nil, fmt.Errorf("%s: %v", path, errs)
		}
	}
	container := &oci.Spec{Process: &oci.Process{Env: append([]string(nil), env...)}}
	if unresolved, err := cache.InjectDevices(container, device); err != nil {
		return nil, fmt.Errorf("injecting %s (unresolved %v): %w", device, unresolved, err)
	}
	var out []string
	for _, e := range container.Process.Env {
		out = append(out, "env "+e)
	}
	for _, m := range container.Mounts {
		out = append(out, fmt.Sprintf("mount %s %s %s", m.Source, m.Destination, strings.Join(m.Options, ",")))
	}
	if container.Linux != nil {
		for _, d := range container.Linux.Devices {
			out = append(out, "device "+d.Path)
		}
	}
	return out, nil
}
