package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// rdmaDevice is one RDMA device of the node: its name and its verbs node under
// /dev/infiniband.
type rdmaDevice struct {
	name   string // mlx5_0, rxe0
	uverbs string // uverbs0
}

// Most devices read from sysfs, and longest ibdev file: a runaway tree must not make a
// runaway response.
const (
	maxDevices = 256
	maxIbdev   = 256
)

// listDevices reads the node's RDMA devices from sysfs: each
// class/infiniband_verbs/uverbsN/ibdev names the device whose verbs node is uverbsN.
// They come sorted by verbs node number.
func listDevices(sysfs string) ([]rdmaDevice, error) {
	dir := filepath.Join(sysfs, "class", "infiniband_verbs")
	entries, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", dir, err)
	}
	var found []rdmaDevice
	for _, e := range entries {
		if uverbsNumber(e.Name()) < 0 {
			continue // abi_version
		}
		if len(found) == maxDevices {
			return nil, fmt.Errorf("more than %d verbs devices in %s", maxDevices, dir)
		}
		name, err := readIbdev(filepath.Join(dir, e.Name(), "ibdev"))
		if err != nil {
			return nil, err
		}
		found = append(found, rdmaDevice{name: name, uverbs: e.Name()})
	}
	slices.SortFunc(found, func(a, b rdmaDevice) int { return uverbsNumber(a.uverbs) - uverbsNumber(b.uverbs) })
	return found, nil
}

// uverbsNumber is N of uverbsN, or -1 for another name.
func uverbsNumber(name string) int {
	digits, ok := strings.CutPrefix(name, "uverbs")
	if !ok || digits == "" {
		return -1
	}
	n, err := strconv.Atoi(digits)
	if err != nil || n < 0 || strconv.Itoa(n) != digits {
		return -1
	}
	return n
}

func readIbdev(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxIbdev))
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", path, err)
	}
	name := strings.TrimSpace(string(data))
	if !validDeviceName(name) {
		return "", fmt.Errorf("%s: %q is not a device name", path, name)
	}
	return name, nil
}

// validDeviceName: letters, digits, _ - . :, starting and ending with a letter or digit
// (what a CDI device name allows, and every kernel RDMA device name has).
func validDeviceName(name string) bool {
	if name == "" || len(name) > 64 {
		return false
	}
	alnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' }
	for i := 0; i < len(name); i++ {
		if !alnum(name[i]) && !strings.ContainsRune("_-.:", rune(name[i])) {
			return false
		}
	}
	return alnum(name[0]) && alnum(name[len(name)-1])
}

// selectDevices keeps the devices named in want (all of them when want is empty), in
// sysfs order. A wanted device the node lacks is simply absent: the pool then reports
// fewer devices, or none and unhealthy.
func selectDevices(all []rdmaDevice, want []string) []rdmaDevice {
	if len(want) == 0 {
		return all
	}
	var out []rdmaDevice
	for _, d := range all {
		if slices.Contains(want, d.name) {
			out = append(out, d)
		}
	}
	return out
}

// hasRdmaCM says whether the node has /dev/infiniband/rdma_cm (sysfs class/misc/rdma_cm,
// present once rdma_ucm is loaded).
func hasRdmaCM(sysfs string) bool {
	_, err := os.Stat(filepath.Join(sysfs, "class", "misc", "rdma_cm"))
	return err == nil
}
