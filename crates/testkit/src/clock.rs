//! Wall clocks a test can step: a process started under libfaketime (Debian's `faketime` package,
//! `scripts/setup.sh`) reads its `CLOCK_REALTIME` offset from a file of its own, which
//! [`MovableClocks::set_offset`] rewrites while it runs (issue 36's `clock_jump`,
//! docs/design/fault-suite section 2).
//!
//! What is moved is what an NTP step or a VM's resume moves: `CLOCK_REALTIME` (Rust's
//! `SystemTime`) only. Monotonic clocks (`Instant`: tokio's timers, the lock client's deadlines,
//! the lock history's timestamps) are left alone. Only dynamically linked programs that read the
//! clock through libc are affected (our Rust services); Go servers (etcd, Temporal) read the vDSO
//! themselves and are not started under it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;

use crate::process::ProcessSpec;

/// Where libfaketime is installed, by distribution: Debian's multiarch directory first, then
/// the layouts of other distributions and of a `make install`.
fn candidate_libraries() -> Vec<PathBuf> {
    let arch = std::env::consts::ARCH;
    [
        format!("/usr/lib/{arch}-linux-gnu/faketime"),
        "/usr/lib64/faketime".to_string(),
        "/usr/lib/faketime".to_string(),
        "/usr/local/lib/faketime".to_string(),
    ]
    .into_iter()
    .map(|dir| Path::new(&dir).join("libfaketime.so.1"))
    .collect()
}

/// A file's offset is re-read at most this long after it changed (libfaketime's
/// `FAKETIME_CACHE_DURATION`, whole seconds; its default is 10 s). One second keeps a step prompt
/// without reading the file on every clock call, which `FAKETIME_NO_CACHE` would.
pub const OFFSET_CACHE_S: u64 = 1;

/// The processes of one system whose wall clocks can be stepped: the library and the folder of
/// their offset files (`<folder>/<process name>`).
#[derive(Debug, Clone)]
pub struct MovableClocks {
    library: PathBuf,
    dir: PathBuf,
}

impl MovableClocks {
    /// libfaketime found and working on this machine, with the offset files in `dir`; or why
    /// not (no library, or a probe under it that did not see a moved clock).
    pub fn find(dir: &Path) -> Result<Self, String> {
        let candidates = candidate_libraries();
        let library = candidates.iter().find(|p| p.is_file()).ok_or_else(|| {
            format!(
                "libfaketime not found (looked for {}; Debian's package is faketime, scripts/setup.sh)",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
        probe(library)?;
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(Self {
            library: library.clone(),
            dir: dir.to_path_buf(),
        })
    }

    fn file(&self, process: &str) -> PathBuf {
        self.dir.join(process)
    }

    /// `spec` started under libfaketime, its offset read from the file named after it (written
    /// `+0` here if it does not exist yet; an existing offset is kept, as for a restart).
    pub fn apply(&self, spec: ProcessSpec) -> anyhow::Result<ProcessSpec> {
        let file = self.file(&spec.name);
        if !file.exists() {
            write_offset(&file, 0)?;
        }
        Ok(spec
            .env("LD_PRELOAD", self.library.display().to_string())
            .env("FAKETIME_TIMESTAMP_FILE", file.display().to_string())
            // A real step moves CLOCK_REALTIME only; timers and lease deadlines are monotonic.
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("FAKETIME_CACHE_DURATION", OFFSET_CACHE_S.to_string())
            // Files' times are the kernel's: a step does not rewrite the times already on disk
            // (and the certificate denylist's reload compares them).
            .env("NO_FAKE_STAT", "1"))
    }

    /// Steps `process`'s wall clock to `offset_s` seconds from the real time (0: the real time
    /// again), within [`OFFSET_CACHE_S`]. Refused for a process not started by [`Self::apply`].
    pub fn set_offset(&self, process: &str, offset_s: i64) -> anyhow::Result<()> {
        let file = self.file(process);
        anyhow::ensure!(
            file.exists(),
            "{process} was not started with a movable clock"
        );
        write_offset(&file, offset_s)
    }
}

/// libfaketime's relative offset in seconds (`+300`, `-420`; its default unit), written whole by
/// a rename so the library never reads a half-written file.
fn write_offset(file: &Path, offset_s: i64) -> anyhow::Result<()> {
    let text = format!("{offset_s:+}\n");
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, file).with_context(|| format!("renaming to {}", file.display()))
}

/// A day ahead under the library, as `date` sees it: the preload works on this machine.
fn probe(library: &Path) -> Result<(), String> {
    const AHEAD_S: i64 = 86_400;
    let seconds = |cmd: &mut Command| -> Result<i64, String> {
        let out = cmd
            .args(["-u", "+%s"])
            .output()
            .map_err(|e| format!("running date: {e}"))?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|e| format!("date's answer under libfaketime: {e}"))
    };
    let real = seconds(&mut Command::new("date"))?;
    let moved = seconds(
        Command::new("date")
            .env("LD_PRELOAD", library)
            .env("FAKETIME", format!("{AHEAD_S:+}")),
    )?;
    // The two readings are a moment apart; a minute's slack.
    if (moved - real - AHEAD_S).abs() > 60 {
        return Err(format!(
            "{} loaded but did not move the clock (date said {moved}, real {real})",
            library.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file holds libfaketime's relative offset in seconds, signed, `+0` for the real time.
    #[test]
    fn an_offset_is_written_whole_in_seconds_with_its_sign() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("payment-resource");
        for (offset_s, text) in [(0, "+0\n"), (300, "+300\n"), (-420, "-420\n")] {
            write_offset(&file, offset_s).unwrap();
            assert_eq!(std::fs::read_to_string(&file).unwrap(), text);
        }
        assert!(!file.with_extension("tmp").exists());
    }

    /// Only a process started with a movable clock has a file to move.
    #[test]
    fn a_process_without_a_clock_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let clocks = MovableClocks {
            library: PathBuf::from("/nonexistent/libfaketime.so.1"),
            dir: dir.path().to_path_buf(),
        };
        assert!(clocks.set_offset("lock-server", 60).is_err());
        let spec = clocks
            .apply(ProcessSpec::new(
                "lock-server",
                "/bin/true",
                dir.path().join("log"),
            ))
            .unwrap();
        assert_eq!(spec.env["FAKETIME_DONT_FAKE_MONOTONIC"], "1");
        clocks.set_offset("lock-server", 60).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("lock-server")).unwrap(),
            "+60\n"
        );
    }
}
