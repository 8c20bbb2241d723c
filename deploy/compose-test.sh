#!/usr/bin/env bash
# The compose deployment's integration suite, from nothing: builds the binaries on the host
# (`cargo build --bins`; nothing is compiled inside Docker), makes the base image if it is missing,
# builds the four images, makes this run's grant signing key (`payoutctl keys grant-signing`, into
# deploy/secrets/, git-ignored), certificates (`payoutctl pki`) and database passwords, and runs
# deploy/compose-tests against `docker-compose.yml`, which refuses to start without them. The suite
# brings the deployment up and down through the testcontainers crate, which runs Compose v2
# (`docker compose`; scripts/setup.sh installs it where Debian has only v1).
#
#   deploy/compose-test.sh            # the whole suite
#
# With no Docker engine it prints why the suite was skipped and exits 0 (the suite's own test
# does the same when run alone). Prints TIMING lines: base image, each image build, compose up,
# each scenario, compose down.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

if ! docker info >/dev/null 2>&1; then
    echo "SKIPPED: compose suite not run: no Docker engine answers \`docker info\`"
    # Still compile and run the suite: its test prints the same reason and passes.
    exec cargo test -p compose-tests -- --nocapture
fi

secs() { local ms=$(( ($(date +%s%N) - $1) / 1000000 )); printf '%d.%03ds' $((ms / 1000)) $((ms % 1000)); }

t=$(date +%s%N)
cargo build --bins
echo "TIMING cargo build --bins: $(secs "$t")"

t=$(date +%s%N)
bash deploy/base-image.sh
echo "TIMING base image: $(secs "$t")"

t=$(date +%s%N)
bash deploy/build-images.sh
echo "TIMING all image builds: $(secs "$t")"

# The grant signing key (ARCHITECTURE.md, "Signed grants"; deploy/README.md, "Keys"): a fresh one
# per run, made by the operator CLI exactly as an operator makes one. The lock-server reads the
# secret from the folder mounted read-only (PAYOUT_GRANT_KEY_DIR); the guards get the public key
# line (PAYOUT_GRANT_VERIFY_KEYS). The compose commands the suite runs inherit these variables.
t=$(date +%s%N)
KEY_DIR="$ROOT/deploy/secrets"
KEY_ID="compose-test-$(date +%Y%m%d%H%M%S)"
mkdir -p "$KEY_DIR"
# The container's `payout` user must reach its file (x), but not list the folder.
chmod 711 "$KEY_DIR"
# Earlier runs' test keys only; any other key in the folder is left alone.
rm -f "$KEY_DIR"/compose-test-*.key
PAYOUT_GRANT_VERIFY_KEYS="$(target/debug/payoutctl keys grant-signing --key-id "$KEY_ID" --out "$KEY_DIR/$KEY_ID.key")"
# Mode 0600, owned by the image's `payout` user (whose uid only the image knows), so the
# lock-server in its container can read it and nobody else on the host.
docker run --rm --user 0 -v "$KEY_DIR:/keys" "payout/services:${PAYOUT_SERVICES_TAG:-dev}" \
    chown payout "/keys/$KEY_ID.key"
# The signed facts' keys (issue 33), made the same way: the payment resource's instruction key
# and the rail proxy's rail-fact key, each mounted only into its own service.
PAYOUT_INSTRUCTION_SIGNING_KEY_ID="$KEY_ID-instruction"
PAYOUT_INSTRUCTION_VERIFY_KEYS="$(target/debug/payoutctl keys instruction-signing \
    --key-id "$PAYOUT_INSTRUCTION_SIGNING_KEY_ID" --out "$KEY_DIR/$PAYOUT_INSTRUCTION_SIGNING_KEY_ID.key")"
PAYOUT_RAIL_FACT_SIGNING_KEY_ID="$KEY_ID-rail-fact"
PAYOUT_RAIL_FACT_VERIFY_KEYS="$(target/debug/payoutctl keys rail-fact-signing \
    --key-id "$PAYOUT_RAIL_FACT_SIGNING_KEY_ID" --out "$KEY_DIR/$PAYOUT_RAIL_FACT_SIGNING_KEY_ID.key")"
