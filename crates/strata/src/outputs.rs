//! A file a command writes when its work is done (`sim --plot`, `bench workload --json`),
//! checked before the work starts: a path that cannot be written is a flag error in a
//! fraction of a second, not the end of a sweep that ran for minutes. Nothing is written or
//! truncated by the check.

use std::path::Path;

use anyhow::{bail, Result};

/// `path` (the value of `flag`) can be written: an existing regular file this user may open
/// for writing (not truncated here), or a new name in an existing directory (made and removed
/// again, to learn that it may be).
pub fn check_writable(flag: &str, path: &Path) -> Result<()> {
    let shown = path.display();
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => bail!("{flag} {shown}: not a regular file"),
        Ok(_) => match std::fs::OpenOptions::new().append(true).open(path) {
            Ok(_) => Ok(()),
            Err(e) => bail!("{flag} {shown}: cannot write it: {e}"),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
            {
                Ok(_) => {
                    let _ = std::fs::remove_file(path);
                    Ok(())
                }
                Err(e) => bail!("{flag} {shown}: cannot create it: {e}"),
            }
        }
        Err(e) => bail!("{flag} {shown}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::check_writable;

    #[test]
    fn a_directory_or_a_missing_directory_is_refused_and_nothing_is_left_behind() {
        let d = tempfile::tempdir().unwrap();
        let e = check_writable("--plot", d.path()).unwrap_err().to_string();
        assert!(e.ends_with("not a regular file"), "{e}");
        let missing = d.path().join("no/such/dir/plot.svg");
        let e = check_writable("--plot", &missing).unwrap_err().to_string();
        assert!(e.contains("cannot create it"), "{e}");
        let fresh = d.path().join("plot.svg");
        check_writable("--plot", &fresh).unwrap();
        assert!(!fresh.exists(), "the check left a file behind");
        std::fs::write(&fresh, "kept").unwrap();
        check_writable("--plot", &fresh).unwrap();
        assert_eq!(std::fs::read_to_string(&fresh).unwrap(), "kept");
    }
}
