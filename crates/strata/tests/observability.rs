//! A `strata up` deployment (tiny model) scraped by a real Prometheus: every PromQL expression
//! of every dashboard panel returns data, `promtool check metrics` accepts every `/metrics`,
//! and the tier counters sum to the prompt tokens after a mixed workload.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use strata_model::tiny::{write_tiny, TinySpec};
use strata_test_support::free_port;
use strata_test_support::up::Up;

fn curl(args: &[&str]) -> String {
    let out = Command::new("curl")
        .arg("-s")
        .args(args)
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn need(bin: &str) {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {bin}")])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "`{bin}` is missing: install the Debian package prometheus (scripts/test.sh does)"
    );
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        // SAFETY: kill(2) on a child this test started.
        unsafe {
            libc::kill(self.0.id() as i32, libc::SIGTERM);
        }
        let _ = self.0.wait();
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn value(metrics: &str, line_prefix: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(line_prefix))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

#[test]
fn dashboards_query_real_prometheus_and_counters_balance() {
    need("prometheus");
    need("promtool");
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    write_tiny(&model, &TinySpec::default()).unwrap();
    // Prometheus cannot say which port it took: it gets a free one; the deployment binds 0.
    let prom = free_port();
    let cfg = d.path().join("up.toml");
    std::fs::write(
        &cfg,
        format!(
            "smoke_test = true\n[router]\nport = 0\npolicy = \"cache_aware\"\n\
             [[prefill]]\nport = 0\nargs = [\"--device-mem\", \"2MiB\", \"--hicache-size\", \"8MiB\", \"--l3\", \"disk:{}\", \"--admin-key\", \"obs-admin\"]\n\
             [[decode]]\nport = 0\nargs = [\"--device-mem\", \"4MiB\", \"--hicache-size\", \"8MiB\", \"--pd-local-prefill-tokens\", \"0\"]\n",
            d.path().join("l3").display()
        ),
    )
    .unwrap();
    let mut up = Up::start(
        env!("CARGO_BIN_EXE_strata"),
        &cfg,
        &model,
        &d.path().join("state"),
        &[],
    );
    let ready = up.ready(90);
    let (r, p, dd) = (
        ready.router,
        ready.port("prefill-0"),
        ready.port("decode-0"),
    );
    let prefill_pid = ready.pid("prefill-0");
    let pcfg = d.path().join("prometheus.yml");
    std::fs::write(
        &pcfg,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: strata\n    static_configs:\n\
             \x20     - targets: [\"127.0.0.1:{r}\"]\n        labels: {{role: router}}\n\
             \x20     - targets: [\"127.0.0.1:{p}\"]\n        labels: {{role: prefill}}\n\
             \x20     - targets: [\"127.0.0.1:{dd}\"]\n        labels: {{role: decode}}\n"
        ),
    )
    .unwrap();
    let prometheus = Kill(
        Command::new("prometheus")
            .arg(format!("--config.file={}", pcfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                d.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // A mixed workload: repeated prefixes, new prompts, streaming, an error, a flush.
    let chat = |content: &str, stream: bool| {
        curl(&[
            "-H",
            "content-type: application/json",
            "-d",
            &format!(
                r#"{{"messages":[{{"role":"system","content":"You answer questions about a long shared document that every request carries along with it."}},{{"role":"user","content":"{content}"}}],"max_tokens":6,"temperature":0,"stream":{stream}}}"#
            ),
            &format!("http://127.0.0.1:{r}/v1/chat/completions"),
        ])
    };
    for round in 0..6 {
        for q in ["first question", "second question", "third"] {
            chat(&format!("{q} {}", round % 2), round % 3 == 0);
        }
        if round == 3 {
            // Admin endpoints need the admin key (or the cluster key) under `strata up`.
            curl(&[
                "-X",
                "POST",
                "-H",
                "authorization: Bearer obs-admin",
                &format!("http://127.0.0.1:{p}/flush_cache?tier=device"),
            ]);
        }
        curl(&[
            "-d",
            "{not json",
            &format!("http://127.0.0.1:{r}/v1/chat/completions"),
        ]);
        std::thread::sleep(Duration::from_millis(300));
    }
    // Every /metrics passes promtool; the tier counters balance on every worker.
    for port in [r, p, dd] {
        let m = curl(&[&format!("http://127.0.0.1:{port}/metrics")]);
        let mut c = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut c.stdin.take().unwrap(), m.as_bytes()).unwrap();
        let o = c.wait_with_output().unwrap();
        assert!(
            o.status.success() && o.stdout.is_empty() && o.stderr.is_empty(),
            "promtool on :{port}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        if port != r {
            let prompt = value(&m, "strata_prompt_tokens_total");
            let hits = value(&m, "strata_cache_hit_tokens_total{");
            let miss = value(&m, "strata_cache_miss_tokens_total");
            assert_eq!(
                hits + miss,
                prompt,
                ":{port} hits {hits} + miss {miss} != prompt {prompt}"
            );
            if port == p {
                assert!(
                    prompt > 0.0 && hits > 0.0,
                    "prefill served no cached tokens:\n{m}"
                );
                assert!(
                    value(&m, "strata_cache_hit_tokens_total{tier=\"host\"}") > 0.0,
                    "{m}"
                );
            }
        }
    }
    // Let Prometheus scrape every target a few times after the traffic (slow machines start it
    // late), then ask every panel's queries.
    let prom_query = |q: &str| -> Value {
        let ans = curl(&[
            "--get",
            "--data-urlencode",
            &format!("query={q}"),
            &format!("http://127.0.0.1:{prom}/api/v1/query"),
        ]);
        serde_json::from_str(&ans).unwrap_or(Value::Null)
    };
    let t = std::time::Instant::now();
    loop {
        let v = prom_query("count_over_time(up[1m]) >= 4 and up == 1");
        if v["data"]["result"].as_array().map(|a| a.len()) == Some(3) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "Prometheus did not scrape every target: {v}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let mut failures = Vec::new();
    let mut checked = 0;
    for f in ["node-health", "cache", "serving-pd"] {
        let path = repo().join(format!("deploy/grafana/dashboards/{f}.json"));
        let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for panel in dash["panels"].as_array().unwrap() {
            for t in panel["targets"].as_array().unwrap() {
                let expr = t["expr"]
                    .as_str()
                    .unwrap()
                    .replace("$instance", ".*")
                    .replace("$role", ".*")
                    .replace("$__rate_interval", "1m");
                let ans = curl(&[
                    "--get",
                    "--data-urlencode",
                    &format!("query={expr}"),
                    &format!("http://127.0.0.1:{prom}/api/v1/query"),
                ]);
                let v: Value = serde_json::from_str(&ans).unwrap_or(Value::Null);
                checked += 1;
                let n = v["data"]["result"].as_array().map(|a| a.len()).unwrap_or(0);
                if v["status"] != "success" || n == 0 {
                    failures.push(format!("{f} / {}: {expr} → {ans}", panel["title"]));
                }
            }
        }
    }
    assert!(checked >= 30, "only {checked} expressions");
    assert!(
        failures.is_empty(),
        "panels without data:\n{}",
        failures.join("\n")
    );
    check_dashboard(r, &[p, dd], d.path());
    check_history(r, p, dd, prefill_pid, d.path());
    drop(prometheus);
    drop(up);
}

/// The router's built-in page in headless Chromium: no console messages, no error shown, and
/// per worker the same numbers as that worker's /metrics; then every chart draws under traffic.
fn check_dashboard(router: u16, workers: &[u16], tmp: &Path) {
    let chromium = chromium();
    // The router scrapes every second; the traffic is over, so its figures are final.
    std::thread::sleep(Duration::from_millis(2500));
    let url = format!("http://127.0.0.1:{router}/dashboard");
    let base = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1500,2200",
        "--force-device-scale-factor=1",
        "--virtual-time-budget=4000",
        "--enable-logging=stderr",
        "--v=0",
    ];
    let profile = format!("--user-data-dir={}", tmp.join("chromium").display());
    let out = Command::new(chromium)
        .args(base)
        .arg(&profile)
        .args(["--dump-dom", &url])
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&out.stdout).into_owned();
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    let console: Vec<&str> = log.lines().filter(|l| l.contains("CONSOLE")).collect();
    assert!(
        console.is_empty(),
        "console messages:\n{}",
        console.join("\n")
    );
    assert!(
        dom.contains("<tbody id=\"rows\"><tr"),
        "no rows rendered:\n{dom}"
    );
    assert!(
        dom.contains("<div id=\"err\"></div>"),
        "the page shows an error:\n{dom}"
    );
    for port in workers {
        let m = curl(&[&format!("http://127.0.0.1:{port}/metrics")]);
        let start = dom
            .find(&format!("data-worker=\"http://127.0.0.1:{port}\""))
            .unwrap_or_else(|| panic!("no row for :{port}:\n{dom}"));
        let end = start + dom[start..].find("</tr>").unwrap();
        let row = &dom[start..end];
        let shown = |k: &str| -> f64 {
            let key = format!("data-k=\"{k}\" data-raw=\"");
            let at = row.find(&key).unwrap_or_else(|| panic!("no {k} in {row}"));
            let rest = &row[at + key.len()..];
            rest[..rest.find('"').unwrap()].parse().unwrap()
        };
        let hit = |tier: &str| {
            value(
                &m,
                &format!("strata_cache_hit_tokens_total{{tier=\"{tier}\"}}"),
            )
        };
        assert_eq!(
            shown("prompt"),
            value(&m, "strata_prompt_tokens_total"),
            ":{port} {row}"
        );
        assert_eq!(shown("hit_device"), hit("device"), ":{port} {row}");
        assert_eq!(shown("hit_host"), hit("host"), ":{port} {row}");
        let ttft = value(&m, "strata_time_to_first_token_seconds_count");
        assert_eq!(shown("ttft"), ttft, ":{port} {row}");
        assert!(row.contains(">up<"), "{row}");
    }
    charts_draw_under_traffic(router, &base, &profile);
}

/// Chat requests through the router on another thread until `stop` is set.
fn traffic(router: u16, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut i = 0;
        while !stop.load(Ordering::Relaxed) {
            curl(&[
                "-H",
                "content-type: application/json",
                "-d",
                &format!(
                    r#"{{"messages":[{{"role":"user","content":"question {} about the shared document"}}],"max_tokens":4,"temperature":0}}"#,
                    i % 5
                ),
                &format!("http://127.0.0.1:{router}/v1/chat/completions"),
            ]);
            i += 1;
        }
    })
}

