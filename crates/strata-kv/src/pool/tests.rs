//! Byte-exactness of the pools and of the copies between them.
use super::*;
use crate::layout::PoolKind;
use crate::memory::HeapAllocator;

#[test]
fn streamed_large_copies_are_exact() {
    // Above the streaming threshold, with odd chunk sizes and offsets.
    let layout = Arc::new(
        PageLayout::new(
            7,
            vec![PoolKind::kv("kv", 5, 3, 1000, 2), PoolKind::aux("x", 3, 13)],
        )
        .unwrap(),
    );
    let n = 1 + (STREAM_MIN_BYTES / layout.page_bytes()) as u32;
    let dev = DevicePool::new(layout.clone(), n, &HeapAllocator).unwrap();
    let host = HostPool::new(layout.clone(), n, &HeapAllocator).unwrap();
    let mut v = 1u8;
    for p in 0..n {
        for c in layout.chunks() {
            let data: Vec<u8> = (0..c.bytes)
                .map(|_| {
                    v = v.wrapping_mul(31).wrapping_add(7);
                    v
                })
                .collect();
            dev.write_chunk(c.kind, c.layer, c.plane, p, &data);
        }
    }
    let pairs: Vec<(u32, u32)> = (0..n).map(|p| (p, n - 1 - p)).collect();
    copy_pages(&dev, &host, Direction::DeviceToHost, &pairs, &[]);
    let dev2 = DevicePool::new(layout.clone(), n, &HeapAllocator).unwrap();
    copy_pages(&dev2, &host, Direction::HostToDevice, &pairs, &[]);
    for p in 0..n {
        for c in layout.chunks() {
            let (mut a, mut b) = (vec![0; c.bytes], vec![0; c.bytes]);
            dev.read_chunk(c.kind, c.layer, c.plane, p, &mut a);
            dev2.read_chunk(c.kind, c.layer, c.plane, p, &mut b);
            assert_eq!(a, b);
        }
    }
}

#[test]
fn device_host_roundtrip_is_exact() {
    let layout = Arc::new(
        PageLayout::new(
            2,
            vec![PoolKind::kv("kv", 3, 1, 4, 2), PoolKind::aux("idx", 3, 5)],
        )
        .unwrap(),
    );
    let dev = DevicePool::new(layout.clone(), 4, &HeapAllocator).unwrap();
    let host = HostPool::new(layout.clone(), 4, &HeapAllocator).unwrap();
    let mut v = 0u8;
    for c in layout.chunks() {
        let data: Vec<u8> = (0..c.bytes)
            .map(|_| {
                v = v.wrapping_add(7);
                v
            })
            .collect();
        dev.write_chunk(c.kind, c.layer, c.plane, 1, &data);
    }
    let b = copy_pages(&dev, &host, Direction::DeviceToHost, &[(1, 3)], &[]);
    assert_eq!(b as usize, layout.page_bytes());
    copy_pages(&dev, &host, Direction::HostToDevice, &[(2, 3)], &[]);
    for c in layout.chunks() {
        let mut a = vec![0; c.bytes];
        let mut b = vec![0; c.bytes];
        dev.read_chunk(c.kind, c.layer, c.plane, 1, &mut a);
        dev.read_chunk(c.kind, c.layer, c.plane, 2, &mut b);
        assert_eq!(a, b);
    }
    // The host blob is the chunks in page-first order.
    let mut blob = vec![0; layout.page_bytes()];
    host.read_page(3, None, &mut blob);
    let c = layout.chunks()[4];
    let mut a = vec![0; c.bytes];
    dev.read_chunk(c.kind, c.layer, c.plane, 1, &mut a);
    assert_eq!(&blob[c.host_offset..c.host_offset + c.bytes], &a[..]);
}

fn fill(dev: &DevicePool, class: Class, page: u32, seed: u8) {
    let layout = dev.layout().clone();
    for c in layout.chunks().iter().filter(|c| c.class == class) {
        let data: Vec<u8> = (0..c.bytes)
            .map(|i| seed.wrapping_mul(13).wrapping_add(i as u8 ^ c.kind as u8))
            .collect();
        dev.write_chunk(c.kind, c.layer, c.plane, page, &data);
    }
}

