//! DeepSeek-V4's paged forward pass (the one the engine runs) against the reference
//! (`Dsv4::step`, itself matched to llama.cpp in dsv4_reference.rs): the same bits for every
//! token whatever the page size, the chunking, the batch, the order of the pages in the pool, and
//! after a prefix's pages moved through the host layout (the form pages take in every other tier).

use std::sync::Arc;

use strata_kv::memory::HeapAllocator;
use strata_kv::pool::{blob_len, DevicePool};
use strata_kv::{PageLayout, NO_PAGE};
use strata_model::deepseek4::load::load_dsv4;
use strata_model::deepseek4::Dsv4;
use strata_model::tiny::deepseek4::{write_tiny_dsv4, TinyDsv4Spec};
use strata_model::SeqInput;

fn model() -> Dsv4 {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("tiny-dsv4.gguf");
    write_tiny_dsv4(&path, &TinyDsv4Spec::default()).unwrap();
    load_dsv4(&path).unwrap()
}

fn pool(m: &Dsv4, ps: usize, pages: u32) -> DevicePool {
    let layout = Arc::new(PageLayout::new(ps, m.pool_kinds(ps).unwrap()).unwrap());
    DevicePool::new(layout, pages, &HeapAllocator).unwrap()
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + 11 + seed * 101) % 280)
        .collect()
}

/// Every token's logits from the reference, one after another.
fn reference(m: &Dsv4, toks: &[u32]) -> Vec<Vec<f32>> {
    let mut st = m.new_state();
    toks.iter().map(|&t| m.step(&mut st, t).unwrap()).collect()
}