/// A headless Chromium screenshot of the page under traffic, kept in
/// `target/ci-artifacts/dashboard.png` (or `$STRATA_ARTIFACTS`): every chart the page names has
/// drawn pixels of a series colour inside its plot (where each plot is, the page says in
/// `data-box`; its layout does not move with the figures).
fn charts_draw_under_traffic(router: u16, base: &[&str], profile: &str) {
    let chromium = chromium();
    let url = format!("http://127.0.0.1:{router}/dashboard");
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(router, stop.clone());
    // Samples of the traffic in every window the page draws.
    std::thread::sleep(Duration::from_millis(4000));
    let dom = Command::new(chromium)
        .args(base)
        .arg(profile)
        .args(["--dump-dom", &url])
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout).into_owned();
    let dir = std::env::var_os("STRATA_ARTIFACTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/ci-artifacts"));
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("dashboard.png");
    let _ = std::fs::remove_file(&png);
    let shot = Command::new(chromium)
        .args(base)
        .arg(profile)
        .arg(format!("--screenshot={}", png.display()))
        .arg(&url)
        .output()
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    load.join().unwrap();
    settle(router);
    assert!(
        shot.status.success() && png.exists(),
        "no screenshot: {}",
        String::from_utf8_lossy(&shot.stderr)
    );
    eprintln!("dashboard screenshot: {}", png.display());
    let (w, h, rgb) = decode(&png);
    let mut charts = 0;
    let mut blank = Vec::new();
    for part in dom.split("data-chart=\"").skip(1) {
        let id = &part[..part.find('"').unwrap()];
        let b = attr_after(part, "", "data-box");
        let b: Vec<usize> = b.split(',').map(|v| v.parse().unwrap()).collect();
        let (x0, y0) = (b[0], b[1]);
        let (x1, y1) = ((b[0] + b[2]).min(w), (b[1] + b[3]).min(h));
        let coloured = (y0..y1)
            .flat_map(|y| (x0..x1).map(move |x| (x, y)))
            .filter(|&(x, y)| {
                let p = &rgb[(y * w + x) * 3..][..3];
                let (hi, lo) = (*p.iter().max().unwrap(), *p.iter().min().unwrap());
                hi - lo > 50
            })
            .count();
        charts += 1;
        if coloured < 20 {
            blank.push(format!("{id} ({coloured} coloured pixels in {b:?})"));
        }
    }
    // The ten time series, and each role's miss-ratio curve (prefill, decode).
    assert_eq!(charts, 12, "charts in the page:\n{dom}");
    for role in ["prefill", "decode"] {
        let at = dom
            .find(&format!("data-answer=\"{role}\""))
            .unwrap_or_else(|| panic!("no answer under the {role} curve:\n{dom}"));
        let line = &dom[at..at + dom[at..].find("</div>").unwrap()];
        assert!(
            line.contains(" per rank: ") && line.contains("tokens/s"),
            "{line}"
        );
    }
    assert!(
        blank.is_empty(),
        "charts with nothing drawn: {blank:?} (see {})",
        png.display()
    );
}

