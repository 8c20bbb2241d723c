#!/usr/bin/env bash
# payout-monitoring prometheus|alertmanager: renders deploy/monitoring/prometheus.yml.in for the
# compose deployment (targets: compose-targets/*.json; interval PROMETHEUS_INTERVAL, default 15s;
# Alertmanager at ALERTMANAGER_ADDRESS, default alertmanager:9093) and runs the named part, its
# data under /var/lib/payout-monitoring.
set -euo pipefail
conf=/etc/payout-monitoring
data=/var/lib/payout-monitoring
case "${1:-}" in
  prometheus)
    shift
    sed -e "s/@INTERVAL@/${PROMETHEUS_INTERVAL:-15s}/g" \
        -e "s#@RULES_FILE@#$conf/alerts.yml#" \
        -e "s#@TARGETS_DIR@#$conf/compose-targets#" \
        -e "s/@ALERTMANAGER@/${ALERTMANAGER_ADDRESS:-alertmanager:9093}/" \
        -e "s/@PROMETHEUS@/${PROMETHEUS_ADDRESS:-prometheus:9090}/" \
        "$conf/prometheus.yml.in" > "$data/prometheus.yml"
    # The workers are scaled behind one name (`--scale worker=N`): every replica the name
    # resolves to is a target of its own.
    cat >> "$data/prometheus.yml" <<YAML
  - job_name: worker
    dns_sd_configs:
      - names: ["${WORKER_DNS_NAME:-worker}"]
        type: A
        port: ${WORKER_METRICS_PORT:-9472}
        refresh_interval: 15s
YAML
    exec prometheus --config.file="$data/prometheus.yml" --storage.tsdb.path="$data/prometheus" \
         --web.listen-address=0.0.0.0:9090 "$@"
    ;;
  alertmanager)
    shift
    exec prometheus-alertmanager --config.file="$conf/alertmanager.yml" \
         --storage.path="$data/alertmanager" --web.listen-address=0.0.0.0:9093 \
         --cluster.listen-address= "$@"
    ;;
  *)
    echo "usage: payout-monitoring prometheus|alertmanager [flags]" >&2
    exit 2
    ;;
esac
