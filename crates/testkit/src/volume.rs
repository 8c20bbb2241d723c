//! A size-capped filesystem under one store's data (a PostgreSQL server's `pg_wal`, an etcd
//! member's data directory), so a test can fill it and see what the store does when its disk is
//! full, then free it and see it recover. This is a real filesystem with a real bound: a `tmpfs`
//! mounted with `size=`, whose writes fail with `ENOSPC` once it is full, exactly as a full
//! volume's do. A deployment puts WAL on its own volume for the same reason: that volume is the
//! one that fills.
//!
//! Needs root (`mount`); [`CappedVolume::mount`] says why not where it is refused. The mount's
//! source is named after this process (`payout-vol-<pid>`), so a run killed before it unmounted
//! is swept by the next one ([`CappedVolume::remove_stale`]).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The ballast file a [`CappedVolume::fill`] writes, at the volume's root.
const BALLAST: &str = "ballast.fill";
/// The mount source's prefix; the owner's pid follows.
const SOURCE_PREFIX: &str = "payout-vol-";

pub struct CappedVolume {
    path: PathBuf,
    size_bytes: u64,
}

impl std::fmt::Debug for CappedVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CappedVolume")
            .field("path", &self.path)
            .field("size_bytes", &self.size_bytes)
            .finish()
    }
}

impl CappedVolume {
    /// Mounts a filesystem of `size_bytes` at `path` (created if missing, and which must be
    /// empty), owned by `owner` if given.
    pub fn mount(path: &Path, size_bytes: u64, owner: Option<(u32, u32)>) -> anyhow::Result<Self> {
        Self::remove_stale();
        std::fs::create_dir_all(path)?;
        anyhow::ensure!(
            std::fs::read_dir(path)?.next().is_none(),
            "{} is not empty: a capped volume is mounted over an empty directory",
            path.display()
        );
        let mut options = format!("size={size_bytes},mode=0700");
        if let Some((uid, gid)) = owner {
            options.push_str(&format!(",uid={uid},gid={gid}"));
        }
        let source = format!("{SOURCE_PREFIX}{}", std::process::id());
        crate::netns::run(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                &options,
                &source,
                &path.to_string_lossy(),
            ],
        )
        .with_context(|| format!("mounting a {size_bytes}-byte volume at {}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            size_bytes,
        })
    }

    /// Whether capped volumes can be made here: `Err` says why not (no root, no tmpfs).
    pub fn available() -> Result<(), String> {
        let probe = std::env::temp_dir().join(format!("payout-vol-probe-{}", std::process::id()));
        let result = Self::mount(&probe, 1 << 20, None)
            .map(drop)
            .map_err(|e| format!("{e:#}"));
        let _ = std::fs::remove_dir(&probe);
        result
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Bytes free on the volume now.
    pub fn free_bytes(&self) -> anyhow::Result<u64> {
        statvfs_free(&self.path)
    }

    /// Fills the volume: a ballast file written until the filesystem refuses (`ENOSPC`), first
    /// in MiB chunks, then page by page, so nothing is left for the store's next allocation.
    /// Answers the ballast's size.
    pub fn fill(&self) -> anyhow::Result<u64> {
        let path = self.path.join(BALLAST);
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let mut written = 0u64;
        for chunk in [1usize << 20, 4096, 512] {
            let block = vec![0xa5u8; chunk];
            loop {
                match file.write(&block) {
                    Ok(0) => break,
                    Ok(n) => written += n as u64,
                    Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                    Err(e) => return Err(e).context("writing the ballast"),
                }
            }
        }
        // tmpfs takes the bytes at write: nothing to flush to make them count.
        Ok(written)
    }

    /// Deletes the ballast (idempotent).
    pub fn free(&self) -> anyhow::Result<()> {
        match std::fs::remove_file(self.path.join(BALLAST)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).context("removing the ballast"),
        }
    }

    /// Unmounts the volumes of processes that no longer exist (a killed run's). Lazy: a volume
    /// some process still holds open goes when the last one lets go.
    pub fn remove_stale() {
        let Ok(mounts) = std::fs::read_to_string("/proc/mounts") else {
            return;
        };
        for line in mounts.lines() {
            let mut fields = line.split_whitespace();
            let (Some(source), Some(target)) = (fields.next(), fields.next()) else {
                continue;
            };
            let Some(pid) = source
                .strip_prefix(SOURCE_PREFIX)
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if !crate::util::pid_alive(pid) {
                let _ = crate::netns::run("umount", &["-l", target]);
            }
        }
    }
}

/// Free bytes of the filesystem holding `path` (`statvfs`: blocks available to an unprivileged
/// writer times the fragment size).
fn statvfs_free(path: &Path) -> anyhow::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `stat` a valid out-pointer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut stat) };
    anyhow::ensure!(
        rc == 0,
        "statvfs {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    Ok(stat.f_bavail as u64 * stat.f_frsize as u64)
}

impl Drop for CappedVolume {
    /// Unmounts (lazily: a store still running on it lets go when it exits).
    fn drop(&mut self) {
        let _ = crate::netns::run("umount", &["-l", &self.path.to_string_lossy()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mounted(path: &Path) -> bool {
        std::fs::read_to_string("/proc/mounts")
            .unwrap()
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some(&*path.to_string_lossy()))
    }

    /// The bound is real: filled, the volume has no page left and a write is refused ENOSPC;
    /// freed, the space is back; dropped, the mount is gone.
    #[test]
    fn a_capped_volume_fills_refuses_frees_and_unmounts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vol");
        let volume = CappedVolume::mount(&path, 4 << 20, None).expect("mount (root and tmpfs)");
        assert!(mounted(&path));
        std::fs::write(path.join("data"), vec![1u8; 1 << 20]).unwrap();
        let ballast = volume.fill().unwrap();
        assert!(ballast >= 2 << 20, "ballast {ballast}");
        assert!(volume.free_bytes().unwrap() < 4096);
        let refused = std::fs::write(path.join("more"), [0u8; 8192]).unwrap_err();
        assert_eq!(refused.raw_os_error(), Some(libc::ENOSPC), "{refused}");
        volume.free().unwrap();
        assert!(volume.free_bytes().unwrap() >= 2 << 20);
        std::fs::write(path.join("more"), [0u8; 8192]).expect("room again");
        drop(volume);
        assert!(!mounted(&path), "unmounted on drop");
    }
}
