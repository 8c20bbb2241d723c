//! Issuing: the project's certificate authority and one certificate per process. `payoutctl pki`
//! is the operator's way in; the test kit and the dev stack issue fresh ones per system.
//! Nothing issued here is committed: setup, the stack and compose's test script generate them.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use crate::{Role, Tls, TlsArgs, TlsError};

const CA_CERT_FILE: &str = "ca.pem";
const CA_KEY_FILE: &str = "ca.key";
const CA_NAME: &str = "payout system certificate authority";
/// How long an issued certificate is valid (the CA: ten times as long). Rotation is reissuing.
pub const VALIDITY_DAYS: i64 = 365;

/// The certificate authority: its certificate and key.
pub struct Authority {
    key: KeyPair,
    cert_pem: String,
}

fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

fn validity(params: &mut CertificateParams, days: i64) {
    let now = rcgen::date_time_ymd(1970, 1, 1)
        + std::time::Duration::from_secs(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        );
    // An hour of slack for clocks a little behind the issuer's.
    params.not_before = now - std::time::Duration::from_secs(3_600);
    params.not_after = now + std::time::Duration::from_secs(days as u64 * 86_400);
}

fn write(path: &Path, contents: &str, private: bool) -> Result<(), TlsError> {
    let result = (|| {
        use std::io::Write;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        if private {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        options.open(path)?.write_all(contents.as_bytes())
    })();
    result.map_err(|source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    })
}

impl Authority {
    /// A new authority (ECDSA P-256 key).
    pub fn create() -> Result<Authority, TlsError> {
        let key = KeyPair::generate()?;
        let mut params = ca_params();
        validity(&mut params, VALIDITY_DAYS * 10);
        let cert = params.self_signed(&key)?;
        Ok(Authority {
            key,
            cert_pem: cert.pem(),
        })
    }

