# shellcheck shell=bash
# Inside the guest: container images assembled from the guest's own packages (no registry
# is reachable), as root file systems for `podman import`. Sourced by cdi.sh.
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
