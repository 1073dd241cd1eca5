//! Hot paths of the cache core. Figures and the exact command are in docs/BENCHMARKS.md.
//!
//! * match_prefix / insert of an 8K-token prompt in a tree holding 1M tokens (page 16);
//! * eviction of 10K pages;
//! * churn at page size 1 with 200K leaves: one new leaf in, the policy's victim out;
//! * device↔host copy of 64 MiB next to a plain memcpy of the same size and a contiguous
//!   streaming copy;
//! * the miss-ratio-curve sampler: one page reference (`mrc::Shards::access`), sampled at its
//!   budget or not.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::{copy_pages, copy_slice_streaming, DevicePool, Direction, HostPool};
use strata_kv::{CacheConfig, EvictionPolicy, PageLayout, PoolKind, TieredCache, WritePolicy};

const PAGE: usize = 16;
const PROMPT: usize = 8192;
const TREE_TOKENS: usize = 1 << 20;

fn rng(seed: &mut u64) -> u32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    (*seed % 49152) as u32
}

fn prompt(seed: u64, shared: &[u32]) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = shared.to_vec();
    while v.len() < PROMPT {
        v.push(rng(&mut s));
    }
    v
}

fn layout() -> PageLayout {
    PageLayout::new(PAGE, vec![PoolKind::kv("kv", 30, 3, 64, 2)]).unwrap()
}

/// A metadata-only cache holding ~1M tokens: 128 prompts of 8K tokens; every 4th shares a
/// 2K-token system prompt so the tree has inner nodes.
fn big_cache(policy: EvictionPolicy) -> (TieredCache, Vec<Vec<u32>>) {
    let mut cfg = CacheConfig::new(layout(), (TREE_TOKENS / PAGE * 2) as u32, 0);
    cfg.with_data = false;
    cfg.eviction = policy;
    cfg.write_policy = WritePolicy::WriteThroughSelective {
        threshold: u32::MAX,
    };
    let mut c = TieredCache::new(cfg, &HeapAllocator, None).unwrap();
    let system: Vec<u32> = prompt(7, &[])[..2048].to_vec();
    let mut prompts = Vec::new();
    for i in 0..(TREE_TOKENS / PROMPT) as u64 {
        let p = if i % 4 == 0 {
            prompt(i + 100, &system)
        } else {
            prompt(i + 100, &[])
        };
        let m = c.match_prefix(&p);
        let skip = m.device_tokens / PAGE;
        let pages = c.alloc_device(PROMPT / PAGE - skip).unwrap();
        c.insert(&p, &pages, skip);
        prompts.push(p);
    }
    (c, prompts)
}

fn bench_tree(c: &mut Criterion) {
    let mut g = c.benchmark_group("tree_1M_tokens");
    g.throughput(Throughput::Elements(PROMPT as u64));
    for policy in EvictionPolicy::ALL {
        let (mut cache, prompts) = big_cache(policy);
        let target = prompts[5].clone();
        g.bench_function(BenchmarkId::new("match_prefix_8k", policy.name()), |b| {
            b.iter(|| black_box(cache.match_prefix(black_box(&target)).device_tokens))
        });
        // Insert fresh 8K prompts; the pages are handed back afterwards (outside the timing).
        g.bench_function(BenchmarkId::new("insert_8k", policy.name()), |b| {
            let mut seed = 1_000_000u64;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    seed += 1;
                    let p = prompt(seed, &[]);
                    let pages = cache.alloc_device(PROMPT / PAGE).unwrap();
                    let t = Instant::now();
                    let ins = cache.insert(black_box(&p), &pages, 0);
                    total += t.elapsed();
                    black_box(&ins);
                    cache.evict_device(PROMPT / PAGE);
                }
                total
            })
        });
    }
    g.finish();
}

fn bench_evict(c: &mut Criterion) {
    let mut g = c.benchmark_group("evict");
    g.throughput(Throughput::Elements(10_000));
    for policy in EvictionPolicy::ALL {
        g.bench_function(BenchmarkId::new("10k_pages", policy.name()), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for it in 0..iters {
                    let mut cfg = CacheConfig::new(layout(), 10_000, 0);
                    cfg.with_data = false;
                    cfg.eviction = policy;
                    cfg.write_policy = WritePolicy::WriteThroughSelective {
                        threshold: u32::MAX,
                    };
                    let mut cache = TieredCache::new(cfg, &HeapAllocator, None).unwrap();
                    // 1,000 leaves of 10 pages under 100 shared parents.
                    let mut s = it + 1;
                    for i in 0..1000u32 {
                        let mut t: Vec<u32> = vec![i / 10; PAGE];
                        t.extend((0..9 * PAGE).map(|_| rng(&mut s)));
                        let m = cache.match_prefix(&t);
                        let skip = m.device_tokens / PAGE;
                        let pages = cache.alloc_device(10 - skip).unwrap();
                        cache.insert(&t, &pages, skip);
                    }
                    let used = cache.device_usage().pages_used as usize;
                    let t = Instant::now();
                    let n = cache.evict_device(used);
                    total += t.elapsed();
                    assert_eq!(n, used);
                }
                total
            })
        });
    }
    g.finish();
}

