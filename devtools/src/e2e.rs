//! `payoutdev bench e2e`: the whole system beside the Temporal floors it stands on, in one run on
//! one stack, so that the ratios are taken on one machine under one load.
//!
//! - (a) `system`: payouts through every service (lock, payment resource, proxy, a zero-latency
//!   rail without faults), on the stack's own workers, each submitted with one CreatePayout (the
//!   dispatcher's starter starts its workflow) and timed from that call. `system-caller-start`
//!   (on request): the same with the bench also starting each workflow itself at once, as
//!   integrators did before the starter.
//! - (b) `workflow-floor`: the same `PayoutWorkflow`, the same activity calls, against the
//!   in-memory backend in a worker inside this process: what our workflow's shape costs on this
//!   Temporal server with services that answer at once.
//! - (c) `temporal-floor`: one workflow of one activity that does nothing: the dev server's
//!   ceiling on this machine.
//! - `idle`: single payouts one after another through the whole system: submission-to-POSTED
//!   latency when nothing else runs.
//! - `in-process` and `in-process-security-off`: the same payouts through the lock service, the
//!   payment resource and the rail proxy hosted in this process (`service_benches::hosted`) on a
//!   private durable PostgreSQL and etcd, with a worker of our workflow in this process; the first
//!   as deployed (mutual TLS, the authorisation tables, every grant's signature and key verified
//!   by both guards), the second with that security switched off by the test-only switches. The
//!   two differ in nothing else, so their ratio is what the security costs a payout end to end.
//!
//! For each: payouts/s, latency p50/p99 from submission (the floors: from the start) to final
//! state, and state transitions and history events per workflow (Temporal's own describe, over a
//! sample), then a/b and b/c.

use std::sync::Arc;
use std::time::Duration;

use clap::Args as ClapArgs;
use payment_client::PaymentClient;
use payout_activities::in_memory::{InMemoryBackend, RailScript};
use payout_activities::types::AmbiguityPolicy;
use payout_worker::services::{ServiceBackend, ServiceConfig};
use payout_workflows::floor::{FloorActivities, FloorWorkflow};
use serde::Serialize;
use service_benches::hosted::{Backing, Hosted, Security};
use temporalio_client::{
    Client, UntypedWorkflow, WorkflowDescribeOptions, WorkflowGetResultOptions,
    WorkflowStartOptions,
};
use temporalio_sdk::{Runtime, Worker, WorkerOptions};

use crate::run::{
    ensure_up, measure, open_accounts, run_id, run_payouts, submit_payouts, Measured, Starts,
    Workload,
};

/// As the payout worker's cache (`payout_worker::MAX_CACHED_WORKFLOWS`): the floors run with
/// the same worker settings as the system.
const FLOOR_CACHED_WORKFLOWS: usize = 1_000;

