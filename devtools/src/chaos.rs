//! `payoutdev chaos`: the fault-injection suite (issue 8) on a stack of its own: a workload
//! through Temporal, a seeded nemesis, then the independent checker. Exit status 1 on any
//! violation. The harness lives in `system-tests` (`system_tests::chaos`), shared with the test.

use std::time::Duration;

use clap::Args as ClapArgs;
use system_tests::chaos::nemesis::FaultKind;
use system_tests::chaos::{self, ChaosConfig, DisableGuard};

#[derive(ClapArgs)]
pub struct Args {
    /// Seed of the workload, the rail's faults and the nemesis's schedule.
    #[arg(long, default_value_t = 8)]
    pub seed: u64,
    #[arg(long, default_value_t = 200)]
    pub payouts: usize,
    /// Accounts (default: a quarter of the payouts, for contention).
    #[arg(long)]
    pub accounts: Option<usize>,
    #[arg(long, default_value_t = 40)]
    pub faults: usize,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Negative control: replace a guarded service by an in-process one with its guard off.
    #[arg(long, default_value = "none", value_parser = ["none", "fence", "proxy", "both"])]
    pub disable_guard: String,
    /// Spread the faults over this many seconds (default: two per fault, at least ten).
    #[arg(long)]
    pub fault_window_s: Option<u64>,
    /// Give the system this long to settle after the faults stop.
    #[arg(long, default_value_t = 300)]
    pub settle_timeout_s: u64,
    /// Only these fault kinds, comma-separated (default: every kind), e.g.
    /// `--kinds stale_holder_planted` for the negative controls' targeted run.
    #[arg(long, value_delimiter = ',')]
    pub kinds: Vec<String>,
    /// At most this many payouts open at a time (started, not yet settled): a long run is
    /// paced like an upstream batch instead of starting thousands of workflows at once.
    #[arg(long, default_value_t = chaos::OPEN_PAYOUTS_MAX)]
    pub open_payouts_max: usize,
    /// Keep every worker on this host's network (no namespaces, so no partition faults).
    #[arg(long)]
    pub no_partitions: bool,
    /// One JSON object instead of the readable report.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let mut config = ChaosConfig::new(args.seed, args.payouts, args.faults);
    if let Some(a) = args.accounts {
        config.accounts = a;
    }
    config.workers = args.workers;
    config.disable = DisableGuard::parse(&args.disable_guard).expect("clap checked the value");
    if let Some(s) = args.fault_window_s {
        config.fault_window = Duration::from_secs(s);
    }
    config.settle_timeout = Duration::from_secs(args.settle_timeout_s);
    config.verbose = !args.json;
    config.partitions = !args.no_partitions;
    anyhow::ensure!(
        args.open_payouts_max > 0,
        "--open-payouts-max must be positive"
    );
    config.open_payouts_max = args.open_payouts_max;
    if !args.kinds.is_empty() {
        let kinds = args
            .kinds
            .iter()
            .map(|k| {
                FaultKind::parse(k).ok_or_else(|| {
                    let known: Vec<&str> = FaultKind::ALL.iter().map(|k| k.name()).collect();
                    anyhow::anyhow!("unknown fault kind {k:?}; known: {}", known.join(", "))
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        config.kinds = Some(kinds);
    }
    let stack = tokio::task::block_in_place(|| {
        testkit::Stack::builder()
            .etcd_members(3)
            .capped_volumes(true)
            .start()
    })?;
    let report = chaos::run(&stack, &config).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.render());
    }
    // A run whose nemesis could not inject most of its faults proves little: say so, and fail.
    let injected: u64 = report.faults_injected_by_kind.values().sum();
    let enough_faults = injected as usize * 2 >= report.faults_scheduled;
    if !enough_faults {
        eprintln!(
            "only {injected} of {} faults were injected; the run is not evidence",
            report.faults_scheduled
        );
    }
    Ok(if report.is_clean() && report.settled && enough_faults {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}
