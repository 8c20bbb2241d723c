//! `payoutctl etcd provision`: etcd's users and roles (`mtls::etcd_access`), applied as etcd's
//! `root` (a client certificate of etcd's own authority whose common name is `root`), then
//! authentication enabled. Idempotent: each run adds what is missing and grants again what is
//! there, like `payoutctl db provision`. `--print-etcdctl` prints the same as `etcdctl` lines and
//! touches nothing.

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};
use mtls::etcd_access::{self, Access};

#[derive(Subcommand)]
pub enum Command {
    /// Create (or update) etcd's roles and users for the lock service's prefix, then enable
    /// authentication: the lock-server's user may read and write its prefix only, the
    /// reconciler's may read the grant records and the audit chain only, root may administer.
    Provision(ProvisionArgs),
}

#[derive(ClapArgs)]
pub struct ProvisionArgs {
    /// etcd's client endpoints (`https://` only).
    #[arg(
        long,
        env = "LOCK_ETCD_ENDPOINTS",
        value_delimiter = ',',
        required = true
    )]
    pub endpoints: Vec<String>,
    /// The lock service's key prefix (`--etcd-prefix` of the lock-server).
    #[arg(long, env = "LOCK_ETCD_PREFIX", default_value = crate::record::LOCK_ETCD_PREFIX)]
    pub prefix: String,
    /// The common name of the lock-server's etcd certificate (`pki issue --name`).
    #[arg(
        long,
        env = "PAYOUT_ETCD_LOCK_SERVER_USER",
        default_value = "lock-server"
    )]
    pub lock_server_user: String,
    /// The common name of the reconciler's etcd certificate.
    #[arg(
        long,
        env = "PAYOUT_ETCD_RECONCILER_USER",
        default_value = "reconciler"
    )]
    pub reconciler_user: String,
    /// Other users with the reconciler's read-only role, comma-separated: each operator's etcd
    /// certificate name (`payoutctl reconcile`, `restore rearm`).
    #[arg(long, env = "PAYOUT_ETCD_READER_USERS", value_delimiter = ',')]
    pub reader_users: Vec<String>,
    /// Print the `etcdctl` commands that do the same, and change nothing.
    #[arg(long)]
    pub print_etcdctl: bool,
    /// root's client certificate of etcd's authority.
    #[command(flatten)]
    pub tls: mtls::EtcdTlsArgs,
}

pub async fn run(command: Command) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::Provision(args) => {
            if args.print_etcdctl {
                for line in etcd_access::etcdctl_lines(
                    &args.prefix,
                    &args.lock_server_user,
                    &args.reconciler_user,
                    &args.reader_users,
                ) {
                    println!("{line}");
                }
                return Ok(std::process::ExitCode::SUCCESS);
            }
            for endpoint in &args.endpoints {
                mtls::require_https(endpoint)?;
            }
            let tls = args.tls.load().context("root's etcd certificate")?;
            let mut client = etcd_client::Client::connect(
                &args.endpoints,
                Some(etcd_client::ConnectOptions::new().with_tls(tls.etcd_client_config())),
            )
            .await
            .context("connecting to etcd")?;
            let users = etcd_access::users(
                &args.lock_server_user,
                &args.reconciler_user,
                &args.reader_users,
            );
            provision(&mut client, &args.prefix, &users).await?;
            let names: Vec<String> = users
                .iter()
                .map(|u| format!("{} ({})", u.name, u.role))
                .collect();
            println!("etcd: users {}; authentication enabled", names.join(", "));
            Ok(std::process::ExitCode::SUCCESS)
        }
    }
}

/// Whether an etcd error says the role or user is already there (a second run).
fn already_exists(error: &etcd_client::Error) -> bool {
    error.to_string().contains("already exists")
}

/// Applies `mtls::etcd_access`'s roles for `prefix` and `users` (`etcd_access::users`) through
/// `client` (root's), then enables authentication.
pub async fn provision(
    client: &mut etcd_client::Client,
    prefix: &str,
    users: &[etcd_access::User],
) -> anyhow::Result<()> {
    for role in etcd_access::roles(prefix) {
        match client.role_add(role.name).await {
            Err(e) if !already_exists(&e) => {
                return Err(e).with_context(|| format!("adding role {}", role.name))
            }
            _ => {}
        }
        for p in &role.permissions {
            let permission = match p.access {
                Access::Read => etcd_client::Permission::read(p.prefix.as_bytes()),
                Access::ReadWrite => etcd_client::Permission::read_write(p.prefix.as_bytes()),
            }
            .with_prefix();
            client
                .role_grant_permission(role.name, permission)
                .await
                .with_context(|| format!("granting {} on {:?}", role.name, p.prefix))?;
        }
    }
    for user in users {
        let no_password = etcd_client::UserAddOptions::new().with_no_pwd();
        match client.user_add(&user.name, "", Some(no_password)).await {
            Err(e) if !already_exists(&e) => {
                return Err(e).with_context(|| format!("adding user {}", user.name))
            }
            _ => {}
        }
        client
            .user_grant_role(&user.name, user.role)
            .await
            .with_context(|| format!("granting {} to {}", user.role, user.name))?;
    }
    client
        .auth_enable()
        .await
        .context("enabling authentication")?;
    Ok(())
}