    /// The authority in `dir` (`ca.pem`, `ca.key`); refused if `ca.key` is not there (it is
    /// never made up: a certificate folder whose key was moved away is not an authority).
    pub fn open(dir: &Path) -> Result<Authority, TlsError> {
        let cert = dir.join(CA_CERT_FILE);
        let key = dir.join(CA_KEY_FILE);
        if !key.exists() {
            return Err(TlsError::NoAuthorityKey {
                dir: dir.to_path_buf(),
            });
        }
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| TlsError::Read {
                path: path.to_path_buf(),
                source,
            })
        };
        let key_pair = KeyPair::from_pem(&read(&key)?)?;
        Ok(Authority {
            key: key_pair,
            cert_pem: read(&cert)?,
        })
    }

    /// A new authority in `dir` (`ca.pem`, and `ca.key` mode 0600); refused if either is there.
    pub fn init(dir: &Path) -> Result<Authority, TlsError> {
        for file in [CA_CERT_FILE, CA_KEY_FILE] {
            if dir.join(file).exists() {
                return Err(TlsError::AuthorityExists {
                    dir: dir.to_path_buf(),
                    file,
                });
            }
        }
        std::fs::create_dir_all(dir).map_err(|source| TlsError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let authority = Authority::create()?;
        write(&dir.join(CA_CERT_FILE), &authority.cert_pem, false)?;
        write(&dir.join(CA_KEY_FILE), &authority.key.serialize_pem(), true)?;
        Ok(authority)
    }

    /// The authority in `dir`, made there first if the folder holds none (the local stack's and
    /// the tests' own). A folder with `ca.pem` but no `ca.key` is refused, never overwritten with
    /// a new authority (the silent replacement this used to make).
    pub fn open_or_create(dir: &Path) -> Result<Authority, TlsError> {
        if dir.join(CA_KEY_FILE).exists() || dir.join(CA_CERT_FILE).exists() {
            return Self::open(dir);
        }
        Self::init(dir)
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for one process: its DNS subject name is `role`'s name, its common name is
    /// `instance` (for logs), and it serves as both TLS server and client.
    /// The role is also the subject's organisational unit (`OU=<role>`): a front that cannot read
    /// a certificate's SAN (nginx before Temporal) admits by it; our own services keep the SAN.
    /// An operator's certificate also carries `<instance>.operator` ([`crate::operator_subject`]):
    /// the name its operator actions are recorded under, which must then be one DNS label.
    pub fn issue(&self, role: Role, instance: &str) -> Result<Issued, TlsError> {
        if role != Role::Operator {
            return self.issue_with(&[role.name()], instance, Some(role));
        }
        if !crate::is_operator_name(instance) {
            return Err(TlsError::OperatorName(instance.to_string()));
        }
        self.issue_with(
            &[role.name(), &crate::operator_subject(instance)],
            instance,
            Some(role),
        )
    }

    /// A certificate for a server that is not one of ours (PostgreSQL, etcd), named by what its
    /// clients connect to: DNS names or IP addresses, each checked by the client
    /// (`sslmode=verify-full`). Like [`issue`](Self::issue), it serves as server and client.
    /// A server certificate carries no role, so no `OU`: a front admitting by role refuses it.
    pub fn issue_named(&self, names: &[&str], instance: &str) -> Result<Issued, TlsError> {
        self.issue_with(names, instance, None)
    }

    fn issue_with(
        &self,
        names: &[&str],
        instance: &str,
        role: Option<Role>,
    ) -> Result<Issued, TlsError> {
        let key = KeyPair::generate()?;
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, instance);
        if let Some(role) = role {
            params
                .distinguished_name
                .push(DnType::OrganizationalUnitName, role.name());
        }
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, VALIDITY_DAYS);
        // The issuer is rebuilt from the CA's fixed parameters and its key: the signature and the
        // authority key identifier need nothing else.
        let issuer = Issuer::new(ca_params(), &self.key);
        let cert = params.signed_by(&key, &issuer)?;
        Ok(Issued {
            ca_pem: self.cert_pem.clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Issues a certificate for `instance` and writes it beside the authority's certificate in
    /// `dir` (`<instance>.pem`, `<instance>.key` with mode 0600).
    pub fn issue_to(&self, role: Role, instance: &str, dir: &Path) -> Result<TlsArgs, TlsError> {
        self.issue(role, instance)?.write(dir, instance)
    }
}

/// One issued certificate, its key and the authority's certificate.
pub struct Issued {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl Issued {
    pub fn tls(&self) -> Tls {
        Tls::from_pem(&self.ca_pem, &self.cert_pem, &self.key_pem)
    }

    /// Writes `ca.pem` (if absent), `<name>.pem` and `<name>.key` into `dir`.
    pub fn write(&self, dir: &Path, name: &str) -> Result<TlsArgs, TlsError> {
        std::fs::create_dir_all(dir).map_err(|source| TlsError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let ca = dir.join(CA_CERT_FILE);
        if !ca.exists() {
            write(&ca, &self.ca_pem, false)?;
        }
        let cert: PathBuf = dir.join(format!("{name}.pem"));
        let key: PathBuf = dir.join(format!("{name}.key"));
        write(&cert, &self.cert_pem, false)?;
        write(&key, &self.key_pem, true)?;
        Ok(TlsArgs { ca, cert, key })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 34, row 1e: a certificate folder whose authority key was moved away (as the
    /// deployment guide advises) is refused, never silently replaced by a new authority; a folder
    /// with an authority is never initialised over.
    #[test]
    fn a_folder_without_the_authority_key_is_refused_and_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let authority = Authority::init(dir.path()).unwrap();
        assert!(matches!(
            Authority::init(dir.path()),
            Err(TlsError::AuthorityExists { .. })
        ));
        std::fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
        let before = std::fs::read_to_string(dir.path().join(CA_CERT_FILE)).unwrap();
        assert_eq!(before, authority.cert_pem());
        for refused in [
            Authority::open(dir.path()),
            Authority::open_or_create(dir.path()),
        ] {
            assert!(matches!(refused, Err(TlsError::NoAuthorityKey { .. })));
        }
        assert_eq!(
            std::fs::read_to_string(dir.path().join(CA_CERT_FILE)).unwrap(),
            before,
            "ca.pem untouched"
        );
        assert!(!dir.path().join(CA_KEY_FILE).exists(), "no key made up");
        // Control: an empty folder gets a new authority, which opens again.
        let fresh = tempfile::tempdir().unwrap();
        let made = Authority::open_or_create(fresh.path()).unwrap();
        assert_eq!(
            Authority::open(fresh.path()).unwrap().cert_pem(),
            made.cert_pem()
        );
    }

    #[test]
    fn an_issued_certificate_names_its_role_and_nothing_else() {
        let ca = Authority::create().unwrap();
        let issued = ca.issue(Role::Worker, "worker-0").unwrap();
        let der =
            rustls_pki_types::pem::PemObject::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
        assert_eq!(crate::role_of(&der), Some(Role::Worker));
        let other = ca.issue(Role::Worker, "worker-1").unwrap();
        let other_der: rustls_pki_types::CertificateDer =
            rustls_pki_types::pem::PemObject::from_pem_slice(other.cert_pem.as_bytes()).unwrap();
        assert_ne!(crate::fingerprint(&der), crate::fingerprint(&other_der));
    }

    /// The subject's organisational units, read from the DER without an X.509 parser: each
    /// attribute is the OID 2.5.4.11 (`06 03 55 04 0b`) followed by a string (tag, short length).
    fn organisational_units(pem: &str) -> Vec<String> {
        let der: rustls_pki_types::CertificateDer =
            rustls_pki_types::pem::PemObject::from_pem_slice(pem.as_bytes()).unwrap();
        let bytes = der.as_ref();
        let oid = [0x06, 0x03, 0x55, 0x04, 0x0b];
        bytes
            .windows(oid.len())
            .enumerate()
            .filter(|(_, w)| *w == oid)
            .map(|(at, _)| {
                let len = bytes[at + oid.len() + 1] as usize;
                let start = at + oid.len() + 2;
                String::from_utf8(bytes[start..start + len].to_vec()).unwrap()
            })
            .collect()
    }

    #[test]
    fn a_process_certificate_carries_its_role_as_its_subject_ou_and_a_server_one_none() {
        let ca = Authority::create().unwrap();
        for role in Role::ALL {
            let instance = if role == Role::Operator {
                "alice"
            } else {
                "i-1"
            };
            let issued = ca.issue(role, instance).unwrap();
            assert_eq!(organisational_units(&issued.cert_pem), vec![role.name()]);
        }
        let server = ca
            .issue_named(&["temporal", "127.0.0.1"], "temporal")
            .unwrap();
        assert!(organisational_units(&server.cert_pem).is_empty());
    }

    #[test]
    fn a_reopened_authority_issues_under_the_same_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let first = Authority::open_or_create(dir.path()).unwrap();
        let again = Authority::open_or_create(dir.path()).unwrap();
        assert_eq!(first.cert_pem(), again.cert_pem());
        let issued = again.issue(Role::Operator, "alice").unwrap();
        assert_eq!(issued.ca_pem, first.cert_pem());
    }
}
