//! The operator commands (`payoutctl payout|lock|outbox`) as an operator runs them: the shipped
//! binary, against a real system (testkit: PostgreSQL, etcd, Temporal and every service as its own
//! process), addressed as a deployment (endpoints and an operator's certificate in the
//! environment), with the exit codes of `payoutctl --help`.
//!
//! Run: `cargo build --bins -p lock-server -p payment-resource -p rail-stub -p rail-proxy
//! -p general-ledger -p outbox-dispatcher -p payout-worker && cargo test -p payoutctl --test
//! operate`.

use std::process::Command;
use std::time::Duration;

use lock_client::LockClient;
use payment_client::{model::Fence, PaymentClient, PaymentError};
use payout_activities::types::PayoutInput;
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId};
use payout_workflows::client as wf;
use serde_json::Value;
use testkit::pki::Role;
use testkit::stack::PgServer;
use testkit::system::{database_name, System, SystemOptions};
use testkit::Stack;

/// A payout through every service settles in a few seconds; this bounds a test gone wrong.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(90);
/// The dispatcher delivers an outbox row (and quarantines a refused one) within a few rounds.
const OUTBOX_TIMEOUT: Duration = Duration::from_secs(60);
/// The operator whose certificate the commands present (the lock service records this name).
const OPERATOR: &str = "alice";

/// What one run of `payoutctl` did.
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not one JSON object ({e}): {self:?}"))
    }
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\nstdout: {}\nstderr: {}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// `payoutctl` with a deployment's endpoints and the operator's certificate in its environment
/// (never a password on the command line).
struct Ctl {
    env: Vec<(String, String)>,
}

impl Ctl {
    fn for_system(system: &System) -> Self {
        let stack = Stack::shared();
        let reader = |server: PgServer, url: &str| {
            stack.pg(server).login_url("reconciler", database_name(url))
        };
        let tls = system
            .pki
            .issue(Role::Operator, OPERATOR)
            .expect("the operator's certificate");
        let env = [
            (
                "PAYOUT_PAYDB_URL",
                reader(PgServer::Main, &system.databases.paydb),
            ),
            (
                "PAYOUT_PROXYDB_URL",
                reader(PgServer::Proxy, &system.databases.proxydb),
            ),
            (
                "PAYOUT_GLDB_URL",
                reader(PgServer::Main, &system.databases.gldb),
            ),
            ("PAYOUT_PAYMENT_URL", system.payment_url()),
            ("PAYOUT_PROXY_URL", system.proxy_url()),
            ("PAYOUT_LOCK_URL", system.lock_url()),
            ("TEMPORAL_ADDRESS", system.temporal_address.clone()),
            (
                "TEMPORAL_CONFIG_FILE",
                system.temporal_clients.display().to_string(),
            ),
            ("TEMPORAL_PROFILE", "operator".to_string()),
            (
                "TEMPORAL_NAMESPACE",
                testkit::temporal::NAMESPACE.to_string(),
            ),
            ("PAYOUT_TLS_CA", tls.ca.display().to_string()),
            ("PAYOUT_TLS_CERT", tls.cert.display().to_string()),
            ("PAYOUT_TLS_KEY", tls.key.display().to_string()),
            (
                "PAYOUT_OUTBOX_REPLAY_URL",
                stack
                    .pg(PgServer::Main)
                    .login_url("outbox_dispatcher", database_name(&system.databases.paydb)),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        Self { env }
    }

    fn bare() -> Self {
        Self { env: Vec::new() }
    }

    fn run(&self, args: &[&str]) -> Out {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_payoutctl"));
        // Only what this test gives: nothing of the caller's own deployment settings.
        for (name, _) in std::env::vars() {
            if name.starts_with("PAYOUT_") || name.starts_with("TEMPORAL_") {
                cmd.env_remove(name);
            }
        }
        let out = cmd
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("payoutctl runs");
        Out {
            code: out.status.code().expect("payoutctl exited"),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Runs and expects exit status `code`.
    fn expect(&self, args: &[&str], code: i32) -> Out {
        let out = self.run(args);
        assert_eq!(out.code, code, "payoutctl {args:?}: {out:?}");
        out
    }
}

impl Ctl {
    /// `payout abandon` signed by the system's registered operator and presenting that
    /// operator's own certificate (the lock service and the payment resource record only the
    /// name a certificate carries), with the key in `key_file`.
    fn abandon_as_operator(
        &self,
        system: &System,
        payout: &str,
        reason: &str,
        key_file: &std::path::Path,
    ) -> Out {
        let tls = system
            .pki
            .issue(Role::Operator, testkit::grants::OPERATOR)
            .expect("the signing operator's certificate");
        self.run(&[
            "payout",
            "abandon",
            payout,
            "--reason",
            reason,
            "--operator",
            testkit::grants::OPERATOR,
            "--key-file",
            key_file.to_str().unwrap(),
            "--tls-ca",
            tls.ca.to_str().unwrap(),
            "--tls-cert",
            tls.cert.to_str().unwrap(),
            "--tls-key",
            tls.key.to_str().unwrap(),
            "--json",
        ])
    }
}

/// What a test drives a system with besides `payoutctl`: the fixture's payment client (opens
/// accounts), Temporal (starts workflows), paydb (reads states).
struct Clients {
    fixture: PaymentClient,
    temporal: temporalio_client::Client,
    paydb: sqlx::PgPool,
}

async fn clients(system: &System) -> Clients {
    Clients {
        fixture: PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
            .await
            .unwrap(),
        temporal: wf::connect_configured(
            &wf::TemporalArgs::profile_of(&system.temporal_clients, "operator"),
            "payoutctl-tests",
        )
        .await
        .unwrap(),
        paydb: sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&system.databases.paydb)
            .await
            .unwrap(),
    }
}

fn unique(name: &str) -> String {
    Stack::shared()
        .unique_prefix(name)
        .replace(['/', ':'], "-")
        .trim_matches('-')
        .to_string()
}

fn input(payout: &str, account: &str, amount_minor: i64) -> PayoutInput {
    PayoutInput {
        payout_id: PayoutId::parse(payout).unwrap(),
        account_id: AccountId::parse(account).unwrap(),
        amount_minor: AmountMinor::new(amount_minor).unwrap(),
        currency: Currency::parse("EUR").unwrap(),
        beneficiary_ref: BeneficiaryRef::parse("ben-ops").unwrap(),
        ambiguity: Default::default(),
    }
}

/// Starts the payout's workflow; "already started" (a starter got there first) is a start too.
async fn start(temporal: &temporalio_client::Client, system: &System, input: &PayoutInput) {
    match wf::start_payout(temporal, &system.task_queue, input).await {
        Ok(_) | Err(wf::PayoutClientError::AlreadyStarted { .. }) => {}
        Err(e) => panic!("starting {}: {e}", input.payout_id),
    }
}

async fn state_of(paydb: &sqlx::PgPool, payout: &str) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM payout WHERE id = $1")
        .bind(payout)
        .fetch_optional(paydb)
        .await
        .unwrap()
}

async fn count(paydb: &sqlx::PgPool, sql: &str, bind: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(bind)
        .fetch_one(paydb)
        .await
        .unwrap()
}

fn create_args<'a>(payout: &'a str, account: &'a str, amount: &'a str) -> Vec<&'a str> {
    vec![
        "payout",
        "create",
        "--account",
        account,
        "--amount-minor",
        amount,
        "--currency",
        "EUR",
        "--beneficiary",
        "ben-ops",
        "--payout-id",
        payout,
        "--json",
    ]
}