#[derive(ClapArgs)]
pub struct Args {
    /// The local stack (started if it is not up), or an existing deployment by its endpoints.
    #[command(flatten)]
    pub target: payoutctl::target::Target,
    /// Payouts (and floor workflows) per configuration.
    #[arg(long, default_value_t = 600)]
    pub payouts: usize,
    /// Accounts the system's payouts are spread over, evenly (payout i on account i mod this).
    /// The workflow floor always uses one account per payout: its in-memory lock has one session.
    #[arg(long, default_value_t = 600)]
    pub accounts: usize,
    /// Ledger entries each of the system's accounts already has when its payouts arrive (pairs
    /// that sum to zero, so its balance stays; written straight into paydb as the superuser: the
    /// local stack only). A payout's cost must not grow with its account's age: run it with 0 and
    /// with a large history, and compare.
    #[arg(long, default_value_t = 0)]
    pub history: usize,
    /// Single payouts, one after another, for the idle latency.
    #[arg(long, default_value_t = 20)]
    pub idle: usize,
    /// Workflows described per configuration for the transition and event counts.
    #[arg(long, default_value_t = 20)]
    pub sample: usize,
    /// Workers, if the stack has to be started.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Give up waiting for one configuration's batch after this long.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// Which configurations to run (comma-separated: system, system-caller-start,
    /// workflow-floor, temporal-floor, idle). `system-caller-start` is `system` with the bench
    /// starting each workflow itself right after CreatePayout, as integrators did before the
    /// dispatcher's starter: the before figure of the intake. `in-process` and
    /// `in-process-security-off`: the payout path's services hosted in this process, as deployed
    /// and with their security off (the pair's ratio is what the security costs).
    /// `in-process-facts-unchecked`: as deployed with only the signed facts' checks off (the
    /// instruction at the proxy, the rail's answers at the payment resource; issue 33).
    #[arg(
        long,
        default_value = "system,workflow-floor,temporal-floor,idle,in-process,in-process-security-off"
    )]
    pub only: String,
    /// One JSON object with every figure.
    #[arg(long)]
    pub json: bool,
    /// Also run the Temporal floor on the dev server's raw frontend (host:port, plaintext), to
    /// set the front's cost beside `temporal-floor`: `temporal-floor-raw`. Only a stack whose
    /// raw ports are open reaches it (`payoutdev stack up --no-temporal-isolation`).
    #[arg(long)]
    pub temporal_raw_address: Option<String>,
}

#[derive(Serialize)]
struct Figures {
    name: &'static str,
    workflows: usize,
    failed: usize,
    elapsed_s: f64,
    per_s: f64,
    latency_ms_p50: f64,
    latency_ms_p99: f64,
    state_transitions_per_workflow: f64,
    history_events_per_workflow: f64,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    profile: &'static str,
    /// The build of the stack's services that (a) and `idle` measured.
    services: crate::profile::Services,
    payouts: usize,
    accounts: usize,
    configurations: Vec<Figures>,
    /// (a) over (b): what the services add to our own workflow's floor.
    system_over_workflow_floor: Option<f64>,
    /// (b) over (c): what our workflow's shape costs against the dev server's ceiling.
    workflow_floor_over_temporal_floor: Option<f64>,
    /// `in-process` over `in-process-security-off`: the payout path with its security (mutual
    /// TLS, the authorisation tables, grant verification at both guards) against without.
    secured_over_security_off: Option<f64>,
    /// `temporal-floor` over `temporal-floor-raw`: what the Temporal front costs the floor.
    front_over_raw: Option<f64>,
    /// `in-process` over `in-process-facts-unchecked`: what checking the signed facts costs the
    /// payout path (issue 33's budget: at least 0.90).
    facts_checked_over_unchecked: Option<f64>,
}

/// The most past entries `--history` gives one account.
const HISTORY_MAX: usize = 2_000_000;

