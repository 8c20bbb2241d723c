//! The certificate denylist: a leaked certificate cut off without a new authority.
//!
//! Every server's authorisation layer ([`crate::authz::Authorize`]) computes each caller's
//! certificate fingerprint (SHA-256 of its DER) on every call; a fingerprint on this list is
//! refused `PERMISSION_DENIED` `certificate_denied` before the role is looked at, health checks
//! included, on a connection opened before the denial too (per request, not per handshake).
//! Denying needs no authority key, so the answer to a leak works while the authority is offline or
//! being replaced. Rotation by short-lived certificates was the alternative; it would end every
//! lock session at each rotation (sessions are bound to their creator's certificate), and renewal
//! needs an issuer online for every service: services/lock-server/RESTORE.md, "Certificates".
//!
//! The file: one certificate per line, `sha256:<64 hex> [sha1:<40 hex>] [# comment]` (the SHA-1 is
//! what nginx's Temporal front can match, `$ssl_client_fingerprint`); blank lines and `#` lines
//! are comments. `payoutctl pki deny` appends a line. A malformed line stops a server at start,
//! naming the line; a reload that fails keeps the list in force and is counted. The servers poll
//! the file's modification time ([`RELOAD_MS`]), so a denial takes effect everywhere within
//! seconds.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

/// How often a server looks at the file for a change.
pub const RELOAD_MS: u64 = 5_000;

#[derive(Debug, thiserror::Error)]
pub enum DenylistError {
    #[error("reading the certificate denylist {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the certificate denylist {path}, line {line}: {problem}")]
    Line {
        path: PathBuf,
        line: usize,
        problem: String,
    },
}

/// One denied certificate: its fingerprints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub sha256: [u8; 32],
    pub sha1: Option<[u8; 20]>,
}

impl Entry {
    /// The line `payoutctl pki deny` writes for a certificate (DER).
    pub fn of_certificate(der: &[u8]) -> Self {
        let sha256 = ring::digest::digest(&ring::digest::SHA256, der);
        let sha1 = ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, der);
        let mut entry = Entry {
            sha256: [0; 32],
            sha1: Some([0; 20]),
        };
        entry.sha256.copy_from_slice(sha256.as_ref());
        if let Some(s) = entry.sha1.as_mut() {
            s.copy_from_slice(sha1.as_ref());
        }
        entry
    }

    pub fn line(&self, comment: &str) -> String {
        let mut line = format!("sha256:{}", hex(&self.sha256));
        if let Some(sha1) = &self.sha1 {
            line.push_str(&format!(" sha1:{}", hex(sha1)));
        }
        let comment = comment.replace(['\n', '\r'], " ");
        if !comment.trim().is_empty() {
            line.push_str(&format!(" # {}", comment.trim()));
        }
        line
    }
}

/// The entry of a certificate in PEM (its first certificate), or `None` if it holds none.
pub fn entry_of_pem(pem: &[u8]) -> Option<Entry> {
    use rustls_pki_types::pem::PemObject;
    rustls_pki_types::CertificateDer::from_pem_slice(pem)
        .ok()
        .map(|der| Entry::of_certificate(der.as_ref()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// The entries of a denylist's text, or the first bad line.
pub fn parse(text: &str) -> Result<Vec<Entry>, (usize, String)> {
    let mut entries = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let content = raw.split('#').next().unwrap_or("").trim();
        if content.is_empty() {
            continue;
        }
        let mut sha256 = None;
        let mut sha1 = None;
        for field in content.split_whitespace() {
            if let Some(h) = field.strip_prefix("sha256:") {
                sha256 =
                    Some(unhex::<32>(&h.to_ascii_lowercase()).ok_or_else(|| {
                        (i + 1, format!("{field:?} is not sha256:<64 hex digits>"))
                    })?);
            } else if let Some(h) = field.strip_prefix("sha1:") {
                sha1 =
                    Some(unhex::<20>(&h.to_ascii_lowercase()).ok_or_else(|| {
                        (i + 1, format!("{field:?} is not sha1:<40 hex digits>"))
                    })?);
            } else {
                return Err((
                    i + 1,
                    format!("{field:?}: a line is sha256:<hex> [sha1:<hex>] [# comment]"),
                ));
            }
        }
        let sha256 = sha256.ok_or_else(|| (i + 1, "no sha256:<hex> on the line".to_string()))?;
        entries.push(Entry { sha256, sha1 });
    }
    Ok(entries)
}

#[derive(Default)]
struct Loaded {
    denied: HashSet<[u8; 32]>,
    modified: Option<SystemTime>,
}

/// A server's denylist: the file it came from and the fingerprints in force.
pub struct Denylist {
    path: Option<PathBuf>,
    loaded: RwLock<Arc<Loaded>>,
}

impl std::fmt::Debug for Denylist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Denylist")
            .field("path", &self.path)
            .field("entries", &self.len())
            .finish()
    }
}

