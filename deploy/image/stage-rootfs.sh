#!/usr/bin/env bash
# Lays out the runtime image's root file system in ROOTFS (run inside the image builder, as root).
#
#   stage-rootfs.sh ROOTFS BINARY... [-- EXCLUDE_REGEX]
#
# ROOTFS gets the binaries in /opt/rubato/bin, exactly their shared-library closure as ldd reports
# it (the dynamic loader included), each library at its canonical path (Debian 12 and Ubuntu 24.04
# merge /lib into /usr/lib: the top-level /lib, /lib64 symlinks are recreated), the Debian copyright
# files of the packages those libraries come from, /etc/passwd and /etc/group with the non-root user
# rubato (65532:65532), /etc/nsswitch.conf, a world-writable /tmp and, when installed, the
# Fashion-MNIST IDX files of Debian's dataset-fashion-mnist at /usr/share/datasets/fashion-mnist.
# Libraries whose path matches EXCLUDE_REGEX (an extended regular expression) are left out: the
# GPU image takes glibc and the CUDA libraries from its base instead. Without one, it ends by
# running each binary with --version under chroot, so that a library missing from the closure
# fails the build here rather than at the container's start.
set -euo pipefail

[ $# -ge 2 ] || { echo "usage: $0 ROOTFS BINARY... [-- EXCLUDE_REGEX]" >&2; exit 2; }
rootfs=$1
shift
bins=()
exclude='^$'
while [ $# -gt 0 ]; do
  if [ "$1" = -- ]; then exclude=$2; break; fi
  bins+=("$1")
  shift
done

mkdir -p "$rootfs/opt/rubato/bin" "$rootfs/etc"
install -d -m 1777 "$rootfs/tmp"
for b in "${bins[@]}"; do
  install -m 755 "$b" "$rootfs/opt/rubato/bin/$(basename "$b")"
done

# Every library any binary needs, and the interpreter each names, at its canonical directory.
libs=()
for b in "${bins[@]}"; do
  if ldd "$b" | grep -q 'not found'; then
    echo "stage-rootfs: $b: missing libraries:" >&2
    ldd "$b" | grep 'not found' >&2
    exit 1
  fi
  # Lines are "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)".
  while read -r path; do libs+=("$path"); done < <(ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
  interp=$(readelf -l "$b" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')
  if [ -n "$interp" ]; then libs+=("$interp"); fi
done
packages=()
for lib in $(printf '%s\n' "${libs[@]}" | sort -u); do
  if printf '%s\n' "$lib" | grep -Eq "$exclude"; then continue; fi
  dir=$(readlink -f "$(dirname "$lib")")
  mkdir -p "$rootfs$dir"
  cp -L "$lib" "$rootfs$dir/$(basename "$lib")"
  # The Debian package that ships it (dpkg knows the real file under either /lib or /usr/lib).
  pkg=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null | head -n 1 | cut -d: -f1) ||
    pkg=$(dpkg -S "$lib" 2>/dev/null | head -n 1 | cut -d: -f1) || pkg=
  if [ -n "$pkg" ]; then packages+=("$pkg"); fi
done

# The usr-merge symlinks (/lib -> usr/lib, /lib64 -> usr/lib64) as they are here, where something
# was copied behind them: the ELF interpreter path and the loader's built-in search path
# (/lib/x86_64-linux-gnu, then /usr/lib/x86_64-linux-gnu) go through them.
for d in /lib /lib64; do
  if [ -L "$d" ] && [ -d "$rootfs$(readlink -f "$d")" ]; then ln -sfn "$(readlink "$d")" "$rootfs$d"; fi
done

# The data set (the worker's default --data_dir), if the builder installed it.
if [ -d /usr/share/datasets/fashion-mnist ]; then
  mkdir -p "$rootfs/usr/share/datasets/fashion-mnist"
  cp /usr/share/datasets/fashion-mnist/*.gz "$rootfs/usr/share/datasets/fashion-mnist/"
  packages+=(dataset-fashion-mnist)
fi

# Licences of everything shipped.
for pkg in $(printf '%s\n' "${packages[@]}" | sort -u); do
  if [ -f "/usr/share/doc/$pkg/copyright" ]; then
    mkdir -p "$rootfs/usr/share/doc/$pkg"
    cp "/usr/share/doc/$pkg/copyright" "$rootfs/usr/share/doc/$pkg/copyright"
  fi
done

cat > "$rootfs/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
rubato:x:65532:65532:rubato:/tmp:/sbin/nologin
EOF
cat > "$rootfs/etc/group" <<'EOF'
root:x:0:
rubato:x:65532:
EOF
# Without this file glibc would try DNS before /etc/hosts.
cat > "$rootfs/etc/nsswitch.conf" <<'EOF'
passwd: files
group: files
hosts: files dns
EOF

# Each binary must start with nothing but what is in the root file system (not checkable here
# when libraries are left out for the base image to provide).
if [ "$exclude" = '^$' ]; then
  for b in "${bins[@]}"; do
    chroot "$rootfs" "/opt/rubato/bin/$(basename "$b")" --version >/dev/null
  done
fi
echo "stage-rootfs: $(find "$rootfs" -type f | wc -l) files, $(du -sh "$rootfs" | cut -f1)"
