//! Who may do what in etcd (issue 34): least privilege for the lock service's keyspace, as data.
//!
//! etcd run with `--client-cert-auth` and authentication enabled takes a client certificate's
//! common name as its user. Three users matter:
//!
//! | user | role | may |
//! |---|---|---|
//! | `root` | `root` | everything: users, roles, members, alarms, snapshots (operators; provisioning) |
//! | the lock-server's (e.g. `lock-server`) | [`LOCK_SERVER_ROLE`] | read and write every key under the lock prefix, nothing outside it |
//! | the reconciler's (e.g. `reconciler`), and each reader's (an operator's `payoutctl reconcile` and `restore rearm`) | [`RECONCILER_ROLE`] | read the grant records (`{prefix}grants/`) and the audit chain (`{prefix}audit/`, `{prefix}audit-head`), write nothing |
//!
//! Any other certificate of etcd's authority completes TLS and is authorised for nothing; a user
//! is revoked by deleting it (`etcdctl user delete`), no revocation list needed. The table is pure
//! data (no etcd client here: the servers that link `mtls` must not link one); `payoutctl etcd
//! provision` applies it, and [`etcdctl_lines`] renders it for the runbooks.

/// etcd's all-powerful user and role (it must exist before authentication can be enabled).
pub const ROOT: &str = "root";
/// The lock-server's role: read-write on its own prefix.
pub const LOCK_SERVER_ROLE: &str = "payout-lock-server";
/// The reconciler's role: read-only on the grant records and the audit chain.
pub const RECONCILER_ROLE: &str = "payout-reconciler";

/// What etcd 3.4 answers a request whose authentication (taken when the request arrived) predates
/// a change of its users or roles applied in the meantime (`ErrAuthOldRevision`). It refuses the
/// request before it reads or writes anything, so sending it again is safe; etcd's own Go client
/// does so. Our etcd clients do the same, at most [`AUTH_REVISION_OLD_ATTEMPTS_MAX`] times.
pub const AUTH_REVISION_OLD: &str = "revision of auth store is old";
/// How many times a request refused with [`AUTH_REVISION_OLD`] is sent: one provisioning makes
/// four or five changes in a row (role, permissions, user, grant), each of which may refuse a
/// request in flight once; past that, something is changing users or roles without end.
pub const AUTH_REVISION_OLD_ATTEMPTS_MAX: usize = 8;

/// Whether etcd's answer `message` is [`AUTH_REVISION_OLD`].
pub fn is_auth_revision_old(message: &str) -> bool {
    message.contains(AUTH_REVISION_OLD)
}

/// `request` (one etcd request, made anew each time), sent again while etcd answers
/// [`AUTH_REVISION_OLD`], at most [`AUTH_REVISION_OLD_ATTEMPTS_MAX`] times in all. Generic over
/// the client's error so that this crate links no etcd client.
pub async fn resend_on_auth_change<T, E: std::fmt::Display, Fut>(
    mut request: impl FnMut() -> Fut,
) -> Result<T, E>
where
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut attempts = 1;
    loop {
        match request().await {
            Err(e)
                if is_auth_revision_old(&e.to_string())
                    && attempts < AUTH_REVISION_OLD_ATTEMPTS_MAX =>
            {
                attempts += 1
            }
            answer => return answer,
        }
    }
}

/// What a permission allows on its key range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// One permission: `access` on every key that starts with `prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permission {
    pub access: Access,
    pub prefix: String,
}

/// A role and its permissions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Role {
    pub name: &'static str,
    pub permissions: Vec<Permission>,
}

/// A user (a certificate's common name) and the role it is granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub role: &'static str,
}

/// The lock service's prefix as the lock-server writes it: always ending in `/`.
pub fn normalise_prefix(prefix: &str) -> String {
    if prefix.ends_with('/') {
        prefix.to_string()
    } else {
        format!("{prefix}/")
    }
}

