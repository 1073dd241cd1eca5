//! A worker (or whatever listens on its port) that answers badly: the router's memory, its
//! clients' waits and what they are told stay the router's own. A mock worker answers HTML
//! errors, bodies that are not JSON, bodies without end, and never; streams that stop.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde_json::Value;
use strata_router::{router, Policy, RouterState};

/// A mock worker: healthy, and each path answers as its name says.
async fn mock() -> String {
    let endless = || {
        let chunk = axum::body::Bytes::from(vec![b'x'; 1 << 16]);
        let s = futures_util::stream::repeat(chunk).map(Ok::<_, std::io::Error>);
        Response::new(Body::from_stream(s))
    };
    let app = axum::Router::new()
        .route("/health", get(|| async { "{}" }))
        .route("/v1/responses", post(responses_stream))
        .route("/version", get(move || async move { endless() }))
        .route(
            "/v1/completions",
            post(|body: String| async move {
                if body.contains("html") {
                    let html = [(header::CONTENT_TYPE, "text/html")];
                    return (
                        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                        html,
                        "<h1>stack trace</h1>",
                    )
                        .into_response();
                }
                if body.contains("broken") {
                    let json = [(header::CONTENT_TYPE, "application/json")];
                    return (json, "{\"choices\": [ not json").into_response();
                }
                // "never": no answer at all.
                tokio::time::sleep(Duration::from_secs(3600)).await;
                "{}".into_response()
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    url
}

/// A `/v1/responses` stream: whole ("whole"), whole then silent ("whole silent"), silent after
/// its first event ("silent"), keep-alive comments only after it ("wedged"), or ending early,
/// after its first event ("cut") or in the middle of its second ("midway").
async fn responses_stream(body: String) -> Response {
    let created = "event: response.created\ndata: {\"response\":{\"id\":\"resp_a1\"}}\n\n";
    let completed = "event: response.completed\ndata: {\"response\":{\"id\":\"resp_a1\"}}\n\n";
    let mut parts = vec![created.to_string()];
    if body.contains("whole") {
        parts.push(completed.to_string());
    }
    if body.contains("midway") {
        // Half an event, in two chunks, then the end of the stream.
        parts.push("event: response.output_text.delta\n".to_string());
        parts.push("data: {\"delta\":\"hal".to_string());
    }
    let silent = body.contains("silent");
    let wedged = body.contains("wedged");
    let comments = futures_util::stream::unfold((), move |()| async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        wedged.then_some((":\n\n".to_string(), ()))
    });
    let s = futures_util::stream::iter(parts)
        .chain(comments)
        .map(Ok::<_, std::io::Error>)
        .chain(futures_util::stream::once(async move {
            if silent {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            Ok(String::new())
        }));
    let sse = [(header::CONTENT_TYPE, "text/event-stream")];
    (sse, Body::from_stream(s)).into_response()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_stream_that_stops_ends_with_an_error_event() {
    let w = mock().await;
    let mut st = RouterState::new(&[], std::slice::from_ref(&w), Policy::RoundRobin);
    st.stream_idle = Duration::from_secs(1);
    st.request_timeout = Duration::from_secs(3);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(Arc::new(st))).await });
    let c = reqwest::Client::new();
    for (input, broke) in [
        ("whole", None),
        ("whole silent", None),
        ("silent", Some("no data from the worker for 1.0 s")),
        (
            "wedged",
            Some("the answer took longer than the router's 3.0 s"),
        ),
        ("cut", Some("it ended before the answer's last event")),
        ("midway", Some("it ended before the answer's last event")),
    ] {
        let a = c
            .post(format!("{r}/v1/responses"))
            .json(&serde_json::json!({"input": input, "stream": true}))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap();
        assert_eq!(a.status().as_u16(), 200, "{input}");
        let text = a.text().await.unwrap();
        // Whole events only: every data line is JSON (half an event is never relayed).
        for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            let v: Result<Value, _> = serde_json::from_str(data);
            assert!(v.is_ok(), "{input}: {text}");
        }
        let last = text.trim_end().rsplit("\n\n").next().unwrap();
        match broke {
            None => assert!(last.starts_with("event: response.completed"), "{text}"),
            Some(why) => {
                assert!(last.starts_with("event: error\ndata: "), "{input}: {text}");
                let e: Value = serde_json::from_str(&last[19..]).unwrap();
                assert_eq!(e["type"], "error");
                assert_eq!(e["sequence_number"], 1, "the event after response.created");
                let msg = e["message"].as_str().unwrap();
                assert!(msg.ends_with(why), "{input}: {msg}");
            }
        }
    }
    // Each stream that broke is a failure of its worker; a whole one is not.
    let w: Value = c
        .get(format!("{r}/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(w["workers"][0]["failures"], 4, "{w}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_worker_gets_json_errors_bounded_reads_and_a_timeout() {
    let w = mock().await;
    let mut st = RouterState::new(&[], std::slice::from_ref(&w), Policy::RoundRobin);
    st.request_timeout = Duration::from_secs(2);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(Arc::new(st))).await });
    let c = reqwest::Client::new();
    let post = |prompt: &'static str| {
        c.post(format!("{r}/v1/completions"))
            .json(&serde_json::json!({"prompt": prompt, "max_tokens": 1}))
            .timeout(Duration::from_secs(30))
            .send()
    };
    // The worker's words never reach the client: an HTML 500, and a 200 that is not JSON.
    for (prompt, want) in [("html", 502), ("broken", 502)] {
        let a = post(prompt).await.unwrap();
        assert_eq!(a.status().as_u16(), want, "{prompt}");
        let e: Value = a.json().await.unwrap();
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(
            !msg.contains("stack trace") && !msg.contains("choices"),
            "{msg}"
        );
    }
    // A worker that never answers: a 504 after --request-timeout, not a wait without end.
    let t = std::time::Instant::now();
    let a = post("never").await.unwrap();
    assert_eq!(a.status().as_u16(), 504);
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    // A body without end is cut at the router's bound: a JSON error, not gigabytes held.
    let a = c
        .get(format!("{r}/version"))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    assert!(a.status().is_server_error(), "{}", a.status());
    let e: Value = a.json().await.unwrap();
    assert!(e["error"]["message"].is_string(), "{e}");
    // A non-streamed answer is said to be JSON whatever the worker called it.
    let a = post("html").await.unwrap();
    let ctype = a.headers()[reqwest::header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_string();
    assert!(ctype.starts_with("application/json"), "{ctype}");
}

