//! The live miss-ratio curve on a worker's `/metrics`: every tier's points at 0.25× to 8× its
//! pages, rising with the size, counting every admitted prompt's whole pages, in a memory that
//! does not change with the traffic; `--curve-pages 0` turns it off.

use std::path::Path;

use strata_test_support::{
    metrics_text, port_after, post_json, sample, tiny_model_with_context, Proc,
};

fn serve(model: &Path, extra: &[&str]) -> (Proc, u16) {
    let mut args: Vec<String> = ["serve", "--port", "0", "--page-size", "16"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(["--device-mem", "1MiB", "--hicache-size", "2MiB"].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--model".into(), model.display().to_string()]);
    let mut p = Proc::start(env!("CARGO_BIN_EXE_strata"), &args);
    let port = port_after(&p.wait_for("ready on http://", 60), "ready on http://");
    (p, port)
}

fn ask(port: u16, prompt: &[u32]) {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
    let r = post_json(port, "/v1/completions", &body);
    assert!(r["choices"][0]["text"].is_string(), "{r}");
}

#[test]
fn the_curve_rises_with_the_size_and_counts_every_prompt_page() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model_with_context(d.path(), 2048);
    let (_w, port) = serve(&model, &[]);
    let before = metrics_text(port);
    let memory = sample(&before, "strata_cache_curve_memory_bytes");
    assert!(memory > 0.0, "{before}");
    // A 320-token document read three times between 12 others: 20 pages each.
    let doc: Vec<u32> = (0..320).map(|j| 3 + (j * 7) % 250).collect();
    let mut pages = 0;
    for i in 0..15u32 {
        let p: Vec<u32> = if i % 5 == 0 {
            doc.clone()
        } else {
            (0..320).map(|j| 3 + (i * 131 + j * 17) % 250).collect()
        };
        ask(port, &p);
        pages += p.len() / 16;
    }
    let m = metrics_text(port);
    assert_eq!(
        sample(&m, "strata_cache_curve_references_total"),
        pages as f64,
        "{m}"
    );
    assert_eq!(sample(&m, "strata_cache_curve_memory_bytes"), memory);
    assert_eq!(sample(&m, "strata_cache_curve_sample_rate"), 1.0);
    for tier in ["device", "host"] {
        let at = |scale: &str| {
            let k = format!("strata_cache_curve_hit_ratio{{tier=\"{tier}\",scale=\"{scale}\"}}");
            sample(&m, &k)
        };
        let curve: Vec<f64> = ["0.25", "0.5", "1", "2", "4", "8"].map(at).to_vec();
        assert!(
            curve.iter().all(|h| (0.0..=1.0).contains(h)),
            "{tier}: {curve:?}"
        );
        assert!(curve.windows(2).all(|w| w[0] <= w[1]), "{tier}: {curve:?}");
        // Every page of the document's second and third reading hits a large enough cache
        // (the 4 prompts between two readings hold 80 pages).
        let pages_of = |scale: &str| {
            let k = format!("strata_cache_curve_pages{{tier=\"{tier}\",scale=\"{scale}\"}}");
            sample(&m, &k)
        };
        if pages_of("8") > 100.0 {
            assert!(curve[5] >= 40.0 / pages as f64 - 1e-9, "{tier}: {curve:?}");
        }
    }

    let (_off, port) = serve(&model, &["--curve-pages", "0"]);
    ask(port, &doc);
    let m = metrics_text(port);
    assert!(!m.contains("strata_cache_curve_"), "{m}");
}