# The rail's answer key (issue 34): the provider's, made by the stub's own command; the proxy is
# given only its public line.
PAYOUT_RAIL_ANSWER_SIGNING_KEY_ID="$KEY_ID-rail-answer"
PAYOUT_RAIL_ANSWER_VERIFY_KEYS="$(target/debug/rail-stub keygen \
    --key-id "$PAYOUT_RAIL_ANSWER_SIGNING_KEY_ID" --out "$KEY_DIR/$PAYOUT_RAIL_ANSWER_SIGNING_KEY_ID.key")"
docker run --rm --user 0 -v "$KEY_DIR:/keys" "payout/services:${PAYOUT_SERVICES_TAG:-dev}" \
    chown payout "/keys/$PAYOUT_INSTRUCTION_SIGNING_KEY_ID.key" "/keys/$PAYOUT_RAIL_FACT_SIGNING_KEY_ID.key" \
    "/keys/$PAYOUT_RAIL_ANSWER_SIGNING_KEY_ID.key"
export PAYOUT_GRANT_KEY_DIR="$KEY_DIR" PAYOUT_GRANT_SIGNING_KEY_ID="$KEY_ID" PAYOUT_GRANT_VERIFY_KEYS
export PAYOUT_INSTRUCTION_SIGNING_KEY_ID PAYOUT_INSTRUCTION_VERIFY_KEYS
export PAYOUT_RAIL_FACT_SIGNING_KEY_ID PAYOUT_RAIL_FACT_VERIFY_KEYS
export PAYOUT_RAIL_ANSWER_SIGNING_KEY_ID PAYOUT_RAIL_ANSWER_VERIFY_KEYS
# The suite's operator (issue 34): its key stays on the host, in a folder no container mounts;
# the payment resource registers its public line, and every funded account the suite opens is
# signed with it (an opening balance is an operator's decision).
OPERATOR_DIR="$ROOT/target/compose-test/operator"
mkdir -p "$OPERATOR_DIR"
chmod 700 "$OPERATOR_DIR"
rm -f "$OPERATOR_DIR/compose-operator.key"
PAYOUT_OPERATOR_KEYS="$(target/debug/payoutctl keys operator --name compose-operator \
    --out "$OPERATOR_DIR/compose-operator.key" 2>/dev/null)"
export PAYOUT_OPERATOR_KEYS PAYOUT_OPERATOR_NAME=compose-operator \
    PAYOUT_OPERATOR_KEY_FILE="$OPERATOR_DIR/compose-operator.key"
echo "grant signing key: $KEY_ID (public: $PAYOUT_GRANT_VERIFY_KEYS)"
echo "instruction key: $PAYOUT_INSTRUCTION_VERIFY_KEYS; rail-fact key: $PAYOUT_RAIL_FACT_VERIFY_KEYS"
echo "TIMING grant signing key: $(secs "$t")"

# This run's certificates (ARCHITECTURE.md, "`crates/mtls`"; deploy/README.md, "Certificates"): a
# fresh authority in a folder no container mounts (target/compose-test/authority, as an operator
# keeps theirs), and one folder per process under deploy/secrets/tls (git-ignored), each with the
# authority's certificate and that process's own certificate and key only, mounted into that
# process's container alone. The suite issues its own certificates from the same authority.
# An authority in a fresh folder (0700), and a fresh folder of per-process folders (0711: a
# container reaches its own folder, nobody lists the others); `issue` and `issue_server` write one
# process's certificate: AUTHORITY FOLDER ROLE NAME, and AUTHORITY FOLDER NAME --host ... .
fresh_authority() { rm -rf "$1"; mkdir -p "$(dirname "$1")"; target/debug/payoutctl pki init --authority "$1" > /dev/null 2>&1; chmod 700 "$1"; }
fresh_folder() { rm -rf "$1"; mkdir -p "$1"; chmod 711 "$1"; }
# A fresh password: 24 random bytes in hex.
pw() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
issue() { target/debug/payoutctl pki issue --authority "$1" --out "$2/$4" --role "$3" --name "$4" > /dev/null; }
issue_server() { local authority="$1" folder="$2" name="$3"; shift 3; target/debug/payoutctl pki issue-server --authority "$authority" --out "$folder/$name" --name "$name" "$@" > /dev/null; }
AUTHORITY_DIR="$ROOT/target/compose-test/authority"
fresh_authority "$AUTHORITY_DIR"
TLS_DIR="$KEY_DIR/tls"
fresh_folder "$TLS_DIR"
for svc in lock-server payment-resource rail-proxy general-ledger outbox-dispatcher worker reconciler; do
    issue "$AUTHORITY_DIR" "$TLS_DIR" "$svc" "$svc"
