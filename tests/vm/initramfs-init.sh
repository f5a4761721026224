#!/bin/sh
# PID 1 of the test guest (busybox sh inside the initramfs built by tests/vm/lib.sh).
#
# Loads the kernel modules listed in /modules.order, mounts the host's root file system
# read-only (9p tag "host") and the writable output directory (9p tag "out") at the same
# path it has on the host, gives the chroot the pseudo file systems and tmpfs scratch it
# needs (keeping the paths in $justitia_out/keep visible), runs "$justitia_out/job.sh" inside the chroot and powers off. The kernel passes
# unknown "name=value" command-line parameters to init as environment variables; that is
# how justitia_out and justitia_timeout arrive.
export PATH=/bin

log() { echo "init: $*"; }

halt() {
    sync
    poweroff -f
    sleep 5
}

# A failure before the job runs: leave the reason where the host looks for it.
fail() {
    log "FAILED: $*"
    if [ -d "/host${justitia_out:-/nonexistent}" ]; then
        echo "$*" > "/host$justitia_out/boot-error"
    fi
    halt
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# The initramfs has no /dev/console node of its own (building it needs no root that way).
exec </dev/console >/dev/console 2>&1

while read -r module; do
    insmod "/lib/modules/$module.ko" || fail "insmod $module"
done < /modules.order
log "modules loaded"

[ -n "${justitia_out:-}" ] || fail "no justitia_out= on the kernel command line"
mkdir -p /host
# cache=loose: the share is read-only and fixed for the life of the guest, so caching
# directory entries and pages makes every binary and library load cheaper under TCG.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose host /host \
    || fail "mount host root over 9p"
# The chroot's /tmp and /var/tmp are scratch tmpfs, but the host paths the job needs that
# lie under them (the repository and the build output, listed one per line in
# $justitia_out/keep) stay visible: a clone in /tmp must test itself, not an empty directory.
keep=""
[ -f "/host$justitia_out/keep" ] && keep=$(cat "/host$justitia_out/keep")
for scratch in /tmp /var/tmp; do
    mkdir -p "/hidden$scratch"
    mount -o bind "/host$scratch" "/hidden$scratch" || fail "bind $scratch aside"
    mount -t tmpfs -o mode=1777 tmpfs "/host$scratch" || fail "tmpfs $scratch"
    printf '%s\n' "$keep" | while IFS= read -r path; do
        case $path in
            "$scratch"/*)
                mkdir -p "/host$path" || fail "mkdir $path"
                mount -o bind "/hidden$path" "/host$path" || fail "keep $path visible"
                ;;
        esac
    done
done
mkdir -p "/host$justitia_out"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 out "/host$justitia_out" \
    || fail "mount output directory over 9p"
mount -t proc proc /host/proc || fail "proc in chroot"
mount -t sysfs sysfs /host/sys || fail "sysfs in chroot"
mount -t devtmpfs devtmpfs /host/dev || fail "devtmpfs in chroot"
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm
mount -t tmpfs tmpfs /host/run || fail "tmpfs /run"
log "file systems ready; running the job"

chroot /host /usr/bin/env -i \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp LANG=C.UTF-8 VM_OUT="$justitia_out" \
    /usr/bin/timeout --kill-after=10 "${justitia_timeout:-600}" \
    /bin/bash "$justitia_out/job.sh" > "/host$justitia_out/job.log" 2>&1
rc=$?
echo "$rc" > "/host$justitia_out/job.rc"
log "job exited with status $rc"
umount "/host$justitia_out"
halt
