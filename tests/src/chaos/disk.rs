//! A full disk (issue 36, docs/design/fault-suite section 1): each store runs out of space
//! mid-batch, refuses, and recovers by the procedure RESTORE.md gives its operator.
//!
//! The chaos stack puts each PostgreSQL server's WAL and one etcd member's data on size-capped
//! volumes (`testkit::volume::CappedVolume`, a real `tmpfs` whose writes fail with `ENOSPC` when
//! it is full) and gives etcd a small backend quota. The faults:
//! - `disk_full_pg_main`, `disk_full_pg_proxy`: the server's WAL volume filled with ballast. Its
//!   next WAL write fails, the server PANICs and its crash recovery cannot finish while the
//!   volume is full; every guard call is UNAVAILABLE (a retry, never a decision). Healed: the
//!   ballast deleted, the server started again where its postmaster gave up (a supervisor's
//!   job), its own crash recovery; a probe write must then commit.
//! - `disk_full_etcd_member`: one member's data volume filled; the cluster's next writes need
//!   space on it and the member exits (etcd stops rather than write on a disk that refuses); the
//!   other two keep the quorum. Healed: ballast deleted, member started again, it catches up.
//! - `etcd_nospace`: the backend quota reached (a runaway writer's keys): etcd raises the
//!   `NOSPACE` alarm and refuses every write, so the lock service grants nothing. Healed by
//!   RESTORE.md's four commands as root: delete the keys, compact, defragment, disarm. The lock
//!   service must grant again, with a higher token than before.
//!
//! What each fault saw is the store's own refusal (its log's `ENOSPC`, etcd's alarm and the
//! lock service's refused grant), counted in [`Outcome::disk_full_refusals`] and required by the
//! CI-sized run ("sometimes").

use std::path::Path;
use std::time::{Duration, Instant};

use testkit::pki::Role;
use testkit::system::System;
use testkit::{PgServer, Stack};

use super::nemesis::{blocking, Fault, Outcome};

/// The `reached` entry of each store's refusal: `disk_full_refused@<store>`.
pub const REACHED_PREFIX: &str = "disk_full_refused@";
/// The stores, as the `reached` entries and the report name them.
pub const STORES: [&str; 4] = ["pg_main", "pg_proxy", "etcd_member", "etcd_quota"];

/// A filled store shows its refusal within this (a bound: a probe write is made at once).
const REFUSAL_WAIT: Duration = Duration::from_secs(60);
/// A freed store takes writes again within this (a bound: PostgreSQL's crash recovery and an
/// etcd member's catch-up take seconds).
const RECOVERY_WAIT: Duration = Duration::from_secs(120);
/// The probe row: larger than a WAL page many times over, so one insert needs fresh space.
const PROBE_ROW_SQL: &str = "INSERT INTO chaos_disk_probe \
     SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 2000)";
/// Scratch keys of the etcd faults live under this prefix (root's; no service reads it).
const SCRATCH_PREFIX: &str = "/chaos/disk/";
/// Each scratch value: under etcd's request limit (1.5 MiB).
const SCRATCH_VALUE_BYTES: usize = 1 << 20;
/// The member-volume fault writes at most this much scratch before it calls the member
/// unrefusing: below the quota, so it is the member's disk that refuses, not the quota.
const MEMBER_SCRATCH_MAX_BYTES: u64 = 40 << 20;

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Lines of `path` past byte `offset` that contain `needle` (case-insensitive).
fn lines_since(path: &Path, offset: u64, needle: &str) -> usize {
    let Ok(bytes) = std::fs::read(path) else {
        return 0;
    };
    let tail = bytes.get(offset as usize..).unwrap_or_default();
    let needle = needle.to_ascii_lowercase();
    String::from_utf8_lossy(tail)
        .lines()
        .filter(|l| l.to_ascii_lowercase().contains(&needle))
        .count()
}