done
# The Temporal front's server certificate: every Temporal client checks the name `temporal`
# (inside compose) and the suite reaches it from the host at 127.0.0.1.
issue_server "$AUTHORITY_DIR" "$TLS_DIR" temporal --host temporal --host 127.0.0.1
# The database servers' certificates name every host their clients reach them at: the service
# name inside compose, 127.0.0.1 and localhost from the host (the suite's reconciler).
for db in paydb proxydb; do
    issue_server "$AUTHORITY_DIR" "$TLS_DIR" "$db" --host "$db" --host 127.0.0.1 --host localhost
done
# etcd has an authority of its own (issue 34, row 2a: no certificate of the services' authority,
# a worker's, an intake's, reaches etcd), kept like the other in a folder no container mounts.
# Each member's certificate serves its clients and its peers: its own host name, `etcd` (the name
# every etcd client checks), `etcd-peer` (the name a peer must carry: ETCD_PEER_CERT_ALLOWED_HOSTNAME,
# row 2d) and loopback (its health check, the suite from the host). The lock-server and the
# reconciler get client certificates of it, in folders of their own.
ETCD_AUTHORITY_DIR="$ROOT/target/compose-test/etcd-authority"
fresh_authority "$ETCD_AUTHORITY_DIR"
ETCD_TLS_DIR="$KEY_DIR/etcd-tls"
fresh_folder "$ETCD_TLS_DIR"
for member in etcd1 etcd2 etcd3; do
    issue_server "$ETCD_AUTHORITY_DIR" "$ETCD_TLS_DIR" "$member" \
        --host "$member" --host etcd --host etcd-peer --host 127.0.0.1 --host localhost
done
for client in lock-server reconciler; do
    issue "$ETCD_AUTHORITY_DIR" "$ETCD_TLS_DIR" "$client" "$client"
done
# etcd's `root` (its certificate's name is the user): the one-shot etcd-setup provisions the
# users and roles with it (`payoutctl etcd provision`) and switches authentication on. The
# lock-server may then write its prefix only, the reconciler read the grant records and the audit
# chain only; the suite's and its operator's etcd certificates are readers.
issue_server "$ETCD_AUTHORITY_DIR" "$ETCD_TLS_DIR" root --host root
export PAYOUT_ETCD_READER_USERS=compose-operator,compose-suite-etcd
chmod 755 "$ETCD_TLS_DIR"/*/
chmod 644 "$ETCD_TLS_DIR"/*/*.pem
# The rail has an authority of its own too (issue 34, rows 5c and 5d), as a real provider's: the
# stub's certificate names what the proxy reaches it at; the proxy's client certificate is what
# the rail knows its merchant by; the harness's (the only one the stub's admin API serves) stays
# with the suite, in a folder no container mounts.
RAIL_AUTHORITY_DIR="$ROOT/target/compose-test/rail-authority"
fresh_authority "$RAIL_AUTHORITY_DIR"
RAIL_TLS_DIR="$KEY_DIR/rail-tls"
fresh_folder "$RAIL_TLS_DIR"
issue_server "$RAIL_AUTHORITY_DIR" "$RAIL_TLS_DIR" rail-stub --host rail-stub --host 127.0.0.1 --host localhost
issue_server "$RAIL_AUTHORITY_DIR" "$RAIL_TLS_DIR" rail-proxy --host rail-proxy
issue_server "$RAIL_AUTHORITY_DIR" "$RAIL_TLS_DIR" harness --host harness
chmod 755 "$RAIL_TLS_DIR"/*/
chmod 644 "$RAIL_TLS_DIR"/*/*.pem
docker run --rm --user 0 -v "$RAIL_TLS_DIR:/tls" "payout/services:${PAYOUT_SERVICES_TAG:-dev}" \
    sh -c 'for p in rail-stub rail-proxy; do chown payout /tls/$p/$p.key; done'
