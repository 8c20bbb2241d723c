//! Test-only stall points, as a [`Backend`] in front of the worker's real one. The shipped worker
//! has none: the fault tests run `payout-test-worker` (src/bin), which is the shipped worker with
//! this wrapper around its backend, and nothing else different.
//!
//! `PAYOUT_TEST_STALL_AFTER_CHECK=<identity>:<step>:<payout_id>:<ms>[,...]` makes the worker
//! whose identity matches wait `ms`, once, after its grant check passed and before the guard call
//! of `step` (`mark_submitted`, `submit` or `post`) for that payout. That is the window the
//! conservative local deadline narrows but cannot close; a test freezes the worker inside it to
//! show the guards (not the lease check) refusing the stale token. It changes no decision and
//! disables nothing.
//!
//! The same stall can be armed while the workers run, for whichever payout reaches the step
//! first: with `PAYOUT_TEST_STALL_DIR=<dir>`, a file `<dir>/<step>.armed` holding `<ms>` is taken
//! by the first worker whose check for `step` passes (an atomic rename to
//! `<step>.taken.<identity>.<payout_id>`, so exactly one worker of all takes it). The taker writes
//! the token it checked to `<step>.token.<payout_id>`, waits until the harness creates
//! `<step>.release.<payout_id>` (at most `ms`: the harness releases it once a successor's write
//! has reached the guard, so the call is stale by what happened, not by a guess at timing), makes
//! its call, and writes the guard's answer to `<step>.answer.<payout_id>`. The chaos nemesis arms
//! it to plant a stale holder in a running system.
//!
//! In the same directory, a file `inquire.failing` makes every rail lookup fail (a transient
//! error) until `inquire.release.<payout_id>` exists, the first failure noted in
//! `inquire.failed.<payout_id>`: a run asking about an ambiguous payout then has no answer of the
//! rail's for as long as the harness needs (`services/reconciler/tests/resumed_abandon.rs`).
//!
//! Where the wait sits: `PayoutActivities` checks the grant (`Backend::check_held`) and then calls
//! the backend; this wrapper is the backend it calls, so the wait falls between the check and the
//! guard call, as a worker paused by the operating system at that instant would.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use payout_activities::backend::{Answer, Backend};
use payout_activities::refusal::{ActivityFailure, Refusal};
use payout_activities::types::*;
use payout_domain::{FencingToken, PayoutId};

/// The variable naming stall points; a deployment never sets it (and the shipped worker does
/// not read it).
pub const STALL_ENV: &str = "PAYOUT_TEST_STALL_AFTER_CHECK";
/// `PAYOUT_TEST_LOSE_ANSWER=<step>:<payout_id>[,...]`: the first call of `step` (`claim`,
/// `mark_submitted`, `record_outcome`, `post`, `abandon`) for that payout is made, the guard
/// commits it, and its answer is replaced by a transient error, as a connection reset after the
/// COMMIT or a local-activity timeout would lose it. Once per step and payout; the retry gets
/// the guard's answer. A deployment never sets it.
pub const LOSE_ANSWER_ENV: &str = "PAYOUT_TEST_LOSE_ANSWER";
/// The variable naming the directory of armed stall points.
pub const STALL_DIR_ENV: &str = "PAYOUT_TEST_STALL_DIR";
/// A planted call that fails transiently is made again for at most this long, this often.
const PLANTED_RETRY_MAX: Duration = Duration::from_secs(20);
const PLANTED_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// An armed stall looks for its release this often.
const STALL_RELEASE_POLL: Duration = Duration::from_millis(50);

/// The worker's backend with the stall points of the environment in front of three guard calls
/// (and the failing rail lookup, [`StallPoints::failing_lookup`]).
pub struct StallingBackend {
    inner: Arc<dyn Backend>,
    stalls: StallPoints,
    lost: LostAnswers,
}

