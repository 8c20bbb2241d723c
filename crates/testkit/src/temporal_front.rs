//! The mutual-TLS front before the Temporal dev server (issue 33, design section 3), which has no
//! TLS or authentication of its own: Debian's nginx terminates TLS, requires a client certificate
//! of the stack's authority, admits by the certificate's role (its subject `OU`: worker,
//! reconciler, outbox-dispatcher, operator), proxies gRPC to the dev server on loopback, and puts
//! the UI behind a login. When this process is root (CI), the raw frontend, its HTTP API and the
//! raw UI are closed to everyone but the unprivileged user the server and nginx run as, by
//! iptables owner rules; elsewhere (a developer's laptop) they stay open, with a warning.

use std::path::PathBuf;
use std::process::Command;

use anyhow::Context;

use crate::process::{Lifetime, ManagedProcess, ProcessSpec};

/// The roles that need Temporal: payout workers, the reconciler (its worker, schedule and resume
/// pass), the outbox dispatcher (the starter) and operators (payoutctl, the CLI, test harnesses).
/// Any other certificate of the authority (intake, the guards, the lock service) is refused.
pub const ADMITTED_ROLES: [mtls::Role; 4] = [
    mtls::Role::Worker,
    mtls::Role::Reconciler,
    mtls::Role::OutboxDispatcher,
    mtls::Role::Operator,
];

/// The name every Temporal client checks the front's certificate against.
pub const SERVER_NAME: &str = "temporal";

/// The unprivileged user the dev server and nginx run as when this process is root: the only
/// user the isolation rules let reach the raw ports (`scripts/setup.sh` makes it).
pub const USER: &str = "payout-temporal";

/// Calls may last longer than Temporal's 70 s long polls (its own advice for a proxy: above
/// 80 s), or every idle poll would end in an error.
const CALL_TIMEOUT_S: u32 = 120;
/// The front's internal location that answers a refused role (never reachable from outside).
const DENIED_PATH: &str = "payout-front-permission-denied";
/// The grpc-message of a refused role: what every client prints (deploy's front says the same).
pub const DENIED_MESSAGE: &str =
    "the client certificate's role may not call Temporal (payout front)";
/// The front's internal location that answers a denied certificate.
const REVOKED_PATH: &str = "payout-front-certificate-denied";
/// The grpc-message of a denied certificate.
pub const REVOKED_MESSAGE: &str =
    "certificate_denied: this client certificate is on the denylist (payout front)";
/// How often the front's watcher looks at its denylist for a change (the services poll theirs
/// every `mtls::denylist::RELOAD_MS`).
const DENYLIST_POLL_MS: u64 = 500;
/// A connection is kept well beyond Temporal's advice (at least 6 minutes).
const KEEPALIVE_TIMEOUT_S: u32 = 600;
/// nginx GOAWAYs a connection after this many requests (default 1000): a busy worker's would be
/// cut every few seconds.
const KEEPALIVE_REQUESTS: u32 = 1_000_000;
/// Streams in flight on one connection (default 128, below what a worker's pollers use).
const CONCURRENT_STREAMS_MAX: u32 = 1_024;
/// Idle upstream connections kept: nginx opens one per call in flight.
const UPSTREAM_KEEPALIVE: u32 = 64;
/// The largest call body (default 1 MiB, below a large history page or payload).
const BODY_SIZE_MAX: &str = "8m";

/// Where the front listens and what it serves.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    /// Its folder: configuration, certificates, logs, pid and temporary files.
    pub dir: PathBuf,
    pub listen_ip: String,
    /// The gRPC front (what every client dials) and the dev server's raw frontend behind it.
    pub front_port: u16,
    pub raw_port: u16,
    /// The UI behind a login, and the raw UI behind it; `None` when the server is headless.
    pub ui: Option<(u16, u16)>,
}

impl FrontConfig {
    pub fn conf_file(&self) -> PathBuf {
        self.dir.join("nginx.conf")
    }
    pub fn access_log(&self) -> PathBuf {
        self.dir.join("front-access.log")
    }
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
    pub fn htpasswd_file(&self) -> PathBuf {
        self.dir.join("htpasswd")
    }
    /// The certificate denylist (`mtls::denylist`'s format, `payoutctl pki deny` appends): its
    /// SHA-1 fingerprints are what nginx can match (`$ssl_client_fingerprint`).
    pub fn denylist_file(&self) -> PathBuf {
        self.dir.join("denylist")
    }
    /// The nginx map rendered from [`FrontConfig::denylist_file`].
    pub fn denied_map_file(&self) -> PathBuf {
        self.dir.join("denied.map")
    }

