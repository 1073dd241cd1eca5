//! A multi-host deployment on one machine: network namespaces for a router host, two prefill
//! hosts, two decode hosts and a cache host (Redis, the prefill workers' shared L3), on one
//! bridge, every link shaped (strata_test_support::netbed: `tc netem` where the kernel has it,
//! else a `tbf` rate and the delay added by a relay hop on each host). Under each link setting:
//! a prompt computed cold, then the same prompt seven times (the cache-aware router sends them
//! to the prefill worker that holds it; their K/V crosses to a decode host), with TTFT
//! measured. Then a decode host is cut off mid-stream: the client gets an error event and
//! `[DONE]`, the router routes around the host and back to it once its link returns.
//!
//! Needs root (network namespaces) and iproute2; elsewhere it is skipped, saying why. The
//! model is SmolLM2-135M (`strata model fetch`), or `STRATA_NETBED_MODEL=PATH`; the figures in
//! docs/BENCHMARKS.md come from `cargo test --release -p strata --test multihost -- --nocapture`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};
use strata_test_support::netbed::{Link, NetBed, Relay};
use strata_test_support::{spawn_ready, ChildGuard};

const HOSTS: [&str; 6] = [
    "router", "prefill0", "prefill1", "decode0", "decode1", "cache",
];
const HTTP: u16 = 8000;
const KV: u16 = 9000;
const ROUTER: u16 = 8080;
const REDIS: u16 = 6379;
/// Times a cached prompt is asked again under each link setting (the median is reported).
const REPEATS: usize = 7;
/// Every service is reached through the hop on its host's address, at its port + HOP.
const HOP: u16 = 10000;

/// The deployment. Fields drop in order: processes, then relays, then the namespaces.
struct Bed {
    procs: Vec<ChildGuard>,
    /// The test's own way in (from this process's namespace to a host's loopback), by host.
    probes: HashMap<String, Relay>,
    hops: Vec<Relay>,
    net: NetBed,
}

impl Bed {
    fn ip(&self, host: &str) -> Ipv4Addr {
        self.net.host(host).ip
    }
    /// The URL peers use for a host's HTTP service.
    fn url(&self, host: &str) -> String {
        let port = if host == "router" { ROUTER } else { HTTP };
        format!("http://{}:{}", self.ip(host), port + HOP)
    }
    /// The test's URL for a host's HTTP service.
    fn probe(&self, host: &str) -> String {
        format!("http://{}", self.probes[host].addr)
    }
    /// A hop on `host` in front of its `port`, and the test's probe of it.
    fn serve_port(&mut self, host: &str, port: u16, probe: bool) {
        let ns = self.net.host(host).ns.clone();
        let ip = self.ip(host);
        let local = SocketAddr::from(([127, 0, 0, 1], port));
        let hop = SocketAddr::from((ip, port + HOP));
        self.hops
            .push(Relay::start(Some(&ns), hop, Some(&ns), local).expect("a hop relay"));
        if probe {
            let any = SocketAddr::from(([127, 0, 0, 1], 0));
            let p = Relay::start(None, any, Some(&ns), local).expect("a probe relay");
            self.probes.insert(host.to_string(), p);
        }
    }
    /// Applies a link setting (without netem, the hops add the delay).
    fn shape(&self, link: Link) {
        self.net.shape(link).expect("tc");
        let hop_delay = if self.net.netem() {
            Duration::ZERO
        } else {
            link.delay
        };
        for h in &self.hops {
            h.set_delay(hop_delay);
        }
    }
}

fn strata(bed: &Bed, host: &str, args: &[String]) -> ChildGuard {
    let mut c = bed.net.command(host, env!("CARGO_BIN_EXE_strata"));
    c.args(args).env("RUST_LOG", "warn");
    spawn_ready(&mut c, Duration::from_secs(120)).0
}

