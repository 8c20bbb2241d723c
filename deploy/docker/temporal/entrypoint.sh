#!/usr/bin/env bash
# temporal server start-dev with a persistent SQLite file, listening on every interface, with the
# search attributes, dynamic config and SQLite pragmas of the project's temporal/ folder (copied to
# /etc/temporal-dev/). Extra arguments are passed through.
set -euo pipefail
args=(server start-dev
      --db-filename /data/temporal.db
      --ip 0.0.0.0 --port 7233
      --ui-ip 0.0.0.0 --ui-port 8233
      --namespace "${TEMPORAL_NAMESPACE:-default}"
      --log-level "${TEMPORAL_LOG_LEVEL:-warn}"
      --metrics-port "${TEMPORAL_METRICS_PORT:-9090}")
settings() { grep -v '^[[:space:]]*#' "$1" 2>/dev/null | sed 's/[[:space:]]*$//' | grep -v '^$' || true; }
while read -r attribute; do args+=(--search-attribute "$attribute"); done < <(settings /etc/temporal-dev/search-attributes)
while read -r value; do args+=(--dynamic-config-value "$value"); done < <(settings /etc/temporal-dev/dynamic-config)
while read -r pragma; do args+=(--sqlite-pragma "$pragma"); done < <(settings /etc/temporal-dev/sqlite-pragmas)
exec temporal "${args[@]}" "$@"
