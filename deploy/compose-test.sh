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
docker run --rm --user 0 -v "$KEY_DIR:/keys" "payout/services:${PAYOUT_SERVICES_TAG:-dev}" \
    chown payout "/keys/$PAYOUT_INSTRUCTION_SIGNING_KEY_ID.key" "/keys/$PAYOUT_RAIL_FACT_SIGNING_KEY_ID.key"
export PAYOUT_GRANT_KEY_DIR="$KEY_DIR" PAYOUT_GRANT_SIGNING_KEY_ID="$KEY_ID" PAYOUT_GRANT_VERIFY_KEYS
export PAYOUT_INSTRUCTION_SIGNING_KEY_ID PAYOUT_INSTRUCTION_VERIFY_KEYS
export PAYOUT_RAIL_FACT_SIGNING_KEY_ID PAYOUT_RAIL_FACT_VERIFY_KEYS
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

# This run's certificates (ARCHITECTURE.md, "`crates/mtls`"): a fresh authority and one certificate
# per service, made by the operator CLI exactly as an operator makes them, into deploy/secrets/tls
# (git-ignored). The suite's own calls use certificates it issues from the same authority.
TLS_DIR="$KEY_DIR/tls"
rm -rf "$TLS_DIR"
mkdir -p "$TLS_DIR"
chmod 711 "$TLS_DIR"
for svc in lock-server payment-resource rail-proxy general-ledger outbox-dispatcher worker reconciler; do
    target/debug/payoutctl pki issue --dir "$TLS_DIR" --role "$svc" --name "$svc" > /dev/null
done
# The database servers' certificates name every host their clients reach them at: the service
# name inside compose, 127.0.0.1 and localhost from the host (the suite's reconciler).
# The Temporal front's server certificate: every Temporal client checks the name `temporal`
# (inside compose) and the suite reaches it from the host at 127.0.0.1.
target/debug/payoutctl pki issue-server --dir "$TLS_DIR" --name temporal \
    --host temporal --host 127.0.0.1 > /dev/null
# The suite's own Temporal client (the operator role) and the certificate the front must refuse.
target/debug/payoutctl pki issue --dir "$TLS_DIR" --role operator --name compose-operator > /dev/null
for db in paydb proxydb; do
    target/debug/payoutctl pki issue-server --dir "$TLS_DIR" --name "$db" \
        --host "$db" --host 127.0.0.1 --host localhost > /dev/null
done
# Each etcd member's certificate serves its clients and its peers: its own host name, `etcd` (the
# name every etcd client checks), and loopback (its health check, the suite from the host).
for member in etcd1 etcd2 etcd3; do
    target/debug/payoutctl pki issue-server --dir "$TLS_DIR" --name "$member" \
        --host "$member" --host etcd --host 127.0.0.1 --host localhost > /dev/null
done
docker run --rm --user 0 -v "$TLS_DIR:/tls" "payout/services:${PAYOUT_SERVICES_TAG:-dev}" \
    sh -c 'chown payout /tls/*.key && chmod 644 /tls/*.pem'
# The front (nginx in the temporal image) reads its key as that image's `temporal` user.
docker run --rm --user 0 --entrypoint sh -v "$TLS_DIR:/tls" "payout/temporal:1.9.1" \
    -c 'chown temporal /tls/temporal.key && chmod 600 /tls/temporal.key'
# The Temporal UI's login: one user, its password beside the certificates (the suite reads it).
rm -f "$TLS_DIR/temporal-ui.password"
target/debug/payoutctl keys ui-user --name compose-operator \
    --password-out "$TLS_DIR/temporal-ui.password" > "$KEY_DIR/temporal-ui.htpasswd" 2>/dev/null
chmod 644 "$KEY_DIR/temporal-ui.htpasswd"
export PAYOUT_TEMPORAL_UI_HTPASSWD="$KEY_DIR/temporal-ui.htpasswd"
# PostgreSQL reads its key as its own user (the postgres image's uid), mode 0600.
docker run --rm --user 0 --entrypoint sh -v "$TLS_DIR:/tls" "payout/postgres:15" \
    -c 'chown postgres /tls/paydb.key /tls/proxydb.key && chmod 600 /tls/paydb.key /tls/proxydb.key'
# etcd reads its members' keys as the etcd image's user.
docker run --rm --user 0 --entrypoint sh -v "$TLS_DIR:/tls" "payout/etcd:3.4" \
    -c 'chown etcd /tls/etcd1.key /tls/etcd2.key /tls/etcd3.key && chmod 600 /tls/etcd1.key /tls/etcd2.key /tls/etcd3.key'
# The certificate denylist every server reads (empty: nothing revoked yet; `payoutctl pki deny`).
: > "$TLS_DIR/denylist"
chmod 644 "$TLS_DIR/denylist"
export PAYOUT_TLS_DIR="$TLS_DIR" PAYOUT_FIXTURE_ACCOUNTS=true

# This run's database passwords: one per login, generated, never written to the repository
# (compose refuses to start without any of them; deploy/README.md, "Database roles").
pw() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
export PAYOUT_DB_ADMIN_PASSWORD="$(pw)"
for login in PAYOUT_OWNER PAYMENT_RESOURCE OUTBOX_DISPATCHER RECONCILER RAIL_PROXY GENERAL_LEDGER LOCK_SERVER; do
    export "PAYOUT_DB_PASSWORD_$login=$(pw)"
done

t=$(date +%s%N)
cargo test -p compose-tests -- --nocapture
echo "TIMING compose tests (build + run): $(secs "$t")"
