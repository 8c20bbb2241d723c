#!/usr/bin/env bash
# Checks the monitoring configuration with the real tools: the Prometheus template rendered as
# the local stack renders it (promtool check config, which also checks the rules), the alert
# rules' unit tests (promtool test rules) and Alertmanager's configuration (amtool check-config).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/targets"
echo '[{"targets":["127.0.0.1:9"],"labels":{"job":"example"}}]' > "$work/targets/example.json"
sed -e 's/@INTERVAL@/5s/g' -e "s#@RULES_FILE@#$here/alerts.yml#" -e "s#@TARGETS_DIR@#$work/targets#" \
    -e 's/@ALERTMANAGER@/127.0.0.1:9093/' -e 's/@PROMETHEUS@/127.0.0.1:9090/' \
    "$here/prometheus.yml.in" > "$work/prometheus.yml"
if grep -q '@[A-Z_]*@' "$work/prometheus.yml"; then
  echo "prometheus.yml.in has a placeholder this check does not fill" >&2; exit 1
fi
promtool check config "$work/prometheus.yml"
(cd "$here" && promtool test rules alerts.test.yml)
amtool check-config "$here/alertmanager.yml"
