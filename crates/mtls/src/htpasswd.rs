//! The Temporal UI's login: one `htpasswd` line per user, which the front (nginx's `auth_basic`)
//! checks. The password is made here (random, never chosen by hand) and the line stores only its
//! salted SHA-1 (`{SSHA}`, a scheme nginx reads natively without an external `htpasswd` tool).
//! SHA-1 is what that scheme is; the password's 32 random characters (about 190 bits) are what
//! keeps it unguessable, not the hash's strength.

use ring::rand::{SecureRandom, SystemRandom};

/// Characters of a made password: letters and digits, so it survives any shell and any header.
const PASSWORD_ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
/// Length of a made password: 32 characters of 62 is about 190 bits.
pub const PASSWORD_LEN: usize = 32;
/// Salt bytes of an `{SSHA}` line (the scheme's usual size).
const SALT_LEN: usize = 8;
/// The longest user name taken (a name is a label in logs and the UI's login prompt).
const NAME_LEN_MAX: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum UiUserError {
    #[error("{0:?} cannot be a UI user's name: 1 to 64 characters of [A-Za-z0-9._-]")]
    BadName(String),
    #[error("the system's random source failed")]
    Random,
}

/// A user of the UI: the password (give it to the person, never store it beside the line) and
/// the `name:{SSHA}...` line for the front's `htpasswd` file.
pub struct UiUser {
    pub name: String,
    pub password: String,
    pub line: String,
}

impl std::fmt::Debug for UiUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UiUser")
            .field("name", &self.name)
            .field("line", &self.line)
            .finish_non_exhaustive()
    }
}

/// A new user `name` with a random password.
pub fn ui_user(name: &str) -> Result<UiUser, UiUserError> {
    if name.is_empty()
        || name.len() > NAME_LEN_MAX
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    {
        return Err(UiUserError::BadName(name.to_string()));
    }
    let password = random_password()?;
    let random = SystemRandom::new();
    let mut salt = [0u8; SALT_LEN];
    random.fill(&mut salt).map_err(|_| UiUserError::Random)?;
    let line = ssha_line(name, &password, &salt);
    Ok(UiUser {
        name: name.to_string(),
        password,
        line,
    })
}

/// A new random password: [`PASSWORD_LEN`] letters and digits, each equally likely (also the
/// monitoring logins' passwords, whose bcrypt lines `htpasswd` makes).
pub fn random_password() -> Result<String, UiUserError> {
    let random = SystemRandom::new();
    // 256 is not a multiple of 62: the few values above the last whole multiple are drawn again,
    // so every character is equally likely.
    let limit = (256 / PASSWORD_ALPHABET.len() * PASSWORD_ALPHABET.len()) as u8;
    let mut password = String::with_capacity(PASSWORD_LEN);
    while password.len() < PASSWORD_LEN {
        let mut byte = [0u8; 1];
        random.fill(&mut byte).map_err(|_| UiUserError::Random)?;
        if byte[0] < limit {
            password.push(PASSWORD_ALPHABET[byte[0] as usize % PASSWORD_ALPHABET.len()] as char);
        }
    }
    Ok(password)
}

/// `name:{SSHA}base64(sha1(password ‖ salt) ‖ salt)`.
pub fn ssha_line(name: &str, password: &str, salt: &[u8]) -> String {
    let mut input = password.as_bytes().to_vec();
    input.extend_from_slice(salt);
    let digest = ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, &input);
    let mut stored = digest.as_ref().to_vec();
    stored.extend_from_slice(salt);
    format!("{name}:{{SSHA}}{}", base64(&stored))
}

/// Standard base64 with padding (RFC 4648 section 4): the one encoding the line needs, not
/// worth a dependency.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 0x3f) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_is_the_salted_sha1_scheme_nginx_reads() {
        // Python: base64.b64encode(sha1(b'correct horse' + salt).digest() + salt)
        let salt = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(
            ssha_line("alice", "correct horse", &salt),
            "alice:{SSHA}NSZEu/ZzEMKdBO5ESNEYml3qKRYBAgMEBQYHCA=="
        );
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
    }

    #[test]
    fn a_made_user_has_a_fresh_long_password_and_a_bad_name_is_refused() {
        let a = ui_user("operator").unwrap();
        let b = ui_user("operator").unwrap();
        assert_eq!(a.password.len(), PASSWORD_LEN);
        assert!(a.password.chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a.password, b.password);
        assert!(a.line.starts_with("operator:{SSHA}"), "{}", a.line);
        assert!(!format!("{a:?}").contains(&a.password));
        for bad in ["", "a b", "x:y", &"n".repeat(65)] {
            assert!(
                matches!(ui_user(bad), Err(UiUserError::BadName(_))),
                "{bad:?}"
            );
        }
    }
}
