//! Fuzzing GGUF loading (a bounded number of cases in the test suite): a valid tiny model (llama,
//! and DeepSeek-V4 through its own reader) with bytes flipped, 8-byte fields overwritten with
//! hostile lengths, or cut short always gives a model or an error, never a panic or an abort
//! (an allocation failure would abort the test process itself); a DeepSeek-V4 model that loads
//! computes a few tokens without a panic.

use proptest::prelude::*;
use strata_model::deepseek4::load::load_dsv4;
use strata_model::tiny::deepseek4::{write_tiny_dsv4, TinyDsv4Spec};
use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::{Gguf, Model};

fn valid() -> Vec<u8> {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.gguf");
    write_tiny(&p, &TinySpec::default()).unwrap();
    std::fs::read(p).unwrap()
}

fn open(bytes: &[u8]) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("f.gguf");
    std::fs::write(&p, bytes).unwrap();
    if let Ok(mut g) = Gguf::open(&p) {
        let _ = strata_model::ModelTokenizer::from_gguf(&g);
        let _ = Model::load(&mut g);
    }
    header_side(&p);
}

/// The header alone, as `strata serve` and `strata plan` read any architecture's.
fn header_side(p: &std::path::Path) {
    if let Ok(h) = strata_model::GgufHeader::open(p) {
        let _ = strata_model::ModelTokenizer::from_gguf(&h);
        let _ = h.chat_template();
    }
    let _ = strata_model::deepseek4::load::read_dsv4_config(p);
}

fn valid_dsv4() -> Vec<u8> {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.gguf");
    write_tiny_dsv4(&p, &TinyDsv4Spec::default()).unwrap();
    std::fs::read(p).unwrap()
}