fn key_file(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("cluster.key");
    std::fs::write(&p, "6e3f9a1c7b2d08e5".repeat(4)).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

/// Starts Redis, two prefill workers, two decode workers and the router, each on its host.
fn start(net: NetBed, model: &Path, key: &Path) -> Bed {
    let mut bed = Bed {
        procs: Vec::new(),
        probes: HashMap::new(),
        hops: Vec::new(),
        net,
    };
    bed.serve_port("cache", REDIS, true);
    let mut redis = bed.net.command("cache", "redis-server");
    redis
        .args([
            "--port",
            &REDIS.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null());
    bed.procs
        .push(ChildGuard(redis.spawn().expect("redis-server")));
    let common = |bed: &Bed| -> Vec<String> {
        [
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--model",
            model.to_str().unwrap(),
            "--cluster-key-file",
            key.to_str().unwrap(),
            "--device-mem",
            "128MiB",
            "--hicache-size",
            "128MiB",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([
            "--l3".to_string(),
            format!("redis://{}:{}", bed.ip("cache"), REDIS + HOP),
        ])
        .collect()
    };
    for p in ["prefill0", "prefill1"] {
        bed.serve_port(p, HTTP, true);
        let mut args = common(&bed);
        args.extend(["--role".into(), "prefill".into()]);
        let child = strata(&bed, p, &args);
        bed.procs.push(child);
    }
    for d in ["decode0", "decode1"] {
        bed.serve_port(d, HTTP, true);
        bed.serve_port(d, KV, false);
        let mut args = common(&bed);
        args.extend([
            "--role".into(),
            "decode".into(),
            "--kv-host".into(),
            "0.0.0.0".into(),
            "--kv-port".into(),
            KV.to_string(),
            "--kv-advertise".into(),
            format!("{}:{}", bed.ip(d), KV + HOP),
            "--prefill-worker".into(),
            bed.url("prefill0"),
            "--prefill-worker".into(),
            bed.url("prefill1"),
        ]);
        let child = strata(&bed, d, &args);
        bed.procs.push(child);
    }
    bed.serve_port("router", ROUTER, true);
    let mut args: Vec<String> = [
        "route",
        "--host",
        "0.0.0.0",
        "--port",
        "8080",
        "--policy",
        "cache_aware",
        "--model",
        model.to_str().unwrap(),
        "--cluster-key-file",
        key.to_str().unwrap(),
        "--stream-idle-timeout",
        "3",
        "--health-interval",
        "0.5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for p in ["prefill0", "prefill1"] {
        args.extend(["--prefill".into(), bed.url(p)]);
    }
    for d in ["decode0", "decode1"] {
        args.extend(["--decode".into(), bed.url(d)]);
    }
    let child = strata(&bed, "router", &args);
    bed.procs.push(child);
    bed
}

async fn metrics(url: &str) -> String {
    strata_test_support::metrics_of(url).await
}

/// Sum of the samples of `name` whose labels contain `label` (e.g. `worker="http://..."`).
fn sum(m: &str, name: &str, label: &str) -> f64 {
    m.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// What one streamed request saw.
struct Streamed {
    ttft: Option<Duration>,
    cached: u64,
    error_event: bool,
    done: bool,
}

/// A streamed chat request through the router; `on_tokens(n)` after each content chunk (n so
/// far) may act mid-stream.
async fn stream(
    router: &str,
    prompt: &str,
    max_tokens: u32,
    mut on_tokens: impl FnMut(usize),
) -> Streamed {
    let body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true}});
    let t = Instant::now();
    let r = reqwest::Client::new()
        .post(format!("{router}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut s = Streamed {
        ttft: None,
        cached: 0,
        error_event: false,
        done: false,
    };
    let (mut buf, mut tokens) = (String::new(), 0);
    let mut body = r.bytes_stream();
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else { break };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(at) = buf.find('\n') {
            let line: String = buf.drain(..=at).collect();
            let Some(data) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                s.done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            if v.get("error").is_some() {
                s.error_event = true;
            }
            if let Some(c) = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
                s.cached = c;
            }
            let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
            if !content.is_empty() {
                s.ttft.get_or_insert(t.elapsed());
                tokens += 1;
                on_tokens(tokens);
            }
        }
    }
    s
}