/// Every operator command against one real system: payouts created through the CLI and paid,
/// failed and abandoned; `show` and `list` over them; the abandon Update accepted, refused and
/// carried out once an operator revoked the account's lock from a holder, which is then fenced
/// out at the guard; a quarantined outbox row listed and replayed with its audit row; bad input
/// refused with its reason and nothing changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_against_a_real_system() {
    let stack = Stack::shared();
    let system = System::start(
        stack,
        SystemOptions {
            workers: 1,
            ..SystemOptions::default()
        },
    )
    .await
    .expect("the system starts");
    let ctl = Ctl::for_system(&system);
    let Clients {
        fixture,
        temporal,
        paydb,
    } = clients(&system).await;
    let eur = Currency::parse("EUR").unwrap();
    let (paid_account, busy_account, poor_account) =
        (unique("a-paid"), unique("a-busy"), unique("a-poor"));
    for (account, balance) in [
        (&paid_account, 10_000),
        (&busy_account, 10_000),
        (&poor_account, 100),
    ] {
        system
            .operator
            .open_account(
                &fixture,
                &AccountId::parse(account.as_str()).unwrap(),
                &eur,
                balance,
            )
            .await
            .unwrap();
    }

    // --- payout create: idempotent; bad input refused with its reason, nothing created.
    let paid = unique("p-paid");
    let created = ctl
        .expect(&create_args(&paid, &paid_account, "1250"), 0)
        .json();
    assert_eq!(
        (created["state"].as_str(), created["amount_minor"].as_i64()),
        (Some("PENDING"), Some(1250)),
        "{created}"
    );
    let again = ctl
        .expect(&create_args(&paid, &paid_account, "1250"), 0)
        .json();
    assert_eq!(
        again["created_at"], created["created_at"],
        "the same payout"
    );
    let other = ctl.expect(&create_args(&paid, &paid_account, "999"), 1);
    assert!(other.stderr.contains("different content"), "{other:?}");
    let negative = unique("p-negative");
    let refused = ctl.expect(&create_args(&negative, &paid_account, "-5"), 2);
    assert!(
        refused.stderr.contains("amount must be positive, got -5"),
        "{refused:?}"
    );
    let unknown_account = ctl.expect(&create_args(&negative, "no-such-account", "5"), 1);
    assert!(
        unknown_account.stderr.contains("not found"),
        "{unknown_account:?}"
    );
    assert_eq!(state_of(&paydb, &negative).await, None, "nothing created");
    // Without --payout-id a fresh id is made and said, so that a retry can name it.
    let fresh = ctl.expect(
        &[
            "payout",
            "create",
            "--account",
            &poor_account,
            "--amount-minor",
            "1",
            "--currency",
            "EUR",
            "--beneficiary",
            "ben-ops",
            "--json",
        ],
        0,
    );
    let fresh_id = fresh.json()["payout_id"].as_str().unwrap().to_string();
    assert!(
        fresh_id.starts_with("p-")
            && fresh
                .stderr
                .contains(&format!("run again with --payout-id {fresh_id}")),
        "{fresh:?}"
    );
    assert_eq!(
        count(
            &paydb,
            "SELECT amount_minor FROM payout WHERE id = $1",
            &paid
        )
        .await,
        1250,
        "the refused create changed nothing"
    );

    // Paid, and failed for want of funds.
    let paid_input = input(&paid, &paid_account, 1250);
    start(&temporal, &system, &paid_input).await;
    let failed = unique("p-failed");
    ctl.expect(&create_args(&failed, &poor_account, "500"), 0);
    let failed_input = input(&failed, &poor_account, 500);
    start(&temporal, &system, &failed_input).await;
    for id in [&paid, &failed] {
        wf::wait_result(&temporal, &format!("payout-{id}"), SETTLE_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("{id}: {e}"));
    }
    assert_eq!(state_of(&paydb, &paid).await.as_deref(), Some("POSTED"));
    assert_eq!(state_of(&paydb, &failed).await.as_deref(), Some("FAILED"));

    // --- payout show: every store's record of the paid payout (the GL's once delivered).
    let shown = testkit::eventually(OUTBOX_TIMEOUT, "the paid payout's GL journal", || async {
        let v = ctl.expect(&["payout", "show", &paid, "--json"], 0).json();
        (v["gl_journal_lines"]
            .as_array()
            .is_some_and(|l| l.len() == 2))
        .then_some(v)
    })
    .await
    .expect("the GL holds the paid payout's journal");
    assert_eq!(shown["payout"]["state"], "POSTED");
    let path: Vec<&str> = shown["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["to_state"].as_str())
        .collect();
    assert_eq!(
        path,
        [
            "PENDING",
            "CLAIMED",
            "RAIL_SUBMITTED",
            "RAIL_ACKED",
            "POSTED"
        ],
        "{shown}"
    );
    assert_eq!(shown["submission"]["outcome"], "ACKED", "{shown}");
    assert_eq!(shown["rail"]["answer"], "found", "{shown}");
    assert_eq!(shown["rail"]["movements"].as_array().unwrap().len(), 1);
    assert_eq!(shown["rail"]["movements"][0]["amount_minor"], 1250);
    let ledger: i64 = shown["ledger"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["amount_minor"].as_i64().unwrap())
        .sum();
    assert_eq!(
        (shown["ledger"].as_array().unwrap().len(), ledger),
        (2, 0),
        "two rows summing to zero: {shown}"
    );
    assert!(
        !shown["gl_events"].as_array().unwrap().is_empty(),
        "{shown}"
    );
    let table = ctl.expect(&["payout", "show", &paid], 0).stdout;
    for section in [
        "state history",
        "audit trail",
        "rail submission (proxydb)",
        "rail movements",
        "ledger (paydb)",
        "General Ledger journals (gldb)",
        "General Ledger transaction events (gldb)",
    ] {
        assert!(table.contains(section), "{section}: {table}");
    }
    let missing = ctl.expect(&["payout", "show", "p-no-such-payout"], 1);
    assert!(
        missing.stderr.contains("no payout p-no-such-payout"),
        "{missing:?}"
    );
    let malformed = ctl.expect(&["payout", "show", "p 1;drop"], 2);
    assert!(
        malformed.stderr.contains("may contain only"),
        "{malformed:?}"
    );

    // --- the abandon Update and the lock's break-glass. A holder (not a worker) holds the busy
    // account's key, so its payout waits PENDING for the lock.
    let key = payout_domain::lock_key(&AccountId::parse(busy_account.as_str()).unwrap());
    let lock = LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let session = lock
        .open_session("stale-holder", Duration::from_secs(30))
        .await
        .unwrap();
    let grant = session
        .acquire(&key, Duration::ZERO)
        .await
        .unwrap()
        .granted()
        .expect("the key is free");
    let stale_token = grant.token().get();
    let described = ctl.expect(&["lock", "describe", &key, "--json"], 0).json();
    assert_eq!(
        (
            described["held"].as_bool(),
            described["holder"].as_str(),
            described["token"].as_u64(),
            described["session_state"].as_str()
        ),
        (
            Some(true),
            Some("stale-holder"),
            Some(stale_token),
            Some("ACTIVE")
        ),
        "{described}"
    );
    let abandoned = unique("p-abandoned");
    ctl.expect(&create_args(&abandoned, &busy_account, "700"), 0);
    start(&temporal, &system, &input(&abandoned, &busy_account, 700)).await;
    // The signing operator's own certificate (the deployment's, in the environment, is `alice`'s:
    // the break-glass calls below are hers).
    let signer_tls = system
        .pki
        .issue(Role::Operator, testkit::grants::OPERATOR)
        .expect("the signing operator's certificate");
    let (tls_ca, tls_cert, tls_key) = (
        signer_tls.ca.display().to_string(),
        signer_tls.cert.display().to_string(),
        signer_tls.key.display().to_string(),
    );
    let abandon_as_signer = |payout: &str, reason: &str| {
        ctl.run(&[
            "payout",
            "abandon",
            payout,
            "--reason",
            reason,
            "--operator",
            testkit::grants::OPERATOR,
            "--key-file",
            system.operator.key_file.to_str().unwrap(),
            "--tls-ca",
            &tls_ca,
            "--tls-cert",
            &tls_cert,
            "--tls-key",
            &tls_key,
            "--json",
        ])
    };
    let abandon = |reason: &str| abandon_as_signer(&abandoned, reason);
    let accepted = abandon("customer cancelled, ticket 7");
    assert_eq!(accepted.code, 0, "{accepted:?}");
    let answer = accepted.json();
    assert_eq!(answer["accepted"], true, "{answer}");
    // The genuine worker's answer is borne out by the payment resource's record (issue 33, the
    // control of rogue_clients.rs's an_abandon_answered_by_a_rogue_poller_is_not_confirmed).
    assert_eq!(answer["confirmation"]["agrees"], true, "{answer}");
    // The control: accepted, but nothing carries it out while the holder keeps the key.
    assert_eq!(
        state_of(&paydb, &abandoned).await.as_deref(),
        Some("PENDING"),
        "{answer}"
    );
    let second = abandon("again");
    assert_eq!(second.code, 1, "{second:?}");
    let second = second.json();
    assert_eq!(second["accepted"], false, "{second}");
    assert!(
        second["rejected"]
            .as_str()
            .is_some_and(|r| r.contains("already being carried out")),
        "{second}"
    );

    // Revoke: a key nobody holds, an operator the certificate does not carry, then the holder.
    let free = ctl.expect(
        &[
            "lock",
            "revoke",
            "payout:nobody-holds-this",
            "--reason",
            "INC-1",
            "--operator",
            OPERATOR,
        ],
        1,
    );
    assert!(free.stderr.contains("nobody holds"), "{free:?}");
    let impostor = ctl.expect(
        &[
            "lock",
            "revoke",
            &key,
            "--reason",
            "INC-1",
            "--operator",
            "mallory",
        ],
        1,
    );
    assert!(
        impostor.stderr.contains("does not carry the operator"),
        "{impostor:?}"
    );
    assert_eq!(
        ctl.expect(&["lock", "describe", &key, "--json"], 0).json()["token"].as_u64(),
        Some(stale_token),
        "the refused revokes took nothing"
    );
    let revoked = ctl
        .expect(
            &[
                "lock",
                "revoke",
                &key,
                "--reason",
                "INC-1: holder wedged",
                "--operator",
                OPERATOR,
                "--json",
            ],
            0,
        )
        .json();
    assert_eq!(
        (
            revoked["revoked_owner"].as_str(),
            revoked["revoked_token"].as_u64()
        ),
        (Some("stale-holder"), Some(stale_token)),
        "{revoked}"
    );
    // The payout's workflow takes the key with a higher token and carries the abandon out.
    wf::wait_result(&temporal, &format!("payout-{abandoned}"), SETTLE_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        state_of(&paydb, &abandoned).await.as_deref(),
        Some("ABANDONED")
    );
    // The deposed holder is fenced out at the guard.
    let worker = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let fence = Fence::new(grant.owner(), grant.token())
        .unwrap()
        .signed(grant.key(), grant.signature().clone());
    match worker
        .claim(&PayoutId::parse(abandoned.as_str()).unwrap(), &fence)
        .await
    {
        Err(PaymentError::FencedOut {
            presented, stored, ..
        }) => assert!(presented == stale_token && stored > stale_token),
        other => panic!("expected the deposed holder fenced out, got {other:?}"),
    }
    let after = ctl
        .expect(&["payout", "show", &abandoned, "--json"], 0)
        .json();
    let kinds: Vec<&str> = after["audit"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a["kind"].as_str())
        .collect();
    assert!(
        kinds.contains(&"operator_decision") && kinds.contains(&"fenced_out"),
        "show carries the decision and the fenced-out attempt: {kinds:?}"
    );
    // A terminal payout's workflow has closed: Temporal refuses the Update before any worker
    // sees it, so payoutctl records the refusal in the payment resource's audit trail itself,
    // under the operator's certified name, and says so.
    let too_late = abandon("too late");
    assert_eq!(too_late.code, 1, "{too_late:?}");
    let too_late = too_late.json();
    assert_eq!(too_late["accepted"], false, "{too_late}");
    assert_eq!(too_late["not_running"]["state"], "ABANDONED", "{too_late}");
    // The paid payout: with a certificate that is not the signing operator's, the refusal is
    // not recorded (an audit row never names someone the call could not prove it was), and
    // payoutctl says so; with the operator's own, it is.
    let posted_abandon = |tls: bool| {
        let mut args = vec![
            "payout",
            "abandon",
            paid.as_str(),
            "--reason",
            "customer cancelled after payment",
            "--operator",
            testkit::grants::OPERATOR,
            "--key-file",
            system.operator.key_file.to_str().unwrap(),
        ];
        if tls {
            args.extend([
                "--tls-ca",
                tls_ca.as_str(),
                "--tls-cert",
                tls_cert.as_str(),
                "--tls-key",
                tls_key.as_str(),
            ]);
        }
        ctl.run(&args)
    };
    let impostor = posted_abandon(false);
    assert_eq!(impostor.code, 1, "{impostor:?}");
    assert!(
        impostor
            .stderr
            .contains("the payment resource did not record the refusal")
            && impostor
                .stderr
                .contains("is not the operator the caller's certificate carries"),
        "{impostor:?}"
    );
    let decisions_of_paid = || async {
        let shown = ctl.expect(&["payout", "show", &paid, "--json"], 0).json();
        shown["audit"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["kind"] == "operator_decision")
            .cloned()
            .collect::<Vec<Value>>()
    };
    assert_eq!(decisions_of_paid().await, Vec::<Value>::new());
    let posted = posted_abandon(true);
    assert_eq!(posted.code, 1, "{posted:?}");
    assert!(
        posted.stdout.contains(&format!(
            "payout-{paid} REFUSED (the payout's workflow is not running; recorded in the payment \
             resource's audit trail"
        )) && posted.stdout.contains(&format!(
            "workflow payout-{paid} is not running (it has completed, or was never started); the \
             payout is POSTED: there is nothing to abandon"
        )),
        "{posted:?}"
    );
    let recorded = decisions_of_paid().await;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    let (owner, detail) = (&recorded[0]["owner"], &recorded[0]["detail"]);
    assert_eq!(
        owner.as_str(),
        Some(testkit::grants::OPERATOR),
        "{recorded:?}"
    );
    assert_eq!(
        (
            detail["accepted"].as_bool(),
            detail["recorded_by"].as_str(),
            detail["reason"].as_str()
        ),
        (
            Some(false),
            Some("operator"),
            Some("customer cancelled after payment")
        ),
        "{detail}"
    );
    assert!(
        detail["note"]
            .as_str()
            .is_some_and(|n| n.contains("the payout is POSTED")),
        "{detail}"
    );
    assert_eq!(
        state_of(&paydb, &paid).await.as_deref(),
        Some("POSTED"),
        "nothing changed but the record"
    );

    // --- payout list over the three states.
    let listed = ctl
        .expect(&["payout", "list", "--account", &busy_account, "--json"], 0)
        .json();
    assert_eq!(
        listed["payouts"][0]["payout_id"].as_str(),
        Some(abandoned.as_str())
    );
    assert_eq!(listed["matching"], 1);
    for (state, id) in [
        ("POSTED", &paid),
        ("FAILED", &failed),
        ("ABANDONED", &abandoned),
    ] {
        let l = ctl
            .expect(
                &[
                    "payout", "list", "--state", state, "--limit", "1000", "--json",
                ],
                0,
            )
            .json();
        let ids: Vec<&str> = l["payouts"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["payout_id"].as_str())
            .collect();
        assert!(ids.contains(&id.as_str()), "{state}: {ids:?}");
        assert!(
            l["payouts"]
                .as_array()
                .unwrap()
                .iter()
                .all(|p| p["state"] == state),
            "{l}"
        );
    }
    let page = ctl.expect(&["payout", "list", "--limit", "1"], 0).stdout;
    assert!(page.contains("payout(s) of"), "a cut page says so: {page}");

    // --- outbox quarantine: a row the GL refuses for its content (an unbalanced journal,
    // planted as the paid payout's journal under another key) is quarantined; replayed with its
    // audit row; a row that is not quarantined is refused.
    let (original_id, payload): (i64, Value) = sqlx::query_as(
        "SELECT id, payload FROM ledger_outbox WHERE kind = 'JOURNAL' AND payload->>'source_transaction_id' = $1",
    )
    .bind(&paid)
    .fetch_one(&paydb)
    .await
    .unwrap();
    let poison_key = format!("{}-poison", unique("outbox"));
    let mut poison = payload.clone();
    poison["idempotency_key"] = Value::from(poison_key.clone());
    poison["entries"][1]["amount"] = Value::from("0.01");
    let poison_id: i64 = sqlx::query_scalar(
        "INSERT INTO ledger_outbox (account_id, idempotency_key, kind, payload) \
         VALUES ($1, $2, 'JOURNAL', $3) RETURNING id",
    )
    .bind(&paid_account)
    .bind(&poison_key)
    .bind(&poison)
    .fetch_one(&paydb)
    .await
    .unwrap();
    let listed = testkit::eventually(OUTBOX_TIMEOUT, "the planted row quarantined", || async {
        let v = ctl
            .expect(&["outbox", "quarantine", "list", "--json"], 0)
            .json();
        v["quarantined"]
            .as_array()
            .unwrap()
            .iter()
            .any(|q| q["id"] == poison_id)
            .then_some(v)
    })
    .await
    .expect("the dispatcher quarantines the unbalanced journal");
    let row = listed["quarantined"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["id"] == poison_id)
        .unwrap()
        .clone();
    assert_eq!(
        (
            row["account_id"].as_str(),
            row["kind"].as_str(),
            row["payout_id"].as_str()
        ),
        (
            Some(paid_account.as_str()),
            Some("JOURNAL"),
            Some(paid.as_str())
        ),
        "{row}"
    );
    let table = ctl.expect(&["outbox", "quarantine", "list"], 0).stdout;
    assert!(
        table.starts_with("ID") && table.contains(&format!("\n{poison_id} ")),
        "{table}"
    );

    let not_quarantined = ctl.expect(
        &[
            "outbox",
            "quarantine",
            "replay",
            &original_id.to_string(),
            "--reason",
            "INC-2",
            "--operator",
            OPERATOR,
        ],
        1,
    );
    assert!(
        not_quarantined.stderr.contains("is not quarantined"),
        "{not_quarantined:?}"
    );
    assert_eq!(
        count(
            &paydb,
            "SELECT count(*) FROM outbox_replay WHERE outbox_id = $1::text::bigint",
            &original_id.to_string()
        )
        .await,
        0,
        "a refused replay records nothing"
    );
    // Issue 17: the replay is recorded under the operator the certificate carries; another
    // name is refused by the payment resource and nothing is released or recorded.
    let impostor = ctl.expect(
        &[
            "outbox",
            "quarantine",
            "replay",
            &poison_id.to_string(),
            "--reason",
            "INC-2",
            "--operator",
            "mallory",
        ],
        1,
    );
    assert!(
        impostor.stderr.contains("does not carry the operator"),
        "{impostor:?}"
    );
    assert_eq!(
        count(
            &paydb,
            "SELECT count(*) FROM outbox_replay WHERE outbox_id = $1::text::bigint",
            &poison_id.to_string()
        )
        .await,
        0,
        "an impostor's replay records nothing"
    );
    let still: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT quarantined_at FROM ledger_outbox WHERE id = $1")
            .bind(poison_id)
            .fetch_one(&paydb)
            .await
            .unwrap();
    assert!(still.is_some(), "an impostor's replay releases nothing");
    let replayed = ctl
        .expect(
            &[
                "outbox",
                "quarantine",
                "replay",
                &poison_id.to_string(),
                "--reason",
                "INC-2: GL fix deployed",
                "--operator",
                OPERATOR,
                "--json",
            ],
            0,
        )
        .json();
    assert_eq!(
        (
            replayed["outbox_id"].as_i64(),
            replayed["operator"].as_str(),
            replayed["reason"].as_str()
        ),
        (
            Some(poison_id),
            Some(OPERATOR),
            Some("INC-2: GL fix deployed")
        ),
        "{replayed}"
    );
    assert!(
        replayed["last_error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "the record keeps the error it was quarantined with: {replayed}"
    );
    assert_eq!(
        count(
            &paydb,
            "SELECT count(*) FROM outbox_replay WHERE outbox_id = $1::text::bigint",
            &poison_id.to_string()
        )
        .await,
        1
    );
}

/// A part that does not answer exits 3 ("could not connect"), with what it tried; nothing else
/// is attempted.
#[test]
fn an_unreachable_deployment_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let pki = testkit::pki::Pki::in_dir(dir.path()).unwrap();
    let tls = pki.issue(Role::Operator, OPERATOR).unwrap();
    let port = testkit::free_port().to_string();
    let ctl = Ctl::bare();
    let db = ctl.expect(
        &[
            "payout",
            "list",
            "--paydb-url",
            &format!("postgres://reconciler@127.0.0.1:{port}/paydb"),
        ],
        3,
    );
    assert!(db.stderr.contains("could not connect to paydb"), "{db:?}");
    let lock = ctl.expect(
        &[
            "lock",
            "describe",
            "payout:a-1",
            "--lock-url",
            &format!("https://127.0.0.1:{port}"),
            "--tls-ca",
            tls.ca.to_str().unwrap(),
            "--tls-cert",
            tls.cert.to_str().unwrap(),
            "--tls-key",
            tls.key.to_str().unwrap(),
        ],
        3,
    );
    assert!(
        lock.stderr
            .contains("could not connect to the lock service"),
        "{lock:?}"
    );
    let no_stack = ctl.expect(
        &[
            "outbox",
            "quarantine",
            "list",
            "--state-dir",
            dir.path().join("no-stack").to_str().unwrap(),
        ],
        3,
    );
    assert!(no_stack.stderr.contains("no stack record"), "{no_stack:?}");
    // The existing commands keep the same scheme.
    let dead_db = format!("postgres://reconciler@127.0.0.1:{port}/paydb");
    let status = ctl.expect(
        &[
            "restore",
            "status",
            "--paydb-url",
            &dead_db,
            "--proxydb-url",
            &dead_db,
        ],
        3,
    );
    assert!(status.stdout.contains("cannot check"), "{status:?}");
    let dead_service = format!("https://127.0.0.1:{port}");
    let (ca, cert, key) = (
        tls.ca.to_str().unwrap(),
        tls.cert.to_str().unwrap(),
        tls.key.to_str().unwrap(),
    );
    let reconcile = ctl.expect(
        &[
            "reconcile",
            "--paydb-url",
            &dead_db,
            "--proxydb-url",
            &dead_db,
            "--gldb-url",
            &dead_db,
            "--rail-url",
            &format!("http://127.0.0.1:{port}"),
            "--payment-url",
            &dead_service,
            "--proxy-url",
            &dead_service,
            "--temporal-address",
            &format!("127.0.0.1:{port}"),
            "--etcd-endpoints",
            &dead_service,
            "--tls-ca",
            ca,
            "--tls-cert",
            cert,
            "--tls-key",
            key,
            "--etcd-tls-ca",
            ca,
            "--etcd-tls-cert",
            cert,
            "--etcd-tls-key",
            key,
        ],
        3,
    );
    assert!(
        reconcile.stderr.contains("could not connect"),
        "{reconcile:?}"
    );
    // Usage: clap's own code.
    ctl.expect(&["payout", "list", "--state", "PAID"], 2);
}

