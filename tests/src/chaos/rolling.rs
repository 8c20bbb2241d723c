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
    /// Its log shows the worker's ready line once more than before.
    WorkerLog,
}

fn ready_lines(process: &ManagedProcess) -> usize {
    std::fs::read_to_string(process.log_path())
        .map(|log| log.matches(WORKER_READY_LINE).count())
        .unwrap_or(0)
}

async fn restart(system: &System, process: &ManagedProcess, ready: Ready) -> anyhow::Result<()> {
    let lines_before = ready_lines(process);
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
                || async { (ready_lines(process) > lines_before).then_some(()) },
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
        restart(system, &r.process, Ready::Tcp(r.metrics_port)).await?;
        done.push("reconciler");
    }
    Ok(format!(
        "restarted in turn, each ready before the next: {}",
        done.join(", ")
    ))
}
