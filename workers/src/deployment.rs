//! Worker Versioning: every worker declares the deployment version it runs (Temporal Worker
//! Deployments: a deployment name and a build id), and the payout workflow's versioning
//! behaviour is stated here, explicitly: **pinned**.
//!
//! Why pinned is what a money workflow wants: a payout's workflow lives from CreatePayout to
//! POSTED or FAILED, which may be hours (RAIL_AMBIGUOUS waits for the settlement window, then for
//! evidence or an operator, up to the resolution SLA). A pinned workflow finishes on the code
//! that started it, so a new version never replays a history written by another one: no
//! nondeterminism failure can stall a payout whose money may already be on the rail, and no
//! change to the workflow needs a `patched()` marker to stay safe for in-flight payouts. The
//! price is that the old version's workers stay up until the version has drained (no pinned
//! workflow left open), which `temporal worker deployment describe-version` shows; the README's
//! "Worker deployment" section is the procedure. Safety never depended on which code runs a
//! step anyway: the guards fence every write (ARCHITECTURE.md), so versioning is about
//! liveness and clean upgrades, not about paying once.
//!
//! With versioning on (`--worker-versioning`), the worker only receives tasks of its own
//! version, and new payouts go to the deployment's current version, which an operator sets
//! (`temporal worker deployment set-current-version`). Off (the default, as in the local stack
//! and the tests), the worker still reports its deployment version but tasks are not routed by
//! it. The worker's private task queue (fenced activities of the grants this process holds) is
//! never versioned: it is this process's own, so there is nothing to route between versions.

use temporalio_common::worker::{
    VersioningBehavior, WorkerDeploymentOptions, WorkerDeploymentVersion,
};

/// The payout workers' Worker Deployment.
pub const DEPLOYMENT_NAME: &str = "payouts";
/// The build id when none is configured: the worker binary's version.
pub const BUILD_ID_DEFAULT: &str = env!("CARGO_PKG_VERSION");
/// The payout workflow's versioning behaviour (see the module documentation for why).
pub const PAYOUT_WORKFLOW_BEHAVIOUR: VersioningBehavior = VersioningBehavior::Pinned;

/// Which deployment version this worker runs, and whether tasks are routed by it.
#[derive(Debug, Clone, clap::Args)]
pub struct DeploymentArgs {
    /// The Worker Deployment this worker belongs to.
    #[arg(long = "deployment-name", env = "PAYOUT_WORKER_DEPLOYMENT_NAME", default_value = DEPLOYMENT_NAME)]
    pub name: String,
    /// This worker's build id in the deployment (one per released build); default: the
    /// worker binary's version.
    #[arg(long = "build-id", env = "PAYOUT_WORKER_BUILD_ID")]
    pub build_id: Option<String>,
    /// Route tasks by deployment version (Temporal Worker Versioning): this worker then
    /// receives only its own version's tasks, payout workflows are pinned to the version that
    /// started them, and new payouts go to the deployment's current version, which an operator
    /// sets (`temporal worker deployment set-current-version`; see the README's "Worker
    /// deployment").
    #[arg(long = "worker-versioning", env = "PAYOUT_WORKER_VERSIONING")]
    pub versioning: bool,
}

impl Default for DeploymentArgs {
    fn default() -> Self {
        Self {
            name: DEPLOYMENT_NAME.to_string(),
            build_id: None,
            versioning: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DeploymentError {
    #[error("{setting} must not be empty")]
    Empty { setting: &'static str },
    /// Temporal joins the two with a dot in a version's name (`payouts.1.4.0`).
    #[error("PAYOUT_WORKER_DEPLOYMENT_NAME (--deployment-name) {0:?} must not contain '.'")]
    DottedName(String),
}

impl DeploymentArgs {
    pub fn build_id(&self) -> String {
        self.build_id
            .clone()
            .unwrap_or_else(|| BUILD_ID_DEFAULT.to_string())
    }

    /// The version as Temporal names it: `<deployment>.<build id>`.
    pub fn version_name(&self) -> String {
        format!("{}.{}", self.name, self.build_id())
    }

    /// The shared queue's deployment options: this version, pinned workflows when routed.
    pub fn options(&self) -> Result<WorkerDeploymentOptions, DeploymentError> {
        if self.name.trim().is_empty() {
            return Err(DeploymentError::Empty {
                setting: "PAYOUT_WORKER_DEPLOYMENT_NAME (--deployment-name)",
            });
        }
        if self.name.contains('.') {
            return Err(DeploymentError::DottedName(self.name.clone()));
        }
        if self.build_id().trim().is_empty() {
            return Err(DeploymentError::Empty {
                setting: "PAYOUT_WORKER_BUILD_ID (--build-id)",
            });
        }
        let version = WorkerDeploymentVersion::builder()
            .deployment_name(self.name.clone())
            .build_id(self.build_id())
            .build();
        Ok(WorkerDeploymentOptions::new(version)
            .use_worker_versioning(self.versioning)
            .maybe_default_versioning_behavior(self.versioning.then_some(PAYOUT_WORKFLOW_BEHAVIOUR))
            .build())
    }

    /// The private queue's: the same build id, never routed (the queue is this process's own).
    pub fn private_queue_options(&self) -> WorkerDeploymentOptions {
        WorkerDeploymentOptions::from_build_id(self.build_id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_workers_pin_payouts_and_unrouted_ones_only_report_their_version() {
        let routed = DeploymentArgs {
            build_id: Some("1.5.0".into()),
            versioning: true,
            ..DeploymentArgs::default()
        };
        let options = routed.options().unwrap();
        assert!(options.use_worker_versioning);
        assert_eq!(
            options.default_versioning_behavior,
            Some(VersioningBehavior::Pinned)
        );
        assert_eq!(options.version.deployment_name, DEPLOYMENT_NAME);
        assert_eq!(options.version.build_id, "1.5.0");
        assert_eq!(routed.version_name(), "payouts.1.5.0");

        let reporting = DeploymentArgs::default().options().unwrap();
        assert!(!reporting.use_worker_versioning);
        assert_eq!(reporting.default_versioning_behavior, None);
        assert_eq!(reporting.version.build_id, BUILD_ID_DEFAULT);
    }

    #[test]
    fn a_bad_deployment_setting_is_refused_naming_it() {
        for (args, setting) in [
            (
                DeploymentArgs {
                    name: "pay.outs".into(),
                    ..DeploymentArgs::default()
                },
                "PAYOUT_WORKER_DEPLOYMENT_NAME",
            ),
            (
                DeploymentArgs {
                    name: " ".into(),
                    ..DeploymentArgs::default()
                },
                "PAYOUT_WORKER_DEPLOYMENT_NAME",
            ),
            (
                DeploymentArgs {
                    build_id: Some(String::new()),
                    ..DeploymentArgs::default()
                },
                "PAYOUT_WORKER_BUILD_ID",
            ),
        ] {
            let refused = args.options().unwrap_err().to_string();
            assert!(refused.contains(setting), "{refused}");
        }
    }
}
