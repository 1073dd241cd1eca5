//! A KV link that stalls in the middle of a transfer (a proxy between the prefill worker and
//! the decode worker's listener stops reading at the first page): the decode worker's receiver
//! gives up on the silent peer, and the client hears so then, not when the prefill worker's
//! sender gives up on its own timeouts (`--kv-deadline`, here 60 s).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use strata_test_support::{spawn_worker, WorkerSpec};

type Held = Arc<Mutex<Vec<TcpStream>>>;

/// Forwards every KV connection from `l` to `upstream`, frame by frame from the sender's side
/// (`u32` length, then the kind and the rest), until the first page frame (kind 4): from there
/// it reads nothing more and holds both ends open (in `held`, to be shut down when the test
/// ends). The receiver's answers pass through.
fn stall_at_the_first_page(l: TcpListener, upstream: SocketAddr, held: Held) {
    for conn in l.incoming() {
        let Ok(mut from) = conn else { return };
        held.lock().unwrap().push(from.try_clone().unwrap());
        let Ok(mut to) = TcpStream::connect(upstream) else {
            return;
        };
        let (mut back_from, mut back_to) = (to.try_clone().unwrap(), from.try_clone().unwrap());
        std::thread::spawn(move || std::io::copy(&mut back_from, &mut back_to));
        std::thread::spawn(move || loop {
            let mut len = [0u8; 4];
            if from.read_exact(&mut len).is_err() {
                return;
            }
            let mut rest = vec![0u8; u32::from_le_bytes(len) as usize];
            if from.read_exact(&mut rest).is_err() {
                return;
            }
            if rest.first() == Some(&4) {
                return;
            }
            if to
                .write_all(&len)
                .and_then(|_| to.write_all(&rest))
                .is_err()
            {
                return;
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_kv_link_fails_the_request_once_the_receiver_gives_up() {
    let d = tempfile::tempdir().unwrap();
    let path = strata_test_support::tiny_model(d.path());
    let spec = |prefill: Vec<String>, kv: Option<SocketAddr>| WorkerSpec {
        page_size: 16,
        kv_listener: kv.is_some(),
        kv_advertise: kv,
        prefill_workers: prefill,
        // Every request goes through the prefill worker (no local prefill of a short rest).
        pd_local_prefill_tokens: 0,
        // The prefill worker's sender waits a minute for the receiver's answer.
        kv_deadline: Duration::from_secs(60),
        ..WorkerSpec::default()
    };
    let prefill = spawn_worker(&path, spec(vec![], None)).await;
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = proxy.local_addr().unwrap();
    let decode = spawn_worker(&path, spec(vec![prefill.url.clone()], Some(at))).await;
    let upstream = decode.state.pd.kv.as_ref().unwrap().addr;
    let held = Held::default();
    let h = held.clone();
    std::thread::spawn(move || stall_at_the_first_page(proxy, upstream, h));

    let t0 = Instant::now();
    let body = json!({"prompt": "tell me about the weather in a long sentence please",
                      "max_tokens": 4, "temperature": 0});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", decode.url))
        .header(strata_server::state::PREFILL_HEADER, &prefill.url)
        .json(&body)
        .send()
        .await
        .unwrap();
    let took = t0.elapsed();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert_eq!(status, 502, "{text}");
    assert!(text.contains("KV transfer"), "{text}");
    // The receiver's idle limit is 10 s; the sender's own timeouts end at 60 s.
    assert!(
        took < Duration::from_secs(40),
        "answered after {took:?}: {text}"
    );
    // The prefill worker's sender, still waiting, sees the link close and ends.
    for s in held.lock().unwrap().iter() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}