fn open_dsv4(bytes: &[u8]) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("f.gguf");
    std::fs::write(&p, bytes).unwrap();
    header_side(&p);
    if let Ok(m) = load_dsv4(&p) {
        let mut st = m.new_state();
        for t in [1u32, 2, 3, 300] {
            let _ = m.step(&mut st, t);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn hostile_header_fields_never_abort(
        at in 0usize..6000,
        v in prop_oneof![Just(u64::MAX), Just(1u64 << 40), Just(1u64 << 32), Just(0u64), any::<u64>()],
    ) {
        let mut b = valid();
        let at = at.min(b.len().saturating_sub(8));
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        open(&b);
    }

    #[test]
    fn flipped_bytes_and_truncation_never_abort(
        flips in proptest::collection::vec((0usize..8000, any::<u8>()), 1..6),
        cut in proptest::option::of(0usize..20000),
    ) {
        let mut b = valid();
        for (at, x) in flips {
            let n = b.len();
            b[at % n] ^= x | 1;
        }
        if let Some(c) = cut {
            b.truncate(c.min(b.len()));
        }
        open(&b);
    }

    #[test]
    fn hostile_dsv4_headers_never_abort(
        at in 0usize..9000,
        v in prop_oneof![Just(u64::MAX), Just(1u64 << 40), Just(1u64 << 32), Just(0u64), any::<u64>()],
        cut in proptest::option::of(0usize..12000),
    ) {
        let mut b = valid_dsv4();
        let at = at.min(b.len().saturating_sub(8));
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        if let Some(c) = cut {
            b.truncate(c.min(b.len()));
        }
        open_dsv4(&b);
    }
}

/// The file with the u32 value of metadata key `key` replaced by `v`.
fn with_u32(key: &str, v: u32) -> Vec<u8> {
    patched(valid_dsv4(), key, 4, v.to_le_bytes())
}

/// `b` (a GGUF) with the 4-byte value of `key` (of GGUF type `ty`) replaced by `v`.
fn patched(mut b: Vec<u8>, key: &str, ty: u32, v: [u8; 4]) -> Vec<u8> {
    let k = key.as_bytes();
    let at = b
        .windows(k.len())
        .position(|w| w == k)
        .expect("the key is in the file")
        + k.len();
    assert_eq!(b[at..at + 4], ty.to_le_bytes(), "{key}'s type");
    b[at + 4..at + 8].copy_from_slice(&v);
    b
}

/// Values that would allocate per layer or divide by a zero size are refused, naming the key,
/// by the header-only reader `strata plan` uses and by the loader, before any allocation.
#[test]
fn hostile_dimensions_are_refused_by_name() {
    for (key, v, want) in [
        ("deepseek4.block_count", u32::MAX, "block_count"),
        ("deepseek4.block_count", 0, "block_count"),
        ("deepseek4.attention.key_length", 0, "attention.key_length"),
        (
            "deepseek4.attention.key_length",
            u32::MAX,
            "attention.key_length",
        ),
        ("deepseek4.attention.sliding_window", 0, "sliding_window"),
        ("deepseek4.context_length", 0, "context_length"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.gguf");
        std::fs::write(&p, with_u32(key, v)).unwrap();
        let e = strata_model::deepseek4::load::read_dsv4_config(&p)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{key} = {v}: {e}");
        let e = load_dsv4(&p).err().unwrap().to_string();
        assert!(e.contains(want), "{key} = {v}: {e}");
    }
}

fn valid_family(family: &str) -> Vec<u8> {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.gguf");
    let spec = strata_model::tiny::TinySpec::family(family).unwrap();
    strata_model::tiny::write_tiny(&p, &spec).unwrap();
    std::fs::read(p).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

    /// Qwen2's biases, Qwen3's head size and norms, Llama 3's frequency factors: hostile
    /// values in those headers are errors, never aborts.
    #[test]
    fn hostile_family_headers_never_abort(
        family in prop_oneof![Just("llama3"), Just("qwen2"), Just("qwen3")],
        at in 0usize..9000,
        v in prop_oneof![Just(u64::MAX), Just(1u64 << 40), Just(1u64 << 32), Just(0u64), any::<u64>()],
    ) {
        let mut b = valid_family(family);
        let at = at.min(b.len().saturating_sub(8));
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        open(&b);
    }
}

/// A tensor the pass would not read is refused by name, not ignored: a Qwen2 file relabelled
/// `llama` keeps its Q/K/V biases, which the llama pass has no use for.
#[test]
fn a_tensor_the_pass_would_not_read_is_refused() {
    let b = valid_family("qwen2");
    let relabelled = {
        let mut v = b.clone();
        let (from, to) = (b"qwen2", b"llama");
        let mut i = 0;
        while i + 5 <= v.len() {
            if &v[i..i + 5] == from {
                v[i..i + 5].copy_from_slice(to);
            }
            i += 1;
        }
        v
    };
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("f.gguf");
    std::fs::write(&p, relabelled).unwrap();
    let e = Gguf::open(&p).err().expect("refused").to_string();
    assert!(
        e.contains(".bias") && e.contains("refused rather than ignored"),
        "{e}"
    );
}

/// What is not a regular file is refused at once, by name: a FIFO (a read would wait for a
/// writer forever), a directory, a device.
#[test]
fn a_fifo_a_directory_or_a_device_is_refused_at_once() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("model.gguf");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) on a NUL-terminated path in this test's own directory.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for (p, want) in [
        (
            fifo.as_path(),
            "a FIFO, a socket or a device, not a regular file",
        ),
        (d.path(), "a directory, not a regular file"),
        (
            std::path::Path::new("/dev/zero"),
            "a FIFO, a socket or a device",
        ),
    ] {
        let e = Gguf::open(p).err().unwrap().to_string();
        assert!(e.contains(want), "{}: {e}", p.display());
        let e = strata_model::GgufHeader::open(p).err().unwrap().to_string();
        assert!(e.contains(want), "{}: {e}", p.display());
        let e = strata_model::deepseek4::load::read_dsv4_config(p)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(want), "{}: {e}", p.display());
    }
}