/// The resolution SLA of the orphaned-ambiguous test (the payment resource's and the runs'):
/// long enough that the first abandon, right after the payout became ambiguous and its workflow
/// was terminated, comes before it (the test checks it had the margin), short enough to wait
/// out.
const ORPHAN_SLA_MS: u64 = 40_000;
/// The rail's settlement window in that test: it answers UNKNOWN about the payout for far longer
/// than the test runs, so only an operator can finish it.
const RAIL_UNKNOWN_MS: u64 = 900_000;
/// The first run's settlement window: it waits far longer than the test before it would ask.
const FIRST_RUN_WINDOW_MS: u64 = 900_000;
/// The window a run started again by `payout abandon` waits between its inquiries.
const RESUMED_WINDOW_MS: u64 = 2_000;

/// Terminates a payout's workflow with the `temporal` CLI, as an operator would.
fn terminate(workflow_id: &str) -> anyhow::Result<String> {
    Stack::shared().temporal().cli(&[
        "workflow",
        "terminate",
        "--namespace",
        testkit::temporal::NAMESPACE,
        "--workflow-id",
        workflow_id,
        "--reason",
        "operator terminates the workflow (test)",
    ])
}

/// Issue 35, item 3: a RAIL_AMBIGUOUS payout whose workflow ended (the rail keeps answering
/// UNKNOWN) is abandoned by `payoutctl payout abandon` past its SLA: before the SLA it is
/// refused with the SLA's end, nothing started; past it, the command takes the account's key over
/// from the dead run's grant, starts the workflow again as the resume pass does and sends the
/// signed Update, so the payout ends ABANDONED through the fenced path with the audit rows naming
/// the operator. A forged signature goes the same way and is refused by the payment resource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_payout_whose_workflow_ended_is_abandoned_past_its_sla() {
    let stack = Stack::shared();
    let system = System::start(
        stack,
        SystemOptions {
            workers: 1,
            settlement_window_ms: RAIL_UNKNOWN_MS,
            rail_timeout_ms: 2_000,
            resolution_sla_ms: Some(ORPHAN_SLA_MS),
            ..SystemOptions::default()
        },
    )
    .await
    .expect("the system starts");
    let mut ctl = Ctl::for_system(&system);
    for (name, value) in [
        ("PAYOUT_TASK_QUEUE", system.task_queue.clone()),
        ("PAYOUT_RESOLUTION_SLA_MS", ORPHAN_SLA_MS.to_string()),
        ("PAYOUT_SETTLEMENT_WINDOW_MS", RESUMED_WINDOW_MS.to_string()),
    ] {
        ctl.env.push((name.to_string(), value));
    }
    let Clients {
        fixture,
        temporal,
        paydb,
    } = clients(&system).await;
    let (account, payout) = (unique("a-orphan"), unique("p-orphan"));
    system
        .operator
        .open_account(
            &fixture,
            &AccountId::parse(account.as_str()).unwrap(),
            &Currency::parse("EUR").unwrap(),
            10_000,
        )
        .await
        .unwrap();
    ctl.expect(&create_args(&payout, &account, "700"), 0);
    // The rail answers 503 without acting: the proxy records TIMEOUT, the payout is ambiguous,
    // and the rail says UNKNOWN about it for the whole test.
    let reference =
        payout_domain::ClientReference::for_payout(&PayoutId::parse(payout.as_str()).unwrap())
            .to_string();
    rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .expect("the harness's rail client")
        .force(&reference, Some(rail_stub::FaultMode::FailBeforeActing))
        .await
        .unwrap();
    let mut first = input(&payout, &account, 700);
    first.ambiguity = payout_activities::types::AmbiguityPolicy {
        settlement_window_ms: FIRST_RUN_WINDOW_MS,
        resolution_sla_ms: ORPHAN_SLA_MS,
    };
    start(&temporal, &system, &first).await;
    let workflow_id = format!("payout-{payout}");
    testkit::eventually(SETTLE_TIMEOUT, "the payout is RAIL_AMBIGUOUS", || async {
        (state_of(&paydb, &payout).await.as_deref() == Some("RAIL_AMBIGUOUS")).then_some(())
    })
    .await
    .unwrap();
    terminate(&workflow_id).expect("the first run is terminated");
    let sla_passed = || async {
        sqlx::query_scalar::<_, Option<bool>>(
            "SELECT min(at) + $2 * interval '1 millisecond' <= now() FROM audit_event \
             WHERE payout_id = $1 AND kind = 'transition' AND to_state = 'RAIL_AMBIGUOUS'",
        )
        .bind(&payout)
        .bind(ORPHAN_SLA_MS as i64)
        .fetch_one(&paydb)
        .await
        .unwrap()
        .expect("an entry into RAIL_AMBIGUOUS is recorded")
    };
    let key_file = system.operator.key_file.clone();

    // Before the SLA: refused with its end, recorded, nothing started.
    let early = ctl.abandon_as_operator(&system, &payout, "finance ticket 1", &key_file);
    assert!(
        !sla_passed().await,
        "the test's margin: the first abandon ran before the SLA ({ORPHAN_SLA_MS} ms) passed"
    );
    assert_eq!(
        state_of(&paydb, &payout).await.as_deref(),
        Some("RAIL_AMBIGUOUS")
    );
    testkit::eventually(
        Duration::from_millis(ORPHAN_SLA_MS) + SETTLE_TIMEOUT,
        "the resolution SLA passes",
        || async { sla_passed().await.then_some(()) },
    )
    .await
    .unwrap();

    // Past the SLA, a forged signature (a key the payment resource does not know under the
    // operator's name): the run is started again, the decision refused by the payment resource.
    let dir = tempfile::tempdir().unwrap();
    let forged_key = dir.path().join("forged.key");
    ctl.expect(
        &[
            "keys",
            "operator",
            "--name",
            testkit::grants::OPERATOR,
            "--out",
            forged_key.to_str().unwrap(),
        ],
        0,
    );
    let forged = ctl.abandon_as_operator(&system, &payout, "finance ticket 2", &forged_key);
    assert_eq!(
        state_of(&paydb, &payout).await.as_deref(),
        Some("RAIL_AMBIGUOUS"),
        "a forged decision changes nothing: {forged:?}"
    );
    // Its run ended again (terminated, holding the key under a higher token).
    let _ = terminate(&workflow_id);

    // Past the SLA, the operator's own signature: ABANDONED through the one fenced path.
    let genuine = ctl.abandon_as_operator(&system, &payout, "finance ticket 3", &key_file);
    assert_eq!(genuine.code, 0, "{genuine:?}");
    let answer = genuine.json();
    assert_eq!(
        (
            answer["accepted"].as_bool(),
            answer["answer"]["outcome"].as_str(),
            answer["resumed"]["started"].as_bool(),
            answer["resumed"]["took_over_from"]
                .as_str()
                .is_some_and(|from| from.ends_with(&format!("/{payout}"))),
        ),
        (Some(true), Some("abandoned"), Some(true), true),
        "{answer}"
    );
    assert_eq!(
        state_of(&paydb, &payout).await.as_deref(),
        Some("ABANDONED")
    );
    let shown = ctl.expect(&["payout", "show", &payout, "--json"], 0).json();
    let audit = shown["audit"].as_array().unwrap();
    let abandoned = audit
        .iter()
        .find(|a| a["kind"] == "transition" && a["to_state"] == "ABANDONED")
        .unwrap_or_else(|| panic!("a transition to ABANDONED: {audit:?}"));
    assert_eq!(
        abandoned["detail"]["operator"].as_str(),
        Some(testkit::grants::OPERATOR),
        "{abandoned}"
    );
    assert!(
        abandoned["token"].as_i64().is_some(),
        "carried out under a grant: {abandoned}"
    );
    let accepted_decision = audit.iter().any(|a| {
        a["kind"] == "operator_decision"
            && a["owner"] == testkit::grants::OPERATOR
            && a["detail"]["accepted"] == true
            && a["detail"]["reason"] == "finance ticket 3"
    });
    assert!(
        accepted_decision,
        "the decision names the operator: {audit:?}"
    );

    // The early refusal said why and when, and started nothing.
    assert_eq!(early.code, 1, "{early:?}");
    let early = early.json();
    assert!(
        early["resumed"].is_null()
            && early["not_running"]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("resolution SLA") && r.contains("ends at")),
        "{early}"
    );
    // The forged one was refused by the payment resource, after the command started the run.
    assert_eq!(forged.code, 1, "{forged:?}");
    let forged = forged.json();
    assert_eq!(
        (
            forged["accepted"].as_bool(),
            forged["resumed"]["started"].as_bool(),
        ),
        (Some(false), Some(true)),
        "{forged}"
    );
    let refused_forged = audit.iter().any(|a| {
        a["kind"] == "operator_not_verified"
            || (a["kind"] == "operator_decision"
                && a["detail"]["reason"] == "finance ticket 2"
                && a["detail"]["accepted"] == false)
    });
    assert!(
        refused_forged,
        "the forged decision is on record as refused: {audit:?}"
    );
}