    /// The nginx configuration (unprivileged: every path in [`FrontConfig::dir`]).
    pub fn render(&self) -> String {
        let dir = self.dir.display();
        let roles = ADMITTED_ROLES
            .iter()
            .map(|r| r.name())
            .collect::<Vec<_>>()
            .join("|");
        let ip = &self.listen_ip;
        let mut conf = format!(
            r#"# Rendered by testkit::temporal_front; do not edit.
daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  client_body_temp_path {dir}/tmp/body;
  proxy_temp_path {dir}/tmp/proxy;
  fastcgi_temp_path {dir}/tmp/fastcgi;
  uwsgi_temp_path {dir}/tmp/uwsgi;
  scgi_temp_path {dir}/tmp/scgi;
  log_format front '$ssl_client_s_dn "$request" $status $request_time';
  access_log {dir}/front-access.log front;
  ssl_protocols TLSv1.2 TLSv1.3;
  ssl_certificate {dir}/temporal.pem;
  ssl_certificate_key {dir}/temporal.key;
  # The role is the subject's OU; nginx prints the subject in RFC 2253 order (last RDN first),
  # so our certificates' OU comes first and a common name cannot pose as one.
  map $ssl_client_s_dn $temporal_role {{
    default "";
    "~^OU=({roles})(,|$)" $1;
  }}
  # A certificate on the denylist (issue 34): refused whatever its role.
  map $ssl_client_fingerprint $payout_denied {{
    default 0;
    include {dir}/denied.map;
  }}
  upstream temporal_raw {{
    server 127.0.0.1:{raw};
    keepalive {UPSTREAM_KEEPALIVE};
    keepalive_timeout {KEEPALIVE_TIMEOUT_S}s;
  }}
  server {{
    listen {ip}:{front} ssl http2;
    ssl_verify_client on;
    ssl_client_certificate {dir}/ca.pem;
    ssl_verify_depth 1;
    keepalive_timeout {KEEPALIVE_TIMEOUT_S}s;
    keepalive_requests {KEEPALIVE_REQUESTS};
    http2_max_concurrent_streams {CONCURRENT_STREAMS_MAX};
    client_max_body_size {BODY_SIZE_MAX};
    client_body_timeout {CALL_TIMEOUT_S}s;
    # A role that does not need Temporal is answered as gRPC answers a refusal (grpc-status 7,
    # PERMISSION_DENIED, in a trailers-only response), so every client names it as such.
    error_page 403 = /{DENIED_PATH};
    error_page 401 = /{REVOKED_PATH};
    location / {{
      if ($payout_denied) {{ return 401; }}
      if ($temporal_role = "") {{ return 403; }}
      grpc_pass grpc://temporal_raw;
      grpc_read_timeout {CALL_TIMEOUT_S}s;
      grpc_send_timeout {CALL_TIMEOUT_S}s;
    }}
    location = /{DENIED_PATH} {{
      internal;
      default_type application/grpc;
      add_header grpc-status 7 always;
      add_header grpc-message "{DENIED_MESSAGE}" always;
      return 200 "";
    }}
    location = /{REVOKED_PATH} {{
      internal;
      default_type application/grpc;
      add_header grpc-status 7 always;
      add_header grpc-message "{REVOKED_MESSAGE}" always;
      return 200 "";
    }}
  }}
"#,
            raw = self.raw_port,
            front = self.front_port,
        );
        if let Some((ui, raw_ui)) = self.ui {
            conf.push_str(&format!(
                r#"  server {{
    listen {ip}:{ui} ssl;
    auth_basic "Temporal";
    auth_basic_user_file {dir}/htpasswd;
    location / {{
      proxy_pass http://127.0.0.1:{raw_ui};
      proxy_read_timeout {CALL_TIMEOUT_S}s;
    }}
  }}
"#
            ));
        }
        conf.push_str("}\n");
        conf
    }
}