impl StallingBackend {
    /// The stall points the environment names for the worker `identity`.
    pub fn from_env(inner: Arc<dyn Backend>, identity: &str) -> Self {
        Self {
            inner,
            stalls: StallPoints::from_env(identity),
            lost: LostAnswers::from_env(),
        }
    }
}

impl Backend for StallingBackend {
    fn acquire(
        &self,
        input: AcquireInput,
        wait: std::time::Duration,
    ) -> Answer<'_, AcquireOutcome> {
        self.inner.acquire(input, wait)
    }
    fn check_held(&self, grant: &Grant) -> Result<(), Refusal> {
        self.inner.check_held(grant)
    }
    fn task_queue(&self) -> String {
        self.inner.task_queue()
    }
    fn release(&self, grant: Grant) -> Answer<'_, ()> {
        self.inner.release(grant)
    }
    fn get_payout(&self, payout_id: PayoutId) -> Answer<'_, PayoutSnapshot> {
        self.inner.get_payout(payout_id)
    }
    fn claim(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot> {
        Box::pin(async move {
            let payout_id = input.payout_id.clone();
            let answer = self.inner.claim(input).await;
            self.lost.maybe_lose("claim", &payout_id, answer)
        })
    }
    fn mark_submitted(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot> {
        Box::pin(async move {
            let plant = self
                .stalls
                .stall("mark_submitted", &input.payout_id, input.grant.token)
                .await;
            let payout_id = input.payout_id.clone();
            let answer = plant
                .call(|| self.inner.mark_submitted(input.clone()))
                .await;
            plant.report(&answer, |_| "accepted".to_string());
            self.lost.maybe_lose("mark_submitted", &payout_id, answer)
        })
    }
    fn record_outcome(&self, input: RecordOutcomeInput) -> Answer<'_, PayoutSnapshot> {
        Box::pin(async move {
            let payout_id = input.payout_id.clone();
            let answer = self.inner.record_outcome(input).await;
            self.lost.maybe_lose("record_outcome", &payout_id, answer)
        })
    }
    fn post(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot> {
        Box::pin(async move {
            let _ = self
                .stalls
                .stall("post", &input.payout_id, input.grant.token)
                .await;
            let payout_id = input.payout_id.clone();
            let answer = self.inner.post(input).await;
            self.lost.maybe_lose("post", &payout_id, answer)
        })
    }
    fn resolve(&self, input: ResolveInput) -> Answer<'_, PayoutSnapshot> {
        self.inner.resolve(input)
    }
    fn abandon(&self, input: AbandonInput) -> Answer<'_, PayoutSnapshot> {
        Box::pin(async move {
            let payout_id = input.payout_id.clone();
            let answer = self.inner.abandon(input).await;
            self.lost.maybe_lose("abandon", &payout_id, answer)
        })
    }
    fn record_operator_decision(
        &self,
        input: OperatorDecisionInput,
    ) -> Answer<'_, RecordedDecision> {
        self.inner.record_operator_decision(input)
    }
    fn submit(&self, input: SubmitInput) -> Answer<'_, SubmitAnswer> {
        Box::pin(async move {
            let plant = self
                .stalls
                .stall("submit", &input.payout_id, input.grant.token)
                .await;
            let answer = plant.call(|| self.inner.submit(input.clone())).await;
            plant.report(&answer, |a| {
                match a {
                    SubmitAnswer::Acked { .. } => "accepted: acked",
                    SubmitAnswer::Declined { .. } => "accepted: declined",
                    SubmitAnswer::Ambiguous { .. } => "accepted: ambiguous",
                }
                .to_string()
            });
            answer
        })
    }
    fn inquire(&self, input: InquireInput) -> Answer<'_, Inquiry> {
        Box::pin(async move {
            if let Some(failure) = self.stalls.failing_lookup(&input.payout_id) {
                return Err(failure);
            }
            self.inner.inquire(input).await
        })
    }
}

/// The answers [`LOSE_ANSWER_ENV`] names, each lost once.
#[derive(Default)]
struct LostAnswers {
    points: Vec<(String, String)>,
    lost: Mutex<std::collections::HashSet<(String, String)>>,
}

