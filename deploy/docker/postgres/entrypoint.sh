#!/usr/bin/env bash
# initdb on the first start (empty volume), then create the databases named in POSTGRES_DATABASES
# that are missing (on every start, so adding one to the list is enough), then serve on TCP.
# While it initialises it listens on the unix socket only, so pg_isready (TCP) says "not ready".
set -euo pipefail
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all 0.0.0.0/0 scram-sha-256" >>"$PGDATA/pg_hba.conf"
    echo "host all all ::/0 scram-sha-256" >>"$PGDATA/pg_hba.conf"
    echo "payout-postgres: initialised $PGDATA"
fi
pg_ctl -D "$PGDATA" -w -o "-c listen_addresses=''" start >/dev/null
for db in $POSTGRES_DATABASES; do
    if [ -z "$(psql -U "$POSTGRES_USER" -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" ]; then
        createdb -U "$POSTGRES_USER" "$db"
        echo "payout-postgres: created database $db"
    fi
done
pg_ctl -D "$PGDATA" -w -m fast stop >/dev/null
# max_connections: every service keeps a bounded pool (service-kit), a few replicas each.
exec postgres -D "$PGDATA" -c listen_addresses='*' -c max_connections="${POSTGRES_MAX_CONNECTIONS:-200}"
