//! The Kubernetes manifests under deploy/kubernetes, checked offline by
//! deploy/kubernetes/check.py: valid against Kubernetes' schemas (strict), memory requests equal
//! to `strata plan`'s per-server figures for the flags they pass, flags that `strata` knows,
//! worker URLs that name the StatefulSets' pods, and the dashboards ConfigMap up to date.

use std::process::Command;

#[test]
fn the_manifests_validate_and_match_the_plan() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let o = Command::new("python3")
        .arg(format!("{root}/deploy/kubernetes/check.py"))
        .args(["--strata", env!("CARGO_BIN_EXE_strata")])
        .output()
        .expect("python3 (scripts/test.sh installs it and kubernetes-validate)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{text}");
    assert!(text.contains("valid against Kubernetes"), "{text}");
    assert!(text.contains("strata-decode: memory"), "{text}");
}
