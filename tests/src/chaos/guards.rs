//! The negative-control switches. The deployable binaries have no flag that disables a guard;
//! to run without one, the harness kills that service's process and serves the same library
//! IN-PROCESS on the same port, built with the test-only (`#[doc(hidden)]`) switch.

use std::time::Duration;
use testkit::pki::Role;

use anyhow::Context;
use service_kit::{Metrics, Shutdown};
use testkit::system::System;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisableGuard {
    None,
    /// The payment resource's fence predicate.
    Fence,
    /// The rail proxy's high-water and uniqueness checks.
    Proxy,
    Both,
}

impl DisableGuard {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "none" => Some(Self::None),
            "fence" => Some(Self::Fence),
            "proxy" => Some(Self::Proxy),
            "both" => Some(Self::Both),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Fence => "fence",
            Self::Proxy => "proxy",
            Self::Both => "both",
        }
    }
    pub fn fence_off(self) -> bool {
        matches!(self, Self::Fence | Self::Both)
    }
    pub fn proxy_off(self) -> bool {
        matches!(self, Self::Proxy | Self::Both)
    }
}

/// Services running in this process; they stop when this is dropped.
pub struct InProcess {
    stops: Vec<tokio::sync::watch::Sender<bool>>,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        for s in &self.stops {
            let _ = s.send(true);
        }
    }
}

/// A port just released by a killed process can be bound again at once on loopback; this bounds
/// the retry if the kernel is slow to let go.
const REBIND_TIMEOUT: Duration = Duration::from_secs(10);

async fn rebind(port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    testkit::eventually(
        REBIND_TIMEOUT,
        &format!("binding 127.0.0.1:{port}"),
        || async {
            tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .ok()
        },
    )
    .await
}

/// Replaces the guarded services named by `disable` with in-process, unguarded ones.
pub async fn replace_services(
    system: &mut System,
    disable: DisableGuard,
) -> anyhow::Result<InProcess> {
    let mut stops = Vec::new();
    if disable.fence_off() {
        tokio::task::block_in_place(|| system.payment_resource.kill())?;
        let pool = service_kit::connect_pg(&system.databases.paydb).await?;
        let verifier = payment_resource::Verifier::new([system.grant_keys.public_key.clone()])?;
        let store = payment_resource::Store::new(
            pool,
            payment_resource::StoreOptions::new(
                verifier,
                payment_resource::SignedFacts::new(
                    std::sync::Arc::new(system.instruction_keys.signer()?),
                    payment_resource::INSTRUCTION_TTL_DEFAULT_MS,
                    system.rail_fact_keys.verifier()?,
                )?,
            )
            .with_operator_keys(system.operator.verifier())
            .without_fence_predicate_for_tests(),
            &Metrics::default(),
        );
        let listener = rebind(system.ports.payment_resource).await?;
        let (shutdown, stop) = Shutdown::new();
        // Served as the binary serves: mutual TLS, the real authorisation table.
        let front =
            payment_resource::Front::new(system.tls(Role::PaymentResource), Metrics::default())
                .with_fixture_accounts(true);
        tokio::spawn(payment_resource::serve(listener, store, front, shutdown));
        stops.push(stop);
        testkit::eventually(
            Duration::from_secs(30),
            "in-process payment resource serving",
            || async {
                testkit::system::probe_grpc(
                    system.ports.payment_resource,
                    &system.tls(Role::Reconciler),
                    Role::PaymentResource,
                )
                .await
                .then_some(())
            },
        )
        .await
        .context("in-process payment resource")?;
    }
    if disable.proxy_off() {
        tokio::task::block_in_place(|| system.rail_proxy.kill())?;
        let pool = service_kit::connect_pg(&system.databases.proxydb).await?;
        let verifier = rail_proxy::Verifier::new([system.grant_keys.public_key.clone()])?;
        let keys = rail_proxy::GuardKeys {
            grants: verifier,
            instructions: system.instruction_keys.verifier()?,
            fact_signer: std::sync::Arc::new(system.rail_fact_keys.signer()?),
        };
        let config = rail_proxy::ProxyConfig::new(
            rail_proxy::RailLink::new(
                system.rail_url(),
                system.rail_answer_keys.verifier()?,
                &system.rail_tls.proxy.load()?,
            )?,
            keys,
            system.tls(Role::RailProxy),
        )
        .with_rail_timeout(Duration::from_millis(super::RAIL_TIMEOUT_MS))
        .disable_guards_for_negative_control();
        let listener = rebind(system.ports.rail_proxy).await?;
        let (shutdown, stop) = Shutdown::new();
        tokio::spawn(rail_proxy::run(
            listener,
            pool,
            config,
            Metrics::default(),
            shutdown,
        ));
        stops.push(stop);
        testkit::eventually(
            Duration::from_secs(30),
            "in-process rail proxy serving",
            || async {
                testkit::system::probe_grpc(
                    system.ports.rail_proxy,
                    &system.tls(Role::Reconciler),
                    Role::RailProxy,
                )
                .await
                .then_some(())
            },
        )
        .await
        .context("in-process rail proxy")?;
    }
    Ok(InProcess { stops })
}
