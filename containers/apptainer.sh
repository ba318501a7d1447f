#!/usr/bin/env bash
# Install Apptainer on a Debian 12 host (as root), for the container backend of agent sandboxes.
#
# Debian 12 ships no Apptainer; Debian unstable does (package `apptainer`), built against a newer C
# library than Debian 12's. So both packages are fetched from unstable with apt (signatures checked,
# nothing of the host's package state touched), unpacked under PREFIX, and Apptainer's two programs
# are pointed at unstable's C library in PREFIX/glibc (patchelf: interpreter and RPATH); the host's
# own libc stays as it is. Apptainer finds its configuration relative to its binary, so PREFIX/bin/
# apptainer works from anywhere; /usr/local/bin/apptainer links to it. Runs without setuid: as a
# normal user it uses user namespaces and squashfuse to mount SIF images.
#
# Idempotent: an apptainer that already runs is left alone.
# Usage: bash containers/apptainer.sh [PREFIX]   (default /opt/miles-apptainer)
set -euo pipefail
PREFIX=${1:-/opt/miles-apptainer}
export DEBIAN_FRONTEND=noninteractive

if command -v apptainer >/dev/null && apptainer version >/dev/null 2>&1; then
  echo "apptainer $(apptainer version) already installed: $(command -v apptainer)"; exit 0
fi
[ "$(id -u)" = 0 ] || { echo "containers/apptainer.sh: run as root (it installs Debian packages)" >&2; exit 1; }

# what Apptainer needs from Debian 12 itself: squashfs tools to build SIF files, squashfuse and
# uidmap for unprivileged use, patchelf for the step below
need="squashfs-tools squashfuse uidmap patchelf ca-certificates"
missing=$(for p in $need; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then apt-get update -q && apt-get install -y -q $missing; fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
chmod 755 "$work" "$work/debs"
echo "deb http://deb.debian.org/debian unstable main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Dir::State::Status=/dev/null
  -o APT::Get::List-Cleanup=0 -q)
apt-get "${apt_opts[@]}" update >/dev/null
(cd "$work/debs" && apt-get "${apt_opts[@]}" download apptainer libc6 2>&1 | grep -v unsandboxed || true)

rm -rf "$PREFIX" && mkdir -p "$PREFIX/glibc" "$work/x" "$work/libc"
dpkg-deb -x "$work"/debs/apptainer_*.deb "$work/x"
dpkg-deb -x "$work"/debs/libc6_*.deb "$work/libc"
cp -a "$work/x/usr/." "$PREFIX/"
cp -a "$work/x/etc" "$work/x/var" "$PREFIX/"
cp -a "$work/libc/usr/lib/x86_64-linux-gnu/." "$PREFIX/glibc/"
# the starter takes the directory above its libexec directory (PREFIX/lib) as its prefix
ln -s ../etc "$PREFIX/lib/etc"
ln -s ../var "$PREFIX/lib/var"
for bin in "$PREFIX/bin/apptainer" "$PREFIX/lib/x86_64-linux-gnu/apptainer/bin/starter"; do
  patchelf --set-interpreter "$PREFIX/glibc/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$PREFIX/glibc" "$bin"
done
ln -sf "$PREFIX/bin/apptainer" /usr/local/bin/apptainer
echo "apptainer $(apptainer version) installed in $PREFIX ($(ls "$work"/debs | tr '\n' ' '))"