/// `chat` sent through a round-robin router of its own in front of `workers` (decode only).
async fn chat_through_router(workers: &[String], chat: &serde_json::Value) -> reqwest::Response {
    let st = RouterState::new(&[], workers, Policy::RoundRobin);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(Arc::new(st))).await });
    let client = reqwest::Client::new();
    let url = format!("{r}/v1/chat/completions");
    client.post(url).json(chat).send().await.unwrap()
}

/// A worker whose queue timed out (503 with `Retry-After`) and no other to try: its answer goes
/// back at once, not after a second wait on the same queue; with two such workers, each is
/// asked once and the second's answer goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_workers_503_is_not_sent_again_to_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let busy = || async {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            post(move || {
                c.fetch_add(1, Ordering::SeqCst);
                async {
                    let body = r#"{"error":{"message":"waited past --max-queue-time","type":"service_unavailable"}}"#;
                    let h = [(header::CONTENT_TYPE, "application/json"), (header::RETRY_AFTER, "7")];
                    (axum::http::StatusCode::SERVICE_UNAVAILABLE, h, body).into_response()
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        (url, calls)
    };
    let chat =
        serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let ((a, a_calls), (b, b_calls)) = (busy().await, busy().await);
    for workers in [vec![a.clone()], vec![a, b]] {
        let answer = chat_through_router(&workers, &chat).await;
        assert_eq!(answer.status().as_u16(), 503);
        assert_eq!(answer.headers()[header::RETRY_AFTER], "7");
    }
    // Alone: once; then the pair of them: once each (the second's answer is the answer).
    assert_eq!(a_calls.load(Ordering::SeqCst), 2);
    assert_eq!(b_calls.load(Ordering::SeqCst), 1);
}

/// A lone worker whose answer the transport refuses (a header with a bare CR), after it read
/// the request: the router does not send the request to it again (it would run twice), and
/// says what happened, not "two worker pairs".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_workers_unreadable_answer_is_not_sent_again() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let c = c.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                let mut got = Vec::new();
                // The whole request (headers and the small body), then a broken answer.
                while !String::from_utf8_lossy(&got).contains("\"max_tokens\"") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                c.fetch_add(1, Ordering::SeqCst);
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nx-bad: a\rb\r\ncontent-length: 2\r\n\r\n{}")
                    .await;
            });
        }
    });
    let chat =
        serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let answer = chat_through_router(&[url], &chat).await;
    assert_eq!(answer.status().as_u16(), 502);
    let body: serde_json::Value = answer.json().await.unwrap();
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(!msg.contains("two worker pairs"), "{msg}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "sent to the lone worker twice"
    );
}