/// Waits until the router's latest scrape of every worker shows the prompt tokens that
/// worker's /metrics does (the traffic is over: its figures stop moving).
fn settle(router: u16) {
    let t = std::time::Instant::now();
    loop {
        let data: Value = serde_json::from_str(&curl(&[&format!(
            "http://127.0.0.1:{router}/dashboard/data"
        )]))
        .unwrap();
        let same = data["workers"].as_array().unwrap().iter().all(|w| {
            let m = curl(&[&format!("{}/metrics", w["url"].as_str().unwrap())]);
            let used = value(&m, "strata_cache_pages{tier=\"device\",state=\"used\"}");
            w["stats"]["prompt_tokens"].as_f64() == Some(value(&m, "strata_prompt_tokens_total"))
                && w["stats"]["device_used"].as_f64() == Some(used)
        });
        if same {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the router's figures never settled: {data}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A PNG's width, height and RGB bytes.
fn decode(path: &Path) -> (usize, usize, Vec<u8>) {
    let mut r = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()))
        .read_info()
        .unwrap();
    let mut buf = vec![0; r.output_buffer_size()];
    let info = r.next_frame(&mut buf).unwrap();
    let n = info.color_type.samples();
    assert!(info.bit_depth == png::BitDepth::Eight && n >= 3, "{info:?}");
    let rgb = buf[..info.buffer_size()]
        .chunks(n)
        .flat_map(|p| [p[0], p[1], p[2]])
        .collect();
    (info.width as usize, info.height as usize, rgb)
}

/// The Chromium binary (Debian's `chromium`; other names where a machine has them).
fn chromium() -> &'static str {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            Command::new("sh")
                .args(["-c", &format!("command -v {b}")])
                .output()
                .unwrap()
                .status
                .success()
        })
        .expect("Chromium is missing: install the Debian package chromium (scripts/test.sh does)")
}

