// Command validate checks Justitia's deployment files against the projects' own
// definitions: the Kubernetes manifests (built with kustomize, each object decoded
// strictly into the k8s.io/api types, so an unknown or misspelt field is an error),
// justitiad's configuration copy, the Dockerfile (BuildKit's parser and its lint rules),
// and CDI specs (the CDI project's strict parser and validation). It also applies a CDI
// device's edits to a container as a runtime would, for the guest test.
//
//	validate repo ROOT BIN_DIR            the manifests, the configuration copy and the Dockerfile,
//	                                      with justitia and justitiad from BIN_DIR
//	validate cdi SPEC...                  CDI spec files
//	validate inject SPEC DEVICE [K=V...]  a container with environment K=V... given DEVICE:
//	                                      prints its "env K=V", "mount SRC DST OPTS" and
//	                                      "device PATH" lines
package main

import (
	"fmt"
	"os"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "validate: %v\n", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("usage: validate repo ROOT BIN_DIR | cdi SPEC... | inject SPEC DEVICE [K=V...]")
	}
	switch args[0] {
	case "repo":
		if len(args) != 3 {
			return fmt.Errorf("usage: validate repo ROOT BIN_DIR")
		}
		report, err := checkRepo(args[1], args[2])
		if err != nil {
			return err
		}
		fmt.Print(report)
		return nil
	case "cdi":
		if len(args) < 2 {
			return fmt.Errorf("usage: validate cdi SPEC...")
		}
		for _, path := range args[1:] {
			summary, err := checkCDISpec(path)
			if err != nil {
				return err
			}
			fmt.Printf("%s: ok, %s\n", path, summary)
		}
		return nil
	case "inject":
		if len(args) < 3 {
			return fmt.Errorf("usage: validate inject SPEC DEVICE [K=V...]")
		}
		lines, err := inject(args[1], args[2], args[3:])
		if err != nil {
			return err
		}
		for _, l := range lines {
			fmt.Println(l)
		}
		return nil
	}
	return fmt.Errorf("unknown command %q", args[0])
}
