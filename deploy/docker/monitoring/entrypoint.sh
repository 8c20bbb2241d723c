#!/usr/bin/env bash
# payout-monitoring prometheus|alertmanager: renders deploy/monitoring/prometheus.yml.in for the
# compose deployment (targets: compose-targets/*.json; interval PROMETHEUS_INTERVAL, default 15s;
# Alertmanager at ALERTMANAGER_ADDRESS, default alertmanager:9093) and runs the named part, its
# data under /var/lib/payout-monitoring, behind its web configuration (TLS and logins) in
# /run/monitoring-tls (deploy/README.md, "Monitoring access"): web-config.yml, ca.pem and, for
# Prometheus, the password of its own `prometheus` login.
set -euo pipefail
conf=/etc/payout-monitoring
data=/var/lib/payout-monitoring
tls=/run/monitoring-tls
for f in web-config.yml ca.pem; do
  [ -r "$tls/$f" ] || { echo "payout-monitoring: $tls/$f is missing (deploy/README.md, \"Monitoring access\")" >&2; exit 2; }
done
case "${1:-}" in
  prometheus)
    shift
    sed -e "s/@INTERVAL@/${PROMETHEUS_INTERVAL:-15s}/g" \
        -e "s#@RULES_FILE@#$conf/alerts.yml#" \
        -e "s#@TARGETS_DIR@#$conf/compose-targets#" \
        -e "s/@ALERTMANAGER@/${ALERTMANAGER_ADDRESS:-alertmanager:9093}/" \
        -e "s/@PROMETHEUS@/${PROMETHEUS_ADDRESS:-prometheus:9090}/" \
        -e "s#@MONITORING_CA@#$tls/ca.pem#" \
        -e "s#@PROMETHEUS_PASSWORD_FILE@#$tls/prometheus.password#" \
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
         --web.listen-address=0.0.0.0:9090 --web.config.file="$tls/web-config.yml" "$@"
    ;;
  alertmanager)
    shift
    exec prometheus-alertmanager --config.file="$conf/alertmanager.yml" \
         --storage.path="$data/alertmanager" --web.listen-address=0.0.0.0:9093 \
         --cluster.listen-address= --web.config.file="$tls/web-config.yml" "$@"
    ;;
  *)
    echo "usage: payout-monitoring prometheus|alertmanager [flags]" >&2
    exit 2
    ;;
esac
