//! The walk both corrective passes take over paydb's open payouts: a keyset on
//! `(created_at, id)` (oldest first, read through the non-terminal payouts' partial index) that
//! starts after a [`Cursor`] left by the pass before, reads a page at a time, and at the end of
//! the open payouts wraps to the oldest and goes on up to where it began, so that one pass
//! examines each open payout at most once.
//!
//! A pass stops at its bound ([`PassBounds`]): `per_pass` candidates acted on (a payout that may
//! need the pass: its workflow is not running), or `examine_max` payouts examined (a Temporal
//! describe each), or every open payout examined once. A payout whose workflow runs is examined
//! but is no candidate, so it costs the pass a describe and never a place in its bound: the
//! first `per_pass` payouts by age can no longer hide whatever sorts after them (issue 35,
//! item 4).
//!
//! **The bound.** Each pass examines at least `per_pass` payouts unless it examined every open
//! payout, and begins where the pass before stopped, so a payout open all along is examined
//! within `ceil(N / per_pass)` passes of one process, N being the most payouts open meanwhile
//! (with 500 per pass and 10,000 open: 20 passes, 100 minutes on the 300 s schedule, and far
//! fewer when few of them are candidates). The cursor lives in the process
//! (`reconciler serve` keeps it across its scheduled runs); a restarted process, or a one-off
//! `reconciler once`, begins again at the oldest, which is still within the same bound.

use std::collections::VecDeque;

use sqlx::postgres::PgRow;
use sqlx::types::chrono::{DateTime, Utc};
use sqlx::{FromRow, PgPool};

/// Rows read from paydb per query of a walk: one page of open payouts. Small enough to hold in
/// memory at once, large enough that a pass over thousands of open payouts is a few queries.
pub const WALK_PAGE_ROWS: i64 = 500;
/// Candidates acted on per pass by default (`--corrective-per-pass`): one pass's writes and
/// starts stay a few minutes' work inside the run's 600 s start-to-close.
pub const PER_PASS_DEFAULT: usize = 500;
/// Payouts examined per pass at most (a Temporal describe each, a few milliseconds): 5,000
/// describes are well under a minute even on a loaded Temporal, inside the run's 600 s
/// start-to-close, while a pass whose open payouts are nearly all running still moves its
/// cursor by thousands.
pub const EXAMINE_PER_PASS_MAX: usize = 5_000;

/// A position in the walk's order: `(created_at, id)`, compared as paydb orders them (`id`
/// under the "C" collation, byte order, which is `String`'s).
pub type Position = (DateTime<Utc>, String);

/// Where the last pass of one process stopped: the last payout it examined. `None` is the start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cursor {
    pub last: Option<Position>,
}

/// How much one pass may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassBounds {
    /// Candidates acted on per pass (resumed, resolved, or failed trying).
    pub per_pass: usize,
    /// Payouts examined per pass, candidates or not; never below `per_pass`.
    pub examine_max: usize,
}

impl PassBounds {
    pub fn per_pass(per_pass: usize) -> Self {
        Self {
            per_pass: per_pass.max(1),
            examine_max: EXAMINE_PER_PASS_MAX.max(per_pass),
        }
    }
}

impl Default for PassBounds {
    fn default() -> Self {
        Self::per_pass(PER_PASS_DEFAULT)
    }
}

/// A row a walk reads: its first two columns are `created_at` and `id`.
pub(crate) trait Positioned {
    fn position(&self) -> Position;
}

/// How far a pass went (reported with what it did).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Progress {
    /// Payouts examined (described) this pass.
    pub examined: usize,
    /// Whether this pass reached the end of the open payouts and began again at the oldest.
    pub wrapped: bool,
    /// Whether this pass examined every open payout once (nothing was left for a later pass).
    pub complete: bool,
}

/// One pass's walk. `sql` takes `$1` (the last position's `created_at`, NULL at the start),
/// `$2` (its id) and `$3` (the page size), and orders by `created_at, id COLLATE "C"`.
pub(crate) struct Walk<'a, T> {
    paydb: &'a PgPool,
    sql: &'static str,
    /// Where this pass began: after a wrap, the walk ends past it.
    began_after: Option<Position>,
    /// The last position handed out (the next page begins after it).
    after: Option<Position>,
    page: VecDeque<T>,
    /// The last page read was the end of the open payouts.
    at_end: bool,
    progress: Progress,
}

impl<'a, T> Walk<'a, T>
where
    T: for<'r> FromRow<'r, PgRow> + Positioned + Send + Unpin,
{
    pub(crate) fn new(paydb: &'a PgPool, sql: &'static str, cursor: &Cursor) -> Self {
        Self {
            paydb,
            sql,
            began_after: cursor.last.clone(),
            after: cursor.last.clone(),
            page: VecDeque::new(),
            at_end: false,
            progress: Progress::default(),
        }
    }

    /// The next open payout, or `None` once each was examined in this pass.
    pub(crate) async fn next(&mut self) -> Result<Option<T>, sqlx::Error> {
        loop {
            if let Some(row) = self.page.pop_front() {
                let position = row.position();
                if self.progress.wrapped && self.began_after.as_ref().is_some_and(|b| &position > b)
                {
                    return Ok(self.finished());
                }
                self.after = Some(position);
                self.progress.examined += 1;
                return Ok(Some(row));
            }
            if self.at_end {
                // The end of the open payouts: begin again at the oldest, once, unless this pass
                // began there.
                if self.progress.wrapped || self.began_after.is_none() {
                    return Ok(self.finished());
                }
                self.progress.wrapped = true;
                self.after = None;
                self.at_end = false;
            }
            let (at, id) = match &self.after {
                Some((at, id)) => (Some(*at), Some(id.clone())),
                None => (None, None),
            };
            let rows: Vec<T> = sqlx::query_as(self.sql)
                .bind(at)
                .bind(id)
                .bind(WALK_PAGE_ROWS)
                .fetch_all(self.paydb)
                .await?;
            self.at_end = (rows.len() as i64) < WALK_PAGE_ROWS;
            self.page.extend(rows);
        }
    }

    /// Payouts examined so far in this pass.
    pub(crate) fn examined(&self) -> usize {
        self.progress.examined
    }

    fn finished(&mut self) -> Option<T> {
        self.progress.complete = true;
        self.page.clear();
        None
    }

    /// Where the next pass begins, and how far this one went.
    pub(crate) fn stop(self, cursor: &mut Cursor) -> Progress {
        cursor.last = self.after;
        self.progress
    }
}

/// The keyset predicate and order every walk's SQL ends with (`$1`, `$2`, `$3` as [`Walk`]).
macro_rules! keyset {
    () => {
        " AND ($1::timestamptz IS NULL OR (p.created_at, p.id COLLATE \"C\") > ($1, $2::text)) \
          ORDER BY p.created_at, p.id COLLATE \"C\" LIMIT $3"
    };
}
pub(crate) use keyset;
