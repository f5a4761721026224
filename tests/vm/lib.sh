# shellcheck shell=bash
# Host-side helpers for the Soft-RoCE guest: prerequisites, the cached Debian kernel,
# the busybox initramfs and the QEMU invocation. Sourced by guest.sh, run-tests.sh and
# isolation-bench.sh; see tests/vm/README.md for what the guest looks like from inside.
#
# Facts this relies on (measured on this kind of machine, see the project notes): the
# host kernel has no InfiniBand, so Soft-RoCE runs in a TCG guest (KVM hangs at boot);
# the guest uses the host's own user space through a read-only 9p share of "/".

VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VM_REPO=$(cd "$VM_DIR/../.." && pwd)
VM_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/justitia/vm
# depmod, modprobe and rdma live in the sbin directories, which a user's PATH may lack.
PATH=$PATH:/usr/sbin:/sbin

# The modules the guest needs (modprobe's dependency walk adds what they depend on):
# virtio and 9p for the shares, Soft-RoCE and veth for the device, the connection manager
# for rping and rdma_cm-based tools, virtio_net for the link between the two guests of
# the two-host checks, the token bucket qdisc that makes the pair's cable a wire of known
# rate (tests/vm/guest/wire.sh), and for the incast's bucket on the receiving side the
# ingress qdisc, a filter matching all and its redirect action to an IFB device (ifb0,
# made when the module loads). crc32_generic is not a declared dependency of rdma_rxe,
# but without it "rdma link add" fails with ENOENT.
VM_MODULES=(virtio_pci 9pnet_virtio 9p crc32_generic rdma_rxe veth rdma_ucm virtio_net sch_tbf
  sch_ingress cls_matchall act_mirred ifb)
# The kernel cache directory's name carries a hash of the module set, so that a checkout
# with another set unpacks its own beside it and never rewrites one in use.
VM_MODULES_KEY=$(printf '%s\n' "${VM_MODULES[@]}" | sha256sum | cut -c1-8)

# Debian packages whose commands the harness and the guest use, as "command:package".
VM_PREREQS=(
  qemu-system-x86_64:qemu-system-x86 cpio:cpio gzip:gzip depmod:kmod modprobe:kmod
  ibv_devinfo:ibverbs-utils ibv_rc_pingpong:ibverbs-utils rping:rdmacm-utils
  ib_write_bw:perftest rdma:iproute2 ip:iproute2 timeout:coreutils
  cc:gcc valgrind:valgrind python3:python3 musl-gcc:musl-tools podman:podman runc:runc
)

vm_log() { printf 'vm: %s\n' "$*" >&2; }