/// `payout list --oldest-first --older-than`: only payouts created longer ago than the age, the
/// oldest first; without the flags, every payout newest first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payout_list_sorts_oldest_first_and_filters_by_age() {
    /// The age the listing filters by: the older payouts are waited until at least this old.
    const AGE_S: u64 = 8;
    let system = System::start(
        Stack::shared(),
        SystemOptions {
            workers: 1,
            ..SystemOptions::default()
        },
    )
    .await
    .expect("the system starts");
    let ctl = Ctl::for_system(&system);
    let Clients { fixture, paydb, .. } = clients(&system).await;
    let account = unique("a-ages");
    system
        .operator
        .open_account(
            &fixture,
            &AccountId::parse(account.as_str()).unwrap(),
            &Currency::parse("EUR").unwrap(),
            10_000,
        )
        .await
        .unwrap();
    let (old1, old2, young) = (unique("p-old1"), unique("p-old2"), unique("p-young"));
    for id in [&old1, &old2] {
        ctl.expect(&create_args(id, &account, "100"), 0);
    }
    let age_of = |id: String| {
        let paydb = paydb.clone();
        async move {
            sqlx::query_scalar::<_, f64>(
                "SELECT extract(epoch FROM now() - created_at)::float8 FROM payout WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&paydb)
            .await
            .unwrap()
        }
    };
    testkit::eventually(
        SETTLE_TIMEOUT,
        "the older payouts are old enough",
        || async { (age_of(old2.clone()).await > AGE_S as f64 + 1.0).then_some(()) },
    )
    .await
    .unwrap();
    ctl.expect(&create_args(&young, &account, "100"), 0);
    let ids = |listed: &Value| -> Vec<String> {
        listed["payouts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["payout_id"].as_str().unwrap().to_string())
            .collect()
    };
    let age = format!("{AGE_S}s");
    let filtered = ctl
        .expect(
            &[
                "payout",
                "list",
                "--account",
                &account,
                "--older-than",
                &age,
                "--oldest-first",
                "--json",
            ],
            0,
        )
        .json();
    assert!(
        age_of(young.clone()).await < AGE_S as f64,
        "the test's margin: the young payout was younger than {AGE_S} s when listed"
    );
    assert_eq!(ids(&filtered), [old1.clone(), old2.clone()], "{filtered}");
    let newest_first = ctl
        .expect(
            &[
                "payout",
                "list",
                "--account",
                &account,
                "--older-than",
                &age,
                "--json",
            ],
            0,
        )
        .json();
    assert_eq!(
        ids(&newest_first),
        [old2.clone(), old1.clone()],
        "{newest_first}"
    );
    let all = ctl
        .expect(
            &[
                "payout",
                "list",
                "--account",
                &account,
                "--oldest-first",
                "--json",
            ],
            0,
        )
        .json();
    assert_eq!(ids(&all), [old1, old2, young], "{all}");
    let bad = ctl.expect(&["payout", "list", "--older-than", "soon"], 2);
    assert!(bad.stderr.contains("is not an age"), "{bad:?}");
}
