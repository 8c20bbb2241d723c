#!/usr/bin/env bash
# initdb on the first start (empty volume), then create the databases named in POSTGRES_DATABASES
# that are missing (on every start, so adding one to the list is enough), then serve on TCP.
# While it initialises it listens on the unix socket only, so pg_isready (TCP) says "not ready".
#
# Host connections are TLS only (the certificate and key in PAYOUT_PG_TLS_CERT / _KEY, issued by
# the deployment's authority for this server's name) and every login has a password (SCRAM);
# pg_hba.conf is rewritten on every start, so nothing else is ever accepted. The superuser
# (POSTGRES_USER) and the schema owner (payout_owner) log in only on the unix socket, never over
# TCP (issue 34): `payoutctl db provision` and `payoutctl migrate` reach the socket through a
# volume only the one-shot db-setup shares; no service logs in as either. The superuser's password
# comes from a file (POSTGRES_PASSWORD_FILE), never from the container's environment, where
# `docker inspect` and /proc would show it for the container's whole life.
set -euo pipefail
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    [ -r "$POSTGRES_PASSWORD_FILE" ] || { echo "payout-postgres: $POSTGRES_PASSWORD_FILE is not readable" >&2; exit 2; }
    POSTGRES_PASSWORD="$(cat "$POSTGRES_PASSWORD_FILE")"
fi
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD_FILE (or POSTGRES_PASSWORD) must be set}"
: "${PAYOUT_PG_TLS_CERT:?PAYOUT_PG_TLS_CERT must name this server certificate (see deploy/README.md)}"
: "${PAYOUT_PG_TLS_KEY:?PAYOUT_PG_TLS_KEY must name this server key}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "payout-postgres: initialised $PGDATA"
fi
# Start-up's own socket session (creating the databases) runs before the real rules, with the
# socket reachable by this container's user only.
cat >"$PGDATA/pg_hba.conf" <<'HBA'
local all all trust
HBA
pg_ctl -D "$PGDATA" -w -o "-c listen_addresses='' -c unix_socket_permissions=0700" start >/dev/null
for db in $POSTGRES_DATABASES; do
    if [ -z "$(psql -U "$POSTGRES_USER" -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" ]; then
        createdb -U "$POSTGRES_USER" "$db"
        echo "payout-postgres: created database $db"
    fi
done
pg_ctl -D "$PGDATA" -w -m fast stop >/dev/null
# The rules while serving: the superuser and the owner on the socket only, with their passwords;
# every other login over TLS with its password; the superuser and the owner refused over TCP.
cat >"$PGDATA/pg_hba.conf" <<HBA
local all $POSTGRES_USER scram-sha-256
local all payout_owner scram-sha-256
local all all reject
host all $POSTGRES_USER,payout_owner 0.0.0.0/0 reject
host all $POSTGRES_USER,payout_owner ::/0 reject
hostssl all all 0.0.0.0/0 scram-sha-256
hostssl all all ::/0 scram-sha-256
HBA
unset POSTGRES_PASSWORD
# max_connections: every service keeps a bounded pool (service-kit), a few replicas each.
exec postgres -D "$PGDATA" -c listen_addresses='*' -c max_connections="${POSTGRES_MAX_CONNECTIONS:-200}" \
    -c ssl=on -c ssl_min_protocol_version=TLSv1.2 -c password_encryption=scram-sha-256 \
    -c ssl_cert_file="$PAYOUT_PG_TLS_CERT" -c ssl_key_file="$PAYOUT_PG_TLS_KEY"
