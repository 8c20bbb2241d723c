#!/usr/bin/env bash
# Checks the monitoring configuration with the real tools: the Prometheus template rendered as
# the local stack renders it (promtool check config, which also checks the rules), the alert
# rules' unit tests (promtool test rules), Alertmanager's configuration (amtool check-config) and
# a web configuration as deploy/README.md ("Monitoring access") has an operator write it
# (promtool check web-config: TLS and a bcrypt login).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/targets"
echo '[{"targets":["127.0.0.1:9"],"labels":{"job":"example"}}]' > "$work/targets/example.json"
sed -e 's/@INTERVAL@/5s/g' -e "s#@RULES_FILE@#$here/alerts.yml#" -e "s#@TARGETS_DIR@#$work/targets#" \
    -e 's/@ALERTMANAGER@/127.0.0.1:9093/' -e 's/@PROMETHEUS@/127.0.0.1:9090/' \
    -e "s#@MONITORING_CA@#$work/ca.pem#" -e "s#@PROMETHEUS_PASSWORD_FILE@#$work/prometheus.password#" \
    "$here/prometheus.yml.in" > "$work/prometheus.yml"
if grep -q '@[A-Z_]*@' "$work/prometheus.yml"; then
  echo "prometheus.yml.in has a placeholder this check does not fill" >&2; exit 1
fi
promtool check config "$work/prometheus.yml"
(cd "$here" && promtool test rules alerts.test.yml)
amtool check-config "$here/alertmanager.yml"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=check \
    -keyout "$work/server.key" -out "$work/server.pem" 2> /dev/null
hash="$(printf '%s' example-password | htpasswd -niBC 6 prometheus | head -1 | cut -d: -f2-)"
cat > "$work/web-config.yml" <<YAML
tls_server_config:
  cert_file: $work/server.pem
  key_file: $work/server.key
  min_version: TLS12
basic_auth_users:
  prometheus: '$hash'
YAML
promtool check web-config "$work/web-config.yml"
