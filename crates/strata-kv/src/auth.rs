//! The cluster key: one secret shared by the router and every worker of a deployment
//! (`--cluster-key-file`, generated per deployment by `strata up`). It never crosses the
//! network: peers prove they hold it with keyed BLAKE3 MACs over fresh nonces (KV-transfer
//! handshake), over a timestamped request line (worker HTTP endpoints), and it keys the
//! checksums of pages stored in L3, so that a page forged or moved under another page's key
//! is a miss.
//!
//! Every use derives its own sub-key with `blake3::derive_key(context, key)`: a MAC made for one
//! purpose is never valid for another.

use std::path::Path;

use thiserror::Error;

/// A deployment's shared secret.
#[derive(Clone)]
pub struct ClusterKey {
    key: [u8; 32],
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(…)")
    }
}

#[derive(Debug, Error)]
pub enum KeyError {
    #[error("cluster key file {path}: {why}")]
    File { path: String, why: String },
}

/// Bytes of secret a key file must hold at least (after trimming whitespace).
pub const MIN_KEY_BYTES: usize = 32;
/// Fewest distinct bytes a key file's secret has (see [`ClusterKey::from_file`]).
const MIN_DISTINCT: usize = 8;

impl ClusterKey {
    /// A key from secret material (e.g. a file's content) of at least [`MIN_KEY_BYTES`].
    pub fn from_secret(secret: &[u8]) -> Option<ClusterKey> {
        (secret.len() >= MIN_KEY_BYTES).then(|| ClusterKey {
            key: blake3::derive_key("strata cluster key v1", secret),
        })
    }

    /// Reads a key file: at least 32 bytes of secret (whitespace around it ignored), readable
    /// by its owner only (like an ssh key: a key others can read is no key).
    pub fn from_file(path: &Path) -> Result<ClusterKey, KeyError> {
        let err = |why: String| KeyError::File {
            path: path.display().to_string(),
            why,
        };
        let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if !meta.is_file() {
            return Err(err("not a regular file".into()));
        }
        if meta.len() > 64 << 10 {
            return Err(err(format!("{} bytes: a key file is small", meta.len())));
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(err(format!(
                    "mode {mode:o} lets others read it: chmod 600 {}",
                    path.display()
                )));
            }
        }
        let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let secret = bytes.trim_ascii();
        // A placeholder (`000…`, `abab…`): random hex has 16 distinct digits in 64, a random
        // secret of 32 bytes about 30; fewer than 8 is no secret.
        let mut seen = [false; 256];
        secret.iter().for_each(|&b| seen[b as usize] = true);
        let distinct = seen.iter().filter(|&&x| x).count();
        if secret.len() >= MIN_KEY_BYTES && distinct < MIN_DISTINCT {
            return Err(err(format!(
                "{distinct} distinct characters in {} bytes: a placeholder, not a secret (make \
                 one: python3 -c 'import secrets; print(secrets.token_hex(32))')",
                secret.len()
            )));
        }
        ClusterKey::from_secret(secret).ok_or_else(|| {
            err(format!(
                "{} bytes of secret: at least {MIN_KEY_BYTES} are needed (e.g. 64 hex digits)",
                secret.len()
            ))
        })
    }

    /// 64 random hex digits: the content of a new key file.
    pub fn generate_secret() -> Result<String, getrandom::Error> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b)?;
        Ok(b.iter().map(|x| format!("{x:02x}")).collect())
    }

    /// Writes a new key file readable by its owner only; returns the key.
    pub fn create_file(path: &Path) -> std::io::Result<ClusterKey> {
        let secret =
            ClusterKey::generate_secret().map_err(|e| std::io::Error::other(e.to_string()))?;
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            o.mode(0o600);
        }
        use std::io::Write;
        let mut f = o.open(path)?;
        f.write_all(secret.as_bytes())?;
        f.write_all(b"\n")?;
        Ok(ClusterKey::from_secret(secret.as_bytes()).expect("64 bytes"))
    }

    /// The key in `path`, made there first if there is none. Safe against concurrent callers:
    /// the new key is written whole to a temporary file, then linked into place (which fails if
    /// another caller got there first; its key is then read).
    pub fn load_or_create(path: &Path) -> Result<(ClusterKey, bool), KeyError> {
        if path.exists() {
            return ClusterKey::from_file(path).map(|k| (k, false));
        }
        let err = |why: String| KeyError::File {
            path: path.display().to_string(),
            why,
        };
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        ClusterKey::create_file(&tmp).map_err(|e| err(e.to_string()))?;
        let linked = std::fs::hard_link(&tmp, path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => ClusterKey::from_file(path).map(|k| (k, true)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                ClusterKey::from_file(path).map(|k| (k, false))
            }
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// A sub-key for one purpose.
    pub fn derive(&self, context: &str) -> [u8; 32] {
        blake3::derive_key(context, &self.key)
    }

    /// MAC of `parts` (each length-prefixed, so no two part lists collide) for `context`.
    pub fn mac(&self, context: &str, parts: &[&[u8]]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.derive(context));
        for p in parts {
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p);
        }
        *h.finalize().as_bytes()
    }

    /// Whether `tag` is the MAC of `parts`, compared in constant time.
    pub fn verify(&self, context: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
        constant_time_eq::constant_time_eq(&self.mac(context, parts), tag)
    }
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes from hex (None: not hex, or odd length).
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_are_bound_to_key_context_and_parts() {
        let k = ClusterKey::from_secret(&[1; 32]).unwrap();
        let k2 = ClusterKey::from_secret(&[2; 32]).unwrap();
        let m = k.mac("a", &[b"x", b"y"]);
        assert!(k.verify("a", &[b"x", b"y"], &m));
        assert!(!k2.verify("a", &[b"x", b"y"], &m), "other key");
        assert!(!k.verify("b", &[b"x", b"y"], &m), "other purpose");
        assert!(!k.verify("a", &[b"xy", b""], &m), "other split");
        assert!(!k.verify("a", &[b"x", b"y"], &m[..31]), "short tag");
        assert!(ClusterKey::from_secret(&[1; 31]).is_none());
    }

    #[test]
    fn key_files_must_be_private_and_long_enough() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("k");
        let k = ClusterKey::create_file(&p).unwrap();
        let again = ClusterKey::from_file(&p).unwrap();
        assert_eq!(k.derive("t"), again.derive("t"));
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = ClusterKey::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        let short = d.path().join("s");
        std::fs::write(&short, "abc").unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = ClusterKey::from_file(&short).unwrap_err().to_string();
        assert!(e.contains("at least 32"), "{e}");
        // A placeholder of the right length is no secret; a phrase of a few words is taken.
        for (text, ok) in [
            ("0".repeat(64), false),
            ("6e".repeat(32), false),
            ("0123456".repeat(10), false),
            ("01234567".repeat(8), true),
            (
                "correct horse battery staple of the harbour".to_string(),
                true,
            ),
        ] {
            std::fs::write(&short, &text).unwrap();
            let r = ClusterKey::from_file(&short);
            assert_eq!(r.is_ok(), ok, "{text}: {:?}", r.err());
            if !ok {
                let e = r.err().unwrap().to_string();
                assert!(e.contains("a placeholder, not a secret"), "{e}");
            }
        }
        assert_eq!(unhex(&hex(&[0, 255, 16])), Some(vec![0, 255, 16]));
        assert_eq!(unhex("zz"), None);
    }
}
