//! `strata up` knows its own processes and gives each deployment its own key: a port another
//! process holds stops `up` before anything starts (exit 2, naming the port and the holder),
//! never "healthy"; two deployments on one host (every port 0) get two keys, and a worker of
//! one refuses K/V from the other.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};

use strata_model::tiny::{write_tiny, TinySpec};
use strata_test_support::up::Up;

/// `strata up` with the deployment described by `toml`, its state under `dir`.
fn up(dir: &Path, model: &Path, toml: &str) -> Up {
    let cfg = dir.join("up.toml");
    std::fs::write(&cfg, toml).unwrap();
    let exe = env!("CARGO_BIN_EXE_strata");
    Up::start(exe, &cfg, model, &dir.join("state"), &[])
}

fn tiny(dir: &Path) -> PathBuf {
    let model = dir.join("tiny.gguf");
    write_tiny(&model, &TinySpec::default()).unwrap();
    model
}

#[test]
fn a_taken_port_stops_up_before_anything_starts_naming_the_port_and_its_holder() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let squat = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squat.local_addr().unwrap().port();
    let toml = format!(
        "host = \"127.0.0.1\"\n[router]\nport = 0\n[[prefill]]\nport = {port}\n\
         args = [\"--device-mem\", \"16MiB\"]\n[[decode]]\nport = 0\nargs = [\"--device-mem\", \"16MiB\"]\n"
    );
    let mut up = up(d.path(), &model, &toml);
    let status = up.wait_exit(30);
    let text = up.drain(200);
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(text.contains(&format!("port {port} (prefill-0)")), "{text}");
    assert!(
        text.contains(&format!("pid {}", std::process::id())),
        "the holder is not named: {text}"
    );
    assert!(!text.contains("healthy"), "{text}");
    assert!(!text.contains("starting"), "something started: {text}");
}

/// One decode-only deployment, every port 0; its key file and its KV-transfer address.
fn deployment(dir: &Path, model: &Path) -> (Up, PathBuf, String) {
    let toml = "host = \"127.0.0.1\"\nsmoke_test = false\n[router]\nport = 0\n[[decode]]\n\
                port = 0\nargs = [\"--device-mem\", \"16MiB\", \"--hicache-size\", \"16MiB\"]\n";
    let mut up = up(dir, model, toml);
    let kv = up.wait_for("[decode-0] strata serve: KV-transfer listener on ", 60);
    let kv = kv
        .split("listener on ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    up.wait_for("strata up: ready", 60);
    let key = up.wait_for("cluster key: ", 10);
    let key = PathBuf::from(key.split("cluster key: ").nth(1).unwrap().trim());
    (up, key, kv)
}

#[test]
fn two_deployments_have_two_keys_and_refuse_each_others_kv() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let (da, db) = (d.path().join("a"), d.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let (_a, key_a, _) = deployment(&da, &model);
    let (_b, key_b, kv_b) = deployment(&db, &model);
    assert_ne!(key_a, key_b);
    let (ka, kb) = (
        std::fs::read_to_string(&key_a).unwrap(),
        std::fs::read_to_string(&key_b).unwrap(),
    );
    assert_ne!(ka, kb, "two deployments share a key");
    // A's key at B's KV port: the sender sees that B cannot prove A's key...
    let ka = strata_kv::auth::ClusterKey::from_file(&key_a).unwrap();
    let kb = strata_kv::auth::ClusterKey::from_file(&key_b).unwrap();
    let mut c = TcpStream::connect(&kv_b).unwrap();
    let e = strata_engine::transfer::handshake_connect(&mut c, &hello(), Some(&ka)).unwrap_err();
    assert!(e.to_string().contains("did not prove"), "{e}");
    // ...and B refuses a sender that goes on with A's key: no K/V of A's is taken.
    let e = sender_proving_with(&kv_b, &ka);
    assert!(e.contains("authentication failed"), "{e}");
    // The same handshake with B's own key passes authentication (only the made-up format
    // differs): the refusal above is the key's.
    let e = sender_proving_with(&kv_b, &kb);
    assert!(e.contains("differ in"), "{e}");
}

fn hello() -> strata_engine::transfer::Hello {
    strata_engine::transfer::Hello {
        model_id: "x".into(),
        page_size: 16,
        page_bytes: 1,
        layout: "y".into(),
    }
}

/// A sender that does not check the receiver's proof and proves itself with `key`, as a
/// worker of another deployment would: the receiver's refusal.
fn sender_proving_with(addr: &str, key: &strata_kv::auth::ClusterKey) -> String {
    use strata_engine::transfer::{read_frame, write_frame, Frame, HANDSHAKE_MAX_FRAME};
    let mut c = TcpStream::connect(addr).unwrap();
    let mine = [7u8; 16];
    let h = hello();
    write_frame(
        &mut c,
        &Frame::Hello {
            hello: h.clone(),
            nonce: mine,
        },
    )
    .unwrap();
    let Frame::Challenge { nonce: theirs, .. } = read_frame(&mut c, HANDSHAKE_MAX_FRAME).unwrap()
    else {
        panic!("no challenge");
    };
    // The hello's fields as they travel (transfer::hello_bytes).
    let mut hb = Vec::new();
    {
        let s = &h.model_id;
        hb.extend_from_slice(&(s.len() as u32).to_le_bytes());
        hb.extend_from_slice(s.as_bytes());
    }
    hb.extend_from_slice(&h.page_size.to_le_bytes());
    hb.extend_from_slice(&h.page_bytes.to_le_bytes());
    hb.extend_from_slice(&(h.layout.len() as u32).to_le_bytes());
    hb.extend_from_slice(h.layout.as_bytes());
    let proof = key.mac("strata kv-transfer sender v2", &[&theirs, &mine, &hb]);
    write_frame(&mut c, &Frame::Proof { proof }).unwrap();
    match read_frame(&mut c, HANDSHAKE_MAX_FRAME) {
        Ok(Frame::Refuse(r)) => r,
        other => panic!("not refused: {other:?}"),
    }
}