/// Workers that never answer `/cache/events` (each call waits out its timeout) delay no other
/// worker's index updates: each worker is polled by a task of its own. Six stalled workers in
/// front of a good one held its first update for half a minute when they were polled in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_worker_does_not_hold_up_the_others_index_updates() {
    use strata_protocol::{CacheEvents, CacheInfo, CacheSnapshot, Hex, Tier, WireEvent};
    use strata_router::cache_index::{CacheIndex, IndexLimits, DEFAULT_INDEX_MEMORY};
    let info = CacheInfo {
        model_id: "tiny".into(),
        page_size: 16,
        hash_key: Some(Hex([7; 32])),
        epoch: 1,
        next: 1,
    };
    let info = serde_json::to_string(&info).unwrap();
    let serve = |app: axum::Router| async move {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        url
    };
    let json = |s: String| ([(header::CONTENT_TYPE, "application/json")], s);
    let i = info.clone();
    let stalled = axum::Router::new()
        .route(
            "/cache/info",
            get(move || std::future::ready(json(i.clone()))),
        )
        .route(
            "/cache/events",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                "{}"
            }),
        );
    let mut workers = Vec::new();
    for _ in 0..6 {
        workers.push(serve(stalled.clone()).await);
    }
    let pages: Vec<Hex<16>> = (0..5u8).map(|b| Hex([b; 16])).collect();
    let snapshot = CacheSnapshot {
        epoch: 1,
        next: 1,
        tiers: vec![WireEvent {
            seq: None,
            stored: true,
            tier: Tier::Device,
            hashes: pages,
        }],
    };
    let snapshot = serde_json::to_string(&snapshot).unwrap();
    let events = CacheEvents {
        epoch: 1,
        first: 0,
        next: 1,
        resync: false,
        events: Vec::new(),
    };
    let events = serde_json::to_string(&events).unwrap();
    let good = axum::Router::new()
        .route(
            "/cache/info",
            get(move || std::future::ready(json(info.clone()))),
        )
        .route(
            "/cache/events",
            get(move || std::future::ready(json(events.clone()))),
        )
        .route(
            "/cache/snapshot",
            get(move || std::future::ready(json(snapshot.clone()))),
        );
    workers.push(serve(good).await);
    let d = tempfile::tempdir().unwrap();
    let g = strata_model::Gguf::open(&strata_test_support::tiny_model(d.path())).unwrap();
    let tk = strata_model::ModelTokenizer::from_gguf(&g).unwrap();
    let mut rs = RouterState::new(&[], &workers, Policy::CacheAware);
    let limits = IndexLimits::within(DEFAULT_INDEX_MEMORY, workers.len()).unwrap();
    let index = Arc::new(CacheIndex::new(Arc::new(tk), None, workers.len(), limits));
    rs.set_index(index.clone());
    tokio::spawn(strata_router::index_loop(
        Arc::new(rs),
        Duration::from_millis(20),
    ));
    // Ready when the good worker's five pages are indexed; polled in turn, not before 30 s.
    let t = std::time::Instant::now();
    while index.footprint().pages < 5 {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the good worker's pages not indexed after {:?}",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(index.footprint().pages, 5);
}

/// A worker that stops passing its health checks (stopped, hung, its engine stalled) while it
/// owes an answer: the client gets a 503 once it has failed them for 10 s, not after
/// --request-timeout (30 minutes by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_owed_by_a_worker_failing_its_health_checks_is_given_up() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stalled = Arc::new(AtomicBool::new(false));
    let (s1, s2) = (stalled.clone(), stalled.clone());
    let app = axum::Router::new()
        .route(
            "/health",
            get(move || {
                let s = s1.clone();
                async move {
                    match s.load(Ordering::SeqCst) {
                        true => axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        false => axum::http::StatusCode::OK,
                    }
                }
            }),
        )
        .route(
            "/v1/completions",
            post(move || {
                let s = s2.clone();
                async move {
                    s.store(true, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    "{}"
                }
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let w = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    let mut st = RouterState::new(&[], std::slice::from_ref(&w), Policy::RoundRobin);
    st.request_timeout = Duration::from_secs(600);
    let every = Duration::from_millis(200);
    st.health_every = every;
    let st = Arc::new(st);
    tokio::spawn(strata_router::health_loop(st.clone(), every));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(st)).await });
    let t = std::time::Instant::now();
    let a = reqwest::Client::new()
        .post(format!("{r}/v1/completions"))
        .json(&serde_json::json!({"prompt": "x", "max_tokens": 1}))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    assert_eq!(a.status().as_u16(), 503);
    let waited = t.elapsed();
    assert!(waited >= Duration::from_secs(10), "{waited:?}");
    assert!(waited < Duration::from_secs(60), "{waited:?}");
    let e: Value = a.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("failed its health checks for 10 s"), "{msg}");
}
