#!/usr/bin/env bash
# Reproduces the design check of README.md in this folder against a scratch PostgreSQL (Debian's
# postgresql 15): the project's paydb and proxydb migrations (0006 is this design), a real
# pg_dump taken at fence 10, the successor's token 20, a restore (pg_restore --clean, then a new
# database), the stale token 15 refused by the guarded statement and landing without the check
# (the negative control, rolled back), the procedure's function, and tokens after it; then the
# same for proxydb, with the token floor for an account that has no high-water row yet.
# Usage: run as root from the repository's root: bash docs/design/guard-restore/demo.sh
set -euo pipefail
DIR=$(mktemp -d /tmp/guard-restore.XXXX); chown postgres "$DIR"; PORT=55433
runuser -u postgres -- initdb -D "$DIR/data" -U postgres --auth=trust >/dev/null
runuser -u postgres -- pg_ctl -D "$DIR/data" -o "-p $PORT -k $DIR -c listen_addresses=''" -l "$DIR/log" -w start >/dev/null
trap 'runuser -u postgres -- pg_ctl -D "$DIR/data" -m immediate stop >/dev/null; rm -rf "$DIR"' EXIT
as() { psql -h "$DIR" -p $PORT -U "$1" -d "$2" -v ON_ERROR_STOP=1 -qtA "${@:3}"; }
for s in "CREATE ROLE payout_owner LOGIN" "CREATE ROLE payment_resource LOGIN" \
         "CREATE ROLE outbox_dispatcher LOGIN" "CREATE ROLE reconciler LOGIN" "CREATE ROLE rail_proxy LOGIN" \
         "CREATE DATABASE paydb OWNER payout_owner" "CREATE DATABASE proxydb OWNER payout_owner"; do
  as postgres postgres -c "$s"; done
for db in paydb proxydb; do
  as payout_owner $db -c "CREATE TABLE _sqlx_migrations (version bigint)"
  for f in migrations/$db/*.sql; do
    as payout_owner $db -f "$f"; done
done
as payout_owner paydb -c "INSERT INTO account (id, currency, balance_minor, opening_balance_minor) VALUES ('acc-1', 'EUR', 0, 0)"
guard() { as payment_resource paydb -c "UPDATE account SET fence = $1 WHERE id = 'acc-1' AND fence <= $1 AND incarnation_admits($1) RETURNING 'written ' || fence"; }
echo "token 10: $(guard 10)"
runuser -u postgres -- pg_dump -h "$DIR" -p $PORT -U postgres -Fc paydb -f "$DIR/paydb.dump"
echo "dump taken; the successor's token 20: $(guard 20); stale 15: '$(guard 15)' (fenced)"
runuser -u postgres -- pg_restore -h "$DIR" -p $PORT -U postgres --clean --if-exists -d paydb "$DIR/paydb.dump"
echo "restored (--clean): fence $(as payment_resource paydb -c 'SELECT fence FROM account'), current $(as payment_resource paydb -c 'SELECT incarnation_is_current()')"
echo "stale 15 with the check: '$(guard 15)' (refused)"
echo "negative control, stale 15 without the check: $(as payment_resource paydb -c "BEGIN; UPDATE account SET fence = 15 WHERE id = 'acc-1' AND fence <= 15 RETURNING 'LANDED ' || fence; ROLLBACK;")"
echo "rearm to the lock service's horizon 25: $(as payout_owner paydb -c "SELECT rearm_after_restore(25, 'alice', 'restored from the dump')") account(s) raised"
echo "after: current $(as payment_resource paydb -c 'SELECT incarnation_is_current()'), stale 15 '$(guard 15)', 20 '$(guard 20)', new 26: $(guard 26)"
if as payout_owner paydb -c "SELECT rearm_after_restore(5, 'alice', 'x')" 2>/dev/null; then echo "UNEXPECTED: rearm below a fence accepted"; exit 1; fi
echo "rearm to a horizon below an accepted fence: refused"
as postgres postgres -c "DROP DATABASE paydb"; as postgres postgres -c "CREATE DATABASE paydb OWNER payout_owner"
runuser -u postgres -- pg_restore -h "$DIR" -p $PORT -U postgres -d paydb "$DIR/paydb.dump"
echo "restored into a new database: current $(as payment_resource paydb -c 'SELECT incarnation_is_current()'), stale 15 '$(guard 15)'"
# proxydb: the same, with the token floor for an account that has no high-water row yet.
hw() { as rail_proxy proxydb -c "INSERT INTO account_high_water (account_id, high_water, owner) SELECT '$1', $2, 'w' WHERE incarnation_admits($2) ON CONFLICT (account_id) DO UPDATE SET high_water = EXCLUDED.high_water WHERE account_high_water.high_water <= EXCLUDED.high_water RETURNING 'advanced ' || high_water"; }
echo "proxydb token 10: $(hw acc-1 10)"
runuser -u postgres -- pg_dump -h "$DIR" -p $PORT -U postgres -Fc proxydb -f "$DIR/proxydb.dump"
echo "dump taken; the successor's token 20: $(hw acc-1 20)"
runuser -u postgres -- pg_restore -h "$DIR" -p $PORT -U postgres --clean --if-exists -d proxydb "$DIR/proxydb.dump"
echo "proxydb restored: high-water $(as rail_proxy proxydb -c 'SELECT high_water FROM account_high_water'), current $(as rail_proxy proxydb -c 'SELECT incarnation_is_current()')"
echo "stale 15: '$(hw acc-1 15)'; another account's first row at 12: '$(hw acc-2 12)' (both refused)"
echo "negative control, stale 15 without the check: $(as rail_proxy proxydb -c "BEGIN; UPDATE account_high_water SET high_water = 15 WHERE account_id = 'acc-1' AND high_water <= 15 RETURNING 'LANDED ' || high_water; ROLLBACK;")"
echo "rearm to 25: $(as payout_owner proxydb -c "SELECT rearm_after_restore(25, 'alice', 'restored from the dump')") high-water(s) raised"
echo "after: stale 15 '$(hw acc-1 15)', acc-2 at 12 below the floor '$(hw acc-2 12)', new 26: $(hw acc-1 26)"
echo "rearm_event: $(as payout_owner proxydb -c 'SELECT horizon, armed_by, accounts_raised FROM rearm_event')"