export PAYOUT_RAIL_AUTHORITY_DIR="$RAIL_AUTHORITY_DIR" PAYOUT_RAIL_TLS_DIR="$RAIL_TLS_DIR"
# The one-shot db-setup needs the authority's certificate only (to check the servers').
mkdir -p "$TLS_DIR/db-setup" && cp "$AUTHORITY_DIR/ca.pem" "$TLS_DIR/db-setup/ca.pem"
# The certificate denylist every gRPC server reads (empty: nothing revoked yet; `payoutctl pki
# deny`), in a folder of its own mounted read-only into those servers.
mkdir -p "$TLS_DIR/revoked" && : > "$TLS_DIR/revoked/denylist"
chmod 755 "$TLS_DIR"/*/
chmod 644 "$TLS_DIR"/*/*.pem "$TLS_DIR/revoked/denylist"
# Each folder's key belongs to the user its image runs as (mode 0600): the services image's
# `payout`, postgres, temporal, etcd. Nobody else in any container can read it, and no container
# mounts another's folder.
docker run --rm --user 0 -v "$TLS_DIR:/tls" "payout/services:${PAYOUT_SERVICES_TAG:-dev}" \
    sh -c 'for svc in lock-server payment-resource rail-proxy general-ledger outbox-dispatcher worker reconciler; do chown payout /tls/$svc/$svc.key; done'
docker run --rm --user 0 --entrypoint sh -v "$TLS_DIR:/tls" "payout/temporal:1.9.1" \
    -c 'chown temporal /tls/temporal/temporal.key'
docker run --rm --user 0 --entrypoint sh -v "$TLS_DIR:/tls" "payout/postgres:15" \
    -c 'chown postgres /tls/paydb/paydb.key /tls/proxydb/proxydb.key'
docker run --rm --user 0 --entrypoint sh -v "$ETCD_TLS_DIR:/tls" "payout/etcd:3.4" \
    -c 'for m in etcd1 etcd2 etcd3; do chown etcd /tls/$m/$m.key; done'
docker run --rm --user 0 -v "$ETCD_TLS_DIR:/tls" "payout/services:${PAYOUT_SERVICES_TAG:-dev}" \
    sh -c 'for c in lock-server reconciler root; do chown payout /tls/$c/$c.key; done'
# The Temporal UI's login: one user, its password with the suite's own secrets (not in a folder
# any container mounts).
rm -f "$KEY_DIR/temporal-ui.password"
target/debug/payoutctl keys ui-user --name compose-operator \
    --password-out "$KEY_DIR/temporal-ui.password" > "$KEY_DIR/temporal-ui.htpasswd" 2>/dev/null
chmod 644 "$KEY_DIR/temporal-ui.htpasswd"
export PAYOUT_TEMPORAL_UI_HTPASSWD="$KEY_DIR/temporal-ui.htpasswd"
export PAYOUT_TEMPORAL_UI_PASSWORD_FILE="$KEY_DIR/temporal-ui.password"
# Monitoring access (deploy/README.md, "Monitoring access"; issue 34, row 3a): Prometheus and
# Alertmanager serve TLS with certificates of the deployment's authority and ask every caller for
# one of three logins, `prometheus` (Prometheus's own calls), `silence-watch` and `operator`
# (people; here the suite, from the host). Each container's folder holds what it needs only: its
# certificate, key and web configuration (bcrypt hashes, made by Debian's htpasswd), and the
# password of the login it uses itself; the operator's password stays with the suite's secrets.
MONITORING_TLS_DIR="$KEY_DIR/monitoring-tls"
fresh_folder "$MONITORING_TLS_DIR"
hash_of() { printf '%s' "$2" | htpasswd -niBC 6 "$1" | head -1 | cut -d: -f2-; }
PROMETHEUS_PASSWORD="$(pw)"; SILENCE_WATCH_PASSWORD="$(pw)"; MONITORING_OPERATOR_PASSWORD="$(pw)"
for part in prometheus alertmanager; do
    issue_server "$AUTHORITY_DIR" "$MONITORING_TLS_DIR" "$part" --host "$part" --host 127.0.0.1 --host localhost
    cat > "$MONITORING_TLS_DIR/$part/web-config.yml" <<YAML
tls_server_config:
  cert_file: /run/monitoring-tls/$part.pem
  key_file: /run/monitoring-tls/$part.key
  min_version: TLS12
basic_auth_users:
  prometheus: '$(hash_of prometheus "$PROMETHEUS_PASSWORD")'
  silence-watch: '$(hash_of silence-watch "$SILENCE_WATCH_PASSWORD")'
  operator: '$(hash_of operator "$MONITORING_OPERATOR_PASSWORD")'