/// Waits until `cond` holds on the router's metrics (the router acts on what it has heard).
async fn until(router: &str, what: &str, cond: impl Fn(&str) -> bool) {
    let t = Instant::now();
    while !cond(&metrics(router).await) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

#[test]
fn pd_across_hosts_under_shaped_links_and_a_decode_host_cut_off() {
    let net = match NetBed::create(&HOSTS) {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIPPED: the namespace test bed cannot be made here ({why}); it needs root and iproute2");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let model = match std::env::var_os("STRATA_NETBED_MODEL") {
        Some(p) => PathBuf::from(p),
        None => {
            use strata_model::fetch::{cache_dir, MODEL_FILE};
            let m = cache_dir().join(MODEL_FILE);
            assert!(
                m.exists(),
                "{} is missing: run `strata model fetch` (scripts/test.sh does it first)",
                m.display()
            );
            m
        }
    };
    let key = key_file(dir.path());
    let bed = start(net, &model, &key);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(run(&bed));
}

async fn run(bed: &Bed) {
    let router = bed.probe("router");
    until(&router, "every worker up", |m| {
        sum(m, "strata_router_worker_up", "") == 4.0
    })
    .await;
    let delay_by = if bed.net.netem() {
        "netem"
    } else {
        "relay hop"
    };
    let settings = [
        (
            "unshaped",
            Link {
                delay: Duration::ZERO,
                rate_bit: 0,
            },
        ),
        (
            "0.5 ms, 10 Gbit/s",
            Link {
                delay: Duration::from_micros(500),
                rate_bit: 10_000_000_000,
            },
        ),
        (
            "5 ms, 1 Gbit/s",
            Link {
                delay: Duration::from_millis(5),
                rate_bit: 1_000_000_000,
            },
        ),
    ];
    let text = "The shared system prompt of an agent that plans, calls tools, reads their \
                answers and writes a report; every request of the session starts with it. ";
    // About 32 tokens a repeat: 12 by default; STRATA_NETBED_PROMPT_REPEAT for longer prompts.
    let repeat: usize = std::env::var("STRATA_NETBED_PROMPT_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    // A warm-up (not timed): the first requests of a fresh deployment pay for first touches
    // (model pages, buffers, connections) that the settings after would not.
    let warm = format!("Warm-up. {}", text.repeat(repeat));
    for _ in 0..2 {
        let r = stream(&router, &warm, 4, |_| {}).await;
        assert!(r.done && !r.error_event, "the warm-up request");
    }
    let mut table = Vec::new();
    for (i, (name, link)) in settings.into_iter().enumerate() {
        bed.shape(link);
        let m0 = metrics(&router).await;
        let cold = colds(
            bed,
            &router,
            name,
            &format!("Setting {i}"),
            &text.repeat(repeat),
        )
        .await;
        let (prompt, kv_cold) = (cold.prompt.clone(), cold.kv);
        // The router hears of the prompt's pages before the repeats.
        let pages0 = sum(&m0, "strata_router_index_pages", "");
        until(&router, "the prompt's pages in the router's index", |m| {
            sum(m, "strata_router_index_pages", "") > pages0
        })
        .await;
        let hits0 = sum(
            &metrics(&router).await,
            "strata_router_requests_total",
            "reason=\"cache_hit\"",
        );
        quiet(bed).await;
        let kv0 = kv_received(bed).await;
        let mut ttfts = Vec::new();
        let mut cached = 0;
        for _ in 0..REPEATS {
            let r = stream(&router, &prompt, 4, |_| {}).await;
            assert!(r.done && !r.error_event, "cached request under {name}");
            assert!(
                r.cached > cold.cached,
                "no more cached tokens than cold under {name}: {} vs {}",
                r.cached,
                cold.cached
            );
            cached = r.cached;
            ttfts.push(r.ttft.unwrap());
        }
        let hits = sum(
            &metrics(&router).await,
            "strata_router_requests_total",
            "reason=\"cache_hit\"",
        ) - hits0;
        assert_eq!(
            hits, REPEATS as f64,
            "the router sent the repeats elsewhere than the prefix under {name}"
        );
        assert!(
            kv_cold > 0.0,
            "no K/V crossed for the cold prompt under {name}"
        );
        // A decode host that holds the prompt asks only for what it lacks (or computes the
        // rest itself): the repeats move less than the cold prompt.
        let kv = (kv_received(bed).await - kv0) / REPEATS as f64;
        assert!(
            kv < kv_cold,
            "the repeats moved {kv} bytes each, the cold prompt {kv_cold} under {name}"
        );
        ttfts.sort();
        table.push(format!(
            "| {name} | {delay_by} | {} ({} cached) | {:.2} MB | {:.0} of {:.0} | {} | {cached} | {hits}/{REPEATS} | {:.2} MB |",
            ms(cold.ttft),
            cold.cached,
            kv_cold / 1e6,
            cold.overlapped,
            cold.pages,
            ms(ttfts[REPEATS / 2]),
            kv / 1e6
        ));
    }
    bed.shape(Link {
        delay: Duration::ZERO,
        rate_bit: 0,
    });
    cut_a_decode_host_mid_stream(bed, &router).await;
    eprintln!("\n| link (each host, one way) | delay by | cold TTFT (median of 3; tokens cached) | cold K/V | pages sent during the prefill | cached TTFT (median of 7) | cached tokens | routed to the prefix | K/V per repeat |");
    eprintln!("|---|---|---|---|---|---|---|---|---|");
    for row in table {
        eprintln!("{row}");
    }
}

/// Cold prompts asked under each link setting (the median TTFT is reported).
const COLDS: usize = 3;

/// What the cold prompts of one setting saw: the median TTFT, tokens cached, and per prompt
/// the K/V bytes received by the decode hosts, the pages the prefill hosts sent during the
/// prefill (overlapping it) out of the pages sent; the last prompt (asked again after).
struct Cold {
    ttft: Duration,
    cached: u64,
    kv: f64,
    overlapped: f64,
    pages: f64,
    prompt: String,
}

/// Asks [`COLDS`] prompts never seen before (`tag`, a number, `text`), each once.
async fn colds(bed: &Bed, router: &str, name: &str, tag: &str, text: &str) -> Cold {
    let prefill_pages = |name: &'static str| async move {
        let mut n = 0.0;
        for p in ["prefill0", "prefill1"] {
            n += sum(&metrics(&bed.probe(p)).await, name, "");
        }
        n
    };
    let (mut ttfts, mut cached, mut prompt) = (Vec::new(), 0, String::new());
    let kv0 = kv_received(bed).await;
    let over0 = prefill_pages("strata_pd_overlapped_pages_total").await;
    let sent0 = prefill_pages("strata_kv_transfer_pages_total").await;
    for k in 0..COLDS {
        quiet(bed).await;
        prompt = format!("{tag}, prompt {k}. {text}");
        let cold = stream(router, &prompt, 4, |_| {}).await;
        // (Its first page may be cached: the chat template's header is every prompt's.)
        assert!(
            cold.done && !cold.error_event,
            "cold request under {name}: done {} error event {}",
            cold.done,
            cold.error_event
        );
        ttfts.push(cold.ttft.unwrap());
        cached = cold.cached;
    }
    ttfts.sort();
    let per = |x: f64| x / COLDS as f64;
    Cold {
        ttft: ttfts[COLDS / 2],
        cached,
        kv: per(kv_received(bed).await - kv0),
        overlapped: per(prefill_pages("strata_pd_overlapped_pages_total").await - over0),
        pages: per(prefill_pages("strata_kv_transfer_pages_total").await - sent0),
        prompt,
    }
}

/// Waits until no worker copies between cache tiers: the previous prompt's pages are written
/// on to Redis. The six hosts share this machine's two cores, which that copying (through the
/// relay hops) would take from the request timed next; on hosts of their own it would not.
async fn quiet(bed: &Bed) {
    let t = Instant::now();
    for h in ["prefill0", "prefill1", "decode0", "decode1"] {
        while sum(
            &metrics(&bed.probe(h)).await,
            "strata_cache_copies_in_flight",
            "",
        ) > 0.0
        {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "{h} still copies between its tiers"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn kv_received(bed: &Bed) -> f64 {
    let mut total = 0.0;
    for d in ["decode0", "decode1"] {
        let m = metrics(&bed.probe(d)).await;
        total += sum(
            &m,
            "strata_kv_transfer_bytes_total",
            "direction=\"received\"",
        );
    }
    total
}

/// A decode host's link goes down while it streams: the client gets an error event and
/// `[DONE]`; requests go to the other decode host meanwhile, and to this one again after.
async fn cut_a_decode_host_mid_stream(bed: &Bed, router: &str) {
    let cut = std::cell::Cell::new(None::<(&str, Instant)>);
    let s = stream(
        router,
        "Count slowly to one thousand, one number a line.",
        3000,
        |n| {
            if n == 3 {
                // The decode worker streaming it: the one the router counts a request in flight on.
                let url = router.to_string();
                let m = block_aside(async move { metrics(&url).await });
                let host = ["decode0", "decode1"]
                    .into_iter()
                    .find(|d| {
                        sum(
                            &m,
                            "strata_router_worker_in_flight",
                            &format!("worker=\"{}\"", bed.url(d)),
                        ) > 0.0
                    })
                    .expect("a decode worker with the stream in flight");
                bed.net.set_link(host, false).unwrap();
                cut.set(Some((host, Instant::now())));
            }
        },
    )
    .await;
    let (host, at) = cut.get().expect("the stream ended before 3 tokens");
    assert!(
        s.error_event && s.done,
        "the cut stream did not end with an error event and [DONE]"
    );
    eprintln!(
        "decode host {host} cut off: the client's stream ended with an error event {} later",
        ms(at.elapsed())
    );
    let label = format!("worker=\"{}\"", bed.url(host));
    until(router, "the cut decode host marked down", |m| {
        sum(m, "strata_router_worker_up", &label) == 0.0
    })
    .await;
    let served = |m: &str| sum(m, "strata_router_http_requests_total", &label);
    let before = served(&metrics(router).await);
    for i in 0..4 {
        let r = stream(
            router,
            &format!("Question {i} while a decode host is away."),
            4,
            |_| {},
        )
        .await;
        assert!(
            r.done && !r.error_event,
            "a request failed while {host} was away"
        );
    }
    assert_eq!(
        served(&metrics(router).await),
        before,
        "requests were sent to the cut host"
    );
    bed.net.set_link(host, true).unwrap();
    until(router, "the decode host back up", |m| {
        sum(m, "strata_router_worker_up", &label) == 1.0
    })
    .await;
    // Two at once: least load puts one on each decode host.
    let (a, b) = tokio::join!(
        stream(
            router,
            "A first question after the host returned.",
            64,
            |_| {}
        ),
        stream(
            router,
            "A second question after the host returned.",
            64,
            |_| {}
        )
    );
    assert!(a.done && b.done && !a.error_event && !b.error_event);
    assert!(
        served(&metrics(router).await) > before,
        "the returned host got no request"
    );
}

/// Runs a future to completion from inside a synchronous callback of an async stream (on a
/// thread of its own, with a runtime of its own).
fn block_aside<T: Send + 'static>(f: impl std::future::Future<Output = T> + Send + 'static) -> T {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    })
    .join()
    .unwrap()
}
