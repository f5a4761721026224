// Command cdi-read reads a CDI spec with one pinned release of the CDI project's library,
// the one a container runtime vendors, through the library's spec cache as that runtime
// does, and resolves devices in it by name. Each directory v*/ of cdi-readers is a module
// pinning one release; this file is linked into each (a symbolic link: one go.mod cannot
// hold two releases of one module), and the module's lib.go binds it to its release.
//
//	cdi-read SPEC [DEVICE...]
//
// It prints "ok" and how many devices the cache lists; a spec the release refuses, or a
// DEVICE (a fully qualified name, KIND=NAME) it does not resolve, is an error and exit
// status 1. Applying the edits needs the host's device nodes, so it is left to the guest
// suite's real runtime.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
)

// cache is what a runtime uses of the library's spec cache to find devices.
type cache interface {
	GetErrors() map[string][]error
	ListDevices() []string
}

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "cdi-read (%s): %v\n", release, err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) < 1 {
		return fmt.Errorf("usage: cdi-read SPEC [DEVICE...]")
	}
	if err := readSpec(args[0]); err != nil {
		return err
	}
	// The cache reads directories, as runtimes do: give it one holding this spec alone.
	dir, err := os.MkdirTemp("", "cdi-read")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	data, err := os.ReadFile(args[0])
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, filepath.Base(args[0])), data, 0o644); err != nil {
		return err
	}
	c, err := newCache(dir)
	if err != nil {
		return err
	}
	for path, errs := range c.GetErrors() {
		if len(errs) > 0 {
			return fmt.Errorf("%s: %v", path, errs)
		}
	}
	listed := c.ListDevices()
	for _, device := range args[1:] {
		if !slices.Contains(listed, device) {
			return fmt.Errorf("%s: device %s is not resolved (the cache lists %d devices)", args[0], device, len(listed))
		}
	}
	fmt.Printf("%s: ok, %d devices listed, %d asked for resolved\n", args[0], len(listed), len(args)-1)
	return nil
}
