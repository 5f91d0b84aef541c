#!/usr/bin/env bash
# The image's base made from Debian's own packages with debootstrap, for a site that reaches no image registry:
# Debian's minimal system with Python 3.11 and its venv, imported as a Docker image.
#
#   deploy/base-image.sh [TAG]        # default aiayn-base:bookworm; a TAG that exists is kept
#
# Runs as root (debootstrap). MIRROR (default http://deb.debian.org/debian) and SUITE (default bookworm) choose the
# packages. The machine's CA bundle goes into the base as the one pip and Python trust (PIP_CERT, SSL_CERT_FILE),
# so that a build behind the site's TLS proxy reaches the package index as this machine does; a site whose pip
# reaches PyPI directly keeps Debian's.
set -euo pipefail
tag=${1:-aiayn-base:bookworm}
suite=${SUITE:-bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
ca=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag exists"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }
root=$(mktemp -d "${TMPDIR:-/var/tmp}/aiayn-rootfs.XXXXXX")
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$root" "$mirror" >&2
install -m 0644 "$ca" "$root/etc/ssl/certs/site-ca-bundle.crt"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
  --change 'ENV PIP_CERT=/etc/ssl/certs/site-ca-bundle.crt SSL_CERT_FILE=/etc/ssl/certs/site-ca-bundle.crt' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  - "$tag" >/dev/null
echo "base image $tag built from Debian $suite"
