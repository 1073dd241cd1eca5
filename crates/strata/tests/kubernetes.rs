//! The Kubernetes manifests under deploy/kubernetes, checked offline by
//! deploy/kubernetes/check.py: valid against Kubernetes' schemas (strict), memory requests equal
//! to `strata plan`'s per-server figures for the flags they pass (the model file's own plan:
//! the runtime memory covers its weights and forward pass), flags that `strata` knows, worker
//! URLs that name the StatefulSets' pods, and the dashboards ConfigMap up to date.

use std::path::Path;
use std::process::{Command, Output};

use strata_model::fetch::{cache_dir, MODEL_FILE};

/// check.py at `root` (a copy of deploy/ or the repository's), with the model the pods name.
fn check(root: &Path) -> (Output, String) {
    let models = cache_dir();
    assert!(
        models.join(MODEL_FILE).exists(),
        "{} is missing: run `strata model fetch` (scripts/test.sh does it first)",
        models.join(MODEL_FILE).display()
    );
    let o = Command::new("python3")
        .arg(root.join("deploy/kubernetes/check.py"))
        .args(["--strata", env!("CARGO_BIN_EXE_strata")])
        .arg("--model-dir")
        .arg(&models)
        .output()
        .expect("python3 (scripts/test.sh installs it and kubernetes-validate)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o, text)
}

#[test]
fn the_manifests_validate_and_match_the_plan() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let (o, text) = check(root);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("valid against Kubernetes"), "{text}");
    assert!(text.contains("strata-decode: memory"), "{text}");
    assert!(
        text.contains("strata-decode: runtime 1073741824 bytes covers the weights"),
        "{text}"
    );

    // A runtime memory below the weights and the forward pass is refused, naming both.
    let d = tempfile::tempdir().unwrap();
    for sub in ["kubernetes", "grafana"] {
        copy_dir(
            &root.join("deploy").join(sub),
            &d.path().join("deploy").join(sub),
        );
    }
    let cm = d.path().join("deploy/kubernetes/configmap.yaml");
    let text = std::fs::read_to_string(&cm).unwrap();
    let small = text.replace("STRATA_RUNTIME_MEMORY: 1Gi", "STRATA_RUNTIME_MEMORY: 200Mi");
    assert_ne!(small, text, "the ConfigMap sets STRATA_RUNTIME_MEMORY: 1Gi");
    std::fs::write(&cm, small).unwrap();
    let (o, text) = check(d.path());
    assert!(!o.status.success(), "{text}");
    assert!(
        text.contains("STRATA_RUNTIME_MEMORY 209715200 bytes does not cover the weights"),
        "{text}"
    );
    std::fs::copy(root.join("deploy/kubernetes/configmap.yaml"), &cm).unwrap();

    // A liveness probe that would restart a worker still loading a large model is refused.
    let sts = d.path().join("deploy/kubernetes/decode.yaml");
    let text = std::fs::read_to_string(&sts).unwrap();
    let short = text.replace("failureThreshold: 180", "failureThreshold: 3");
    assert_ne!(
        short, text,
        "the decode workers' startup probe waits 180 periods"
    );
    std::fs::write(&sts, short).unwrap();
    let (o, text) = check(d.path());
    assert!(!o.status.success(), "{text}");
    assert!(
        text.contains("strata-decode: a liveness probe with a startup probe of 30 s"),
        "{text}"
    );
}

/// `from` copied to `to`, recursively (the manifests and dashboards: small files).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}