# Prints one "what (package)" line per missing prerequisite; prints nothing when all are there.
vm_missing_prereqs() {
  local entry cmd pkg
  for entry in "${VM_PREREQS[@]}"; do
    cmd=${entry%%:*}
    pkg=${entry#*:}
    command -v "$cmd" >/dev/null 2>&1 || echo "$cmd ($pkg)"
  done
  # The initramfs needs a statically linked busybox; Debian's busybox-static installs it here.
  if ! [ -x /bin/busybox ] || ! dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "install ok installed"; then
    echo "static /bin/busybox (busybox-static)"
  fi
  ls /usr/lib/*/libibverbs/librxe-* >/dev/null 2>&1 || echo "Soft-RoCE provider librxe (ibverbs-providers)"
  if ! vm_cached_kernel_dir >/dev/null && ! command -v apt-get >/dev/null 2>&1; then
    echo "a cached guest kernel or apt-get to download one (apt)"
  fi
}

# The newest complete kernel already in the cache, if any.
vm_cached_kernel_dir() {
  local k newest=""
  for k in "$VM_CACHE"/linux-image-6.1.0-*-amd64-m"$VM_MODULES_KEY"; do
    [ -e "$k/complete" ] && newest=$(printf '%s\n%s\n' "$newest" "$k" | sort -V | tail -n 1)
  done
  [ -n "$newest" ] && echo "$newest"
}

# The newest Debian 6.1 kernel image package apt offers (JUSTITIA_VM_KERNEL_PKG overrides).
vm_newest_kernel_package() {
  if [ -n "${JUSTITIA_VM_KERNEL_PKG:-}" ]; then
    echo "$JUSTITIA_VM_KERNEL_PKG"
    return
  fi
  apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' 2>/dev/null \
    | awk '{print $1}' | sort -V | tail -n 1
}

# Makes sure a kernel (vmlinuz, the needed modules and their load order) is cached and
# prints its directory. Downloads with "apt-get download" and unpacks with dpkg -x; the
# package is never installed.
vm_ensure_kernel() {
  local pkg dir work ver kdir line
  pkg=$(vm_newest_kernel_package)
  if [ -z "$pkg" ] && [ "$(id -u)" = 0 ]; then
    apt-get update -qq >&2 || true
    pkg=$(vm_newest_kernel_package)
  fi
  if [ -z "$pkg" ]; then
    if dir=$(vm_cached_kernel_dir); then
      echo "$dir"
      return 0
    fi
    vm_log "apt offers no linux-image-6.1.0-NN-amd64 package and none is cached"
    return 1
  fi
  dir=$VM_CACHE/$pkg-m$VM_MODULES_KEY
  if [ -e "$dir/complete" ]; then
    echo "$dir"
    return 0
  fi
  vm_log "downloading $pkg into $VM_CACHE"
  rm -rf "$dir"
  mkdir -p "$dir/modules"
  work=$(mktemp -d "$VM_CACHE/unpack.XXXXXX")
  # apt-get download runs as _apt when it can; a private directory it can write avoids
  # the "unsandboxed" warning and works for root and for users alike.
  chmod 0777 "$work"
  if ! (cd "$work" && timeout 300 apt-get download -q -o APT::Sandbox::User=root "$pkg" >&2); then
    rm -rf "$work" "$dir"
    vm_log "apt-get download $pkg failed"
    # An older kernel from an earlier run boots the guest just as well.
    if dir=$(vm_cached_kernel_dir); then
      vm_log "using the cached $(basename "$dir") instead"
      echo "$dir"
      return 0
    fi
    return 1
  fi
  dpkg -x "$work"/"$pkg"_*.deb "$work/root" || { rm -rf "$work"; return 1; }
  ver=${pkg#linux-image-}
  kdir=$work/root/lib/modules/$ver
  depmod -b "$work/root" "$ver" || { rm -rf "$work"; return 1; }
  cp "$work/root/boot/vmlinuz-$ver" "$dir/vmlinuz"
  : > "$dir/modules.order"
  for m in "${VM_MODULES[@]}"; do
    modprobe -d "$work/root" -S "$ver" --show-depends "$m" | while read -r line; do
      case $line in
        insmod\ *)
          line=${line#insmod }
          line=${line%% *}
          name=$(basename "$line" .ko)
          if ! grep -qx "$name" "$dir/modules.order"; then
            cp "$line" "$dir/modules/$name.ko"
            echo "$name" >> "$dir/modules.order"
          fi
          ;;
      esac
    done
  done
  echo "$ver" > "$dir/version"
  rm -rf "$work"
  touch "$dir/complete"
  echo "$dir"
}

# Builds (or reuses) the initramfs for a cached kernel and prints its path. The cache key
# covers everything that goes into it: the init script, busybox and the module set.
vm_ensure_initramfs() {
  local kdir=$1 key out root m
  key=$(cat "$VM_DIR/initramfs-init.sh" /bin/busybox "$kdir/modules.order" | sha256sum | cut -c1-16)
  out=$kdir/initramfs-$key.cpio.gz
  if [ -s "$out" ]; then
    echo "$out"
    return 0
  fi
  root=$(mktemp -d "$VM_CACHE/initramfs.XXXXXX")
  mkdir -p "$root"/{bin,dev,proc,sys,host,lib/modules}
  cp /bin/busybox "$root/bin/busybox"
  for m in sh mount umount insmod mkdir poweroff sleep sync cat chroot; do
    ln -s busybox "$root/bin/$m"
  done
  cp "$VM_DIR/initramfs-init.sh" "$root/init"
  chmod 0755 "$root/init"
  cp "$kdir/modules.order" "$root/modules.order"
  cp "$kdir"/modules/*.ko "$root/lib/modules/"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$out.$$.tmp" && mv "$out.$$.tmp" "$out"
  rm -rf "$root"
  echo "$out"
}

# vm_boot OUT TIMEOUT [QEMU_ARG...]: boots the guest, which runs OUT/job.sh in the chroot
# with at most TIMEOUT seconds, and waits for it to power off. The console goes to
# OUT/console.log, the job's output to OUT/job.log and its status to OUT/job.rc. Returns
# the job's status, 124 if the job or the guest timed out, 125 if the guest failed before
# the job ran. VM_SMP (2) and VM_MEM (2048 MiB) size the guest; QEMU_ARGs are added to its
# command line (the two-host pair's network card).
vm_boot() {
  local out=$1 limit=$2 kdir initrd rc
  shift 2
  kdir=$(vm_ensure_kernel) || return 125
  initrd=$(vm_ensure_initramfs "$kdir") || return 125
  rm -f "$out/job.rc" "$out/boot-error"
  # Host paths the guest must not hide behind its scratch /tmp and /var/tmp.
  {
    echo "$VM_REPO"
    [ -z "${CARGO_TARGET_DIR:-}" ] || realpath -m "$CARGO_TARGET_DIR"
    [ -z "${JUSTITIA_VM_KEEP:-}" ] || tr ':' '\n' <<<"$JUSTITIA_VM_KEEP"
  } > "$out/keep"
  # The guest gets the job's limit; QEMU gets that plus room for boot and power-off.
  timeout --kill-after=10 $((limit + 120)) qemu-system-x86_64 \
    -accel tcg -smp "${VM_SMP:-2}" -m "${VM_MEM:-2048}" -nodefaults -nic none -display none -no-reboot \
    -serial "file:$out/console.log" -monitor none -pidfile "$out/qemu.pid" \
    -kernel "$kdir/vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 panic=-1 loglevel=4 mitigations=off no_timer_check justitia_out=$out justitia_timeout=$limit" \
    -virtfs local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap \
    -virtfs "local,path=$out,mount_tag=out,security_model=none" "$@" \
    </dev/null >"$out/qemu.log" 2>&1
  rc=$?
  if [ -s "$out/job.rc" ]; then
    return "$(cat "$out/job.rc")"
  fi
  if [ -s "$out/boot-error" ]; then
    vm_log "guest failed before the job ran: $(cat "$out/boot-error") (console: $out/console.log)"
    return 125
  fi
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    vm_log "guest timed out after $((limit + 120)) s (console: $out/console.log)"
    return 124
  fi
  vm_log "guest stopped without a job status (qemu status $rc; console: $out/console.log, qemu: $out/qemu.log)"
  return 125
}

# vm_write_job OUT CMD...: the script the guest runs: bring up its device (VM_UP, default
# tests/vm/guest/rdma-up.sh: rxe0 on a veth pair), then CMD from the repository root.
vm_write_job() {
  local out=$1
  shift
  {
    echo '#!/bin/bash'
    echo "cd $(printf '%q' "$VM_REPO") || exit 125"
    echo "${VM_UP:-tests/vm/guest/rdma-up.sh} || exit 125"
    printf '%q ' "$@"
    echo
  } > "$out/job.sh"
}

# vm_boot_pair OUT_A OUT_B TIMEOUT [OUT_C]: boots two guests at once, host A running
# OUT_A/job.sh and host B OUT_B/job.sh, one emulated CPU and 1 GiB each (the build
# machines have two cores), joined by a virtual cable: each has a virtio-net card (eth0)
# on a QEMU datagram netdev whose two ends are Unix sockets in a scratch directory, so
# every frame one sends arrives at the other and nowhere else, and no TCP or UDP port of
# the machine is taken. With OUT_C, a third guest, host C, runs OUT_C/job.sh beside them
# (1 GiB too), on a second cable into B: B's emulator joins its card and the
# two cables in a QEMU hub (a repeater: a frame from any of the three goes to the other
# two), so the three hosts share one Ethernet segment and B keeps one card, one address
# and one RDMA device for what A and C send it. Returns A's status (as vm_boot does); B's
# is left in OUT_B/job.rc, C's in OUT_C/job.rc.
vm_boot_pair() {
  local out_a=$1 out_b=$2 limit=$3 out_c=${4:-} link rc_a pid_b pid_c="" kdir b_net
  # The boots need the kernel and the initramfs: made once, before any starts.
  kdir=$(vm_ensure_kernel) && vm_ensure_initramfs "$kdir" > /dev/null || return 125
  link=$(mktemp -d /tmp/justitia-link.XXXXXX)
  # shellcheck disable=SC2054 # QEMU's options are comma-separated within one word
  if [ -n "$out_c" ]; then
    b_net=(-netdev hubport,id=nic,hubid=0
      -netdev "dgram,id=link,local.type=unix,local.path=$link/b,remote.type=unix,remote.path=$link/a"
      -netdev hubport,id=toa,hubid=0,netdev=link
      -netdev "dgram,id=linkc,local.type=unix,local.path=$link/bc,remote.type=unix,remote.path=$link/c"
      -netdev hubport,id=toc,hubid=0,netdev=linkc
      -device virtio-net-pci,netdev=nic,mac=52:54:00:4a:00:02)
    VM_SMP=1 VM_MEM=1024 vm_boot "$out_c" "$limit" \
      -netdev "dgram,id=link,local.type=unix,local.path=$link/c,remote.type=unix,remote.path=$link/bc" \
      -device virtio-net-pci,netdev=link,mac=52:54:00:4a:00:03 &
    pid_c=$!
  else
    b_net=(-netdev "dgram,id=link,local.type=unix,local.path=$link/b,remote.type=unix,remote.path=$link/a"
      -device virtio-net-pci,netdev=link,mac=52:54:00:4a:00:02)
  fi
  VM_SMP=1 VM_MEM=1024 vm_boot "$out_b" "$limit" "${b_net[@]}" &
  pid_b=$!
  VM_SMP=1 VM_MEM=1024 vm_boot "$out_a" "$limit" \
    -netdev "dgram,id=link,local.type=unix,local.path=$link/a,remote.type=unix,remote.path=$link/b" \
    -device virtio-net-pci,netdev=link,mac=52:54:00:4a:00:01
  rc_a=$?
  # B and C power off when A's checks tell them to; if A ended without doing so, their
  # emulators are stopped after a grace period rather than left to their own time limit.
  vm_stop_after_grace "$pid_b" "$out_b" B
  [ -z "$pid_c" ] || vm_stop_after_grace "$pid_c" "$out_c" C
  rm -rf "$link"
  return "$rc_a"
}

# vm_stop_after_grace PID OUT NAME: waits up to 60 s for the vm_boot in the background
# (PID) to end, then stops its emulator.
vm_stop_after_grace() {
  local pid=$1 out=$2 name=$3
  for _ in $(seq 60); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$pid" 2>/dev/null && [ -s "$out/qemu.pid" ]; then
    vm_log "host $name still running 60 s after host A stopped: stopping it"
    kill "$(cat "$out/qemu.pid")" 2>/dev/null
  fi
  wait "$pid"
}