impl LostAnswers {
    fn from_env() -> Self {
        let points = std::env::var(LOSE_ANSWER_ENV)
            .unwrap_or_default()
            .split(',')
            .filter_map(|p| {
                let (step, payout) = p.trim().split_once(':')?;
                Some((step.to_string(), payout.to_string()))
            })
            .collect();
        Self {
            points,
            lost: Mutex::default(),
        }
    }

    /// `answer`, or, the first time `step` answers for `payout_id` with success, a transient
    /// error in its place: the guard committed, the caller never hears it.
    fn maybe_lose<T>(
        &self,
        step: &str,
        payout_id: &PayoutId,
        answer: Result<T, ActivityFailure>,
    ) -> Result<T, ActivityFailure> {
        let point = (step.to_string(), payout_id.to_string());
        if answer.is_err() || !self.points.contains(&point) {
            return answer;
        }
        let first = self
            .lost
            .lock()
            .map(|mut lost| lost.insert(point))
            .unwrap_or(false);
        if !first {
            return answer;
        }
        tracing::warn!(step, payout_id = %payout_id, "test: the guard committed; its answer is lost");
        Err(ActivityFailure::Transient(format!(
            "test: the answer of {step} for {payout_id} was lost after the guard committed"
        )))
    }
}

#[derive(Default)]
struct StallPoints {
    points: Vec<(String, String, u64)>,
    fired: Mutex<std::collections::HashSet<(String, String)>>,
    armed_dir: Option<(std::path::PathBuf, String)>,
}

/// A stall taken from the armed directory: where the guard's answer is reported.
#[must_use]
#[derive(Default)]
struct PlantedCall {
    answer_file: Option<std::path::PathBuf>,
}

impl PlantedCall {
    /// Makes the call; a planted one is made again on a transient failure (its guard's database
    /// restarting under another fault, say), as the stale holder's own retry would, for at most
    /// [`PLANTED_RETRY_MAX`]: what the harness waits for is the guard's decision.
    async fn call<T, F, Fut>(&self, mut call: F) -> Result<T, ActivityFailure>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ActivityFailure>>,
    {
        let give_up = std::time::Instant::now() + PLANTED_RETRY_MAX;
        loop {
            let answer = call().await;
            match &answer {
                Err(ActivityFailure::Transient(e))
                    if self.answer_file.is_some() && std::time::Instant::now() < give_up =>
                {
                    tracing::warn!(error = %e, "test stall point (armed): the planted call failed transiently; made again");
                    tokio::time::sleep(PLANTED_RETRY_PAUSE).await;
                }
                _ => return answer,
            }
        }
    }

    /// Writes how the guard answered the planted call: `accepted[: detail]`, or the refusal's
    /// kind.
    fn report<T>(&self, answer: &Result<T, ActivityFailure>, accepted: impl FnOnce(&T) -> String) {
        let Some(path) = &self.answer_file else {
            return;
        };
        let what = match answer {
            Ok(t) => accepted(t),
            Err(ActivityFailure::Refused(r)) => match r {
                Refusal::FencedOut { .. } => "fenced_out".to_string(),
                Refusal::DuplicateSubmission { .. } => "duplicate".to_string(),
                Refusal::RefusedTransition { .. } => "refused_transition".to_string(),
                other => format!("refused: {other}"),
            },
            Err(ActivityFailure::Transient(e)) => format!("error: {e}"),
        };
        tracing::warn!(answer = %what, "test stall point (armed): the guard answered the planted call");
        write_atomically(path, &what);
    }
}

/// Writes `text` to `path` so that a reader sees all of it or nothing (a rename).
fn write_atomically(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path)) {
        tracing::error!(path = %path.display(), error = %e, "test stall point: cannot write");
    }
}