/// nginx's map lines for a denylist's text: `<sha1 hex> 1;` per certificate that has a SHA-1
/// (what `payoutctl pki deny` writes); a line that does not parse is skipped here (the services
/// refuse the whole file; the front keeps serving with what it can read).
pub fn denied_map(denylist: &str) -> String {
    denylist
        .lines()
        .filter_map(|line| mtls::denylist::parse(line).ok())
        .flatten()
        .filter_map(|entry| entry.sha1)
        .map(|sha1| {
            let hex: String = sha1.iter().map(|b| format!("{b:02x}")).collect();
            format!("{hex} 1;\n")
        })
        .collect()
}

/// The running front, and its isolation rules when root.
pub struct TemporalFront {
    pub config: FrontConfig,
    pub process: ManagedProcess,
    /// Ends the denylist watcher (`Drop`).
    stop_watch: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for TemporalFront {
    fn drop(&mut self) {
        self.stop_watch
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Renders the front's `denied.map` from its denylist whenever the list changes, and has nginx
/// reload it (SIGHUP to its master): a denied certificate is refused within a second or so.
fn watch_denylist(
    config: FrontConfig,
    pid: Option<u32>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let modified = |path: &std::path::Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let mut seen = modified(&config.denylist_file());
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        std::thread::sleep(std::time::Duration::from_millis(DENYLIST_POLL_MS));
        let now = modified(&config.denylist_file());
        if now == seen {
            continue;
        }
        seen = now;
        let text = std::fs::read_to_string(config.denylist_file()).unwrap_or_default();
        if std::fs::write(config.denied_map_file(), denied_map(&text)).is_err() {
            continue;
        }
        if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
            // SAFETY: kill with a pid we started and a valid signal has no memory effects.
            unsafe {
                libc::kill(pid, libc::SIGHUP);
            }
        }
    }
}

/// nginx: `NGINX`, else Debian's `/usr/sbin/nginx`, else `PATH`.
pub fn nginx_path() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("NGINX") {
        return Ok(PathBuf::from(path));
    }
    let debian = PathBuf::from("/usr/sbin/nginx");
    if debian.exists() {
        return Ok(debian);
    }
    crate::etcd::which("nginx").context("nginx is not installed: run scripts/setup.sh")
}

/// (uid, gid) of [`USER`] when this process is root; `None` otherwise. Root without the user is
/// an error: the isolation would have no one to let through.
pub fn front_user() -> anyhow::Result<Option<(u32, u32)>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let name = std::ffi::CString::new(USER).context("user name")?;
    // SAFETY: getpwnam returns a pointer to static storage or null; read it at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    anyhow::ensure!(
        !pw.is_null(),
        "running as root without the user {USER} that Temporal and its front run as: run \
         scripts/setup.sh"
    );
    // SAFETY: non-null pointer from getpwnam.
    Ok(Some(unsafe { ((*pw).pw_uid, (*pw).pw_gid) }))
}