/// Every token's logits from the paged pass, `toks` computed in chunks of `chunk` tokens.
fn paged(
    m: &Dsv4,
    pool: &DevicePool,
    (pages, windows): (&[u32], &[u32]),
    toks: &[u32],
    chunk: usize,
) -> Vec<f32> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < toks.len() {
        let n = chunk.min(toks.len() - at);
        let seq = SeqInput {
            tokens: &toks[at..at + n],
            pos: at,
            pages,
            windows,
            decode: false,
        };
        out.extend(m.forward_rows(pool, &[seq], &[true]).unwrap().remove(0));
        at += n;
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn every_page_size_and_chunking_gives_the_references_bits() {
    let m = model();
    // 300 tokens cross the window (32), many 4-blocks and two 128-blocks.
    let toks = prompt(300, 0);
    let want: Vec<f32> = reference(&m, &toks).concat();
    for (ps, chunks) in [
        (4, &[300][..]),
        (16, &[1, 7, 300]),
        (64, &[33]),
        (256, &[128, 5]),
    ] {
        let n_pages = 300usize.div_ceil(ps) as u32;
        let pool = pool(&m, ps, n_pages + 3);
        // Pages in a scrambled order, window pages in another: the pass must follow both.
        let pages: Vec<u32> = (0..n_pages).map(|i| (i * 7 + 2) % (n_pages + 3)).collect();
        let windows: Vec<u32> = (0..n_pages).rev().collect();
        for &c in chunks {
            let got = paged(&m, &pool, (&pages, &windows), &toks, c);
            assert!(bits(&got) == bits(&want), "page size {ps}, chunks of {c}");
        }
    }
}

#[test]
fn a_batch_gives_each_sequence_its_own_logits() {
    let m = model();
    let (a, b) = (prompt(150, 1), prompt(133, 2));
    let pool = pool(&m, 16, 40);
    let pa: Vec<u32> = (0..10).collect();
    let pb: Vec<u32> = (20..29).collect();
    let seqs = [
        SeqInput {
            tokens: &a,
            pos: 0,
            pages: &pa,
            windows: &pa,
            decode: false,
        },
        SeqInput {
            tokens: &b,
            pos: 0,
            pages: &pb,
            windows: &pb,
            decode: false,
        },
    ];
    let out = m.forward_rows(&pool, &seqs, &[false, true]).unwrap();
    assert_eq!(bits(&out[0]), bits(reference(&m, &a).last().unwrap()));
    assert_eq!(bits(&out[1]), bits(&reference(&m, &b).concat()));
}

/// A prefix's pages copied out in the host layout and into other device pages (what a host,
/// disk, Redis or PD hit does) continue exactly, for prefixes ending before, on and after the
/// window and block boundaries — with window state only for the pages covering the layout's
/// window before the hit (the rest of the prefix keeps its main kinds alone, as after window
/// eviction): the window kinds' stated windows are all a continuation reads.
#[test]
fn a_prefix_moved_through_the_host_layout_resumes_exactly() {
    let m = model();
    let toks = prompt(300, 3);
    let want = reference(&m, &toks);
    let ps = 4;
    let layout = Arc::new(PageLayout::new(ps, m.pool_kinds(ps).unwrap()).unwrap());
    let w = layout.window_tokens();
    assert_eq!(w, 128, "the open 128-block's rows are the widest window");
    let pool = DevicePool::with_window(layout.clone(), 150, 150, &HeapAllocator).unwrap();
    let first: Vec<u32> = (0..75).collect();
    paged(&m, &pool, (&first, &first), &toks, 300);
    let mut blob = vec![0u8; layout.page_bytes()];
    let zeros = vec![0u8; layout.page_bytes()];
    for hit in [28, 32, 36, 124, 128, 132, 252, 256, 260] {
        let span_from = (hit - w.min(hit)) / ps;
        let moved: Vec<u32> = (75..150).collect();
        let moved_w: Vec<u32> = (0..75)
            .map(|i| {
                if i < span_from {
                    NO_PAGE
                } else {
                    75 + i as u32
                }
            })
            .collect();
        // Nothing left from the previous hit: a read before its write would see zeros.
        for (&p, &wp) in moved.iter().zip(&moved_w) {
            let wp = (wp != NO_PAGE).then_some(wp);
            pool.write_page_host_layout(p, wp, &zeros[..blob_len(&layout, wp)]);
        }
        for (i, (&src, &dst)) in first.iter().zip(&moved).take(hit / ps).enumerate() {
            let (sw, dw) = if i < span_from {
                (None, None)
            } else {
                (Some(src), Some(moved_w[i]))
            };
            let blob = &mut blob[..blob_len(&layout, sw)];
            pool.read_page_host_layout(src, sw, blob);
            pool.write_page_host_layout(dst, dw, blob);
        }
        let rest = &toks[hit..];
        let seq = SeqInput {
            tokens: rest,
            pos: hit,
            pages: &moved,
            windows: &moved_w,
            decode: false,
        };
        let got = m.forward_rows(&pool, &[seq], &[true]).unwrap().remove(0);
        assert!(
            bits(&got) == bits(&want[hit..].concat()),
            "a hit of {hit} tokens"
        );
        // One page short of the window is refused by name, not read.
        if span_from > 0 {
            let mut short = moved_w.clone();
            short[span_from] = NO_PAGE;
            let seq = SeqInput {
                windows: &short,
                ..seq
            };
            let e = m.forward_rows(&pool, &[seq], &[false]).unwrap_err();
            assert!(e.to_string().contains("has no window page"), "{e}");
        }
    }
}

#[test]
fn page_sizes_that_split_a_block_are_refused() {
    let m = model();
    for ps in [0, 2, 6, 12, 96, 200] {
        let e = m.pool_kinds(ps).unwrap_err().to_string();
        assert!(e.contains("--page-size"), "{ps}: {e}");
    }
    for ps in [4, 8, 16, 32, 64, 128, 256, 512] {
        assert!(m.pool_kinds(ps).is_ok(), "{ps}");
    }
    // A pool of another layout is refused, not misread.
    let other = pool(&m, 16, 4);
    let kinds = m.pool_kinds(8).unwrap();
    let wrong = DevicePool::new(
        Arc::new(PageLayout::new(16, kinds).unwrap()),
        4,
        &HeapAllocator,
    )
    .unwrap();
    let seq = SeqInput {
        tokens: &[1, 2],
        pos: 0,
        pages: &[0],
        windows: &[0],
        decode: false,
    };
    assert!(m.forward_rows(&other, &[seq], &[false]).is_ok());
    assert!(m.forward_rows(&wrong, &[seq], &[false]).is_err());
    // Tokens past the pages, the context or the vocabulary are errors.
    let over = SeqInput {
        tokens: &[1; 17],
        ..seq
    };
    assert!(m.forward_rows(&other, &[over], &[false]).is_err());
    let past_context = SeqInput {
        tokens: &[1; 8],
        pos: 1020,
        ..seq
    };
    let e = m
        .forward_rows(&other, &[past_context], &[false])
        .unwrap_err();
    assert!(
        e.to_string().contains("exceed the context length 1024"),
        "{e}"
    );
    // Two sequences writing one page (they run in parallel) are refused.
    let e = m
        .forward_rows(&other, &[seq, seq], &[false, false])
        .unwrap_err();
    assert!(e.to_string().contains("both write page 0"), "{e}");
    let bad = SeqInput {
        tokens: &[9999],
        ..seq
    };
    assert!(m.forward_rows(&other, &[bad], &[false]).is_err());
}
