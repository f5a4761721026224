# shellcheck shell=bash
# Inside the guest: container images assembled from the guest's own packages (no registry
# is reachable), and a runner that starts a process in one as an OCI runtime does with a
# CDI device applied. Sourced by cdi.sh.
#
# image_add ROOT FILE...: copies each FILE into the image ROOT at the same path, with every
# shared object `ldd` says it needs (and the dynamic linker), so that ROOT holds what the
# program needs and nothing of the guest else: no /etc/ld.so.cache, no /etc/ld.so.preload,
# no libjustitia. Paths under /lib are put under /usr/lib (ROOT is merged-/usr, as Debian
# and Ubuntu images are).
image_add() {
  local root=$1 f lib
  shift
  mkdir -p "$root/usr/bin" "$root/usr/lib" "$root/usr/lib64" "$root/etc" "$root/tmp"
  [ -e "$root/bin" ] || ln -s usr/bin "$root/bin"
  [ -e "$root/lib" ] || ln -s usr/lib "$root/lib"
  [ -e "$root/lib64" ] || ln -s usr/lib64 "$root/lib64"
  for f in "$@"; do
    image_copy "$root" "$f" || return 1
    # ldd prints "name => /path (addr)" and "/path (addr)" lines; a static program none.
    for lib in $(ldd "$f" 2> /dev/null | grep -o '/[^ ]*'); do
      image_copy "$root" "$lib" || return 1
    done
  done
}

# image_copy ROOT PATH: PATH's file (symbolic links followed) at its merged-/usr path.
image_copy() {
  local root=$1 path=$2 dest
  case $path in
    /lib/* | /lib64/* | /bin/*) dest=$root/usr$path ;;
    *) dest=$root$path ;;
  esac
  mkdir -p "$(dirname "$dest")"
  cp -L "$path" "$dest"
}

# image_glibc ROOT: every shared object of Debian's libc6 package, as every glibc image has
# (libpthread.so.0, libdl.so.2 and librt.so.1 too, which programs built for glibc 2.34 and
# later no longer name, but objects built for older ones, such as the shaper, do).
image_glibc() {
  local root=$1 f
  for f in $(dpkg -L libc6 | grep -E '^/(usr/)?lib(64)?/(x86_64-linux-gnu/)?[^/]*\.so(\.[0-9]+)*$'); do
    [ -f "$f" ] && { image_copy "$root" "$f" || return 1; }
  done
}

# image_verbs ROOT: libibverbs' configuration and the rxe provider with what it needs.
image_verbs() {
  local root=$1 p
  mkdir -p "$root/etc/libibverbs.d"
  cp /etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/"
  for p in /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so; do
    image_add "$root" "$p" || return 1
  done
}

# CONTAINER_RUNNER: the script run_container runs in a private mount namespace. Arguments:
# ROOT, the mounts ("SRC DST OPTIONS" words, as deploy/validate's inject prints them), --,
# the device nodes, --, the environment (NAME=VALUE words), --, the command. As runc does
# for a container: mount points created in the image for each mount (a directory or an
# empty file like its source), each bound and remounted with its options; proc, a tmpfs
# /dev with the device nodes bound in, sysfs read-only, a tmpfs /tmp; then the command
# started in the image's root with exactly that environment.
CONTAINER_RUNNER='
set -e
root=$1
shift
mount --make-rprivate /
mkdir -p "$root/dev" "$root/proc" "$root/sys" "$root/tmp"
mount -t tmpfs -o mode=0755 tmpfs "$root/dev"
touch "$root/dev/null"
mount --bind /dev/null "$root/dev/null"
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount -o remount,bind,ro "$root/sys"
mount -t tmpfs tmpfs "$root/tmp"
while [ "$1" != -- ]; do
  read -r src dst opts <<< "$1"
  shift
  if [ -d "$src" ]; then mkdir -p "$root$dst"; else mkdir -p "$(dirname "$root$dst")"; [ -e "$root$dst" ] || touch "$root$dst"; fi
  mount --bind "$src" "$root$dst"
  rest=$(echo "$opts" | tr , "\n" | grep -vx bind | paste -sd ,)
  [ -z "$rest" ] || mount -o "remount,bind,$rest" "$root$dst"
done
shift
while [ "$1" != -- ]; do
  mkdir -p "$(dirname "$root$1")"
  touch "$root$1"
  mount --bind "$1" "$root$1"
  shift
done
shift
env=()
while [ "$1" != -- ]; do env+=("$1"); shift; done
shift
exec chroot "$root" /usr/bin/env -i "${env[@]}" "$@"
'

# run_container SECONDS ROOT COMMAND...: COMMAND in the image ROOT (which must hold
# /usr/bin/env) with the edits in EDIT_MOUNTS, EDIT_DEVICES and EDIT_ENV (arrays as the
# runner takes them), in a mount namespace of its own, stopped after SECONDS; returns its
# exit status (124 when stopped).
run_container() {
  local secs=$1 root=$2
  shift 2
  timeout "$secs" unshare -m --propagation private bash -c "$CONTAINER_RUNNER" runner "$root" \
    "${EDIT_MOUNTS[@]}" -- "${EDIT_DEVICES[@]}" -- "${EDIT_ENV[@]}" -- "$@"
}

# image_env ROOT: busybox (statically linked: no C library of its own to load) as the
# image's /usr/bin/env, which the runner starts every command with.
image_env() {
  mkdir -p "$1/usr/bin"
  cp /bin/busybox "$1/usr/bin/env"
}