#[test]
fn window_pages_are_a_page_space_of_their_own() {
    let layout = Arc::new(
        PageLayout::new(
            4,
            vec![
                PoolKind::aux("raw", 2, 12).with_window(8),
                PoolKind::aux("blocks", 2, 3),
            ],
        )
        .unwrap(),
    );
    // 6 main pages, 2 window pages on device; 3 and 1 on host.
    let dev = DevicePool::with_window(layout.clone(), 6, 2, &HeapAllocator).unwrap();
    let host = HostPool::with_window(layout.clone(), 3, 1, &HeapAllocator).unwrap();
    assert_eq!(
        dev.bytes(),
        6 * layout.class_bytes(Class::Main) + 2 * layout.class_bytes(Class::Window)
    );
    assert_eq!(
        host.bytes(),
        3 * layout.class_bytes(Class::Main) + layout.class_bytes(Class::Window)
    );
    fill(&dev, Class::Main, 5, 1);
    fill(&dev, Class::Window, 1, 2);
    // Main page 5 with window page 1 → host page 2 with host window page 0, and back into
    // main page 0 with window page 0.
    copy_pages(&dev, &host, Direction::DeviceToHost, &[(5, 2)], &[(1, 0)]);
    let mut a = vec![0; layout.page_bytes()];
    host.read_page(2, Some(0), &mut a);
    let mut b = vec![0; layout.page_bytes()];
    dev.read_page_host_layout(5, Some(1), &mut b);
    assert_eq!(a, b);
    copy_pages(&dev, &host, Direction::HostToDevice, &[(0, 2)], &[(0, 0)]);
    let mut c = vec![0; layout.page_bytes()];
    dev.read_page_host_layout(0, Some(0), &mut c);
    assert_eq!(a, c);
    // Without a window page a blob is the main part only.
    let mut m = vec![0; layout.class_bytes(Class::Main)];
    host.read_page(2, None, &mut m);
    assert_eq!(m, a[..m.len()]);
    dev.copy_page(Class::Window, 1, 0);
    dev.copy_page(Class::Main, 5, 3);
    dev.read_page_host_layout(3, Some(0), &mut c);
    assert_eq!(a, c);
}

#[test]
#[should_panic(expected = "out of range")]
fn a_window_page_beyond_the_window_pool_is_refused() {
    let layout = Arc::new(
        PageLayout::new(
            4,
            vec![
                PoolKind::aux("raw", 1, 4).with_window(8),
                PoolKind::aux("blocks", 1, 4),
            ],
        )
        .unwrap(),
    );
    let dev = DevicePool::with_window(layout, 6, 2, &HeapAllocator).unwrap();
    dev.write_token(0, 0, 0, 2, 0, &[0; 4]);
}

/// A host pool with each kind's part of the pages in its own region (a tensor-parallel rank's
/// on its node) holds the same blobs as a one-region pool: copies from and to the device pool,
/// and whole blobs read and written, are byte for byte the same.
#[test]
fn a_host_pool_split_by_kind_holds_the_same_blobs() {
    let layout = Arc::new(
        PageLayout::new(
            4,
            vec![
                PoolKind::kv("kv.tp0", 3, 2, 8, 2),
                PoolKind::kv("kv.tp1", 3, 1, 8, 2),
            ],
        )
        .unwrap(),
    );
    let n = 5;
    let dev = DevicePool::new(layout.clone(), n, &HeapAllocator).unwrap();
    let mut v = 3u8;
    for p in 0..n {
        for c in layout.chunks() {
            let data: Vec<u8> = (0..c.bytes)
                .map(|_| {
                    v = v.wrapping_mul(13).wrapping_add(5);
                    v
                })
                .collect();
            dev.write_chunk(c.kind, c.layer, c.plane, p, &data);
        }
    }
    let (a0, a1) = (HeapAllocator, HeapAllocator);
    let allocs: [&dyn HostAllocator; 2] = [&a0, &a1];
    let split = HostPool::with_allocators(layout.clone(), n, 0, &|k| allocs[k]).unwrap();
    let one = HostPool::new(layout.clone(), n, &HeapAllocator).unwrap();
    assert_eq!(split.regions().count(), 2);
    assert_eq!(split.bytes(), one.bytes());
    let pairs: Vec<(u32, u32)> = (0..n).map(|p| (p, (p + 2) % n)).collect();
    for h in [&split, &one] {
        copy_pages(&dev, h, Direction::DeviceToHost, &pairs, &[]);
    }
    let len = layout.page_bytes();
    let mut blobs = Vec::new();
    for p in 0..n {
        let (mut a, mut b) = (vec![0; len], vec![0; len]);
        split.read_page(p, None, &mut a);
        one.read_page(p, None, &mut b);
        assert_eq!(a, b, "page {p}");
        blobs.push(a);
    }
    // Written back whole, each into the next page, then loaded back to the device.
    for (p, a) in blobs.iter().enumerate() {
        split.write_page((p as u32 + 1) % n, None, a);
    }
    let dev2 = DevicePool::new(layout.clone(), n, &HeapAllocator).unwrap();
    let back: Vec<(u32, u32)> = (0..n).map(|p| (p, (p + 3) % n)).collect();
    copy_pages(&dev2, &split, Direction::HostToDevice, &back, &[]);
    for p in 0..n {
        let mut want = vec![0; len];
        dev.read_page_host_layout(p, None, &mut want);
        let mut got = vec![0; len];
        dev2.read_page_host_layout(p, None, &mut got);
        assert_eq!(got, want, "device page {p} after the round trip");
    }
}
