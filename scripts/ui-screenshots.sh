#!/usr/bin/env bash
# Screenshots of the Temporal UI explaining payouts, saved as PNG under docs/screenshots/.
#
# Brings up a local stack of its own (state dir and ports below, all overridable; it is brought
# down again at the end) with a long settlement window, so RAIL_AMBIGUOUS payouts stay ambiguous,
# runs a small batch through `payoutdev run` with the rail stub timing out after acceptance for a
# third of the payouts, then opens the UI in headless Chromium (installed by scripts/setup.sh) and
# saves:
#   list-by-account.png      the workflow list filtered by AccountId
#   list-rail-ambiguous.png  the workflow list filtered by PayoutState='RAIL_AMBIGUOUS'
#   ambiguous-metadata.png   a RAIL_AMBIGUOUS payout: summary, details and current details
#   ambiguous-history.png    its event history: every activity and timer says what it is for
#   waiting-metadata.png     a payout waiting for its account's lock (who holds it), if one is
#
# With UI_STACK_REUSE=1 the stack at UI_STACK_STATE_DIR is used as it is (and left running).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

state_dir="${UI_STACK_STATE_DIR:-/tmp/ui-screenshots/stack}"
pg_main="${UI_STACK_PG_MAIN_PORT:-32432}"
pg_proxy="${UI_STACK_PG_PROXY_PORT:-32433}"
etcd="${UI_STACK_ETCD_PORT:-32379}"
temporal_port="${UI_STACK_TEMPORAL_PORT:-32233}"
ui_port="${UI_STACK_TEMPORAL_UI_PORT:-32240}"
service_base="${UI_STACK_SERVICE_PORT_BASE:-32050}"
out="$root/docs/screenshots"
# Long enough that the ambiguous payouts are still ambiguous when the screenshots are taken.
settlement_window_ms=600000
# The batch reaches RAIL_AMBIGUOUS in seconds; this bounds a stack that went wrong.
ambiguous_wait_s=180

temporal="$root/.venv/bin/temporal"
[ -x "$temporal" ] || temporal="$(command -v temporal || true)"
chromium="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$temporal" ] || [ -z "$chromium" ]; then
  echo "ui-screenshots: needs the temporal CLI and chromium: run scripts/setup.sh" >&2
  exit 1
fi
# Temporal is behind its mutual-TLS front: the CLI as the stack's operator profile, the UI over
# TLS with the stack's UI login (ui_screenshot.py sends it).
tctl() {
  TEMPORAL_CONFIG_FILE="$state_dir/temporal-clients/temporal-clients.toml" TEMPORAL_PROFILE=operator \
    "$temporal" --address "127.0.0.1:$temporal_port" --namespace default "$@"
}
ui="https://127.0.0.1:$ui_port/namespaces/default"
urlencode() { python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$1"; }

cargo build -q --bins --locked
if [ "${UI_STACK_REUSE:-0}" != 1 ]; then
  ./target/debug/payoutdev stack up --state-dir "$state_dir" --pg-main-port "$pg_main" \
    --pg-proxy-port "$pg_proxy" --etcd-port "$etcd" --temporal-port "$temporal_port" \
    --temporal-ui-port "$ui_port" --service-port-base "$service_base" \
    --settlement-window-ms "$settlement_window_ms"
fi
run_pid=""
cleanup() {
  [ -n "$run_pid" ] && kill "$run_pid" 2>/dev/null || true
  if [ "${UI_STACK_REUSE:-0}" != 1 ]; then
    ./target/debug/payoutdev stack down --state-dir "$state_dir" >/dev/null || true
  fi
}
trap cleanup EXIT

# Three accounts, one payout in flight per account at a time: while one is ambiguous, the others
# of its account wait for the lock. The run itself waits for settlement; it is stopped at the end.
./target/debug/payoutdev run --state-dir "$state_dir" --payouts 12 --accounts 3 \
  --timeout-after-accept-rate 0.34 --decline-rate 0 --insufficient-rate 0.1 \
  --fail-after-accept-rate 0 --lost-response-rate 0 \
  --settlement-window-ms "$settlement_window_ms" --timeout-s 900 >"$state_dir/ui-run.log" 2>&1 &
run_pid=$!

ambiguous=""
for _ in $(seq "$ambiguous_wait_s"); do
  ambiguous="$(tctl workflow list --query "PayoutState='RAIL_AMBIGUOUS'" -o json 2>/dev/null |
    python3 -c 'import json, sys; w = json.load(sys.stdin) or []; print(w[0]["execution"]["workflowId"] if w else "")' || true)"
  [ -n "$ambiguous" ] && break
  sleep 1
done
if [ -z "$ambiguous" ]; then
  echo "ui-screenshots: no RAIL_AMBIGUOUS payout within ${ambiguous_wait_s} s; see $state_dir/ui-run.log" >&2
  exit 1
fi
# Let the other payouts of the batch reach where they wait.
sleep 5
describe() { tctl workflow describe --workflow-id "$1" -o json; }
run_id() { describe "$1" | python3 -c 'import json, sys; print(json.load(sys.stdin)["workflowExecutionInfo"]["execution"]["runId"])'; }
account="$(describe "$ambiguous" | python3 -c '
import base64, json, sys
fields = json.load(sys.stdin)["workflowExecutionInfo"]["searchAttributes"]["indexedFields"]
print(json.loads(base64.b64decode(fields["AccountId"]["data"])))')"
ambiguous_run="$(run_id "$ambiguous")"
waiting="$(tctl workflow list --query "AccountId='$account' AND PayoutState='PENDING' AND ExecutionStatus='Running'" -o json 2>/dev/null |
  python3 -c 'import json, sys; w = json.load(sys.stdin) or []; print(w[0]["execution"]["workflowId"] if w else "")' || true)"

mkdir -p "$out"
shots=(
  "$out/list-by-account.png" "$ui/workflows?query=$(urlencode "AccountId='$account'")" "$ambiguous"
  "$out/list-rail-ambiguous.png" "$ui/workflows?query=$(urlencode "PayoutState='RAIL_AMBIGUOUS'")" "$ambiguous"
  "$out/ambiguous-metadata.png" "$ui/workflows/$ambiguous/$ambiguous_run/user-metadata" "Current Details"
  "$out/ambiguous-history.png" "$ui/workflows/$ambiguous/$ambiguous_run/history" "Timer Started"
)
if [ -n "$waiting" ]; then
  shots+=("$out/waiting-metadata.png" "$ui/workflows/$waiting/$(run_id "$waiting")/user-metadata" "Current Details")
fi
UI_LOGIN="operator:$(cat "$state_dir/temporal-clients/temporal-ui.password")" \
  python3 "$root/scripts/ui_screenshot.py" "$chromium" "${shots[@]}"
echo "ui-screenshots: saved under docs/screenshots/ (account $account, ambiguous $ambiguous${waiting:+, waiting $waiting})"
