#!/usr/bin/env bash
# temporal server start-dev with a persistent SQLite file, on loopback only, behind its
# mutual-TLS front (nginx, nginx.conf.in): the front listens on every interface on 7233 (gRPC,
# client certificates of the deployment's authority, roles worker, reconciler, outbox-dispatcher
# and operator only) and 8233 (the UI behind a login), and passes the metrics (9090, no payloads)
# through for Prometheus; the dev server's own frontend (7234), HTTP API (7243), UI (8234) and
# metrics (9091) are reachable inside the container only. The search attributes, dynamic
# config and SQLite pragmas come from the project's temporal/ folder (copied to
# /etc/temporal-dev/). Either process dying stops the container. Extra arguments go to the server.
set -euo pipefail
TLS_DIR="${TEMPORAL_FRONT_TLS_DIR:-/run/payout-tls}"
for file in "$TLS_DIR/ca.pem" "$TLS_DIR/temporal.pem" "$TLS_DIR/temporal.key" /run/temporal-ui/htpasswd; do
  [ -r "$file" ] || { echo "payout-temporal: $file is missing or unreadable (deploy/README.md, \"Temporal front\")" >&2; exit 2; }
done
args=(server start-dev
      --db-filename /data/temporal.db
      --ip 127.0.0.1 --port 7234 --http-port 7243
      --ui-ip 127.0.0.1 --ui-port 8234
      --namespace "${TEMPORAL_NAMESPACE:-default}"
      --log-level "${TEMPORAL_LOG_LEVEL:-warn}"
      --metrics-port 9091)
settings() { grep -v '^[[:space:]]*#' "$1" 2>/dev/null | sed 's/[[:space:]]*$//' | grep -v '^$' || true; }
while read -r attribute; do args+=(--search-attribute "$attribute"); done < <(settings /etc/temporal-dev/search-attributes)
while read -r value; do args+=(--dynamic-config-value "$value"); done < <(settings /etc/temporal-dev/dynamic-config)
while read -r pragma; do args+=(--sqlite-pragma "$pragma"); done < <(settings /etc/temporal-dev/sqlite-pragmas)
mkdir -p /data/front/tmp
# The certificate denylist (issue 34): its SHA-1 fingerprints, the only ones nginx can match
# ($ssl_client_fingerprint), as a map; rendered again and nginx reloaded whenever the file changes.
DENYLIST="${TEMPORAL_FRONT_DENYLIST:-/run/payout-revoked/denylist}"
render_denied() {
  { grep -o 'sha1:[0-9a-fA-F]\{40\}' "$DENYLIST" 2>/dev/null || true; } \
    | sed -e 's/^sha1://' -e 's/$/ 1;/' | tr 'A-F' 'a-f' > /data/front/denied.map.tmp
  mv /data/front/denied.map.tmp /data/front/denied.map
}
[ -r "$DENYLIST" ] || echo "payout-temporal: no denylist at $DENYLIST: nothing denied at the front" >&2
render_denied
sed -e "s|@FRONT_PORT@|7233|g" -e "s|@UI_PORT@|8233|g" -e "s|@RAW_PORT@|7234|g" \
    -e "s|@RAW_UI_PORT@|8234|g" -e "s|@TLS_DIR@|$TLS_DIR|g" \
    -e "s|@METRICS_PORT@|${TEMPORAL_METRICS_PORT:-9090}|g" -e "s|@RAW_METRICS_PORT@|9091|g" \
    /etc/temporal-dev/nginx.conf.in > /data/front/nginx.conf
nginx -t -q -e stderr -c /data/front/nginx.conf
temporal "${args[@]}" "$@" &
nginx -e stderr -c /data/front/nginx.conf &
(
  seen="$(stat -c %y "$DENYLIST" 2>/dev/null || true)"
  while sleep 2; do
    now="$(stat -c %y "$DENYLIST" 2>/dev/null || true)"
    if [ "$now" != "$seen" ]; then
      seen="$now"
      render_denied && nginx -e stderr -c /data/front/nginx.conf -s reload \
        && echo "payout-temporal: certificate denylist reloaded" >&2
    fi
  done
) &
wait -n
