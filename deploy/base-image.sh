#!/usr/bin/env bash
# Makes the local base image `payout/debian:bookworm-<BASE_TAG>` from Debian's packages
# (debootstrap into a folder, then `docker import`), only when that tag is missing.
#
# This machine has no image registry, so `FROM debian:bookworm` cannot be pulled. Every Dockerfile
# under deploy/ starts with `ARG BASE_IMAGE=payout/debian:bookworm-<tag>`; on a machine with a
# registry, build with `--build-arg BASE_IMAGE=debian:bookworm` (or set BASE_IMAGE in the
# environment for docker-compose) and nothing else changes.
set -euo pipefail

# The pinned tag: bump it deliberately (it names a debootstrap of bookworm made on/after that date).
BASE_TAG="${BASE_TAG:-20261130}"
IMAGE="payout/debian:bookworm-${BASE_TAG}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base-image: $IMAGE already present"
    exit 0
fi

if ! command -v debootstrap >/dev/null 2>&1; then
    echo "base-image: installing debootstrap from Debian's packages"
    apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null
fi

ROOT="$(mktemp -d /tmp/payout-bookworm-rootfs.XXXXXX)"
trap 'rm -rf "$ROOT"' EXIT
start=$(date +%s)
echo "base-image: debootstrap bookworm (minbase) into $ROOT"
debootstrap --variant=minbase --include=ca-certificates bookworm "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 \
    || { tail -30 "$ROOT.log"; exit 1; }
rm -f "$ROOT.log"
# Trim what a container never needs: apt lists and caches, docs, man pages.
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/cache/apt/archives/*.deb \
    "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/locale/*
# Same apt sources as the public debian:bookworm image (main + updates + security).
cat >"$ROOT/etc/apt/sources.list" <<SRC
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SRC
tar -C "$ROOT" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["bash"]' \
    - "$IMAGE" >/dev/null
echo "base-image: made $IMAGE in $(( $(date +%s) - start ))s"
