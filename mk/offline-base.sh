#!/usr/bin/env bash
# The Dockerfile's base image (python:3.11-slim) where it cannot be pulled (no registry reachable): Debian bookworm
# made with debootstrap from Debian's own package mirror, with its Python 3.11, venv and pip, `python` on PATH as
# the official image has it, imported into Docker under the base's tag. Does nothing when the tag is there.
#
#   mk/offline-base.sh [TAG]        (root: debootstrap and chroot need it)
set -euo pipefail
tag="${1:-python:3.11-slim}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
docker image inspect "$tag" >/dev/null 2>&1 && { echo "base image $tag: present"; exit 0; }
if docker pull "$tag" >/dev/null 2>&1; then echo "base image $tag: pulled"; exit 0; fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing (apt-get install debootstrap)" >&2; exit 2; }
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
echo "base image $tag: not pullable; making it with debootstrap (Debian bookworm, about a minute)"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$root" "$mirror" \
  >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
# This machine's trusted certificates: a network that inspects TLS on its way to the package registries signs with a
# CA only the host trusts. pip reads its own bundle unless told, so /etc/pip.conf names the system's.
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/etc/pip.conf"
fi
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
  -c 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' -c 'ENV LANG=C.UTF-8' \
  -c 'CMD ["python3"]' - "$tag" >/dev/null
echo "base image $tag: made ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"
