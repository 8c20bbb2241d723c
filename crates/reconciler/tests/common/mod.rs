//! The rig the reconciler's system tests share: a system without workers (payouts are driven by
//! hand under real grants), the reconciler's sources on it, and a grant as the guards see it.

use std::time::Duration;

use payment_client::model::Fence;
use payout_domain::AccountId;
use reconciler::Sources;
use testkit::etcd::EtcdRole;
use testkit::pki::Role;
use testkit::system::{System, SystemOptions};
use testkit::Stack;

/// Payouts here are driven by hand, so no workers.
pub async fn system_without_workers() -> System {
    System::start(
        Stack::shared(),
        SystemOptions {
            workers: 0,
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap()
}

pub async fn sources(system: &System) -> Sources {
    Sources {
        paydb: sqlx::PgPool::connect(&system.databases.paydb)
            .await
            .unwrap(),
        proxydb: sqlx::PgPool::connect(&system.databases.proxydb)
            .await
            .unwrap(),
        gldb: sqlx::PgPool::connect(&system.databases.gldb).await.unwrap(),
        rail_proxy: Some(reconciler::ProxySource {
            url: system.proxy_url(),
            tls: system.tls(Role::Reconciler),
        }),
        lock_grants: Some(reconciler::LockGrants::new(
            Stack::shared().etcd_endpoints(),
            Stack::shared().etcd_identity_tls(EtcdRole::Reconciler, &system.etcd_prefix),
            system.etcd_prefix.clone(),
        )),
        operators: Some(system.operator.verifier()),
    }
}

/// `account`'s key taken by `session` (it must be free), and the fence the guards verify: the
/// grant as the lock service signed it (key, token, owner).
pub async fn granted(
    session: &lock_client::Session,
    account: &AccountId,
) -> (lock_client::GrantHandle, Fence) {
    let grant = match session
        .acquire(&payout_domain::lock_key(account), Duration::from_secs(5))
        .await
        .unwrap()
    {
        lock_client::Acquired::Granted(g) => g,
        other => panic!("lock not granted: {other:?}"),
    };
    let fence = Fence::new(grant.owner(), grant.token())
        .unwrap()
        .signed(grant.key(), grant.signature().clone());
    (grant, fence)
}
