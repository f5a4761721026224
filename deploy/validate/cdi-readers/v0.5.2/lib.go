package main

import "github.com/container-orchestrated-devices/container-device-interface/pkg/cdi"

// release is the library release this module pins, and the runtimes that vendor it.
const release = "github.com/container-orchestrated-devices/container-device-interface v0.5.2, as podman 4.3.1 (Debian 12) vendor"

func readSpec(path string) error {
	_, err := cdi.ReadSpec(path, 0)
	return err
}

func newCache(dir string) (cache, error) {
	return cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
}