/// The page's DOM after `budget_ms` of virtual time in headless Chromium (console lines too).
fn dump(url: &str, profile: &Path, budget_ms: u32) -> (String, Vec<String>) {
    let chromium = chromium();
    let out = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--enable-logging=stderr",
            "--v=0",
            &format!("--virtual-time-budget={budget_ms}"),
            &format!("--user-data-dir={}", profile.display()),
            "--dump-dom",
            url,
        ])
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        log.lines()
            .filter(|l| l.contains("CONSOLE"))
            .map(str::to_string)
            .collect(),
    )
}

/// `data-NAME="..."` of the first element after `from` in `dom`.
fn attr_after<'a>(dom: &'a str, from: &str, name: &str) -> &'a str {
    let at = dom
        .find(from)
        .unwrap_or_else(|| panic!("no `{from}` in the page"));
    let key = format!("{name}=\"");
    let rest = &dom[at..];
    let v = &rest[rest
        .find(&key)
        .unwrap_or_else(|| panic!("no {name} after {from}"))
        + key.len()..];
    &v[..v.find('"').unwrap()]
}

/// The dashboard's time series: points appear over time; the latest occupancy points equal each
/// worker's /metrics; a worker that stops answering is marked stale within three scrape
/// intervals (it is stopped with SIGSTOP, so `strata up` does not restart it).
fn check_history(router: u16, p: u16, dd: u16, prefill_pid: i32, tmp: &Path) {
    let url = format!("http://127.0.0.1:{router}/dashboard");
    let profile = tmp.join("chromium-history");
    // Wait for the workers' device occupancy to hold still for longer than the router's
    // one-second scrape (a lease released after the last answer moves it): the chart's last
    // point is then the figure /metrics gives.
    let used = |port: u16| {
        let m = curl(&[&format!("http://127.0.0.1:{port}/metrics")]);
        value(&m, "strata_cache_pages{tier=\"device\",state=\"used\"}")
    };
    let mut last = (used(p), used(dd));
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(2500));
        let now = (used(p), used(dd));
        if now == last {
            break;
        }
        last = now;
    }
    let (dom, console) = dump(&url, &profile, 3000);
    assert!(
        console.is_empty(),
        "console messages:\n{}",
        console.join("\n")
    );
    let chart = "data-chart=\"occupancy\"";
    let first: usize = attr_after(&dom, chart, "data-points").parse().unwrap();
    assert!(first >= 2, "only {first} points:\n{dom}");
    for (port, role) in [(p, "prefill"), (dd, "decode")] {
        let m = curl(&[&format!("http://127.0.0.1:{port}/metrics")]);
        let used = value(&m, "strata_cache_pages{tier=\"device\",state=\"used\"}");
        let total = value(&m, "strata_cache_pages{tier=\"device\",state=\"total\"}");
        let series = format!("data-series=\"{role} 127.0.0.1:{port} device\"");
        let latest: f64 = attr_after(&dom, &series, "data-latest").parse().unwrap();
        assert!(
            (latest - 100.0 * used / total).abs() < 1e-6,
            ":{port} chart {latest} vs /metrics {used}/{total}"
        );
    }
    std::thread::sleep(Duration::from_millis(2500));
    let (dom, _) = dump(&url, &profile, 2000);
    let later: usize = attr_after(&dom, chart, "data-points").parse().unwrap();
    assert!(later > first, "no new points: {first} then {later}");
    // SAFETY: kill(2) with SIGSTOP / SIGCONT on the prefill worker `strata up` started.
    unsafe {
        libc::kill(prefill_pid, libc::SIGSTOP);
    }
    std::thread::sleep(Duration::from_millis(3000));
    let (dom, _) = dump(&url, &profile, 1500);
    // SAFETY: as above.
    unsafe {
        libc::kill(prefill_pid, libc::SIGCONT);
    }
    let row = format!("data-worker=\"http://127.0.0.1:{p}\"");
    assert_eq!(
        attr_after(&dom, &row, "data-stale"),
        "1",
        "the stopped worker is not marked stale:\n{dom}"
    );
    let row = format!("data-worker=\"http://127.0.0.1:{dd}\"");
    assert_eq!(attr_after(&dom, &row, "data-stale"), "0", "{dom}");
}