impl TemporalFront {
    /// Writes the configuration and the files it names (already in `config.dir`: `temporal.pem`,
    /// `temporal.key`, `ca.pem`, `htpasswd` when there is a UI), checks it with `nginx -t` and
    /// starts nginx as `user`.
    pub fn start(
        config: FrontConfig,
        user: Option<(u32, u32)>,
        lifetime: Lifetime,
    ) -> anyhow::Result<Self> {
        let nginx = nginx_path()?;
        std::fs::create_dir_all(config.dir.join("tmp"))?;
        if !config.denylist_file().exists() {
            std::fs::write(config.denylist_file(), "")?;
        }
        std::fs::write(
            config.denied_map_file(),
            denied_map(&std::fs::read_to_string(config.denylist_file())?),
        )?;
        std::fs::write(config.conf_file(), config.render())?;
        crate::util::hand_over(&config.dir, user)?;
        let error_log = config.dir.join("nginx-error.log");
        let mut check = Command::new(&nginx);
        check
            .arg("-t")
            .arg("-q")
            .arg("-e")
            .arg(&error_log)
            .arg("-c")
            .arg(config.conf_file());
        if let Some((uid, gid)) = user {
            use std::os::unix::process::CommandExt;
            check.uid(uid).gid(gid);
        }
        let out = check.output().context("running nginx -t")?;
        anyhow::ensure!(
            out.status.success(),
            "nginx refused the front's configuration {}: {}",
            config.conf_file().display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let spec = ProcessSpec::new("temporal-front", &nginx, config.dir.join("nginx.log"))
            .arg("-e")
            .arg(&error_log)
            .arg("-c")
            .arg(config.conf_file())
            .user(user)
            .lifetime(lifetime);
        std::fs::File::create(&spec.log_path)?;
        crate::util::hand_over(&spec.log_path, user)?;
        let process = ManagedProcess::start(spec)?;
        let stop_watch = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (watched, pid, stop) = (config.clone(), process.pid(), stop_watch.clone());
        std::thread::spawn(move || watch_denylist(watched, pid, stop));
        Ok(Self {
            config,
            process,
            stop_watch,
        })
    }
}

/// The iptables rules that keep everyone but [`USER`] off the raw ports: packets to them on
/// loopback from any other user, and packets to them arriving from outside loopback (the fault
/// suite's namespaced workers reach the host's loopback by DNAT and arrive on INPUT). Tagged
/// with the dev server's pid, so a run killed before its Drop leaves rules the next start sweeps.
pub struct Isolation {
    tag: String,
    ports: Vec<u16>,
    /// Its entry in [`exit_rules`] (attached isolations only).
    registered: Option<u64>,
}

/// The rules of attached isolations still in place, removed at process exit: a shared stack is
/// a `static`, never dropped, and a rule left behind would refuse whoever binds its port next.
fn exit_rules() -> &'static std::sync::Mutex<std::collections::BTreeMap<u64, Vec<Vec<String>>>> {
    static RULES: std::sync::OnceLock<
        std::sync::Mutex<std::collections::BTreeMap<u64, Vec<Vec<String>>>>,
    > = std::sync::OnceLock::new();
    RULES.get_or_init(|| {
        extern "C" fn remove_at_exit() {
            if let Ok(rules) = exit_rules().lock() {
                for rule in rules.values().flatten() {
                    let mut args = vec!["-D"];
                    args.extend(rule.iter().map(String::as_str));
                    let _ = iptables(&args);
                }
            }
        }
        // SAFETY: registering a plain extern "C" fn.
        unsafe {
            libc::atexit(remove_at_exit);
        }
        std::sync::Mutex::new(std::collections::BTreeMap::new())
    })
}

fn iptables(args: &[&str]) -> anyhow::Result<()> {
    let mut all = vec!["-w"];
    all.extend_from_slice(args);
    crate::netns::run("iptables", &all)
}

const TAG_SUFFIX: &str = "-temporal";

impl Isolation {
    /// Closes `ports` to everyone but [`USER`]; `owner_pid` is the process whose life the rules
    /// share (the dev server, or this process); `attached` rules are also removed when this
    /// process exits.
    pub fn apply(ports: &[u16], owner_pid: u32, attached: bool) -> anyhow::Result<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Self::remove_stale();
        let mut isolation = Self {
            tag: format!("pw{owner_pid}{TAG_SUFFIX}"),
            ports: ports.to_vec(),
            registered: None,
        };
        let all: Vec<Vec<String>> = isolation
            .ports
            .iter()
            .flat_map(|port| isolation.rules(*port))
            .collect();
        if attached {
            let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Ok(mut rules) = exit_rules().lock() {
                rules.insert(id, all.clone());
                isolation.registered = Some(id);
            }
        }
        for rule in &all {
            let mut args = vec!["-A"];
            args.extend(rule.iter().map(String::as_str));
            iptables(&args)?;
        }
        Ok(isolation)
    }

    fn rules(&self, port: u16) -> [Vec<String>; 2] {
        let port = port.to_string();
        let tail = [
            "-m",
            "comment",
            "--comment",
            &self.tag,
            "-j",
            "REJECT",
            "--reject-with",
            "tcp-reset",
        ];
        let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        let mut output = s(&["OUTPUT", "-o", "lo", "-p", "tcp", "--dport", &port]);
        output.extend(s(&["-m", "owner", "!", "--uid-owner", USER]));
        output.extend(s(&tail));
        let mut input = s(&["INPUT", "!", "-i", "lo", "-p", "tcp", "--dport", &port]);
        input.extend(s(&tail));
        [output, input]
    }

    /// Removes the rules of dev servers that no longer run.
    pub fn remove_stale() {
        for chain in ["OUTPUT", "INPUT"] {
            let Ok(out) = Command::new("iptables").args(["-w", "-S", chain]).output() else {
                continue;
            };
            for rule in String::from_utf8_lossy(&out.stdout).lines() {
                let Some(tag) = rule
                    .split_whitespace()
                    .skip_while(|w| *w != "--comment")
                    .nth(1)
                else {
                    continue;
                };
                let gone = tag
                    .trim_matches('"')
                    .strip_prefix("pw")
                    .and_then(|rest| rest.strip_suffix(TAG_SUFFIX))
                    .and_then(|pid| pid.parse::<u32>().ok())
                    .is_some_and(|pid| !crate::util::pid_alive(pid));
                if gone {
                    let mut args = vec!["-D"];
                    args.extend(rule.split_whitespace().skip(1).map(|w| w.trim_matches('"')));
                    let _ = iptables(&args);
                }
            }
        }
    }
}

