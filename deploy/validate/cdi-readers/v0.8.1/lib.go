package main

import "tags.cncf.io/container-device-interface/pkg/cdi"

// release is the library release this module pins, and the runtimes that vendor it.
const release = "tags.cncf.io/container-device-interface v0.8.1, as containerd 1.7.35 vendor"

func readSpec(path string) error {
	_, err := cdi.ReadSpec(path, 0)
	return err
}

func newCache(dir string) (cache, error) {
	return cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
}