/// A WAL volume filled: the server refuses, PANICs, and recovers once it is freed.
pub async fn pg_full(
    stack: &Stack,
    system: &System,
    server: PgServer,
    fault: &Fault,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    let (pg, store) = match server {
        PgServer::Main => (&stack.main, "pg_main"),
        PgServer::Proxy => (&stack.proxy, "pg_proxy"),
    };
    let volume = pg.wal_volume.as_ref().ok_or_else(|| {
        anyhow::anyhow!(
            "{store} has no capped WAL volume: {}",
            stack
                .volumes_unavailable
                .as_deref()
                .unwrap_or("not mounted")
        )
    })?;
    let in_flight = super::payouts_in_flight(system).await.unwrap_or(0);
    let log = pg.process.log_path().to_path_buf();
    let offset = file_len(&log);
    let probe_url = pg.url("postgres");
    // The probe's table exists before the disk fills (creating it needs WAL too).
    probe_write(&probe_url).await?;
    let ballast = blocking(|| volume.fill())?;
    // The next WAL write anyone makes is refused: the workload's, or the probe's made now.
    let refused = testkit::eventually(REFUSAL_WAIT, "the server to refuse a write", || async {
        let _ = probe_write(&probe_url).await;
        let n = lines_since(&log, offset, "No space left on device");
        (n > 0).then_some(n)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(fault.down_ms)).await;
    // Healed whatever was seen: the run must go on.
    blocking(|| volume.free())?;
    let restarted = recover_pg(pg, &probe_url).await?;
    refused?;
    // Every refusal of the episode: the first write's PANIC and crash recovery's own.
    let refused = lines_since(&log, offset, "No space left on device");
    *outcome
        .disk_full_refusals
        .entry(store.to_string())
        .or_default() += 1;
    Ok(format!(
        "{store}'s WAL volume filled ({} MiB of ballast, {in_flight} payouts in flight): \
         {refused} ENOSPC lines in its log; freed after {} ms; {}",
        ballast >> 20,
        fault.down_ms,
        if restarted {
            "its postmaster had given up and was started again, crash recovery done"
        } else {
            "it recovered by itself"
        }
    ))
}

/// Creates the probe table if missing and writes one large row (`PROBE_ROW_SQL`).
async fn probe_write(url: &str) -> anyhow::Result<()> {
    let pool = super::one_connection(url).await?;
    let result = async {
        sqlx::query("CREATE TABLE IF NOT EXISTS chaos_disk_probe (filler text)")
            .execute(&pool)
            .await?;
        sqlx::query(PROBE_ROW_SQL).execute(&pool).await?;
        sqlx::query("TRUNCATE chaos_disk_probe")
            .execute(&pool)
            .await?;
        anyhow::Ok(())
    }
    .await;
    testkit::util::close_pool(pool).await;
    result
}

/// Until a probe write commits: a postmaster that exited (its crash recovery could not write
/// while the volume was full) is started again, as a supervisor would. Answers whether it was.
async fn recover_pg(pg: &testkit::postgres::Postgres, probe_url: &str) -> anyhow::Result<bool> {
    let give_up = Instant::now() + RECOVERY_WAIT;
    let mut restarted = false;
    let mut last = String::new();
    while Instant::now() < give_up {
        if !pg.process.is_running() {
            blocking(|| pg.restart())?;
            restarted = true;
        }
        match probe_write(probe_url).await {
            Ok(()) => return Ok(restarted),
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    anyhow::bail!(
        "{} took no write within {RECOVERY_WAIT:?} of its volume's freeing: {last}\n{}",
        pg.name,
        pg.process.log_tail(20)
    )
}

/// One etcd member's data volume filled: the cluster's writes reach it, it exits; the other two
/// carry on. Freed, started again, it catches up.
pub async fn etcd_member_full(
    stack: &Stack,
    fault: &Fault,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    let index = testkit::stack::CAPPED_ETCD_MEMBER;
    let member = stack
        .etcd
        .members
        .get(index)
        .filter(|m| m.volume.is_some())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "no etcd member on a capped volume: {}",
                stack
                    .volumes_unavailable
                    .as_deref()
                    .unwrap_or("not mounted")
            )
        })?;
    let volume = member.volume.as_ref().expect("filtered above");
    let log = member.process.log_path().to_path_buf();
    let offset = file_len(&log);
    let ballast = blocking(|| volume.fill())?;
    let prefix = format!("{SCRATCH_PREFIX}member-{}/", fault.at_ms);
    let value = vec![b'x'; SCRATCH_VALUE_BYTES];
    let mut written = 0u64;
    let mut write_error = None;
    while member.process.is_running() && written < MEMBER_SCRATCH_MAX_BYTES {
        match put(stack, &format!("{prefix}{written}"), &value).await {
            Ok(()) => written += SCRATCH_VALUE_BYTES as u64,
            Err(e) => {
                write_error = Some(e);
                break;
            }
        }
    }
    let exited = testkit::eventually(REFUSAL_WAIT, "the full member to stop", || async {
        (!member.process.is_running()).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(fault.down_ms)).await;
    // Healed whatever was seen: the scratch keys go (the quorum takes the delete), the ballast
    // goes, the member comes back.
    let deleted = delete_prefix(stack, &prefix).await;
    blocking(|| volume.free())?;
    if !member.process.is_running() {
        blocking(|| member.restart())?;
    }
    blocking(|| stack.etcd.wait_healthy())?;
    deleted?;
    exited.map_err(|e| {
        anyhow::anyhow!(
            "member {} did not stop on its full disk after {} MiB of scratch ({e}; last write \
             error: {write_error:?})",
            member.name,
            written >> 20
        )
    })?;
    let enospc = lines_since(&log, offset, "no space left on device");
    anyhow::ensure!(
        enospc > 0,
        "member {} stopped without an ENOSPC in its log:\n{}",
        member.name,
        member.process.log_tail(10)
    );
    *outcome
        .disk_full_refusals
        .entry("etcd_member".to_string())
        .or_default() += 1;
    Ok(format!(
        "etcd {}'s data volume filled ({} MiB of ballast): it stopped after {} MiB of writes \
         ({enospc} ENOSPC lines); freed, started again, the cluster healthy",
        member.name,
        ballast >> 20,
        written >> 20
    ))
}

/// One put as root, retried while the cluster elects (a member just went).
async fn put(stack: &Stack, key: &str, value: &[u8]) -> anyhow::Result<()> {
    let mut client = stack.etcd.client().await?;
    client
        .put(key, value.to_vec(), None)
        .await
        .map(drop)
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// Deletes every key under `prefix`, retried (bounded) while the cluster comes back.
async fn delete_prefix(stack: &Stack, prefix: &str) -> anyhow::Result<()> {
    testkit::eventually(RECOVERY_WAIT, "the scratch keys deleted", || async {
        blocking(|| stack.etcd.etcdctl_as_root(&["del", "--prefix", prefix]))
            .ok()
            .map(drop)
    })
    .await
}

/// etcd's backend quota reached: `NOSPACE` raised, every write refused, the lock service grants
/// nothing; then RESTORE.md's procedure.
pub async fn etcd_nospace(
    stack: &Stack,
    system: &System,
    fault: &Fault,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    etcd_nospace_with(stack, system, fault, outcome, NospaceProcedure::Whole).await
}

/// How much of RESTORE.md's `NOSPACE` procedure the operator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NospaceProcedure {
    Whole,
    /// Test-only negative control: every step but the last (`alarm disarm`).
    WithoutDisarm,
}

/// [`etcd_nospace`] with the operator's procedure chosen: without the disarm, the fault ends
/// with the lock service's refusal after the procedure as its error, and nothing counted.
pub async fn etcd_nospace_with(
    stack: &Stack,
    system: &System,
    fault: &Fault,
    outcome: &mut Outcome,
    procedure: NospaceProcedure,
) -> anyhow::Result<String> {
    let key = format!("payout:chaos-nospace-probe-{}", fault.at_ms);
    let before = grant_once(system, &key)
        .await
        .map_err(|e| anyhow::anyhow!("the probe before the quota: {e}"))?;
    let prefix = format!("{SCRATCH_PREFIX}nospace-{}/", fault.at_ms);
    let value = vec![b'x'; SCRATCH_VALUE_BYTES];
    let most = 2 * testkit::stack::CHAOS_ETCD_QUOTA_BYTES / SCRATCH_VALUE_BYTES as u64;
    let mut refusal = None;
    let mut written = 0u64;
    for i in 0..most {
        if let Err(e) = put(stack, &format!("{prefix}{i}"), &value).await {
            refusal = Some(e.to_string());
            break;
        }
        written += 1;
    }
    let outcome_of_fill = match &refusal {
        Some(e) if e.contains("database space exceeded") => Ok(()),
        Some(e) => Err(anyhow::anyhow!("the fill failed otherwise: {e}")),
        None => Err(anyhow::anyhow!(
            "{most} MiB written and the quota never refused"
        )),
    };
    let alarms = blocking(|| stack.etcd.etcdctl_as_root(&["alarm", "list"])).unwrap_or_default();
    // The lock service's grant refused while the alarm stands (a session needs a lease grant,
    // a grant a transaction: both refused).
    let refused_grant = match grant_once(system, &format!("{key}-during")).await {
        Ok(token) => Err(format!("granted token {token} under NOSPACE")),
        Err(e) => Ok(e),
    };
    tokio::time::sleep(Duration::from_millis(fault.down_ms)).await;
    let recovered = nospace_procedure(stack, &prefix, procedure).await;
    outcome_of_fill?;
    recovered?;
    if procedure == NospaceProcedure::WithoutDisarm {
        // The alarm stands until disarmed: the refusal is the state, not a moment of it.
        return match grant_once(system, &key).await {
            Ok(token) => Ok(format!(
                "granted token {token} after the procedure without the disarm"
            )),
            Err(e) => Err(anyhow::anyhow!(
                "after the procedure without the disarm the lock service still refuses: {e}"
            )),
        };
    }
    anyhow::ensure!(
        alarms.contains("NOSPACE"),
        "no NOSPACE alarm was raised: {alarms:?}"
    );
    let refused_grant = refused_grant.map_err(|e| anyhow::anyhow!("{e}"))?;
    let after = testkit::eventually(RECOVERY_WAIT, "a grant after the procedure", || async {
        grant_once(system, &key).await.ok()
    })
    .await?;
    anyhow::ensure!(
        after > before,
        "after the procedure the probe got token {after}, not above {before}"
    );
    *outcome
        .disk_full_refusals
        .entry("etcd_quota".to_string())
        .or_default() += 1;
    Ok(format!(
        "etcd's quota reached after {written} MiB of scratch ({}): NOSPACE raised, the lock \
         service refused a grant ({refused_grant}); deleted, compacted, defragmented, disarmed; \
         probe token {before} -> {after}",
        refusal.unwrap_or_default()
    ))
}

/// RESTORE.md, "etcd out of space": the keys that filled it deleted, history compacted at the
/// current revision, every member defragmented, the alarm disarmed; the same commands an
/// operator types, as root.
async fn nospace_procedure(
    stack: &Stack,
    prefix: &str,
    procedure: NospaceProcedure,
) -> anyhow::Result<()> {
    let etcd = &stack.etcd;
    blocking(|| etcd.etcdctl_as_root(&["del", "--prefix", prefix]))?;
    let status = blocking(|| etcd.etcdctl_as_root(&["endpoint", "status", "-w", "json"]))?;
    let revision = serde_json::from_str::<serde_json::Value>(&status)?
        .as_array()
        .and_then(|members| {
            members
                .iter()
                .filter_map(|m| m["Status"]["header"]["revision"].as_i64())
                .max()
        })
        .ok_or_else(|| anyhow::anyhow!("no revision in endpoint status: {status}"))?;
    let revision = revision.to_string();
    // A compaction at a revision already compacted (the periodic one got there first) is
    // refused; that is the state wanted.
    if let Err(e) = blocking(|| etcd.etcdctl_as_root(&["compact", &revision])) {
        anyhow::ensure!(
            format!("{e:#}").contains("compacted"),
            "compact {revision}: {e:#}"
        );
    }
    blocking(|| etcd.etcdctl_as_root(&["defrag", "--cluster"]))?;
    if procedure == NospaceProcedure::Whole {
        blocking(|| etcd.etcdctl_as_root(&["alarm", "disarm"]))?;
    }
    Ok(())
}

/// One session and one acquire of `key` (released at once): the grant's token, or why not.
pub async fn grant_once(system: &System, key: &str) -> Result<u64, String> {
    let attempt = async {
        let lock =
            lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker)).await?;
        let session = lock
            .open_session("chaos-disk-probe", Duration::from_secs(10))
            .await?;
        let answer = session.acquire(key, Duration::from_secs(3)).await;
        let _ = session.close().await;
        answer
    };
    match tokio::time::timeout(Duration::from_secs(15), attempt).await {
        Ok(Ok(lock_client::Acquired::Granted(g))) => Ok(g.token().get()),
        Ok(Ok(lock_client::Acquired::NotAcquired { holder_owner, .. })) => {
            Err(format!("held by {holder_owner}"))
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no answer within 15 s".into()),
    }
}
