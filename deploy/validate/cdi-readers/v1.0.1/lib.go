package main

import "tags.cncf.io/container-device-interface/pkg/cdi"

// release is the library release this module pins, and the runtimes that vendor it.
const release = "tags.cncf.io/container-device-interface v1.0.1, as containerd 2.1.5 and 2.2.0, CRI-O 1.34.0 vendor"

func readSpec(path string) error {
	_, err := cdi.ReadSpec(path, 0)
	return err
}

func newCache(dir string) (cache, error) {
	return cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
}