/// Gives each account of `inputs` `entries` past ledger entries (rounded down to pairs): a +1 and
/// a -1 on the account, one balanced group each, so its balance and the sum of its entries stay as
/// they were. Written as the local stack's superuser with the triggers off
/// (`session_replication_role = replica`), so seeding costs one pass, not a commit check per entry.
async fn seed_history(
    target: &payoutctl::target::Target,
    inputs: &[payout_activities::types::PayoutInput],
    entries: usize,
) -> anyhow::Result<()> {
    use anyhow::Context;
    use payoutctl::record::StackRecord;
    anyhow::ensure!(
        !target.is_external(),
        "--history writes behind paydb's triggers as the superuser: the local stack only"
    );
    let record = StackRecord::load(&target.state_dir)?;
    let credentials =
        db_access::Credentials::load(&target.state_dir.join(db_access::CREDENTIALS_FILE))
            .context("--history: the stack's database credentials")?;
    let paydb = StackRecord::pg_server(&target.state_dir, record.ports.pg_main).url(
        "postgres",
        &credentials.superuser,
        "paydb",
    );
    let mut accounts: Vec<&str> = inputs.iter().map(|p| p.account_id.as_str()).collect();
    accounts.sort_unstable();
    accounts.dedup();
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&paydb)
        .await
        .context("--history: connecting to paydb")?;
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await
        .context("--history: switching paydb's triggers off (the superuser's right)")?;
    // The `WHERE a.id IS NOT NULL` ties the series to each account, so PostgreSQL draws fresh group
    // ids per account instead of evaluating the series once and sharing its ids.
    sqlx::query(
        "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty) \
         SELECT g.id, l.line, a.id, a.currency, CASE l.line WHEN 1 THEN 1 ELSE -1 END, a.id \
           FROM account a \
           CROSS JOIN LATERAL (SELECT gen_random_uuid() AS id FROM generate_series(1, $2) \
                                WHERE a.id IS NOT NULL) g \
           CROSS JOIN (VALUES (1), (2)) AS l(line) \
          WHERE a.id = ANY($1)",
    )
    .bind(&accounts)
    .bind(i64::try_from(entries / 2).context("--history")?)
    .execute(&mut conn)
    .await
    .context("--history: writing the past entries")?;
    Ok(())
}

