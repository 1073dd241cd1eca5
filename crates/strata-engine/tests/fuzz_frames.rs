//! Fuzzing the KV-transfer frame reader and the receiver (a bounded number of cases in the test
//! suite): arbitrary bytes are an error or a frame within the stated bound, never a panic or an
//! allocation past the bound; a receiver fed arbitrary frames ends with an error or a transfer
//! that satisfies every limit.

use proptest::prelude::*;
use strata_engine::transfer::{read_frame, recv_kv, write_frame, Admit, Frame, RecvLimits};

fn lim() -> RecvLimits {
    RecvLimits {
        page_bytes: 32,
        main_page_bytes: None,
        page_size: 4,
        max_tokens: 64,
    }
}

/// A duplex over in-memory bytes: reads from `input`, discards writes.
struct Mem<'a> {
    input: &'a [u8],
}
impl std::io::Read for Mem<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        std::io::Read::read(&mut self.input, buf)
    }
}
impl std::io::Write for Mem<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (
            any::<u128>(),
            proptest::collection::vec(any::<u32>(), 0..80),
            0u32..4,
            0u32..30
        )
            .prop_map(|(id, tokens, first, pages)| Frame::Begin {
                id,
                tokens,
                first,
                pages
            }),
        (
            any::<u128>(),
            0u32..30,
            proptest::collection::vec(any::<u8>(), 0..40)
        )
            .prop_map(|(id, index, data)| Frame::Page {
                id,
                index,
                hash: [0; 16],
                data
            }),
        any::<u128>().prop_map(|id| Frame::End { id }),
        (any::<u128>(), ".{0,20}").prop_map(|(id, reason)| Frame::Abort { id, reason }),
    ]
}

#[test]
fn hostile_corpus() {
    // Length prefixes: 0, below the minimum, the 256 MiB maximum of v1, u32::MAX.
    for len in [0u32, 16, 256 << 20, u32::MAX] {
        let mut b = len.to_le_bytes().to_vec();
        b.extend_from_slice(&[0u8; 64]);
        assert!(read_frame(&mut &b[..], 1 << 16).is_err(), "{len}");
    }
    // An unknown kind with a valid checksum.
    let mut body = vec![99u8, 1, 2, 3];
    let sum = xxhash_rust::xxh3::xxh3_128(&body).to_le_bytes();
    let mut b = ((body.len() + 16) as u32).to_le_bytes().to_vec();
    b.append(&mut body);
    b.extend_from_slice(&sum);
    assert!(read_frame(&mut &b[..], 1 << 16).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), max in 17usize..4096) {
        let mut r = &bytes[..];
        if let Ok(f) = read_frame(&mut r, max) {
            // Whatever decodes re-encodes within the bound it was read under.
            let mut out = Vec::new();
            write_frame(&mut out, &f).unwrap();
            prop_assert!(out.len() <= max + 4);
        }
    }

    #[test]
    fn a_receiver_fed_arbitrary_frames_never_breaks_a_limit(frames in proptest::collection::vec(arb_frame(), 1..8)) {
        let mut bytes = Vec::new();
        for f in &frames {
            write_frame(&mut bytes, f).unwrap();
        }
        let mut link = Mem { input: &bytes };
        if let Ok(r) = recv_kv(&mut link, &lim(), &mut |_, _, _| Admit::Yes) {
            let l = lim();
            prop_assert!(!r.tokens.is_empty() && r.tokens.len() <= l.max_tokens);
            prop_assert_eq!(
                r.first as usize + r.pages.len(),
                r.tokens.len().div_ceil(l.page_size as usize)
            );
            prop_assert!(r.pages.iter().all(|p| p.len() as u64 == l.page_bytes));
        }
    }
}