/// Page size 1 at scale: a metadata-only cache full with 200,000 leaves of two tokens under
/// 2,000 one-token parents, so that the eviction sets hold 200,000 keys; each step adds a new
/// leaf, the policy evicting one to make room (admission and eviction, as a server at page
/// size 1 with a large pool does them).
fn bench_churn(c: &mut Criterion) {
    const LEAVES: u64 = 200_000;
    let mut g = c.benchmark_group("churn_page1_200k_leaves");
    g.throughput(Throughput::Elements(1));
    let leaf = |i: u64| {
        [
            (i % 2_000) as u32,
            10_000 + (i % 40_000) as u32,
            (i / 40_000) as u32,
        ]
    };
    let step = |cache: &mut TieredCache, i: u64| {
        let t = leaf(i);
        let m = cache.match_prefix(&t);
        let pages = cache.alloc_device(3 - m.device_tokens).unwrap();
        cache.insert(&t, &pages, m.device_tokens);
    };
    for policy in [EvictionPolicy::Lru, EvictionPolicy::Auto] {
        let layout = PageLayout::new(1, vec![PoolKind::kv("kv", 30, 3, 64, 2)]).unwrap();
        let mut cfg = CacheConfig::new(layout, (2 * LEAVES + 2_000) as u32, 0);
        cfg.with_data = false;
        cfg.eviction = policy;
        cfg.write_policy = WritePolicy::WriteThroughSelective {
            threshold: u32::MAX,
        };
        let mut cache = TieredCache::new(cfg, &HeapAllocator, None).unwrap();
        for i in 0..LEAVES {
            step(&mut cache, i);
        }
        let mut i = LEAVES;
        g.bench_function(BenchmarkId::new("insert_evict", policy.name()), |b| {
            b.iter(|| {
                i += 1;
                step(&mut cache, black_box(i));
            })
        });
    }
    g.finish();
}

fn bench_copy(c: &mut Criterion) {
    let layout = Arc::new(layout());
    let pages = ((64usize << 20) / layout.page_bytes()) as u32; // 182 pages ≈ 64 MiB
    let bytes = pages as usize * layout.page_bytes();
    let dev = DevicePool::new(layout.clone(), pages, &HeapAllocator).unwrap();
    let host = HostPool::new(layout.clone(), pages, &HeapAllocator).unwrap();
    let pairs: Vec<(u32, u32)> = (0..pages).map(|p| (p, pages - 1 - p)).collect();
    let mut g = c.benchmark_group("copy_64MiB");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.sample_size(20);
    g.bench_function("device_to_host", |b| {
        b.iter(|| copy_pages(&dev, &host, Direction::DeviceToHost, black_box(&pairs), &[]))
    });
    g.bench_function("host_to_device", |b| {
        b.iter(|| copy_pages(&dev, &host, Direction::HostToDevice, black_box(&pairs), &[]))
    });
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    g.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    // The same bytes, contiguous, with the streaming stores copy_pages uses: the layout's cost.
    g.bench_function("streaming_contiguous", |b| {
        b.iter(|| copy_slice_streaming(black_box(&src), &mut dst))
    });
    g.finish();
}

fn bench_mrc(c: &mut Criterion) {
    let mut s = strata_kv::mrc::Shards::new(65536, 1.0, [7; 32]);
    let page = |i: u64| {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(&strata_kv::rng::mix(i % 400_000).to_le_bytes());
        strata_kv::PageHash(h)
    };
    // Past the budget: the rate has fallen to where a steady stream keeps it.
    for i in 0..2_000_000 {
        s.access(&page(i));
    }
    let mut g = c.benchmark_group("mrc");
    g.throughput(Throughput::Elements(1000));
    let mut i = 0u64;
    g.bench_function("access_1000_pages", |b| {
        b.iter(|| {
            for _ in 0..1000 {
                i += 1;
                s.access(black_box(&page(i)));
            }
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = bench_tree, bench_evict, bench_churn, bench_copy, bench_mrc
}
criterion_main!(benches);