impl Drop for Isolation {
    fn drop(&mut self) {
        if let (Some(id), Ok(mut rules)) = (self.registered, exit_rules().lock()) {
            rules.remove(&id);
        }
        for port in &self.ports {
            for rule in self.rules(*port) {
                let mut args = vec!["-D"];
                args.extend(rule.iter().map(String::as_str));
                let _ = iptables(&args);
            }
        }
    }
}

/// The connection settings of each admitted role, in the SDK's environment-configuration format
/// (what `TemporalArgs` and the `temporal` CLI read): one profile per role.
pub fn clients_toml(
    address: &str,
    namespace: &str,
    clients: &[(mtls::Role, mtls::TlsArgs)],
) -> String {
    let mut out = String::from("# Rendered by testkit::temporal_front: one profile per role.\n");
    for (role, files) in clients {
        out.push_str(&format!(
            "\n[profile.{role}]\naddress = \"{address}\"\nnamespace = \"{namespace}\"\n\n\
             [profile.{role}.tls]\nclient_cert_path = \"{}\"\nclient_key_path = \"{}\"\n\
             server_ca_cert_path = \"{}\"\nserver_name = \"{SERVER_NAME}\"\n",
            files.cert.display(),
            files.key.display(),
            files.ca.display(),
            role = role.name(),
        ));
    }
    out
}

/// The `temporal` CLI's flags for one client's certificate through the front.
pub fn cli_tls_flags(files: &mtls::TlsArgs) -> Vec<String> {
    vec![
        "--tls-cert-path".into(),
        files.cert.display().to_string(),
        "--tls-key-path".into(),
        files.key.display().to_string(),
        "--tls-ca-path".into(),
        files.ca.display().to_string(),
        "--tls-server-name".into(),
        SERVER_NAME.into(),
    ]
}

/// The UI's HTTP status for GET `url` through the front (`curl`, trusting `ca`), with
/// `login` (`user:password`) when given: what a person's browser would get.
pub fn ui_status(url: &str, ca: &std::path::Path, login: Option<&str>) -> anyhow::Result<String> {
    let mut curl = Command::new("curl");
    curl.args([
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "20",
    ])
    .arg("--cacert")
    .arg(ca);
    if let Some(login) = login {
        curl.args(["-u", login]);
    }
    let out = curl
        .arg(url)
        .output()
        .context("running curl (scripts/setup.sh installs it)")?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nginx_accepts_the_rendered_configuration() {
        let Ok(nginx) = nginx_path() else {
            panic!("nginx is not installed: run scripts/setup.sh");
        };
        let dir = tempfile::tempdir().unwrap();
        let pki = crate::pki::Pki::in_dir(dir.path()).unwrap();
        let config = FrontConfig {
            dir: dir.path().join("front"),
            listen_ip: "127.0.0.1".into(),
            front_port: 1,
            raw_port: 2,
            ui: Some((3, 4)),
        };
        std::fs::create_dir_all(config.dir.join("tmp")).unwrap();
        let issued = pki.issue_named(&[SERVER_NAME], "temporal").unwrap();
        issued.write(&config.dir, "temporal").unwrap();
        std::fs::write(config.htpasswd_file(), "u:{SSHA}x\n").unwrap();
        let denied = mtls::denylist::Entry::of_certificate(b"a certificate");
        std::fs::write(config.denied_map_file(), denied_map(&denied.line("x"))).unwrap();
        assert_eq!(denied_map(&denied.line("x")).lines().count(), 1);
        std::fs::write(config.conf_file(), config.render()).unwrap();
        let out = Command::new(nginx)
            .arg("-t")
            .arg("-e")
            .arg(config.dir.join("err.log"))
            .arg("-c")
            .arg(config.conf_file())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
