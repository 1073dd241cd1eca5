//! K/V stored as q8_0 through the engine: a prefix from the device, the host and the disk tier
//! gives the same bits (tokens and log-probabilities) as the others, K/V moved from a prefill
//! engine to a decode engine continues with the bits of one engine computing everything, and
//! engines of different K/V dtypes refuse each other at the transfer handshake.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use strata_engine::request::CachedTokens;
use strata_engine::transfer::{handshake_accept, handshake_connect};
use strata_engine::*;
use strata_kv::dtype::Dtype;
use strata_kv::memory::HeapAllocator;
use strata_kv::storage::blob::BlobKey;
use strata_kv::storage::{DiskStorage, Storage};
use strata_kv::{CacheConfig, PageLayout, TieredCache};
use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::{Gguf, Model};

mod common;
use common::{export_from, imported, prompt, PS};

/// The tiny model with heads of 32 values (a whole q8_0 block each).
fn tiny32(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("tiny32.gguf");
    let spec = TinySpec::family("llama-h32").unwrap();
    write_tiny(&p, &spec).unwrap();
    p
}

/// An engine storing K/V as `dtype`, with `disk` as its L3 (written for its layout).
fn start(path: &Path, dtype: Dtype, host_pages: u32, disk: Option<&Path>) -> EngineHandle {
    let mut m = Model::load(&mut Gguf::open(path).unwrap()).unwrap();
    m.set_kv_dtype(dtype).unwrap();
    let layout = PageLayout::new(PS, vec![m.pool_kind()]).unwrap();
    let storage = disk.map(|d| {
        let s = DiskStorage::open(d, 1 << 30, false)
            .unwrap()
            .with_key(BlobKey::public().for_layout(&layout));
        Arc::new(s) as Arc<dyn Storage>
    });
    let mut cc = CacheConfig::new(layout, 64, host_pages);
    cc.model_id = "tiny32".into();
    let cache = TieredCache::new(cc, &HeapAllocator, storage).unwrap();
    Engine::start(m, cache, EngineConfig::default())
}

fn params() -> SamplingParams {
    SamplingParams {
        max_tokens: 8,
        ignore_eos: true,
        logprobs: Some(3),
        ..SamplingParams::default()
    }
}

/// Every sampled token with the bits of its log-probability and of its top 3.
type Bits = Vec<(u32, u32, Vec<(u32, u32)>)>;

fn collect(s: &mut RequestStream) -> (Bits, CachedTokens) {
    let (mut out, mut cached) = (Vec::new(), CachedTokens::default());
    while let Some(ev) = s.events.blocking_recv() {
        match ev {
            Event::Logprobs(l) => out.push((
                l.token,
                l.logprob.to_bits(),
                l.top.iter().map(|(t, p)| (*t, p.to_bits())).collect(),
            )),
            Event::Done { cached: c, .. } => cached = c,
            _ => {}
        }
    }
    (out, cached)
}

fn run(e: &EngineHandle, p: &[u32]) -> (Bits, CachedTokens) {
    collect(&mut e.submit(p.to_vec(), params()).unwrap())
}

#[test]
fn a_q8_0_prefix_from_every_tier_gives_the_same_bits() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny32(d.path());
    let e = start(&path, Dtype::Q8_0, 64, Some(&d.path().join("l3")));
    let p = prompt(70, 5);
    let (cold, _) = run(&e, &p);
    assert_eq!(cold.len(), 8);
    let (dev, c) = run(&e, &p);
    assert_eq!(c.device, 64);
    e.flush(FlushScope::Device).unwrap();
    let (host, c) = run(&e, &p);
    assert_eq!((c.device, c.host), (0, 64));
    e.flush(FlushScope::All).unwrap();
    let (disk, c) = run(&e, &p);
    assert_eq!((c.device, c.host, c.storage), (0, 0, 64));
    assert_eq!(dev, host, "host tier");
    assert_eq!(dev, disk, "disk tier");
    e.shutdown(Duration::from_secs(5));
}

#[test]
fn q8_0_kv_moved_by_pd_continues_with_one_engines_bits() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny32(d.path());
    let single = start(&path, Dtype::Q8_0, 0, None);
    let prefill = start(&path, Dtype::Q8_0, 0, None);
    let decode = start(&path, Dtype::Q8_0, 0, None);
    let p = prompt(37, 2);
    let (want, _) = run(&single, &p);
    let (first, kv) = export_from(&prefill, &p, 0);
    assert_eq!(first, want[0].0);
    let mut s = decode
        .submit_prefilled(p.clone(), params(), imported(&kv, first))
        .unwrap();
    let (got, _) = collect(&mut s);
    // The first token's log-probabilities stay with the prefill worker (none were asked
    // for); every later one is the decode engine's, over the imported q8_0 pages.
    assert_eq!(got[..], want[1..]);
    for e in [single, prefill, decode] {
        e.shutdown(Duration::from_secs(5));
    }
}

#[test]
fn engines_of_different_kv_dtypes_refuse_each_others_transfers() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny32(d.path());
    let f16 = start(&path, Dtype::F16, 0, None);
    let q8 = start(&path, Dtype::Q8_0, 0, None);
    let (a, b) = (f16.info().hello(), q8.info().hello());
    assert_eq!(
        (a.model_id.as_str(), a.page_size),
        (b.model_id.as_str(), b.page_size)
    );
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let rx = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        handshake_accept(&mut s, &b, None).unwrap_err().to_string()
    });
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    let e = handshake_connect(&mut c, &a, None).unwrap_err().to_string();
    assert!(e.contains("layout"), "{e}");
    assert!(rx.join().unwrap().contains("layout"));
    for e in [f16, q8] {
        e.shutdown(Duration::from_secs(5));
    }
}
