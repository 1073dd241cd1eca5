//! The deployment's state directory and its cluster key: one key per deployment, never one
//! shared by every deployment of a host.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The deployment's state directory: the one given (`--state-dir`, or `state_dir` in the
/// file), else `$XDG_STATE_HOME/strata/up/HOST_PORT` (`~/.local/state/...`), named by the
/// router's address, so that a restart of the same deployment finds its key again (L3 pages
/// written under it stay valid) and a second deployment on the host gets its own. A router on
/// port 0 has no stable address: that run gets a directory of its own (`HOST_0-PID`).
pub(super) fn state_dir(given: Option<&Path>, host: &str, router_port: u16) -> Result<PathBuf> {
    if let Some(d) = given {
        if d.exists() && !d.is_dir() {
            bail!("--state-dir {}: not a directory", d.display());
        }
        return Ok(d.to_path_buf());
    }
    let base = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .context("no $HOME or $XDG_STATE_HOME for the deployment's state; give --state-dir")?;
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let name = if router_port == 0 {
        format!("{host}_0-{}", std::process::id())
    } else {
        format!("{host}_{router_port}")
    };
    Ok(base.join("strata").join("up").join(name))
}

/// The cluster key file every process of the deployment gets: the one the deployment names
/// (checked), else `cluster.key` in its state directory, made on first use (64 random hex
/// digits, mode 600, in a directory of mode 700). Says which.
pub(super) fn cluster_key(named: Option<&Path>, state: &Path) -> Result<PathBuf> {
    if let Some(f) = named {
        strata_kv::auth::ClusterKey::from_file(f).context("cluster_key_file")?;
        say!(
            "strata up: using the cluster key {} (named by the deployment)",
            f.display()
        );
        return Ok(f.to_path_buf());
    }
    private_dir(state, true)
        .with_context(|| format!("cannot create the state directory {}", state.display()))?;
    let f = state.join("cluster.key");
    let (_, made) =
        strata_kv::auth::ClusterKey::load_or_create(&f).context("the deployment's cluster key")?;
    say!(
        "strata up: {} this deployment's cluster key {} (mode 600; its router and workers \
         authenticate each other with it, and no other deployment has it)",
        if made { "made" } else { "using" },
        f.display()
    );
    Ok(f)
}

/// The key file a deployment's flags are checked with before anything of it is made: its own
/// (named, or made by an earlier run), else a stand-in made in a directory of its own under
/// the temporary directory and removed when the [`StandIn`] drops, so that a deployment whose
/// flags are refused leaves no state directory or key behind.
pub(super) fn key_for_checks(named: Option<&Path>, state: &Path) -> Result<(PathBuf, StandIn)> {
    if let Some(f) = named {
        return Ok((f.to_path_buf(), StandIn(None)));
    }
    let f = state.join("cluster.key");
    if f.exists() {
        return Ok((f, StandIn(None)));
    }
    let dir = std::env::temp_dir().join(format!(
        "strata-up-check-{}-{}",
        std::process::id(),
        strata_server::ids::fresh_id()
    ));
    // No temporary directory to write in (a read-only one): the deployment's own key is made
    // first, as it would be anyway.
    if private_dir(&dir, false).is_err() {
        return Ok((cluster_key(None, state)?, StandIn(None)));
    }
    let stand_in = StandIn(Some(dir.clone()));
    let k = dir.join("cluster.key");
    strata_kv::auth::ClusterKey::load_or_create(&k).context("a stand-in cluster key")?;
    Ok((k, stand_in))
}

/// Makes `dir` (and, when `parents`, what is above it) readable by its owner only (mode 700).
fn private_dir(dir: &Path, parents: bool) -> std::io::Result<()> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(parents);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        b.mode(0o700);
    }
    b.create(dir)
}

/// A stand-in key's directory, removed on drop.
pub(super) struct StandIn(Option<PathBuf>);

impl Drop for StandIn {
    fn drop(&mut self) {
        if let Some(d) = &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_deployments_get_two_keys_and_a_restart_its_own_again() {
        let root = std::env::temp_dir().join(format!("strata-key-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let a = cluster_key(None, &root.join("a")).unwrap();
        let b = cluster_key(None, &root.join("b")).unwrap();
        let (ta, tb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        assert_ne!(ta, tb);
        assert_eq!(
            std::fs::read(cluster_key(None, &root.join("a")).unwrap()).unwrap(),
            ta
        );
        // A named key is used as is; a bad one is refused.
        assert_eq!(cluster_key(Some(&a), &root.join("c")).unwrap(), a);
        std::fs::write(root.join("bad"), "short").unwrap();
        assert!(cluster_key(Some(&root.join("bad")), &root.join("c")).is_err());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn the_state_directory_is_named_by_the_routers_address() {
        let d = state_dir(None, "127.0.0.1", 8000).unwrap();
        assert!(d.ends_with("strata/up/127.0.0.1_8000"), "{}", d.display());
        let given = Path::new("/srv/strata");
        assert_eq!(state_dir(Some(given), "h", 1).unwrap(), given);
        let any = state_dir(None, "::", 0).unwrap();
        assert!(any.to_string_lossy().contains("--_0-"), "{}", any.display());
        let file = tempfile::NamedTempFile::new().unwrap();
        let e = state_dir(Some(file.path()), "h", 1)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with(": not a directory"), "{e}");
    }
}