/// Numbers that would make every logit NaN, or a special token the vocabulary lacks, are
/// refused by name at load, not served as garbage.
#[test]
fn nonsense_numbers_and_special_tokens_are_refused_by_name() {
    const F32: u32 = 6;
    const U32: u32 = 4;
    for (key, ty, v, want) in [
        (
            "llama.rope.freq_base",
            F32,
            f32::NAN.to_le_bytes(),
            "rope.freq_base",
        ),
        (
            "llama.rope.freq_base",
            F32,
            0.5f32.to_le_bytes(),
            "rope.freq_base",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            F32,
            f32::INFINITY.to_le_bytes(),
            "layer_norm_rms_epsilon",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            F32,
            (-1f32).to_le_bytes(),
            "layer_norm_rms_epsilon",
        ),
        (
            "tokenizer.ggml.eos_token_id",
            U32,
            u32::MAX.to_le_bytes(),
            "eos_token_id 4294967295 is outside the vocabulary",
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.gguf");
        std::fs::write(&p, patched(valid(), key, ty, v)).unwrap();
        let g = Gguf::open(&p);
        let e = match g {
            Err(e) => e.to_string(),
            Ok(g) => strata_model::ModelTokenizer::from_gguf(&g)
                .err()
                .expect("refused")
                .to_string(),
        };
        assert!(e.contains(want), "{key}: {e}");
    }
}

/// A metadata key or a tensor name given twice is refused by name, by the loader and by the
/// header readers `strata serve` sizes with (keeping the last, as a map would, lets one file
/// say two things: which one a tool reads depends on the tool).
#[test]
fn a_key_or_a_tensor_given_twice_is_refused() {
    for (from, to, want) in [
        (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.bos_token_id",
            "metadata key `tokenizer.ggml.bos_token_id` appears twice",
        ),
        (
            "blk.0.attn_k.weight",
            "blk.0.attn_q.weight",
            "tensor `blk.0.attn_q.weight` appears twice",
        ),
    ] {
        let mut b = valid();
        let at = b
            .windows(from.len())
            .position(|w| w == from.as_bytes())
            .expect("the name is in the file");
        b[at..at + to.len()].copy_from_slice(to.as_bytes());
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.gguf");
        std::fs::write(&p, &b).unwrap();
        let e = Gguf::open(&p).err().expect("refused").to_string();
        assert!(e.contains(want), "{e}");
        let e = strata_model::GgufHeader::open(&p)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(want), "{e}");
        let e = strata_model::scratch::ModelShape::read(&p).unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
    }
}

/// `b` (a GGUF) with the data offset of tensor `name` replaced by `f(offset)`.
fn moved(mut b: Vec<u8>, name: &str, f: impl Fn(u64) -> u64) -> Vec<u8> {
    let n = name.as_bytes();
    let mut at = b
        .windows(n.len() + 8)
        .position(|w| w[8..] == *n && w[..8] == (n.len() as u64).to_le_bytes())
        .expect("the tensor is in the file")
        + 8
        + n.len();
    let dims = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
    at += 4 + 8 * dims + 4;
    let off = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    b[at..at + 8].copy_from_slice(&f(off).to_le_bytes());
    b
}

/// Tensor data that overlaps another tensor's, or does not start at a multiple of the
/// alignment, is refused by name (both were served as nonsense weights).
#[test]
fn overlapping_or_unaligned_tensor_data_is_refused() {
    let name = "blk.0.ffn_down.weight";
    for (b, dsv4, want) in [
        (moved(valid(), name, |_| 0), false, "overlaps"),
        (
            moved(valid(), name, |o| o + 1),
            false,
            "is not aligned to 32 bytes",
        ),
        (
            moved(valid_dsv4(), "output_norm.weight", |_| 0),
            true,
            "overlaps",
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.gguf");
        std::fs::write(&p, &b).unwrap();
        let e = match dsv4 {
            false => Gguf::open(&p).err().expect("refused").to_string(),
            true => load_dsv4(&p).err().expect("refused").to_string(),
        };
        assert!(e.contains(want), "{e}");
    }
}