YAML
done
printf '%s' "$PROMETHEUS_PASSWORD" > "$MONITORING_TLS_DIR/prometheus/prometheus.password"
mkdir -p "$MONITORING_TLS_DIR/silence-watch"
cp "$AUTHORITY_DIR/ca.pem" "$MONITORING_TLS_DIR/silence-watch/ca.pem"
printf '%s' "$SILENCE_WATCH_PASSWORD" > "$MONITORING_TLS_DIR/silence-watch/silence-watch.password"
rm -f "$KEY_DIR/monitoring-operator.password"
(umask 077; printf '%s' "$MONITORING_OPERATOR_PASSWORD" > "$KEY_DIR/monitoring-operator.password")
chmod 755 "$MONITORING_TLS_DIR"/*/
chmod 644 "$MONITORING_TLS_DIR"/*/*.pem "$MONITORING_TLS_DIR"/*/web-config.yml
chmod 600 "$MONITORING_TLS_DIR"/*/*.key "$MONITORING_TLS_DIR"/*/*.password
docker run --rm --user 0 --entrypoint sh -v "$MONITORING_TLS_DIR:/tls" "payout/monitoring:${PAYOUT_SERVICES_TAG:-dev}" \
    -c 'chown prometheus /tls/prometheus/prometheus.key /tls/prometheus/prometheus.password /tls/alertmanager/alertmanager.key'
docker run --rm --user 0 -v "$MONITORING_TLS_DIR:/tls" "payout/services:${PAYOUT_SERVICES_TAG:-dev}" \
    sh -c 'chown payout /tls/silence-watch/silence-watch.password'
export PAYOUT_MONITORING_TLS_DIR="$MONITORING_TLS_DIR"
export PAYOUT_MONITORING_OPERATOR_PASSWORD_FILE="$KEY_DIR/monitoring-operator.password"
export PAYOUT_TLS_AUTHORITY_DIR="$AUTHORITY_DIR"
export PAYOUT_ETCD_AUTHORITY_DIR="$ETCD_AUTHORITY_DIR" PAYOUT_ETCD_TLS_DIR="$ETCD_TLS_DIR"
export PAYOUT_TLS_DIR="$TLS_DIR" PAYOUT_FIXTURE_ACCOUNTS=true

# This run's database passwords: one per login, generated, never written to the repository
# (compose refuses to start without any of them; deploy/README.md, "Database roles").
export PAYOUT_DB_ADMIN_PASSWORD="$(pw)"
for login in PAYOUT_OWNER PAYMENT_RESOURCE OUTBOX_DISPATCHER RECONCILER RAIL_PROXY GENERAL_LEDGER LOCK_SERVER; do
    export "PAYOUT_DB_PASSWORD_$login=$(pw)"
done
# The passwords db-setup and the database servers read from files, not from their containers'
# configuration (issue 34): server/ holds the superuser's (read by the postgres image's user),
# setup/ every login's (read by the services image's user, in db-setup only).
DB_SECRETS_DIR="$KEY_DIR/db-secrets"
rm -rf "$DB_SECRETS_DIR"
mkdir -p "$DB_SECRETS_DIR/server" "$DB_SECRETS_DIR/setup"
chmod 711 "$DB_SECRETS_DIR"
printf '%s' "$PAYOUT_DB_ADMIN_PASSWORD" > "$DB_SECRETS_DIR/server/admin-password"
printf '%s' "$PAYOUT_DB_ADMIN_PASSWORD" > "$DB_SECRETS_DIR/setup/ADMIN"
for login in PAYOUT_OWNER PAYMENT_RESOURCE OUTBOX_DISPATCHER RECONCILER RAIL_PROXY GENERAL_LEDGER LOCK_SERVER; do
    var="PAYOUT_DB_PASSWORD_$login"
    printf '%s' "${!var}" > "$DB_SECRETS_DIR/setup/$login"
done
chmod 700 "$DB_SECRETS_DIR/server" "$DB_SECRETS_DIR/setup"
chmod 600 "$DB_SECRETS_DIR"/server/* "$DB_SECRETS_DIR"/setup/*
docker run --rm --user 0 --entrypoint sh -v "$DB_SECRETS_DIR/server:/s" "payout/postgres:15" \
    -c 'chown -R postgres /s'
docker run --rm --user 0 -v "$DB_SECRETS_DIR/setup:/s" "payout/services:${PAYOUT_SERVICES_TAG:-dev}" \
    sh -c 'chown -R payout /s'
export PAYOUT_DB_SECRETS_DIR="$DB_SECRETS_DIR"

t=$(date +%s%N)
cargo test -p compose-tests -- --nocapture
echo "TIMING compose tests (build + run): $(secs "$t")"