impl StallPoints {
    fn from_env(identity: &str) -> Self {
        let armed_dir = std::env::var_os(STALL_DIR_ENV)
            .map(|dir| (std::path::PathBuf::from(dir), identity.to_string()));
        let Ok(spec) = std::env::var(STALL_ENV) else {
            return Self {
                armed_dir,
                ..Self::default()
            };
        };
        let points = spec
            .split(',')
            .filter_map(|p| {
                let parts: Vec<&str> = p.trim().split(':').collect();
                match parts.as_slice() {
                    [who, step, payout, ms] if *who == identity => {
                        Some((step.to_string(), payout.to_string(), ms.parse().ok()?))
                    }
                    _ => None,
                }
            })
            .collect();
        Self {
            points,
            fired: Mutex::default(),
            armed_dir,
        }
    }

    /// Takes the armed stall point of `step`, if there is one and no other worker took it first:
    /// the longest wait for the release, and the directory.
    fn take_armed(&self, step: &str, payout: &PayoutId) -> Option<(u64, &std::path::Path)> {
        let (dir, identity) = self.armed_dir.as_ref()?;
        let armed = dir.join(format!("{step}.armed"));
        let ms = std::fs::read_to_string(&armed).ok()?.trim().parse().ok()?;
        let taken = dir.join(format!("{step}.taken.{identity}.{payout}"));
        std::fs::rename(&armed, &taken).ok()?;
        Some((ms, dir))
    }

    /// With `<dir>/inquire.failing` in the armed directory, a rail lookup for `payout` fails as
    /// a transient error (as with the proxy unreachable) until the harness creates
    /// `<dir>/inquire.release.<payout>`; the first failure writes `<dir>/inquire.failed.<payout>`.
    /// Unlike a held call, a failing one leaves the run's workflow tasks free (a held local
    /// step keeps its workflow task open, so the run answers no Update meanwhile), and the run
    /// gets no answer of the rail's.
    fn failing_lookup(&self, payout: &PayoutId) -> Option<ActivityFailure> {
        let (dir, _) = self.armed_dir.as_ref()?;
        if !dir.join("inquire.failing").exists()
            || dir.join(format!("inquire.release.{payout}")).exists()
        {
            return None;
        }
        let failed = dir.join(format!("inquire.failed.{payout}"));
        if !failed.exists() {
            write_atomically(&failed, "failing");
        }
        tracing::warn!(payout_id = %payout, "test: the rail lookup fails until the harness releases it");
        Some(ActivityFailure::Transient(format!(
            "test: the rail lookup for {payout} fails until released"
        )))
    }

    async fn stall(&self, step: &str, payout: &PayoutId, token: FencingToken) -> PlantedCall {
        if let Some((ms, dir)) = self.take_armed(step, payout) {
            write_atomically(
                &dir.join(format!("{step}.token.{payout}")),
                &token.get().to_string(),
            );
            tracing::warn!(step, payout_id = %payout, token = token.get(), max_ms = ms, "test stall point (armed): waiting after the grant check for the harness's release");
            let release = dir.join(format!("{step}.release.{payout}"));
            let give_up = tokio::time::Instant::now() + Duration::from_millis(ms);
            while !release.exists() && tokio::time::Instant::now() < give_up {
                tokio::time::sleep(STALL_RELEASE_POLL).await;
            }
            tracing::warn!(step, payout_id = %payout, released = release.exists(), "test stall point (armed): continuing to the guard");
            return PlantedCall {
                answer_file: Some(dir.join(format!("{step}.answer.{payout}"))),
            };
        }
        let Some((_, _, ms)) = self
            .points
            .iter()
            .find(|(s, p, _)| s == step && p == payout.as_str())
        else {
            return PlantedCall::default();
        };
        if !self
            .fired
            .lock()
            .expect("stall points")
            .insert((step.to_string(), payout.to_string()))
        {
            return PlantedCall::default();
        }
        tracing::warn!(step, payout_id = %payout, stall_ms = ms, "test stall point: waiting after the grant check");
        tokio::time::sleep(Duration::from_millis(*ms)).await;
        tracing::warn!(step, payout_id = %payout, "test stall point: continuing to the guard");
        PlantedCall::default()
    }
}
