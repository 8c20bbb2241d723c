//! A host clock that jumps (issue 36, docs/design/fault-suite section 2): the wall clock of one
//! process (a worker, the payment resource, the rail proxy or the lock-server) is stepped forward
//! or back by minutes while payouts run, then set right again.
//!
//! The run's processes are started under libfaketime (`SystemOptions::movable_clocks`,
//! `testkit::clock`); a step moves `CLOCK_REALTIME` only, as an NTP step or a VM's resume does, so
//! leases, timers and the lock history (all monotonic) are unmoved. What reads the wall clock may
//! refuse (the proxy: an instruction not yet valid or expired, a rail answer signed too far from
//! its now): liveness, which the run's settling measures. INV-01..08 must hold throughout.

use std::time::Duration;

use rand::{RngExt, SeedableRng};
use testkit::system::System;

use super::nemesis::Fault;
use super::DisableGuard;

/// A jump is at least this many minutes and at most [`JUMP_MINUTES_MAX`]: past the proxy's
/// five-second instruction skew at once, and up to the instruction's whole ten-minute life
/// (`grant_signing::instruction::TTL_DEFAULT_MS`) and twice the rail answer's five-minute skew.
const JUMP_MINUTES_MIN: i64 = 1;
const JUMP_MINUTES_MAX: i64 = 10;

/// One seeded jump: whose clock, by how much.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Jump {
    /// The process's name (its offset file's).
    pub process: String,
    pub offset_s: i64,
}

impl Jump {
    /// Drawn from `fault.seed`: the target among the four (a worker is `fault.worker`; a guard
    /// served in-process with its switch off has no clock of its own to move and is left out),
    /// the direction, and 1..=10 minutes.
    pub fn of(system: &System, fault: &Fault, disable: DisableGuard) -> Self {
        let mut targets: Vec<&str> = Vec::new();
        if let Some(worker) = system.workers.get(fault.worker) {
            targets.push(worker.name());
        }
        if !disable.fence_off() {
            targets.push(system.payment_resource.name());
        }
        if !disable.proxy_off() {
            targets.push(system.rail_proxy.name());
        }
        targets.push(system.lock_server.name());
        let mut rng = rand::rngs::StdRng::seed_from_u64(fault.seed);
        let process = targets[rng.random_range(0..targets.len())].to_string();
        let minutes = rng.random_range(JUMP_MINUTES_MIN..=JUMP_MINUTES_MAX);
        let sign = if rng.random_bool(0.5) { 1 } else { -1 };
        Self {
            process,
            offset_s: sign * minutes * 60,
        }
    }
}

/// Once a payout is in flight (bounded: `super::payouts_in_flight`), steps one
/// process's wall clock for `fault.down_ms` (plus the time the library takes to read the new
/// offset, so the step holds that long), then sets it right and waits until that is read too:
/// healed before the next fault.
pub async fn inject(
    system: &System,
    fault: &Fault,
    disable: DisableGuard,
) -> anyhow::Result<String> {
    let jump = Jump::of(system, fault, disable);
    let read_within = Duration::from_secs(testkit::clock::OFFSET_CACHE_S);
    let in_flight = super::payouts_in_flight(system).await;
    system.set_clock_offset(&jump.process, jump.offset_s)?;
    tokio::time::sleep(Duration::from_millis(fault.down_ms) + read_within).await;
    system.set_clock_offset(&jump.process, 0)?;
    tokio::time::sleep(read_within).await;
    Ok(format!(
        "{}'s wall clock stepped {:+} min for {} ms ({}), then set right",
        jump.process,
        jump.offset_s / 60,
        fault.down_ms,
        in_flight.map_or(
            "no payout came in flight within the wait".to_string(),
            |n| { format!("{n} payouts in flight") }
        ),
    ))
}
