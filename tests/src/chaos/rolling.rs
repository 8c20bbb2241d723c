//! `rolling_restart` (issue 36, docs/design/fault-suite section 4): every service of the system
//! stopped gracefully (SIGTERM, then SIGKILL after the kit's grace) and started again, one after
//! another, each ready before the next goes, as a deployment's rolling restart of a new release
//! does. What it tests is the services' graceful stop under load: calls in flight answered or
//! failed cleanly, nothing written half, every payout still ending once.

use std::time::Duration;

use testkit::pki::Role;
use testkit::system::{wait_grpc, wait_tcp, System};
use testkit::ManagedProcess;

use super::temporal::Reconciler;
use super::DisableGuard;

/// A restarted worker logs this once its lock session and the guards answer (workers/src/lib.rs).
const WORKER_READY_LINE: &str = "the worker's services answered";
/// How long a restarted worker may take to say it is ready.
const WORKER_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How a restarted process is known ready.
enum Ready {
    /// Its gRPC health says SERVING (a certificate of this server role answers).
    Grpc(u16, Role),
    /// Its port accepts connections (its `/metrics`).
    Tcp(u16),
    /// What its log gained since the restart holds the worker's ready line.
    WorkerLog,
}

/// The log's length now: where a restarted process's own lines begin.
fn log_end(process: &ManagedProcess) -> u64 {
    std::fs::metadata(process.log_path()).map_or(0, |m| m.len())
}

/// Whether the log holds the worker's ready line after byte `from` (read from there only).
fn ready_since(process: &ManagedProcess, from: u64) -> bool {
    use std::io::{Read, Seek};
    let mut gained = String::new();
    std::fs::File::open(process.log_path())
        .and_then(|mut log| {
            log.seek(std::io::SeekFrom::Start(from))?;
            log.read_to_string(&mut gained)
        })
        .is_ok_and(|_| gained.contains(WORKER_READY_LINE))
}

async fn restart(system: &System, process: &ManagedProcess, ready: Ready) -> anyhow::Result<()> {
    let log_from = log_end(process);
    tokio::task::block_in_place(|| {
        process.terminate()?;
        process.restart()
    })?;
    match ready {
        Ready::Grpc(port, role) => {
            wait_grpc(port, process, &system.tls(Role::Reconciler), role).await
        }
        Ready::Tcp(port) => wait_tcp(port, process).await,
        Ready::WorkerLog => {
            testkit::eventually(
                WORKER_READY_TIMEOUT,
                &format!("{} ready again", process.name()),
                || async { ready_since(process, log_from).then_some(()) },
            )
            .await
        }
    }
}

/// Restarts every service in turn: the lock-server, the guards (unless replaced in-process by a
/// control), the GL, the dispatcher, each worker and the reconciler.
pub async fn restart_all(
    system: &System,
    reconciler: Option<&Reconciler>,
    disable: DisableGuard,
) -> anyhow::Result<String> {
    let ports = &system.ports;
    let mut done = Vec::new();
    restart(
        system,
        &system.lock_server,
        Ready::Grpc(ports.lock_server, Role::LockServer),
    )
    .await?;
    done.push("lock-server");
    if !disable.fence_off() {
        let ready = Ready::Grpc(ports.payment_resource, Role::PaymentResource);
        restart(system, &system.payment_resource, ready).await?;
        done.push("payment-resource");
    }
    if !disable.proxy_off() {
        let ready = Ready::Grpc(ports.rail_proxy, Role::RailProxy);
        restart(system, &system.rail_proxy, ready).await?;
        done.push("rail-proxy");
    }
    let ready = Ready::Grpc(ports.general_ledger, Role::GeneralLedger);
    restart(system, &system.general_ledger, ready).await?;
    done.push("general-ledger");
    // The dispatcher's `/metrics` is the last of the system's metrics ports (`SystemPorts`).
    let dispatcher_metrics = *ports
        .metrics
        .last()
        .ok_or_else(|| anyhow::anyhow!("the system has no metrics ports"))?;
    restart(system, &system.dispatcher, Ready::Tcp(dispatcher_metrics)).await?;
    done.push("dispatcher");
    for worker in &system.workers {
        restart(system, worker, Ready::WorkerLog).await?;
        done.push(worker.name());
    }
    if let Some(r) = reconciler {
        r.carry().await;
        restart(system, &r.process, Ready::Tcp(r.metrics_port)).await?;
        done.push("reconciler");
    }
    Ok(format!(
        "restarted in turn, each ready before the next: {}",
        done.join(", ")
    ))
}