pub async fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    anyhow::ensure!(
        args.payouts > 0 && args.accounts > 0,
        "--payouts and --accounts must be positive"
    );
    anyhow::ensure!(
        args.history <= HISTORY_MAX,
        "--history: at most {HISTORY_MAX} past entries per account"
    );
    let wanted: Vec<&str> = args.only.split(',').map(str::trim).collect();
    for w in &wanted {
        anyhow::ensure!(
            [
                "system",
                "system-caller-start",
                "workflow-floor",
                "temporal-floor",
                "idle",
                "in-process",
                "in-process-security-off",
                "in-process-facts-unchecked"
            ]
            .contains(w),
            "--only: unknown configuration {w:?}"
        );
    }
    let system = ensure_up(&args.target, args.workers).await?;
    // The local stack's operator signs the fundings of its accounts (an external target: none,
    // and opening funded accounts there is refused, as it must be).
    let operator = testkit::grants::OperatorKey::in_dir(&args.target.state_dir.join("system"))?;
    // Once `up` has started this build's services in place of any other's: the figures say which
    // build they measured, and a mixture, or another build than this payoutdev's (whose worker
    // runs the floors), is refused before anything is measured.
    let services = crate::profile::check(&args.target)?;
    if !args.json {
        eprintln!("{services}");
    }
    let client = Arc::new(
        payout_workflows::client::connect_configured(&system.temporal_args(), "payoutdev-bench")
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    let timeout = Duration::from_secs(args.timeout_s);
    // A rail that answers at once and never misbehaves: the benchmark measures our path.
    let stub = crate::run::rail_admin(&system)?;
    stub.set_faults(&rail_stub::FaultConfig::default())
        .await
        .map_err(|e| anyhow::anyhow!("configuring the rail stub: {e}"))?;
    let payments = PaymentClient::connect(&system.payment_url, &system.tls(mtls::Role::Fixture)?)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let ambiguity = AmbiguityPolicy {
        settlement_window_ms: system.settlement_window_ms + 500,
        resolution_sla_ms: 120_000,
    };
    let say = |line: String| {
        if !args.json {
            eprintln!("{line}");
        }
    };

    let mut configurations = Vec::new();
    // (a) Each payout submitted with one CreatePayout (its workflow started by the dispatcher's
    // starter), timed from that call; then the same with the caller also starting it at once.
    for (name, starts) in [
        (
            "system",
            Starts::Staged {
                paydb: &system.paydb,
            },
        ),
        ("system-caller-start", Starts::Caller),
    ] {
        if !wanted.contains(&name) {
            continue;
        }
        say(format!(
            "(a) {name}: {} payouts over {} accounts",
            args.payouts, args.accounts
        ));
        let workload = even_workload(args.payouts, args.accounts, 1, ambiguity)?;
        let inputs = open_accounts(&workload, &payments, &operator).await?;
        if args.history > 0 {
            let started = std::time::Instant::now();
            seed_history(&args.target, &inputs, args.history).await?;
            say(format!(
                "    {} past entries given to each account in {:.1} s",
                args.history,
                started.elapsed().as_secs_f64()
            ));
        }
        let ids = workflow_ids(&inputs);
        let measured = submit_payouts(
            client.clone(),
            &payments,
            inputs,
            (starts, &system.task_queue),
            timeout,
        )
        .await?;
        configurations.push(figures(name, &client, &ids, measured, args.sample).await);
    }
    if wanted.contains(&"workflow-floor") {
        say(format!(
            "(b) workflow floor: {} payouts on the in-memory backend",
            args.payouts
        ));
        let workload = even_workload(args.payouts, args.payouts, 1, ambiguity)?;
        let (accounts, inputs) = workload.build()?;
        let backend = Arc::new(InMemoryBackend::new("bench-floor"));
        for account in &accounts {
            backend.open_account(account, crate::run::OPENING_BALANCE_MINOR);
        }
        for input in &inputs {
            backend.create_payout(input, RailScript::Ack);
        }
        let queue = format!("bench-workflow-floor-{}", workload.run_id);
        let ids = workflow_ids(&inputs);
        let worker = WorkerOptions::new(queue.clone())
            .register_workflow::<payout_workflows::PayoutWorkflow>()?
            .register_activities(payout_activities::PayoutActivities::new(backend))
            .build();
        let measured = with_worker(&client, worker, async {
            run_payouts(client.clone(), &queue, inputs, timeout).await
        })
        .await?;
        configurations.push(figures("workflow-floor", &client, &ids, measured, args.sample).await);
    }
    if wanted.contains(&"temporal-floor") {
        say(format!(
            "(c) Temporal floor: {} workflows of one no-op activity",
            args.payouts
        ));
        configurations.push(temporal_floor("temporal-floor", &client, &args, timeout).await?);
    }
    if let Some(raw) = &args.temporal_raw_address {
        say(format!(
            "(c') Temporal floor on the dev server's raw frontend {raw}, around its front: {} \
             workflows",
            args.payouts
        ));
        // Plaintext, nothing configured but the address: only a stack whose raw ports are open
        // (`payoutdev stack up --no-temporal-isolation`, measurement only) lets it through.
        let raw_client = Arc::new(
            payout_workflows::client::connect_configured(
                &payout_workflows::client::TemporalArgs::at(raw.clone(), "default"),
                "payoutdev-bench-raw",
            )
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?,
        );
        configurations
            .push(temporal_floor("temporal-floor-raw", &raw_client, &args, timeout).await?);
    }
    if wanted.contains(&"idle") && args.idle > 0 {
        say(format!(
            "idle: {} single payouts, one after another",
            args.idle
        ));
        let workload = even_workload(args.idle, args.idle, 2, ambiguity)?;
        let inputs = open_accounts(&workload, &payments, &operator).await?;
        let ids = workflow_ids(&inputs);
        let mut total = Measured {
            latencies: Vec::new(),
            failures: Vec::new(),
            elapsed: Duration::ZERO,
        };
        for input in inputs {
            let one = submit_payouts(
                client.clone(),
                &payments,
                vec![input],
                (
                    Starts::Staged {
                        paydb: &system.paydb,
                    },
                    &system.task_queue,
                ),
                timeout,
            )
            .await?;
            total.latencies.extend(one.latencies);
            total.failures.extend(one.failures);
            total.elapsed += one.elapsed;
        }
        configurations.push(figures("idle", &client, &ids, total, args.sample).await);
    }

    // The security pair: a private durable PostgreSQL and etcd, started once for both.
    let pair: Vec<(&'static str, Security)> = [
        ("in-process", Security::AsDeployed),
        ("in-process-security-off", Security::Off),
        ("in-process-facts-unchecked", Security::FactsUnchecked),
    ]
    .into_iter()
    .filter(|(name, _)| wanted.contains(name))
    .collect();
    if !pair.is_empty() {
        let stack = tokio::task::spawn_blocking(|| testkit::Stack::builder().durable(true).start())
            .await??;
        for (name, security) in pair {
            say(format!(
                "{name}: {} payouts over {} accounts, the services in this process",
                args.payouts, args.accounts
            ));
            let workload = even_workload(args.payouts, args.accounts, 3, ambiguity)?;
            let (ids, measured) = in_process(&client, &stack, security, workload, timeout).await?;
            configurations.push(figures(name, &client, &ids, measured, args.sample).await);
        }
    }

    let per_s = |name: &str| {
        configurations
            .iter()
            .find(|f| f.name == name)
            .map(|f| f.per_s)
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let failed: usize = configurations.iter().map(|f| f.failed).sum();
    let report = Report {
        bench: "e2e",
        profile: crate::bench::profile(),
        services,
        payouts: args.payouts,
        accounts: args.accounts,
        system_over_workflow_floor: ratio(per_s("system"), per_s("workflow-floor")),
        workflow_floor_over_temporal_floor: ratio(per_s("workflow-floor"), per_s("temporal-floor")),
        secured_over_security_off: ratio(per_s("in-process"), per_s("in-process-security-off")),
        front_over_raw: ratio(per_s("temporal-floor"), per_s("temporal-floor-raw")),
        facts_checked_over_unchecked: ratio(
            per_s("in-process"),
            per_s("in-process-facts-unchecked"),
        ),
        configurations,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    Ok(if failed == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}

/// One batch through the services hosted in this process with `security`, submitted as the
/// system's is (CreatePayout, then the bench starts the workflow at once: no starter runs here)
/// on a worker of our workflow in this process, on the service backend the payout worker uses.
async fn in_process(
    client: &Arc<Client>,
    stack: &testkit::Stack,
    security: Security,
    workload: Workload,
    timeout: Duration,
) -> anyhow::Result<(Vec<String>, Measured)> {
    use mtls::Role;
    let etcd_prefix = stack.unique_prefix("e2e-locks");
    let backing = Backing {
        etcd_endpoints: stack.etcd_endpoints(),
        etcd_tls: stack.etcd_identity_tls(testkit::etcd::EtcdRole::LockServer, &etcd_prefix),
        etcd_prefix,
        paydb_url: stack.fresh_db(testkit::PgServer::Main).await,
        proxydb_url: stack.fresh_db(testkit::PgServer::Proxy).await,
    };
    // Its accounts are funded under the test process's operator's signature.
    let hosted = Hosted::start(
        &backing,
        security,
        testkit::grants::test_operator().verifier(),
    )
    .await?;
    let worker_channel = |addr, server| hosted.channel(addr, server, Role::Worker);
    let lock = lock_client::LockClient::from_channel(
        worker_channel(hosted.lock_addr, Role::LockServer).await?,
    );
    let payment = PaymentClient::from_channel(
        worker_channel(hosted.payment_addr, Role::PaymentResource).await?,
    );
    let proxy = rail_proxy_client::RailProxyClient::from_channel(
        worker_channel(hosted.proxy_addr, Role::RailProxy).await?,
    );
    let fixture = PaymentClient::from_channel(
        hosted
            .channel(hosted.payment_addr, Role::PaymentResource, Role::Fixture)
            .await?,
    );
    let queue = format!("bench-in-process-{}", workload.run_id);
    let backend = Arc::new(
        ServiceBackend::from_clients(
            ServiceConfig {
                owner: format!("bench-worker-{}", workload.run_id),
                // One worker polls here: its grants' fenced activities come back to it.
                private_task_queue: queue.clone(),
                lock_server_url: format!("{}", hosted.lock_addr),
                payment_resource_url: format!("{}", hosted.payment_addr),
                rail_proxy_url: format!("{}", hosted.proxy_addr),
                tls: service_benches::hosted::certificate(Role::Worker),
                lock_ttl: Duration::from_millis(payout_worker::services::LOCK_TTL_MS_DEFAULT),
                lock_history_path: None,
                unclaimed_grant_max: Duration::from_millis(
                    payout_worker::services::UNCLAIMED_GRANT_MAX_MS_DEFAULT,
                ),
            },
            lock,
            payment,
            proxy,
        )
        .await?,
    );
    let inputs = open_accounts(&workload, &fixture, testkit::grants::test_operator()).await?;
    let ids = workflow_ids(&inputs);
    let worker = WorkerOptions::new(queue.clone())
        .register_workflow::<payout_workflows::PayoutWorkflow>()?
        .register_activities(payout_activities::PayoutActivities::new(
            backend.clone() as Arc<dyn payout_activities::Backend>
        ))
        .build();
    let measured = with_worker(client, worker, async {
        submit_payouts(
            client.clone(),
            &fixture,
            inputs,
            (Starts::Caller, &queue),
            timeout,
        )
        .await
    })
    .await;
    backend.close().await;
    hosted.stop().await;
    Ok((ids, measured?))
}

/// A benchmark workload: no payout the account cannot fund, payouts spread evenly.
fn even_workload(
    payouts: usize,
    accounts: usize,
    seed: u64,
    ambiguity: AmbiguityPolicy,
) -> anyhow::Result<Workload> {
    Ok(Workload {
        run_id: run_id()?,
        payouts,
        accounts,
        opening_balance_minor: crate::run::OPENING_BALANCE_MINOR,
        insufficient_rate: 0.0,
        amount_max_minor: crate::run::AMOUNT_MAX_MINOR,
        beneficiaries: crate::run::BENEFICIARIES,
        seed,
        ambiguity,
        round_robin: true,
    })
}

fn workflow_ids(inputs: &[payout_activities::types::PayoutInput]) -> Vec<String> {
    inputs
        .iter()
        .map(|i| payout_domain::workflow_id(&i.payout_id))
        .collect()
}

/// (c): `args.payouts` workflows of one no-op activity on a worker in this process, through
/// `client` (the front, or the raw frontend for `temporal-floor-raw`).
async fn temporal_floor(
    name: &'static str,
    client: &Arc<Client>,
    args: &Args,
    timeout: Duration,
) -> anyhow::Result<Figures> {
    let run = run_id()?;
    let queue = format!("bench-{name}-{run}");
    let ids: Vec<String> = (0..args.payouts)
        .map(|i| format!("bench-floor-{run}-{i:05}"))
        .collect();
    let worker = WorkerOptions::new(queue.clone())
        .register_workflow::<FloorWorkflow>()?
        .register_activities(FloorActivities)
        .build();
    let measured = with_worker(client, worker, async {
        let starts = Arc::new(tokio::sync::Semaphore::new(
            crate::run::START_CONCURRENCY_MAX,
        ));
        measure(ids.clone(), |id| {
            let client = client.clone();
            let queue = queue.clone();
            let starts = starts.clone();
            async move {
                let permit = starts.acquire_owned().await.expect("semaphore open");
                client
                    .start_workflow(
                        FloorWorkflow::run,
                        id.clone(),
                        WorkflowStartOptions::new(queue, id.clone()).build(),
                    )
                    .await?;
                drop(permit);
                let handle = client.get_workflow_handle::<FloorWorkflow>(&id);
                tokio::time::timeout(
                    timeout,
                    handle.get_result(WorkflowGetResultOptions::default()),
                )
                .await??;
                Ok(())
            }
        })
        .await
    })
    .await?;
    Ok(figures(name, client, &ids, measured, args.sample).await)
}

/// Runs `work` while a worker with `options` polls in this process, then stops the worker.
async fn with_worker<T>(
    client: &Client,
    options: WorkerOptions,
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let runtime = Runtime::from_current_tokio(Default::default())?;
    let mut options = options;
    options.max_cached_workflows = FLOOR_CACHED_WORKFLOWS;
    let mut worker = Worker::new(&runtime, client.clone(), options)?;
    let shutdown = worker.shutdown_handle();
    let (ran, result) = tokio::join!(worker.run(), async {
        let result = work.await;
        shutdown();
        result
    });
    ran?;
    result
}

/// The batch's figures, with the transitions and events of up to `sample` of its workflows.
async fn figures(
    name: &'static str,
    client: &Client,
    ids: &[String],
    measured: Measured,
    sample: usize,
) -> Figures {
    let step = (ids.len() / sample.max(1)).max(1);
    let (mut transitions, mut events, mut described) = (0i64, 0usize, 0usize);
    for id in ids.iter().step_by(step).take(sample) {
        let handle = client.get_workflow_handle::<UntypedWorkflow>(id.as_str());
        if let Ok(d) = handle.describe(WorkflowDescribeOptions::default()).await {
            transitions += d
                .raw_description
                .workflow_execution_info
                .as_ref()
                .map_or(0, |i| i.state_transition_count);
            events += d.history_length();
            described += 1;
        }
    }
    let mean = |total: f64| {
        if described == 0 {
            0.0
        } else {
            total / described as f64
        }
    };
    for f in measured.failures.iter().take(5) {
        eprintln!("{name}: did not complete: {f}");
    }
    Figures {
        name,
        workflows: measured.latencies.len() + measured.failures.len(),
        failed: measured.failures.len(),
        elapsed_s: measured.elapsed.as_secs_f64(),
        per_s: measured.throughput(),
        latency_ms_p50: measured.percentile_ms(0.50),
        latency_ms_p99: measured.percentile_ms(0.99),
        state_transitions_per_workflow: mean(transitions as f64),
        history_events_per_workflow: mean(events as f64),
    }
}

fn print_report(r: &Report) {
    println!(
        "e2e: {} payouts over {} accounts (the floors: one account each), {} build",
        r.payouts, r.accounts, r.profile
    );
    println!("{}", r.services);
    println!(
        "{:<24} {:>9} {:>7} {:>9} {:>10} {:>10} {:>12} {:>8}",
        "configuration",
        "workflows",
        "failed",
        "per s",
        "p50 (ms)",
        "p99 (ms)",
        "transitions",
        "events"
    );
    for f in &r.configurations {
        println!(
            "{:<24} {:>9} {:>7} {:>9.1} {:>10.0} {:>10.0} {:>12.1} {:>8.1}",
            f.name,
            f.workflows,
            f.failed,
            f.per_s,
            f.latency_ms_p50,
            f.latency_ms_p99,
            f.state_transitions_per_workflow,
            f.history_events_per_workflow
        );
    }
    if let Some(x) = r.system_over_workflow_floor {
        println!("a/b system over workflow floor: {x:.2}");
    }
    if let Some(x) = r.workflow_floor_over_temporal_floor {
        println!("b/c workflow floor over Temporal floor: {x:.2}");
    }
    if let Some(x) = r.front_over_raw {
        println!("c/c' Temporal floor through the front over raw: {x:.2}");
    }
    if let Some(x) = r.secured_over_security_off {
        println!(
            "in-process secured over security off: {x:.2} (mutual TLS, the authorisation tables, grant verification and the signed facts' checks; target at least 0.95)"
        );
    }
    if let Some(x) = r.facts_checked_over_unchecked {
        println!(
            "in-process signed facts checked over unchecked: {x:.2} (the instruction at the proxy, the rail's answers at the payment resource; target at least 0.90)"
        );
    }
}