/// The roles of a deployment whose lock service writes under `prefix`.
pub fn roles(prefix: &str) -> Vec<Role> {
    let prefix = normalise_prefix(prefix);
    vec![
        Role {
            name: LOCK_SERVER_ROLE,
            permissions: vec![Permission {
                access: Access::ReadWrite,
                prefix: prefix.clone(),
            }],
        },
        Role {
            name: RECONCILER_ROLE,
            permissions: vec![
                Permission {
                    access: Access::Read,
                    prefix: format!("{prefix}grants/"),
                },
                // `audit` covers the chain's records (`audit/`) and its head (`audit-head`).
                Permission {
                    access: Access::Read,
                    prefix: format!("{prefix}audit"),
                },
            ],
        },
    ]
}

/// The users: root, the lock-server's and the reconciler's certificates' common names, and
/// `readers` (operators, a test harness) with the reconciler's read-only role.
pub fn users(lock_server_user: &str, reconciler_user: &str, readers: &[String]) -> Vec<User> {
    let mut users = vec![
        User {
            name: ROOT.to_string(),
            role: ROOT,
        },
        User {
            name: lock_server_user.to_string(),
            role: LOCK_SERVER_ROLE,
        },
        User {
            name: reconciler_user.to_string(),
            role: RECONCILER_ROLE,
        },
    ];
    // An empty name (an unset list read as one empty item) is no user: etcd refuses it.
    users.extend(
        readers
            .iter()
            .map(|name| name.trim())
            .filter(|name| !name.is_empty())
            .map(|name| User {
                name: name.to_string(),
                role: RECONCILER_ROLE,
            }),
    );
    users
}

/// The same table as `etcdctl` 3.4 commands (run with root's certificate), in the order they
/// must run: roles, users (no password: the certificate is the credential), grants, then
/// authentication on.
pub fn etcdctl_lines(
    prefix: &str,
    lock_server_user: &str,
    reconciler_user: &str,
    readers: &[String],
) -> Vec<String> {
    let mut lines = Vec::new();
    for role in roles(prefix) {
        lines.push(format!("etcdctl role add {}", role.name));
        for p in &role.permissions {
            let access = match p.access {
                Access::Read => "read",
                Access::ReadWrite => "readwrite",
            };
            lines.push(format!(
                "etcdctl role grant-permission --prefix=true {} {access} '{}'",
                role.name, p.prefix
            ));
        }
    }
    for user in users(lock_server_user, reconciler_user, readers) {
        lines.push(format!("etcdctl user add {} --no-password", user.name));
        lines.push(format!(
            "etcdctl user grant-role {} {}",
            user.name, user.role
        ));
    }
    lines.push("etcdctl auth enable".to_string());
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_server_writes_its_prefix_and_the_reconciler_reads_two_ranges_of_it() {
        let roles = roles("payout-locks");
        let lock = roles.iter().find(|r| r.name == LOCK_SERVER_ROLE).unwrap();
        assert_eq!(
            lock.permissions,
            [Permission {
                access: Access::ReadWrite,
                prefix: "payout-locks/".into()
            }]
        );
        let reconciler = roles.iter().find(|r| r.name == RECONCILER_ROLE).unwrap();
        assert!(reconciler
            .permissions
            .iter()
            .all(|p| p.access == Access::Read && p.prefix.starts_with("payout-locks/")));
        let covers = |key: &str| {
            reconciler
                .permissions
                .iter()
                .any(|p| key.starts_with(&p.prefix))
        };
        for read in [
            "payout-locks/grants/payout:a/1",
            "payout-locks/audit/00000000000000000001",
            "payout-locks/audit-head",
        ] {
            assert!(covers(read), "{read}");
        }
        for not in [
            "payout-locks/locks/payout:a",
            "payout-locks/retention/1",
            "other/grants/x",
        ] {
            assert!(!covers(not), "{not}");
        }
    }

    #[test]
    fn the_etcdctl_lines_end_with_authentication_on() {
        let lines = etcdctl_lines("p/", "lock", "rec", &["alice".to_string()]);
        assert_eq!(lines.last().unwrap(), "etcdctl auth enable");
        assert!(lines.contains(&"etcdctl user add root --no-password".to_string()));
        assert!(lines.contains(&"etcdctl user grant-role alice payout-reconciler".to_string()));
        // An unset reader list (compose's default: an empty string) adds no user.
        assert_eq!(users("l", "r", &[String::new()]).len(), 3);
        assert!(lines.contains(
            &"etcdctl role grant-permission --prefix=true payout-reconciler read 'p/grants/'"
                .to_string()
        ));
    }
}
