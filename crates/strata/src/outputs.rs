//! A file a command writes when its work is done (`sim --plot`, `bench workload --json`),
//! checked before the work starts: a path that cannot be written is a flag error in a
//! fraction of a second, not the end of a sweep that ran for minutes. The check touches
//! nothing: it asks the kernel whether this user may write there (`access(2)`).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use anyhow::{bail, Result};

/// `path` (the value of `flag`) can be written: anything but a directory that this user may
/// write (a file, `/dev/stdout`, a pipe), or a new name in a directory this user may write.
pub fn check_writable(flag: &str, path: &Path) -> Result<()> {
    let shown = path.display();
    if path.is_dir() {
        bail!("{flag} {shown}: a directory, not a file");
    }
    // An existing file (through its links), or else the directory a new one goes in.
    let target = match std::fs::metadata(path) {
        Ok(_) => path.to_path_buf(),
        Err(_) => {
            let parent = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            if !parent.is_dir() {
                bail!("{flag} {shown}: {} is not a directory", parent.display());
            }
            parent.to_path_buf()
        }
    };
    let c = CString::new(target.as_os_str().as_bytes())?;
    // SAFETY: access(2) on a NUL-terminated path; it reads the path and nothing else.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0 {
        let e = std::io::Error::last_os_error();
        bail!("{flag} {shown}: cannot write {}: {e}", target.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_writable;

    #[test]
    fn a_directory_or_a_missing_directory_is_refused_and_nothing_is_touched() {
        let d = tempfile::tempdir().unwrap();
        let e = check_writable("--plot", d.path()).unwrap_err().to_string();
        assert!(e.ends_with("a directory, not a file"), "{e}");
        let missing = d.path().join("no/such/dir/plot.svg");
        let e = check_writable("--plot", &missing).unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");
        let fresh = d.path().join("plot.svg");
        check_writable("--plot", &fresh).unwrap();
        assert!(!fresh.exists(), "the check made a file");
        std::fs::write(&fresh, "kept").unwrap();
        check_writable("--plot", &fresh).unwrap();
        assert_eq!(std::fs::read_to_string(&fresh).unwrap(), "kept");
        // Not regular files, but written as before.
        check_writable("--json", std::path::Path::new("/dev/null")).unwrap();
    }
}
