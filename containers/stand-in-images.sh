#!/usr/bin/env bash
# Build, without a registry, Apptainer images standing in for the public images the shipped Harbor
# tasks name, under the file names `apptainer pull` gives them, so that the container sandbox backend
# finds them with `image_dir: DIR` (miles/agentic/sandbox/container.py):
#
#   debian_bookworm-slim.sif          debian:bookworm-slim          Debian 12 minbase
#   python_3.11-slim.sif              python:3.11-slim              Debian 12 minbase + python3 (3.11), pip
#   buildpack-deps_bookworm-scm.sif   buildpack-deps:bookworm-scm   Debian 12 minbase + git, curl
#
# and, as links to those, stand-ins for the bases the third-party tasks of tests/foreign_tasks name:
#
#   ubuntu_24.04.sif                  ubuntu:24.04                  -> debian_bookworm-slim.sif
#   python_3.13-slim-bookworm.sif     python:3.13-slim-bookworm     -> python_3.11-slim.sif
#   python-3-13_20250620.sif          Terminal-Bench 1's python-3-13 -> python_3.11-slim.sif
#
# (apt-get, pip and python3 behave alike there; the Python and Ubuntu versions do not.)
# Each is debootstrap's minimal Debian 12 plus the packages named, which is what the public images are
# built from (they differ in details, e.g. python:3.11-slim has its own CPython under /usr/local).
# Where a registry is reachable, pull the real ones instead: apptainer pull DIR/NAME.sif docker://IMAGE.
# Needs root, debootstrap and apptainer (containers/apptainer.sh). Images already there are kept.
# Usage: bash containers/stand-in-images.sh DIR
set -euo pipefail
DIR=${1:?usage: containers/stand-in-images.sh DIR}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
command -v debootstrap >/dev/null || { apt-get update -q && apt-get install -y -q debootstrap; }
mkdir -p "$DIR/.debs"

build() {  # build NAME PACKAGES
  local sif="$DIR/$1.sif" root="$DIR/.rootfs-$1"
  [ -s "$sif" ] && return 0
  rm -rf "$root"
  debootstrap --variant=minbase ${2:+--include=$2} --cache-dir="$(cd "$DIR/.debs" && pwd)" \
    bookworm "$root" "$MIRROR" >"$DIR/.debootstrap-$1.log" 2>&1 \
    || { echo "debootstrap failed, see $DIR/.debootstrap-$1.log" >&2; return 1; }
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
  # pip installs into the image as the public python images' own pip does (no PEP 668 refusal)
  rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
  apptainer --silent build --force "$sif.part" "$root"
  mv "$sif.part" "$sif" && chmod 644 "$sif" && rm -rf "$root" "$DIR/.debootstrap-$1.log"
  echo "built $sif"
}

build debian_bookworm-slim ""
build python_3.11-slim python3,python3-pip
build buildpack-deps_bookworm-scm git,curl,ca-certificates
link_as() { [ -e "$DIR/$1.sif" ] || ln -s "$2.sif" "$DIR/$1.sif"; }  # link_as NAME TARGET
link_as ubuntu_24.04 debian_bookworm-slim
link_as python_3.13-slim-bookworm python_3.11-slim
link_as python-3-13_20250620 python_3.11-slim
rm -rf "$DIR/.debs"