impl Denylist {
    /// Nothing denied, no file: the in-memory test servers (`Tls::from_pem`).
    pub fn empty() -> Arc<Self> {
        Arc::new(Self {
            path: None,
            loaded: RwLock::new(Arc::new(Loaded::default())),
        })
    }

    /// Reads `path`; a missing file or a bad line is an error (a server does not start on a list
    /// it cannot read: a typo must not mean "nothing denied"). The file may be empty.
    pub fn load(path: &Path) -> Result<Arc<Self>, DenylistError> {
        let list = Self {
            path: Some(path.to_path_buf()),
            loaded: RwLock::new(Arc::new(Loaded::default())),
        };
        list.read()?;
        Ok(Arc::new(list))
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    fn read(&self) -> Result<(), DenylistError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let read_err = |source| DenylistError::Read {
            path: path.clone(),
            source,
        };
        let modified = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .map_err(read_err)?;
        let text = std::fs::read_to_string(path).map_err(read_err)?;
        let entries = parse(&text).map_err(|(line, problem)| DenylistError::Line {
            path: path.clone(),
            line,
            problem,
        })?;
        *self.loaded.write().expect("denylist") = Arc::new(Loaded {
            denied: entries.into_iter().map(|e| e.sha256).collect(),
            modified: Some(modified),
        });
        Ok(())
    }

    /// Reads the file again if it changed since the last reading. `Ok(true)`: a new list is in
    /// force; an error keeps the previous one.
    pub fn reload_if_changed(&self) -> Result<bool, DenylistError> {
        let Some(path) = &self.path else {
            return Ok(false);
        };
        let modified = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .map_err(|source| DenylistError::Read {
                path: path.clone(),
                source,
            })?;
        if self.loaded.read().expect("denylist").modified == Some(modified) {
            return Ok(false);
        }
        self.read()?;
        Ok(true)
    }

    pub fn is_denied(&self, fingerprint: &[u8; 32]) -> bool {
        self.loaded
            .read()
            .expect("denylist")
            .denied
            .contains(fingerprint)
    }

    pub fn len(&self) -> usize {
        self.loaded.read().expect("denylist").denied.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Appends `entry` to the denylist at `path` (created if missing) with one write of a whole line,
/// made durable before returning.
pub fn append(path: &Path, entry: &Entry, comment: &str) -> std::io::Result<()> {
    use std::io::Write;
    let existing = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    if let Ok(entries) = parse(&existing) {
        if entries.iter().any(|e| e.sha256 == entry.sha256) {
            return Ok(());
        }
    }
    let mut line = String::new();
    if !existing.is_empty() && !existing.ends_with('\n') {
        line.push('\n');
    }
    line.push_str(&entry.line(comment));
    line.push('\n');
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    file.write_all(line.as_bytes())?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_and_a_bad_line_is_named() {
        let a = Entry::of_certificate(b"certificate a");
        let text = format!(
            "# denied certificates\n\n{}\nsha256:{}   # another\n",
            a.line("leaked 2026-12-06, INC-42"),
            "AB".repeat(32)
        );
        let entries = parse(&text).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0], a);
        assert_eq!(entries[1].sha256, [0xab; 32]);
        for bad in ["sha256:abc", "sha1:00", "md5:00", "sha256:zz", "hello"] {
            assert_eq!(parse(&format!("\n{bad}\n")).unwrap_err().0, 2, "{bad}");
        }
    }

    #[test]
    fn a_denial_is_in_force_after_a_reload_and_a_bad_file_keeps_the_last_list() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("denylist");
        std::fs::write(&path, "").unwrap();
        let list = Denylist::load(&path).unwrap();
        let a = Entry::of_certificate(b"a");
        assert!(!list.is_denied(&a.sha256));
        append(&path, &a, "leaked").unwrap();
        append(&path, &a, "twice").unwrap();
        // The file's time may not have moved within its resolution: force a new one.
        let later = SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(later)
            .unwrap();
        assert!(list.reload_if_changed().unwrap());
        assert!(list.is_denied(&a.sha256));
        assert_eq!(list.len(), 1);
        std::fs::write(&path, "garbage\n").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(later + std::time::Duration::from_secs(5))
            .unwrap();
        assert!(list.reload_if_changed().is_err());
        assert!(
            list.is_denied(&a.sha256),
            "the last good list stays in force"
        );
        assert!(Denylist::load(&dir.path().join("missing")).is_err());
    }
}
