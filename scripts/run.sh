#!/usr/bin/env bash
# The main job: build every binary, bring the local stack and all services up (if not already),
# and run a batch of payouts under rail faults through the whole system, then the reconciler.
# Arguments go to `payoutdev run` (see `payoutdev run --help`: --payouts, --accounts, fault rates, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --bins --locked
exec ./target/debug/payoutdev run "$@"
